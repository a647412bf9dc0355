"""``Muon(offload="state")``: the owners' masters in host memory between steps.

Between steps each dedicated weight this rank owns keeps

- its **master** (the original dtype, fp32 in mixed precision) in pinned host memory, as the
  registered parameter's local tensor: ``state_dict()``, DCP, ``full_tensor()`` and the user
  read and write it there. The parameter stays the same object and its wrapper keeps its device,
  so gradients (on the GPU) are set on it as before;
- its **compute copy** on the GPU: the master cast to the forward's dtype, which is what the
  unshard would cast it to, so the forward sees the same bits. The unshard sends it
  (``DedicatedParam.unshard_source``); a write to the host master between steps (``nn.init``,
  ``mul_``: its version counter moves; a ``load_state_dict``, which DCP's and torchtitan's loads
  end with: a hook) makes the next unshard cast it again first.

So the GPU holds the compute dtype's bytes of the weight (bf16: 2 per value) instead of the
master's (fp32: 4) through forward and backward, and with the momentum offloaded as well none of
the owners' optimizer state.

A step brings the masters to the GPU for its commit, the only reader, and after it each new
master is cast into its compute copy and copied out to its host master in place; a step that
does not commit writes nothing back, so it changes nothing. Where the momentum streams by shape
bucket (``momentum_storage.BucketStream``, the default), the step's first half runs on
*stand-ins* (:meth:`HostMasters.swap_in`: each master's shape, dtype and device, no memory),
and after the verdict :meth:`HostMasters.commit_by_bucket` walks the same buckets, as many at a
time: each bucket's masters copied in on a side stream (the next ones ahead), committed, cast
and copied out on a second side stream beside the next bucket's copy in, then released; the GPU
never holds every master. Else (all at once: ``momentum_in_flight=None``, the user's
``torch.compile(opt.step)``) every master is copied in when the step starts, on a side stream
under its Newton–Schulz (the step's stream waits for it just before the commit:
:meth:`HostMasters.ready`), and copied out after the commit (:meth:`HostMasters.swap_out`),
under the next forward. Host reads of a master wait for the copies out (an entry of the
runtime's pending updates, which every read or write through a registered parameter applies
first).

The copy out waits for the verdict and writes the host master in place, never a new buffer:
the storage stays the one ``state_dict()`` views and DCP's and torchtitan's caches hold. So the
streamed step's masters cross the host link after its Newton–Schulz, not under it.

HSDP: the global owners' masters go to host memory; the replicate publish rounds the master
into the broadcast buffer as before (inside the step, from the master on the GPU; after it,
from the compute copy, the same bits), and the other column members keep their replicas.
The global owner's compute copy is its column buffer (both are the master's cast to the
compute dtype): one buffer, not two.

Tensor parallelism: each member's shards of its TP matrices are its masters; the step's
stages take those matrices, so their masters are copied in all at once, and the updates the TP
owners scatter are applied at the commit, not queued for the next forward (the copies out
follow the commit). Split Newton–Schulz: the owner commits the matrix like any other.

The offloaded step needs its verdict before the commit, which a stored momentum gives (the
optimizer offloads the momentum too); ``qk_clip`` (it scales the masters after the step) and
dedicated weights computing in their masters' dtype are refused (:func:`check_supported`).
"""

from __future__ import annotations

import contextlib

import torch

from dmuon_compile.distributed._compat import dtensor as _dt
from dmuon_compile.distributed._owner.param import DedicatedParam

_ALIGN = 256  # bytes: where each master's view in a slot starts


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _CopiedOut:
    """A pending update (``_comm/pending.py``): the last step's masters copied out to host
    memory on side streams (``events``: after them); host reads wait for it."""

    collectives = 0

    def __init__(self, events: list) -> None:
        self.events = events

    def apply(self, forward: bool) -> None:  # noqa: ARG002 - PendingUpdates' signature
        for event in self.events:
            event.synchronize()


