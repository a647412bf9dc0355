"""Stored momenta on real ranks (``Muon(offload="momentum")``, ``Muon(momentum_dtype=torch.int8)``).

- An offloaded momentum trains bit for bit like the one on the parameter's device: dedicated
  weights (1-D), HSDP 2×1, expert stacks (dedicated) and TP 2, 2 gloo ranks each.
- ``keep_new_momentum=True`` trains bit for bit like the default: dedicated weights, HSDP 2×1
  and dedicated expert stacks.
- HSDP 2×2 (4 ranks): the offloaded momentum trains bit for bit like the one on the device.
- DCP: a checkpoint saved with one setting (8-bit, offloaded) and loaded into an optimizer of
  another (offloaded, fp32) resumes exactly as the same state handed over by the optimizer's own
  ``state_dict``/``load_state_dict`` on the same ranks; an 8-bit checkpoint of 2 ranks resumes
  on 4, offloaded and in place, to the same bits.

Controls: a run with another μ ends elsewhere (the comparison sees the momentum); a resumed run
whose optimizer loaded nothing ends elsewhere (the comparison sees the loaded state).
"""

from __future__ import annotations

import pytest
import torch

from . import models, moe_models
from .harness import full_state, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 4


def _build(kind: str, rank: int, world: int, device: str = "cpu"):
    """``(model, dp_rank, dp_size)`` for ``kind`` (``device``: dense and HSDP only)."""
    if kind == "dense":
        return models.build_dedicated(world, device=device)[0], rank, world
    if kind == "hsdp":
        return models.build_dedicated(world, hsdp=True, device=device)[0], rank, world
    if kind == "hsdp22":  # replicate 2 × shard 2
        model = models.build_dedicated(world, hsdp=True, device=device, shards=2)[0]
        return model, rank, world
    if kind == "tp":
        from .test_tp import build_tp

        model, dp_rank = build_tp(rank, world, 1, world)
        return model, dp_rank, 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    model = moe_models.build_moe()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(
        model, mesh, predicate=lambda n, p: p.ndim == 3 or dmuon.default_muon_predicate(n, p)
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, rank, world


def _batches(kind: str, world: int):
    if kind == "moe":
        return [x for x in moe_models.expert_batches(moe_models.build_moe(), STEPS, world)]
    return models.batches(STEPS, world)


def _train(rank, world, kind, settings, device="cpu"):
    import dmuon_compile as dmuon
    from dmuon_compile import optimizer

    from .harness import local_device

    taken = []  # keep_new_momentum: the buffers each commit swapped buf′ into
    real = optimizer.take_kept_momentum

    def counted(bufs, kept, commit_if=None):
        taken.append(len(bufs))
        return real(bufs, kept, commit_if)

    optimizer.take_kept_momentum = counted
    try:
        model, dp_rank, dp = _build(kind, rank, world, device)
        settings = dict(settings)
        opt = dmuon.Muon(model, compile=settings.pop("compile", False), **settings)
        batches = _batches(kind, dp)
        losses = train_steps(model, opt, batches, dp_rank, dp, device=local_device(device))
    finally:
        optimizer.take_kept_momentum = real
    stored = sorted({k for s in opt.state.values() for k in s if k.startswith("momentum")})
    state = {k: v.detach().cpu().clone() for k, v in full_state(model).items()}
    return {"losses": losses, "state": state, "keys": stored, "taken": sum(taken)}


@pytest.mark.parametrize("kind", ["dense", "hsdp", "moe", "tp"])
def test_an_offloaded_momentum_trains_bit_for_bit_like_the_one_on_the_device(kind):
    check_offloaded_equals_on_device(kind)


def test_on_four_ranks_hsdp_2x2_offloaded_trains_bit_for_bit_like_on_the_device():
    """HSDP with two replicas of two shards: the owners' offloaded momentum (one global owner
    per matrix, its replica column refreshed by the broadcast) equals the one on the device."""
    check_offloaded_equals_on_device("hsdp22", world=4)


def check_offloaded_equals_on_device(kind: str, device: str = "cpu", world: int = 2) -> None:
    """``world`` ranks (2 by default): the streamed, offloaded momentum against the one on the
    device, bit for bit."""
    on = run_ranks(_train, world, kind, {}, device, device=device)
    off = run_ranks(_train, world, kind, {"offload": "momentum"}, device, device=device)
    assert on[0]["keys"] == ["momentum_buffer"] and off[0]["keys"] == ["momentum_host"]
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        for name, ref in a["state"].items():
            torch.testing.assert_close(b["state"][name], ref, rtol=0, atol=0, msg=name)
    if kind in ("dense", "hsdp22"):  # control: another μ moves the weights elsewhere
        settings = {"offload": "momentum", "momentum": 0.5}
        other = run_ranks(_train, world, kind, settings, device, device=device)[0]
        assert any(not torch.equal(other["state"][k], v) for k, v in on[0]["state"].items())


@pytest.mark.parametrize("kind", ["dense", "hsdp", "moe"])
def test_the_kept_new_momentum_trains_bit_for_bit_like_the_default(kind):
    """2 ranks, ``keep_new_momentum=True``: each owner's buf′ swapped in at the commit (counted:
    the control that the kept path ran on every rank) gives the default's losses and weights."""
    check_kept_equals_default(kind)


def check_kept_equals_default(kind: str, device: str = "cpu", compile: bool = False) -> None:
    """2 ranks: ``keep_new_momentum=True`` against the default, bit for bit (``compile``: the
    compiled step, whose deferred verdict the swap's undo reads on the device)."""
    world = 2
    ref = run_ranks(_train, world, kind, {"compile": compile}, device, device=device)
    kept = {"compile": compile, "keep_new_momentum": True}
    got = run_ranks(_train, world, kind, kept, device, device=device)
    assert all(r["taken"] == 0 for r in ref) and all(r["taken"] > 0 for r in got)
    for a, b in zip(ref, got):
        assert a["losses"] == b["losses"]
        for name, want in a["state"].items():
            torch.testing.assert_close(b["state"][name], want, rtol=0, atol=0, msg=name)


def _resume(rank, world, path, first, second, how):
    """Two steps with ``first``, then two with ``second`` after handing the optimizer state over
    ``how``: "dcp" (save, new model and optimizer, load), "local" (state_dict/load_state_dict
    on the same ranks) or "none" (the control: nothing handed over)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dmuon_compile as dmuon

    xs = models.batches(4, world)
    model = models.build_dedicated(world, seed=0)[0]
    opt = dmuon.Muon(model, compile=False, **first)
    train_steps(model, opt, xs[:2], rank, world)
    if how == "dcp":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        model = models.build_dedicated(world, seed=5)[0]
        opt = dmuon.Muon(model, compile=False, **second)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        saved = opt.state_dict()
        opt = dmuon.Muon(model, compile=False, **second)
        if how == "local":
            opt.load_state_dict(saved)
    train_steps(model, opt, xs[2:], rank, world)
    return {k: v.detach().cpu().clone() for k, v in full_state(model).items()}


@pytest.mark.parametrize(
    "first,second",
    [({"momentum_dtype": torch.int8}, {"offload": "momentum"}), ({"offload": "momentum"}, {})],
    ids=["int8_to_offload", "offload_to_fp32"],
)
def test_dcp_resume_across_storage_settings(tmp_path, first, second):
    world = 2
    dcp_run = run_ranks(_resume, world, str(tmp_path / "ckpt"), first, second, "dcp")
    local = run_ranks(_resume, world, "", first, second, "local")
    for a, b in zip(dcp_run, local):
        for name, ref in b.items():
            torch.testing.assert_close(a[name], ref, rtol=0, atol=0, msg=name)
    if "momentum_dtype" in first:  # control (once): a resume that loads nothing ends elsewhere
        none = run_ranks(_resume, world, "", first, second, "none")[0]
        assert any(not torch.equal(none[k], v) for k, v in local[0].items())


def _reshard(rank, world, path, setting, how):
    """``how``: "save": two steps on these ranks with an 8-bit momentum, saved by DCP; "load"
    or "model_only": a new model and an optimizer with ``setting`` on these ranks, the
    checkpoint loaded (or only its model: the control), two more steps. Returns the full
    weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dmuon_compile as dmuon

    xs = models.batches(4, world)
    if how == "save":
        model = models.build_dedicated(world, seed=0)[0]
        opt = dmuon.Muon(model, compile=False, momentum_dtype=torch.int8)
        train_steps(model, opt, xs[:2], rank, world)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        return None
    model = models.build_dedicated(world, seed=5)[0]
    opt = dmuon.Muon(model, compile=False, **setting)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if how == "model_only":
        state = {"model": model_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state.get("optim", optim_sd)
    )
    train_steps(model, opt, xs[2:], rank, world)
    return {k: v.detach().cpu().clone() for k, v in full_state(model).items()}


def test_an_8bit_checkpoint_of_2_ranks_resumes_offloaded_on_4_like_in_place(tmp_path):
    """DCP resharding across settings: saved on 2 ranks with the 8-bit momentum, loaded on 4
    with the offloaded momentum and with the momentum in place (fp32), both resume to the same
    bits (the checkpoint holds the dequantised momentum, which both then store exactly).
    Control: the same 4 ranks loading the model but not the optimizer end elsewhere."""
    path = str(tmp_path / "ckpt")
    run_ranks(_reshard, 2, path, {}, "save")
    offloaded = run_ranks(_reshard, 4, path, {"offload": "momentum"}, "load")
    in_place = run_ranks(_reshard, 4, path, {}, "load")
    for a, b in zip(offloaded, in_place):
        for name, ref in b.items():
            torch.testing.assert_close(a[name], ref, rtol=0, atol=0, msg=name)
    fresh = run_ranks(_reshard, 4, path, {"offload": "momentum"}, "model_only")[0]
    assert any(not torch.equal(fresh[k], v) for k, v in in_place[0].items())
