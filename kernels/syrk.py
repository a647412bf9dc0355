"""CUDA implementation of ``torch.ops.dmuon.syrk`` / ``sym_mm``: Triton kernels or cuBLAS.

Importing this module registers :func:`syrk_cuda` and :func:`sym_mm_cuda` as the CUDA kernels
of the custom ops defined in ``ops.py`` (``torch.library.register_kernel``); every other device
keeps the torch reference. Per call:

1. fp16/bf16/fp32 inputs on an SM80+ GPU ask :mod:`autotune` for the verdict of their
   (op, shape, dtype, layout, device) key — tuned once, then cached in memory and on disk;
2. the verdict is a :class:`TileConfig` (Triton kernels of ``symmetric_product.py``: lower tiles
   only, mirrored, persistent, one launch per stack) or ``"cublas"``;
3. ``"cublas"`` (and fp64, older GPUs) runs ``torch.mm``/``addmm``/``baddbmm``, adds
   ``gamma·I`` and mirrors the lower triangle so the result is exactly symmetric like the
   kernel's.

The rectangular products of NS (Q·X, a·X + B·X) stay on cuBLAS (``TorchPrimitives``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from dmuon_compile.kernels import autotune
from dmuon_compile.kernels.availability import triton_status
from dmuon_compile.kernels.lower_tiles import TileConfig
from dmuon_compile.kernels.mirror import mirror_lower_inplace
from dmuon_compile.kernels.ops import _check_operands
from dmuon_compile.kernels.symmetric_product import launch_symmetric_product
from dmuon_compile.kernels.syrk_tma import tma_descriptors
from torch import Tensor

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The autotune list, chosen with benchmarks/sweep_tiles.py in fp16: every entry wins at least
# one NS product class.
# - TMA loads with off-diagonal tiles stored through output descriptors ("_st"): the epilogue
#   was the bottleneck of the Gram-space products (k = m), square and stacked.
# - 128×256 strips through TMA with the balanced two-strip schedule: the largest matrices.
#   Stored through descriptors in one piece these tiles do not fit shared memory, so the
#   kernel stores strips in two square halves; with 3 stages they are the fastest wide SYRK.
# - Pointer loads: for layouts TMA cannot address (unaligned rows, strided stacks).
# Left out: 256² tiles (too many registers per thread at 16 warps, accumulator spills at 8),
# 128×128×128 TMA tiles with 2 stages (slower than cuBLAS), and flattening the persistent
# loop (no measurable change).
CANDIDATES: tuple[TileConfig, ...] = (
    TileConfig(128, 64, 8, 4, 1),
    TileConfig(128, 64, 4, 3, 2),
    TileConfig(64, 64, 4, 4, 2),
    TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True),
    TileConfig(128, 64, 4, 3, 2, tma=True, tma_store=True),
    TileConfig(64, 64, 4, 4, 2, tma=True, tma_store=True),
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True),
    TileConfig(128, 64, 8, 4, 1, block_n=256, tma=True),
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True),
)
DEFAULT_CONFIG = CANDIDATES[0]
# The untimed choice where TMA can read the operands: the most frequent autotune winner.
DEFAULT_TMA_CONFIG = TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True)
# What autotune times by default where TMA can read the operands: the benchmark models' verdicts
# all go to one of these two, and timing the full list costs a Triton compile per candidate and
# layout, most of a cold first step; ``DMUON_SYRK_AUTOTUNE=all`` times every candidate.
SHORTLIST: tuple[TileConfig, ...] = (
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True),
    DEFAULT_TMA_CONFIG,
)


# The Gluon kernel's configuration the autotune times beside the Triton candidates, for the
# Gram-space products (sym_mm, with or without C) and products with a beta·C term, where the
# warp-specialised kernel beats the best Triton candidate. Plain SYRKs (X·Xᵀ, k ≠ m) leave it
# out: there the Triton strips win, and each candidate is a compile of a cold first step.
GLUON_SHORTLIST_FIELDS: tuple[dict, ...] = (
    {"split": 1, "stages": 4},
    {"split": 2, "block_k": 32, "stages": 4, "c_slots": 1, "wide": True},
    {"split": 2, "block_k": 64, "stages": 2, "c_slots": 1, "wide": True},
)
# The wide (128×256) entries are timed on matrices of at least this many rows: they won on the
# 4096-row Gram products (model M's step, benchmarks/RESULTS.md §32) and were not seen to win
# below, where each would be two more compiles of a cold first step.
GLUON_WIDE_MIN_ROWS = 4096
# The Gluon configurations timed for plain SYRKs (X·Xᵀ, no C): the ping-pong of two 4-warp
# consumers with a 4-deep operand ring (it fits shared memory only without C), which beats
# cuBLAS and every Triton candidate on the expert stacks' X·Xᵀ (512×768×2048,
# benchmarks/RESULTS.md §22); the autotune keeps the Triton strips where they win (§13).
GLUON_SYRK_SHORTLIST_FIELDS: tuple[dict, ...] = (
    {"split": 1, "stages": 4, "consumers": 2, "num_warps": 4},
)


def gluon_candidates(a: Tensor, b: Tensor | None, c: Tensor | None) -> tuple:
    """The Gluon configurations worth timing for these operands: ``GLUON_SHORTLIST_FIELDS`` (its
    wide tiles from ``GLUON_WIDE_MIN_ROWS`` rows), or for a plain SYRK (no ``b``, no ``beta·C``)
    ``GLUON_SYRK_SHORTLIST_FIELDS``; none on anything
    but SM90, on layouts the Gluon kernel cannot read, or without Gluon in this Triton; a
    configuration whose shared memory would not fit these operands' dtypes is left out."""
    shortlist = GLUON_SYRK_SHORTLIST_FIELDS if b is None and c is None else GLUON_SHORTLIST_FIELDS
    if not shortlist or not a.is_cuda:
        return ()
    try:
        from dmuon_compile.kernels.syrk_gluon import SMEM_LIMIT, GluonConfig, gluon_supported
    except ImportError:  # a Triton without triton.experimental.gluon
        return ()
    if not gluon_supported(a, b, c):
        return ()
    size, c_size = a.element_size(), None if c is None else c.element_size()
    rows = a.shape[-2]
    configs = (
        GluonConfig(**fields)
        for fields in shortlist
        if not fields.get("wide") or rows >= GLUON_WIDE_MIN_ROWS
    )
    return tuple(cfg for cfg in configs if cfg.smem_bytes(size, c_size, size) <= SMEM_LIMIT)


