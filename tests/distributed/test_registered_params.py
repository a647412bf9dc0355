"""Dedicated weights are registered parameters: what PyTorch sees, reads between steps, DCP.

Each distributed result is compared with one process running the same model and batches.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import local_device, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

GLOBAL_BATCH = 4  # samples per step, split over the data-parallel ranks


def _build(world: int, mesh_shape: tuple[int, ...], seed: int = 0, device: str = "cpu"):
    """The test Llama with its ``*_proj`` weights dedicated and FSDP2 on the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    model = models.build_llama(seed=seed).to(local_device(device))
    if len(mesh_shape) == 2:
        mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(
            model, mesh["shard"], predicate=models.proj_predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh(device, (world,))
        dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _global_loss(model, x, rank: int, world: int) -> float:
    """Forward + backward on this rank's slice; returns the loss of the whole batch."""
    import torch.distributed as dist

    per = x.shape[0] // world
    device = next(model.parameters()).device  # the batch goes where the model is
    loss = model(x[rank * per : (rank + 1) * per].to(device)).square().mean()
    loss.backward()
    value = loss.detach().clone()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(value)
        value /= world
    return float(value)


def _batches(steps: int, seed: int = 123):
    return models.batches(steps, GLOBAL_BATCH, per_rank=1, seed=seed)


def _opt(model):
    import dmuon_compile as dmuon

    return dmuon.Muon(model, lr=0.02, compile=False, predicate=models.proj_predicate, adamw_lr=1e-2)


# ---------------------------------------------------------------------------------- what is seen
def _seen(rank, world):
    from torch.distributed.tensor import DTensor

    import dmuon_compile as dmuon

    model = _build(world, (world,))
    names = [n for n, _ in model.named_parameters()]
    numel = sum(p.numel() for p in model.parameters())
    keys = sorted(model.state_dict())
    runtime = dmuon.distributed.dedicated_runtime(model)
    fsdp_params = set()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if callable(state):
            for group in getattr(state(), "_fsdp_param_groups", None) or [
                state()._fsdp_param_group
            ]:
                if group is not None:
                    fsdp_params.update(id(fp.sharded_param) for fp in group.fsdp_params)
    sharded_by_fsdp = [dp.fqn for dp in runtime.params if id(dp.param) in fsdp_params]
    registered = all(dict(model.named_parameters())[dp.fqn] is dp.param for dp in runtime.params)
    opt = _opt(model)
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    x = _batches(2)
    for xb in x:
        _global_loss(model, xb, rank, world)
        opt.step()
        opt.zero_grad()
    # reads between steps
    w = model.layers[0].mlp.up_proj.weight
    read = {
        "is_dtensor": isinstance(w, DTensor),
        "local_numel": w.to_local().numel(),
        "full": dmuon.full_tensor(w),  # collective: the weight on every rank
        "full_method": w.full_tensor(),  # the DTensor method, collective too
        "sum": float(dmuon.full_tensor(w.sum())),  # a reduction on the DTensor itself
    }
    snapshot = dmuon.get_model_state_dict(model, cpu_offload=False)
    before = {k: v.clone() for k, v in snapshot.items()}
    _global_loss(model, x[0], rank, world)
    opt.step()
    snapshot_unchanged = all(torch.equal(before[k], snapshot[k]) for k in snapshot)
    weights_moved = not torch.equal(dmuon.full_tensor(w), read["full"])
    # conversions
    try:
        model.to(torch.float64)
        to_error = None
    except RuntimeError as exc:
        to_error = str(exc)
    model.to(torch.float32)  # no change: allowed
    return {
        "names": names,
        "numel": numel,
        "keys": keys,
        "sharded_by_fsdp": sharded_by_fsdp,
        "registered": registered,
        "all_in_optimizer": all(id(p) in in_groups for p in model.parameters()),
        "read": read,
        "snapshot_unchanged": snapshot_unchanged,
        "weights_moved": weights_moved,
        "to_error": to_error,
    }


def test_parameters_state_dict_reads_and_conversions():
    reference = models.build_llama()
    opt = _opt(reference)
    for xb in _batches(2):
        _global_loss(reference, xb, 0, 1)
        opt.step()
        opt.zero_grad()
    ref_w = reference.layers[0].mlp.up_proj.weight.detach()
    results = run_ranks(_seen, 2)
    for r in results:
        assert r["names"] == [n for n, _ in reference.named_parameters()]
        assert r["numel"] == sum(p.numel() for p in reference.parameters())
        assert r["keys"] == sorted(reference.state_dict())
        assert r["sharded_by_fsdp"] == [] and r["registered"] and r["all_in_optimizer"]
        assert r["read"]["is_dtensor"]
        torch.testing.assert_close(
            r["read"]["full"], ref_w, rtol=1e-4, atol=1e-5
        )  # fp32 reduction order
        assert torch.equal(r["read"]["full_method"], r["read"]["full"])
        assert r["read"]["sum"] == pytest.approx(float(ref_w.sum()), rel=1e-4, abs=1e-5)
        assert r["snapshot_unchanged"] and r["weights_moved"]
        assert r["to_error"] is not None and "param_policy" in r["to_error"]
    numels = sorted(r["read"]["local_numel"] for r in results)
    assert numels == [0, ref_w.numel()]  # the whole weight on its owner, nothing on the other rank


# ---------------------------------------------------------------------------------- DCP resume
SAVE_AT, CONTINUE = 3, 5


def _train_and_save(rank, world, mesh_shape, path, device="cpu"):
    """The uninterrupted run: SAVE_AT steps, a DCP checkpoint, then CONTINUE more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _build(world, mesh_shape, device=device)
    opt = _opt(model)
    x = _batches(SAVE_AT + CONTINUE)
    losses = []
    for i, xb in enumerate(x):
        if i == SAVE_AT:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        losses.append(_global_loss(model, xb, rank, world))
        opt.step()
        opt.zero_grad()
    return losses


def _resume(rank, world, mesh_shape, path, fresh_optimizer=False, device="cpu"):
    """Build on another cluster shape, load the checkpoint, run the CONTINUE steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if mesh_shape == (1,) and world == 1:
        model = models.build_llama(seed=5).to(local_device(device))  # one process, plain model
    else:  # other initial values: the load must replace them
        model = _build(world, mesh_shape, seed=5, device=device)
    opt = _opt(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    if fresh_optimizer:  # the weights only; a new optimizer without momentum or AdamW moments
        set_model_state_dict(model, state["model"])
        opt = _opt(model)
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    x = _batches(SAVE_AT + CONTINUE)[SAVE_AT:]
    losses = []
    for xb in x:
        losses.append(_global_loss(model, xb, rank, world))
        opt.step()
        opt.zero_grad()
    return losses


def _single_process(fn, *args):
    """``fn(0, 1, *args)`` in a one-rank gloo group of its own."""
    return run_ranks(fn, 1, *args)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step3")
    losses = run_ranks(_train_and_save, 2, (2,), path, timeout=120)
    assert losses[0] == losses[1]
    return path, losses[0][SAVE_AT:]


def test_resume_same_topology_is_bit_exact(saved):
    path, expected = saved
    for losses in run_ranks(_resume, 2, (2,), path, timeout=120):
        assert losses == expected


@pytest.mark.parametrize(
    "world,mesh_shape", [(1, (1,)), (4, (2, 2))], ids=["one_process", "hsdp_2x2"]
)
def test_resume_on_another_cluster_shape(saved, world, mesh_shape):
    path, expected = saved
    results = run_ranks(_resume, world, mesh_shape, path, timeout=180)
    for losses in results:
        for got, want in zip(losses, expected):
            assert got == pytest.approx(want, rel=1e-5)


def test_fresh_optimizer_control(saved):
    """The control: the same resume with a fresh optimizer (weights loaded, no momentum) gives
    other losses, so the equality above depends on the optimizer state moving."""
    path, expected = saved
    losses = run_ranks(_resume, 2, (2,), path, True, timeout=120)[0]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)  # same weights at the first step
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[1:], expected[1:])) > 1e-4


