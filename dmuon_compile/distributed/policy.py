"""Mixed-precision policy of the dedicated parameters (``dedicate_params(param_policy=...)``).

Mirrors FSDP2's ``MixedPrecisionPolicy`` fields that matter here: ``param_dtype`` is the dtype
of the unsharded compute copy used in forward/backward; ``reduce_dtype`` the dtype of the
gradient reduce to the owner. The master copy on the owner keeps the parameter's own dtype.
Without a ``reduce_dtype`` here the reduce follows the ``MixedPrecisionPolicy.reduce_dtype`` of
the ``fully_shard`` module that would manage the weight, else ``param_dtype`` (the gradients'
dtype), as FSDP2 reduces its own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of one kind of dedicated parameter; ``None`` inherits the parameter's dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ParamPolicy:
    """``param_policy`` for ``dedicate_params``: ``defaults`` applies to every parameter.

    Example::

        policy = dmuon.ParamPolicy(defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32))
        dmuon.dedicate_params(model, mesh, param_policy=policy)
    """

    defaults: MixedPrecision = field(default_factory=MixedPrecision)


def resolve_dtypes(param_dtype_of: torch.dtype, param_policy=None, compute_dtype=None):
    """(param_dtype, reduce_dtype) for a parameter of dtype ``param_dtype_of``; ``reduce_dtype``
    is None when the policy sets none (the runtime then follows FSDP2's, see the module doc).

    ``param_policy`` is any object with ``.defaults.param_dtype`` (and optionally
    ``.defaults.reduce_dtype``), or FSDP2's ``MixedPrecisionPolicy`` itself. The legacy
    ``compute_dtype`` maps to ``param_dtype``; giving both with different values is an error.
    """
    policy_dtype, reduce_dtype = None, None
    if param_policy is not None:
        defaults = getattr(param_policy, "defaults", param_policy)
        if not hasattr(defaults, "param_dtype"):
            raise TypeError(
                "param_policy must have .defaults.param_dtype (e.g. dmuon.ParamPolicy("
                "defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16))), got "
                f"{type(param_policy).__name__}"
            )
        policy_dtype = defaults.param_dtype
        reduce_dtype = getattr(defaults, "reduce_dtype", None)
    if compute_dtype is not None and policy_dtype is not None and compute_dtype != policy_dtype:
        raise ValueError(
            f"compute_dtype={compute_dtype} conflicts with param_policy.defaults.param_dtype="
            f"{policy_dtype}; compute_dtype is the legacy name of param_dtype: pass only one"
        )
    param_dtype = policy_dtype or compute_dtype or param_dtype_of
    for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(f"{name} must be a floating torch.dtype, got {dt!r}")
    return param_dtype, reduce_dtype
