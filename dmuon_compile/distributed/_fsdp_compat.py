"""What the runtime reads from FSDP2, in one module.

Checked by tests/distributed/test_dedicated_runtime.py (gradient accumulation test).

Dedicated parameters never enter FSDP2 (see ``dedicate.py``), so the only thing the runtime
needs from FSDP is whether the user turned gradient synchronisation off with the public
``FSDPModule.set_requires_gradient_sync(False)`` (gradient accumulation). FSDP2 keeps that
flag on its parameter groups: ``state._fsdp_param_groups`` (torch 2.13) or
``state._fsdp_param_group`` (torch 2.11), attribute ``reduce_grads``. If a new torch moves it,
:func:`requires_gradient_sync` raises (never silently syncs or skips) and the compat test fails.
"""

from __future__ import annotations

from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch < 2.6
    FSDPModule = None  # type: ignore[assignment]


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        if single is None and not hasattr(state, "_fsdp_param_group"):
            raise RuntimeError(
                "dmuon_compile cannot find FSDP2's parameter groups on this torch version "
                "(neither _fsdp_param_groups nor _fsdp_param_group); update "
                "dmuon_compile/distributed/_fsdp_compat.py for it."
            )
        groups = [single] if single is not None else []
    return list(groups)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The ``fully_shard``-ed modules of ``model`` (empty without FSDP2)."""
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def requires_gradient_sync(model: nn.Module) -> bool:
    """False when any FSDP2 module of ``model`` has gradient sync turned off.

    ``set_requires_gradient_sync`` applies recursively by default, so any module with
    parameters reflects the user's choice; with no FSDP module at all the answer is True.
    """
    for module in fsdp_modules(model):
        for group in _param_groups(module):
            if group is None:
                continue
            if not hasattr(group, "reduce_grads"):
                raise RuntimeError(
                    "dmuon_compile cannot read FSDP2's reduce_grads flag on this torch version; "
                    "update dmuon_compile/distributed/_fsdp_compat.py for it."
                )
            if not group.reduce_grads:
                return False
    return True


def finish_aborted_backward(model: nn.Module) -> bool:
    """Run FSDP2's end-of-backward callback if a backward that queued it raised before it ran.

    FSDP2 queues that callback on the autograd engine at the first pre-backward hook; when
    backward raises, the engine drops it and FSDP2 stays mid-backward (parameters unsharded,
    ``post_backward_final_callback_queued`` left True, so no later backward queues it again
    and every later gradient goes wrong). Running it here reduces what the aborted backward
    left and returns every group to idle; ``Muon.zero_grad`` then drops those gradients.
    Collective when it runs (every rank raised at the same point). Returns whether it ran.
    """
    ran = False
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()
        ctx = getattr(state, "_state_ctx", None)
        if not getattr(state, "_is_root", False) or ctx is None:
            continue
        if not hasattr(ctx, "post_backward_final_callback_queued") or not hasattr(
            state, "_root_post_backward_final_callback"
        ):
            raise RuntimeError(
                "dmuon_compile cannot find FSDP2's end-of-backward state on this torch version; "
                "update dmuon_compile/distributed/_fsdp_compat.py for it."
            )
        if ctx.post_backward_final_callback_queued:
            state._root_post_backward_final_callback()
            ran = True
    return ran


def compute_dtypes(model: nn.Module) -> set:
    """The dtypes FSDP2 computes ``model``'s parameters in: each ``fully_shard`` call's
    ``MixedPrecisionPolicy.param_dtype``, or its parameters' own dtype without one."""
    dtypes = set()
    for module in fsdp_modules(model):
        policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        if dtype is not None:
            dtypes.add(dtype)
            continue
        for group in _param_groups(module):
            for fsdp_param in getattr(group, "fsdp_params", []) if group is not None else []:
                sharded = getattr(fsdp_param, "sharded_param", None)
                if sharded is not None and sharded.is_floating_point():
                    dtypes.add(sharded.dtype)
    return dtypes
