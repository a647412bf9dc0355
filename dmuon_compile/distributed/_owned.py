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

A TP-sharded dedicated weight (``_tp/``) is an ``OwnerTensor`` too, on its *owner group*
mesh (the TP ranks at its DP owner coordinate) with its TP placement ``Shard(d)``: shard ``t`` on
the group's ``t``-th rank, empty elsewhere. Every piece of an owner tensor is thus held by one
rank of the whole job (a plain weight of a TP model: by one rank per TP column, the same copy).

Two PyTorch tools assume a whole model on one mesh; :class:`OwnerTensor` makes both work (checked
on torch 2.13 and 2.11):

- ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, and DTensor refuses to stack
  norms of different meshes ("must have the same mesh", pytorch issue 180346). The norm of an
  owner tensor is therefore given on its model's *norm mesh* — FSDP2's data-parallel mesh, or
  the DP × TP mesh of a TP model — as a ``_NormPartial`` whose only non-zero parts are the
  holders' (``Replicate`` over TP for a plain weight of a TP model). It is an
  :class:`_OwnerNorm`, so ``torch.stack`` of the norms comes here and lifts FSDP2's norms of a
  TP model (on the DP slice) onto the DP × TP mesh; stacked and reduced, it is the exact global
  norm. The in-place scaling that follows (``_foreach_mul_`` / ``mul_``) scales local tensors.
  So torch's ``clip_grad_norm_(model.parameters(), max_norm)`` works unchanged;
  ``dmuon.clip_grad_norm_`` is the same with a plain-tensor result.
