"""Autotune the symmetric-product kernels against cuBLAS, per (op, shape, dtype, device).

For each new key the candidates of ``syrk.CANDIDATES`` and the plain cuBLAS product
(``torch.mm``/``addmm``/``baddbmm``) are timed on the GPU (``triton.testing.do_bench``,
median); a Triton candidate wins only if it beats cuBLAS by ``WIN_MARGIN`` and matches it
numerically, otherwise the verdict is ``"cublas"`` — so after autotune the op is never slower
than cuBLAS by more than the noise of the timing. Verdicts persist as JSON in
``$DMUON_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dmuon_compile`` or ``~/.cache/dmuon_compile``),
one file per device name. A corrupt file, or one written by another cache version / Triton /
torch, is ignored with a warning (and overwritten on the next verdict), never a crash.

The tuning inputs come from a private ``torch.Generator``: the training RNG is untouched. On
the first uncached key each rank prints ``[DMuon][rank=R/W] SYRK autotune ...`` progress lines
(``DMUON_SYRK_AUTOTUNE_LOG=0`` silences them). ``DMUON_SYRK_AUTOTUNE=0`` skips timing and uses
:func:`heuristic_choice` (so does a call made while a CUDA graph is being captured);
``DMUON_SYRK_AUTOTUNE=all`` times every candidate instead of the shortlist
(``syrk.candidates_for``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dmuon_compile import env
from dmuon_compile.log import progress

# 2: mirror; 3: 128×256 strips; 4: TMA; 5-7: TMA stores; 8: C by TMA; 9: Gluon; 10: Gluon also
# timed for sym_mm products without a C term; 11: Gluon also timed for plain SYRKs.
CACHE_VERSION = 11
CUBLAS = "cublas"
LOG_SWITCH = env.SYRK_AUTOTUNE_LOG
ENABLE_SWITCH = env.SYRK_AUTOTUNE
# A Triton candidate must be this much faster than cuBLAS to be chosen (timing noise ~1-2%).
WIN_MARGIN = 0.02
# The op's untimed rule (:func:`untimed_choice`): a launch needs about this many rows of output
# (m·√batch) to fill the chip with tiles (docs/architecture.md, Kernels).
UNTIMED_MIN_ROWS = 1024
HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR``, else ``$XDG_CACHE_HOME/dmuon_compile``, else
    ``~/.cache/dmuon_compile``.

    >>> isinstance(default_cache_dir(), Path)
    True
    """
    explicit = env.cache_dir()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dmuon_compile"


