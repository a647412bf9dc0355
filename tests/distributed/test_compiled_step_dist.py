"""``Muon(compile=True)`` on dedicated weights + FSDP2 (1-D, 2 gloo ranks) trains like one process
with the eager step, and an LR schedule never recompiles the step.

Each rank compiles the Muon step of the matrices it owns (Inductor's C++ backend on CPU; the
NS-chain pass rewrites the chain into ``torch.ops.dmuon``, whose CPU code is the torch
reference); AdamW runs eagerly on the FSDP2 shards. Three steps under ``LambdaLR`` (lr changes
every step) equal the single-process eager ``Muon`` on the global batch.

Tolerance: fp32 end to end (``work_dtype=float32``); the two runs differ only by summation
orders (FSDP2's reduce-scatter and the owner reduce against one process's backward, Inductor's
fused kernels and the reference ops against eager ``mm``): fp32 rounding, ~1e-7 relative per
operation. The weights move by ~2e-2 over the 3 steps and end within ~2e-6 of the reference
(measured, both routes); atol 3e-5 leaves 15× headroom for other thread counts and BLAS builds.
Control: the eager reference without the schedule (what the compiled step would match had the
first step's lr been baked into the graph) misses by more than 100× that tolerance on both
routes (by ~1e-2). Inductor's cache is a fresh directory per rank and per test.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import full_state, local_device, run_ranks
from .test_dedicated_training import HYPER

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(480)]

STEPS = 3
WORLD = 2
ATOL = 3e-5


def _ns():
    import dmuon_compile as dmuon

    # kernel="auto": on a machine without CUDA the compiled step runs the NS-chain pass (the
    # path a GPU run takes, with the ops' reference code); eager NS keeps plain mm.
    return dmuon.NewtonSchulz(kernel="auto", work_dtype=torch.float32)


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def reference(schedule: bool = True, device: str = "cpu") -> dict:
    """One process, eager Muon, the whole global batch; ``schedule=False`` is the control."""
    import dmuon_compile as dmuon

    model = models.build_llama().to(device)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False, **HYPER
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule) if schedule else None
    for x in models.batches(STEPS, WORLD):
        model(x.to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _train_compiled(rank: int, world: int, cache: str, device: str = "cpu") -> dict:
    import os

    # Before anything compiles: this rank's own, empty Inductor cache (no hits from other tests).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"inductor-rank{rank}")
    from torch._dynamo.utils import counters

    import dmuon_compile as dmuon

    torch._dynamo.reset()
    counters.clear()
    model, owners = models.build_dedicated(world, device=device)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=True, **HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    graphs, lrs = [], []
    for x in models.batches(STEPS, world):
        x = x.to(local_device(device))
        per = x.shape[0] // world
        model(x[rank * per : (rank + 1) * per]).square().mean().backward()
        lrs.append([float(g["lr"]) for g in opt.param_groups])  # the lr this step ran with
        opt.step()
        opt.zero_grad()
        sched.step()
        graphs.append(counters["stats"]["unique_graphs"])
    steps = {
        f"{k.group}/{k.part}": {"calls": s.calls, "rewrites": s.rewrites}
        for k, s in opt.compiled_steps.items()
    }
    return {
        "owners": owners,
        "state": full_state(model),
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "syrk": counters["dmuon"]["syrk"],
        "skipped": counters["dmuon"]["skipped"],
        "lrs": lrs,
        "steps": steps,
        "muon": sorted(
            opt.param_name(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]
        ),
    }


def test_compiled_step_matches_eager_single_process(tmp_path, cache_dir):
    check_compiled(tmp_path, "cpu")


def check_compiled(tmp_path, device: str) -> None:
    """Train compiled on WORLD ranks and eagerly in one process on ``device``; compare."""
    results = run_ranks(_train_compiled, WORLD, str(tmp_path), device, timeout=360, device=device)
    ref, control = reference(device=device), reference(schedule=False, device=device)
    r0 = results[0]
    assert sorted(set(r0["owners"].values())) == list(range(WORLD))  # both ranks own matrices
    for res in results:
        # the schedule changed lr every step, and it reached the Muon and the AdamW group
        assert all(len({lrs[i] for lrs in res["lrs"]}) == STEPS for i in range(2)), res["lrs"]
        # the compiled step ran every step, through the NS-chain pass ...
        assert res["steps"] == {"0/all": {"calls": STEPS, "rewrites": True}}, res["steps"]
        if device == "cpu":
            assert res["syrk"] >= 1
        else:
            # on CUDA these small products stay on cuBLAS: the pass saw them and skipped them
            # (its size gate is the eager NS kernel choice)
            assert res["syrk"] + res["skipped"] >= 1, res
        # two graphs (the directions, the commit) after the first step, and no recompile
        assert res["graphs"] == [2] * STEPS, res["graphs"]
        assert res["breaks"] == 0
        assert res["muon"] == sorted(r0["owners"])
    dedicated = set(r0["owners"])
    adamw = set(ref) - dedicated
    assert adamw and dedicated  # both routes are compared
    for name, want in ref.items():
        for res in results:
            torch.testing.assert_close(
                res["state"][name], want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
    # Control: without the schedule the reference lands elsewhere, by far more than ATOL, on
    # both routes (the compiled Muon step saw each step's lr, not the first step's).
    for names in (dedicated, adamw):
        miss = max((r0["state"][n] - control[n]).abs().max().item() for n in names)
        assert miss > 100 * ATOL, (sorted(names)[:3], miss)