- ``DTensor.full_tensor()`` of a one-rank DTensor gives the tensor on its owner and an empty one
  elsewhere. ``OwnerTensor.full_tensor()`` broadcasts each piece from its holder (collective,
  like ``full_tensor()`` of FSDP2's DTensors, the same broadcasts on every rank) and its ops
  return ``OwnerTensor`` again, so ``p.full_tensor()`` and ``p.detach().full_tensor()`` give the
  weight on every rank; ``dmuon.full_tensor(t)`` does the same for any tensor. Its
  ``redistribute(Replicate)`` does the same, which is how torch's
  ``get_model_state_dict(full_state_dict=True)`` gathers a DTensor.
- A shard-like placement on FSDP2's mesh (``Shard(0)`` subclass) was tried first and dropped:
  DTensor's sharding rules rebuild plain ``Shard(0)`` for its outputs (wrong labels), and its
  foreach rules mixed it up with FSDP2's own ``Shard(0)`` gradients of the same shape (a hang).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dmuon_compile import _compat
from dmuon_compile.distributed import _dtensor_compat as _dt
from dmuon_compile.distributed import _pending


class _MeshRegistry:
    """What this module knows about the meshes of dedicated weights, in one object.

    Process-wide, not per model: owner meshes are built once per ``(device type, rank)`` and
    shared by every model (``owner_mesh``), and the lookups run inside DTensor dispatch, where
    only the tensor's mesh is at hand. Keyed by ``id(mesh)`` (a DeviceMesh compares by its
    layout, and an owner group's mesh may be equal to this rank's own TP mesh); ``keep`` holds
    the meshes so no id is reused.
    """

    def __init__(self) -> None:
        self.owner_meshes: dict[tuple[str, int], DeviceMesh] = {}  # (device type, rank) -> mesh
        self.owner_of: dict[int, int] = {}  # id(owner mesh) -> the owner's global rank (hot path)
        # id(owner mesh) -> (norm mesh, placements): where the norms of its tensors are given.
        self.norm_of: dict[int, tuple] = {}
        # id(owner group mesh) -> its global ranks in mesh order: a TP weight's owner group,
        # shard t on the t-th rank (its mesh may be this rank's TP mesh, _tp.owner_tp_mesh).
        self.group_ranks: dict[int, tuple[int, ...]] = {}
        # id(one-rank owner mesh) -> the rank full_tensor broadcasts from. In a TP model a plain
        # weight has one owner per TP column (each column's copy is the same): all ranks agree
        # on column 0's.
        self.source_of: dict[int, int] = {}
        self.keep: list[DeviceMesh] = []


_MESHES = _MeshRegistry()
_aten = torch.ops.aten


class OwnerTensor(DTensor):
    """A DTensor on an owner mesh (see the module docstring): ``full_tensor()`` is collective.

    Everything else is DTensor's; results of ops on it that land on an owner mesh are
    ``OwnerTensor`` too (``detach``, ``zeros_like``, arithmetic).
    """

    def full_tensor(self, *, grad_placements=None) -> Tensor:  # noqa: ARG002 - DTensor's signature
        return full_tensor(self)

    def data_ptr(self) -> int:
        # The address of this rank's data (0 where it holds none), as FSDP2's DTensors are
        # addressed by their local shard. accelerate's FSDP2 prepare matches the optimizer's
        # parameters to the model's by it; ``Muon`` puts back the weights held elsewhere,
        # which all have address 0 (``Muon.restore_dedicated``).
        return _dt.local_tensor(self).data_ptr()

    def to_local(self, *, grad_placements=None) -> Tensor:
        _pending.before_access(write=False)  # a pending update lands first (_pending.py)
        return super().to_local(grad_placements=grad_placements)

    def redistribute(self, device_mesh=None, placements=None, **kwargs) -> DTensor:
        # Replicate on its own mesh: the whole tensor on every rank (collective, like full_tensor).
        # torch.distributed.checkpoint's full state dict gathers each DTensor this way.
        _pending.before_access(write=False)
        same_mesh = device_mesh is None or device_mesh == self.device_mesh
        if same_mesh and placements is not None and all(p.is_replicate() for p in placements):
            whole = full_tensor(self)
            spec = _dt.make_spec(
                self.device_mesh, placements, self.shape, whole.stride(), self.dtype
            )
            return DTensor(whole, spec, requires_grad=False)
        return super().redistribute(device_mesh, placements, **kwargs)

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
        if _pending.watched:  # an HSDP or TP runtime lives (one flag: this runs on every op)
            name = getattr(func, "__name__", "")
            if name not in _ACCESSORS:
                # Reads see the pending updates; writes make a publish due (_pending.py).
                _pending.before_access(_writes(name, kwargs))
        if func in _RANDOM_FILLS and args and isinstance(args[0], OwnerTensor):
            return _random_fill(func, args, kwargs, _compat.caller_frame(1))
        if func in _INIT_ENTRIES:
            return _init_entry(func, args, kwargs)
        caller = _compat.caller_frame(1)
        caller_module = caller.f_globals.get("__name__")
        if caller_module == _DDP_MODULE:
            raise _ddp_error()
        if caller_module == _INIT_MODULE:
            done, out = _in_init(func, args, kwargs, caller.f_code.co_name)
            if done:
                return out
        handler = _CLIP_FUNCTIONS.get(func)
        if handler is not None:
            done, out = handler(args, kwargs)
            if done:
                return out
        with _compat.disable_torch_function_subclass():
            return _rewrap(func(*args, **kwargs))


# ``p.grad``, ``p.data``, ``p.grad = None``: no value read or written (``zero_grad`` right after an
# async step must not apply the step's pending updates on the compute stream).
_ACCESSORS = frozenset({"__get__", "__set__"})


def _writes(name: str, kwargs) -> bool:
    """Whether the torch function ``name`` writes its first argument (``mul_``, ``copy_``,
    ``_foreach_add_``, ``__setitem__``, ``__imul__``...) or an ``out=`` tensor."""
    if name.endswith("__"):
        return name == "__setitem__" or name.startswith("__i")
    return name.endswith("_") or kwargs.get("out") is not None


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
            _scale_locally(args[0], args[1])
            return args[0]
        elif func is torch._foreach_mul_ and isinstance(args[1], _OwnerNorm) and not kwargs:
            for t in args[0]:
                _scale_locally(t, args[1])
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


def set_norm_mesh(mesh: DeviceMesh, norm_mesh: DeviceMesh, partial_dims=None) -> None:
    """Give the norms of owner ``mesh``'s tensors on ``norm_mesh`` (FSDP2's mesh, or the DP × TP
    mesh of a TP model), partial over the dims named in ``partial_dims`` (``None``: all) and
    ``Replicate`` over the others (a plain weight of a TP model: one owner per TP column)."""
    names = norm_mesh.mesh_dim_names or (None,) * norm_mesh.ndim
    partial = [partial_dims is None or n in partial_dims for n in names]
    _MESHES.norm_of[id(mesh)] = (norm_mesh, partial, _dt.norm_partial())
    _MESHES.keep.append(mesh)


def set_dp_mesh(mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """Record the data-parallel mesh (FSDP2's) that owner ``mesh``'s norms are given on."""
    set_norm_mesh(mesh, dp_mesh)


def register_group(mesh: DeviceMesh, ranks) -> None:
    """Record an owner group mesh (a TP weight's owner TP group) and its global ranks."""
    _MESHES.group_ranks[id(mesh)] = tuple(int(r) for r in ranks)
    _MESHES.keep.append(mesh)


def set_source(mesh: DeviceMesh, rank: int) -> None:
    """The rank ``full_tensor`` broadcasts owner ``mesh``'s tensors from (default: the owner)."""
    _MESHES.source_of[id(mesh)] = int(rank)


def _norm_of(t: DTensor, ord) -> Tensor:
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
    entry = _MESHES.norm_of.get(id(t.device_mesh))
    if entry is None:
        return value
    mesh, partial, norm_partial = entry
    placements = [norm_partial(ord) if p else Replicate() for p in partial]
    plain = DTensor.from_local(
        value.reshape(()), mesh, placements, run_check=False, shape=torch.Size(()), stride=()
    )
    return _as_norm(plain)


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
    return True, [_norm_of(t, ord) if i in mine else next(rest) for i, t in enumerate(tensors)]


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
    return True, _norm_of(t, ord)


def _value_of(factor):
    """A scale factor as a plain tensor or number (a DTensor's replicated value)."""
    if not isinstance(factor, DTensor):
        return factor
    if not all(p.is_replicate() for p in factor.placements):
        factor = factor.redistribute(factor.device_mesh, [Replicate()] * factor.device_mesh.ndim)
    return _dt.local_tensor(factor)


def _scale_locally(t: Tensor, factor) -> None:
    """``t *= factor`` on ``t``'s local tensor (a scalar factor: right for every placement)."""
    local = local_of(t)
    if local.numel():
        value = _value_of(factor)
        local.mul_(value.to(local.device) if isinstance(value, Tensor) else value)


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
    if type(out) is DTensor and _is_owner_mesh(out.device_mesh):
        local = _dt.local_tensor(out)
        if local.device.type != out.device_mesh.device_type and local.numel() == 0:
            # DTensor gives ranks outside the mesh an empty CPU placeholder; a CUDA parameter's
            # zeros_like (DCP's optimizer-state init sets it as .grad) must stay on its device.
            local = local.to(_mesh_device(out.device_mesh))
        return OwnerTensor(local, _dt.spec(out), requires_grad=out.requires_grad)
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap(o) for o in out)
    return out


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _is_owner_mesh(mesh: DeviceMesh) -> bool:
    return id(mesh) in _MESHES.owner_of or id(mesh) in _MESHES.group_ranks


def owner_mesh(device_type: str, global_rank: int) -> DeviceMesh:
    """The one-rank mesh of ``global_rank`` (cached; built the same way on every rank).

    It needs no process group (a one-rank DTensor never communicates), so none is created where
    the torch version allows it.
    """
    key = (device_type, int(global_rank))
    mesh = _MESHES.owner_meshes.get(key)
    if mesh is None:
        mesh = _dt.mesh_without_backend(device_type, [global_rank])
        _MESHES.owner_meshes[key] = mesh
        _MESHES.owner_of[id(mesh)] = int(global_rank)
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
    placement=None,
) -> DTensor:
    """An :class:`OwnerTensor` of global ``shape`` on the owner ``mesh``; ``local`` (the owner's
    whole tensor, shared, not copied) or ``None`` off the owner. ``placement``: ``Replicate()``
    (default, a one-rank mesh) or ``Shard(d)`` on an owner group mesh (``local``: this member's
    shard, not checked)."""
    shape = torch.Size(shape)
    if local is None:
        local = empty_local(dtype, device)
    elif placement is None and tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"the owner's tensor has shape {tuple(local.shape)}, expected {tuple(shape)}"
        )
    stride = torch.empty(shape, device="meta").stride()
    plain = DTensor.from_local(
        local, mesh, [placement or Replicate()], run_check=False, shape=shape, stride=stride
    )
    return OwnerTensor(_dt.local_tensor(plain), _dt.spec(plain), requires_grad=requires_grad)


