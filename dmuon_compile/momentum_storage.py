"""Where and in what form Muon keeps each matrix's momentum between steps.

``Muon(momentum_dtype=..., offload=...)`` picks it. Two kinds of storage:

- **In place** (``momentum_dtype`` ``None``, ``torch.float32`` or ``torch.bfloat16``, no
  offload): ``state["momentum_buffer"]`` is the tensor the step reads and writes, as in every
  torch optimizer. Nothing here runs during a step.
- **Stored** (``momentum_dtype=torch.int8`` — blockwise 8-bit —, or ``offload="momentum"``):
  the state holds a compact or host-side copy; each step materialises a *working* buffer on the
  parameter's device in the compute dtype (:meth:`MomentumStorage.working`), runs the unchanged
  step on it, and writes it back after the commit (:meth:`MomentumStorage.keep`). A step that
  does not commit never writes back, so the stored copy is exactly what the last committed step
  left. Between steps (the forward and backward, where activations peak) the GPU holds no
  momentum (offload) or a quarter of it (8-bit).

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

import warnings
import zlib

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._owned import OwnerTensor, wrap_like
from dmuon_compile.distributed._owner_meshes import local_of

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
OFFLOADS = (None, "momentum")


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
            f"offload={value!r}: choose None (the momentum stays on the parameter's device) or "
            "'momentum' (kept in host memory between steps, streamed in for the step)"
        )
    return value


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


# ---------------------------------------------------------------------------- the storage
class MomentumStorage:
    """One optimizer's momentum storage (module docstring). ``dtype``: the storage dtype
    (``None``: the parameter's; ``torch.int8``: the 8-bit format); ``offload``: ``None`` or
    ``"momentum"``."""

    def __init__(self, dtype: torch.dtype | None = None, offload: str | None = None) -> None:
        self.dtype = resolve_momentum_dtype(dtype)
        self.offload = check_offload(offload)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def stored(self) -> bool:
        """Whether the step works on a materialised copy (8-bit or offload), not in place."""
        return self.dtype == torch.int8 or self.offload is not None

    def working_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype the step computes the momentum in: the storage dtype, or the parameter's
        where that is 8-bit (the codes are no arithmetic type)."""
        return p.dtype if self.dtype in (None, torch.int8) else self.dtype

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

    # -- the stored form
    def working(self, state: dict, p: Tensor, name: str) -> Tensor:
        """The step's momentum buffer of ``p`` (a plain tensor: ``p``'s local tensor's shape,
        on its device): zeros on the first step, else the stored copy materialised. A state
        holding ``momentum_buffer`` (a checkpoint loaded, or another setting's) is taken into
        the stored form first. ``name``: seeds the 8-bit rounding noise."""
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
        if not any(key in state for key in (HOST, CODES)):
            return torch.zeros_like(local, dtype=dtype)
        if CODES in state:
            codes, scales = state[CODES], state[SCALES]
            if codes.device != local.device:  # 8-bit and offloaded
                codes, scales = (
                    self._to_device(codes, local.device),
                    self._to_device(scales, local.device),
                )
            return dequantize_blockwise(codes, scales, dtype)
        return self._to_device(state[HOST], local.device, copy=True)

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

    def synchronize(self) -> None:
        """Wait for the write-backs in flight (before the host reads a stored copy)."""
        for stream in self._streams.values():
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
    def _holds_own_form(self, state: dict, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``state``'s stored copy is in this storage's form (not another setting's);
        ``device``: the parameter's (on a CPU both places are one)."""
        if self.dtype == torch.int8:
            place = torch.device("cpu") if self.offload else device
            return CODES in state and state[CODES].device == place
        return HOST in state and state[HOST].dtype == dtype

    def _store(self, state: dict, work: Tensor, name: str, first: bool = False) -> None:
        if self.dtype == torch.int8:
            rounds = 0 if first else state.get(ROUNDS, 0) + 1
            seed = zlib.crc32(f"{name}#{rounds}".encode())
            codes, scales = quantize_blockwise(work, seed)
            if self.offload is not None:
                codes, scales = (
                    self._to_host(codes, state.get(CODES)),
                    self._to_host(scales, state.get(SCALES)),
                )
            state[CODES], state[SCALES], state[ROUNDS] = codes, scales, rounds
            return
        state[HOST] = self._to_host(work, state.get(HOST))

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _to_device(self, host: Tensor, device: torch.device, copy: bool = False) -> Tensor:
        """``host`` on ``device``: on CUDA issued on the side stream (``ready`` orders it
        before the step); a fresh tensor (the step writes it, never the stored copy)."""
        stream = self._stream(device)
        if stream is None:
            return host.to(device, copy=copy)
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True, copy=copy)
        out.record_stream(torch.cuda.current_stream(device))
        return out

    def _to_host(self, work: Tensor, into: Tensor | None) -> Tensor:
        """``work`` copied into host memory (``into`` reused when it fits; pinned where a GPU
        exists); from CUDA on the side stream after the step's kernels."""
        if into is None or into.shape != work.shape or into.dtype != work.dtype:
            pin = work.device.type == "cuda"
            into = torch.empty(work.shape, dtype=work.dtype, device="cpu", pin_memory=pin)
        stream = self._stream(work.device)
        if stream is None:
            into.copy_(work)
            return into
        stream.wait_stream(torch.cuda.current_stream(work.device))
        with torch.cuda.stream(stream):
            into.copy_(work, non_blocking=True)
        work.record_stream(stream)
        return into
