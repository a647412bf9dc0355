"""torch.nn.utils.clip_grad_norm_(model.parameters()) sees the dedicated gradients, as does the
dmuon.clip_grad_norm_ alias: the norm and the clipped gradients equal one process's (1-D, HSDP,
and TP: dp 1 × tp 2 and dp 2 × tp 2, TP shards and plain weights of a TP model, a
sequence-parallel plan, HSDP × TP). Control: TP norms that count only each TP rank's own
shards (``Replicate`` over TP) miss."""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import local_device, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _reference(max_norm, dp=2, device="cpu"):
    model = models.build_llama().to(device)
    x = next(iter(models.batches(1, dp)))
    model(x.to(device)).square().mean().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(total), {n: p.grad.cpu().clone() for n, p in model.named_parameters()}


def _clip(rank, world, max_norm, use_torch, hsdp, device="cpu"):
    import dmuon_compile as dmuon

    model, _ = models.build_dedicated(world, hsdp=hsdp, device=device)
    x = next(iter(models.batches(1, world))).to(local_device(device))
    per = x.shape[0] // world
    model(x[rank * per : (rank + 1) * per]).square().mean().backward()
    if use_torch:  # the user's unchanged FSDP2 line
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
    else:
        total = dmuon.clip_grad_norm_(model, max_norm)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
    owned = sorted(n for n, p in model.named_parameters() if p.grad.to_local().numel() == p.numel())
    return float(total), grads, owned


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clips", "no-op"])
@pytest.mark.parametrize("use_torch", [True, False], ids=["torch", "alias"])
def test_clip_matches_single_process(max_norm, use_torch):
    ref_total, ref_grads = _reference(max_norm)
    results = run_ranks(_clip, 2, max_norm, use_torch, False, timeout=90)
    for total, grads, _ in results:
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7)
    # the dedicated gradients really are split between the ranks (the test has teeth)
    dedicated = {n for n in ref_grads if models.proj_predicate(n, None)}
    assert not dedicated <= set(results[0][2]) and not dedicated <= set(results[1][2])


def test_torch_clip_hsdp():
    ref_total, ref_grads = _reference(1e-3)
    for total, grads, _ in run_ranks(_clip, 2, 1e-3, True, True, timeout=90):
        assert total == pytest.approx(ref_total, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7)


def test_bad_norm_type():
    import dmuon_compile as dmuon

    with pytest.raises(ValueError, match="norm_type"):
        dmuon.clip_grad_norm_(models.build_llama(), 1.0, norm_type=1.0)


def _clip_tp(rank, world, dp, attention, use_torch, control, device="cpu"):
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime, mesh_checks
    from dmuon_compile.distributed._owner import meshes as _owner_meshes

    from .test_tp import build_tp

    model, dp_rank = build_tp(rank, world, dp, 2, attention=attention, device=device)
    if control:  # each TP shard's norm partial over DP only: every TP rank counts its own shards
        stage = dedicated_runtime(model).tp
        root = mesh_checks._root(stage.info.mesh)
        for p in stage.params:
            _owner_meshes.set_norm_mesh(p.param.device_mesh, root, {"dp"})
    x = next(iter(models.batches(1, dp))).to(local_device(device))
    per = x.shape[0] // dp
    model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
    if use_torch:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).full_tensor()
    else:
        total = dmuon.clip_grad_norm_(model, 1e-3)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
    return float(total), grads


@pytest.mark.parametrize(
    ("dp", "attention", "use_torch"),
    [(1, True, True), (2, False, True), (2, True, False)],
    ids=["dp1xtp2", "dp2xtp2-mixed", "dp2xtp2-alias"],
)
def test_clip_tp_matches_single_process(dp, attention, use_torch):
    """attention=False: q/k/v/o stay plain dedicated weights of the TP model (one owner per TP
    column) beside the TP-sharded MLP; the rest of the model is FSDP2's on the DP mesh."""
    ref_total, ref_grads = _reference(1e-3, dp)
    results = run_ranks(_clip_tp, 2 * dp, dp, attention, use_torch, False, timeout=150)
    for total, grads in results:
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def _clip_sequence_parallel(rank, world):
    from .test_tp import sequence_parallel_model

    model = sequence_parallel_model(world)
    x = next(iter(models.batches(1, 1)))
    chunk = x.shape[1] // world  # each TP rank feeds its slice of the sequence
    (model(x[:, rank * chunk : (rank + 1) * chunk]).square().mean() / world).backward()
    meshes = {p.grad.device_mesh.mesh_dim_names for p in model.parameters()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).full_tensor()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return float(total), grads, sorted(meshes)


def test_clip_sequence_parallel_plan():
    """torchtitan's layout: FSDP2's norms and head on the 2-D (dp, tp) mesh beside the TP shards."""
    ref_total, ref_grads = _reference(1e-3, 1)
    for total, grads, meshes in run_ranks(_clip_sequence_parallel, 2, timeout=150):
        assert ("dp", "tp") in meshes  # FSDP2 + TP gradients on the 2-D mesh
        assert total == pytest.approx(ref_total, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def _clip_hsdp_tp(rank, world, device="cpu"):
    from .test_tp import build_tp

    model, dp_rank = build_tp(rank, world, 4, 2, replicas=2, device=device)
    x = next(iter(models.batches(1, 4))).to(local_device(device))
    per = x.shape[0] // 4
    model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).full_tensor()
    return float(total), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_clip_hsdp_tp_3d():
    """replicate 2 × shard 2 × tp 2: FSDP2's norms on the (replicate, shard) slice."""
    ref_total, ref_grads = _reference(1e-3, 4)
    for total, grads in run_ranks(_clip_hsdp_tp, 8, timeout=240):
        assert total == pytest.approx(ref_total, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def test_clip_tp_control_counting_own_shards_misses():
    ref_total, _ = _reference(1e-3, 1)
    for total, _ in run_ranks(_clip_tp, 2, 1, True, True, True, timeout=150):
        assert abs(total - ref_total) > 1e-3 * ref_total, (total, ref_total)
