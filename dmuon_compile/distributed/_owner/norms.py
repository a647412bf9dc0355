"""The norm of an owner tensor (:class:`_OwnerNorm`) and the in-place scaling by a clip
coefficient: what lets ``torch.nn.utils.clip_grad_norm_`` run on a model with dedicated weights
(see ``_owner/tensor.py``'s module docstring). The op handlers that call these are in
``_owner/tensor.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from dmuon_compile import _compat
from dmuon_compile.distributed._compat import dtensor as _dt
from dmuon_compile.distributed._owner.meshes import MESHES, local_of


class _OwnerNorm(DTensor):
    """The norm of an owner tensor, a ``_NormPartial`` DTensor on its model's norm mesh.

    Its own type makes the two steps of ``clip_grad_norm_`` that mix it with FSDP2's results
    come here: ``torch.stack`` of the per-tensor norms puts every norm on the norm mesh first
    (FSDP2's norms of a TP model live on the data-parallel mesh, a slice of it), and
    ``grad.mul_(clip_coef)`` scales the local tensor of any gradient, whatever its mesh. Results
    of other ops on it (``+``, ``/``, ``clamp``, ``.to``) keep the type, so the clip coefficient
    does too.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack and args:
            args = (_on_norm_mesh(list(args[0])), *args[1:])
        elif func is Tensor.mul_ and isinstance(args[1], _OwnerNorm) and not kwargs:
            scale_locally(args[0], args[1])
            return args[0]
        elif func is torch._foreach_mul_ and isinstance(args[1], _OwnerNorm) and not kwargs:
            for t in args[0]:
                scale_locally(t, args[1])
            return None
        with _compat.disable_torch_function_subclass():
            out = func(*args, **kwargs)
        return _as_norm(out)


def _as_norm(out):
    if type(out) is DTensor:
        return _OwnerNorm(_dt.local_tensor(out), _dt.spec(out), requires_grad=False)
    return out


def _on_norm_mesh(tensors: list) -> list:
    """The norms on the mesh of the first owner norm: FSDP2's norms on a slice of it (the DP
    dims of a DP × TP mesh) get ``Replicate`` on the dims they lack (their gradients are the same
    on every TP rank). Norms on unrelated meshes are left for DTensor to refuse."""
    mesh = next(t.device_mesh for t in tensors if isinstance(t, _OwnerNorm))
    names = mesh.mesh_dim_names
    out = []
    for t in tensors:
        src = t.device_mesh if isinstance(t, DTensor) else None
        own = src.mesh_dim_names if src is not None else None
        if src is None or src == mesh or names is None or own is None or not set(own) <= set(names):
            out.append(t)
            continue
        placements = [t.placements[own.index(n)] if n in own else Replicate() for n in names]
        out.append(
            DTensor.from_local(
                _dt.local_tensor(t),
                mesh,
                placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        )
    return out


def norm_of(t: DTensor, ord) -> Tensor:
    """‖t's local tensor‖ (0 when empty) as an :class:`_OwnerNorm` on its model's norm mesh.

    Every piece of an owner tensor is held by one rank in the whole job (the owner, or one member
    of the owner group per shard), so partial over all dims of the norm mesh it sums each piece
    once; a plain weight of a TP model is held once per TP column, hence ``Replicate`` there.
    """
    local = _dt.local_tensor(t)
    value = (
        torch.linalg.vector_norm(local, ord)
        if local.numel()
        else torch.zeros((), dtype=t.dtype, device=local.device)
    )
    entry = MESHES.norm_of.get(id(t.device_mesh))
    if entry is None:
        return value
    mesh, partial, norm_partial = entry
    placements = [norm_partial(ord) if p else Replicate() for p in partial]
    plain = DTensor.from_local(
        value.reshape(()), mesh, placements, run_check=False, shape=torch.Size(()), stride=()
    )
    return _as_norm(plain)


def _value_of(factor):
    """A scale factor as a plain tensor or number (a DTensor's replicated value)."""
    if not isinstance(factor, DTensor):
        return factor
    if not all(p.is_replicate() for p in factor.placements):
        factor = factor.redistribute(factor.device_mesh, [Replicate()] * factor.device_mesh.ndim)
    return _dt.local_tensor(factor)


def scale_locally(t: Tensor, factor) -> None:
    """``t *= factor`` on ``t``'s local tensor (a scalar factor: right for every placement)."""
    local = local_of(t)
    if local.numel():
        value = _value_of(factor)
        local.mul_(value.to(local.device) if isinstance(value, Tensor) else value)
