"""A failure on one rank inside ``Muon.step`` reaches every rank, and training goes on exactly.

Owners differ per rank, so the local work of a step differs too (compiled graphs, autotune,
memory peaks): an OOM or a compile error can raise on one rank only. Injected on rank 1 only
(gloo, 2 ranks, tiny models) at step ``FAIL_AT`` — in the eager Newton–Schulz, in the compiled
step (its backend raises while compiling, as an Inductor/Triton error would), as an
``OutOfMemoryError``, and in the TP owners' Newton–Schulz (dp1 × tp2) — every rank must raise
``MuonStepError`` within seconds naming rank 1 and the phase (rank 1 chaining its own
exception); then ``zero_grad()`` and more steps on every rank must give the weights of one
process that skipped that batch. The compiled step leaves its verdict on the device, so every
rank raises at the next ``step()``, before it does anything; that call's batch is then stepped
by calling ``step()`` again.

Tolerance: fp32 throughout; the runs differ from one process by summation orders only (~1e-7
relative per operation, weights within ~1e-6 after the steps); ``ATOL`` 3e-5 as in the other
training tests. Control: with the failure caught by nobody (the old step: the failing rank raises
at once, the others go on into the step's all-reduce), the run hangs, errors elsewhere or ends
with other weights: the check fails.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from . import models
from .harness import full_state, local_device, run_ranks
from .test_dedicated_training import HYPER

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

WORLD = 2
STEPS = 3
FAIL_AT = 1  # the batch whose step fails on rank 1
FAILING = 1
ATOL = 3e-5
RAISE_WITHIN_S = 10.0  # far below any process-group timeout: nobody waited for a timeout


class InjectedError(RuntimeError):
    pass


def _inject(kind: str, model, step: list) -> None:
    """Make this rank's step ``FAIL_AT`` raise where ``kind`` says (only on its owner's work)."""
    from dmuon_compile import functional as F

    def failing(original, exc):
        def wrapper(*args, **kwargs):
            if step[0] == FAIL_AT:
                raise exc
            return original(*args, **kwargs)

        return wrapper

    if kind == "eager":
        F.orthogonalize = failing(F.orthogonalize, InjectedError("simulated NS failure"))
    elif kind == "eager_late":  # at the step's second NS call (a streamed step's second bucket)
        original, calls = F.orthogonalize, []

        def second_fails(*args, **kwargs):
            if step[0] == FAIL_AT:
                calls.append(1)
                if len(calls) == 2:
                    raise InjectedError("simulated NS failure")
            return original(*args, **kwargs)

        F.orthogonalize = second_fails
    elif kind == "oom":
        oom = torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        F.orthogonalize = failing(F.orthogonalize, oom)
    elif kind == "tp":
        from dmuon_compile.distributed import dedicated_runtime

        stage = dedicated_runtime(model).tp
        stage.orthogonalize = failing(stage.orthogonalize, InjectedError("simulated TP NS failure"))
    elif kind != "compiled":  # compiled: see _cheap_compile
        raise ValueError(kind)


def _cheap_compile(rank: int, step: list) -> None:
    """The compiled step through Dynamo with a backend that runs the traced graph (no Inductor:
    seconds, not minutes, on CPU) and on rank 1 fails while compiling at step ``FAIL_AT``
    (where rank 1 alone compiles again, as after a recompile)."""
    import dmuon_compile.compiled_step as CS

    real = torch.compile

    def backend(gm, _inputs):
        if rank == FAILING and step[0] == FAIL_AT:
            raise InjectedError("simulated Triton compile error")
        return gm.forward

    def compile_(fn, **_kwargs):
        return real(fn, backend=backend, fullgraph=True, dynamic=False)

    CS.torch = _TorchWith(compile_)


class _TorchWith:
    """``torch`` with another ``compile`` (for the compiled step's module only)."""

    def __init__(self, compile_) -> None:
        self.compile = compile_

    def __getattr__(self, name):
        return getattr(torch, name)


def _train(rank, world, kind, layout, fold=True, device="cpu", storage=None, leak=False):
    """``storage``: ``Muon``'s momentum storage options (e.g. ``offload="momentum"``);
    ``leak``: the control of the stored momentum's test (a step's staged momentum is kept even
    when the step failed)."""
    import dmuon_compile as dmuon
    from dmuon_compile import optimizer

    if not fold:  # the control: the failing rank raises at once, nobody agrees
        optimizer.guarded = lambda failure, phase, compute, placeholder: compute()
    step = [-1]
    dev = local_device(device)
    if layout == "tp":
        import torch.distributed as dist

        from .test_tp import _whole_state, build_tp

        model, dp_rank = build_tp(rank, world, 1, world, device=device)
        dp = 1
    else:
        model, _ = models.build_dedicated(world, hsdp=layout == "hsdp", device=device)
        dp_rank, dp = rank, world
    if kind == "compiled":
        _cheap_compile(rank, step)
    elif rank == FAILING:
        _inject(kind, model, step)
    opt = dmuon.Muon(
        model,
        ns_backend=dmuon.NewtonSchulz(work_dtype=torch.float32),
        compile=kind == "compiled",
        **HYPER,
        **(storage or {}),
    )
    if leak:  # a failed step's verdict keeps its staged momentum instead of dropping it
        opt._storage.drop_staged = opt._storage.commit_staged
    out = {"error": None, "cause": None, "failed": None, "after_s": None, "losses": []}
    for i, x in enumerate(models.batches(STEPS + 1, dp)):
        step[0] = i
        if kind == "compiled" and rank == FAILING and i == FAIL_AT:
            torch._dynamo.reset()  # this rank alone compiles the step again (and fails)
        per = x.shape[0] // dp
        loss = model(x[dp_rank * per : (dp_rank + 1) * per].to(dev)).square().mean()
        loss.backward()
        start = time.monotonic()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - what every rank reports
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["cause"] = type(exc.__cause__).__name__ if exc.__cause__ else None
            out["failed"] = getattr(exc, "failed", None)
            out["after_s"] = time.monotonic() - start
            out["at"] = i
            if kind == "compiled" and i == FAIL_AT + 1:
                # Read one call late (the compiled step leaves its verdict on the device):
                # this call raised before doing anything, so its own batch is stepped now.
                opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    if layout == "tp":
        out["state"] = _whole_state(model)
        dist.barrier()
    else:
        out["state"] = full_state(model)
    return out


@functools.cache
def reference(dp: int, device: str = "cpu") -> dict:
    """One process, eager Muon, the global batches of ``dp`` data-parallel ranks, the batch
    ``FAIL_AT`` skipped (weights returned on the CPU)."""
    import dmuon_compile as dmuon

    model = models.build_llama().to(device)
    opt = dmuon.Muon(
        model,
        predicate=models.proj_predicate,
        ns_backend=dmuon.NewtonSchulz(work_dtype=torch.float32),
        compile=False,
        **HYPER,
    )
    for i, x in enumerate(models.batches(STEPS + 1, dp)):
        model(x.to(device)).square().mean().backward()
        if i != FAIL_AT:
            opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _problems(results, phase: str, cause: str, ref: dict, at: int = FAIL_AT) -> list[str]:
    """What is wrong with a run (empty: every rank raised in time, at call ``at``, then
    trained exactly)."""
    found = []
    for rank, res in enumerate(results):
        err = res["error"] or ""
        if not err.startswith("MuonStepError") or res.get("at") != at:
            found.append(f"rank {rank} did not raise MuonStepError at step {at}: {err!r}")
            continue
        if f"rank {FAILING} in {phase}" not in err or res["failed"] != {FAILING: phase}:
            found.append(f"rank {rank}'s error does not name rank {FAILING} in {phase}: {err}")
        if (res["cause"] == cause) is not (rank == FAILING):
            found.append(f"rank {rank} chains {res['cause']}, expected {cause} on rank 1 only")
        if res["after_s"] > RAISE_WITHIN_S:
            found.append(f"rank {rank} raised after {res['after_s']:.1f} s")
    for name, want in ref.items():
        for rank, res in enumerate(results):
            got = res["state"][name]
            if not torch.allclose(got, want, atol=ATOL, rtol=0):
                miss = float((got - want).abs().max())
                found.append(f"rank {rank}: {name} differs from the reference by {miss:.2e}")
    return found


CASES = [
    # (kind, layout, phase, the failing rank's own exception)
    ("eager", "1d", "the eager Muon step (momentum, Newton–Schulz)", "InjectedError"),
    ("oom", "hsdp", "the eager Muon step (momentum, Newton–Schulz)", "OutOfMemoryError"),
    ("compiled", "1d", "the compiled Muon step", "BackendCompilerFailed"),
    ("compiled", "hsdp", "the compiled Muon step", "BackendCompilerFailed"),
    ("tp", "tp", "the TP owners' Newton–Schulz (eager)", "InjectedError"),
]


@pytest.mark.parametrize("kind, layout, phase, cause", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_one_rank_failure_in_step_raises_everywhere_then_trains_exactly(kind, layout, phase, cause):
    from dmuon_compile import optimizer

    phase = next(p for p in optimizer.STEP_PHASES if p.startswith(phase))
    results = run_ranks(_train, WORLD, kind, layout, timeout=120)
    ref = reference(1 if layout == "tp" else WORLD)
    # The compiled step leaves its verdict on the device: every rank raises at the next call.
    at = FAIL_AT + 1 if kind == "compiled" else FAIL_AT
    assert _problems(results, phase, cause, ref, at) == []


@pytest.mark.parametrize("layout", ["1d", "hsdp"])
def test_an_offloaded_momentum_after_a_one_rank_failure_trains_exactly(layout):
    """``Muon(offload="momentum")``, streamed, failing at rank 1's second bucket: the first
    bucket's new momentum stays in its shadow, which the next step drops, so the host copy is
    the last committed step's: every rank raises, then trains like one process that skipped the
    batch (offloaded training is the in-place one bit for bit). Control: with the failed step's
    shadows kept, the weights differ."""
    from dmuon_compile import optimizer

    phase = optimizer.PHASE_EAGER
    storage = {"offload": "momentum"}
    args = ("eager_late", layout, True, "cpu", storage)
    results = run_ranks(_train, WORLD, *args, timeout=120)
    assert _problems(results, phase, "InjectedError", reference(WORLD)) == []
    leaked = run_ranks(_train, WORLD, *args, True, timeout=120)
    assert any(
        "differs from the reference" in p
        for p in _problems(leaked, phase, "InjectedError", reference(WORLD))
    )


def test_control_without_the_agreement_the_ranks_fall_apart():
    """The failing rank raises at once (nothing caught): the others are left in the step's
    all-reduce while it goes on: a hang (killed here), an error elsewhere, or other weights."""
    from dmuon_compile import optimizer

    phase = optimizer.PHASE_EAGER
    try:
        results = run_ranks(_train, WORLD, "oom", "1d", False, timeout=25)
    except (TimeoutError, AssertionError, RuntimeError) as exc:  # a hang or a rank that died
        assert "did not finish" in str(exc) or "failed" in str(exc) or "died" in str(exc)
        return
    assert _problems(results, phase, "OutOfMemoryError", reference(WORLD)) != []
