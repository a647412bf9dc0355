"""Which parameters of a model are dedicated (owned whole by one rank).

``dedicate_params`` records its plan on the model; ``Muon`` reads it here to route those
parameters to Muon. Kept tiny so the optimizer does not import the distributed runtime.
"""

from __future__ import annotations

from torch import nn

PLAN_ATTR = "_dmuon_plan"


def dedicated_names(model: nn.Module) -> set[str]:
    """FQNs of the dedicated parameters of ``model`` (empty without ``dedicate_params``)."""
    plan = getattr(model, PLAN_ATTR, None)
    if plan is None:
        return set()
    return set(plan.param_names())


def dedicated_parameters(model: nn.Module) -> list:
    """``[(fqn, parameter)]`` of every dedicated parameter (the registered owner DTensors,
    the same list on every rank; ``to_local()`` is the master on its owner, empty elsewhere)."""
    plan = getattr(model, PLAN_ATTR, None)
    if plan is None:
        return []
    return list(plan.named_parameters())
