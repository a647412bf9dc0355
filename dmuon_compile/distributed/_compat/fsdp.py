"""What the runtime reads from FSDP2, in one module (and how FSDP2 joins mesh dims:
:func:`joined_mesh`).

Checked by tests/distributed/test_grad_scaling.py and test_dedicated_runtime.py.

Dedicated parameters never enter FSDP2 (see ``dedicate.py``), but their gradients follow the
reduction settings of the ``fully_shard`` module that would manage them were they not dedicated
(:func:`managing_module`), read once per backward (:func:`grad_reduction`):

- ``set_requires_gradient_sync`` (``reduce_grads``): gradient accumulation without sync;
- ``set_gradient_divide_factor`` (``gradient_divide_factor``; ``set_reduce_scatter_divide_factor``
  is its deprecated alias): the reduced gradient is the sum over the data-parallel ranks divided
  by it; ``None`` means the mean over every data-parallel rank (shard × replicate with HSDP);
- ``MixedPrecisionPolicy.reduce_dtype`` (the ``fully_shard`` call's ``_mp_policy``);
- ``set_reshard_after_backward`` (``reshard_after_backward``): during gradient accumulation
  (sync off) the groups stay unsharded after backward, so the next micro-batch's forward
  gathers nothing (torch's pipeline schedules set it so for every micro-batch but the last).

FSDP2 keeps the first two and the last on its parameter groups: ``state._fsdp_param_groups``
(torch 2.13) or ``state._fsdp_param_group`` (torch 2.11); a module without parameters of its
own has none and stores no setting. ``set_all_reduce_hook`` (``_all_reduce_hook``), a user
callback on FSDP2's own reduce output, cannot run on dedicated gradients: :func:`grad_reduction`
raises. If a new torch moves any of these, the readers raise (never silently sync, skip or
mis-scale) and the tests fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from dmuon_compile._compat import (
    PrivateAPI,
    TorchInternalsError,
    caller_frame,
    torch_internals_error,
)
from dmuon_compile.distributed._compat import dtensor as _dtensor_compat

_MODULE = "distributed/_compat/fsdp.py"
_GET_STATE = PrivateAPI(
    "torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "FSDP2's gradient settings", _MODULE
)
_MANAGED_STATES = PrivateAPI(
    "torch.distributed.fsdp._fully_shard._fsdp_init",
    "_get_managed_states",
    "keeping dedicated weights out of fully_shard",
    _MODULE,
)
_CONCATENATE = "_concatenate"  # DeviceMesh._concatenate: how FSDP2 joins DP and TP meshes
_FSDP_PACKAGE = "torch.distributed.fsdp"


def _state(module):
    _GET_STATE.get()  # raises if FSDP2 no longer has it
    return module._get_fsdp_state()


def _require(obj, attr: str, feature: str):
    if not hasattr(obj, attr):
        raise torch_internals_error(f"{type(obj).__name__}.{attr} (FSDP2)", feature, _MODULE)
    return getattr(obj, attr)


def _param_groups(module) -> list:
    state = _state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        if single is None and not hasattr(state, "_fsdp_param_group"):
            raise torch_internals_error(
                "FSDPState._fsdp_param_groups (2.13) or _fsdp_param_group (2.11)",
                "FSDP2's gradient settings for dedicated weights",
                _MODULE,
            )
        groups = [single] if single is not None else []
    return list(groups)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The ``fully_shard``-ed modules of ``model`` (empty without FSDP2)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass(frozen=True)
class GradReduction:
    """How FSDP2 reduces the gradients of the parameters of one ``fully_shard`` module."""

    sync: bool = True  # set_requires_gradient_sync
    divide_factor: float | None = None  # set_gradient_divide_factor; None: the mean
    reduce_dtype: torch.dtype | None = None  # MixedPrecisionPolicy.reduce_dtype; None: grad's
    reshard_after_backward: bool = True  # set_reshard_after_backward


def _update_hint(what: str) -> str:
    return str(torch_internals_error(f"FSDP2's {what}", "FSDP2's gradient settings", _MODULE))


def managing_module(model: nn.Module, fqn: str) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the ``fully_shard`` module that would manage parameter ``fqn``
    were it not dedicated: its nearest FSDP ancestor (its own module included) with parameters
    of its own, since a module without any keeps no gradient settings. ``None`` without one."""
    parts = fqn.split(".")[:-1]
    for k in range(len(parts), -1, -1):
        path = ".".join(parts[:k])
        module = model.get_submodule(path)
        if isinstance(module, FSDPModule) and _param_groups(module):
            return path, module
    return None


def grad_reduction(module: nn.Module, path: str = "<root>") -> GradReduction:
    """The gradient reduction settings of the ``fully_shard``-ed ``module`` (see the module doc).

    Raises when FSDP2 would pass the gradients through a user hook the dedicated reduce cannot
    run (``set_all_reduce_hook``), or when this torch keeps the settings elsewhere.
    """
    settings = set()
    for group in _param_groups(module):
        if group is None:
            continue
        for attr in (
            "reduce_grads",
            "gradient_divide_factor",
            "_all_reduce_hook",
            "reshard_after_backward",
        ):
            if not hasattr(group, attr):
                raise TorchInternalsError(_update_hint(f"parameter-group attribute {attr!r}"))
        if group._all_reduce_hook is not None:
            raise RuntimeError(
                f"dmuon_compile: fully_shard module {path!r} has an all-reduce hook "
                "(set_all_reduce_hook), which FSDP2 runs on its own reduced gradients only; the "
                "dedicated weights it would manage cannot go through it. Fix: exclude those "
                "weights from dmuon.dedicate_params (predicate=), or drop the hook."
            )
        factor = group.gradient_divide_factor
        reshard = bool(group.reshard_after_backward)
        settings.add((bool(group.reduce_grads), None if factor is None else float(factor), reshard))
    if len(settings) > 1:  # torch 2.13 per-parameter meshes: groups set one by one
        raise RuntimeError(
            f"dmuon_compile: the parameter groups of fully_shard module {path!r} have different "
            "gradient settings (requires_gradient_sync, divide factor, reshard_after_backward): "
            f"{sorted(settings)}. "
            "Fix: set them on the module (FSDPModule.set_...), which sets every group."
        )
    sync, factor, reshard = settings.pop() if settings else (True, None, True)
    state = _state(module)
    if not hasattr(state, "_mp_policy"):
        raise TorchInternalsError(_update_hint("MixedPrecisionPolicy of a fully_shard module"))
    return GradReduction(sync, factor, state._mp_policy.reduce_dtype, reshard)


