"""Tensor parallelism for dedicated weights: Newton–Schulz on the whole TP-sharded matrix, once.

A weight that ``parallelize_module`` made a DTensor (``ColwiseParallel``: ``Shard(0)``, local
shard ``(out/T, in)``; ``RowwiseParallel``: ``Shard(1)``, ``(out, in/T)``) is dedicated shard by
shard: each TP rank dedicates its *local shard* over its data-parallel mesh exactly like a plain
weight (owner-packed unshard and reduce, HSDP replicate stage). The plan is computed from the
same specs on every rank, so shard ``t`` of a matrix has the same DP owner ``d`` on every TP
rank: the TP group at DP coordinate ``d`` holds the whole matrix, one shard per member.

Per step, in that TP group (:class:`TPStage`), one shape bucket of whole matrices at a time (a
TP owner holds one bucket's gathered pieces and whole matrices, not all of its matrices'):

1. each member updates the momentum of its shard (elementwise: sharding changes nothing) and
   the Nesterov input ``u_t``;
2. the ``u_t`` are gathered to the matrix's *TP owner* ``t*``, which runs Newton–Schulz on the
   whole matrix (never blockwise on shards: that changes the update);
3. ``t*`` scatters the update's shards back; each member applies its shard with the learning-
   rate scale of the *global* shape. With ``Muon(replicate_async=True)`` (and no HSDP) the
   scatter is left in flight — an entry of the runtime's pending-update queue (``_pending.py``)
   — and applied right before the group's next unshard (its forward pre-hook or the prefetch
   before it), or before anything reads or writes the weight (``p.full_tensor()``,
   ``p.to_local()``, ``model.state_dict()``, DCP, an in-place edit);
   ``replicate_async=False`` applies it inside ``step()``. A step first applies whatever an
   earlier step left pending, so two ``step()`` calls without a forward are safe. With HSDP the
   scatter is applied inside ``step()``, before the replicate publish reads the new weights.

The owners ``(d, t*)`` are spread by LPT over all DP × TP slots (:func:`plan_tp_owners`): a
TP matrix costs its whole-matrix NS on one slot; a plain (TP-replicated) matrix is charged on
every TP slot of its DP column.

A plain dedicated weight of a TP model has one owner per TP column: ``(d, t)`` for every ``t``
(each TP rank's own DP group unshards it from there). Those copies must stay bitwise equal —
separately updated, they drift on GPUs (each column's reduce sums in its own order, kernel
choices differ per rank) — so only TP rank 0 of the owner TP group updates them, and broadcasts
the new weight and its momentum over the TP group (:meth:`TPStage.broadcast_plain`): one
master per weight, the copy ``full_tensor()`` already reads.

The registered parameter is an ``OwnerTensor`` (a DTensor, ``_owned.py``) of the global shape on
the owner TP group (the TP ranks at DP coordinate ``d``) with the plan's placement: there its
local tensor is the master shard, elsewhere it is empty. DCP therefore sees a TP-sharded weight
and reshards it; ``full_tensor()``, torch's full state dict and ``clip_grad_norm_`` work on it
as on a plain dedicated weight. The compute copy
swapped in for forward is a DTensor on this rank's TP mesh with the plan's placement, over the
group's unsharded buffer, so ``parallelize_module``'s input/output redistribution is unchanged.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon_compile import functional as F
from dmuon_compile.distributed import _collectives as C
from dmuon_compile.distributed import _dtensor_compat as _dt
from dmuon_compile.distributed import _fsdp_compat, _owned, mesh_checks
from dmuon_compile.distributed._dedicated_param import DedicatedParam
from dmuon_compile.distributed._owned import local_of, make_owned, wrap_like
from dmuon_compile.distributed.owner_plan import (
    MatrixSpec,
    OwnerPlan,
    PlanEntry,
    _improve,
    default_layer_key,
    ns_cost_fn,
)
from dmuon_compile.trace_labels import TP_GATHER, TP_SCATTER, label

# ---------------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class TPInfo:
    """The TP axis of a model: this rank's TP mesh (the one ``parallelize_module`` used)."""

    mesh: DeviceMesh
    dim_name: str
    # The DP × TP mesh FSDP2 puts TP parameters on (:func:`dp_tp_mesh`); None: TP mesh alone.
    dp_tp: DeviceMesh | None = None

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


