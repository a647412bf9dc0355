"""A hook group: the dedicated parameters unsharded, resharded and reduced together.

Owner-packed layout: the group's parameters are ordered by owner, each owner's parameters
contiguous (its *chunk*). Either way a group costs one collective launch per unshard and one per
gradient reduce; two collective shapes move the chunks, chosen per group at set-up (and shown by
``summarize_comm_plan``):

- ``all_gather``: chunks padded to the largest one (S); unshard = one all-gather of world·S,
  gradients = one reduce-scatter of world·S. Best when chunks are even (padding ≤ 25%): NCCL's
  ring collectives, at most 25% more bytes.
- ``all_gather_v``: chunks unpadded (sizes differ, zero for ranks owning nothing here); unshard
  = one all-gather of uneven chunks, gradients = one reduce-scatter of uneven chunks (NCCL: one
  group of broadcasts / reduces, one launch). Each rank receives exactly the group's bytes, so it
  is the shape for groups whose matrices cannot be spread evenly: grouped-query attention's
  k/v (a quarter of q), or 7 matrices on 8+ ranks.

Every collective is async; its ``Work`` is kept and waited on only when the data is needed
(forward pre-hook of the group, end of backward).

With HSDP the group has a ``replicate`` stage (``_runtime/replicate.py``): the owner-chunk gradient
sums go on to the global owner over the replicate group. ``unshard`` first applies the group's
entries of the runtime's pending-update queue (``_comm/pending.py``: the replicate broadcast that
refreshed this rank's weights after the last step, the deferred TP update shards).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._comm.pending import CommContext
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat
from dmuon_compile.distributed._owner.param import DedicatedParam
from dmuon_compile.distributed._owner.tensor import local_of
from dmuon_compile.distributed._runtime.group_profile import GroupProfile
from dmuon_compile.distributed._runtime.replicate import ReplicateStage
from dmuon_compile.trace_labels import REDUCE, UNSHARD, label

# Padding above this fraction of the group's bytes makes the group gather uneven chunks.
MAX_GATHER_PADDING = 0.25


class GroupReduce(NamedTuple):
    """A gradient reduce in flight: its works, this rank's chunk of the sums (group offset
    ``base``), and the send buffer, kept alive until the works are waited for."""

    works: list
    out: Tensor
    base: int
    send: Tensor


class GroupState(Enum):
    """Where a hook group's weights are (FSDP2 keeps its own as an enum too, ``TrainingState``)."""

    SHARDED = auto()  # on the owners' masters only; the flat buffer freed
    UNSHARDING = auto()  # the unshard's collective issued, not waited for yet
    UNSHARDED = auto()  # the compute copies hold the whole weights