def state_offload_obstacles(*, qk_clip: bool, same_dtype: list[str]) -> list[str]:
    """Why ``offload="state"`` cannot hold the masters in host memory (module docstring), as
    ``Muon`` (:func:`check_supported`) and the dry run (``plan/run.py``) both judge it:
    ``qk_clip`` (it scales them after the step), ``same_dtype`` (the dedicated weights computing
    in their master's dtype: a compute copy would take as much GPU memory as the master).
    Empty: it can."""
    reasons = []
    if qk_clip:
        reasons.append("qk_clip: it scales the masters after the step")
    if same_dtype:
        reasons.append(
            f"{len(same_dtype)} dedicated weight(s) ({same_dtype[0]}, ...) compute in their "
            "master's dtype, so a compute copy would take as much GPU memory as the master"
        )
    return reasons


def check_supported(runtime, qk_clip) -> None:
    """Raise ``ValueError`` naming the fix where ``offload="state"`` cannot hold the masters in
    host memory (:func:`state_offload_obstacles`); the same verdict on every rank (from the plan
    alone)."""
    fix = "use offload='momentum' (the momentum in host memory, the masters on the GPU)"
    if runtime is None:
        raise ValueError(
            "Muon(offload='state') keeps the masters of dedicated weights in host memory: build "
            "it as Muon(model) on a model given to dmuon.dedicate_params, or " + fix
        )
    same = [dp.fqn for dp in runtime.params if dp.compute_dtype.itemsize >= dp.orig_dtype.itemsize]
    reasons = state_offload_obstacles(qk_clip=qk_clip is not None, same_dtype=same)
    if same:
        reasons[-1] += (
            ": give dedicate_params(..., param_policy=dmuon.ParamPolicy("
            "defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16)))"
        )
    if reasons:
        raise ValueError(
            "Muon(offload='state') is not available here: " + "; ".join(reasons) + ". Else " + fix
        )