def detect_tp(selected, dp_mesh: DeviceMesh, replicate_mesh=None) -> TPInfo | None:
    """The TP axis of the selected DTensor parameters (``None`` when there are none).

    The TP dims are each parameter's ``DTensor.mesh_dim_names`` minus the data-parallel names
    (the names of ``mesh`` and ``replicate_mesh``), so every mesh must be named. Supported:
    one TP dim, each weight ``Shard(0)`` (colwise) or ``Shard(1)`` (rowwise) with an even split.
    """
    dp_names: set[str] = set()
    dtensors = [(n, p) for n, p in selected if isinstance(p, DTensor)]
    if not dtensors:
        return None
    for m in (dp_mesh, replicate_mesh):
        if m is None:
            continue
        if m.mesh_dim_names is None:
            raise ValueError(
                f"{mesh_checks.TP_ERROR}\n(the data-parallel mesh passed to dedicate_params has "
                "no mesh_dim_names)"
            )
        dp_names.update(m.mesh_dim_names)
    info = None
    for name, p in dtensors:
        mesh = p.device_mesh
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"{mesh_checks.TP_ERROR}\n(parameter {name} is a DTensor on an unnamed mesh)"
            )
        tp_names = [n for n in mesh.mesh_dim_names if n not in dp_names]
        if mesh.ndim != 1 or len(tp_names) != 1:
            raise ValueError(
                f"dedicate_params: {name} is a DTensor on mesh dims {mesh.mesh_dim_names}; with "
                f"data-parallel dims {sorted(dp_names)} that leaves TP dims {tp_names}. Supported: "
                'one TP dim: parallelize_module(model, mesh["tp"], plan), then '
                'dedicate_params(model, mesh["dp"]) (or mesh["shard"] with replicate_mesh=).'
            )
        placement = p.placements[0]
        if not isinstance(placement, Shard) or placement.dim not in (0, 1) or p.ndim != 2:
            raise ValueError(
                f"dedicate_params: {name} is a {p.ndim}-D DTensor with placement {placement}; TP "
                "dedication supports 2-D weights sharded by ColwiseParallel (Shard(0)) or "
                "RowwiseParallel (Shard(1)). Exclude it with predicate= (it then gets AdamW)."
            )
        if p.shape[placement.dim] % mesh.size() != 0:
            raise ValueError(
                f"dedicate_params: {name} has shape {tuple(p.shape)}, dim {placement.dim} not "
                f"divisible by the TP size {mesh.size()}; the TP gather needs even shards. Pick "
                "sizes divisible by the TP size or exclude it with predicate=."
            )
        if info is None:
            info = TPInfo(mesh, tp_names[0], dp_tp_mesh(dp_mesh, replicate_mesh, mesh))
        elif mesh != info.mesh:
            raise ValueError(
                f"dedicate_params: {name} lives on TP mesh {mesh}, another weight on {info.mesh}; "
                "use one TP mesh for the whole model."
            )
    return info


def detect_tp_mesh(model: nn.Module, dp_mesh: DeviceMesh, replicate_mesh=None) -> TPInfo | None:
    """The TP axis of a model none of whose *dedicated* weights is TP-sharded (``None`` when
    no parameter is a DTensor on a named mesh with one data-parallel-free dim).

    Its plain dedicated weights are held by every TP rank of the owner's column all the same,
    so they need the TP stage's one-master rule (:meth:`TPStage.broadcast_plain`).
    """
    dp_names = {
        n for m in (dp_mesh, replicate_mesh) if m is not None for n in m.mesh_dim_names or ()
    }
    for p in model.parameters():
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        if mesh is None or mesh.ndim != 1 or mesh.mesh_dim_names is None:
            continue
        (name,) = mesh.mesh_dim_names
        if name not in dp_names and mesh.size() > 1:
            return TPInfo(mesh, name, dp_tp_mesh(dp_mesh, replicate_mesh, mesh))
    return None


