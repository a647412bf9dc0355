"""``model.to(dtype)`` / ``.double()`` / ``.half()`` on a model with dedicated weights raise
*before* anything converts: after the error every parameter and buffer is as it was, and the
model trains on exactly as a model that never saw the call (compared step for step).

Control: the same "is anything changed?" comparison reports the parameters that a conversion
of a part without dedicated weights (``model.norm.double()``) did change.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

CONVERSIONS = {
    "to_float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "to_dtype_kw": lambda m: m.to(dtype=torch.bfloat16),
}


def _snapshot(model) -> dict:
    """Every parameter and buffer's local tensor (a copy), by name."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        out[name] = local.detach().clone()
    return out


def _changed(before: dict, model) -> list[str]:
    after = _snapshot(model)
    return [
        n
        for n in before
        if after[n].dtype != before[n].dtype or not torch.equal(after[n], before[n])
    ]


def _train(model, opt, rank: int, world: int, steps: int = 2) -> list[float]:
    return train_steps(model, opt, models.batches(steps, world), rank, world, mean=False)


def _refused_then_trains(rank, world):
    import dmuon_compile as dmuon

    model = models.build_dedicated(world)[0]
    opt = dmuon.Muon(model, compile=False, predicate=models.proj_predicate)
    before = _snapshot(model)
    errors, changed = {}, {}
    for label, convert in CONVERSIONS.items():
        try:
            convert(model)
            errors[label] = None
        except RuntimeError as exc:
            errors[label] = str(exc)
        changed[label] = _changed(before, model)
    losses = _train(model, opt, rank, world)
    after_training = _snapshot(model)

    control_model = models.build_dedicated(world)[0]  # never saw a conversion
    control_opt = dmuon.Muon(control_model, compile=False, predicate=models.proj_predicate)
    control_losses = _train(control_model, control_opt, rank, world)
    control_after = _snapshot(control_model)

    # the detector's teeth: a conversion that is allowed (no dedicated weight below) changes
    teeth_before = _snapshot(control_model)
    control_model.norm.double()
    teeth = _changed(teeth_before, control_model)
    return {
        "errors": errors,
        "changed": changed,
        "losses": losses,
        "control_losses": control_losses,
        "same_weights": all(
            torch.equal(after_training[k], control_after[k]) for k in control_after
        ),
        "teeth": teeth,
    }


def test_conversion_of_dedicated_weights_raises_before_changing_anything():
    for result in run_ranks(_refused_then_trains, 2):
        for label, error in result["errors"].items():
            assert error is not None and "nothing was converted" in error, label
            assert "dedicate_params" in error  # names the fix
            assert result["changed"][label] == [], (label, result["changed"][label])
        assert result["losses"] == result["control_losses"]
        assert result["same_weights"]
        assert result["teeth"] == ["norm.weight"]
