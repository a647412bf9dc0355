"""The pointer-load symmetric-product kernel: ``alpha·A·B + beta·C + gamma·I``, lower tiles only.

Operand tiles are loaded through pointers with any strides, so this kernel runs every layout
(and every GPU the Triton kernels support); TMA configurations fall back to it for layouts TMA
cannot address. Its schedule and epilogue are ``lower_tiles.py``'s. Compile-time switches
(each value is its own compiled variant; Triton's cache keys binaries on them):

- ``B_FROM_A``: True for SYRK (``B = Aᵀ``: the column tile's operand is read from the *rows* of
  ``A``, K-contiguous like the row tile, then transposed in registers); False for ``sym_mm``,
  where ``B`` is read as a general ``(k, m)`` operand through its strides (no symmetry of ``B``
  is assumed, only that the *product* is symmetric).
- ``HAS_C``: whether the ``beta·C`` term is loaded at all.
- ``EVEN_K``: ``k`` is a multiple of ``BLOCK_K``, so the K loads need no mask.
- ``DOT_IN_FP32``: upcast tiles before ``tl.dot``; only for bf16 under ``TRITON_INTERPRET=1``
  on CPU, whose ``tl.dot`` multiplies bf16 bit patterns (numpy has no bf16).
- ``BLOCK_M``/``BLOCK_N``/``BLOCK_K``/``INPUT_PRECISION`` and the launch's ``num_warps``/
  ``num_stages``: the tile configuration the autotuner (``autotune.py``) picks per shape.
  ``BLOCK_N`` is ``BLOCK_M`` (square tiles) or a multiple of it (e.g. 128×256, the shape that
  keeps Hopper's tensor cores busiest per byte of operands loaded).
"""

from __future__ import annotations

import triton
import triton.language as tl
from dmuon_compile.kernels.lower_tiles import (
    TileConfig,
    _lower_tile_coords,
    _store_symmetric_tile,
    epilogue_operand,
    lower_tile_count,
    persistent_programs,
    product_metadata,
    stack_strides,
    tile_constexprs,
)
from torch import Tensor


def _pointer_launch_metadata(grid, metadata, args) -> dict:
    """Profiler name, FLOPs and bytes of one launch (``lower_tiles.product_metadata``)."""
    return product_metadata(
        "ptr",
        syrk=bool(args["B_FROM_A"]),
        batch=args["batch"],
        m=args["m"],
        k=args["k"],
        operand_size=args["a_ptr"].element_size(),
        c_size=args["c_ptr"].element_size() if args["HAS_C"] else 0,
        out_size=args["out_ptr"].element_size(),
        tile=(args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]),
    )


# Stack size and grid size take any value: specialising on them (Triton keys ints on ==1 and
# %16) would compile a stack of 8 apart from one of 16, a cold compile's biggest cost.
@triton.jit(launch_metadata=_pointer_launch_metadata, do_not_specialize=["batch", "num_programs"])
def _symmetric_product_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    batch,
    m,
    k,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    gamma,
    num_programs,
    B_FROM_A: tl.constexpr,
    HAS_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # The lower triangle is walked in square BLOCK_N super-tiles; each is cut into
    # STRIPS = BLOCK_N / BLOCK_M row strips of BLOCK_M × BLOCK_N, one program tile each.
    STRIPS: tl.constexpr = BLOCK_N // BLOCK_M
    pid = tl.program_id(0)
    tiles_per_side = tl.cdiv(m, BLOCK_N)
    tiles_per_matrix = tiles_per_side * (tiles_per_side + 1) // 2 * STRIPS
    total_tiles = batch * tiles_per_matrix
    k_steps = tl.cdiv(k, BLOCK_K)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, total_tiles, num_programs):
        batch_index = tile // tiles_per_matrix
        t = tile - batch_index * tiles_per_matrix
        row, col = _lower_tile_coords(t // STRIPS)
        strip = t % STRIPS

        batch64 = batch_index.to(tl.int64)
        offs_m = row * BLOCK_N + strip * BLOCK_M + arange_m
        offs_n = col * BLOCK_N + arange_n
        # Rows past m read a valid row (wrapped) instead of masking every load; never stored.
        safe_m = offs_m % m
        safe_n = offs_n % m
        a_rows = (
            a_ptr + batch64 * stride_ab + safe_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        )
        if B_FROM_A:
            b_cols = (
                a_ptr
                + batch64 * stride_ab
                + safe_n[:, None] * stride_am
                + offs_k[None, :] * stride_ak
            )
        else:
            b_cols = (
                b_ptr
                + batch64 * stride_bb
                + offs_k[:, None] * stride_bk
                + safe_n[None, :] * stride_bn
            )

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(0, k_steps):
            if EVEN_K:
                a_tile = tl.load(a_rows)
                if B_FROM_A:
                    b_tile = tl.trans(tl.load(b_cols))
                else:
                    b_tile = tl.load(b_cols)
            else:
                k_left = k - ks * BLOCK_K
                a_tile = tl.load(a_rows, mask=offs_k[None, :] < k_left, other=0.0)
                if B_FROM_A:
                    b_tile = tl.trans(tl.load(b_cols, mask=offs_k[None, :] < k_left, other=0.0))
                else:
                    b_tile = tl.load(b_cols, mask=offs_k[:, None] < k_left, other=0.0)
            if DOT_IN_FP32:
                a_tile = a_tile.to(tl.float32)
                b_tile = b_tile.to(tl.float32)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=INPUT_PRECISION)
            a_rows += BLOCK_K * stride_ak
            if B_FROM_A:
                b_cols += BLOCK_K * stride_ak
            else:
                b_cols += BLOCK_K * stride_bk

        _store_symmetric_tile(
            acc,
            offs_m,
            offs_n,
            batch64,
            m,
            c_ptr,
            (stride_cb, stride_cm, stride_cn),
            out_ptr,
            (stride_ob, stride_om, stride_on),
            (alpha, beta, gamma),
            HAS_C,
        )


def launch_pointer_kernel(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    config: TileConfig,
    num_sms: int,
    out: Tensor,
) -> Tensor:
    """Launch :func:`_symmetric_product_kernel` into ``out`` (checked, non-empty: see
    ``symmetric_product.launch_symmetric_product``); returns ``out``."""
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    num_programs = persistent_programs(lower_tile_count(m, batch, config), num_sms, config)
    c_arg, (scb, scm, scn) = epilogue_operand(c, out)
    sob, som, son = stack_strides(out)
    b_arg = a if b is None else b
    sab, sam, sak = stack_strides(a)
    sbb, sbk, sbn = stack_strides(b_arg) if b is not None else (0, 0, 0)
    _symmetric_product_kernel[(num_programs,)](
        a,
        b_arg,
        c_arg,
        out,
        batch,
        m,
        k,
        sab,
        sam,
        sak,
        sbb,
        sbk,
        sbn,
        scb,
        scm,
        scn,
        sob,
        som,
        son,
        float(alpha),
        float(beta),
        float(gamma),
        num_programs,
        B_FROM_A=b is None,
        EVEN_K=k % config.block_k == 0,
        **tile_constexprs(a, c, beta, config),
    )
    return out