def config_from_dict(data: dict):
    """The :class:`TileConfig` or ``GluonConfig`` an autotune verdict names."""
    if not isinstance(data, dict):
        raise TypeError(f"a verdict's config must be a dict, got {type(data).__name__}")
    if data.get("kernel") == "gluon":
        from dmuon_compile.kernels.syrk_gluon import GluonConfig

        return GluonConfig.from_dict(data)
    return TileConfig.from_dict(data)


def launch_config(a, b, c, alpha: float, beta: float, gamma: float, config) -> Tensor:
    """Run one verdict's kernel: the Triton kernels of ``symmetric_product.py`` for a
    :class:`TileConfig`, the Gluon kernel for a ``GluonConfig``."""
    if config.kernel == "gluon":
        from dmuon_compile.kernels.syrk_gluon import launch_gluon_kernel

        return launch_gluon_kernel(a, b, c, alpha, beta, gamma, config=config)
    return launch_symmetric_product(a, b, c, alpha, beta, gamma, config)


def default_config_for(a: Tensor, b: Tensor | None) -> TileConfig:
    """The tile used without timing (``DMUON_SYRK_AUTOTUNE=0``, or inside a CUDA graph capture)."""
    return (
        DEFAULT_TMA_CONFIG
        if tma_descriptors(a, b, DEFAULT_TMA_CONFIG) is not None
        else DEFAULT_CONFIG
    )


def candidates_for(
    m: int, a: Tensor | None = None, b: Tensor | None = None, has_c: bool = False
) -> tuple[TileConfig, ...]:
    """Candidates worth timing for an ``m×m`` output (no tile much larger than the matrix).

    With the operands given, TMA configurations whose descriptors cannot read them are left
    out (they would only time the pointer kernel again), and where TMA can read them only the
    :data:`SHORTLIST` is timed (every candidate with ``DMUON_SYRK_AUTOTUNE=all``). With a
    ``beta·C`` term (``has_c``), each TMA candidate is also timed with C read by TMA
    (``c_load="prologue"``, and ``"tma"`` for the configs with TMA stores): no way of reading C
    wins everywhere.
    """
    fitting = tuple(c for c in CANDIDATES if c.cols <= max(64, 2 * m))
    if a is not None:
        fitting = tuple(c for c in fitting if not c.tma or tma_descriptors(a, b, c) is not None)
        short = tuple(c for c in fitting if c in SHORTLIST)
        if short and not autotune.exhaustive():
            fitting = short
    fitting = fitting or (DEFAULT_CONFIG,)
    if has_c:
        fitting += tuple(
            replace(c, c_load=load)
            for load in ("prologue", "tma")
            for c in fitting
            if c.tma and (c.tma_store or load == "prologue")
        )
    return fitting


