"""A fault on one member of a split Newton–Schulz group stops the step on every rank, writes
nothing, and training goes on exactly.

``dedicate_params(split_size=2)`` on 4 gloo ranks (the model of test_split_dedicated: its three
FFN matrices each split over an aligned pair, the owner the pair's first rank). At step
``FAIL_AT`` rank 1 — a member of pair (0, 1), not the owner — has a fault in its part of the
split NS:

- ``nonfinite``: its piece of the result is NaN (the owner would write NaN into the weight);
- ``nonfinite_skip``: the same with ``Muon(nonfinite_grads="skip")``;
- ``raise_mid``: its local math raises after some of the NS's collectives went out;
- ``raise_early``: its local math raises before the first one (the norm of its piece);
- ``raise_mid_hsdp``: ``raise_mid`` on HSDP 2 × 2 (the pairs are slots of the whole job; the
  step still publishes the unchanged weights to the other replica).

Every rank must raise at that step, within seconds (no rank waits for a timeout): the
non-finite case the non-finite error of the ordinary path (``FloatingPointError`` naming the
split NS; with ``"skip"``, its skip warning on every rank), the exceptions ``MuonStepError``
naming rank 1 in the split NS's phase (rank 1 chaining its own exception). Then
``zero_grad()`` and the remaining steps on every rank must give the weights of one process
that skipped that batch (tolerances of test_split_dedicated): the failing step wrote nothing
anywhere.

Controls: with the split result's finite check taken out, the ``nonfinite`` run ends with NaN
weights and the check fails; with the split NS outside the step's failure guard (what the step
did before), the ``raise_mid`` run makes rank 1 raise its own error at once while its peers
wait in a collective: a hang (killed), other errors or other weights — the check fails.
"""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch

from . import models
from .harness import full_state, run_ranks
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

WORLD = 4
STEPS = 3
FAIL_AT = 1
FAILING = 1  # a member of the pair (0, 1), not its owner
SHAPE = {"layers": 1, "ffn": 1024}  # as test_split_dedicated: each FFN matrix is split
ATOL = 2e-4
RAISE_WITHIN_S = 60.0  # far below the process-group timeout (30 min): no rank waited for it
KINDS = ("nonfinite", "nonfinite_skip", "raise_mid", "raise_early", "raise_mid_hsdp")


class InjectedError(RuntimeError):
    pass


