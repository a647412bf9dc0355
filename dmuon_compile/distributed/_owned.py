"""Owner tensors: a DTensor that lives whole on one rank, on that rank's one-rank mesh.

A dedicated weight is registered on its module as a DTensor of its global shape on the *owner
mesh* — ``DeviceMesh(device_type, [owner's global rank])``, built on every rank — with the
placement ``Replicate()``. On the owner its local tensor is the whole weight; on every other rank
DTensor's own convention for ranks outside a mesh applies: an empty local tensor, and ops that
return empty results. Its gradient and its optimizer state are DTensors of the same kind.

This is plain DTensor, with no placement of our own, so every DTensor op means what it says, and
``torch.distributed.checkpoint`` saves the owner's tensor with its global shape and loads any
saved layout back into it (another owner, FSDP2's ``Shard(0)``, a plain tensor on one process),
which is what lets checkpoints move between cluster shapes.

Checked on torch 2.11 and 2.13, and the reasons for the helpers in this package:

- ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, and DTensor refuses to stack
  norms of different meshes ("must have the same mesh", pytorch issue 180346). Use
  ``dmuon.clip_grad_norm_(model.parameters(), max_norm)``, which groups by mesh.
- ``DTensor.full_tensor()`` of a plain one-rank DTensor gives the tensor on its owner and an
  empty one elsewhere. Owner tensors are therefore of the subclass :class:`OwnerTensor`, whose
  ``full_tensor()`` is a broadcast from the owner (collective, like ``full_tensor()`` of FSDP2's
  DTensors) and whose ops return ``OwnerTensor`` again, so ``p.full_tensor()``, ``p.detach()
  .full_tensor()`` and torch's ``get_model_state_dict(full_state_dict=True)`` give the weight on
  every rank. ``dmuon.full_tensor(t)`` does the same for any tensor.
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
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return _rewrap(out)


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


def make_owned(local: Tensor | None, mesh: DeviceMesh, shape, dtype: torch.dtype,
               device: torch.device) -> DTensor:
    """A DTensor of global ``shape`` on the owner ``mesh``; ``local`` (the owner's whole tensor,
    shared, not copied) or ``None`` off the owner."""
    shape = torch.Size(shape)
    if local is None:
        local = empty_local(dtype, device)
    elif tuple(local.shape) != tuple(shape):
        raise ValueError(f"the owner's tensor has shape {tuple(local.shape)}, expected {tuple(shape)}")
    stride = torch.empty(shape, device="meta").stride()
    plain = DTensor.from_local(local, mesh, [Replicate()], run_check=False, shape=shape, stride=stride)
    return OwnerTensor(plain._local_tensor, plain._spec, requires_grad=False)


def wrap_like(local: Tensor | None, like: DTensor) -> DTensor:
    """An owner DTensor with ``like``'s mesh, shape and dtype around ``local`` (``None``: empty).

    The per-step path (gradients): reuses ``like``'s spec, about 20x cheaper than
    :func:`make_owned` (measured 11 µs against 210 µs on CPU).
    """
    if local is None:
        local = empty_local(like.dtype, local_of(like).device)
    return OwnerTensor(local, like._spec, requires_grad=False)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (the whole tensor on its owner, empty elsewhere), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_owned(t) -> bool:
    """True for a DTensor on an owner mesh (a dedicated weight, its gradient or its state)."""
    if not isinstance(t, DTensor):
        return False
    mesh = t.device_mesh
    if id(mesh) in _OWNER_OF_MESH:  # the per-step path: the very mesh objects made here
        return True
    return mesh.ndim == 1 and mesh.size() == 1 and _OWNER_MESHES.get(
        (mesh.device_type, int(mesh.mesh.reshape(-1)[0]))) == mesh


def owner_rank(t: DTensor) -> int:
    """Global rank that holds ``t`` (an owner tensor)."""
    rank = _OWNER_OF_MESH.get(id(t.device_mesh))
    return rank if rank is not None else int(t.device_mesh.mesh.reshape(-1)[0])


def same_layout(a, b) -> bool:
    """Both owner tensors of the same global shape on the same owner."""
    return is_owned(a) and is_owned(b) and owner_rank(a) == owner_rank(b) and tuple(a.shape) == tuple(b.shape)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor on every rank. Collective for owner tensors (a broadcast from the owner)
    and for other DTensors (``full_tensor()``); plain tensors come back as they are.

    Example::

        w = dmuon.full_tensor(model.layers[0].mlp.up_proj.weight)   # on every rank
    """
    if not isinstance(t, DTensor):
        return t
    if not is_owned(t):
        return t.full_tensor()
    local = local_of(t)
    if dist.get_rank() == owner_rank(t):
        buf = local.clone(memory_format=torch.contiguous_format)
    else:
        buf = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    dist.broadcast(buf, src=owner_rank(t))
    return buf
