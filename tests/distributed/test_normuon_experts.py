"""NorMuon (``Muon(normuon=True)``) through the expert reshard stage: expert stacks cut inside
their experts by FSDP2 (``Shard(1)``: rows, ``Shard(2)``: columns; torchtitan's layout when
efsdp·ep exceeds the experts) and, under HSDP with ``Muon(expert_ns="once")``, split over the
replicas, train equal to one process with NorMuon; the second moments of the stacks (whole)
equal the one-process run's, and a DCP checkpoint of the ranks loads them into one process.
``orthogonalize_resharded`` with moments, by the direct and the reference (``redistribute``)
path, equals one process's per-expert NS and ``normalize``; a non-finite ``v`` on one rank
makes every rank refuse the step.

Control: one process without NorMuon ends elsewhere, so the comparison sees the normalisation.
Each spawn trains two models one after the other (two shard dims) to keep to two spawns.
Everything in fp32; tolerances as in test_normuon_dist.py (only reduction orders differ).
"""

from __future__ import annotations

import pytest
import torch

from . import moe_models
from .harness import full_state, run_ranks, train_steps, whole_tensor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3
HYPER = {"lr": 0.02, "momentum": 0.95, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}
KEY = "normuon_second_moment"
STACKS = [f"layers.{i}.experts.w{j}" for i in range(2) for j in (1, 2, 3)]


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _loss(model, x):
    return (model(x) - 0.5).square().mean()


def _stack_moments(opt) -> dict:
    """``{name: whole second moment}`` of the expert stacks (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for p, state in opt.state.items():
        name = opt.param_name(p)
        if name in STACKS:
            v = state[KEY]
            v = whole_tensor(v) if isinstance(v, DTensor) else v
            out[name] = v.detach().cpu().clone()
    return dict(sorted(out.items()))


def _reference(world: int, normuon: bool = True):
    import dmuon_compile as dmuon

    model = moe_models.build_moe()
    opt = dmuon.Muon(model, ns_backend=_ns(), normuon=normuon, **HYPER)
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses = train_steps(model, opt, batches, loss_fn=_loss)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, _stack_moments(opt) if normuon else None


def _train(rank: int, world: int, replicas: int, shard_dims, expert_ns: str, folder: str | None):
    """Per ``shard_dims`` entry: a fresh model with FSDP2 ``Shard(d)`` expert stacks (HSDP
    ``replicas × world / replicas`` where ``replicas`` > 1), dense matrices dedicated, trained
    ``STEPS`` steps with NorMuon. Returns per entry the losses, the whole weights and stack
    moments, the moments' placements, the reshard's all-to-alls and all-gathers over the run,
    :func:`_paths` of two stacks, and (with ``folder``, last entry only) what the step of a
    non-finite ``v`` raised and whether it wrote nothing. With ``folder``, the first entry is
    saved there by DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es

    calls = {"all_to_all": 0, "all_gather": 0}
    for name in calls:
        original = getattr(es, f"_{name}")

        def counting(*a, _name=name, _original=original):
            calls[_name] += 1
            return _original(*a)

        setattr(es, f"_{name}", counting)

    out = []
    for k, dim in enumerate(shard_dims):
        model = moe_models.build_moe()
        if replicas > 1:
            mesh = init_device_mesh(
                "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
            )
            dmuon.dedicate_params(model, mesh["shard"], replicate_mesh=mesh["replicate"])
        else:
            mesh = init_device_mesh("cpu", (world,))
            dmuon.dedicate_params(model, mesh)
        for block in model.layers:
            fully_shard(block.experts, mesh=mesh, shard_placement_fn=lambda _, d=dim: Shard(d))
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, ns_backend=_ns(), normuon=True, expert_ns=expert_ns, **HYPER)
        batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
        before = dict(calls)
        losses = train_steps(model, opt, batches, rank, world, loss_fn=_loss)
        counted = {name: calls[name] - before[name] for name in calls}
        w1 = model.layers[0].experts.w1
        v1 = opt.state[w1][KEY]
        placed = (str(w1.placements), str(v1.placements), tuple(v1.to_local().shape))
        if folder is not None and k == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
        weights = {n: v.detach().cpu().clone() for n, v in full_state(model).items()}
        paths = _paths([model.layers[0].experts.w1, model.layers[0].experts.w2])
        out.append((losses, weights, _stack_moments(opt), placed, counted, paths, None))
    if folder is not None:  # the last model: a non-finite v on one rank (as a load could bring)
        v = v1.to_local()
        if rank == 0:
            v[0, 0, 0] = float("nan")
        before = (w1.to_local().clone(), v.clone())
        _loss(model, batches[0].chunk(world)[rank]).backward()
        try:
            opt.step()
            raised = None
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            raised = type(err).__name__
        opt.zero_grad()
        same = torch.equal(w1.to_local(), before[0]) and torch.equal(
            v.nan_to_num(7.0), before[1].nan_to_num(7.0)
        )
        out[-1] = (*out[-1][:-1], (raised, same))
    return out


