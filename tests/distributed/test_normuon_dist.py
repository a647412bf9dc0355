"""NorMuon (``Muon(normuon=True)``) where each rank holds whole matrices: a tiny MoE model with
its dense matrices dedicated (owner DTensors) and its expert stacks left to FSDP2 (``Shard(0)``:
whole experts on each rank) trains equal to one process, each second moment a DTensor of its
parameter's mesh and placements; a DCP checkpoint of the 2 ranks loads into one process with
the same second moments.

Control: one process without NorMuon ends elsewhere, so the comparison sees the normalisation.
Everything in fp32; tolerances as in test_dedicated_training.py (only reduction orders differ).
"""

from __future__ import annotations

import pytest
import torch

from . import moe_models
from .harness import full_state, run_ranks, train_steps, whole_tensor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS = 3
HYPER = {"lr": 0.02, "momentum": 0.95, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}
KEY = "normuon_second_moment"
DENSE, STACK = "layers.0.proj.weight", "layers.0.experts.w1"


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _loss(model, x):
    return (model(x) - 0.5).square().mean()


def _moments(opt) -> dict:
    """``{name: second moment}`` of every Muon matrix, whole (collective for FSDP2's shards;
    a dedicated weight's from its owner only: the other ranks' pieces are empty)."""
    from torch.distributed.tensor import DTensor

    from dmuon_compile.distributed._owner.tensor import is_owned, local_of

    out = {}
    for p, state in opt.state.items():
        v = state.get(KEY)
        if v is None or (is_owned(v) and not local_of(v).numel()):
            continue
        whole = local_of(v) if is_owned(v) else whole_tensor(v) if isinstance(v, DTensor) else v
        out[opt.param_name(p)] = whole.detach().cpu().clone()
    return out


def _reference(normuon: bool):
    import dmuon_compile as dmuon

    model = moe_models.build_moe()
    opt = dmuon.Muon(model, ns_backend=_ns(), normuon=normuon, **HYPER)
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, 2)
    losses = train_steps(model, opt, batches, loss_fn=_loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, _moments(opt)


def _train_and_save(rank: int, world: int, path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._owner.tensor import is_owned

    model = moe_models.build_moe()
    mesh = init_device_mesh("cpu", (world,))
    owners = dmuon.dedicate_params(model, mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), normuon=True, **HYPER)
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses = train_steps(model, opt, batches, rank, world, loss_fn=_loss)
    dense, stack = model.layers[0].proj.weight, model.layers[0].experts.w1
    v_dense, v_stack = opt.state[dense][KEY], opt.state[stack][KEY]
    placed = (
        is_owned(v_dense)
        and isinstance(v_stack, DTensor)
        and not is_owned(v_stack)
        and tuple(v_stack.placements) == tuple(stack.placements)
    )
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    weights = {k: v.detach().cpu().clone() for k, v in full_state(model).items()}
    return losses, weights, _moments(opt), placed, sorted(owners)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("normuon") / "ckpt")
    return path, run_ranks(_train_and_save, 2, path)


def test_owners_and_expert_stacks_train_equal_to_one_process(trained):
    _, results = trained
    ref_losses, ref_weights, ref_moments = _reference(True)
    losses, weights, _, placed, owners = results[0]
    assert placed and results[1][3]  # the second moments live where their parameters do
    assert DENSE in owners and STACK not in owners  # dedicated / left to FSDP2
    moments = {**results[0][2], **results[1][2]}
    assert sorted(moments) == sorted(ref_moments) and STACK in moments
    assert moments[STACK].shape == (*ref_weights[STACK].shape[:2], 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=2e-4, rtol=0, msg=name)
    for name, ref in ref_moments.items():
        torch.testing.assert_close(moments[name], ref, rtol=1e-3, atol=1e-7, msg=name)
    _, plain, _ = _reference(False)  # control: without NorMuon the run ends elsewhere
    gap = max((plain[n] - weights[n]).abs().max() for n in (DENSE, STACK))
    assert gap > 10 * 2e-4, gap


def test_a_dcp_checkpoint_of_two_ranks_loads_into_one_process(trained):
    """Saved by two ranks (the owners' tensors, FSDP2's shards of the stacks), loaded into a
    plain model in this process: every second moment as it was."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dmuon_compile as dmuon

    path, results = trained
    model = moe_models.build_moe(seed=5)
    opt = dmuon.Muon(model, ns_backend=_ns(), normuon=True, **HYPER)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = {**results[0][2], **results[1][2]}
    loaded = _moments(opt)
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
        assert loaded[name].abs().sum() > 0, name  # not the zeros the load started from
