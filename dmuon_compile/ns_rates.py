"""Measured Newton–Schulz throughput, so a dry run can price a rank's optimizer step in ms.

The model (:class:`NSRates`), for one batched Newton–Schulz call over ``batch`` matrices of
``(m, n)`` (``m`` the shorter side):

    call ms = call_ms + batch · flops(m, n) / rate(m)

- ``flops``: :func:`useful_flops`, the package's NS FLOP count with the symmetric products at
  half cost (the work the Triton/Gluon kernels do; the TFLOP/s columns of
  ``benchmarks/RESULTS.md`` use the same count);
- ``rate(m)``: achieved useful TFLOP/s, piecewise linear in ``log2(m)`` between anchors, each
  taken from a measured stack big enough that ``call_ms`` is small beside it; below the
  smallest anchor the rate falls in proportion to ``m`` (small products fill fewer tiles);
- ``call_ms``: a fixed cost per batched call (each of its ~14 products pays a pipeline fill and
  tail: a single 2048×5632, one wave of tiles per product, runs at 60% of the stacked rate).

A step over a rank's matrices adds the elementwise work around NS (momentum, Nesterov input,
norms, scale-casts, the commit: ~44 bytes per element at HBM speed) and a start-up gap:

    step ms = Σ call ms + elements · elementwise_ps / 1e9 + start_ms

Every number of :data:`H200` comes from ``benchmarks/RESULTS.md`` (one H200 SXM, torch
2.11.0+cu130, triton 3.6.0, the default ``NewtonSchulz()``: Gram NS, Polar Express, 5 steps,
restart after step 2, fp16, kernels as the autotune picks them); :data:`MEASURED` names the
section and date of each. Other hardware or kernels: ``python benchmarks/dry_run_check.py
--shapes --rates-out rates.json`` times the same shapes and writes a file :meth:`NSRates.load`
(``python -m dmuon_compile.plan --rates rates.json``) reads; or build your own with
:meth:`NSRates.from_measurements`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple


class Measured(NamedTuple):
    """One measured Newton–Schulz call: ``batch`` matrices of ``shape`` in ``ms``."""

    shape: tuple[int, int]
    batch: int
    ms: float
    source: str


# One H200, default NewtonSchulz() (eager, batched calls). The anchors of the rate curve:
MEASURED = (
    Measured((768, 2048), 64, 3.914, "RESULTS.md §17 call 1 (2026-12-04), 64×(768×2048)"),
    Measured((1536, 4096), 16, 5.648, "RESULTS.md §17 call 1 (2026-12-04), 16×(1536×4096)"),
    Measured((2048, 7168), 32, 18.093, "RESULTS.md §17 call 1 (2026-12-04), 32×(2048×7168)"),
    Measured((4096, 14336), 1, 4.290, "RESULTS.md §16 call 2 (2026-12-02), 4096×14336"),
    Measured((8192, 28672), 1, 32.244, "RESULTS.md §1 run 6 A (2026-11-30), 8192×28672"),
)
# Sets call_ms (one wave of tiles per product) and checks the rest; not an anchor.
SINGLE_2048 = Measured((2048, 5632), 1, 0.784, "RESULTS.md §17 call 1 (2026-12-04), 2048×5632")
# What the model is checked against (benchmarks/dry_run_check.py prints the ratios): other
# shapes of the same runs, and the compiled step alone of the benchmark models (bench_step.py
# matrices, fp32, one H200): median ms of the step and, where profiled, of its NS products.
CHECKS = (
    Measured((7168, 2048), 8, 4.849, "RESULTS.md §17 call 1 (2026-12-04), 8×(7168×2048)"),
    Measured((14336, 4096), 1, 4.253, "RESULTS.md §16 call 2 (2026-12-02), 14336×4096"),
    Measured((4096, 4096), 1, 2.731, "RESULTS.md §1 run 6 A (2026-11-30), 4096² (direct NS)"),
)
STEP_MEASURED = {
    # model: (step ms, NS products ms or None, source)
    "S": (26.58, 20.21, "RESULTS.md §16 call 2 step; §15 profile: 12.98 symmetric + 7.23 cuBLAS"),
    "M": (95.73, 83.2, "RESULTS.md §16 call 2 step; §15 profile: 48.9 symmetric + 34.3 cuBLAS"),
    "E": (60.83, None, "RESULTS.md §17 call 2 (2026-12-04), compiled step of model E"),
    "G": (
        24.46,
        None,
        "benchmarks/dry_run_check.py on one H200, 2026-12-04 (torch 2.11.0+cu130): the compiled "
        "step alone (RESULTS.md §11's 32.07 ms was G's step inside its FSDP2 iteration, before "
        "§16 took the AdamW host time out of it)",
    ),
}


def useful_flops(m: int, n: int, ns=None) -> float:
    """Newton–Schulz FLOPs of one ``(m, n)`` matrix under ``ns``'s configuration (default
    ``NewtonSchulz()``), symmetric products at half cost whatever kernel this machine has."""
    from dmuon_compile.newton_schulz import (
        DEFAULT_GRAM_MIN_ASPECT,
        direct_ns_flops,
        gram_ns_flops,
    )

    small, large = min(int(m), int(n)), max(int(m), int(n))
    if ns is None:
        backend, steps, restarts, aspect = "gram", 5, 1, DEFAULT_GRAM_MIN_ASPECT
    else:
        backend, steps = ns.backend, len(ns.coefficients)
        restarts, aspect = len(ns.restart_iterations), ns.gram_min_aspect
    if backend == "gram" and large >= aspect * small:
        return gram_ns_flops(small, large, steps, restarts, True)
    return direct_ns_flops(small, large, steps, True)


class TargetFlops:
    """An ``ns`` for the owner planner that prices NS as :func:`useful_flops` does: plans made
    on a CPU with it equal the plans ``dedicate_params`` makes on a GPU with Triton kernels
    (where ``NewtonSchulz().flops`` counts the symmetric products at half)."""

    def __init__(self, ns=None) -> None:
        self.ns = ns

    def flops(self, m: int, n: int) -> float:
        return useful_flops(m, n, self.ns)


@dataclass(frozen=True)
class NSRates:
    """Newton–Schulz and step timing of one device (see the module docstring for the model).

    ``anchors``: ``(m, useful TFLOP/s)`` pairs, ``m`` ascending. ``memory_gib``: the card's
    memory (the dry run notes a predicted peak above it), ``None`` if unknown.
    """

    anchors: tuple[tuple[int, float], ...]
    call_ms: float = 0.3
    elementwise_ps: float = 10.5  # ps per matrix element per step (~44 B/element at 4.2 TB/s)
    start_ms: float = 1.0  # the step's start before its first kernel
    device: str = "custom"
    sources: tuple[str, ...] = field(default=(), compare=False)
    memory_gib: float | None = None  # the card's memory as the driver reports it (dry run's fit)

    def __post_init__(self) -> None:
        if not self.anchors:
            raise ValueError("NSRates needs at least one (m, TFLOP/s) anchor")
        ms = [m for m, _ in self.anchors]
        if ms != sorted(ms) or any(r <= 0 for _, r in self.anchors) or ms[0] < 1:
            raise ValueError(
                f"NSRates anchors must be (m, TFLOP/s) pairs with m ascending and rates > 0, got "
                f"{self.anchors}"
            )
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ValueError(f"NSRates memory_gib must be > 0 GiB (or None), got {self.memory_gib}")

    @classmethod
    def from_measurements(cls, measured, call_ms: float = 0.3, ns=None, **kwargs) -> NSRates:
        """Anchors from measured calls ``(shape, batch, ms[, source])``: per shorter side ``m``
        the call with the most work gives ``rate(m) = work / (ms − call_ms)``."""
        best: dict[int, tuple[float, float, str]] = {}
        for item in measured:
            shape, batch, ms = item[0], int(item[1]), float(item[2])
            source = item[3] if len(item) > 3 else ""
            m = min(shape)
            work = batch * useful_flops(*shape, ns)
            if ms <= call_ms:
                raise ValueError(
                    f"measured {batch}×{tuple(shape)} in {ms} ms, not more than call_ms="
                    f"{call_ms}: pass a bigger stack or a smaller call_ms"
                )
            if m not in best or work > best[m][0]:
                best[m] = (work, work / ((ms - call_ms) * 1e-3) / 1e12, source)
        anchors = tuple((m, best[m][1]) for m in sorted(best))
        sources = tuple(best[m][2] for m in sorted(best) if best[m][2])
        return cls(anchors=anchors, call_ms=call_ms, sources=sources, **kwargs)

    @classmethod
    def load(cls, path: str) -> NSRates:
        """From a JSON file: ``{"anchors": [[m, tflops], ...], "call_ms": ..., ...}`` (the
        fields of this class) or ``{"measured": [[[m, n], batch, ms], ...], "call_ms": ...}``.
        A file that is neither raises ``ValueError`` saying what is wrong and what it must
        hold."""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise _bad_rates(path, f"not JSON ({e})") from None
        _check_rates_file(path, data)
        data = dict(data)
        try:
            if "measured" in data:
                measured = [(tuple(s), b, ms, *rest) for s, b, ms, *rest in data.pop("measured")]
                data.pop("sources", None)  # from_measurements takes them from the entries
                return cls.from_measurements(measured, **data)
            data["anchors"] = tuple((int(m), float(r)) for m, r in data["anchors"])
            data["sources"] = tuple(data.get("sources", ()))
            return cls(**data)
        except ValueError as e:  # the class's own checks (ascending anchors, ms > call_ms)
            raise _bad_rates(path, str(e)) from None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["anchors"] = [list(a) for a in self.anchors]
        out["sources"] = list(self.sources)
        return out

    def rate(self, m: int) -> float:
        """Useful TFLOP/s of NS on matrices whose shorter side is ``m``."""
        (m0, r0), (m1, r1) = self.anchors[0], self.anchors[-1]
        if m <= m0:
            return r0 * m / m0
        if m >= m1:
            return r1
        for (a, ra), (b, rb) in zip(self.anchors, self.anchors[1:]):
            if m <= b:
                t = (math.log2(m) - math.log2(a)) / (math.log2(b) - math.log2(a))
                return ra + t * (rb - ra)
        return r1  # unreachable

    def call_ms_of(self, shape, batch: int = 1, ns=None) -> float:
        """Milliseconds of one batched NS call over ``batch`` matrices of ``shape``."""
        if batch <= 0:
            return 0.0
        work = batch * useful_flops(*shape, ns)
        return self.call_ms + work / (self.rate(min(shape)) * 1e12) * 1e3

    def bucket_ms(self, shape, count: int, stack_bytes: int, ns=None) -> float:
        """One shape bucket of ``count`` matrices, cut into calls of at most ``stack_bytes``
        of fp32 input (at least one matrix per call), as the step cuts it."""
        per = max(1, stack_bytes // (4 * shape[0] * shape[1]))
        full, rest = divmod(count, per)
        return full * self.call_ms_of(shape, per, ns) + self.call_ms_of(shape, rest, ns)

    def elementwise_ms(self, elements: int) -> float:
        return elements * self.elementwise_ps * 1e-9


H200 = NSRates.from_measurements(
    MEASURED,
    call_ms=0.3,
    elementwise_ps=10.5,  # §15: S 4.3 ms for 411M elements, M ~10 ms for 973M
    start_ms=1.0,  # §14/§15 traces: ~1 ms before the step's first kernel
    device="H200 (torch 2.11, default NewtonSchulz)",
    memory_gib=143771 / 1024,  # an H200 SXM as nvidia-smi reports it: 143771 MiB (141 GB)
)

_RATES_FILE = (
    'the file must hold one JSON object: either "anchors": [[m, TFLOP/s], ...] (m ascending, '
    'rates > 0) or "measured": [[[m, n], batch, ms], ...] (each ms above call_ms), and '
    "optionally call_ms, elementwise_ps, start_ms (numbers >= 0), device (text), sources (a "
    "list of text), memory_gib (the card's GiB, > 0); `python benchmarks/dry_run_check.py "
    "--shapes --rates-out rates.json` writes one"
)
_NUMBERS = ("call_ms", "elementwise_ps", "start_ms")


def _bad_rates(path, what: str) -> ValueError:
    return ValueError(f"rates file {path}: {what}; {_RATES_FILE}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_rates_file(path, data) -> None:
    """What :meth:`NSRates.load` needs of a file's JSON ``data``; raises naming the first flaw."""
    if not isinstance(data, dict):
        raise _bad_rates(path, f"it holds a JSON {type(data).__name__}, not an object")
    kinds = [k for k in ("anchors", "measured") if k in data]
    if len(kinds) != 1:
        raise _bad_rates(
            path,
            "it has both 'anchors' and 'measured'"
            if kinds
            else "it has no 'anchors' or 'measured'",
        )
    known = {"anchors", "measured", "memory_gib", "device", "sources", *_NUMBERS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise _bad_rates(path, f"unknown keys {unknown}")
    (kind,) = kinds
    items = data[kind]
    if not isinstance(items, list) or not items:
        raise _bad_rates(path, f"'{kind}' is {items!r}, not a non-empty list")
    for i, item in enumerate(items):
        if kind == "anchors":
            ok = isinstance(item, list) and len(item) == 2 and all(map(_number, item))
            ok = ok and item[0] >= 1 and item[0] == int(item[0]) and item[1] > 0
            want = "[m, TFLOP/s] with m a whole number >= 1 and TFLOP/s > 0"
        else:
            shape = item[0] if isinstance(item, list) and item else None
            ok = isinstance(item, list) and len(item) in (3, 4) and isinstance(shape, list)
            ok = ok and len(shape) == 2 and all(_number(x) and x >= 1 for x in shape)
            ok = ok and all(_number(x) and x > 0 for x in item[1:3])
            want = "[[m, n], batch, ms] (optionally a source text after ms), all > 0"
        if not ok:
            raise _bad_rates(path, f"'{kind}'[{i}] is {item!r}, not {want}")
    for key in _NUMBERS:
        if key in data and not (_number(data[key]) and data[key] >= 0):
            raise _bad_rates(path, f"{key} is {data[key]!r}, not a number >= 0")
    memory = data.get("memory_gib")
    if memory is not None and not (_number(memory) and memory > 0):
        raise _bad_rates(path, f"memory_gib is {memory!r}, not a number > 0")
    if "device" in data and not isinstance(data["device"], str):
        raise _bad_rates(path, f"device is {data['device']!r}, not text")
    sources = data.get("sources", [])
    if not (isinstance(sources, list) and all(isinstance(x, str) for x in sources)):
        raise _bad_rates(path, f"sources is {sources!r}, not a list of text")


def predict_step_ms(shapes, rates: NSRates = H200, stack_bytes: int | None = None, ns=None):
    """``(NS ms, step ms)`` of one device's step over ``shapes`` (2-D matrices; a 3-D shape is
    an expert stack of per-expert matrices), bucketed by matrix shape as the step buckets."""
    if stack_bytes is None:
        stack_bytes = default_stack_bytes()
    buckets: dict[tuple[int, int], int] = {}
    elements = 0
    for shape in shapes:
        count = int(shape[0]) if len(shape) == 3 else 1
        key = (int(shape[-2]), int(shape[-1]))
        buckets[key] = buckets.get(key, 0) + count
        elements += count * key[0] * key[1]
    ns_ms = sum(rates.bucket_ms(k, c, stack_bytes, ns) for k, c in buckets.items())
    step = ns_ms + rates.elementwise_ms(elements) + (rates.start_ms if buckets else 0.0)
    return ns_ms, step


def default_stack_bytes() -> int:
    """``functional.DEFAULT_STACK_BYTES`` (the most fp32 bytes one batched NS call stacks)."""
    from dmuon_compile import functional

    return int(getattr(functional, "DEFAULT_STACK_BYTES", 4 << 30))
