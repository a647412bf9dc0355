"""Full (unsharded) model state dicts, dedicated parameters included.

Dedicated weights are registered parameters (DTensors on their owners' one-rank meshes), so
``model.state_dict()`` and torch's ``torch.distributed.checkpoint.state_dict`` functions see them
under their original names, and DCP (``dcp.save`` / ``dcp.load`` of ``get_state_dict(model, opt)``)
checkpoints and reshards them like FSDP2's parameters: that is the path for resuming on another
cluster shape. torch's ``get_model_state_dict(full_state_dict=True)`` gathers each DTensor with
``redistribute(Replicate)``, which an owner tensor answers with the whole weight on every rank
(a plain dedicated weight, or a TP weight's shards from its owner group), so that works too,
and so do torch's full-state loads, ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``full_state_dict=True`` (with or without ``broadcast_from_rank0``; ``_owner/tensor.py`` says how),
the HF Trainer's FSDP2 ``FULL_STATE_DICT`` checkpoints included. The two helpers here are the
full-state-dict pair: one dict with every tensor whole and a copy (for ``torch.save``, HF
``save_pretrained(state_dict=...)``, or a single-process model), and its way back in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from dmuon_compile.dedicated_registry import runtime_of


def _whole_shape(dp) -> tuple:
    """The weight's shape in a full dict (a TP weight: its global shape, not this shard's)."""
    shape = getattr(dp, "global_shape", None)
    return tuple(shape if shape is not None else dp.shape)


def _piece(dp, value: Tensor, runtime) -> Tensor:
    """This rank's part of a full ``value``: all of it, or its TP shard (shard t on TP rank t)."""
    if getattr(dp, "global_shape", None) is None:
        return value
    size = dp.shape[dp.shard_dim]
    return value.narrow(dp.shard_dim, runtime.tp.info.rank * size, size)


def _live_storages(model: nn.Module) -> set[int]:
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


def get_model_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, Tensor]:
    """The model's full state dict, dedicated parameters included, as copies.

    Collective: call it on every rank. Every DTensor (FSDP2 shards and dedicated weights alike)
    is gathered whole by ``torch.distributed.checkpoint.state_dict.get_model_state_dict(
    full_state_dict=True)`` (TP models included). With ``cpu_offload=True`` (default) tensors go
    to the CPU and — as in torch's full-state-dict convention — only rank 0 gets the dict (other
    ranks get ``{}``); with ``False`` every rank gets it on its device. Every tensor is a copy:
    later steps do not change it. Pending replicate broadcasts and TP updates are applied first.

    Example::

        state = dmuon.get_model_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(state, "model.pt")   # or hf_model.save_pretrained(dir, state_dict=state)
    """
    runtime = runtime_of(model)
    if runtime is not None:
        runtime.wait_all()
    options = dcp_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    state = dcp_state_dict.get_model_state_dict(model, options=options)
    keep = not cpu_offload or not dist.is_initialized() or dist.get_rank() == 0
    live = _live_storages(model)
    state = {
        k: v.clone()
        if isinstance(v, Tensor) and v.numel() and v.untyped_storage().data_ptr() in live
        else v
        for k, v in state.items()
    }
    return state if keep else {}


def set_model_state_dict(
    model: nn.Module, state_dict: dict[str, Tensor], *, strict: bool = True
) -> None:
    """Load a full state dict (from :func:`get_model_state_dict` or a single-process model).

    Collective: call it on every rank with the same full dict. Owners copy their dedicated
    matrices (a TP weight: each owner group member its shard) into their masters (the next
    forward unshards them; with HSDP they are broadcast to the other replicas before this
    returns); FSDP2 parameters are loaded by torch's
    ``set_model_state_dict(full_state_dict=True)``. ``strict=True`` raises a ``KeyError`` naming
    missing dedicated entries and torch's error for the rest; a wrong shape raises a ``ValueError``.

    Example::

        state = torch.load("model.pt")      # the same full dict on every rank
        dmuon.set_model_state_dict(model, state)
    """
    runtime = runtime_of(model)
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
    if strict:  # every check before anything is loaded: a bad dict changes nothing
        expected = set(
            dcp_state_dict.get_model_state_dict(
                model, options=dcp_state_dict.StateDictOptions(full_state_dict=False)
            )
        )
        absent = sorted(expected - set(state_dict))
        if absent:
            raise KeyError(f"set_model_state_dict: the state dict lacks {absent[:6]}")
    for name, dp in dedicated.items():
        value = state_dict.get(name)
        if value is not None and tuple(value.shape) != _whole_shape(dp):
            raise ValueError(
                f"set_model_state_dict: {name} has shape {tuple(value.shape)} in the state dict "
                f"but {_whole_shape(dp)} in the model"
            )
    for name, dp in dedicated.items():
        if name not in state_dict:
            continue
        value = _piece(dp, state_dict[name], runtime)
        if dp.master is not None:
            with torch.no_grad():
                dp.master.copy_(value.to(device=dp.master.device, dtype=dp.master.dtype))
    if getattr(runtime, "replicated", False):
        runtime.publish(wait=True)  # HSDP: the other replicas take the loaded weights now
    rest = {k: v for k, v in state_dict.items() if k not in dedicated}
    if dist.is_initialized() or rest:
        dcp_state_dict.set_model_state_dict(
            model, rest, options=dcp_state_dict.StateDictOptions(full_state_dict=True, strict=False)
        )
