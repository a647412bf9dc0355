"""The TP stage of a step: gather the Nesterov inputs to each matrix's TP owner, Newton–Schulz
there, scatter the update's shards back (applied now or queued as a pending update), and the
one-master broadcast of a TP model's plain dedicated weights (see the package doc)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile import functional as F
from dmuon_compile.distributed import _collectives as C
from dmuon_compile.distributed import _owner_meshes
from dmuon_compile.distributed._owned import local_of
from dmuon_compile.distributed._tp.detect import TPInfo, tp_row
from dmuon_compile.distributed._tp.param import TPDedicatedParam
from dmuon_compile.distributed._tp.plan import TPPlan
from dmuon_compile.trace_labels import TP_GATHER, TP_SCATTER, label


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
    """The TP stage of one model: gather → NS on the TP owner → scatter (see the package doc)."""

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
            self.profile.not_ready += int(not all(C.is_done(e[2]) for e in entries))
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


def _register_owner_meshes(info: TPInfo, params) -> None:
    """What ``_owner_meshes`` needs for the registered weights of a TP model.

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