def wrap_like(local: Tensor | None, like: DTensor) -> DTensor:
    """An owner DTensor with ``like``'s mesh, shape and dtype around ``local`` (``None``: empty).

    The per-step path (gradients): reuses ``like``'s spec, much cheaper than
    :func:`make_owned`, which builds a new one.
    """
    if local is None:
        local = empty_local(like.dtype, local_of(like).device)
    return OwnerTensor(local, _dt.spec(like), requires_grad=False)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (the whole tensor on its owner, empty elsewhere), else "
    "``t``."""
    return _dt.local_tensor(t) if isinstance(t, DTensor) else t


def is_owned(t) -> bool:
    """True for a DTensor on a one-rank owner mesh (a dedicated weight, its gradient or its
    state; the shards of a TP weight on their owner group are not)."""
    if not isinstance(t, DTensor):
        return False
    mesh = t.device_mesh
    if id(mesh) in _MESHES.owner_of:  # the per-step path: the very mesh objects made here
        return True
    return (
        mesh.ndim == 1
        and mesh.size() == 1
        and _MESHES.owner_meshes.get((mesh.device_type, int(mesh.mesh.reshape(-1)[0]))) == mesh
    )


def owner_rank(t: DTensor) -> int:
    """Global rank that holds ``t`` (an owner tensor)."""
    rank = _MESHES.owner_of.get(id(t.device_mesh))
    return rank if rank is not None else int(t.device_mesh.mesh.reshape(-1)[0])