class HostMasters:
    """The masters of one runtime's dedicated weights owned by this rank, in host memory
    between steps (module docstring)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.params: list[DedicatedParam] = [dp for dp in runtime.params if dp.owns]
        self.offloaded = False
        self._swapped_in = False
        self._streams: dict[torch.device, list] = {}  # per device: the copies in, out
        self._pending_in = None  # CUDA: the event after this step's copies in at its start
        self._stand_ins: dict[int, DedicatedParam] = {}  # stand-in id -> its master's owner
        self._copied_out: list = []  # CUDA: the events after this step's copies out
        self._last_out: list = []  # ... and the last step's, which the copies in wait for
        self._slots: list = []  # during a streamed step: the GPU memory of reserve()
        self._slot_freed: list = []  # ... and per slot the event after its last copy out
        self._load_hook = None  # offloaded: the model's load_state_dict post-hook

    @torch.no_grad()
    def offload(self) -> None:
        """Move every owned master to pinned host memory (waits for it) and make its compute
        copy; the GPU copy of the master is freed."""
        if self.offloaded:
            return
        self.runtime.wait_all()  # nothing in flight reads or writes a master
        columns = {  # HSDP: the global owners' column buffers (the publish's source)
            id(p): view
            for g in self.runtime.groups
            if g.replicate is not None
            for p, view in g.replicate.copy_in
        }
        for dp in self.params:
            master = dp.master
            pin = master.device.type == "cuda"
            host = torch.empty(master.shape, dtype=master.dtype, device="cpu", pin_memory=pin)
            host.copy_(master)
            column = columns.get(id(dp))
            if column is not None and column.dtype == dp.compute_dtype:
                column.copy_(master)  # one buffer: the unshard's cast, the publish's source
                dp.compute_copy = column
            else:
                dp.compute_copy = master.to(dp.compute_dtype, copy=True)
            dp.host_master = host
            dp.host_version = host._version
            _dt.set_local_tensor(dp.param, host)
        if self.params and self.params[0].compute_copy.device.type == "cuda":
            self.runtime.comm.watch()  # host reads wait for a step's copies out (_CopiedOut)
        # A load may write the host masters without their version counters (DCP loads in
        # place through its own views): after any load_state_dict every compute copy is cast
        # again at its next unshard.
        self._load_hook = self.runtime.model.register_load_state_dict_post_hook(self._loaded)
        self.runtime.host_masters = self  # one per model: another optimizer finds it
        self.offloaded = True

    def _loaded(self, _module, _incompatible) -> None:
        for dp in self.params:
            dp.host_version = -1

    @torch.no_grad()
    def restore(self) -> None:
        """The masters back on the GPU (the parameter's local tensor again), as before
        :meth:`offload`."""
        if not self.offloaded:
            return
        self.runtime.pending.drain()
        self._load_hook.remove()
        self.runtime.host_masters = None
        for dp in self.params:
            master = dp.host_master.to(dp.compute_copy.device, copy=True)
            _dt.set_local_tensor(dp.param, master)
            dp.host_master = dp.compute_copy = None
            dp.host_version = -1
        self.offloaded = False

    def _side(self, device: torch.device, which: int):
        """``device``'s side stream for the copies in (0) or out (1); ``None`` off CUDA."""
        if device.type != "cuda":
            return None
        streams = self._streams.setdefault(device, [])
        while len(streams) <= which:
            streams.append(torch.cuda.Stream(device))
        return streams[which]

    @torch.compiler.disable  # host copies: eager, also under the user's torch.compile(opt.step)
    @torch.no_grad()
    def swap_in(self, by_bucket: frozenset = frozenset()) -> None:
        """A step starts. The parameters in ``by_bucket`` (ids: the Muon matrices of a step
        whose momentum streams by shape bucket) get a *stand-in* as their local tensor until
        their commit: the master's shape, dtype and device, no memory (the step's first half
        reads no master), so :meth:`commit_by_bucket` can bring their masters to the GPU a few
        buckets at a time. Every other master is copied to a GPU buffer now, which stays the
        parameter's local tensor until :meth:`swap_out` (on CUDA on a side stream, after the
        last step's copies out; :meth:`ready` makes the step's stream wait for it)."""
        if not self.offloaded or self._swapped_in:
            return
        self._swapped_in = True
        self._last_out, self._copied_out = self._copied_out, []
        self._pending_in, self._stand_ins = None, {}
        if not self.params:
            return
        device = self.params[0].compute_copy.device
        side = self._side(device, 0)
        if side is not None:  # the buffers are the step stream's: the side writes after it
            side.wait_stream(torch.cuda.current_stream(device))
            for event in self._last_out:
                side.wait_event(event)
        for dp in self.params:
            host = dp.host_master
            if id(dp.param) in by_bucket:
                local = torch.empty(1, dtype=host.dtype, device=device).expand(host.shape)
                self._stand_ins[id(local)] = dp
            else:
                local = torch.empty_like(host, device=device)
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    local.copy_(host, non_blocking=True)
            _dt.set_local_tensor(dp.param, local)
        if side is not None:
            self._pending_in = torch.cuda.Event()
            self._pending_in.record(side)

    @torch.compiler.disable  # a stream wait: eager under the user's torch.compile(opt.step)
    def ready(self) -> None:
        """Before the commit writes the masters: the step's stream waits for the copies in."""
        if self._pending_in is not None:
            torch.cuda.current_stream(self.params[0].compute_copy.device).wait_event(
                self._pending_in
            )
            self._pending_in = None

    def holds_stand_ins(self, tensors: list) -> bool:
        """Whether any of ``tensors`` (a job's local tensors) is a stand-in of :meth:`swap_in`:
        its commit must go through :meth:`commit_by_bucket`."""
        return any(id(t) in self._stand_ins for t in tensors)

    def _bucket_bytes(self, tensors: list, idx: list[int]) -> int:
        """The bytes a bucket's masters take in a slot (each start aligned to ``_ALIGN``)."""
        total = 0
        for i in idx:
            dp = self._stand_ins.get(id(tensors[i]))
            if dp is not None:
                total += _aligned(dp.host_master.numel() * dp.host_master.element_size())
        return total

    @torch.compiler.disable
    @torch.no_grad()
    def reserve(self, jobs: list[tuple[list, list[list[int]]]], in_flight) -> None:
        """Before the step's verdict: the GPU memory :meth:`commit_by_bucket` brings the masters
        into, ``in_flight`` slots each as large as the largest bucket's masters (``jobs``: each
        streamed job's local tensors and shape buckets). The commit then allocates nothing: a
        step that runs out of memory does so here, before anything is written, and the
        agreement makes every rank raise (``PHASE_MASTERS``)."""
        need, device = 0, None
        for tensors, buckets in jobs:
            for idx in buckets:
                size = self._bucket_bytes(tensors, idx)
                if size:
                    need, device = max(need, size), tensors[idx[0]].device
        if not need:
            return
        limit = max(1, in_flight or 1)  # stand-ins exist only where the momentum streams
        self._slots = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(limit)]
        self._slot_freed = [None] * limit

    @torch.compiler.disable
    @torch.no_grad()
    def commit_by_bucket(self, tensors: list, buckets: list[list[int]], commit) -> None:
        """The commit of a job whose masters are stand-ins (``tensors``: its local tensors),
        after the step's verdict, bucket by bucket (``buckets``: indices into ``tensors``, the
        shape buckets its momentum streamed in): each bucket's masters copied into a slot of
        :meth:`reserve` (on CUDA on a side stream, the next slots' buckets ahead: as many in
        flight as there are slots),
        ``commit(k, locals)`` writes the new ones in them (``locals``: ``tensors`` at bucket
        ``k``'s indices, the masters in place of the stand-ins), then each is cast into its
        compute copy and copied out to its host master in place (CUDA: on the second side
        stream), which frees the slot. So the GPU holds the masters of ``in_flight`` buckets at
        most, never all of them, and allocates nothing after the verdict."""
        slots = self._slots
        limit = len(slots)
        if not limit:  # reserve() runs before every verdict that lets a commit through
            raise RuntimeError("Muon(offload='state'): the commit found no memory reserved")
        device = tensors[buckets[0][0]].device if buckets and buckets[0] else None
        side = None if device is None else self._side(device, 0)
        out = None if device is None else self._side(device, 1)
        if side is not None:  # the slots were made on the step's stream
            side.wait_stream(torch.cuda.current_stream(device))
        issued: dict[int, tuple[list, object]] = {}
        freed = self._slot_freed  # per slot: the event after its last bucket's copy out
        next_in = 0
        for k, idx in enumerate(buckets):
            while next_in < min(k + limit, len(buckets)):
                j = next_in % limit
                if freed[j] is not None:  # the host waits: the slot's last bucket copied out
                    freed[j].synchronize()
                    freed[j] = None
                issued[next_in] = self._bring_in(tensors, buckets[next_in], side, slots[j])
                next_in += 1
            pairs, event = issued.pop(k)
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
            commit(k, [work if work is not None else tensors[i] for i, work in zip(idx, pairs)])
            done = [
                (self._stand_ins.pop(id(tensors[i])), w)
                for i, w in zip(idx, pairs)
                if w is not None
            ]
            for dp, work in done:
                self._cast(dp, work)
            if out is not None:  # after the commit and the casts: the slot is free after this
                out.wait_stream(torch.cuda.current_stream(device))
            for dp, work in done:
                self._copy_out(dp, work, out)
            if out is not None:
                freed[k % limit] = torch.cuda.Event()
                freed[k % limit].record(out)
        if out is not None and buckets:
            self._copied_out.append(freed[(len(buckets) - 1) % limit])

    @staticmethod
    def _cast(dp: DedicatedParam, work: torch.Tensor) -> None:
        """A committed master ``work`` (on the GPU) cast into ``dp``'s compute copy, on the
        step's stream: what the next unshard sends. Not again where an HSDP publish inside the
        step cast it into its broadcast buffer, which is this compute copy (its broadcast may
        still be reading it)."""
        if dp.compute_cast:
            dp.compute_cast = False
            return
        dp.compute_copy.copy_(work)

    @staticmethod
    def _copy_out(dp: DedicatedParam, work: torch.Tensor, out) -> None:
        """A committed master ``work`` (on the GPU) copied out to ``dp``'s host master in place
        (on ``out`` when a CUDA stream, ordered after the commit by the caller), which is the
        parameter's local tensor again."""
        with torch.cuda.stream(out) if out is not None else contextlib.nullcontext():
            dp.host_master.copy_(work, non_blocking=True)
        if out is not None:
            work.record_stream(out)  # freed once the copy out has read it
        _dt.set_local_tensor(dp.param, dp.host_master)
        dp.host_version = dp.host_master._version

    def _bring_in(self, tensors: list, idx: list[int], side, slot) -> tuple[list, object]:
        """A bucket's masters copied into views of ``slot`` (``None`` where ``tensors[i]`` is no
        stand-in), on ``side`` when a CUDA stream; ``(views, the event after them)``."""
        works, offset = [], 0
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i in idx:
                dp = self._stand_ins.get(id(tensors[i]))
                if dp is None:
                    works.append(None)
                    continue
                host = dp.host_master
                nbytes = host.numel() * host.element_size()
                work = slot[offset : offset + nbytes].view(host.dtype).view(host.shape)
                offset += _aligned(nbytes)
                work.copy_(host, non_blocking=True)
                works.append(work)
        if side is None:
            return works, None
        event = torch.cuda.Event()
        event.record(side)
        return works, event

    @torch.compiler.disable
    @torch.no_grad()
    def swap_out(self, committed: bool) -> None:
        """After the step: where it ``committed``, each new master still on the GPU cast into its
        compute copy and copied out to its host master (CUDA: on a side stream, after the
        commit); either way the host master is the parameter's local tensor again and the GPU
        copy is released. Host reads wait for this step's copies out."""
        if not self._swapped_in:
            return
        self._swapped_in = False
        self.ready()  # a step that raised before its commit: nothing reads its copies after this
        missed = [dp.fqn for dp in self._stand_ins.values()] if committed else []
        out = None
        if committed and self.params:
            device = self.params[0].compute_copy.device
            out = self._side(device, 1)
            if out is not None:
                out.wait_stream(torch.cuda.current_stream(device))
        copied = False
        for dp in self.params:
            work = _dt.local_tensor(dp.param)
            if work is dp.host_master:  # committed by bucket (commit_by_bucket): copied out
                continue
            if committed and id(work) not in self._stand_ins:
                self._cast(dp, work)
                self._copy_out(dp, work, out)
                copied = True
                continue
            _dt.set_local_tensor(dp.param, dp.host_master)
            dp.host_version = dp.host_master._version
        for dp in self.params:  # a step that did not commit: its publish cast nothing kept
            dp.compute_cast = False
        self._stand_ins = {}
        slots, self._slots = self._slots, []
        for slot in slots:  # released once the side streams' copies are done with them
            for stream in self._streams.get(slot.device, []):
                slot.record_stream(stream)
        if out is not None and copied:
            event = torch.cuda.Event()
            event.record(out)
            self._copied_out.append(event)
        if self._copied_out:
            self.runtime.pending.add(id(self), _CopiedOut(self._copied_out))
        if missed:  # an invariant of Muon's commit, checked: never a silently lost update
            raise RuntimeError(
                "Muon(offload='state'): the step committed without writing the masters of "
                + ", ".join(missed)
            )
