"""Full (unsharded) model state dicts that include the dedicated parameters.

Dedicated matrices are not ``nn.Parameter``s of their modules any more (they live whole on
their owner rank, out of FSDP2's reach), so ``model.state_dict()`` — and torch's
``get_model_state_dict`` — do not contain them. :func:`get_model_state_dict` adds them,
fetched from their owners, under their original names; :func:`set_model_state_dict` loads such
a dict back (owners copy their matrices, FSDP2 takes the rest). The dict is topology-free:
a checkpoint saved on G ranks loads on any other G or mesh, which is the seed's advice for
topology changes (optimizer state is per owner and does not carry across them).
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from dmuon_compile.dedicated_registry import PLAN_ATTR

_quiet = threading.local()


@contextlib.contextmanager
def _no_state_dict_warning():
    previous = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = previous


def _runtime(model: nn.Module):
    return getattr(model, PLAN_ATTR, None)


def install_state_dict_warning(model: nn.Module) -> None:
    """Make a plain ``model.state_dict()`` warn that dedicated weights are not in it."""

    def hook(module, state_dict, prefix, local_metadata):
        if not getattr(_quiet, "on", False):
            warnings.warn(
                "model.state_dict() does not contain the dedicated parameters (they live whole on "
                "their owner ranks, outside FSDP2). Save with dmuon.get_model_state_dict(model) "
                "and load with dmuon.set_model_state_dict(model, state_dict).",
                UserWarning,
                stacklevel=3,
            )
        return None

    model._register_state_dict_hook(hook)


def _comm_device(runtime) -> torch.device:
    if runtime.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(runtime.mesh.device_type)


def _holders(runtime, device: torch.device) -> list[int]:
    """Global rank holding each dedicated parameter's master (identical on every rank)."""
    mine = torch.tensor(
        [dist.get_rank() + 1 if dp.master is not None else 0 for dp in runtime.params],
        dtype=torch.int64, device=device,
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    holders = [int(v) - 1 for v in mine.tolist()]
    missing = [dp.fqn for dp, h in zip(runtime.params, holders) if h < 0]
    if missing:
        raise RuntimeError(f"no rank holds the master of {missing[:4]}: the runtime state is broken")
    return holders


def get_model_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, Tensor]:
    """The model's full state dict, dedicated parameters included, under their original names.

    Collective: call it on every rank. FSDP2 parameters are gathered by
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True)``;
    each dedicated matrix is broadcast from its owner. With ``cpu_offload=True`` (default)
    tensors go to the CPU and — as in torch's full-state-dict convention — only rank 0 gets
    the dict (other ranks get ``{}``); with ``False`` every rank gets it on its device.
    Pending replicate broadcasts are drained first.

    Example::

        state = dmuon.get_model_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(state, "model.pt")
    """
    runtime = _runtime(model)
    options = dcp_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    with _no_state_dict_warning():
        if runtime is None:
            return dcp_state_dict.get_model_state_dict(model, options=options)
        runtime.wait_all()
        state = dcp_state_dict.get_model_state_dict(model, options=options)
    keep = not cpu_offload or dist.get_rank() == 0
    device = _comm_device(runtime)
    for dp, holder in zip(runtime.params, _holders(runtime, device)):
        if dp.master is not None and dist.get_rank() == holder:
            buf = dp.master.detach().to(device).contiguous()
        else:
            buf = torch.empty(dp.shape, dtype=dp.orig_dtype, device=device)
        dist.broadcast(buf, src=holder)
        if keep:
            state[dp.fqn] = buf.cpu() if cpu_offload else buf
    return state if keep else {}


def set_model_state_dict(model: nn.Module, state_dict: dict[str, Tensor], *, strict: bool = True) -> None:
    """Load a full state dict (from :func:`get_model_state_dict` or a single-process model).

    Collective: call it on every rank with the same full dict. Owners copy their dedicated
    matrices into their masters (the next forward unshards them; with HSDP they are broadcast
    to the other replicas before this returns); FSDP2 parameters are
    loaded by torch's ``set_model_state_dict(full_state_dict=True)``. ``strict=True`` raises a
    ``KeyError`` naming missing dedicated entries and torch's error for the rest.

    Example::

        state = torch.load("model.pt") if dist.get_rank() == 0 else None
        state = broadcast_object(state)  # or load the file on every rank
        dmuon.set_model_state_dict(model, state)
    """
    runtime = _runtime(model)
    options = dcp_state_dict.StateDictOptions(full_state_dict=True, strict=strict)
    if runtime is None:
        dcp_state_dict.set_model_state_dict(model, state_dict, options=options)
        return
    runtime.wait_all()
    dedicated = {dp.fqn: dp for dp in runtime.params}
    missing = [name for name in dedicated if name not in state_dict]
    if strict and missing:
        raise KeyError(
            f"set_model_state_dict: the state dict lacks dedicated parameters {missing[:6]}; pass "
            "a full dict from dmuon.get_model_state_dict (or strict=False to keep current values)"
        )
    for name, dp in dedicated.items():
        if dp.master is None or name not in state_dict:
            continue
        value = state_dict[name]
        if tuple(value.shape) != tuple(dp.shape):
            raise ValueError(
                f"set_model_state_dict: {name} has shape {tuple(value.shape)} in the state dict but "
                f"{tuple(dp.shape)} in the model"
            )
        with torch.no_grad():
            dp.master.copy_(value.to(device=dp.master.device, dtype=dp.master.dtype))
    if getattr(runtime, "replicated", False):
        runtime.publish(wait=True)  # HSDP: the other replicas take the loaded weights now
    rest = {k: v for k, v in state_dict.items() if k not in dedicated}
    with _no_state_dict_warning():
        dcp_state_dict.set_model_state_dict(model, rest, options=options)