def same_layout(a, b) -> bool:
    """Both owner tensors of the same global shape on the same owner."""
    return (
        is_owned(a)
        and is_owned(b)
        and owner_rank(a) == owner_rank(b)
        and tuple(a.shape) == tuple(b.shape)
    )


def _sources(t: DTensor) -> tuple[int, ...] | None:
    """The global ranks that hold ``t``'s pieces, in order (``None``: not an owner tensor)."""
    ranks = _MESHES.group_ranks.get(id(t.device_mesh))
    if ranks is not None:
        return ranks
    if is_owned(t):
        return (_MESHES.source_of.get(id(t.device_mesh), owner_rank(t)),)
    return None


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor on every rank. Collective for owner tensors (a broadcast from each rank
    that holds a piece: the owner, or each member of a TP weight's owner group) and for other
    DTensors (``full_tensor()``); plain tensors come back as they are. Every rank calls it in the
    same order (the collectives are the same everywhere).

    Example::

        w = dmuon.full_tensor(model.layers[0].mlp.up_proj.weight)   # on every rank
    """
    if not isinstance(t, DTensor):
        return t
    sources = _sources(t)
    if sources is None:
        return t.full_tensor()
    _pending.before_access(write=False)  # the weight with every pending update applied
    local = local_of(t)
    placement = t.placements[0]
    if placement.is_partial() and placement.reduce_op not in ("sum", "avg"):
        raise NotImplementedError(
            f"dmuon.full_tensor: a {placement} result on a TP weight's owner group; reduce it "
            "after gathering instead (dmuon.full_tensor(p) first)"
        )
    if placement.is_replicate():  # every member holds the whole tensor: the first one sends
        sources = sources[:1]
    shape = list(t.shape)  # of each piece: the whole, or one even shard
    dim = placement.dim if placement.is_shard() else 0
    if placement.is_shard():
        shape[dim] //= len(sources)
    me = dist.get_rank()
    pieces = []
    for src in sources:  # the same broadcasts, in the same order, on every rank
        if me == src:
            buf = local.clone(memory_format=torch.contiguous_format)
        else:
            buf = torch.empty(shape, dtype=t.dtype, device=local.device)
        dist.broadcast(buf, src=src)
        pieces.append(buf)
    if len(pieces) == 1:
        return pieces[0]
    if placement.is_partial():  # e.g. p.sum() of a TP weight: one partial sum per member
        total = torch.stack(pieces).sum(0)
        return total / len(pieces) if placement.reduce_op == "avg" else total
    return torch.cat(pieces, dim=dim)


# ---------------------------------------------------------------------------- initialisation
#
# A model built on the meta device is initialised after ``model.to_empty`` by its own
# ``reset_parameters()`` / ``init_weights()``: ``nn.init`` functions and random fills
# (``w.normal_()``, ``w.data.uniform_()``) on the registered dedicated weights. They run on the
# holder's local tensor (the owner's whole master, or a TP shard on its owner group member) and
# change nothing elsewhere:
#
# - a random fill draws on the holder from a generator of its own, seeded by
#   ``torch.initial_seed()``, the weight's name, its TP shard index and how many fills the
#   weight had (a temporary of an ``nn.init`` function, e.g. ``trunc_normal_``'s rejection
#   samples or ``orthogonal_``'s Gaussian matrix, counts as a fill of the weight that function
#   initialises). The default generators are never advanced: a holder that
#   drew from them would leave its RNG state behind the other ranks', and DTensor's random ops
#   on FSDP2's replicated shards (HSDP, TP) need every rank's state in step. DTensor's own
#   random path is never taken either: on CUDA its first use broadcasts an RNG state over the
#   default group, which the owner alone would enter. So a dedicated weight gets the same
#   values whichever rank owns it and however many ranks there are (the TP copies of a plain
#   weight are the same), given the same seed on every rank, as DTensor also requires; they
#   are not the values a single process drawing from its default generator would get.
# - inside an ``nn.init`` function, the ranks that hold nothing see a meta tensor of the global
#   shape (shape arithmetic works, fills are no-ops, scalar reads such as the rejection test
#   never read a value that is not there).
# - every such write, on every rank (the holder and the others run the same ``nn.init`` call),
#   makes a publish due (``_pending.py``): the next forward sends the global owners' new weights
#   to the other replicas first.

_INIT_MODULE = "torch.nn.init"
# DistributedDataParallel's module: it would broadcast and all-reduce every parameter as a
# whole replicated tensor. A dedicated weight is whole on its owner only, so DDP breaks deep
# inside (a mixed Tensor/DTensor ``cat`` in its first broadcast); its first touch of one raises.
_DDP_MODULE = "torch.nn.parallel.distributed"


def _ddp_error() -> RuntimeError:
    return RuntimeError(
        "DistributedDataParallel cannot wrap a model with dedicated weights "
        "(dmuon.dedicate_params): each dedicated weight lives whole on one owner rank, and DDP "
        "replicates and all-reduces every parameter. Shard the model with FSDP2 instead: "
        "torch.distributed.fsdp.fully_shard after dedicate_params (accelerate: "
        "FullyShardedDataParallelPlugin(fsdp_version=2) and "
        "dmuon_compile.integrations.accelerate.dedicate_params). Without dedicate_params, "
        "DDP with dmuon.Muon works as with any optimizer."
    )


_RANDOM_FILLS = frozenset(
    {
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.random_,
        Tensor.bernoulli_,
        Tensor.exponential_,
        Tensor.cauchy_,
        Tensor.log_normal_,
        Tensor.geometric_,
    }
)
# data_ptr of a holder's local tensor -> [name, TP shard index, fills so far]
_FILL_KEYS: dict[int, list] = {}
_GENERATOR: list = [None]  # the last fill's generator (a temporary of user code continues it)


def key_fills(param: DTensor, fqn: str, shard: int = 0) -> None:
    """Random fills of ``param`` (a dedicated weight this rank holds) draw from a generator keyed
    by ``fqn`` and ``shard`` (its TP shard index; 0 for a whole weight)."""
    local = _dt.local_tensor(param)
    if local.numel():
        _FILL_KEYS[local.data_ptr()] = [fqn, int(shard), 0]


def _note_init_write() -> None:
    _pending.before_access(write=True)


def _seed(fqn: str, shard: int, count: int) -> int:
    text = f"{torch.initial_seed()}/{fqn}/{shard}/{count}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _fill_generator(local: Tensor, frame) -> torch.Generator:
    """A fresh generator for a fill of ``local``: keyed by the weight it is (or, for a temporary
    of an ``nn.init`` function, the weight that function initialises) and its fill count."""
    key = _FILL_KEYS.get(local.data_ptr())
    if key is None and frame.f_globals.get("__name__") == _INIT_MODULE:
        target = frame.f_locals.get("tensor")  # every nn.init function names its weight so
        if isinstance(target, DTensor) and _dt.local_tensor(target).numel():
            key = _FILL_KEYS.get(_dt.local_tensor(target).data_ptr())
    gen = _GENERATOR[0]
    if key is None and gen is not None and gen.device == local.device:
        return gen  # a temporary of user code that filled a weight just before
    if key is None:
        key = _FILL_KEYS.setdefault(-1, ["", 0, 0])  # no weight to name: one stream of its own
    fqn, shard, count = key
    key[2] = count + 1
    gen = torch.Generator(device=local.device)
    gen.manual_seed(_seed(fqn, shard, count))
    _GENERATOR[0] = gen
    return gen


def _random_fill(func, args, kwargs, frame):
    """``t.uniform_(...)`` and the other random fills: on the holder's local tensor."""
    t = args[0]
    _note_init_write()
    local = _dt.local_tensor(t)
    if local.numel():
        if kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": _fill_generator(local, frame)}
        with torch.no_grad():
            func(local, *args[1:], **kwargs)
    return t


def _uniform(tensor, a=0.0, b=1.0, generator=None):
    with torch.no_grad():
        return tensor.uniform_(a, b, generator=generator)


def _normal(tensor, mean=0.0, std=1.0, generator=None):
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator)


