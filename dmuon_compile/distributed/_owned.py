"""Owner tensors: a DTensor that lives whole on one rank, on that rank's one-rank mesh.

A dedicated weight is registered on its module as a DTensor of its global shape on the *owner
mesh* — ``DeviceMesh(device_type, [owner's global rank])``, built on every rank — with the
placement ``Replicate()``. On the owner its local tensor is the whole weight; on every other rank
DTensor's own convention for ranks outside a mesh applies: an empty local tensor, and ops that
return empty results. Its gradient and its optimizer state are DTensors of the same kind.

The placement is DTensor's own (no placement of ours), so every DTensor op means what it says, and
``torch.distributed.checkpoint`` saves the owner's tensor with its global shape and loads any
saved layout back into it (another owner, FSDP2's ``Shard(0)``, a plain tensor on one process),
which is what lets checkpoints move between cluster shapes.

Two PyTorch tools assume a whole model on one mesh; the subclass :class:`OwnerTensor` makes both
work (checked on torch 2.13; the DCP behaviour also on 2.11):

- ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, and DTensor refuses to stack
  norms of different meshes ("must have the same mesh", pytorch issue 180346). The norm of an
  :class:`OwnerTensor` is therefore given on the *data-parallel mesh* of its model (the mesh
  FSDP2's norms live on), as a ``_NormPartial`` whose only non-zero part is the owner's: stacked
  with FSDP2's norms and reduced, it is the exact global norm. The in-place scaling that follows
  (``_foreach_mul_`` / ``mul_``) scales the owner's local tensor. So torch's
  ``clip_grad_norm_(model.parameters(), max_norm)`` works unchanged;
  ``dmuon.clip_grad_norm_`` is the same with a plain-tensor result.
- ``DTensor.full_tensor()`` of a plain one-rank DTensor gives the tensor on its owner and an
  empty one elsewhere. Owner tensors are therefore of the subclass :class:`OwnerTensor`, whose
  ``full_tensor()`` is a broadcast from the owner (collective, like ``full_tensor()`` of FSDP2's
  DTensors) and whose ops return ``OwnerTensor`` again, so ``p.full_tensor()`` and ``p.detach()
  .full_tensor()`` give the weight on every rank. ``dmuon.full_tensor(t)`` does the same for any
  tensor. (torch's ``get_model_state_dict(full_state_dict=True)`` takes a ``Replicate`` DTensor's
  local tensor without ``full_tensor()``: use ``dmuon.get_model_state_dict``.)
- A shard-like placement on FSDP2's mesh (``Shard(0)`` subclass) was tried first and dropped:
  DTensor's sharding rules rebuild plain ``Shard(0)`` for its outputs (wrong labels), and its
  foreach rules mixed it up with FSDP2's own ``Shard(0)`` gradients of the same shape (a hang).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

_OWNER_MESHES: dict[tuple[str, int], DeviceMesh] = {}
_OWNER_OF_MESH: dict[int, int] = {}  # id(owner mesh) -> the owner's global rank (hot-path lookups)
_DP_MESH_OF: dict[int, DeviceMesh] = {}  # id(owner mesh) -> the data-parallel mesh of its model
# id(mesh) of the registered weights of tensor-parallel models: their owners differ per TP
# column, so a whole-job broadcast from "the" owner would hang (see full_tensor).
_TP_MODEL_MESHES: set[int] = set()
_aten = torch.ops.aten
_NO_BACKEND = "_init_backend" in inspect.signature(DeviceMesh.__init__).parameters


class OwnerTensor(DTensor):
    """A DTensor on an owner mesh (see the module docstring): ``full_tensor()`` is collective.

    Everything else is DTensor's; results of ops on it that land on an owner mesh are
    ``OwnerTensor`` too (``detach``, ``zeros_like``, arithmetic).
    """

    def full_tensor(self, *, grad_placements=None) -> Tensor:  # noqa: ARG002 - DTensor's signature
        return full_tensor(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _CLIP_OPS.get(func)
        if handler is not None:
            done, out = handler(args, kwargs)
            if done:
                return out
        return _rewrap(super().__torch_dispatch__(func, types, args, kwargs))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch 2.11 dispatches every DTensor subclass through DTensor's C++ fast path, which
        # never calls __torch_dispatch__ above: the same handlers and re-wrapping, one level
        # up (torch 2.13 reaches both; the clip ops are then handled here first).
        kwargs = kwargs or {}
        handler = _CLIP_FUNCTIONS.get(func)
        if handler is not None:
            done, out = handler(args, kwargs)
            if done:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return _rewrap(func(*args, **kwargs))


def set_dp_mesh(mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """Record the data-parallel mesh (FSDP2's) that owner ``mesh``'s norms are given on."""
    _DP_MESH_OF[id(mesh)] = dp_mesh


def _norm_on_dp_mesh(t: OwnerTensor, ord) -> Tensor:
    """‖t‖ as a ``_NormPartial`` DTensor on its model's data-parallel mesh (0 off the owner)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    local = t._local_tensor
    value = (
        torch.linalg.vector_norm(local, ord)
        if local.numel()
        else torch.zeros((), dtype=t.dtype, device=local.device)
    )
    dp_mesh = _DP_MESH_OF.get(id(t.device_mesh))
    if dp_mesh is None:
        return value
    return DTensor.from_local(
        value.reshape(()),
        dp_mesh,
        [_NormPartial(ord)] * dp_mesh.ndim,
        run_check=False,
        shape=torch.Size(()),
        stride=(),
    )


def _split(tensors):
    mine = [i for i, t in enumerate(tensors) if isinstance(t, OwnerTensor)]
    others = [t for t in tensors if not isinstance(t, OwnerTensor)]
    return mine, others


def _foreach_norm(args, kwargs):
    tensors = list(args[0])
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if (len(args) > 2 and args[2] is not None) or kwargs.get("dtype") is not None:
        return False, None
    mine, others = _split(tensors)
    rest = iter(torch._foreach_norm(others, ord) if others else [])
    return True, [
        _norm_on_dp_mesh(t, ord) if i in mine else next(rest) for i, t in enumerate(tensors)
    ]


def _vector_norm(args, kwargs):
    t = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if (
        not isinstance(t, OwnerTensor)
        or dim is not None
        or keepdim
        or kwargs.get("dtype") is not None
    ):
        return False, None
    return True, _norm_on_dp_mesh(t, ord)


def _scale_locally(t: OwnerTensor, factor) -> None:
    local = t._local_tensor
    if local.numel():
        local.mul_(local_of(factor).to(local.device) if isinstance(factor, Tensor) else factor)


def _foreach_mul_(args, kwargs):
    tensors, factor = list(args[0]), args[1]
    if isinstance(factor, (list, tuple)) or isinstance(factor, OwnerTensor):
        return False, None
    mine, others = _split(tensors)
    for i in mine:
        _scale_locally(tensors[i], factor)
    if others:
        torch._foreach_mul_(others, factor)
    return True, None


def _mul_(args, kwargs):
    t, factor = args[0], args[1]
    if (
        not isinstance(t, OwnerTensor)
        or isinstance(factor, OwnerTensor)
        or (isinstance(factor, Tensor) and factor.numel() != 1)
    ):
        return False, None
    _scale_locally(t, factor)
    return True, t


# What torch.nn.utils.clip_grad_norm_ / get_total_norm call on gradients (2.11 and 2.13).
_CLIP_OPS = {
    _aten._foreach_norm.Scalar: _foreach_norm,
    _aten.linalg_vector_norm.default: _vector_norm,
    _aten._foreach_mul_.Tensor: _foreach_mul_,
    _aten._foreach_mul_.Scalar: _foreach_mul_,
    _aten.mul_.Tensor: _mul_,
    _aten.mul_.Scalar: _mul_,
}


# The same handlers at the torch-function level (what clip_grad_norm_ calls).
_CLIP_FUNCTIONS = {
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch._foreach_mul_: _foreach_mul_,
    Tensor.mul_: _mul_,
}


def _rewrap(out):
    if type(out) is DTensor and id(out.device_mesh) in _OWNER_OF_MESH:
        return OwnerTensor(out._local_tensor, out._spec, requires_grad=out.requires_grad)
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap(o) for o in out)
    return out