def dp_grid_mesh(mesh: DeviceMesh, replicate_mesh) -> DeviceMesh:
    """The data-parallel mesh of this rank's TP coordinate: ``mesh`` (1-D), or the 2-D
    (replicate, shard) mesh of the HSDP slices, whatever their names."""
    if replicate_mesh is None:
        return mesh
    return mesh_checks.hsdp_mesh(mesh, replicate_mesh)


def dp_tp_mesh(mesh: DeviceMesh, replicate_mesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The data-parallel dims then the TP dim: the mesh FSDP2 puts a TP parameter on (and the
    rows of TP groups), also for slices of a mesh unflattened from a flattened 1-D root (where
    the root itself has none of these dims). ``None`` when the meshes are unrelated."""
    try:
        return _fsdp_compat.joined_mesh([dp_grid_mesh(mesh, replicate_mesh), tp_mesh])
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------- planning


@dataclass
class TPPlan:
    """Owners over the DP × TP slots: ``slot = dp_index * tp_size + tp_rank``."""

    dp_size: int
    tp_size: int
    tp_owner: dict[str, int] = field(default_factory=dict)  # TP matrices only: t*
    slot_flops: list[float] = field(default_factory=list)
    matrix_flops: list[float] = field(default_factory=list)  # TP matrices (one slot each)

    def lower_bound(self) -> float:
        """A lower bound on the most loaded slot of *any* plan with whole matrices.

        ``max(mean, largest)``, and for two matrix costs ``a ≥ b``: below ``a + b`` a slot holds
        at most one matrix of cost ≥ a and then none ≥ b besides, and any other slot at most
        ``ceil((a+b)/b) − 1`` matrices of cost ≥ b; more matrices ≥ b than that allows force
        ``a + b`` (70B on 256 ranks: 240 MLP matrices each fill a slot, the 160 q/o cannot
        all pair up on the other 16, so the best plan puts one beside an MLP matrix).
        """
        loads, costs = self.slot_flops, sorted(self.matrix_flops, reverse=True)
        slots = len(loads)
        bound = max(sum(loads) / slots if slots else 0.0, costs[0] if costs else 0.0)
        distinct = sorted(set(costs), reverse=True)
        for i, a in enumerate(distinct):
            n_a = sum(1 for c in costs if c >= a)
            if n_a > slots:
                continue
            for b in distinct[i:]:
                if b <= 0 or a + b <= bound:
                    continue
                per_slot = -(-(a + b) // b) - 1
                if sum(1 for c in costs if c >= b) > n_a + (slots - n_a) * per_slot:
                    bound = a + b
        return bound

    def balance(self) -> dict[str, float]:
        loads = self.slot_flops
        mean = sum(loads) / len(loads) if loads else 0.0
        bound = self.lower_bound()
        return {
            "ns_max_over_mean": max(loads) / mean if mean else 1.0,
            "ns_max_over_lower_bound": max(loads) / bound if bound else 1.0,
            "best_possible_max_over_mean": bound / mean if mean else 1.0,
        }

    def digest_text(self) -> str:
        return repr(sorted(self.tp_owner.items())) + f"|{self.dp_size}x{self.tp_size}"


def plan_tp_owners(
    specs: list[MatrixSpec],
    dp_size: int,
    tp_size: int,
    tp_fqns: set[str],
    *,
    ns=None,
    layer_id_fn=None,
    improve_rounds: int = 2000,
) -> tuple[OwnerPlan, TPPlan]:
    """LPT over the ``dp_size × tp_size`` slots; deterministic (a function of the specs).

    ``specs`` carry *global* shapes (the NS cost is that of the whole matrix). A matrix in
    ``tp_fqns`` takes one slot ``(d, t*)``; any other matrix takes its cost on all ``tp_size``
    slots of one DP column ``d``. Returns the DP plan (owner = ``d``, what the DP machinery
    uses) and the TP plan (``t*`` per TP matrix, the slot loads).

    >>> from dmuon_compile.distributed.owner_plan import llama_matrix_specs
    >>> specs = llama_matrix_specs(4, 64, 256, 64)
    >>> dp, tp = plan_tp_owners(specs, 2, 2, {s.fqn for s in specs})
    >>> round(tp.balance()["ns_max_over_lower_bound"], 2) <= 1.05
    True
    """
    flops_of = ns_cost_fn(ns)
    specs = sorted(specs, key=lambda s: s.fqn)
    layer_of = layer_id_fn or default_layer_key
    layers = [str(layer_of(s.fqn) or default_layer_key(s.fqn)) for s in specs]
    flops = [float(flops_of(*s.matrix_shape)) for s in specs]
    sizes = [s.numel * s.itemsize for s in specs]
    total = sum(f * (1 if s.fqn in tp_fqns else tp_size) for f, s in zip(flops, specs)) or 1.0
    cost = [f / total for f in flops]
    slots = dp_size * tp_size
    loads = [0.0] * slots
    column_bytes = [0] * dp_size
    layer_bytes: dict[str, list[int]] = defaultdict(lambda: [0] * dp_size)
    slot_of = [0] * len(specs)
    order = sorted(range(len(specs)), key=lambda i: (-cost[i], layers[i], specs[i].fqn))
    for i in order:
        lb = layer_bytes[layers[i]]
        if specs[i].fqn in tp_fqns:
            low = min(loads)
            k = min(
                range(slots),
                key=lambda k: (
                    loads[k] > low * (1 + 1e-9) + 1e-15,
                    lb[k // tp_size],
                    column_bytes[k // tp_size],
                    k,
                ),
            )
            loads[k] += cost[i]
        else:  # every TP rank of column d runs NS on its own copy
            col = [max(loads[d * tp_size : (d + 1) * tp_size]) for d in range(dp_size)]
            low = min(col)
            d = min(
                range(dp_size),
                key=lambda d: (col[d] > low * (1 + 1e-9) + 1e-15, lb[d], column_bytes[d], d),
            )
            k = d * tp_size
            for t in range(tp_size):
                loads[k + t] += cost[i]
        slot_of[i] = k
        lb[k // tp_size] += sizes[i]
        column_bytes[k // tp_size] += sizes[i]
    movable = [i for i, s in enumerate(specs) if s.fqn in tp_fqns]
    if movable and len(movable) == len(specs):
        _improve(slot_of, cost, loads, improve_rounds)
    elif movable:  # keep the plain matrices' columns fixed; move the TP ones only
        sub_owner = [slot_of[i] for i in movable]
        _improve(sub_owner, [cost[i] for i in movable], loads, improve_rounds)
        for i, k in zip(movable, sub_owner):
            slot_of[i] = k
    entries = [
        PlanEntry(
            s.fqn,
            tuple(int(x) for x in s.shape),
            slot_of[i] // tp_size,
            layers[i],
            flops[i],
            sizes[i] // (tp_size if s.fqn in tp_fqns else 1),
        )
        for i, s in enumerate(specs)
    ]
    tp_plan = TPPlan(
        dp_size,
        tp_size,
        {s.fqn: slot_of[i] % tp_size for i, s in enumerate(specs) if s.fqn in tp_fqns},
        [x * total for x in loads],
        [f for f, s in zip(flops, specs) if s.fqn in tp_fqns],
    )
    return OwnerPlan(world_size=dp_size, entries=entries), tp_plan


# ---------------------------------------------------------------------------------- parameter

_TP_MESHES: dict[tuple, DeviceMesh] = {}


def owner_tp_mesh(info: TPInfo, ranks: list[int]) -> DeviceMesh:
    """The TP group of the owner's DP coordinate: this rank's own TP mesh when it is a member
    (it has a process group, so DTensor ops that communicate work there), else a backend-less
    mesh (``full_tensor()`` broadcasts on the default group, so it needs none)."""
    if sorted(ranks) == sorted(int(r) for r in info.mesh.mesh.flatten().tolist()):
        return info.mesh
    key = (info.mesh.device_type, tuple(ranks), info.dim_name)
    mesh = _TP_MESHES.get(key)
    if mesh is None:
        mesh = _dt.mesh_without_backend(info.mesh.device_type, ranks, (info.dim_name,))
        _TP_MESHES[key] = mesh
    return mesh


@dataclass(eq=False)
class TPDedicatedParam(DedicatedParam):
    """A dedicated TP shard: ``shape`` is the local shard's (what the DP group moves)."""

    global_shape: torch.Size | None = None
    shard_dim: int = 0
    tp_owner: int = 0  # t*: the TP rank that runs NS on the whole matrix
    tp_mesh: DeviceMesh | None = None  # this rank's TP mesh (the compute copy's)
    reg_mesh: DeviceMesh | None = None  # the owner TP group (the registered parameter's)

    def bind(self, flat: Tensor) -> None:
        local = torch.empty(0, dtype=flat.dtype, device=flat.device)
        with torch.no_grad():
            local.set_(flat.untyped_storage(), flat.storage_offset() + self.offset, self.shape)
        self.unsharded = _dtensor(local, self.tp_mesh, self.shard_dim, self.global_shape, True)

    def register(self, mesh, master: Tensor | None, device: torch.device) -> None:  # noqa: ARG002
        # An OwnerTensor on the owner group: full_tensor(), clip_grad_norm_ and DCP's full state
        # dict treat it like a plain dedicated weight (_owned.py).
        self.param = make_owned(
            master,
            self.reg_mesh,
            self.global_shape,
            self.orig_dtype,
            device,
            requires_grad=True,
            placement=Shard(self.shard_dim),
        )
        self.param._is_param = True
        self.owns = master is not None
        self._empty_grad = None if self.owns else self._wrap(None)
        self.module._parameters[self.attr] = self.param

    def _wrap(self, local: Tensor | None) -> DTensor:
        return wrap_like(local, self.param)

    @torch.no_grad()
    def accumulate_grad(self, full: Tensor | None) -> None:
        grad = self.param.grad
        if grad is None and full is None:
            self.param.grad = self._empty_grad if self._empty_grad is not None else self._wrap(None)
        elif grad is None:
            self.param.grad = self._wrap(full.to(self.orig_dtype))
        elif full is not None:
            local_of(grad).add_(full.to(self.orig_dtype))


def _dtensor(local: Tensor, mesh: DeviceMesh, dim: int, shape, requires_grad: bool) -> DTensor:
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    plain = DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=stride
    )
    return DTensor(_dt.local_tensor(plain), _dt.spec(plain), requires_grad=requires_grad)