def _constant(tensor, val):
    with torch.no_grad():
        return tensor.fill_(val)


def _kaiming_uniform(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    if 0 in tensor.shape:
        return tensor
    fan = _compat.calculate_correct_fan(tensor, mode)
    bound = math.sqrt(3.0) * nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
    with torch.no_grad():
        return tensor.uniform_(-bound, bound, generator=generator)


# The nn.init functions that hand a tensor subclass to __torch_function__ whole (the others run
# their body, whose ops come here one by one): the same math as torch's, on our fills.
_INIT_ENTRIES = {
    nn.init.uniform_: _uniform,
    nn.init.normal_: _normal,
    nn.init.constant_: _constant,
    nn.init.kaiming_uniform_: _kaiming_uniform,
}


def _init_entry(func, args, kwargs):
    kwargs = dict(kwargs)  # torch passes every argument by name, the tensor included
    tensor, rest = (kwargs.pop("tensor"), args) if "tensor" in kwargs else (args[0], args[1:])
    _note_init_write()
    return _INIT_ENTRIES[func](tensor, *rest, **kwargs)


# nn.init functions that need the whole matrix in one place (not element-wise).
_WHOLE_MATRIX_INITS = frozenset({"eye_", "orthogonal_", "sparse_", "dirac_"})


def _in_init(func, args, kwargs, init_name: str):
    """An op of the ``nn.init`` function ``init_name``'s body on an owner tensor:
    ``(handled, result)``."""
    owned = [a for a in _compat.tree_flatten((args, kwargs))[0] if isinstance(a, OwnerTensor)]
    if not owned:
        return False, None
    t = owned[0]
    if init_name in _WHOLE_MATRIX_INITS and id(t.device_mesh) in _MESHES.group_ranks:
        # Raised on every rank alike (every rank knows the owner group meshes).
        raise NotImplementedError(
            f"nn.init.{init_name} on a TP-sharded dedicated weight: it needs the whole matrix, "
            "which no rank holds. Initialise this weight with an element-wise nn.init function "
            "(normal_, trunc_normal_, uniform_, xavier_*, kaiming_*, constant_), or load it "
            "(dmuon.set_model_state_dict of a full state dict, or a DCP checkpoint)."
        )
    _note_init_write()
    if _dt.local_tensor(t).numel() == 0 and t.numel() > 0:  # holds nothing: shapes only
        if func is Tensor.__setitem__:
            return True, None  # sparse_'s zeroing: nothing here to zero
        back: dict[int, Tensor] = {}

        def stand_in(a):
            if not isinstance(a, OwnerTensor):
                return a
            meta = torch.empty(a.shape, dtype=a.dtype, device="meta")
            back[id(meta)] = a
            return meta

        out = func(*_compat.tree_map(stand_in, args), **_compat.tree_map(stand_in, kwargs))
        return True, _compat.tree_map(
            lambda o: back.get(id(o), o) if isinstance(o, Tensor) else o, out
        )
    if func is Tensor.__setitem__ and id(t.device_mesh) in _MESHES.owner_of:
        # sparse_: indexing with plain index tensors, on the owner's whole weight
        func(_dt.local_tensor(t), *_compat.tree_map(local_of, args[1:]))
        return True, None
    return False, None