def _paths(stacks) -> dict:
    """``orthogonalize_resharded`` with NorMuon's moments of ``stacks`` (their placements, one
    batch) by the direct path and by the reference (``DTensor.redistribute``) path, each
    against one process's per-expert NS and ``normalize``: the largest differences of the local
    directions and ``v′``."""
    from torch.distributed.tensor import distribute_tensor

    from dmuon_compile import functional as F
    from dmuon_compile.distributed._stages import expert_shards as es
    from dmuon_compile.distributed._stages.expert_shards import moment_placements
    from dmuon_compile.layouts import Layout
    from dmuon_compile.normuon import NorMuon, moment_shape, normalize_all

    ns, lay, config = _ns(), Layout.experts(), NorMuon(beta2=0.9)
    g = torch.Generator().manual_seed(3)
    us, vs, want_o, want_v = [], [], [], []
    for p in stacks:
        u = torch.randn(p.shape, generator=g)
        v = torch.rand(moment_shape(lay, p.shape), generator=g) / p.shape[-1]
        (o,), (v2,) = normalize_all(F.orthogonalize([u], ns, layouts=[lay]), [v], [lay], config)
        placed = moment_placements(p, lay)
        for xs, x, pl in ((us, u, p.placements), (vs, v, placed)):
            xs.append(distribute_tensor(x, p.device_mesh, pl, src_data_rank=None).to_local())
        want_o.append(distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None))
        want_v.append(distribute_tensor(v2, p.device_mesh, placed, src_data_rank=None))

    def orthogonalize(mats, lays):
        return F.orthogonalize(mats, ns, layouts=lays)

    def normalize(mats, moments, lays):
        return normalize_all(mats, moments, lays, config)

    lays = [lay] * len(stacks)
    direct = es.orthogonalize_resharded(
        stacks, us, lays, orthogonalize, moments=vs, normalize=normalize
    )
    norm = es._Normalize(vs, normalize)
    ref = [
        es._reference_one(p, u, lay, orthogonalize, norm, i)
        for i, (p, u) in enumerate(zip(stacks, us))
    ]
    reference = ([r[0] for r in ref], [r[1] for r in ref])
    out = {}
    for name, (os, v2s) in (("direct", direct), ("reference", reference)):
        out[name] = max(
            max((o - w.to_local()).abs().max().item(), (v2 - wv.to_local()).abs().max().item())
            for o, v2, w, wv in zip(os, v2s, want_o, want_v)
        )
    return out


