"""Where a model's dedicated runtime lives, and which of its parameters are dedicated.

``dedicate_params`` attaches its
:class:`~dmuon_compile.distributed._runtime.runtime.DedicatedRuntime` to the model; everything else
finds it with :func:`runtime_of`. Kept tiny so the optimizer does not import the distributed
runtime.
"""

from __future__ import annotations

from torch import nn

RUNTIME_ATTR = "_dmuon_runtime"  # the model attribute holding its DedicatedRuntime


def runtime_of(model: nn.Module | None):
    """The ``DedicatedRuntime`` ``dedicate_params`` attached to ``model``, else ``None``."""
    return getattr(model, RUNTIME_ATTR, None) if model is not None else None


def attach_runtime(model: nn.Module, runtime) -> None:
    setattr(model, RUNTIME_ATTR, runtime)


def dedicated_names(model: nn.Module) -> set[str]:
    """FQNs of the dedicated parameters of ``model`` (empty without ``dedicate_params``)."""
    runtime = runtime_of(model)
    return set(runtime.param_names()) if runtime is not None else set()


def dedicated_parameters(model: nn.Module) -> list:
    """``[(fqn, parameter)]`` of every dedicated parameter (the registered owner DTensors,
    the same list on every rank; ``to_local()`` is the master on its owner, empty elsewhere)."""
    runtime = runtime_of(model)
    return list(runtime.named_parameters()) if runtime is not None else []
