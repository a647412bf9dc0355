"""HSDP replicate stage of one hook group: gradients to the global owner, new weights back.

With ``replicate_mesh`` of size R > 1 every matrix has a *global owner* among all R × S ranks
(replica ``r``, shard ``s``). Its *owner column* is the S-rank coordinate ``s`` in every replica:
those R ranks hold the whole weight (the global owner as its master — the local tensor of the
registered parameter — the
others as a plain ``replica``), because their shard groups unshard it from them. Per step:

1. backward: the shard group reduces the gradient to the column (``DedicatedGroup``), then this
   stage reduces the column's sums over the replicate group to the global owner, which divides
   by S·R — the gradient of the global batch, as one process would compute it;
2. ``Muon.step`` runs Newton–Schulz on the global owner only (one NS per matrix in the job);
3. publish: the global owner broadcasts the new weight over the replicate group to its column
   peers. Async (default) it is issued at the end of ``step()`` as a :class:`Publish` entry of
   the runtime's pending-update queue (``_comm/pending.py``) and waited for in the next forward,
   right before the group's unshard reads the weight (``DedicatedGroup.unshard``; on CUDA on a side
   stream, so only that unshard, not the compute stream, waits for it), or before anything reads
   or writes a dedicated weight in between.

Layout: a group's *column chunk* (its matrices whose owner column is this rank's shard
coordinate) lives in one flat buffer ``flat`` in the group's *compute* dtype (what the shard
group's unshard sends anyway), ordered by the global owner's replica, so each replica owner's
matrices are one contiguous *segment*: one reduce and one broadcast per segment. When the
master dtype is the compute dtype, the global owner's master is a view into ``flat``
(the optimizer's in-place update writes straight into the broadcast's source); otherwise
(``param_policy`` with e.g. bf16 compute and fp32 masters) the owner rounds its masters into
``flat`` right before the broadcast — half the bytes, and the same bf16 values its own unshard
would produce from the fp32 master, so every replica computes with identical weights. With
the masters in host memory (``offload="state"``) that view *is* the owner's compute copy: the
cast the unshard sends and the broadcast's source are one buffer.

Every member of a replicate group holds the same column chunk (the plan is identical on every
rank), so all issue the same collectives in the same order: SPMD, no per-rank branches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._owner.param import DedicatedParam
from dmuon_compile.trace_labels import PUBLISH, REDUCE, label

if TYPE_CHECKING:
    from dmuon_compile.distributed._runtime.group_profile import GroupProfile


class ReplicateReduce(NamedTuple):
    """A replicate reduce in flight: its works, the column's gradient sums they reduce, and
    what the global owner divides the sum by."""

    works: list
    column_grads: Tensor
    divide_by: float


@dataclass(frozen=True)
class Segment:
    """One replica owner's matrices inside the column chunk: one reduce, one broadcast."""

    root: int  # rank in the replicate group (the global owner's replica)
    start: int
    numel: int