def make_tp_param(
    name,
    module,
    attr,
    owner,
    p: DTensor,
    orig_dtype,
    param_dtype,
    replica_owner,
    tp_owner,
    info,
    reg_ranks,
) -> TPDedicatedParam:
    local_shape = p.to_local().shape
    return TPDedicatedParam(
        name,
        module,
        attr,
        owner,
        local_shape,
        orig_dtype,
        param_dtype,
        replica_owner=replica_owner,
        global_shape=p.shape,
        shard_dim=p.placements[0].dim,
        tp_owner=tp_owner,
        tp_mesh=info.mesh,
        reg_mesh=owner_tp_mesh(info, reg_ranks),
    )


# ---------------------------------------------------------------------------------- the step


@dataclass
class TPStepHalf:
    """What ``Muon.step``'s directions of a part's TP matrices leave for :meth:`TPStage.commit`
    / :meth:`TPStage.abort`: their gradients and momentum buffers, the pending scatters."""

    grads: list
    bufs: list
    momentum: object
    entries: list  # (id of the hook group, pending apply entry)


@dataclass
class TPProfile:
    gathers: int = 0
    gather_bytes: int = 0  # bytes this rank sent to TP owners (its shards of the NS inputs)
    scatters: int = 0
    scatter_bytes: int = 0  # bytes this rank received from TP owners (its update shards)
    waits: int = 0  # forward waits for a pending scatter (async mode)
    not_ready: int = 0  # ... that found it not finished yet
    wait_s: float = 0.0
    plain_broadcasts: int = 0  # plain dedicated weights and momenta from the TP source


