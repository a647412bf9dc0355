"""Where and in what form Muon keeps each matrix's momentum between steps.

``Muon(momentum_dtype=..., offload=...)`` picks it (``offload="state"`` stores the momentum as
``"momentum"`` does, and moves the owners' masters too: ``distributed/_owner/host_masters.py``).
Two kinds of storage:

- **In place** (``momentum_dtype`` ``None``, ``torch.float32`` or ``torch.bfloat16``, no
  offload): ``state["momentum_buffer"]`` is the tensor the step reads and writes, as in every
  torch optimizer. Nothing here runs during a step.
- **Stored** (``momentum_dtype=torch.int8`` — blockwise 8-bit —, or ``offload="momentum"``): the
  state holds a compact or host-side copy; the step materialises a *working* buffer on the
  parameter's device in the compute dtype and runs the unchanged math on it. Streamed (the
  default, :meth:`MomentumStorage.stream`): shape bucket by shape bucket, the buckets of
  ``NewtonSchulz.stack_bytes`` the step already walks for Newton–Schulz (offloaded: cut to
  :data:`OFFLOAD_BUCKET_BYTES` at most, so that the copy the step waits for is small), at most
  ``in_flight`` buckets materialised at once (the next ones copied in or decoded on a side
  stream under the current one's Newton–Schulz); each bucket's new momentum buf′ goes to a
  *shadow* of the stored form (new 8-bit codes, a new host copy) and its working buffers are
  freed; the commit, after the step's verdict, puts the shadows in the state
  (:meth:`MomentumStorage.commit_staged`). All at once (``in_flight=None``; also where the step
  cannot stream: a plan with stages — tensor parallelism, split NS, the expert reshard — or a
  step traced by the user's ``torch.compile``): every working buffer before the first
  Newton–Schulz (:meth:`MomentumStorage.working`), written back after the commit
  (:meth:`MomentumStorage.keep`). Either way a step that does not commit writes nothing, so the
  stored copy is exactly what the last committed step left. Between steps (the forward and
  backward, where activations peak) the GPU holds no momentum (offload) or a quarter of it
  (8-bit).

The 8-bit format: the local tensor is cut into blocks of :data:`BLOCK` consecutive values;
each block keeps its absolute maximum ``s`` (fp32) and one int8 code per value,
``c = round(127·sign(x)·√(|x|/s))`` (a square-root companding: small values keep relative
precision, as the momentum of a quiet row needs). Rounding is stochastic — unbiased, so a
momentum that decays by μ each step keeps decaying instead of sticking at a code — with noise
a counter-based hash of each value's index and a seed made of the parameter's name and the
number of times it was stored (:func:`rounding_noise`), so the same matrix quantised on any
rank draws the same noise; on CUDA the codec is one compiled kernel each way. Per value,
``|x − x̂| ≤ 2·√(|x|·s)/127 + s/127²`` (:func:`error_bound`).

Checkpoints always hold ``state["momentum_buffer"]`` in the parameter's dtype and layout
(:meth:`MomentumStorage.checkpoint_form`; ``Muon.state_dict`` gives it), so a checkpoint of any
setting loads into any other (converted at the next step), through ``torch.save``,
``torch.distributed.checkpoint`` (resharding included) and torch's full-state loads.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
import zlib

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._owner.meshes import local_of
from dmuon_compile.distributed._owner.tensor import OwnerTensor, wrap_like

MOMENTUM = "momentum_buffer"  # the in-place (and checkpoint) form
HOST = "momentum_host"  # offload: the momentum in host memory (pinned where a GPU exists)
CODES = "momentum_codes"  # 8-bit: int8 codes, the local tensor's shape
SCALES = "momentum_scales"  # 8-bit: one fp32 absolute maximum per block
ROUNDS = "momentum_rounds"  # 8-bit: how often this tensor was stored (seeds its rounding noise)
STORED_KEYS = (HOST, CODES, SCALES, ROUNDS)

BLOCK = 256
LEVELS = 127.0

# The one table of the momentum's storage dtypes, by the names configs use (train, torchtitan,
# the dry run) and as torch dtypes (Muon's argument).
MOMENTUM_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,  # the parameter's dtype (fp32 weights: fp32)
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
# "state": the momentum and, for the dedicated weights this rank owns, their masters
# (``distributed/_owner/host_masters.py``); the momentum is stored alike.
OFFLOADS = (None, "momentum", "state")
# Streamed stored momentum: the shape buckets whose working buffers exist at once (the one
# stepped and the next, copied in or decoded under its Newton–Schulz). ``None``: every matrix's.
IN_FLIGHT = 2
# Offloaded and streamed: the most bytes of gradient (= working momentum) one shape bucket holds,
# below ``NewtonSchulz.stack_bytes`` (4 GiB). The first bucket's copy-in and the last one's
# write-back run under no Newton–Schulz, so the bucket's size is what the step waits for; the
# buckets between hide theirs as long as one bucket's copy takes less than its NS.
OFFLOAD_BUCKET_BYTES = 1 << 30


def stream_bucket_bytes(stack_bytes: int | None, offload: str | None) -> int | None:
    """The byte cap of a streamed step's shape buckets: ``stack_bytes`` (NS's), and at most
    :data:`OFFLOAD_BUCKET_BYTES` where the momentum is offloaded. The optimizer cuts its
    buckets by it and the dry run prices them by it."""
    if offload is None:
        return stack_bytes
    return OFFLOAD_BUCKET_BYTES if stack_bytes is None else min(stack_bytes, OFFLOAD_BUCKET_BYTES)


def resolve_momentum_dtype(value) -> torch.dtype | None:
    """``None``, a torch dtype of :data:`MOMENTUM_DTYPES` or its name (``"bf16"``) → the
    storage dtype (``None``: the parameter's); anything else raises naming the choices."""
    if isinstance(value, str) and value in MOMENTUM_DTYPES:
        return MOMENTUM_DTYPES[value]
    if value is None or value == torch.float32:
        return None if value is None else torch.float32
    if value in (torch.bfloat16, torch.int8):
        return value
    raise ValueError(
        f"momentum_dtype={value!r}: choose None (the parameter's dtype), torch.float32, "
        "torch.bfloat16 or torch.int8 (blockwise 8-bit), or their names "
        f"{sorted(MOMENTUM_DTYPES)}"
    )


def check_offload(value) -> str | None:
    """``offload``'s value, or a ``ValueError`` naming the choices."""
    if value not in OFFLOADS:
        raise ValueError(
            f"offload={value!r}: choose None (the momentum stays on the parameter's device), "
            "'momentum' (kept in host memory between steps, streamed in for the step) or "
            "'state' (the momentum and the owners' master weights in host memory)"
        )
    return value


def check_in_flight(value) -> int | None:
    """``momentum_in_flight``'s value (a positive int or ``None``), or a ``ValueError``."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"momentum_in_flight={value!r}: give a positive number of shape buckets (default "
        f"{IN_FLIGHT}: the bucket stepped and the next one, materialised under its "
        "Newton-Schulz) or None (every matrix's working momentum at once)"
    )


def check_kept_momentum(keep, dtype, offload, compile_mode=None) -> bool:
    """``keep_new_momentum``'s value (a bool) checked against the storage it needs: the
    momentum in place (``dtype`` not 8-bit, no ``offload``) and no CUDA graphs; else a
    ``ValueError`` naming the pair."""
    if not isinstance(keep, bool):
        raise ValueError(f"keep_new_momentum={keep!r}: give True or False")
    if not keep:
        return keep
    if resolve_momentum_dtype(dtype) == torch.int8 or check_offload(offload) is not None:
        raise ValueError(
            "keep_new_momentum=True keeps buf′ beside the momentum stored in place; with "
            f"momentum_dtype={resolve_momentum_dtype(dtype)} and offload={offload!r} the step "
            "works on a materialised copy instead: turn one of them off"
        )
    if compile_mode == "reduce-overhead":
        raise ValueError(
            "keep_new_momentum=True swaps each momentum buffer's storage at the commit, and "
            "compile_mode='reduce-overhead' (CUDA graphs) needs the momentum at fixed "
            "addresses: turn one of them off"
        )
    return keep


# ---------------------------------------------------------------------------- 8-bit format
MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x · c mod 2³²`` for ``x`` < 2³² in int64 without overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer (xor-shift, multiply): neighbouring inputs, unrelated outputs."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_noise(n: int, seed: int | Tensor, device) -> Tensor:
    """``n`` uniform values in [0, 1) from a counter-based hash of each index and ``seed``:
    the same on every device and rank for the same ``seed``; no generator state."""
    idx = torch.arange(n, device=device, dtype=torch.int64) & MASK32
    h = _hash32(_hash32(idx) ^ (seed & MASK32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def _quantize(x: Tensor, seed: Tensor, stochastic: bool) -> tuple[Tensor, Tensor]:
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1)
    unit = blocks / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    level = unit.abs().sqrt() * LEVELS  # in [0, 127]
    if stochastic:
        noise = rounding_noise(level.numel(), seed, level.device).view(level.shape)
        level = (level + noise).floor().clamp(max=LEVELS)
    else:
        level = level.round()
    codes = (level * unit.sign()).to(torch.int8).reshape(-1)[:n].view(x.shape)
    return codes, scales


def _dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    n = codes.numel()
    c = torch.nn.functional.pad(codes.reshape(-1).float(), (0, (-n) % BLOCK)).view(-1, BLOCK)
    unit = (c.abs() / LEVELS).square() * c.sign()
    return (unit * scales.unsqueeze(1)).reshape(-1)[:n].view(codes.shape).to(dtype)


_COMPILED: dict[str, object] = {}


def _on_device(name: str, fn, t: Tensor):
    """``fn`` compiled (one fused kernel or two instead of ~12 passes over the tensor) for CUDA
    tensors; eager elsewhere (the same ops: a CPU runs it where it is tested). If the compiled
    codec fails (a compiler that cannot build it), the eager ops run instead, from then on, with
    a warning: the codec is a pure function, so nothing was written."""
    if t.device.type != "cuda" or torch.compiler.is_compiling() or _COMPILED.get(name) is False:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    compiled = _COMPILED[name]

    def run(*args):
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager ops instead
            _COMPILED[name] = False
            warnings.warn(
                f"dmuon: the compiled 8-bit momentum {name} failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); using the eager ops "
                "(same format, more passes over memory)",
                stacklevel=3,
            )
            return fn(*args)

    return run


def quantize_blockwise(x: Tensor, seed: int | None = None) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of ``x`` in the 8-bit format (module docstring): codes int8 of
    ``x``'s shape, scales fp32 of ``ceil(numel / BLOCK)`` blocks. ``seed``: stochastic rounding
    with :func:`rounding_noise` of that seed; ``None``: round to nearest."""
    fn = _on_device("quantize", _quantize, x)
    # the seed as a tensor: compiled, an integer argument would be specialised or made symbolic
    seed_t = torch.tensor(0 if seed is None else int(seed) & MASK32, device=x.device)
    return fn(x, seed_t, seed is not None)


def dequantize_blockwise(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """The values ``codes`` and ``scales`` stand for, in ``dtype``, ``codes``' shape."""
    return _on_device("dequantize", _dequantize, codes)(codes, scales, dtype)


def error_bound(x: Tensor, scales: Tensor) -> Tensor:
    """The per-value bound of the 8-bit format's error for ``x`` (either rounding):
    ``2·√(|x|·s)/127 + s/127²`` with ``s`` its block's scale."""
    n = x.numel()
    s = scales.repeat_interleave(BLOCK)[:n].view(x.shape).float()
    return 2 * (x.abs().float() * s).sqrt() / LEVELS + s / LEVELS**2


def compiled_store_momentum():
    """``functional.store_momentum`` (buf ← μ·buf + g in place) compiled as the compiled
    step's commit compiles it (its own code object, static shapes, no NS pass): a streamed
    compiled step computes each bucket's buf′ with the same fused kernel as that commit."""
    from dmuon_compile import functional as F
    from dmuon_compile.compiled_step import _fresh_copy, default_compile_options

    return torch.compile(
        _fresh_copy(F.store_momentum),
        fullgraph=True,
        dynamic=False,
        options=default_compile_options(None, rewrite=False),
    )


# ---------------------------------------------------------------------------- kept buf′
def _owns_storage(t: Tensor) -> bool:
    """Whether ``t`` is the whole of its storage, densely (a view or a slice of a larger
    buffer is not: swapping it would detach it from that buffer, or save the buffer whole)."""
    return (
        t._base is None
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def take_kept_momentum(bufs: list[Tensor], kept: list[Tensor], commit_if=None) -> None:
    """The commit of ``Muon(keep_new_momentum=True)``: each momentum buffer of ``bufs`` (the
    state's own tensors: their objects stay, wrappers and state entries see the change) takes
    its buf′ from ``kept``, computed by the directions. Where both own their storage whole, the
    buffer's storage is swapped for buf′'s: no bytes move and the old storage is freed; else
    buf′ is copied in. ``commit_if`` (a deferred verdict on the device): where it turns out
    false the old values are copied back (``kernels/copy_unless.py``: on CUDA nothing is read
    when it is true)."""
    from dmuon_compile.kernels.copy_unless import copy_unless

    for buf, new in zip(bufs, kept):
        swap = (
            new.shape == buf.shape
            and new.dtype == buf.dtype
            and new.device == buf.device
            and _owns_storage(buf)
            and _owns_storage(new)
        )
        if not swap:
            buf.copy_(new if commit_if is None else torch.where(commit_if, new, buf))
            continue
        old = buf.detach()  # the old storage, held until the undo below is queued
        buf.set_(new)
        if commit_if is not None:
            copy_unless(commit_if.to(buf.device, non_blocking=True), buf, old)


# ---------------------------------------------------------------------------- the storage
class Streamed:
    """A Muon matrix whose stored momentum the step materialises with its shape bucket: what a
    job's ``bufs`` hold in place of a working buffer when the step streams
    (:meth:`MomentumStorage.stream`)."""

    __slots__ = ("state", "param", "name")

    def __init__(self, state: dict, param: Tensor, name: str) -> None:
        self.state, self.param, self.name = state, param, name

    def __repr__(self) -> str:
        return f"Streamed({self.name})"


def is_streamed(bufs) -> bool:
    """Whether a job's ``bufs`` are streamed (:class:`Streamed` entries)."""
    return any(isinstance(b, Streamed) for b in bufs)


class MomentumStorage:
    """One optimizer's momentum storage (module docstring). ``dtype``: the storage dtype
    (``None``: the parameter's; ``torch.int8``: the 8-bit format); ``offload``: ``None`` or
    ``"momentum"``; ``in_flight``: the shape buckets whose working buffers a streamed step
    holds at once (``None``: every matrix's, materialised before the first Newton–Schulz).

    ``working_bytes`` / ``peak_working_bytes``: the bytes of working buffers alive now and at
    most since :meth:`begin_step` (counted while each tensor lives: what the step really holds,
    not what it meant to free)."""

    def __init__(
        self,
        dtype: torch.dtype | None = None,
        offload: str | None = None,
        in_flight: int | None = IN_FLIGHT,
    ) -> None:
        self.dtype = resolve_momentum_dtype(dtype)
        self.offload = check_offload(offload)
        self.in_flight = check_in_flight(in_flight)
        # Per device: the side stream that copies in and decodes, the one that copies out.
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._out_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._begun: set[torch.device] = set()  # devices whose side stream this step ordered
        self._staged: list[tuple[dict, dict]] = []  # (state, its shadow), for commit_staged
        self.working_bytes = 0
        self.peak_working_bytes = 0

    @property
    def stored(self) -> bool:
        """Whether the step works on a materialised copy (8-bit or offload), not in place."""
        return self.dtype == torch.int8 or self.offload is not None

    @property
    def streaming(self) -> bool:
        """Whether a step may materialise the stored momentum bucket by bucket."""
        return self.stored and self.in_flight is not None

    def bucket_bytes(self, stack_bytes: int | None) -> int | None:
        """The byte cap of this storage's streamed shape buckets (:func:`stream_bucket_bytes`)."""
        return stream_bucket_bytes(stack_bytes, self.offload)

    def working_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype the step computes the momentum in: the storage dtype, or the parameter's
        where that is 8-bit (the codes are no arithmetic type)."""
        return p.dtype if self.dtype in (None, torch.int8) else self.dtype

    def begin_step(self) -> None:
        """A step starts: shadows a step left uncommitted are dropped, the peak counter starts
        from what is alive now."""
        self._staged = []
        self._begun = set()
        self.peak_working_bytes = self.working_bytes

    # -- the in-place form
    def in_place(self, state: dict, p: Tensor) -> Tensor:
        """``state["momentum_buffer"]``, created (zeros like ``p``) or converted to the
        storage dtype (a loaded checkpoint of another setting) as needed."""
        dtype = self.working_dtype(p)
        if MOMENTUM not in state and any(key in state for key in (HOST, CODES)):
            self.synchronize()  # the setting changed on a live optimizer: its stored copy
            state[MOMENTUM] = self.checkpoint_form(state, p)
        buf = state.get(MOMENTUM)
        if buf is None:
            buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif buf.dtype != dtype:  # torch's load casts state to the parameter's dtype
            buf = buf.to(dtype)
        state[MOMENTUM] = buf
        for key in STORED_KEYS:  # a stored form left by another setting's step
            state.pop(key, None)
        return buf

    # -- the stored form, all at once
    def working(self, state: dict, p: Tensor, name: str) -> Tensor:
        """The step's momentum buffer of ``p`` (a plain tensor: ``p``'s local tensor's shape,
        on its device): zeros on the first step, else the stored copy materialised (offload on
        CUDA: on the side stream, :meth:`ready` orders it before the step). A state holding
        ``momentum_buffer`` (a checkpoint loaded, or another setting's) is taken into the
        stored form first. ``name``: seeds the 8-bit rounding noise."""
        local, dtype = self._into_own_form(state, p, name)
        side = self._side(local.device) if self.offload is not None else None
        return self._materialise(state, local, dtype, side)

    def keep(self, kept: list[tuple[dict, Tensor, str, Tensor]]) -> None:
        """Write back the step's working buffers ``(state, p, name, working)`` after the
        commit (offload: on a side stream, ordered after the step's kernels)."""
        for state, _p, name, work in kept:
            self._store(state, work, name)

    def ready(self, device: torch.device) -> None:
        """Make ``device``'s current stream wait for the working buffers copied in."""
        stream = self._streams.get(device)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)

    # -- the stored form, streamed
    def streamed(self, state: dict, p: Tensor, name: str) -> Streamed:
        """``p``'s entry in a streamed step's ``bufs``: nothing materialised yet (the state
        taken into this storage's form first, as :meth:`working` does)."""
        self._into_own_form(state, p, name)
        return Streamed(state, p, name)

    def stream(self, bufs: list, buckets: list[list[int]]) -> BucketStream:
        """The working buffers of ``bufs`` (:class:`Streamed` entries, or tensors passed
        through) by ``buckets`` (indices into ``bufs``), :attr:`in_flight` at a time."""
        return BucketStream(self, bufs, buckets)

    def commit_staged(self) -> None:
        """After the commit: each streamed matrix's shadow becomes its stored copy."""
        staged, self._staged = self._staged, []
        for state, shadow in staged:
            state.update(shadow)

    def drop_staged(self) -> None:
        """A step that does not commit: its shadows are dropped, the stored copies unchanged."""
        self._staged = []

    def synchronize(self) -> None:
        """Wait for the copies in flight (before the host reads a stored copy)."""
        for stream in (*self._streams.values(), *self._out_streams.values()):
            stream.synchronize()

    def checkpoint_form(self, state: dict, p: Tensor) -> Tensor:
        """``p``'s momentum as a checkpoint holds it: a tensor like ``p`` (a DTensor of
        ``p``'s mesh and placements for a DTensor), in ``p``'s dtype."""
        local = local_of(p)
        if CODES in state:
            codes, scales = state[CODES], state[SCALES]
            value = dequantize_blockwise(codes, scales, p.dtype).to(local.device)
        else:
            value = state[HOST].to(local.device, p.dtype, copy=True)
        if not isinstance(p, DTensor):
            return value
        if isinstance(p, OwnerTensor):
            return wrap_like(value, p)
        return DTensor.from_local(
            value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    # -- internals
    def _into_own_form(self, state: dict, p: Tensor, name: str) -> tuple[Tensor, torch.dtype]:
        """``state`` converted to this storage's stored form where it holds another (a
        checkpoint's ``momentum_buffer``, another setting's copy); ``(p's local tensor, the
        working dtype)``."""
        local = local_of(p)
        dtype = self.working_dtype(p)
        stored = any(key in state for key in (HOST, CODES))
        if stored and not self._holds_own_form(state, dtype, local.device):
            self.synchronize()  # the setting changed on a live optimizer: into this form
            state[MOMENTUM] = self.checkpoint_form(state, p)
            for key in STORED_KEYS:
                state.pop(key, None)
        if MOMENTUM in state:
            self._store(state, local_of(state.pop(MOMENTUM)).to(dtype), name, first=True)
            self._begun.discard(local.device)  # its copy out: the next copy in waits for it
        return local, dtype

    def _materialise(self, state: dict, local: Tensor, dtype: torch.dtype, side) -> Tensor:
        """A fresh working buffer of ``state``'s stored copy (zeros without one) on
        ``local``'s device; ``side``: a CUDA stream to issue the copy and decode on (the
        caller orders the step after it), else the current stream."""
        if not any(key in state for key in (HOST, CODES)):
            return self._count(torch.zeros_like(local, dtype=dtype))
        device = local.device
        if side is not None:
            self._begin(device)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if CODES in state:
                codes, scales = state[CODES], state[SCALES]
                if codes.device != device:  # 8-bit and offloaded
                    codes = codes.to(device, non_blocking=True)
                    scales = scales.to(device, non_blocking=True)
                elif side is not None:  # read on the side stream: freed after that read
                    codes.record_stream(side)
                    scales.record_stream(side)
                out = dequantize_blockwise(codes, scales, dtype)
            else:
                out = state[HOST].to(device, non_blocking=True, copy=True)
        if side is not None:
            out.record_stream(torch.cuda.current_stream(device))
        return self._count(out)

    def _begin(self, device: torch.device) -> None:
        """Once per step and device, before the side stream reads a stored copy: after the
        copies out that wrote it (the last step's) and, for codes on the device, after the
        step's stream (where they were quantised)."""
        if device in self._begun:
            return
        self._begun.add(device)
        side = self._side(device)
        side.wait_stream(self._out(device))
        if self.offload is None:
            side.wait_stream(torch.cuda.current_stream(device))

    def _count(self, t: Tensor) -> Tensor:
        nbytes = t.numel() * t.element_size()
        self.working_bytes += nbytes
        self.peak_working_bytes = max(self.peak_working_bytes, self.working_bytes)
        weakref.finalize(t, self._uncount, nbytes)
        return t

    def _uncount(self, nbytes: int) -> None:
        self.working_bytes -= nbytes

    def _holds_own_form(self, state: dict, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``state``'s stored copy is in this storage's form (not another setting's);
        ``device``: the parameter's (on a CPU both places are one)."""
        if self.dtype == torch.int8:
            place = torch.device("cpu") if self.offload else device
            return CODES in state and state[CODES].device == place
        return HOST in state and state[HOST].dtype == dtype

    def _stored_form(self, state: dict, work: Tensor, name: str, first: bool, into) -> dict:
        """The stored form of ``work`` as state entries. ``into``: ``state`` itself (its host
        buffers reused) or ``None`` (new ones: a shadow)."""
        if self.dtype == torch.int8:
            rounds = 0 if first else state.get(ROUNDS, 0) + 1
            seed = zlib.crc32(f"{name}#{rounds}".encode())
            codes, scales = quantize_blockwise(work, seed)
            if self.offload is not None:
                codes = self._to_host(codes, None if into is None else into.get(CODES))
                scales = self._to_host(scales, None if into is None else into.get(SCALES))
            return {CODES: codes, SCALES: scales, ROUNDS: rounds}
        return {HOST: self._to_host(work, None if into is None else into.get(HOST))}

    def _store(self, state: dict, work: Tensor, name: str, first: bool = False) -> None:
        state.update(self._stored_form(state, work, name, first, state))

    def _stage(self, entries: list, work: list[Tensor]) -> None:
        """A bucket's new momentum (``work``: buf′ of each entry) to the shadows of its
        :class:`Streamed` entries; the state is untouched until :meth:`commit_staged`."""
        for entry, buf in zip(entries, work):
            if isinstance(entry, Streamed):
                shadow = self._stored_form(entry.state, buf, entry.name, False, None)
                self._staged.append((entry.state, shadow))

    def _side(self, device: torch.device):
        """``device``'s side stream for copies in and decodes (``None`` off CUDA)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _out(self, device: torch.device):
        """``device``'s side stream for copies out (``None`` off CUDA): apart from the copies
        in, so that a bucket's copy out does not hold up the next bucket's copy in."""
        if device.type != "cuda":
            return None
        if device not in self._out_streams:
            self._out_streams[device] = torch.cuda.Stream(device)
        return self._out_streams[device]

    def _to_host(self, work: Tensor, into: Tensor | None) -> Tensor:
        """``work`` copied into host memory (``into`` reused when it fits; pinned where a GPU
        exists); from CUDA on the out stream after the step's kernels so far."""
        if into is None or into.shape != work.shape or into.dtype != work.dtype:
            pin = work.device.type == "cuda"
            into = torch.empty(work.shape, dtype=work.dtype, device="cpu", pin_memory=pin)
        stream = self._out(work.device)
        if stream is None:
            into.copy_(work)
            return into
        stream.wait_stream(torch.cuda.current_stream(work.device))
        with torch.cuda.stream(stream):
            into.copy_(work, non_blocking=True)
        work.record_stream(stream)
        return into


class BucketStream:
    """One job's stored momentum materialised bucket by bucket (:meth:`MomentumStorage.stream`).

    ``take(k)`` gives bucket ``k``'s working buffers; the caller computes its directions and its
    new momentum buf′ in them, then ``stage(k, bufs)`` stores buf′ to the shadows and releases
    them (the caller drops its references too). Bucket ``k + in_flight − 1`` is issued in
    ``stage(k)``, after bucket ``k``'s kernels are queued, so on CUDA its copy runs on the side
    stream under them; before that, the host waits until bucket ``k − 1``'s buffers are no
    longer used on the device, so that no more than ``in_flight`` buckets' buffers exist there
    at once (a host running ahead would otherwise allocate every bucket before the device frees
    any). On a CPU everything runs in order."""

    def __init__(self, storage: MomentumStorage, bufs: list, buckets: list[list[int]]) -> None:
        self.storage, self.bufs, self.buckets = storage, bufs, buckets
        self.limit = storage.in_flight or len(buckets)
        self._issued = 0
        self._work: dict[int, list] = {}  # issued, not yet staged
        self._ready: dict[int, object] = {}  # CUDA: the event after bucket k's copies in
        self._released: dict[int, object] = {}  # CUDA: the event after bucket k's last use

    def take(self, k: int) -> list:
        self._issue_through(k)
        ready = self._ready.pop(k, None)
        if ready is not None:  # (event, device): the step's stream waits for this bucket only
            torch.cuda.current_stream(ready[1]).wait_event(ready[0])
        return self._work[k]

    def stage(self, k: int, work: list) -> None:
        entries = [self.bufs[i] for i in self.buckets[k]]
        self.storage._stage(entries, work)
        device = next((b.device for b in work if isinstance(b, Tensor)), None)
        out = None if device is None else self.storage._out(device)
        if out is not None:  # after buf′ and its copies out: the buffers are free again
            out.wait_stream(torch.cuda.current_stream(device))
            event = torch.cuda.Event()
            event.record(out)
            self._released[k] = event
            for buf in work:
                buf.record_stream(out)
        del self._work[k]
        self._issue_through(k + self.limit - 1)

    def _issue_through(self, last: int) -> None:
        last = min(last, len(self.buckets) - 1)
        while self._issued <= last:
            k = self._issued
            freed = self._released.pop(k - self.limit, None)
            if freed is not None:  # the host waits: the device bound, not the host's
                freed.synchronize()
            work, side, device = [], None, None
            for i in self.buckets[k]:
                entry = self.bufs[i]
                if isinstance(entry, Streamed):
                    local = local_of(entry.param)
                    device, side = local.device, self.storage._side(local.device)
                    dtype = self.storage.working_dtype(entry.param)
                    entry = self.storage._materialise(entry.state, local, dtype, side)
                work.append(entry)
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
                self._ready[k] = (event, device)
            self._work[k] = work
            self._issued += 1
