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

A TP-sharded dedicated weight (``_stages/tp/``) is an ``OwnerTensor`` too, on its *owner group*
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
  like ``full_tensor()`` of FSDP2's DTensors: the same broadcasts on every rank of the model
  part's data-parallel mesh, on that mesh's process groups, never the default group — with
  pipeline parallelism each stage gathers its own weights; a rank outside that mesh raises
  instead of waiting) and its ops
  return ``OwnerTensor`` again, so ``p.full_tensor()`` and ``p.detach().full_tensor()`` give the
  weight on every rank; ``dmuon.full_tensor(t)`` does the same for any tensor. Its
  ``redistribute(Replicate)`` does the same, which is how torch's
  ``get_model_state_dict(full_state_dict=True)`` gathers a DTensor.
- torch's full-state loads (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
  ``full_state_dict=True``) place each whole tensor into its DTensor with ``distribute_tensor``
  (the dict on every rank: a broadcast on the mesh, which an owner mesh has no process group
  for) or slice it for this rank (``broadcast_from_rank0``: a rank outside the mesh gets the
  whole tensor, not its empty piece). Both calls are routed here for owner meshes
  (``_compat.dtensor.route_full_state_loads``): each holder takes its piece of its own copy.
- A shard-like placement on FSDP2's mesh (``Shard(0)`` subclass) was tried first and dropped:
  DTensor's sharding rules rebuild plain ``Shard(0)`` for its outputs (wrong labels), and its
  foreach rules mixed it up with FSDP2's own ``Shard(0)`` gradients of the same shape (a hang).

Plain saving works as for any DTensor: ``data_ptr()`` is 0 (what marks a wrapper subclass for
torch), so ``torch.save`` (``torch.load`` with its default ``weights_only``), ``copy.deepcopy``
and ``dcp.async_save`` take an owner tensor by its local tensor; a loaded or copied one is back
on this process's owner mesh object, which the lookups here go by.