def _tp_buckets(mine: list) -> list[list]:
    """``mine`` (``(dp, master, grad, buf)`` rows) grouped by whole-matrix shape and dtype, in
    first-seen order: the same buckets in the same order on every member of the owner TP group
    (keyed by global shape: the collectives stay SPMD), one batched NS stack per owner and
    bucket."""
    buckets: dict[tuple, list] = {}
    for row in mine:
        dp, master = row[0], row[1]
        buckets.setdefault((tuple(dp.global_shape), master.dtype), []).append(row)
    return list(buckets.values())


PLAIN_SOURCE = 0  # the TP rank that updates a column's plain dedicated weights


@dataclass(eq=False)
class TPStage:
    """The TP stage of one model: gather → NS on the TP owner → scatter (see the module doc)."""

    info: TPInfo
    pg: object
    params: list[TPDedicatedParam]
    deferrable: bool  # False with HSDP: the replicate publish needs the applied weights
    group_of: dict[int, int] = field(default_factory=dict)  # id(param) -> id(hook group)
    queue: object = None  # the runtime's pending updates (``_pending.py``): deferred scatters
    profile: TPProfile = field(default_factory=TPProfile)
    record_profile: bool = False
    plan: TPPlan | None = None

    def __post_init__(self) -> None:
        self.by_param = {id(p.param): p for p in self.params}

    def split(self, params, grads, bufs):
        """``(TP [(dp, p, g, b)], rest)`` of a Muon group's lists."""
        mine, rest = [], ([], [], [])
        for p, g, b in zip(params, grads, bufs):
            dp = self.by_param.get(id(p))
            if dp is None:
                for xs, x in zip(rest, (p, g, b)):
                    xs.append(x)
            elif dp.owns:  # the whole owner TP group owns it: SPMD inside that group
                mine.append((dp, local_of(p), local_of(g), local_of(b)))
        return mine, rest

    def _global(self, tp_rank: int) -> int:
        return dist.get_global_rank(self.pg, tp_rank)

    @staticmethod
    def buckets(mine: list) -> list[list]:
        """The TP rows of :meth:`split` by shape bucket (:func:`_tp_buckets`): the step gathers,
        orthogonalises and scatters one bucket at a time."""
        return _tp_buckets(mine)

    @torch.no_grad()
    def gather(self, bucket: list, updates: list) -> list[tuple[int, Tensor]]:
        """The Nesterov inputs ``updates`` of a bucket's rows gathered to their TP owners:
        ``[(row index, whole matrix)]`` for the matrices this rank orthogonalises (none
        elsewhere). Issued on every member whatever happened locally (a failed member sends
        placeholders): the TP group's collectives stay paired."""
        with label(TP_GATHER):
            gathered = self._gather(bucket, updates)
        return [
            (i, torch.cat(parts, dim=dp.shard_dim))
            for i, ((dp, *_), parts) in enumerate(zip(bucket, gathered))
            if parts is not None
        ]

    @torch.no_grad()
    def scatter(
        self, bucket: list, updates: list, ortho: dict, lr: float, wd: float, adjust_lr_fn: str
    ) -> list:
        """The TP owners' orthogonalised matrices (``ortho``: row index → whole matrix, on the
        owner) scattered back in shards, async; returns the pending apply entries ``[(id of the
        hook group, entry)]`` for :class:`TPStepHalf`. ``updates`` give the shards' shape and
        dtype (and stand in for the owner's matrix after a failure)."""
        size, me = self.info.size, self.info.rank
        entries = []
        with label(TP_SCATTER):
            for i, ((dp, master, _g, _b), u) in enumerate(zip(bucket, updates)):
                out = torch.empty_like(u)
                chunks = None
                if i in ortho:
                    chunks = [
                        c.contiguous() for c in ortho[i].to(u.dtype).chunk(size, dim=dp.shard_dim)
                    ]
                work = dist.scatter(
                    out, chunks, src=self._global(dp.tp_owner), group=self.pg, async_op=True
                )
                entry = (master, out, work, lr, wd, adjust_lr_fn, dp.global_shape)
                entries.append((self.group_of.get(id(dp.param), 0), entry))
                if self.record_profile:
                    self.profile.scatters += 1
                    self.profile.scatter_bytes += (
                        out.numel() * out.element_size() * int(me != dp.tp_owner)
                    )
        return entries

    def _gather(self, mine: list, updates: list) -> list:
        """Each matrix's Nesterov input shards to its TP owner: the owner's pieces (``None``
        elsewhere), per matrix."""
        size, me = self.info.size, self.info.rank
        gathered, works = [], []
        for (dp, *_), u in zip(mine, updates):
            u = u.contiguous()
            parts = [torch.empty_like(u) for _ in range(size)] if me == dp.tp_owner else None
            works.append(
                dist.gather(u, parts, dst=self._global(dp.tp_owner), group=self.pg, async_op=True)
            )
            gathered.append(parts)
            if self.record_profile:
                self.profile.gathers += 1
                self.profile.gather_bytes += u.numel() * u.element_size() * int(me != dp.tp_owner)
        for w in works:
            C.wait(w, "the TP gather of Muon inputs to the TP owners", self.pg)
        return gathered

    @torch.no_grad()
    def commit(self, half: TPStepHalf, defer: bool) -> None:
        """Store the momentum and apply the scattered update shards now, or with ``defer`` (and
        no HSDP) queue them in the runtime's pending updates: applied before the group's next
        unshard or any read of the weight."""
        torch._foreach_mul_(half.bufs, F.hyper(half.momentum))
        torch._foreach_add_(half.bufs, half.grads)
        by_group: dict[int, list] = {}
        for key, entry in half.entries:
            by_group.setdefault(key, []).append(entry)
        for key, entries in by_group.items():
            if defer and self.deferrable:
                self.queue.add(key, ScatterUpdates(self, entries))
            else:
                self._apply(entries, forward=False)

    def abort(self, half: TPStepHalf) -> None:
        """A step that failed on some rank: wait for the scatters (every member issued them)
        and drop their results."""
        for _key, entry in half.entries:
            C.wait(entry[2], "the TP scatter of Newton–Schulz updates", self.pg)

    def orthogonalize(self, mats: list[Tensor], ns) -> list[Tensor]:
        """Newton–Schulz on whole matrices, eager (the reference's ``functional.orthogonalize``;
        the compiled step's ``orthogonalize`` where ``compile`` is on)."""
        return F.orthogonalize(mats, ns)

    def _apply(self, entries, forward: bool) -> None:
        with label(TP_SCATTER):
            self._apply_shards(entries, forward)

    @torch.no_grad()
    def _apply_shards(self, entries, forward: bool) -> None:
        """Wait for the scattered update shards and apply them to this member's masters."""
        if forward and self.record_profile:
            self.profile.waits += 1
            self.profile.not_ready += int(not all(_is_done(e[2]) for e in entries))
            t0 = time.perf_counter()
        for master, out, work, lr, wd, adjust_lr_fn, global_shape in entries:
            C.wait(work, "the TP scatter of Newton–Schulz updates", self.pg)
            if out.is_cuda:  # applied on the unshard side stream: keep the block until then
                out.record_stream(torch.cuda.current_stream(out.device))
            # The reference's update on this rank's shard, scaled as the whole matrix.
            F.apply_muon_update([master], [out], lr, wd, adjust_lr_fn, [global_shape])
        if forward and self.record_profile:
            self.profile.wait_s += time.perf_counter() - t0

    # ------------------------------------------------------- plain weights of a TP model

    def updates_plain(self) -> bool:
        """Whether this rank updates the plain dedicated weights of its TP column: TP rank 0
        only; the other TP ranks of the column take the result from :meth:`broadcast_plain`."""
        return self.info.rank == PLAIN_SOURCE

    @torch.compiler.disable  # collectives stay eager (the user may compile opt.step)
    @torch.no_grad()
    def broadcast_plain(self, masters: list[Tensor], bufs: list[Tensor]) -> None:
        """The TP source's plain masters and momentum buffers, in place on every TP rank.

        ``masters`` are this rank's owned plain weights of one Muon group part (their local
        tensors): every member of the TP group holds the same list (they share the DP
        coordinate that owns them), so the broadcasts pair up. In place, no packing buffer:
        the step's memory stays that of the update.
        """
        works = [C.broadcast(t, PLAIN_SOURCE, self.pg) for pair in zip(masters, bufs) for t in pair]
        for work in works:
            C.wait(work, "the TP broadcast of plain dedicated weights", self.pg)
        if self.record_profile:
            self.profile.plain_broadcasts += len(works)

    def summary(self, runtime) -> dict:
        """What ``summarize_comm_plan`` shows for the TP stage (this rank's view)."""
        rows, gather, scatter = [], 0, 0
        me = self.info.rank
        for p in self.params:
            nbytes = p.numel * torch.empty((), dtype=p.orig_dtype).element_size()
            owns = p.owns
            if owns and me != p.tp_owner:
                gather += nbytes
                scatter += nbytes
            rows.append(
                {
                    "fqn": p.fqn,
                    "global_shape": list(p.global_shape),
                    "placement": f"Shard({p.shard_dim})",
                    "dp_owner": p.owner,
                    "tp_owner": p.tp_owner,
                    "this_rank_in_owner_group": owns,
                    "ns_here": owns and me == p.tp_owner,
                }
            )
        return {
            "tp_size": self.info.size,
            "tp_rank": me,
            "tp_dim": self.info.dim_name,
            "scatter_async": self.deferrable,
            "gather_bytes_per_step": gather,
            "scatter_bytes_per_step": scatter,
            "ns_matrices_here": sum(1 for r in rows if r["ns_here"]),
            "matrices": rows,
        }