def split_divide_factor(factor: float, reduce_dtype: torch.dtype) -> tuple[float | None, float]:
    """``(before, after)``: the divisions around a sum-reduce in ``reduce_dtype``, as FSDP2
    splits them: all after the sum in fp32/bf16; otherwise (fp16) a power of two near the
    square root before (so the sum does not overflow) and the rest after."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, factor
    pre = 1
    while math.fmod(factor, pre) == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


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
        state = _state(module)
        feature = "Muon.zero_grad after a failed backward"
        if not _require(state, "_is_root", feature):  # None before FSDP2's lazy init
            continue
        ctx = _require(state, "_state_ctx", feature)
        _require(state, "_root_post_backward_final_callback", feature)
        if _require(ctx, "post_backward_final_callback_queued", feature):
            state._root_post_backward_final_callback()
            ran = True
    return ran


def compute_dtypes(model: nn.Module) -> set:
    """The dtypes FSDP2 computes ``model``'s parameters in: each ``fully_shard`` call's
    ``MixedPrecisionPolicy.param_dtype``, or its parameters' own dtype without one."""
    dtypes = set()
    feature = "the dedicated vs FSDP2 compute dtype check"
    for module in fsdp_modules(model):
        dtype = _require(_state(module), "_mp_policy", feature).param_dtype
        if dtype is not None:
            dtypes.add(dtype)
            continue
        for group in _param_groups(module):
            for fsdp_param in _require(group, "fsdp_params", feature) if group is not None else []:
                sharded = _require(fsdp_param, "sharded_param", feature)
                if sharded is not None and sharded.is_floating_point():
                    dtypes.add(sharded.dtype)
    return dtypes


def cpu_offloaded(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> path of its fully_shard module`` for the parameters FSDP2 keeps in
    host memory (``fully_shard(offload_policy=CPUOffloadPolicy())``; torchtitan's
    ``training.enable_cpu_offload``): there an optimizer steps them on the CPU."""
    out: dict[int, str] = {}
    feature = "the FSDP2 CPU offload check"
    paths = {id(m): name for name, m in model.named_modules()}
    for module in fsdp_modules(model):
        for group in _param_groups(module):
            for fsdp_param in _require(group, "fsdp_params", feature) if group is not None else []:
                if _require(fsdp_param, "offload_to_cpu", feature):
                    sharded = _require(fsdp_param, "sharded_param", feature)
                    out[id(sharded)] = paths.get(id(module), "<root>") or "<root>"
    return out


def joined_mesh(meshes) -> DeviceMesh:
    """The mesh whose dims are the dims of ``meshes`` (slices of one mesh), in order: how FSDP2
    builds the DP × TP mesh of a TP parameter (``DeviceMesh._concatenate``), so it equals the
    mesh FSDP2's parameters and norms live on. Names are read, never required to be particular
    ones, and the slices may come from a mesh unflattened from a flattened 1-D root (torchtitan's
    ``ParallelDims``). Raises ``RuntimeError`` for overlapping dims or unrelated meshes."""
    meshes = list(meshes)
    if hasattr(DeviceMesh, _CONCATENATE):
        return getattr(DeviceMesh, _CONCATENATE)(meshes)
    # a torch without _concatenate: the slices' dims named on their common root (which raises
    # when this torch has no root mesh either)
    root = _dtensor_compat.root_mesh(meshes[0]) or meshes[0]
    return root[tuple(n for m in meshes for n in m.mesh_dim_names)]


def check_parameter_collection() -> None:
    """Raise unless ``fully_shard`` still collects a module's parameters by calling
    ``named_parameters(recurse=False)`` from its own package, which is what lets the holder
    class hide dedicated weights from it (``_owner/holder.py``, :func:`called_by_fsdp`)."""
    collect = _MANAGED_STATES.get()
    code = getattr(collect, "__code__", None)
    names = code.co_names if code is not None else ()
    if "named_parameters" not in names or not collect.__module__.startswith(_FSDP_PACKAGE):
        raise torch_internals_error(
            "fully_shard collecting parameters with named_parameters(recurse=False) "
            "(_get_managed_states)",
            "keeping dedicated weights out of fully_shard",
            _MODULE,
        )


def called_by_fsdp(depth: int) -> bool:
    """Whether the function ``depth`` frames above the caller of this one is FSDP2's code.

    A stack-frame check, kept because nothing else distinguishes the call: the user calls
    ``fully_shard`` after ``dedicate_params`` returned, so no code of ours runs around it to
    set a flag, and FSDP2 offers no hook before it collects parameters (only
    ``ignored_params=``, an argument of the user's own call)."""
    return caller_frame(depth + 1).f_globals.get("__name__", "").startswith(_FSDP_PACKAGE)