def cache_path(device_name: str) -> Path:
    """The verdict file of one device model, e.g. ``.../syrk_autotune_NVIDIA_H200.json``."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name).strip("_") or "device"
    return default_cache_dir() / f"syrk_autotune_{slug}.json"


def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - the kernels need triton anyway
        triton_version = "none"
    return {"version": CACHE_VERSION, "triton": triton_version, "torch": torch.__version__}


def make_key(op: str, a: torch.Tensor, has_c: bool) -> str:
    """Cache key: op, batch, m, k, dtype, whether ``c`` is used and the operand layout.

    >>> make_key("syrk", torch.empty(4, 8, dtype=torch.bfloat16), False)
    'syrk|b1|m4|k8|bfloat16|c0|row'
    """
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    layout = "row" if a.stride(-1) == 1 else ("col" if a.stride(-2) == 1 else "strided")
    dtype = str(a.dtype).replace("torch.", "")
    return f"{op}|b{batch}|m{m}|k{k}|{dtype}|c{int(has_c)}|{layout}"


class VerdictCache:
    """The JSON verdict file of one device plus its in-memory copy.

    ``get`` never touches the disk after the first load; ``put`` merges with what is on disk
    (other processes may have tuned other keys) and replaces the file atomically.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._verdicts: dict[str, dict] | None = None
        self._lock = threading.Lock()
        self._unwritable = False  # a write failed: warn once, keep verdicts in memory

    def _read_file(self, warn: bool) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("verdicts"), dict):
                raise ValueError("no 'verdicts' table")
        except (OSError, ValueError) as exc:
            if warn:
                warnings.warn(
                    f"dmuon_compile: ignoring the corrupt SYRK autotune cache {self.path} ({exc}); "
                    "shapes will be re-tuned and the file rewritten",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return {}
        expected = _versions()
        found = {key: data.get(key) for key in expected}
        if found != expected:
            if warn:
                warnings.warn(
                    f"dmuon_compile: ignoring the stale SYRK autotune cache {self.path} "
                    f"(written by {found}, this is {expected}); shapes will be re-tuned",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return {}
        return {
            str(k): v for k, v in data["verdicts"].items() if isinstance(v, dict) and "choice" in v
        }

    def get(self, key: str) -> dict | None:
        """The stored verdict for ``key`` (a dict with ``choice``), or ``None``."""
        if self._verdicts is None:
            with self._lock:
                if self._verdicts is None:
                    self._verdicts = self._read_file(warn=True)
        return self._verdicts.get(key)

    def put(self, key: str, verdict: dict) -> None:
        """Store ``verdict`` for ``key`` in memory and on disk (disk errors only warn)."""
        with self._lock:
            if self._verdicts is None:
                self._verdicts = self._read_file(warn=True)
            self._verdicts[key] = verdict
            merged = {**self._read_file(warn=False), **self._verdicts}
            payload = {**_versions(), "verdicts": merged}
            if self._unwritable:
                return  # warned once already; the verdicts stay in memory
            tmp = None
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=self.path.name, dir=self.path.parent)
                with os.fdopen(fd, "w") as handle:
                    json.dump(payload, handle, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
                tmp = None
            except OSError as exc:
                self._unwritable = True
                warnings.warn(
                    f"dmuon_compile: could not write the SYRK autotune cache {self.path} ({exc}); "
                    "verdicts stay in memory for this process. Fix: make the path a writable "
                    "file location, or point DMUON_CACHE_DIR at a writable directory",
                    RuntimeWarning,
                    stacklevel=2,
                )
            finally:
                if tmp is not None:  # never leave a half-written temporary file behind
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)


_CACHES: dict[str, VerdictCache] = {}
# Per-process fast path of the dispatch: (op, shape, strides, dtype, device, has_c) -> verdict.
RESOLVED: dict[tuple, object] = {}


def verdict_cache(device_name: str) -> VerdictCache:
    """The process-wide :class:`VerdictCache` of a device model (path read from the env once)."""
    path = cache_path(device_name)
    cache = _CACHES.get(str(path))
    if cache is None:
        cache = _CACHES[str(path)] = VerdictCache(path)
    return cache


def clear_memory_caches() -> None:
    """Forget the in-memory verdicts (tests; a new ``DMUON_CACHE_DIR`` is then honoured)."""
    _CACHES.clear()
    RESOLVED.clear()


def time_ms(fn: Callable[[], object]) -> float:
    """Median GPU time of ``fn`` in ms (``triton.testing.do_bench``; tests replace this)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tune(
    key: str,
    candidates: Sequence,
    run_candidate: Callable[[object], torch.Tensor],
    run_cublas: Callable[[], torch.Tensor],
    matches: Callable[[torch.Tensor, torch.Tensor], bool],
) -> dict:
    """Time every candidate and cuBLAS for ``key``; return the verdict dict.

    ``run_candidate(config)`` and ``run_cublas()`` compute the product on fixed tuning inputs;
    ``matches(candidate_out, cublas_out)`` rejects a candidate that computes something else.
    A candidate that fails to compile or launch is skipped with a progress line. The verdict
    is ``{"choice": "cublas" | config.name, "config": {...} | None, "cublas_ms": t,
    "timings_ms": {name: t}}``.
    """
    progress(
        f"SYRK autotune started for {key}: {len(candidates)} kernel candidates + cuBLAS", LOG_SWITCH
    )
    reference = run_cublas()
    cublas_ms = time_ms(run_cublas)
    timings: dict[str, float] = {}
    configs = {}
    for config in candidates:
        progress(f"SYRK autotune candidate started {config.name} for {key}", LOG_SWITCH)
        try:
            out = run_candidate(config)
            if not matches(out, reference):
                progress(
                    f"SYRK autotune candidate {config.name} rejected: result differs from cuBLAS",
                    LOG_SWITCH,
                )
                continue
            timings[config.name] = time_ms(lambda config=config: run_candidate(config))
            configs[config.name] = config
        except Exception as exc:  # a config that does not fit this GPU must not stop training
            progress(
                f"SYRK autotune candidate {config.name} failed: {type(exc).__name__}: {exc}",
                LOG_SWITCH,
            )
    verdict = {"choice": CUBLAS, "config": None, "cublas_ms": cublas_ms, "timings_ms": timings}
    if timings:
        best = min(timings, key=timings.get)
        if timings[best] < cublas_ms * (1.0 - WIN_MARGIN):
            verdict.update(choice=best, config=configs[best].to_dict())
    best_ms = timings.get(verdict["choice"], cublas_ms)
    progress(
        f"SYRK autotune verdict for {key}: {verdict['choice']} {best_ms:.4f} ms "
        f"(cuBLAS {cublas_ms:.4f} ms, {cublas_ms / max(best_ms, 1e-9):.2f}x)",
        LOG_SWITCH,
    )
    return verdict


def autotune_enabled() -> bool:
    """False when ``DMUON_SYRK_AUTOTUNE=0`` (the heuristic decides instead)."""
    return env.syrk_autotune()


def exhaustive() -> bool:
    """True when ``DMUON_SYRK_AUTOTUNE=all``: time every candidate, not the shortlist."""
    return env.syrk_autotune_all()


def untimed_choice(m: int, batch: int, dtype: torch.dtype) -> tuple[bool, str]:
    """``(Triton?, why)`` for a product the op does not time (rule 2 of
    :func:`dmuon_compile.kernel_choice.choose_kernel`, ``site="op"``, which asks this function:
    the rule lives here, with the op, because the kernels import nothing above them).

    Triton for fp16/bf16 with at least ``UNTIMED_MIN_ROWS`` rows of output per launch
    (m·√batch); fp32/fp64 and smaller launches run cuBLAS.

    >>> untimed_choice(512, 4, torch.bfloat16)[0], untimed_choice(512, 1, torch.bfloat16)[0]
    (True, False)
    """
    if dtype not in HALF_DTYPES:
        return False, f"untimed: {dtype} runs cuBLAS"
    if m * max(batch, 1) ** 0.5 < UNTIMED_MIN_ROWS:
        return False, f"untimed: {batch}×{m}×{m} has too few tiles"
    return True, f"untimed: {batch}×{m}×{m} {dtype} fills the chip"


def heuristic_choice(m: int, batch: int, dtype: torch.dtype, default_config) -> object:
    """Untimed choice: ``default_config`` where :func:`untimed_choice` picks Triton — half
    precision with ≥ 1024 rows of output per launch (m·√batch) — else ``"cublas"``.
    """
    return default_config if untimed_choice(m, batch, dtype)[0] else CUBLAS