def _check(runs, world: int) -> None:
    """Each run equals the one-process NorMuon run of ``world`` ranks' batches (weights and the
    stacks' second moments); the control, without NorMuon, ends elsewhere."""
    ref_losses, ref_weights, ref_moments = _reference(world)
    for losses, weights, moments, *_ in runs:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0
        )
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, atol=2e-4, rtol=0, msg=name)
        assert list(moments) == STACKS
        for name, value in ref_moments.items():
            assert moments[name].shape == (*ref_weights[name].shape[:2], 1), name
            assert value.abs().sum() > 0, name
            torch.testing.assert_close(moments[name], value, rtol=1e-3, atol=1e-7, msg=name)
    _, plain, _ = _reference(world, normuon=False)
    gap = min(max((plain[n] - weights[n]).abs().max() for n in STACKS) for _, weights, *_ in runs)
    assert gap > 10 * 2e-4, gap  # control: without NorMuon the stacks end elsewhere


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """2 ranks, FSDP2 ``Shard(1)`` (saved to DCP) then ``Shard(2)``."""
    folder = str(tmp_path_factory.mktemp("normuon_experts") / "ckpt")
    return folder, run_ranks(_train, 2, 1, (1, 2), "per_replica", folder, timeout=200)


def test_fsdp2_stacks_cut_inside_their_experts_train_equal_to_one_process(fsdp2):
    """``Shard(1)``: ``v`` is cut along the rows like the stack (its own all-to-all each way);
    ``Shard(2)``: ``v`` is replicated over the cut (each member holds every row: no all-to-all
    on the way in, every row back to every member on the way out)."""
    _, results = fsdp2
    _check([run for rank_runs in results for run in rank_runs], world=2)
    rows, cols = results[0]
    for run in rows, cols:  # the direct and reference paths against one process
        assert max(run[5].values()) < 1e-5, run[5]
    assert rows[3] == ("(Shard(dim=1),)", "(Shard(dim=1),)", (4, 12, 1))
    assert cols[3] == ("(Shard(dim=2),)", "(Replicate(),)", (4, 24, 1))
    # A non-finite v on one rank: every rank refuses the step (v′ joins the finite check),
    # nothing is written.
    assert [rank_runs[-1][6] for rank_runs in results] == [("FloatingPointError", True)] * 2
    # Per step one batch of the 6 stacks: u there and back, v there (rows only) and back.
    assert rows[4] == {"all_to_all": 4 * STEPS, "all_gather": 0}
    assert cols[4] == {"all_to_all": 3 * STEPS, "all_gather": 0}


def test_a_dcp_checkpoint_of_row_cut_moments_loads_into_one_process(fsdp2):
    """The ``Shard(1)`` run's checkpoint (two ranks' rows of every stack's ``v``) loaded into a
    plain model in this process: every stack's second moment as it was."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dmuon_compile as dmuon

    folder, results = fsdp2
    model = moe_models.build_moe(seed=5)
    opt = dmuon.Muon(model, ns_backend=_ns(), normuon=True, **HYPER)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _stack_moments(opt)
    assert list(loaded) == STACKS
    for name, value in results[0][0][2].items():
        assert torch.equal(loaded[name], value), name


def test_hsdp_stacks_split_over_replicas_train_equal_to_one_process():
    """HSDP 2 × 2, ``expert_ns="once"``: ``Shard(0)`` stacks (whole experts split over the
    replicas: every replica normalises the gathered results, so no ``v`` moves) and
    ``Shard(1)`` stacks (the in-expert all-to-all first)."""
    results = run_ranks(_train, 4, 2, (0, 1), "once", None, timeout=200)
    _check([run for rank_runs in results for run in rank_runs], world=4)
    whole, rows = results[0]
    for run in whole, rows:
        assert max(run[5].values()) < 1e-5, run[5]
    assert whole[3][1] == "(Replicate(), Shard(dim=0))"
    assert rows[3][1] == "(Replicate(), Shard(dim=1))"
    # Per step one batch: the replicas' all-gather; with Shard(1) u and v there and back.
    assert whole[4] == {"all_to_all": 0, "all_gather": STEPS}
    assert rows[4] == {"all_to_all": 4 * STEPS, "all_gather": STEPS}
