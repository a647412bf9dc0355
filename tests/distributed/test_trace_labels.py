"""Profiler labels: one profiled iteration on 2 gloo ranks shows every runtime phase by name.

HSDP 2×1 (unshard, reduce, publish, step, Newton–Schulz) and TP dp1×tp2 (the TP gather and
scatter) in one launch; the names are ``dmuon_compile.trace_labels``'s, which the docs list.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _profiled_labels(model, opt, x) -> set[str]:
    """The ``dmuon::`` ranges of one iteration (forward, backward, step, the next forward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
    return {e.name for e in prof.events() if e.name.startswith("dmuon::")}


def _phases(names) -> set[str]:
    from dmuon_compile.trace_labels import phase_of

    return {phase_of(n) for n in names}


def _labels(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    from .test_tp import build_tp

    x = models.batches(1, 1)[0]
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = models.build_llama()
    dmuon.dedicate_params(
        model, mesh["shard"], predicate=models.proj_predicate, replicate_mesh=mesh["replicate"]
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False, **HYPER)
    hsdp = _profiled_labels(model, opt, x)
    model, _ = build_tp(rank, world, 1, world)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False, **HYPER)
    tp = _profiled_labels(model, opt, x)
    return {"hsdp": sorted(hsdp), "tp": sorted(tp)}


def test_every_phase_is_labelled():
    from dmuon_compile import trace_labels as L

    for got in run_ranks(_labels, 2, timeout=100):
        hsdp, tp = _phases(got["hsdp"]), _phases(got["tp"])
        assert {L.UNSHARD, L.REDUCE, L.PUBLISH, L.STEP, L.NS} <= hsdp, got
        assert {L.TP_GATHER, L.TP_SCATTER, L.STEP} <= tp, got
        assert hsdp | tp == set(L.ALL), got
        # The unshard, reduce and publish ranges name their hook group, as FSDP2's do.
        for phase in (L.UNSHARD, L.REDUCE, L.PUBLISH):
            assert f"{phase} (layers.0)" in got["hsdp"], got


def test_labels_cost_nothing_without_a_profiler():
    from dmuon_compile.trace_labels import STEP, label

    assert label(STEP) is label(STEP)  # one shared no-op context, no range object