def owner_mesh(device_type: str, global_rank: int) -> DeviceMesh:
    """The one-rank mesh of ``global_rank`` (cached; built the same way on every rank).

    It needs no process group (a one-rank DTensor never communicates), so none is created where
    the torch version allows it.
    """
    key = (device_type, int(global_rank))
    mesh = _OWNER_MESHES.get(key)
    if mesh is None:
        kwargs = {"_init_backend": False} if _NO_BACKEND else {}
        mesh = DeviceMesh(device_type, [int(global_rank)], **kwargs)
        _OWNER_MESHES[key] = mesh
        _OWNER_OF_MESH[id(mesh)] = int(global_rank)
    return mesh


def empty_local(dtype: torch.dtype, device: torch.device) -> Tensor:
    """What a rank outside the owner mesh holds (DTensor's convention: an empty tensor)."""
    return torch.empty(0, dtype=dtype, device=device)


def make_owned(
    local: Tensor | None,
    mesh: DeviceMesh,
    shape,
    dtype: torch.dtype,
    device: torch.device,
    requires_grad: bool = False,
) -> DTensor:
    """An :class:`OwnerTensor` of global ``shape`` on the owner ``mesh``; ``local`` (the owner's
    whole tensor, shared, not copied) or ``None`` off the owner."""
    shape = torch.Size(shape)
    if local is None:
        local = empty_local(dtype, device)
    elif tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"the owner's tensor has shape {tuple(local.shape)}, expected {tuple(shape)}"
        )
    stride = torch.empty(shape, device="meta").stride()
    plain = DTensor.from_local(
        local, mesh, [Replicate()], run_check=False, shape=shape, stride=stride
    )
    return OwnerTensor(plain._local_tensor, plain._spec, requires_grad=requires_grad)