Beside this module: ``_owner/meshes.py`` (the owner meshes and what is known about each),
``_owner/norms.py`` (the norm of an owner tensor, the clip's local scaling) and
``_owner/init.py`` (``nn.init`` and random fills on dedicated weights).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dmuon_compile import _compat
from dmuon_compile.distributed._comm import pending as _pending
from dmuon_compile.distributed._compat import dtensor as _dt
from dmuon_compile.distributed._owner.init import (
    DDP_MODULE,
    INIT_ENTRIES,
    INIT_MODULE,
    RANDOM_FILLS,
    WHOLE_MATRIX_INITS,
    ddp_error,
    init_entry,
    note_init_write,
    random_fill,
)
from dmuon_compile.distributed._owner.meshes import (
    MESHES,
    collective_mesh,
    empty_local,
    is_owned,
    is_owner_mesh,
    local_of,
    mesh_device,
    owner_rank,
)
from dmuon_compile.distributed._owner.norms import norm_of, scale_locally

_aten = torch.ops.aten


class OwnerTensor(DTensor):
    """A DTensor on an owner mesh (see the module docstring): ``full_tensor()`` is collective.

    Everything else is DTensor's; results of ops on it that land on an owner mesh are
    ``OwnerTensor`` too (``detach``, ``zeros_like``, arithmetic).
    """

    # Pickled (torch.save of a state dict) by its public path, which a move of this module
    # does not change; dmuon_compile.distributed exports it and loads the older path too.
    __module__ = "dmuon_compile.distributed"

    # Its Newton–Schulz sees whole matrices (on the owner, or gathered to the TP owner), so a
    # blocked layout's blocks are cut there (``layouts.check_blocked_placement`` reads this).
    orthogonalised_whole = True

    def full_tensor(self, *, grad_placements=None) -> Tensor:  # noqa: ARG002 - DTensor's signature
        return full_tensor(self)

    def data_ptr(self) -> int:
        # 0: a wrapper holds no data of its own, and torch tells a wrapper subclass by that
        # (torch.save pickles it by its local tensor, copy.deepcopy clones it). torch 2.13 gives
        # a DTensor its local tensor's storage offset, which makes a weight viewing a flat buffer
        # (HSDP's masters and replicas) read as non-zero without this.
        return 0

    def __deepcopy__(self, memo):
        # copy.deepcopy copies every slot, the mesh too: the copy keeps this owner mesh, by which
        # it is known for what it is (full_tensor's holders, the norms' mesh).
        mesh = _dt.spec(self).mesh
        memo.setdefault(id(mesh), mesh)
        return super().__deepcopy__(memo)

    def __setstate__(self, state) -> None:
        # Unpickling (torch.load) rebuilds the mesh as a copy: this process's equal owner mesh
        # takes its place, as in __deepcopy__; a copy that matches none (another process) stays.
        _dt.set_pickled_state(self, state)
        mesh = _dt.spec(self).mesh
        known = _known_owner_mesh(mesh)
        if known is not None and known is not mesh:
            _dt.set_spec_mesh(self, known)

    def to_local(self, *, grad_placements=None) -> Tensor:
        _pending.before_access(write=False)  # a pending update lands first (_comm/pending.py)
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
                # Reads see the pending updates; writes make a publish due (_comm/pending.py).
                _pending.before_access(_writes(name, kwargs))
        if func in RANDOM_FILLS and args and isinstance(args[0], OwnerTensor):
            return random_fill(func, args, kwargs, _compat.caller_frame(1))
        if func in INIT_ENTRIES:
            return init_entry(func, args, kwargs)
        caller = _compat.caller_frame(1)
        caller_module = caller.f_globals.get("__name__")
        if caller_module == DDP_MODULE:
            raise ddp_error()
        if caller_module == INIT_MODULE:
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


# torch.load's default (weights_only) loads DTensors; owner tensors are DTensors of the same parts.
torch.serialization.add_safe_globals([OwnerTensor])


def _known_owner_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The owner mesh of this process equal to ``mesh`` (``mesh`` itself when it is one)."""
    if is_owner_mesh(mesh):
        return mesh
    if mesh.ndim == 1 and mesh.size() == 1:
        known = MESHES.latest.get((mesh.device_type, int(mesh.mesh.reshape(-1)[0])))
        return known if known == mesh else None
    for known in MESHES.keep.values():  # TP owner group meshes
        if id(known) in MESHES.group_ranks and known == mesh:
            return known
    return None


# ``p.grad``, ``p.data``, ``p.grad = None``: no value read or written (``zero_grad`` right after an
# async step must not apply the step's pending updates on the compute stream).
_ACCESSORS = frozenset({"__get__", "__set__"})


def _writes(name: str, kwargs) -> bool:
    """Whether the torch function ``name`` writes its first argument (``mul_``, ``copy_``,
    ``_foreach_add_``, ``__setitem__``, ``__imul__``...) or an ``out=`` tensor."""
    if name.endswith("__"):
        return name == "__setitem__" or name.startswith("__i")
    return name.endswith("_") or kwargs.get("out") is not None


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
    return True, [norm_of(t, ord) if i in mine else next(rest) for i, t in enumerate(tensors)]


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
    return True, norm_of(t, ord)


def _foreach_mul_(args, kwargs):
    tensors, factor = list(args[0]), args[1]
    if isinstance(factor, (list, tuple)) or isinstance(factor, OwnerTensor):
        return False, None
    mine, others = _split(tensors)
    for i in mine:
        scale_locally(tensors[i], factor)
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
    scale_locally(t, factor)
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
    if type(out) is DTensor and is_owner_mesh(out.device_mesh):
        local = _dt.local_tensor(out)
        if local.device.type != out.device_mesh.device_type and local.numel() == 0:
            # DTensor gives ranks outside the mesh an empty CPU placeholder; a CUDA parameter's
            # zeros_like (DCP's optimizer-state init sets it as .grad) must stay on its device.
            local = local.to(mesh_device(out.device_mesh))
        return OwnerTensor(local, _dt.spec(out), requires_grad=out.requires_grad)
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap(o) for o in out)
    return out


def _distribute_for_load(original, tensor, device_mesh=None, placements=None, **kwargs):
    """``distribute_tensor`` as torch's full-state load calls it with the dict on every rank.
    Onto a one-rank owner mesh the owner keeps its own copy (``src_data_rank=None``): the data
    a broadcast from the mesh's only rank would give, and the mesh has no process group to
    broadcast on. Ranks outside an owner mesh get DTensor's empty local; the result is an
    :class:`OwnerTensor`, as every result on an owner mesh."""
    if device_mesh is None or not is_owner_mesh(device_mesh):
        return original(tensor, device_mesh, placements, **kwargs)
    if id(device_mesh) in MESHES.owner_of:
        kwargs["src_data_rank"] = None
    return _rewrap(original(tensor, device_mesh, placements, **kwargs))


def _distribute_tensors_for_load(original, local_state_dict, keys, *args, **kwargs):
    """The copy of the tensors broadcast from rank 0 into their DTensors: an owner tensor on a
    rank that holds none of it keeps its (empty) self; torch would slice the whole tensor for
    it (a rank outside a mesh has no coordinate, hence no slice)."""
    for key in keys:
        entry = local_state_dict.get(key)
        if isinstance(entry, tuple) and isinstance(entry[0], OwnerTensor):
            t, whole = entry
            if not _holds_piece(t):
                local_state_dict[key] = (
                    wrap_like(empty_local(t.dtype, whole.device), t) if t.is_meta else t
                )
    return original(local_state_dict, keys, *args, **kwargs)


def _holds_piece(t: DTensor) -> bool:
    me = dist.get_rank()
    ranks = MESHES.group_ranks.get(id(t.device_mesh))
    return me in ranks if ranks is not None else owner_rank(t) == me


_ROUTED = False


def _route_full_state_loads() -> None:
    global _ROUTED
    if not _ROUTED:
        _ROUTED = True
        try:
            _dt.route_full_state_loads(_distribute_for_load, _distribute_tensors_for_load)
        except RuntimeError as exc:  # a torch without them: only that feature is lost, and said
            warnings.warn(
                f"dmuon_compile: torch's full-state loads into dedicated weights are not routed "
                f"on this torch ({exc}); load with dmuon.set_model_state_dict or DCP instead.",
                stacklevel=3,
            )


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
    _route_full_state_loads()  # torch's full-state loads place owner tensors here (above)
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
    ranks = MESHES.group_ranks.get(id(t.device_mesh))
    if ranks is not None:
        return ranks
    if is_owned(t):
        return (MESHES.source_of.get(id(t.device_mesh), owner_rank(t)),)
    return None


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor on every rank. Collective for owner tensors (a broadcast from each rank
    that holds a piece: the owner, or each member of a TP weight's owner group, over the ranks
    of the model part that holds it: its data-parallel, or DP × TP, mesh) and for other DTensors
    (``full_tensor()``); plain tensors come back as they are. Every rank of that mesh calls it,
    in the same order (the collectives are the same everywhere); with pipeline parallelism,
    the ranks of the weight's stage only — a rank outside its mesh raises ``RuntimeError``.

    Example::

        w = dmuon.full_tensor(model.layers[0].mlp.up_proj.weight)   # on every rank
    """
    if not isinstance(t, DTensor):
        return t
    sources = _sources(t)
    if sources is None:
        if isinstance(t, OwnerTensor):  # an owner mesh this process does not know
            raise _unknown_holders()
        return t.full_tensor()
    _pending.before_access(write=False)  # the weight with every pending update applied
    local = local_of(t)
    if local.device.type != t.device_mesh.device_type:  # a master in host memory (offload)
        local = local.to(mesh_device(t.device_mesh))
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
    mesh = _gather_mesh(t, sources)
    me = dist.get_rank()
    pieces = []
    for src in sources:  # the same broadcasts, in the same order, on every rank of `mesh`
        if me == src:
            buf = local.clone(memory_format=torch.contiguous_format)
        else:
            buf = torch.empty(shape, dtype=t.dtype, device=local.device)
        broadcast_on_mesh(buf, src, mesh)
        pieces.append(buf)
    if len(pieces) == 1:
        return pieces[0]
    if placement.is_partial():  # e.g. p.sum() of a TP weight: one partial sum per member
        total = torch.stack(pieces).sum(0)
        return total / len(pieces) if placement.reduce_op == "avg" else total
    return torch.cat(pieces, dim=dim)


def _gather_mesh(t: DTensor, sources) -> DeviceMesh:
    """The mesh ``t``'s gather runs on (:func:`_owner.meshes.collective_mesh`: the ranks of the
    model part that holds it), after checking that this rank and every holder are in it: a rank
    outside it (another pipeline stage's) would wait for ranks that never join, so it raises."""
    mesh = collective_mesh(t.device_mesh)
    if mesh is None:
        raise _unknown_holders()
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    me = dist.get_rank()
    if me not in ranks:
        raise RuntimeError(
            f"dmuon.full_tensor on rank {me}: this dedicated tensor belongs to the model part "
            f"on ranks {ranks} (its data-parallel group: with pipeline parallelism, one stage), "
            f"which rank {me} is not in; gathering it here would wait for ranks that never join. "
            f"Call dmuon.full_tensor (or p.full_tensor(), p.redistribute(Replicate)) on the "
            f"ranks {ranks}, all of them, and on no other rank"
        )
    outside = [int(s) for s in sources if int(s) not in ranks]
    if outside:  # a layout whose holders are not all in its norm mesh: no group spans them
        raise RuntimeError(
            f"dmuon.full_tensor: the ranks {outside} holding pieces of this tensor are outside "
            f"its data-parallel mesh (ranks {ranks}); gather the pieces on the holders' group "
            "yourself (dmuon.distributed.dedicated_runtime(model).mesh)"
        )
    return mesh


def _unknown_holders() -> RuntimeError:
    return RuntimeError(
        f"dmuon.full_tensor on rank {dist.get_rank()}: no dmuon.dedicate_params of this "
        "process made this dedicated tensor's owner mesh (a weight of another pipeline stage, "
        "or one loaded from another process's save), so the ranks that hold it are unknown "
        "here and gathering it would wait for ranks that never join. Call dmuon.full_tensor "
        "on the ranks of the model part that holds it, or save that model's weights whole "
        "there (dmuon.get_model_state_dict)"
    )


def broadcast_on_mesh(buf: Tensor, src: int, mesh: DeviceMesh) -> None:
    """Broadcast ``buf`` from global rank ``src`` to every rank of ``mesh``, on the mesh's own
    process groups (one broadcast per dim of size > 1: along dim ``d``, the ranks that agree
    with ``src`` on the dims after ``d`` take it from their line's holder), never the default
    group. Collective over the ranks of ``mesh``: every one of them calls it, in the same order."""
    grid = mesh.mesh
    at_src = (grid == src).nonzero()
    at_me = (grid == dist.get_rank()).nonzero()
    if len(at_src) == 0 or len(at_me) == 0:
        raise RuntimeError(f"broadcast_on_mesh: rank {src} or this rank is not in {mesh}")
    s, m = at_src[0].tolist(), at_me[0].tolist()
    for d in range(mesh.ndim):
        if mesh.size(d) == 1 or m[d + 1 :] != s[d + 1 :]:
            continue  # nothing to send along d, or this rank's line gets it at a later dim
        holder = int(grid[tuple(m[:d] + [s[d]] + m[d + 1 :])])
        dist.broadcast(buf, src=holder, group=mesh.get_group(d))


def _in_init(func, args, kwargs, init_name: str):
    """An op of the ``nn.init`` function ``init_name``'s body on an owner tensor:
    ``(handled, result)``."""
    owned = [a for a in _compat.tree_flatten((args, kwargs))[0] if isinstance(a, OwnerTensor)]
    if not owned:
        return False, None
    t = owned[0]
    if init_name in WHOLE_MATRIX_INITS and id(t.device_mesh) in MESHES.group_ranks:
        # Raised on every rank alike (every rank knows the owner group meshes).
        raise NotImplementedError(
            f"nn.init.{init_name} on a TP-sharded dedicated weight: it needs the whole matrix, "
            "which no rank holds. Initialise this weight with an element-wise nn.init function "
            "(normal_, trunc_normal_, uniform_, xavier_*, kaiming_*, constant_), or load it "
            "(dmuon.set_model_state_dict of a full state dict, or a DCP checkpoint)."
        )
    note_init_write()
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
    if func is Tensor.__setitem__ and id(t.device_mesh) in MESHES.owner_of:
        # sparse_: indexing with plain index tensors, on the owner's whole weight
        func(_dt.local_tensor(t), *_compat.tree_map(local_of, args[1:]))
        return True, None
    return False, None