def mirror_lower_triangle(p: Tensor) -> Tensor:
    """``p`` made exactly symmetric from its lower triangle (in place on CUDA, a copy elsewhere)."""
    if p.is_cuda and p.is_contiguous():
        return mirror_lower_inplace(p)
    m = p.shape[-1]
    idx = torch.arange(m, device=p.device)
    lower = idx[:, None] >= idx[None, :]
    return torch.where(lower, p, p.mT).contiguous()


def symmetric_product_cublas(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    mirror: bool = True,
) -> Tensor:
    """``alpha·a·b + beta·c + gamma·I`` (``b=None``: ``a·aᵀ``) with cuBLAS, mirrored lower triangle.

    ``mirror=False`` gives the bare cuBLAS product (what the autotuner times Triton against).

    >>> symmetric_product_cublas(torch.ones(2, 3), None, None, 1.0, 0.0, 1.0)
    tensor([[4., 3.],
            [3., 4.]])
    """
    bt = a.mT if b is None else b
    if c is not None and beta != 0.0:
        c = c.to(a.dtype)
        if a.dim() == 2:
            p = torch.addmm(c, a, bt, beta=beta, alpha=alpha)
        else:
            p = torch.baddbmm(c, a, bt, beta=beta, alpha=alpha)
    else:
        p = a @ bt
        if alpha != 1.0:
            p = p.mul_(alpha)
    if gamma != 0.0:
        p.diagonal(dim1=-2, dim2=-1).add_(gamma)
    return mirror_lower_triangle(p) if mirror else p