@dataclass(eq=False)
class DedicatedGroup:
    name: str
    module: nn.Module
    params: list[DedicatedParam]
    rank: int
    world: int
    pg: dist.ProcessGroup
    device: torch.device
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool = True
    mode: str = "all_gather"
    chunk_numel: list[int] = field(default_factory=list)
    chunk_base: list[int] = field(default_factory=list)
    flat: Tensor | None = None
    state: GroupState = GroupState.SHARDED
    works: list = field(default_factory=list)
    grads_ready: set = field(default_factory=set)
    pending_reduce: list[GroupReduce] = field(default_factory=list)
    profile: GroupProfile = field(default_factory=GroupProfile)
    record_profile: bool = False
    stall_events: list = field(default_factory=list)  # CUDA event pairs around forward waits
    replicate: ReplicateStage | None = None  # HSDP replicate stage (None in 1-D)
    reduced: bool = False  # a reduce was issued in the current backward
    ran_forward: bool = False  # its forward ran since the last synchronising backward
    # FSDP2's set_reshard_after_backward(False) on its managing module (``follow_fsdp``): a
    # backward without gradient sync keeps the weights unsharded for the next micro-batch
    keep_after_backward: bool = False
    comm: CommContext | None = None  # the runtime's (``_comm/pending.py``): its pending updates
    # FSDP2's gradient scaling (``follow_fsdp``): the reduced gradient is the sum over the
    # data-parallel ranks divided by ``divide_factor``; None: their mean (FSDP2's default).
    divide_factor: float | None = None
    policy_reduce_dtype: torch.dtype | None = None  # param_policy's; wins over FSDP2's

    # ------------------------------------------------------------------ layout
    def build(self) -> None:
        """Order params by owner, choose the collective shape, allocate and bind the buffer."""
        # Stable: plan order within an owner; HSDP: each replica owner's matrices contiguous.
        self.params.sort(key=lambda p: (p.owner, p.replica_owner))
        self.chunk_numel = [0] * self.world
        for p in self.params:
            p.offset = self.chunk_numel[p.owner]  # relative to the owner's chunk for now
            self.chunk_numel[p.owner] += p.numel
        total, widest = sum(self.chunk_numel), max(self.chunk_numel)
        padded = widest * self.world
        self.mode = "all_gather" if padded <= (1 + MAX_GATHER_PADDING) * total else "all_gather_v"
        if self.mode == "all_gather":
            self.chunk_base = [r * widest for r in range(self.world)]
            size = padded
        else:
            self.chunk_base, acc = [], 0
            for n in self.chunk_numel:
                self.chunk_base.append(acc)
                acc += n
            size = total
        for p in self.params:
            p.offset += self.chunk_base[p.owner]
        self.flat = torch.empty(size, dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.bind(self.flat)
        self._free()

    @property
    def padded_chunk(self) -> int:
        return max(self.chunk_numel) if self.chunk_numel else 0

    def _chunks(self, buffer: Tensor) -> list[Tensor]:
        """Every rank's chunk of an unpadded group-layout ``buffer`` (``all_gather_v``)."""
        return [buffer[b : b + n] for b, n in zip(self.chunk_base, self.chunk_numel)]

    def _storage_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def _free(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def _alloc(self) -> None:
        storage = self.flat.untyped_storage()
        if storage.size() != self._storage_bytes():
            storage.resize_(self._storage_bytes())

    # ------------------------------------------------------------------ unshard
    @torch.no_grad()
    def unshard(self, prefetch: bool = False) -> None:
        """Issue the collectives that fill the buffer from the owners (no wait)."""
        if self.state != GroupState.SHARDED:
            return
        # The buffer is allocated on the compute stream, which reads and frees it.
        self._alloc()
        side = None
        queued = self.comm is not None and self.comm.pending.has(id(self))
        if queued and self.device.type == "cuda":
            # The weights this rank sends must be current: the last step's pending updates
            # (HSDP publish, TP update shards) land first. Wait for and apply them on a side
            # stream, not the compute stream: a prefetch issued from the previous group's
            # pre-hook must not hold that group's forward back until *this* group's updates
            # land. The compute stream waits only for the unshard itself.
            side = self.comm.unshard_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (
            label(UNSHARD, self.name),
            torch.cuda.stream(side) if side is not None else contextlib.nullcontext(),
        ):
            if queued:
                self.comm.pending.wait_group(id(self))
            self._issue_unshard(prefetch)

    def _issue_unshard(self, prefetch: bool) -> None:
        flat = self.flat
        # Both shapes gather in place: this rank's masters are cast into its own chunk of
        # ``flat``, which is the collective's input (as FSDP2 gathers: no send buffer to fill
        # and copy). An ``all_gather`` chunk's padding is gathered unset: no weight views it.
        for p in self.params_of(self.rank):
            flat[p.offset : p.offset + p.numel].copy_(p.unshard_source().detach().reshape(-1))
        if self.world == 1:  # its chunk is the whole buffer: nothing to gather
            self.works = []
        elif self.mode == "all_gather":
            base = self.chunk_base[self.rank]
            send = flat[base : base + self.padded_chunk]
            self.works = [C.all_gather(flat, send, self.pg)]
        else:
            self.works = [C.all_gather_v(self._chunks(flat), self.pg)]
        self.state = GroupState.UNSHARDING
        if self.record_profile:
            self.profile.unshards += 1
            self.profile.prefetched += int(prefetch)
            self.profile.bytes_received += (
                sum(self.chunk_numel[o] for o in range(self.world) if o != self.rank)
                * flat.element_size()
            )

    def wait_unshard(self) -> None:
        """Make the buffer usable on the current stream (waits for the collectives)."""
        if self.state == GroupState.SHARDED:
            self.unshard()
        if self.state != GroupState.UNSHARDING:
            return
        cuda = self.device.type == "cuda"
        if self.record_profile:
            self.profile.waits += 1
            self.profile.found_ready += int(all(C.is_done(w) for w in self.works))
            t0 = time.perf_counter()
            if cuda:  # the stream stall: from "compute reached the wait" to "the data is there"
                before = torch.cuda.Event(enable_timing=True)
                before.record()
        with label(UNSHARD, self.name):
            for w in self.works:
                C.wait(w, f"the unshard ({self.mode}) of dedicated group {self.name!r}", self.pg)
        if self.record_profile:
            self.profile.wait_s += time.perf_counter() - t0  # host time (blocking only on gloo)
            if cuda:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self.stall_events.append((before, after))
        self.works = []
        self.state = GroupState.UNSHARDED
        for p in self.params:  # module.weight is the compute copy until the reshard
            p.use_compute_copy()

    def collect_stalls(self) -> None:
        """Fold finished CUDA stall events into the profile (after a device synchronize)."""
        for before, after in self.stall_events:
            self.profile.stream_stall_s += before.elapsed_time(after) / 1e3
        self.stall_events.clear()
        if self.replicate is not None:
            self.replicate.collect_stalls(self.profile)

    def reshard(self) -> None:
        """Free the buffer (after waiting for anything still writing into it)."""
        if self.state == GroupState.UNSHARDING:
            self.wait_unshard()
        if self.state == GroupState.UNSHARDED:
            for p in self.params:
                p.use_registered()
            self._free()
            self.state = GroupState.SHARDED

    def params_of(self, rank: int) -> list[DedicatedParam]:
        return [p for p in self.params if p.owner == rank]

    # ------------------------------------------------------------------ gradients
    def follow_fsdp(self, divide_factor: float | None, fsdp_reduce_dtype: torch.dtype | None):
        """Reduce like FSDP2 reduces the module that would manage these weights: its divide
        factor, and its ``MixedPrecisionPolicy.reduce_dtype`` unless ``param_policy`` set one
        (else the compute dtype, the gradients' dtype, as FSDP2's default)."""
        self.divide_factor = divide_factor
        self.reduce_dtype = self.policy_reduce_dtype or fsdp_reduce_dtype or self.compute_dtype

    def _divisions(self) -> tuple[float | None, float]:
        """(before, after) the sum over the data-parallel ranks (shard × replicate)."""
        ranks = self.world * (self.replicate.replicate_size if self.replicate is not None else 1)
        factor = ranks if self.divide_factor is None else self.divide_factor
        return _fsdp_compat.split_divide_factor(factor, self.reduce_dtype)

    def reduce_grads(self) -> None:
        """Pack the local gradients (owner-packed), issue the reduce to owners, free them."""
        with label(REDUCE, self.name):
            self._reduce_grads()

    @torch.no_grad()
    def _reduce_grads(self) -> None:
        send_size = self.flat.numel()
        # Every weight's slot is written once, its gradient or zeros (not a zero-filled buffer
        # first: one pass less). The chunks' padding is sent unset: its sums land in the
        # reduce output's padding, which no gradient is a view of.
        grads = torch.empty(send_size, dtype=self.reduce_dtype, device=self.device)
        for p in self.params:
            g = p.unsharded.grad
            slot = grads[p.offset : p.offset + p.numel]
            if g is not None:
                slot.copy_(local_of(_as_placed(g, p.unsharded)).reshape(-1))
            else:
                slot.zero_()
            p.unsharded.grad = None
        before, _ = self._divisions()
        if before is not None:
            grads.div_(before)
        # This rank's chunk of the sums, at group offset ``chunk_base[rank]``.
        if self.world == 1:  # the sum over one rank is its gradient: no collective, no copy
            out, works = grads, []
        elif self.mode == "all_gather":
            out = torch.empty(self.padded_chunk, dtype=self.reduce_dtype, device=self.device)
            works = [C.reduce_scatter_sum(out, grads, self.pg)]
        else:
            out = torch.empty(
                self.chunk_numel[self.rank], dtype=self.reduce_dtype, device=self.device
            )
            works = [C.reduce_scatter_v_sum(out, self._chunks(grads), self.pg)]
        self.pending_reduce.append(GroupReduce(works, out, self.chunk_base[self.rank], grads))
        self.grads_ready.clear()
        self.reduced = True
        if self.record_profile:
            self.profile.reduces += 1
            self.profile.bytes_reduced += send_size * grads.element_size()

    def finish_reduce(self) -> None:
        """Wait for the reduces; each owned ``param.grad`` gets the reduced gradient (accumulated):
        the sum over the ranks divided as FSDP2 would (:meth:`follow_fsdp`).

        HSDP: the owner column's sums go on to the global owner (``ReplicateStage.reduce``,
        async; :meth:`drain` waits for it), which divides.
        """
        if self.pending_reduce:
            with label(REDUCE, self.name):
                self._finish_reduce()

    @torch.no_grad()
    def _finish_reduce(self) -> None:
        _, after = self._divisions()
        for r in self.pending_reduce:
            for w in r.works:
                C.wait(w, f"the gradient reduce of dedicated group {self.name!r}", self.pg)
            if self.replicate is not None:
                start = self.chunk_base[self.rank] - r.base
                column = r.out[start : start + self.chunk_numel[self.rank]]
                self.replicate.reduce(column, after, self.profile if self.record_profile else None)
                continue
            for p in self.params_of(self.rank):
                start = p.offset - r.base
                p.accumulate_reduced(r.out[start : start + p.numel].view(p.shape), after)
        self.pending_reduce.clear()

    @torch.no_grad()
    def discard_reduces(self) -> None:
        """Wait for the reduces in flight to finish for real, then drop their results (see
        ``discard_backward``): on CUDA ``Work.wait()`` only orders the stream, and returning
        before the collective completed would let the next step's collectives pair with it."""
        for r in self.pending_reduce:
            for w in r.works:
                C.wait_finished(w, f"the gradient reduce of dedicated group {self.name!r}", self.pg)
        self.pending_reduce.clear()
        if self.replicate is not None:
            self.replicate.discard_reduces()

    def drain(self) -> None:
        """Wait for every collective in flight (unshard, reduce, HSDP replicate stage)."""
        if self.state == GroupState.UNSHARDING:
            self.wait_unshard()
        self.finish_reduce()
        if self.replicate is not None:
            self.replicate.drain()


def _as_placed(grad: Tensor, param: Tensor) -> Tensor:
    """A TP gradient in its weight's placements, as FSDP2 redistributes its gradients: a
    module may leave it in others (torchtitan's row-wise linears without sequence parallel:
    ``Partial``, reduced here over the TP group; every TP rank has it at the same point)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        if grad.placements != param.placements:
            return grad.redistribute(placements=param.placements)
    return grad