@dataclass(eq=False)
class ScatterUpdates:
    """A pending update (``_pending.py``): one hook group's TP update shards in flight."""

    stage: TPStage
    entries: list  # (master, out, work, lr, wd, adjust_lr_fn, global_shape)

    @property
    def collectives(self) -> int:
        return len(self.entries)

    def apply(self, forward: bool) -> None:
        entries, self.entries = self.entries, []
        if entries:
            self.stage._apply(entries, forward)


def _is_done(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return False


def owner_group_ranks(info: TPInfo, rank_grid, replica_owner: int, owner: int) -> list[int]:
    """Global ranks of the TP group at DP coordinate ``(replica_owner, owner)``, in TP order."""
    return _tp_row(info, int(rank_grid[replica_owner, owner]))  # that coordinate in this column


def build_stage(info, pg, tp_plan, params, groups, replicated: bool) -> TPStage:
    """The model's TP stage (its deferred scatters go to the runtime's queue, ``attach_tp``)."""
    tp_params = [p for p in params if isinstance(p, TPDedicatedParam)]
    stage = TPStage(info, pg, tp_params, deferrable=not replicated)
    for g in groups:
        for p in g.params:
            stage.group_of[id(p.param)] = id(g)
    stage.plan = tp_plan
    _register_owner_meshes(info, params)
    return stage


def _tp_row(info: TPInfo, global_rank: int) -> list[int]:
    """Global ranks of the TP group that holds ``global_rank``, in TP order."""
    root = info.dp_tp
    if root is None:
        rows = info.mesh.mesh.reshape(1, -1)
    else:
        axis = list(root.mesh_dim_names).index(info.dim_name)
        rows = root.mesh.movedim(axis, -1).reshape(-1, info.size)
    for row in rows.tolist():
        if global_rank in row:
            return [int(r) for r in row]
    raise RuntimeError(f"rank {global_rank} is in no TP group of {root}")  # a mesh we cannot read


def _register_owner_meshes(info: TPInfo, params) -> None:
    """What ``_owned`` needs for the registered weights of a TP model.

    Norms (``clip_grad_norm_``) are given on the DP × TP mesh: a TP shard is held by one rank
    of the whole job (partial over every dim); a plain weight once per TP column (partial over
    the DP dims, ``Replicate`` over TP). ``full_tensor`` broadcasts each TP shard from its owner
    group member, and a plain weight from its owner in TP column 0, which every rank can name
    (each column's owner differs; a broadcast from "this column's owner" would not be SPMD):
    the copy the column's TP rank 0 updates and broadcasts (``TPStage.broadcast_plain``).
    """
    norm_mesh = info.dp_tp if info.dp_tp is not None else info.mesh
    dp_dims = {n for n in norm_mesh.mesh_dim_names or () if n != info.dim_name}
    for p in params:
        mesh = p.param.device_mesh
        if isinstance(p, TPDedicatedParam):
            _owned.register_group(mesh, mesh.mesh.flatten().tolist())
            _owned.set_norm_mesh(mesh, norm_mesh)
        else:
            _owned.set_norm_mesh(mesh, norm_mesh, dp_dims)
            _owned.set_source(mesh, _tp_row(info, _owned.owner_rank(p.param))[PLAIN_SOURCE])
