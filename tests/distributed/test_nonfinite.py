"""A NaN gradient on one rank stops every rank the same way: no rank is left waiting in a
collective. The compiled step reports it one call later (``last_step_committed()`` here), on
every rank alike, with every weight unchanged."""

from __future__ import annotations

import pytest

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _nan_on_rank0(rank, world, mode, compiled=False):
    import warnings

    import torch

    import dmuon_compile as dmuon

    from .harness import full_state
    from .test_step_faults import _cheap_compile

    model, owners = models.build_dedicated(world)
    if compiled:
        _cheap_compile(rank, [-1])  # Dynamo with a backend that runs the graph: no Inductor
    opt = dmuon.Muon(model, compile=compiled, nonfinite_grads=mode)
    x = next(iter(models.batches(1, world)))
    per = x.shape[0] // world
    model(x[rank * per : (rank + 1) * per]).square().mean().backward()
    if rank == 0:  # poison a gradient only this rank holds: an owned matrix
        name = next(n for n, o in owners.items() if o == 0)
        models.owned_grads(model)[name][0, 0] = float("nan")
    outcome = "stepped"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before, held = full_state(model), False
        try:
            opt.step()
            held = opt._agreement.pending is not None
            opt.last_step_committed()
        except FloatingPointError as exc:
            outcome = f"raised: {exc}"
    if any("skipped" in str(w.message) for w in caught):
        outcome = "skipped"
    after = full_state(model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    if compiled != held or changed:
        outcome += " (but: held" if held else " (but: read at once"
        outcome += f", weights changed: {changed})"
    # both ranks must still be in step with each other: one more collective completes
    opt.zero_grad()
    model(x[rank * per : (rank + 1) * per]).square().mean().backward()
    return outcome


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_every_rank_agrees_on_a_nonfinite_step(mode, compiled):
    r0, r1 = run_ranks(_nan_on_rank0, 2, mode, compiled, timeout=90)
    assert "(but:" not in r0 + r1  # held iff compiled, and no weight changed anywhere
    if mode == "raise":
        assert r0.startswith("raised") and r1.startswith("raised")
        assert "another rank" in r1 and "another rank" not in r0
    else:
        assert r0 == r1 == "skipped"