def wrap_like(local: Tensor | None, like: DTensor) -> DTensor:
    """An owner DTensor with ``like``'s mesh, shape and dtype around ``local`` (``None``: empty).

    The per-step path (gradients): reuses ``like``'s spec, much cheaper than
    :func:`make_owned`, which builds a new one.
    """
    if local is None:
        local = empty_local(like.dtype, local_of(like).device)
    return OwnerTensor(local, like._spec, requires_grad=False)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (the whole tensor on its owner, empty elsewhere), else "
    "``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_owned(t) -> bool:
    """True for a DTensor on an owner mesh (a dedicated weight, its gradient or its state)."""
    if not isinstance(t, DTensor):
        return False
    mesh = t.device_mesh
    if id(mesh) in _OWNER_OF_MESH:  # the per-step path: the very mesh objects made here
        return True
    return (
        mesh.ndim == 1
        and mesh.size() == 1
        and _OWNER_MESHES.get((mesh.device_type, int(mesh.mesh.reshape(-1)[0]))) == mesh
    )


def owner_rank(t: DTensor) -> int:
    """Global rank that holds ``t`` (an owner tensor)."""
    rank = _OWNER_OF_MESH.get(id(t.device_mesh))
    return rank if rank is not None else int(t.device_mesh.mesh.reshape(-1)[0])


def same_layout(a, b) -> bool:
    """Both owner tensors of the same global shape on the same owner."""
    return (
        is_owned(a)
        and is_owned(b)
        and owner_rank(a) == owner_rank(b)
        and tuple(a.shape) == tuple(b.shape)
    )


def mark_tp_model(meshes) -> None:
    """Record the meshes of a tensor-parallel model's registered weights (``dedicate_params``)."""
    _TP_MODEL_MESHES.update(id(m) for m in meshes)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor on every rank. Collective for owner tensors (a broadcast from the owner)
    and for other DTensors (``full_tensor()``); plain tensors come back as they are.

    Example::

        w = dmuon.full_tensor(model.layers[0].mlp.up_proj.weight)   # on every rank
    """
    if not isinstance(t, DTensor):
        return t
    if id(t.device_mesh) in _TP_MODEL_MESHES:
        raise NotImplementedError(
            "dmuon.full_tensor / get_model_state_dict: not supported yet for the dedicated "
            "weights of a tensor-parallel model (their owners differ per TP rank). Save and load "
            "TP models with torch.distributed.checkpoint (get_state_dict / set_state_dict), "
            "which reshards them to any layout, one process included."
        )
    if not is_owned(t):
        return t.full_tensor()
    local = local_of(t)
    if dist.get_rank() == owner_rank(t):
        buf = local.clone(memory_format=torch.contiguous_format)
    else:
        buf = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    dist.broadcast(buf, src=owner_rank(t))
    return buf