def _inject(kind: str, step: list) -> None:
    """Rank ``FAILING``'s fault at step ``FAIL_AT`` (only in its split NS work)."""
    from dmuon_compile.distributed import split_ns
    from dmuon_compile.distributed._stages import split_step as _split_step

    def at_fail(original, fault):
        def wrapper(*args, **kwargs):
            if step[0] == FAIL_AT:
                return fault(original, *args, **kwargs)
            return original(*args, **kwargs)

        return wrapper

    if kind.startswith("nonfinite"):

        def nan_piece(original, *args, **kwargs):
            return torch.full_like(original(*args, **kwargs), float("nan"))

        _split_step.split_newton_schulz = at_fail(_split_step.split_newton_schulz, nan_piece)
    elif kind.startswith("raise_mid"):
        calls = [0]

        def third_call_raises(original, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:  # inside the NS loop: collectives went out before
                raise InjectedError("simulated kernel failure in the split NS")
            return original(*args, **kwargs)

        split_ns._add_identity_rows = at_fail(split_ns._add_identity_rows, third_call_raises)
    elif kind == "raise_early":

        def raises(original, *args, **kwargs):
            raise InjectedError("simulated OOM taking the piece's norm")

        split_ns._piece_sumsq = at_fail(split_ns._piece_sumsq, raises)
    else:
        raise ValueError(kind)


def _undo() -> dict:
    from dmuon_compile.distributed import split_ns
    from dmuon_compile.distributed._stages import split_step as _split_step

    return {
        (_split_step, "split_newton_schulz"): _split_step.split_newton_schulz,
        (split_ns, "_add_identity_rows"): split_ns._add_identity_rows,
        (split_ns, "_piece_sumsq"): split_ns._piece_sumsq,
    }


def _train(rank: int, world: int, kind: str, control: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile import optimizer

    saved = _undo()
    step = [-1]
    if rank == FAILING:
        _inject(kind, step)
    if control and kind == "nonfinite":  # the split result's finite check taken out
        optimizer.directions_finite = lambda ortho: None
    if control and kind == "raise_mid":  # the split NS outside the step's failure guard
        from dmuon_compile.distributed._stages import split_step as _split_step

        real = _split_step.orthogonalize_split
        _split_step.orthogonalize_split = lambda *a, failure=None, **k: real(*a, **k)
    model = models.build_llama(**SHAPE)
    if kind.endswith("hsdp"):  # 2 × 2, as test_split_dedicated
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(
            model,
            mesh["shard"],
            predicate=models.proj_predicate,
            replicate_mesh=mesh["replicate"],
            split_size=2,
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate, split_size=2)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    skip = kind == "nonfinite_skip"
    opt = dmuon.Muon(
        model,
        ns_backend=_ns(),
        compile=False,
        nonfinite_grads="skip" if skip else "raise",
        **HYPER,
    )
    out = {"error": None, "cause": None, "failed": None, "at": None, "after_s": None}
    for i, x in enumerate(models.batches(STEPS + 1, world)):
        step[0] = i
        per = x.shape[0] // world
        model(x[rank * per : (rank + 1) * per]).square().mean().backward()
        before = full_state(model) if i == FAIL_AT else None
        start = time.monotonic()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            for w in caught:  # a skip: reported as the error would be
                if "skipped" in str(w.message):
                    out.update(
                        error=f"skipped: {w.message}", at=i, after_s=time.monotonic() - start
                    )
        except Exception as exc:  # noqa: BLE001 - what every rank reports
            out.update(
                error=f"{type(exc).__name__}: {exc}",
                cause=type(exc.__cause__).__name__ if exc.__cause__ else None,
                failed=getattr(exc, "failed", None),
                at=i,
                after_s=time.monotonic() - start,
            )
        if before is not None:  # the failing step wrote nothing (weights, on every rank)
            after = full_state(model)
            out["unchanged"] = all(torch.equal(after[n], before[n]) for n in before)
        opt.zero_grad()
    out["state"] = full_state(model)
    dist.barrier()
    for (module, name), value in saved.items():
        setattr(module, name, value)
    return out


@functools.cache
def reference() -> dict:
    """One process, the reference Muon, the global batches, batch ``FAIL_AT`` skipped."""
    import dmuon_compile as dmuon

    model = models.build_llama(**SHAPE)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False, **HYPER
    )
    for i, x in enumerate(models.batches(STEPS + 1, WORLD)):
        model(x).square().mean().backward()
        if i != FAIL_AT:
            opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _problems(kind: str, results: list[dict], ref: dict) -> list[str]:
    """What is wrong with a run (empty: every rank raised the right error in time at step
    ``FAIL_AT``, nothing was written, and the run ended on the reference's weights)."""
    from dmuon_compile.step_phases import PHASE_SPLIT_NS

    found = []
    for rank, res in enumerate(results):
        err = res["error"] or ""
        if res["at"] != FAIL_AT:
            found.append(f"rank {rank} did not raise at step {FAIL_AT}: {err!r} at {res['at']}")
            continue
        if kind.startswith("nonfinite"):
            want = "skipped" if kind == "nonfinite_skip" else "FloatingPointError"
            if not err.startswith(want) or "split Newton–Schulz" not in err:
                found.append(f"rank {rank}: not the split NS's non-finite {want}: {err}")
        else:
            if not err.startswith("MuonStepError") or res["failed"] != {FAILING: PHASE_SPLIT_NS}:
                found.append(f"rank {rank}: not MuonStepError naming rank {FAILING}: {err}")
            if (res["cause"] == "InjectedError") is not (rank == FAILING):
                found.append(f"rank {rank} chains {res['cause']}")
        if res["after_s"] > RAISE_WITHIN_S:
            found.append(f"rank {rank} raised after {res['after_s']:.1f} s")
        if not res.get("unchanged", False):
            found.append(f"rank {rank}: the failing step changed weights")
    for name, want in ref.items():
        for rank, res in enumerate(results):
            got = res["state"][name]
            if not torch.allclose(got, want, atol=ATOL, rtol=0):
                miss = float((got - want).abs().max())
                found.append(f"rank {rank}: {name} differs from the reference by {miss:.2e}")
    return found


def _all_kinds(rank: int, world: int) -> dict:
    return {kind: _train(rank, world, kind) for kind in KINDS}


def test_a_member_fault_in_split_ns_stops_every_rank_then_trains_exactly():
    results = run_ranks(_all_kinds, WORLD, timeout=180)
    ref = reference()
    for kind in KINDS:
        assert _problems(kind, [r[kind] for r in results], ref) == [], kind


def test_control_without_the_split_finite_check_nan_is_written():
    results = run_ranks(_train, WORLD, "nonfinite", True, timeout=120)
    assert _problems("nonfinite", results, reference()) != []
    assert any(not torch.isfinite(t).all() for t in results[0]["state"].values())


def test_control_split_ns_outside_the_guard_falls_apart():
    """Rank 1 raises its own error at once; its peers are left in the split NS's collectives
    (a hang, killed here), raise something else, or end on other weights."""
    try:
        results = run_ranks(_train, WORLD, "raise_mid", True, timeout=20)
    except (TimeoutError, AssertionError, RuntimeError) as exc:  # a hang or a rank that died
        assert "did not finish" in str(exc) or "failed" in str(exc) or "died" in str(exc)
        return
    assert _problems("raise_mid", results, reference()) != []