@dataclass
class ReplicateStage:
    params: list[DedicatedParam]  # the column chunk, in the group's (owner-packed) order
    replicate_rank: int
    replicate_size: int
    shard_size: int
    pg: dist.ProcessGroup
    device: torch.device
    dtype: torch.dtype
    flat: Tensor | None = None
    segments: list[Segment] = field(default_factory=list)
    copy_in: list = field(default_factory=list)  # (param, view): owners whose dtype differs
    pending_reduce: list[ReplicateReduce] = field(default_factory=list)
    stall_events: list = field(default_factory=list)
    name: str = ""  # the hook group's (its profiler ranges name it)

    # ------------------------------------------------------------------ layout
    def build(self, values: dict[str, Tensor | None]) -> dict[str, Tensor]:
        """Allocate the column buffer, fill it with ``values``, bind the replicas to it; return
        the global owner's masters (views into the buffer when the dtypes agree). A ``None``
        value (a weight built on the meta device) leaves its part uninitialised, and its master
        is allocated the same way: the first forward publishes what initialisation put there."""
        numel = sum(p.numel for p in self.params)
        self.flat = torch.empty(numel, dtype=self.dtype, device=self.device)
        masters: dict[str, Tensor] = {}
        offset = 0
        for p in self.params:
            view = self.flat[offset : offset + p.numel].view(p.shape)
            value = values[p.fqn]
            if value is not None:
                value = value.detach().reshape(p.shape)
                with torch.no_grad():
                    view.copy_(value)
            owns = p.replica_owner == self.replicate_rank
            if owns and p.orig_dtype == self.dtype:
                masters[p.fqn] = view  # the optimizer updates the broadcast source in place
            elif owns:
                if value is None:
                    value = torch.empty(p.shape, dtype=p.orig_dtype, device=self.device)
                masters[p.fqn] = value
                self.copy_in.append((p, view))
            else:
                p.replica = view
            if not self.segments or self.segments[-1].root != p.replica_owner:
                self.segments.append(Segment(p.replica_owner, offset, 0))
            last = self.segments[-1]
            self.segments[-1] = Segment(last.root, last.start, last.numel + p.numel)
            offset += p.numel
        return masters

    @property
    def numel(self) -> int:
        return self.flat.numel() if self.flat is not None else 0

    @property
    def element_size(self) -> int:
        return self.flat.element_size() if self.flat is not None else 0

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def reduce(self, column_grads: Tensor, divide_by: float, profile=None) -> None:
        """Issue the reduce of the column's gradient sums to each global owner (async); the
        global owner divides the sum by ``divide_by``."""
        with label(REDUCE, self.name or None):
            works = [
                C.reduce_sum(column_grads[s.start : s.start + s.numel], s.root, self.pg)
                for s in self.segments
            ]
        self.pending_reduce.append(ReplicateReduce(works, column_grads, divide_by))
        if profile is not None:
            profile.replicate_reduces += len(works)
            profile.replicate_bytes_reduced += column_grads.numel() * column_grads.element_size()

    def finish_reduce(self) -> None:
        """Wait for the reduces; the global owner's ``param.grad`` gets the sum / ``divide_by``."""
        if self.pending_reduce:
            with label(REDUCE, self.name or None):
                self._finish_reduce()

    @torch.no_grad()
    def _finish_reduce(self) -> None:
        for r in self.pending_reduce:
            for w in r.works:
                C.wait(w, "the HSDP gradient reduce to the global owners", self.pg)
            offset = 0
            for p in self.params:
                if p.owns:
                    summed = r.column_grads[offset : offset + p.numel].view(p.shape)
                    p.accumulate_reduced(summed, r.divide_by)
                offset += p.numel
        self.pending_reduce.clear()

    def discard_reduces(self) -> None:
        """Wait for the reduces in flight to finish for real (``C.wait_finished``), then drop
        their results."""
        for r in self.pending_reduce:
            for w in r.works:
                C.wait_finished(w, "the HSDP gradient reduce to the global owners", self.pg)
        self.pending_reduce.clear()

    # ------------------------------------------------------------------ publish
    @torch.no_grad()
    def publish(self, profile=None) -> Publish:
        """Broadcast each global owner's weights to its column peers (async): the pending
        update the runtime queues (``_comm/pending.py``), applied by :meth:`finish_publish`. The
        caller has applied this group's earlier entries (a previous publish still in flight)."""
        with label(PUBLISH, self.name or None):
            for p, view in self.copy_in:
                source = p.unshard_source()  # the master, or its compute copy (offload)
                if source is view:  # offload="state": the compute copy is this buffer
                    continue
                view.copy_(source)
                if p.compute_copy is view:  # the step's master, cast: the commit need not
                    p.compute_cast = True
            works = [
                C.broadcast(self.flat[s.start : s.start + s.numel], s.root, self.pg)
                for s in self.segments
            ]
        if profile is not None and self.segments:
            profile.publishes += 1
            profile.publish_broadcasts += len(self.segments)
            profile.publish_bytes += self.numel * self.element_size
        return Publish(self, works, profile)

    def finish_publish(self, works: list, profile=None) -> None:
        """Make the column buffer current (CUDA: a stream dependency; gloo: blocks).
        ``profile``: a forward's wait, counted there."""
        if not works:
            return
        cuda = self.device.type == "cuda"
        if profile is not None:
            profile.publish_waits += 1
            profile.publish_not_ready += int(not all(C.is_done(w) for w in works))
            t0 = time.perf_counter()
            if cuda:
                before = torch.cuda.Event(enable_timing=True)
                before.record()
        with label(PUBLISH, self.name or None):
            for w in works:
                C.wait(w, "the HSDP replicate broadcast of the new weights", self.pg)
        if profile is not None:
            profile.publish_wait_s += time.perf_counter() - t0
            if cuda:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self.stall_events.append((before, after))

    def collect_stalls(self, profile) -> None:
        for before, after in self.stall_events:
            profile.publish_stall_s += before.elapsed_time(after) / 1e3
        self.stall_events.clear()

    def drain(self) -> None:
        self.finish_reduce()

    def pending(self) -> int:
        """Gradient reduces of this stage still in flight (0 after ``drain``; the publishes are
        in the runtime's queue)."""
        return sum(len(r.works) for r in self.pending_reduce)


@dataclass(eq=False)
class Publish:
    """A pending update (``_comm/pending.py``): a group's replicate broadcasts in flight."""

    stage: ReplicateStage
    works: list
    profile: GroupProfile | None = None  # the group's profile when recorded

    @property
    def collectives(self) -> int:
        return len(self.works)

    def apply(self, forward: bool) -> None:
        works, self.works = self.works, []
        self.stage.finish_publish(works, self.profile if forward else None)