def _tuning_inputs(
    a: Tensor, b: Tensor | None, c: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Random inputs with the shapes, dtype and layouts of the call, from a private generator.

    For ``sym_mm`` the tuning ``b`` is ``aᵀ`` so its product is symmetric, as the op requires.
    """
    gen = torch.Generator(device=a.device)
    gen.manual_seed(20240607)
    k = a.shape[-1]

    def random_like(t: Tensor, scale: float) -> Tensor:
        values = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32) * scale
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return out.copy_(values)

    a_tune = random_like(a, max(k, 1) ** -0.25)
    b_tune = None
    if b is not None:
        b_tune = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=b.device).copy_(
            a_tune.mT
        )
    c_tune = None if c is None else random_like(c, 1.0)
    return a_tune, b_tune, c_tune


def candidate_matches(out: Tensor, reference: Tensor) -> bool:
    """A candidate's product is right: its lower triangle agrees with cuBLAS's to
    half-precision accuracy (relative Frobenius error < 2e-2), and the whole output is exactly
    symmetric (every kernel mirrors the triangle it computes: a wrong mirror shows here)."""
    diff = torch.tril(out.float() - reference.float())
    scale = torch.linalg.vector_norm(torch.tril(reference.float())) + 1e-6
    return (
        bool(torch.isfinite(out).all())
        and float(torch.linalg.vector_norm(diff) / scale) < 2e-2
        and torch.equal(out, out.mT)
    )


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def tuned_choice(op: str, a: Tensor, b: Tensor | None, c: Tensor | None, beta: float):
    """The cached or freshly tuned verdict for this call: a :class:`TileConfig` or ``"cublas"``.

    A shape seen before costs one dict lookup (``autotune.RESOLVED``); NS calls these ops ~16
    times per matrix, so the per-call path must stay short.
    """
    has_c = c is not None and beta != 0.0
    # The operands' strides are in the key: a Gluon verdict holds only for the layouts the Gluon
    # kernel reads, checked once per key here rather than on every call.
    fast_key = (
        op,
        a.shape,
        a.stride(),
        None if b is None else b.stride(),
        c.stride() if has_c else None,
        a.dtype,
        a.device,
        has_c,
    )
    choice = autotune.RESOLVED.get(fast_key)
    if choice is None:
        choice, final = _tuned_choice_slow(op, a, b, c if has_c else None)
        if choice != autotune.CUBLAS and choice.kernel == "gluon":
            if not gluon_candidates(a, b, c if has_c else None):
                choice = default_config_for(a, b)  # a layout the verdict's key did not promise
        if final:
            autotune.RESOLVED[fast_key] = choice
    return choice


_VALID_WARPS = (1, 2, 4, 8, 16)


def _valid_verdict(key: str, verdict: dict, path) -> bool:
    """A cached verdict names cuBLAS, or a config this version can build whose name it is."""
    import warnings

    if verdict.get("choice") == autotune.CUBLAS:
        return True
    try:
        config = config_from_dict(verdict["config"])
        if config.kernel == "gluon":
            return config.name == verdict["choice"]
        sane = (
            config.name == verdict["choice"]
            and all(v > 0 and v & (v - 1) == 0 for v in (config.block, config.block_k, config.cols))
            and config.block <= 512
            and config.num_warps in _VALID_WARPS
            and 1 <= config.num_stages <= 8
            and 1 <= config.ctas_per_sm <= 8
        )
    except (KeyError, TypeError, ValueError) as exc:
        sane, why = False, f"{type(exc).__name__}: {exc}"
    else:
        why = f"config {verdict.get('config')!r} for choice {verdict.get('choice')!r}"
    if not sane:
        warnings.warn(
            f"dmuon_compile: ignoring the SYRK autotune verdict for {key} in {path} ({why}); "
            "the shape is re-tuned and the entry rewritten",
            RuntimeWarning,
            stacklevel=3,
        )
    return sane


def _tuned_choice_slow(op: str, a: Tensor, b: Tensor | None, c: Tensor | None):
    """(verdict, whether it may be memoised) from the disk cache, a fresh tuning or the
    heuristic."""
    has_c = c is not None
    key = autotune.make_key(op, a, has_c)
    cache = autotune.verdict_cache(_device_name(a.device.index))
    verdict = cache.get(key)
    if verdict is not None and not _valid_verdict(key, verdict, cache.path):
        verdict = None  # re-tuned below, and the file's entry replaced
    if verdict is None:
        m, batch = a.shape[-2], (a.shape[0] if a.dim() == 3 else 1)
        if not autotune.autotune_enabled():
            return autotune.heuristic_choice(m, batch, a.dtype, default_config_for(a, b)), True
        if torch.cuda.is_current_stream_capturing():  # no timing inside a graph capture
            return autotune.heuristic_choice(m, batch, a.dtype, default_config_for(a, b)), False
        a_t, b_t, c_t = _tuning_inputs(a, b, c)
        verdict = autotune.tune(
            key,
            candidates_for(m, a_t, b_t, has_c=c_t is not None) + gluon_candidates(a_t, b_t, c_t),
            lambda config: launch_config(a_t, b_t, c_t, 1.0, 0.5, 0.0, config),
            lambda: symmetric_product_cublas(a_t, b_t, c_t, 1.0, 0.5, 0.0, mirror=False),
            candidate_matches,
        )
        cache.put(key, verdict)
    if verdict["choice"] == autotune.CUBLAS or not verdict.get("config"):
        return autotune.CUBLAS, True
    return config_from_dict(verdict["config"]), True


def _row_or_column_major(t: Tensor) -> Tensor:
    """``t`` itself if each matrix is row- or column-major (dense), else a contiguous copy."""
    if t.is_contiguous() or t.mT.is_contiguous():
        return t
    return t.contiguous()


def _symmetric_product_cuda(
    op: str, a: Tensor, b: Tensor | None, c: Tensor | None, alpha: float, beta: float, gamma: float
) -> Tensor:
    a = _row_or_column_major(a)
    b = None if b is None else _row_or_column_major(b)
    usable = (
        a.dtype in TRITON_DTYPES
        and (b is None or b.dtype == a.dtype)
        and triton_status(a.device.index)[0]
    )
    choice = tuned_choice(op, a, b, c, beta) if usable and a.numel() > 0 else autotune.CUBLAS
    if choice == autotune.CUBLAS:
        return symmetric_product_cublas(a, b, c, alpha, beta, gamma).to(a.dtype)
    return launch_config(a, b, c, alpha, beta, gamma, choice)


def syrk_cuda(x: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float) -> Tensor:
    """CUDA kernel of ``dmuon::syrk``: autotuned Triton SYRK or cuBLAS ``x·xᵀ``, mirrored."""
    _check_operands("syrk", x, None, c)
    return _symmetric_product_cuda("syrk", x, None, c, alpha, beta, gamma)


def sym_mm_cuda(
    a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float
) -> Tensor:
    """CUDA kernel of ``dmuon::sym_mm``: autotuned Triton (lower tiles of a·b) or cuBLAS,
    mirrored."""
    _check_operands("sym_mm", a, b, c)
    if a.shape[-2] != b.shape[-1]:
        raise ValueError(
            "dmuon::sym_mm: a·b must be square to be symmetric, "
            f"got {tuple(a.shape)}·{tuple(b.shape)}"
        )
    return _symmetric_product_cuda("sym_mm", a, b, c, alpha, beta, gamma)


torch.library.register_kernel("dmuon::syrk", "cuda", syrk_cuda)
torch.library.register_kernel("dmuon::sym_mm", "cuda", sym_mm_cuda)
