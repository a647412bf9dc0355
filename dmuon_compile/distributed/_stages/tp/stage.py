"""The TP stage of a step (a ``stages.StepStage``): gather the Nesterov inputs to each matrix's TP
owner, Newton–Schulz there, scatter the update's shards back (applied now or queued as a pending
update), or, for a blocked matrix whose shards hold whole blocks, Newton–Schulz of each member's
own blocks with no collective; and the one-master broadcast of a TP model's plain dedicated
weights (see the package doc).

NorMuon (``Muon(normuon=True)``, ``normuon.py``): right after Newton–Schulz, before a blocked
matrix's per-block learning-rate scale (the one-process order: ``functional.muon_directions``
normalises, ``apply_muon_update`` scales), each matrix is normalised row by row where it is
whole: on its TP owner, with the whole second moment ``v`` (its members' rows gathered with the
Nesterov inputs; a replicated ``v``: the owner's own, ``moments.py``), each member getting its
rows of ``v′`` back (a scatter, or a broadcast of a replicated ``v′``) before the update's
scatter goes out; or, where each member holds whole blocks, on the member, block by block (a
block is a matrix of its own: its rows and its Frobenius norm are the member's). ``v′`` is
stored by :meth:`TPStage.commit` with the momentum, only for a step that commits; a plain
weight's ``v`` goes with its master and momentum from TP rank 0."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile import functional as F
from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._comm.pending import PendingUpdates
from dmuon_compile.distributed._owner import meshes as _owner_meshes
from dmuon_compile.distributed._owner.tensor import local_of
from dmuon_compile.distributed._stages.tp import moments as _moments
from dmuon_compile.distributed._stages.tp.detect import TPInfo, tp_row
from dmuon_compile.distributed._stages.tp.param import TPDedicatedParam
from dmuon_compile.distributed._stages.tp.plan import TPOwners
from dmuon_compile.distributed.stages import (
    READ,
    MuonJob,
    StageDirections,
    StepHalf,
    StepNS,
    local_job,
    no_halves,
)
from dmuon_compile.layouts import Layout, block_shard_layouts, get_layout, needs_reshard
from dmuon_compile.normuon import normalize_all
from dmuon_compile.step_phases import (
    PHASE_TP_MOMENTUM,
    PHASE_TP_NS_COMPILED,
    PHASE_TP_NS_EAGER,
    guarded,
)
from dmuon_compile.trace_labels import NS, TP_GATHER, TP_SCATTER, label


class TPRow(NamedTuple):
    """A TP matrix of a Muon group's lists that this rank's owner TP group steps: its local
    tensors (this member's shard of master, gradient and momentum)."""

    param: TPDedicatedParam
    master: Tensor
    grad: Tensor
    buf: Tensor
    layout: Layout  # the whole matrix's; its blocks (per head) are cut on the TP owner, or on
    # each member when every shard holds whole blocks (``local_blocks_layout``)
    moment: Tensor | None = None  # NorMuon: this member's piece of v (``moments.py``)


class ScatterShard(NamedTuple):
    """One matrix's update shard in flight from its TP owner, and how to apply it."""

    hook_group: int  # id of the hook group whose unshard applies it (deferred scatters)
    master: Tensor
    out: Tensor  # the received update shard
    work: dist.Work  # the async scatter's work handle
    lr: float
    wd: float
    adjust_lr_fn: str
    global_shape: tuple  # the whole matrix's shape: the lr scale


class LocalUpdate(NamedTuple):
    """One matrix's update shard computed on this member from its own whole blocks."""

    master: Tensor
    out: Tensor
    lr: float
    wd: float
    adjust_lr_fn: str
    global_shape: tuple  # the whole matrix's shape: the lr scale


@dataclass
class TPStepHalf:
    """What the directions of a job (:meth:`TPStage.directions`) leave for :meth:`TPStage.commit`
    / :meth:`TPStage.abort`: its TP matrices' gradients and momentum buffers, the pending
    scatters; and its plain weights (local masters and momenta) for
    :meth:`TPStage.broadcast_plain` (sent after the optimizer's commit on TP rank 0, received
    elsewhere)."""

    grads: list[Tensor]
    bufs: list[Tensor]
    momentum: float | Tensor  # the group's momentum (a 0-d tensor in Muon groups)
    shards: list[ScatterShard]
    plain_masters: list[Tensor] = field(default_factory=list)
    plain_bufs: list[Tensor] = field(default_factory=list)
    local: list[LocalUpdate] = field(default_factory=list)  # the blocks orthogonalised here
    # NorMuon: the TP matrices' second moments (this member's pieces, the state) and their v′,
    # in ``grads``' order, stored by the commit; the plain weights' v (sent from TP rank 0).
    moments: list[Tensor] = field(default_factory=list)
    new_moments: list[Tensor] = field(default_factory=list)
    plain_moments: list[Tensor] = field(default_factory=list)


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
    local_matrices: int = 0  # TP matrices orthogonalised block by block on their shards


def _tp_buckets(rows: list[TPRow]) -> list[list[TPRow]]:
    """``rows`` grouped by whole-matrix shape and dtype, in first-seen order: the same buckets
    in the same order on every member of the owner TP group (keyed by global shape: the
    collectives stay SPMD), one batched NS stack per owner and bucket."""
    buckets: dict[tuple, list[TPRow]] = {}
    for row in rows:
        key = (tuple(row.param.global_shape), row.master.dtype, row.layout)
        buckets.setdefault(key, []).append(row)
    return list(buckets.values())


PLAIN_SOURCE = 0  # the TP rank that updates a column's plain dedicated weights


def _nesterov_inputs(group: dict, bucket: list[TPRow], failure: list) -> list[Tensor]:
    """The bucket's Nesterov inputs from this member's shards, or (after a failure here, which
    ``failure`` records) its gradients as placeholders that are sent but never committed."""
    grads, bufs = [r.grad for r in bucket], [r.buf for r in bucket]
    if failure:
        return grads
    momentum = F.hyper(group["momentum"])
    compute = lambda: F.nesterov_input(grads, bufs, momentum, group["nesterov"])  # noqa: E731
    return guarded(failure, PHASE_TP_MOMENTUM, compute, grads)


def _finite(grads: list[Tensor], bufs: list[Tensor], moments: list[Tensor]) -> Tensor:
    """Per TP matrix: this member's gradient, momentum and ``v′`` all finite (1-D bool), by one
    ``foreach`` norm (what ``StepAgreement.check_finite`` would read, and ``v′``)."""
    k = len(grads)
    tensors = [t.float() if t.dtype != torch.float32 else t for t in [*grads, *bufs, *moments]]
    norms = torch.stack([n.to(grads[0].device) for n in torch._foreach_norm(tensors)])
    return torch.isfinite(norms).reshape(3, k).all(0)


@functools.lru_cache(maxsize=256)
def _shard_layouts(layout: Layout, shape: tuple, dim: int, size: int) -> list[Layout] | None:
    return block_shard_layouts(layout, shape, dim, size)


def local_blocks_layout(dp: TPDedicatedParam, layout: Layout, size: int, rank: int):
    """The layout of TP rank ``rank``'s shard of ``dp`` when every shard holds whole blocks of
    ``layout`` (then each member orthogonalises its own blocks: no gather, no scatter), else
    ``None``. Decided from the configuration alone (layout, global shape, shard dim, TP size):
    every member of the TP group takes the same path, so the collectives stay paired."""
    if not layout.blocked or size < 2:
        return None
    shards = _shard_layouts(layout, tuple(int(s) for s in dp.global_shape), dp.shard_dim, size)
    return None if shards is None else shards[rank]


@dataclass(eq=False)
class TPStage:
    """The TP stage of one model: gather → NS on the TP owner → scatter (see the package doc).
    ``Muon.step`` drives it as a ``stages.StepStage``."""

    info: TPInfo
    pg: dist.ProcessGroup
    params: list[TPDedicatedParam]
    deferrable: bool  # False with HSDP: the replicate publish needs the applied weights
    group_of: dict[int, int] = field(default_factory=dict)  # id(param) -> id(hook group)
    pending: PendingUpdates | None = None  # the runtime's (``_comm/pending.py``): deferred scatters
    profile: TPProfile = field(default_factory=TPProfile)
    record_profile: bool = False
    owners: TPOwners | None = None
    what: ClassVar[str] = "tensor parallelism"
    defers: ClassVar[bool] = False  # its commit applies the updates the owners scattered
    queues: ClassVar[bool] = True  # deferred scatters wait in the runtime's pending queue
    normuon_ok: ClassVar[bool] = True  # NorMuon where each matrix is whole (the module doc)

    def __post_init__(self) -> None:
        self.by_param = {id(p.param): p for p in self.params}
        self.layouts: dict[int, Layout] = {}  # id(TPDedicatedParam) -> its last step's layout
        self.normuon = None  # the last step's NorMuon config (``StepNS.normuon``; None: off)

    def directions(self, jobs: list[list[MuonJob]], ns: StepNS, failure: list) -> StageDirections:
        """The first half of Muon on the TP matrices of every job, one shape bucket at a time:
        each member's Nesterov inputs, gathered to their TP owners, the optimizer's Newton–Schulz
        on the owner's whole matrices (:meth:`_orthogonalizer`) and the updates' shards
        scattered back, left in flight for :meth:`commit` or :meth:`abort`. Nothing is written.
        A blocked matrix whose shards each hold whole blocks (per-head q/k/v column-parallel, o
        row-parallel, the heads not straddling a shard boundary: :func:`local_blocks_layout`)
        skips the gather and the scatter on every member: each orthogonalises its own blocks.

        The gather and the scatter go out on every member whatever happens locally: a member
        whose momentum or Newton–Schulz raised (or whose step failed earlier: ``failure``
        non-empty) sends placeholders, so the TP group's collectives stay paired and every rank
        learns of the failure in the agreement.

        A job's plain weights (the matrices this rank holds whole, once per TP column) are
        stepped by TP rank 0 only (:meth:`updates_plain`): elsewhere they are taken out of the
        job and received in the commit. Under a user's ``torch.compile(opt.step)``
        (``ns.traced``) a TP matrix raises: its traced directions would see one shard, and
        Newton–Schulz of a shard is not the shard of Newton–Schulz (``Muon(compile=True)``
        compiles the step's math around the gather and scatter instead). The same on every
        rank (which parameters are TP-sharded is the configuration), before any collective."""
        if ns.traced and any(id(p) in self.by_param for js in jobs for j in js for p in j.params):
            raise NotImplementedError(
                "torch.compile(opt.step) with tensor-parallel dedicated weights is not "
                "supported: Newton–Schulz needs each TP matrix gathered whole, outside the "
                "traced step. Call opt.step() uncompiled and let Muon compile its math "
                "(Muon(compile=True), the default on CUDA)"
            )
        self.normuon = ns.normuon
        halves = no_halves(jobs)
        kept_jobs = []
        for part_jobs, part_halves in zip(jobs, halves):
            kept = []
            for job in part_jobs:
                half, rest = self._job_directions(job, ns, failure)
                kept.append(rest)
                if half is not None:
                    part_halves.append(self._step_half(job.group, half, failure))
            kept_jobs.append(kept)
        return StageDirections(kept_jobs, halves)

    def _step_half(self, group: dict, half: TPStepHalf, failure: list) -> StepHalf:
        """The optimizer's view of a TP half: committed by :meth:`commit`. With NorMuon its
        finite flags are read here, ``v′`` included (a loaded non-finite ``v`` would reach the
        weights through the owner's normalisation)."""
        out = StepHalf(group, [], [], [], None, stage=self, stage_half=half)
        if half.new_moments and not failure:
            flags = guarded(
                failure,
                PHASE_TP_MOMENTUM,
                lambda: _finite(half.grads, half.bufs, half.new_moments),
                None,
            )
            if flags is not None:
                out.grads, out.finite, out.path = list(half.grads), flags, READ
        return out

    def _job_directions(
        self, job: MuonJob, ns: StepNS, failure: list
    ) -> tuple[TPStepHalf | None, MuonJob]:
        """One job's TP half (``None`` if nothing of it here) and its other matrices."""
        group = job.group
        tp = [self.by_param.get(id(p)) for p in job.params]
        taken, rest = job.split([dp is not None for dp in tp])
        # The whole owner TP group owns a row (SPMD inside that group); other ranks skip it.
        rows = [
            TPRow(dp, local_of(p), local_of(g), local_of(b), lay, self._moment(dp, lay, g, m))
            for dp, p, g, b, lay, m in zip(
                [dp for dp in tp if dp is not None],
                taken.params,
                taken.grads,
                taken.bufs,
                taken.layouts,
                taken.moments,
            )
            if dp.owns
        ]
        for row in rows:
            self.layouts[id(row.param)] = row.layout
        here = [self._local_layout(row.param, row.layout) is not None for row in rows]
        local_rows = [row for row, h in zip(rows, here) if h]
        gathered_rows = [row for row, h in zip(rows, here) if not h]
        orthogonalize = self._orthogonalizer(group, ns, failure)
        # No collective in the local buckets: where they run among the others changes nothing.
        local: list[LocalUpdate] = []
        walked: list[TPRow] = []  # the rows in the order their v′ come (NorMuon)
        new_moments: list[Tensor] = []
        for bucket in _tp_buckets(local_rows):
            updates, new = self._local_directions(group, bucket, orthogonalize, failure)
            local += updates
            walked += bucket
            new_moments += new
        shards: list[ScatterShard] = []
        for bucket in _tp_buckets(gathered_rows):
            updates, new = self._bucket_directions(group, bucket, orthogonalize, failure)
            shards += updates
            walked += bucket
            new_moments += new
        # The plain weights: what the optimizer steps here after the stages (neither the expert
        # stacks the reshard takes nor other ranks' owner tensors).
        stacks, plain = rest.split(
            [needs_reshard(p, lay) for p, lay in zip(rest.params, rest.layouts)]
        )
        plain = local_job(plain)
        if not self.updates_plain():  # received from TP rank 0 in the commit
            rest = stacks
        if not rows and not plain.params:
            return None, rest
        grads, bufs = [r.grad for r in walked], [r.buf for r in walked]
        half = TPStepHalf(grads, bufs, group["momentum"], shards, plain.params, plain.bufs, local)
        if self.normuon is not None:
            half.moments = [r.moment for r in walked]
            half.new_moments = new_moments
            half.plain_moments = [m for m in plain.moments if m is not None]
        return half, rest

    def _moment(self, dp: TPDedicatedParam, layout: Layout, grad, moment) -> Tensor | None:
        """This member's piece of a TP matrix's second moment with NorMuon (zeros of its shape
        after a failure: the collectives still go out), else ``None``."""
        if self.normuon is None:
            return None
        if moment is not None:
            return local_of(moment)
        shape, dim, size = dp.global_shape, dp.shard_dim, self.info.size
        return _moments.placeholder(layout, shape, dim, size, local_of(grad))

    def _orthogonalizer(
        self, group: dict, ns: StepNS, failure: list
    ) -> Callable[[list[Tensor], Layout], list[Tensor]]:
        """The Newton–Schulz run on a TP owner's whole matrices (one shape bucket at a time;
        none on a non-owner), or on a member's shards of whole blocks: compiled like the rest
        of the step with ``compile=True`` (default on CUDA), else :meth:`orthogonalize`. A
        failure is recorded in ``failure`` and the input returned (placeholders: the scatter
        still goes out)."""

        def orthogonalize(mats: list[Tensor], layout: Layout) -> list[Tensor]:
            if not mats or failure:
                return mats
            lays = [layout] * len(mats) if layout.blocked else None
            compiled = ns.compiled(group, mats, part="tp")
            if compiled is not None:
                return guarded(
                    failure,
                    PHASE_TP_NS_COMPILED,
                    lambda: compiled.orthogonalize(mats, lays),
                    mats,
                )
            by_block = {} if lays is None else {"layouts": lays}
            return guarded(
                failure,
                PHASE_TP_NS_EAGER,
                lambda: self.orthogonalize(mats, ns.ns, **by_block),
                mats,
            )

        return orthogonalize

    def _bucket_directions(
        self, group: dict, bucket: list[TPRow], orthogonalize: Callable, failure: list
    ) -> tuple[list[ScatterShard], list[Tensor]]:
        """One shape bucket's Nesterov inputs, gather to the TP owners, ``orthogonalize`` on
        the whole matrices and the scatter of the updates. The bucket's inputs, gathered pieces
        and whole matrices are freed when it returns, before the next bucket's are made: a TP
        owner holds one bucket's whole matrices. With NorMuon the second moments go with the
        inputs, the owner normalises its whole matrices (before a blocked matrix's per-block
        scale) and each member's ``v′`` comes back before the update's scatter goes out;
        returns ``(update shards, v′ of the bucket's rows)`` (no ``v′`` without NorMuon)."""
        updates = _nesterov_inputs(group, bucket, failure)
        whole = self._gather(bucket, updates)  # {row index: whole matrix} on the TP owner
        moments = None
        if self.normuon is not None:
            with label(TP_GATHER):
                moments = self._gather_moments(bucket)
        layout = bucket[0].layout  # one per bucket (``_tp_buckets``)
        with label(NS):
            out = orthogonalize(list(whole.values()), layout)
        new: dict[int, Tensor] = {}
        if moments is not None:  # NorMuon on the whole matrices, before the blocks' scale
            vs = [moments[i] for i in whole]
            out, vs = self._normalize(out, vs, [layout] * len(out), failure)
            new = dict(zip(whole, vs))
        if layout.blocked and not failure:  # each block's own lr scale, on the owner
            fn = group["adjust_lr_fn"]
            out = [F.scale_blocks_as_whole(o.float(), layout, fn) for o in out]
        ortho = dict(zip(whole, out))
        whole = out = moments = None  # the whole matrices: freed once orthogonalised
        # v′ first: waiting for it below does not wait for the update's scatter behind it.
        works, received = [], []
        if self.normuon is not None:
            with label(TP_SCATTER):
                works, received = self._return_moments(bucket, new)
        lr, wd = float(group["lr"]), float(group["weight_decay"])  # 0-d tensors in Muon groups
        shards = self._scatter(bucket, updates, ortho, lr, wd, group["adjust_lr_fn"])
        for w in works:
            C.wait(w, "the TP scatter of NorMuon's second moments", self.pg)
        return shards, received

    def _normalize(self, mats, vs, layouts, failure: list) -> tuple[list[Tensor], list[Tensor]]:
        """NorMuon's ``normalize_all`` of whole matrices (or blocks): ``(mats, v′)``; after a
        failure here or earlier, the inputs as placeholders."""
        if failure or not mats:
            return list(mats), list(vs)
        config = self.normuon
        return guarded(
            failure,
            PHASE_TP_NS_EAGER,
            lambda: normalize_all(mats, vs, layouts, config),
            (list(mats), list(vs)),
        )

    @torch.no_grad()
    def _gather_moments(self, bucket: list[TPRow]) -> dict[int, Tensor]:
        """Each matrix's whole second moment on its TP owner (``{row index: v}``, none
        elsewhere): a sharded ``v`` gathered from the members (every member issues the gather,
        placeholders after a failure), a replicated one the owner's own."""
        size, me = self.info.size, self.info.rank
        works, parts_of = [], {}
        for i, row in enumerate(bucket):
            dp, v = row.param, row.moment
            if not self._moment_sharded(row) or size < 2:
                if me == dp.tp_owner:
                    parts_of[i] = [v]
                continue
            v = v.contiguous()
            parts = [torch.empty_like(v) for _ in range(size)] if me == dp.tp_owner else None
            works.append(
                dist.gather(v, parts, dst=self._global(dp.tp_owner), group=self.pg, async_op=True)
            )
            if parts is not None:
                parts_of[i] = parts
        for w in works:
            C.wait(w, "the TP gather of NorMuon's second moments", self.pg)
        return {
            i: torch.cat(parts, dim=bucket[i].param.shard_dim) if len(parts) > 1 else parts[0]
            for i, parts in parts_of.items()
        }

    @torch.no_grad()
    def _return_moments(
        self, bucket: list[TPRow], new: dict[int, Tensor]
    ) -> tuple[list, list[Tensor]]:
        """The owners' ``v′`` (``new``: row index → whole ``v′``, on the owner) to the members,
        async: a sharded one scattered (each member its rows), a replicated one broadcast. A
        row whose owner failed sends its placeholder (the old ``v``). Returns the works and this
        member's ``v′`` per row, in bucket order (valid once the works are waited for)."""
        size, me = self.info.size, self.info.rank
        works, received = [], []
        for i, row in enumerate(bucket):
            dp, v = row.param, row.moment
            if size < 2:  # the owner is the only member
                received.append(new.get(i, v))
                continue
            owner = self._global(dp.tp_owner)
            whole = new.get(i)
            if whole is None and me == dp.tp_owner:  # a failure before the gather: placeholders
                whole = v if not self._moment_sharded(row) else torch.cat([v] * size, dp.shard_dim)
            out = torch.empty_like(v)
            if self._moment_sharded(row):
                chunks = None
                if me == dp.tp_owner:
                    chunks = [c.contiguous() for c in whole.chunk(size, dim=dp.shard_dim)]
                works.append(dist.scatter(out, chunks, src=owner, group=self.pg, async_op=True))
            else:
                if me == dp.tp_owner:
                    out = whole.contiguous()
                works.append(dist.broadcast(out, src=owner, group=self.pg, async_op=True))
            received.append(out)
        return works, received

    def _moment_sharded(self, row: TPRow) -> bool:
        dp = row.param
        shape = tuple(int(s) for s in dp.global_shape)
        return _moments.moment_sharded(row.layout, shape, dp.shard_dim, self.info.size)

    def _local_layout(self, dp: TPDedicatedParam, layout: Layout) -> Layout | None:
        """This member's blocks' layout where it orthogonalises them itself (``None``: the
        matrix goes through its TP owner). With NorMuon, also only where the second moment is
        cut like the blocks (``moments.moment_sharded``): each member then holds its blocks'
        ``v``; else the owner normalises the whole matrix."""
        lay = local_blocks_layout(dp, layout, self.info.size, self.info.rank)
        if lay is not None and self.normuon is not None:
            shape = tuple(int(s) for s in dp.global_shape)
            if not _moments.moment_sharded(layout, shape, dp.shard_dim, self.info.size):
                return None
        return lay

    @torch.no_grad()
    def _local_directions(
        self, group: dict, bucket: list[TPRow], orthogonalize: Callable, failure: list
    ) -> tuple[list[LocalUpdate], list[Tensor]]:
        """One shape bucket of matrices whose shards hold whole blocks: each member's Nesterov
        inputs orthogonalised block by block where they are, each block scaled by its own
        learning-rate rule over the whole matrix's (what the TP owner would have scattered:
        the same blocks, the same scale). With NorMuon each block is normalised before that
        scale, with the member's piece of ``v`` (its blocks' rows or columns: each block is a
        matrix of its own, so its rows and its Frobenius norm are all here). Returns
        ``(updates, v′ of the bucket's rows)`` (no ``v′`` without NorMuon)."""
        updates = _nesterov_inputs(group, bucket, failure)
        layout = self._local_layout(bucket[0].param, bucket[0].layout)  # one per bucket
        with label(NS):
            out = orthogonalize(list(updates), layout)
        new: list[Tensor] = []
        if self.normuon is not None:  # per block, before the blocks' scale
            vs = [r.moment for r in bucket]
            out, new = self._normalize(out, vs, [layout] * len(out), failure)
        fn = group["adjust_lr_fn"]
        if not failure:
            out = [
                F.scale_blocks_as_whole(o.float(), layout, fn, r.param.global_shape)
                for o, r in zip(out, bucket)
            ]
        if self.record_profile:
            self.profile.local_matrices += len(bucket)
        lr, wd = float(group["lr"]), float(group["weight_decay"])  # 0-d tensors in Muon groups
        updates = [
            LocalUpdate(r.master, o.to(u.dtype), lr, wd, fn, r.param.global_shape)
            for r, o, u in zip(bucket, out, updates)
        ]
        return updates, new

    def _global(self, tp_rank: int) -> int:
        return dist.get_global_rank(self.pg, tp_rank)

    @torch.no_grad()
    def _gather(self, bucket: list[TPRow], updates: list[Tensor]) -> dict[int, Tensor]:
        """The Nesterov inputs ``updates`` of a bucket's rows gathered to their TP owners:
        ``{row index: whole matrix}`` for the matrices this rank orthogonalises (none
        elsewhere). Issued on every member whatever happened locally (a failed member sends
        placeholders): the TP group's collectives stay paired."""
        with label(TP_GATHER):
            gathered = self._gather_parts(bucket, updates)
        return {
            i: torch.cat(parts, dim=row.param.shard_dim)
            for i, (row, parts) in enumerate(zip(bucket, gathered))
            if parts is not None
        }

    def _gather_parts(self, bucket: list[TPRow], updates: list[Tensor]) -> list:
        """Each matrix's Nesterov input shards to its TP owner: the owner's pieces (``None``
        elsewhere), per matrix."""
        size, me = self.info.size, self.info.rank
        gathered, works = [], []
        for row, u in zip(bucket, updates):
            dp = row.param
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
    def _scatter(
        self,
        bucket: list[TPRow],
        updates: list[Tensor],
        ortho: dict[int, Tensor],
        lr: float,
        wd: float,
        adjust_lr_fn: str,
    ) -> list[ScatterShard]:
        """The TP owners' orthogonalised matrices (``ortho``: row index → whole matrix, on the
        owner) scattered back in shards, async. ``updates`` give the shards' shape and dtype
        (and stand in for the owner's matrix after a failure)."""
        size, me = self.info.size, self.info.rank
        shards = []
        with label(TP_SCATTER):
            for i, (row, u) in enumerate(zip(bucket, updates)):
                dp = row.param
                out = torch.empty_like(u)
                chunks = None
                if i in ortho:
                    chunks = [
                        c.contiguous() for c in ortho[i].to(u.dtype).chunk(size, dim=dp.shard_dim)
                    ]
                work = dist.scatter(
                    out, chunks, src=self._global(dp.tp_owner), group=self.pg, async_op=True
                )
                hook_group = self.group_of.get(id(dp.param), 0)
                shards.append(
                    ScatterShard(
                        hook_group, row.master, out, work, lr, wd, adjust_lr_fn, dp.global_shape
                    )
                )
                if self.record_profile:
                    self.profile.scatters += 1
                    self.profile.scatter_bytes += (
                        out.numel() * out.element_size() * int(me != dp.tp_owner)
                    )
        return shards

    @torch.no_grad()
    def commit(self, half: TPStepHalf, defer: bool) -> None:
        """Store the momentum and apply the scattered update shards now, or with ``defer`` (and
        no HSDP) queue them in the runtime's pending updates: applied before the group's next
        unshard or any read of the weight. Then the job's plain weights from TP rank 0 (after
        the optimizer committed them there) to the TP group."""
        if half.grads:
            F.store_momentum(half.grads, half.bufs, F.hyper(half.momentum))
        if half.moments:  # NorMuon's v′, with the momentum
            torch._foreach_copy_(half.moments, half.new_moments)
        for u in half.local:  # nothing in flight: applied now, like a scatter without defer
            F.apply_muon_update([u.master], [u.out], u.lr, u.wd, u.adjust_lr_fn, [u.global_shape])
        by_group: dict[int, list[ScatterShard]] = {}
        for shard in half.shards:
            by_group.setdefault(shard.hook_group, []).append(shard)
        for key, shards in by_group.items():
            if defer and self.deferrable:
                self.pending.add(key, ScatterUpdates(self, shards))
            else:
                self._apply(shards, forward=False)
        if half.plain_masters:
            more = {"moments": half.plain_moments} if half.plain_moments else {}
            self.broadcast_plain(half.plain_masters, half.plain_bufs, **more)

    def abort(self, half: TPStepHalf) -> None:
        """A step that failed on some rank: wait for the scatters (every member issued them)
        and drop their results."""
        for shard in half.shards:
            C.wait(shard.work, "the TP scatter of Newton–Schulz updates", self.pg)

    def orthogonalize(self, mats: list[Tensor], ns, layouts=None) -> list[Tensor]:
        """Newton–Schulz on whole matrices, eager (the reference's ``functional.orthogonalize``):
        what :meth:`directions` runs where ``compile`` is off (tests replace it). ``layouts``:
        each matrix's, when blocked (per head)."""
        return F.orthogonalize(mats, ns, layouts=layouts)

    def _apply(self, shards: list[ScatterShard], forward: bool) -> None:
        with label(TP_SCATTER):
            self._apply_shards(shards, forward)

    @torch.no_grad()
    def _apply_shards(self, shards: list[ScatterShard], forward: bool) -> None:
        """Wait for the scattered update shards and apply them to this member's masters."""
        if forward and self.record_profile:
            self.profile.waits += 1
            self.profile.not_ready += int(not all(C.is_done(s.work) for s in shards))
            t0 = time.perf_counter()
        for s in shards:
            C.wait(s.work, "the TP scatter of Newton–Schulz updates", self.pg)
            if s.out.is_cuda:  # applied on the unshard side stream: keep the block until then
                s.out.record_stream(torch.cuda.current_stream(s.out.device))
            # The reference's update on this rank's shard, scaled as the whole matrix.
            F.apply_muon_update([s.master], [s.out], s.lr, s.wd, s.adjust_lr_fn, [s.global_shape])
        if forward and self.record_profile:
            self.profile.wait_s += time.perf_counter() - t0

    # ------------------------------------------------------- plain weights of a TP model

    def updates_plain(self) -> bool:
        """Whether this rank updates the plain dedicated weights of its TP column: TP rank 0
        only; the other TP ranks of the column take the result from :meth:`broadcast_plain`."""
        return self.info.rank == PLAIN_SOURCE

    @torch.compiler.disable  # collectives stay eager (the user may compile opt.step)
    @torch.no_grad()
    def broadcast_plain(
        self, masters: list[Tensor], bufs: list[Tensor], moments: list[Tensor] = ()
    ) -> None:
        """The TP source's plain masters and momentum buffers (and NorMuon's second moments,
        ``moments``), in place on every TP rank.

        ``masters`` are this rank's owned plain weights of one Muon group part (their local
        tensors): every member of the TP group holds the same list (they share the DP
        coordinate that owns them), so the broadcasts pair up. In place, no packing buffer:
        the step's memory stays that of the update.
        """
        tensors = [t for pair in zip(masters, bufs) for t in pair] + list(moments)
        works = [C.broadcast(t, PLAIN_SOURCE, self.pg) for t in tensors]
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
            layout = self.layouts.get(id(p)) or get_layout(p.param)
            local = layout is not None and self._local_layout(p, layout) is not None
            if owns and me != p.tp_owner and not local:
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
                    "ns_here": owns and (local or me == p.tp_owner),
                    "local_blocks": local,  # each member orthogonalises its own whole blocks
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
    """A pending update (``_comm/pending.py``): one hook group's TP update shards in flight."""

    stage: TPStage
    shards: list[ScatterShard]

    @property
    def collectives(self) -> int:
        return len(self.shards)

    def apply(self, forward: bool) -> None:
        shards, self.shards = self.shards, []
        if shards:
            self.stage._apply(shards, forward)


def build_stage(info, pg, owners: TPOwners, params, groups, replicated: bool) -> TPStage:
    """The model's TP stage (its deferred scatters go to the runtime's queue, ``attach_tp``);
    ``owners``: the TP owners over the DP × TP slots (:func:`plan_tp_owners`)."""
    tp_params = [p for p in params if isinstance(p, TPDedicatedParam)]
    stage = TPStage(info, pg, tp_params, deferrable=not replicated)
    for g in groups:
        for p in g.params:
            stage.group_of[id(p.param)] = id(g)
    stage.owners = owners
    _register_owner_meshes(info, params)
    return stage


def _register_owner_meshes(info: TPInfo, params) -> None:
    """What ``_owner/meshes.py`` needs for the registered weights of a TP model.

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
            _owner_meshes.register_group(mesh, mesh.mesh.flatten().tolist())
            _owner_meshes.set_norm_mesh(mesh, norm_mesh)
        else:
            _owner_meshes.set_norm_mesh(mesh, norm_mesh, dp_dims)
            _owner_meshes.set_source(
                mesh, tp_row(info, _owner_meshes.owner_rank(p.param))[PLAIN_SOURCE]
            )