# ---------------------------------------------------------------------------------- bad state
def _incompatible(rank, world):
    model = _build(world, (world,))
    opt = _opt(model)
    _global_loss(model, _batches(1)[0], rank, world)
    opt.step()
    state = opt.state_dict()
    # a single-process optimizer's state (plain tensors) into the dedicated model
    plain_model = models.build_llama()
    plain_opt = _opt(plain_model)
    _global_loss(plain_model, _batches(1)[0], 0, 1)
    plain_opt.step()
    errors = {}
    try:
        opt.load_state_dict(plain_opt.state_dict())
    except ValueError as exc:
        errors["plain"] = str(exc)
    opt.load_state_dict(state)  # its own state loads
    return errors


def test_incompatible_optimizer_state_fails_at_load():
    for errors in run_ranks(_incompatible, 2):
        assert "plain" in errors
        assert (
            "_proj.weight" in errors["plain"] and "torch.distributed.checkpoint" in errors["plain"]
        )


# ---------------------------------------------------------------------------------- HF
def _hf_round_trip(rank, world, directory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import dmuon_compile as dmuon

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    count_before = model.num_parameters()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: n.endswith("_proj.weight"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    count_after = model.num_parameters()
    ids = torch.arange(16).reshape(2, 8) % 64
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    state = dmuon.get_model_state_dict(model)  # rank 0 only, full tensors on the CPU
    if rank == 0:
        model.save_pretrained(directory, state_dict=state)
    dist.barrier()
    return {"counts": (count_before, count_after), "logits": logits}


def test_hf_save_pretrained_round_trip(tmp_path):
    from transformers import LlamaForCausalLM

    results = run_ranks(_hf_round_trip, 2, str(tmp_path), timeout=150)
    for r in results:
        assert r["counts"][0] == r["counts"][1]
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        logits = loaded(input_ids=torch.arange(16).reshape(2, 8) % 64).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


def _other_owner(rank, world):
    """Rank-local optimizer state of a run whose owner plan differs (another layer grouping)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    mesh = init_device_mesh("cpu", (world,))

    def build(layer_id_fn):
        model = models.build_llama()
        owners = dmuon.dedicate_params(
            model, mesh, predicate=models.proj_predicate, layer_id_fn=layer_id_fn
        )
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _opt(model), owners

    saved, saved_opt, saved_owners = build(None)
    _global_loss(saved, _batches(1)[0], rank, world)
    saved_opt.step()
    _, opt, owners = build(lambda name: str(len(name)))  # grouped by name length: other owners
    moved = [n for n, r in owners.items() if saved_owners[n] != r]
    try:
        opt.load_state_dict(saved_opt.state_dict())
    except ValueError as exc:
        return moved, str(exc)
    return moved, None


def test_state_of_another_owner_names_both_owners():
    """Per-rank state loaded where another rank owns the matrix: the error says which ranks
    (a DeviceMesh's repr leaves them out, so both sides used to print alike)."""
    for moved, error in run_ranks(_other_owner, 2):
        assert moved, "the two owner plans must differ for this test"
        assert error is not None and "Muon.load_state_dict" in error, error
        saved, here = (
            error.split("was saved as ", 1)[1].split(". ", 1)[0].split("; the parameter is ")
        )
        assert saved != here, error
        assert {saved[:15], here[:15]} == {"owned by rank 0", "owned by rank 1"}, error
