"""Triton kernel family for symmetric products ``alpha·A·B + beta·C + gamma·I`` (lower tiles only).

One kernel body, specialised at compile time by ``tl.constexpr`` switches instead of rendered
source files (the "template" is this function; each switch value is its own compiled variant):

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

Why constexpr variants and not rendered files: the variants differ only in branches Triton
removes at compile time, one readable source is easier to test through ``TRITON_INTERPRET=1``
than a renderer, and Triton's own cache already keys compiled binaries on the constexpr values.

Schedule. Only the ``T·(T+1)/2`` lower-triangle super-tiles of each ``m×m`` output
(``T = ⌈m/BLOCK_N⌉``, each ``BLOCK_N`` square) are computed, each as ``BLOCK_N/BLOCK_M`` row
strips of ``BLOCK_M × BLOCK_N`` (one program tile each; on a diagonal super-tile the part of a
strip above the diagonal is computed but not stored). A *persistent* grid of
``min(tiles, SMs·ctas_per_sm)`` programs walks the flat index
``tile = batch_index·tiles_per_matrix + t``; ``t // strips`` maps to the super-tile
``(row, col)`` with ``col ≤ row`` by the square-root formula ``row = ⌊(√(8t+1) − 1)/2⌋``
(corrected by one where fp32 rounding lands on the wrong side), ``col = t − row·(row+1)/2``.
A stack of same-shape matrices is one launch: batching is what fills the chip for small ``m``.

Epilogue (fp32): ``acc·alpha + beta·C + gamma·I``; each element ``(i, j)`` of a tile with
``i ≥ j`` is written in place, and with ``i > j`` also mirrored to ``(j, i)``. Every lower
element lies in exactly one strip, so every output element comes from exactly one fp32 value
and the result is bitwise symmetric — the same rule as the reference in ``ops.py``.

Two kernels share the schedule idea and the epilogue: ``_symmetric_product_kernel`` loads
operand tiles through pointers (any strides), ``_symmetric_product_tma_kernel`` through TMA
descriptors (SM90+, 16-byte aligned row- or column-major operands; ``TileConfig(tma=True)``).
The TMA kernel also has the balanced two-strip schedule (see its comment) and, with
``tma_store=True``, stores tiles strictly below the diagonal through output descriptors, which
was the largest single gain measured on H200 (benchmarks/RESULTS.md §1).

This module imports only triton and torch and registers nothing, so a test can load a second,
interpreted copy of it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class TileConfig:
    """One tile configuration of the symmetric-product kernel.

    >>> TileConfig(128, 64, 8, 3).name
    'b128_k64_w8_s3_p1'
    """

    block: int  # rows of a program's tile (BLOCK_M)
    block_k: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1
    block_n: int = 0  # columns of the tile (BLOCK_N); 0 means square (= block)
    tma: bool = False  # operand tiles through TMA descriptors (SM90+, aligned row-major operands)
    flatten: bool = False  # TMA kernel only: one flattened tile×K loop, pipelined across tiles
    tma_store: bool = False  # TMA kernel only: off-diagonal tiles stored through output descriptors

    def __post_init__(self) -> None:
        if self.block_n and self.block_n % self.block:
            raise ValueError(
                f"TileConfig: block_n={self.block_n} must be a multiple of block={self.block}"
            )
        if (self.flatten or self.tma_store) and not self.tma:
            raise ValueError(
                "TileConfig: flatten=True and tma_store=True belong to the TMA kernel; "
                "set tma=True too"
            )

    @property
    def cols(self) -> int:
        return self.block_n or self.block

    @property
    def name(self) -> str:
        shape = f"b{self.block}" if self.cols == self.block else f"b{self.block}x{self.cols}"
        loads = (
            ("_tma" + ("_flat" if self.flatten else "") + ("_st" if self.tma_store else ""))
            if self.tma
            else ""
        )
        return (
            f"{shape}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"
            f"_p{self.ctas_per_sm}{loads}"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TileConfig:
        fields = {
            k: int(data[k]) for k in ("block", "block_k", "num_warps", "num_stages", "ctas_per_sm")
        }
        return cls(
            **fields,
            block_n=int(data.get("block_n", 0)),
            tma=bool(data.get("tma", False)),
            flatten=bool(data.get("flatten", False)),
            tma_store=bool(data.get("tma_store", False)),
        )


@triton.jit
def _lower_tile_coords(t):
    """Triangular tile index ``t`` -> ``(row, col)`` with ``col <= row`` (square-root formula)."""
    row = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    # fp32 rounding of the square root can land one off on either side: correct it.
    row = tl.where((row + 1) * (row + 2) // 2 <= t, row + 1, row)
    row = tl.where(row * (row + 1) // 2 > t, row - 1, row)
    col = t - row * (row + 1) // 2
    return row, col


@triton.jit
def _mirror_lower_kernel(p_ptr, m, stride_b, stride_m, stride_n, BLOCK: tl.constexpr):
    # One program per lower tile (batch-major); copies the strict lower triangle onto the upper
    # one in place. Reads only i > j and writes only j < i positions, so programs never race.
    pid = tl.program_id(0)
    tiles_per_side = tl.cdiv(m, BLOCK)
    tiles_per_matrix = tiles_per_side * (tiles_per_side + 1) // 2
    batch_index = pid // tiles_per_matrix
    row, col = _lower_tile_coords(pid - batch_index * tiles_per_matrix)
    offs_m = row * BLOCK + tl.arange(0, BLOCK)
    offs_n = col * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < m) & (offs_m[:, None] > offs_n[None, :])
    base = p_ptr + batch_index.to(tl.int64) * stride_b
    values = tl.load(base + offs_m[:, None] * stride_m + offs_n[None, :] * stride_n, mask=mask)
    tl.store(base + offs_m[:, None] * stride_n + offs_n[None, :] * stride_m, values, mask=mask)


def mirror_lower_inplace(p: Tensor, block: int = 64) -> Tensor:
    """Overwrite the strict upper triangle of each ``m×m`` matrix of ``p`` with its lower one.

    One Triton launch, half a matrix read and half written (a torch ``where(tril, p, p.mT)``
    reads two and writes one). Returns ``p``, now exactly symmetric.
    """
    if p.dim() not in (2, 3) or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"mirror_lower_inplace: expected square matrices, got {tuple(p.shape)}")
    m = p.shape[-1]
    batch = p.shape[0] if p.dim() == 3 else 1
    if p.numel() == 0:
        return p
    tiles_per_side = triton.cdiv(m, block)
    grid = (batch * tiles_per_side * (tiles_per_side + 1) // 2,)
    sb, sm, sn = _stack_strides(p)
    _mirror_lower_kernel[grid](p, m, sb, sm, sn, BLOCK=block, num_warps=4)
    return p


@triton.jit
def _store_symmetric_tile(
    acc,
    offs_m,
    offs_n,
    batch64,
    m,
    c_ptr,
    stride_cb,
    stride_cm,
    stride_cn,
    out_ptr,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    gamma,
    HAS_C: tl.constexpr,
):
    """fp32 epilogue ``alpha·acc + beta·C + gamma·I`` of one tile, stored with its mirror."""
    value = _epilogue_value(
        acc,
        offs_m,
        offs_n,
        batch64,
        m,
        c_ptr,
        stride_cb,
        stride_cm,
        stride_cn,
        alpha,
        beta,
        gamma,
        out_ptr.dtype.element_ty,
        HAS_C,
    )
    in_bounds = (offs_m[:, None] < m) & (offs_n[None, :] < m)

    # Element rule, the same for every tile: (i, j) with i >= j is stored in place, and
    # i > j also at (j, i). Off the diagonal super-tiles every element qualifies; on them
    # the upper part of a strip was computed but is never stored.
    out_base = out_ptr + batch64 * stride_ob
    lower_mask = in_bounds & (offs_m[:, None] >= offs_n[None, :])
    tl.store(
        out_base + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, value, mask=lower_mask
    )
    # The mirror is stored as the transposed tile, indexed (n, m), so consecutive lanes
    # write consecutive addresses (the transpose goes through shared memory) instead of
    # one element per output row.
    mirror_mask = (
        (offs_n[:, None] < m) & (offs_m[None, :] < m) & (offs_m[None, :] > offs_n[:, None])
    )
    tl.store(
        out_base + offs_n[:, None] * stride_om + offs_m[None, :] * stride_on,
        tl.trans(value),
        mask=mirror_mask,
    )


@triton.jit
def _epilogue_value(
    acc,
    offs_m,
    offs_n,
    batch64,
    m,
    c_ptr,
    stride_cb,
    stride_cm,
    stride_cn,
    alpha,
    beta,
    gamma,
    OUT_DTYPE: tl.constexpr,
    HAS_C: tl.constexpr,
):
    """``alpha·acc + beta·C + gamma·I`` in fp32, rounded once to the output dtype."""
    in_bounds = (offs_m[:, None] < m) & (offs_n[None, :] < m)
    acc = acc * alpha
    if HAS_C:
        c_tile = tl.load(
            c_ptr + batch64 * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            mask=in_bounds,
            other=0.0,
        )
        acc += beta * c_tile.to(tl.float32)
    acc += tl.where(offs_m[:, None] == offs_n[None, :], gamma, 0.0)
    return acc.to(OUT_DTYPE)


@triton.jit
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
            stride_cb,
            stride_cm,
            stride_cn,
            out_ptr,
            stride_ob,
            stride_om,
            stride_on,
            alpha,
            beta,
            gamma,
            HAS_C,
        )


@triton.jit
def _tma_tile(
    a_desc,
    b_desc,
    c_ptr,
    out_ptr,
    out_desc,
    out_t_desc,
    batch_index,
    first_m,
    first_n,
    m,
    k,
    stride_cb,
    stride_cm,
    stride_cn,
    stride_ob,
    stride_om,
    stride_on,
    alpha,
    beta,
    gamma,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_ROWS_ARE_M: tl.constexpr,
    B_ROWS_ARE_N: tl.constexpr,
    HAS_C: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """One ROWS × COLS output tile at (first_m, first_n) of matrix ``batch_index``: TMA loads,
    dot, epilogue.

    With TMA_STORE, a tile entirely below the diagonal (every element stored, in place and
    mirrored) is written through the (batch, m, m) output descriptors: TMA clips rows and
    columns past m, so no mask is needed. Tiles that touch the diagonal keep masked stores.
    """
    acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    for ks in range(0, tl.cdiv(k, BLOCK_K)):
        k0 = ks * BLOCK_K
        if A_ROWS_ARE_M:
            a_tile = a_desc.load([batch_index * m + first_m, k0])
        else:
            a_tile = tl.trans(a_desc.load([batch_index * k + k0, first_m]))
        if B_ROWS_ARE_N:
            b_tile = tl.trans(b_desc.load([batch_index * m + first_n, k0]))
        else:
            b_tile = b_desc.load([batch_index * k + k0, first_n])
        if DOT_IN_FP32:
            a_tile = a_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(a_tile, b_tile, acc, input_precision=INPUT_PRECISION)
    offs_m = first_m + tl.arange(0, ROWS)
    offs_n = first_n + tl.arange(0, COLS)
    if TMA_STORE:
        if first_m >= first_n + COLS:
            value = _epilogue_value(
                acc,
                offs_m,
                offs_n,
                batch_index.to(tl.int64),
                m,
                c_ptr,
                stride_cb,
                stride_cm,
                stride_cn,
                alpha,
                beta,
                gamma,
                out_ptr.dtype.element_ty,
                HAS_C,
            )
            if COLS == 2 * ROWS:
                # Strips store as two square halves through ROWS×ROWS descriptors (out_desc
                # serves both orientations): half the epilogue's staging buffer of a
                # 128×256 tile, which in one piece does not fit beside the pipeline.
                left, right = tl.split(tl.permute(tl.reshape(value, (ROWS, 2, ROWS)), (0, 2, 1)))
                out_desc.store([batch_index, first_m, first_n], tl.reshape(left, (1, ROWS, ROWS)))
                out_desc.store(
                    [batch_index, first_n, first_m], tl.reshape(tl.trans(left), (1, ROWS, ROWS))
                )
                out_desc.store(
                    [batch_index, first_m, first_n + ROWS], tl.reshape(right, (1, ROWS, ROWS))
                )
                out_desc.store(
                    [batch_index, first_n + ROWS, first_m],
                    tl.reshape(tl.trans(right), (1, ROWS, ROWS)),
                )
            else:
                out_desc.store([batch_index, first_m, first_n], tl.reshape(value, (1, ROWS, COLS)))
                out_t_desc.store(
                    [batch_index, first_n, first_m], tl.reshape(tl.trans(value), (1, COLS, ROWS))
                )
        else:
            _store_symmetric_tile(
                acc,
                offs_m,
                offs_n,
                batch_index.to(tl.int64),
                m,
                c_ptr,
                stride_cb,
                stride_cm,
                stride_cn,
                out_ptr,
                stride_ob,
                stride_om,
                stride_on,
                alpha,
                beta,
                gamma,
                HAS_C,
            )
    else:
        _store_symmetric_tile(
            acc,
            offs_m,
            offs_n,
            batch_index.to(tl.int64),
            m,
            c_ptr,
            stride_cb,
            stride_cm,
            stride_cn,
            out_ptr,
            stride_ob,
            stride_om,
            stride_on,
            alpha,
            beta,
            gamma,
            HAS_C,
        )


@triton.jit
def _symmetric_product_tma_kernel(
    a_desc,
    b_desc,
    b_narrow_desc,
    c_ptr,
    out_ptr,
    out_desc,
    out_t_desc,
    batch,
    m,
    k,
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
    A_ROWS_ARE_M: tl.constexpr,
    B_ROWS_ARE_N: tl.constexpr,
    HAS_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    # The operand tiles come through Hopper's tensor-memory accelerator (TMA) instead of
    # per-thread pointer loads. Each descriptor views its operand's stack as one 2-D matrix
    # (see tma_descriptors): ``a_desc`` as (batch·m, k) (A_ROWS_ARE_M) or as aᵀ, (batch·k, m);
    # ``b_desc`` as the rows of the output's columns, (batch·m, k) (B_ROWS_ARE_N: SYRK of a
    # row-major ``a``, or a column-major ``b``) or as ``b``, (batch·k, m); ``b_narrow_desc`` is
    # ``b_desc`` with BLOCK_M-wide tiles. Rows past a matrix's m read the next matrix (or TMA's
    # zero fill after the last) and only feed outputs past m, never stored; K past k is
    # zero-filled along a row, and the launcher never lets a K tile run into the next matrix.
    #
    # Schedule. Square tiles (BLOCK_N == BLOCK_M) walk the lower triangle as the pointer kernel
    # does. Two-strip tiles (BLOCK_N == 2·BLOCK_M) use a balanced schedule: the upper strip of a
    # diagonal super-tile only needs its left half, so it runs as a BLOCK_M² "narrow" tile, and
    # narrow tiles go in pairs, one work item each. A matrix of T super-tile rows is then T²
    # full items plus T/2 pairs, all of one cost: e.g. 4096² in 128×256 strips is 256 + 8 = 264
    # items, exactly two waves on 132 SMs, where the plain strip walk has 272 (three waves, the
    # last nearly empty). FLATTEN (square tiles only) lets the compiler pipeline the next tile's
    # first loads under this tile's epilogue.
    pid = tl.program_id(0)
    tiles_per_side = tl.cdiv(m, BLOCK_N)
    if BLOCK_N == 2 * BLOCK_M:
        full_items = batch * tiles_per_side * tiles_per_side
        diagonals = batch * tiles_per_side
        total_items = full_items + tl.cdiv(diagonals, 2)
        for item in tl.range(pid, total_items, num_programs):
            if item < full_items:
                # Row r of super-tiles holds 2r + 1 full items (two strips per off-diagonal
                # super-tile, the lower strip of the diagonal one): they start at r².
                batch_index = item // (tiles_per_side * tiles_per_side)
                t = item - batch_index * tiles_per_side * tiles_per_side
                row = tl.sqrt(t.to(tl.float32)).to(tl.int32)
                row = tl.where((row + 1) * (row + 1) <= t, row + 1, row)
                row = tl.where(row * row > t, row - 1, row)
                j = t - row * row
                col = j // 2
                strip = tl.where(col == row, 1, j % 2)
                _tma_tile(
                    a_desc,
                    b_desc,
                    c_ptr,
                    out_ptr,
                    out_desc,
                    out_t_desc,
                    batch_index,
                    row * BLOCK_N + strip * BLOCK_M,
                    col * BLOCK_N,
                    m,
                    k,
                    stride_cb,
                    stride_cm,
                    stride_cn,
                    stride_ob,
                    stride_om,
                    stride_on,
                    alpha,
                    beta,
                    gamma,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    A_ROWS_ARE_M,
                    B_ROWS_ARE_N,
                    HAS_C,
                    INPUT_PRECISION,
                    DOT_IN_FP32,
                    TMA_STORE,
                )
            else:
                for half in range(0, 2):
                    d = 2 * (item - full_items) + half
                    if d < diagonals:
                        batch_index = d // tiles_per_side
                        first = (d - batch_index * tiles_per_side) * BLOCK_N
                        _tma_tile(
                            a_desc,
                            b_narrow_desc,
                            c_ptr,
                            out_ptr,
                            out_desc,
                            out_t_desc,
                            batch_index,
                            first,
                            first,
                            m,
                            k,
                            stride_cb,
                            stride_cm,
                            stride_cn,
                            stride_ob,
                            stride_om,
                            stride_on,
                            alpha,
                            beta,
                            gamma,
                            BLOCK_M,
                            BLOCK_M,
                            BLOCK_K,
                            A_ROWS_ARE_M,
                            B_ROWS_ARE_N,
                            HAS_C,
                            INPUT_PRECISION,
                            DOT_IN_FP32,
                            False,  # narrow tiles sit on the diagonal: masked stores
                        )
    else:
        STRIPS: tl.constexpr = BLOCK_N // BLOCK_M
        tiles_per_matrix = tiles_per_side * (tiles_per_side + 1) // 2 * STRIPS
        for tile in tl.range(pid, batch * tiles_per_matrix, num_programs, flatten=FLATTEN):
            batch_index = tile // tiles_per_matrix
            t = tile - batch_index * tiles_per_matrix
            row, col = _lower_tile_coords(t // STRIPS)
            strip = t % STRIPS
            _tma_tile(
                a_desc,
                b_desc,
                c_ptr,
                out_ptr,
                out_desc,
                out_t_desc,
                batch_index,
                row * BLOCK_N + strip * BLOCK_M,
                col * BLOCK_N,
                m,
                k,
                stride_cb,
                stride_cm,
                stride_cn,
                stride_ob,
                stride_om,
                stride_on,
                alpha,
                beta,
                gamma,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                A_ROWS_ARE_M,
                B_ROWS_ARE_N,
                HAS_C,
                INPUT_PRECISION,
                DOT_IN_FP32,
                TMA_STORE,
            )


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _multiprocessor_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _stack_strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, row, col) strides; batch stride 0 for a 2-D tensor viewed as a stack of one."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def launch_symmetric_product(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    config: TileConfig,
    num_sms: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Run the Triton kernel: ``alpha·a·aᵀ`` (``b=None``) or ``alpha·a·b``, ``+ beta·c + gamma·I``.

    ``a`` is ``(m, k)`` or ``(batch, m, k)`` with any strides; ``b`` (when given) is ``(k, m)``
    or ``(batch, k, m)``; ``c`` is ``m×m`` per matrix or ``None``. Returns a new contiguous
    tensor of ``a``'s dtype, exactly symmetric. ``num_sms`` sets the persistent grid (default:
    the device's multiprocessor count; under ``TRITON_INTERPRET=1`` on CPU, 4). ``out``, if
    given, must be a contiguous tensor of the result's shape and dtype (tests pass a poisoned
    one to prove every element is written).

    >>> config = TileConfig(128, 64, 8, 3)
    >>> out = launch_symmetric_product(x, None, None, 1.0, 0.0, 0.0, config)  # doctest: +SKIP
    """
    if a.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"symmetric-product kernel: dtype {a.dtype} is not one of {_SUPPORTED_DTYPES}"
        )
    if b is not None and b.dtype != a.dtype:
        raise TypeError(f"symmetric-product kernel: operand dtypes differ ({a.dtype} vs {b.dtype})")
    if a.dim() not in (2, 3):
        raise ValueError(
            f"symmetric-product kernel: expected 2-D or 3-D input, got {tuple(a.shape)}"
        )
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    out_shape = tuple(a.shape[:-2]) + (m, m)
    if out is None:
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != out_shape or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(
            f"symmetric-product kernel: out must be contiguous {out_shape} {a.dtype}, "
            f"got {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}"
        )
    if out.numel() == 0:
        return out
    if num_sms is None:
        num_sms = _multiprocessor_count(a.device.index) if a.is_cuda else 4
    tiles_per_side = triton.cdiv(m, config.cols)
    total_tiles = batch * tiles_per_side * (tiles_per_side + 1) // 2 * (config.cols // config.block)
    num_programs = max(1, min(total_tiles, num_sms * config.ctas_per_sm))

    c_arg = out if c is None else c  # any valid pointer; never read when HAS_C is False
    scb, scm, scn = _stack_strides(c_arg) if c is not None else (0, 0, 0)
    sob, som, son = _stack_strides(out)
    common = dict(
        HAS_C=c is not None and beta != 0.0,
        BLOCK_M=config.block,
        BLOCK_N=config.cols,
        BLOCK_K=config.block_k,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton 3.6's interpreter multiplies bf16 *bit patterns* in tl.dot (numpy has no
        # bf16); on CPU the tiles are upcast first. Never set on a GPU.
        DOT_IN_FP32=a.dtype == torch.bfloat16 and not a.is_cuda,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    descriptors = tma_descriptors(a, b, config) if config.tma else None
    if descriptors is not None:
        a_desc, b_desc, b_narrow_desc, a_rows_are_m, b_rows_are_n = descriptors
        if config.cols == 2 * config.block:  # the balanced two-strip schedule (see the kernel)
            total_items = batch * tiles_per_side**2 + triton.cdiv(batch * tiles_per_side, 2)
            num_programs = max(1, min(total_items, num_sms * config.ctas_per_sm))
        out_descs = output_descriptors(out, config) if config.tma_store else None
        out_desc, out_t_desc = (
            out_descs if out_descs is not None else (a_desc, a_desc)
        )  # unused if None
        _symmetric_product_tma_kernel[(num_programs,)](
            a_desc,
            b_desc,
            b_narrow_desc,
            c_arg,
            out,
            out_desc,
            out_t_desc,
            batch,
            m,
            k,
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
            A_ROWS_ARE_M=a_rows_are_m,
            B_ROWS_ARE_N=b_rows_are_n,
            FLATTEN=config.flatten and config.cols != 2 * config.block,
            TMA_STORE=out_descs is not None,
            **common,
        )
        return out

    # Pointer loads: any strides (and the TMA configs' fallback for layouts TMA cannot read).
    b_arg = a if b is None else b
    sab, sam, sak = _stack_strides(a)
    sbb, sbk, sbn = _stack_strides(b_arg) if b is not None else (0, 0, 0)
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
        **common,
    )
    return out


def output_descriptors(out: Tensor, config: TileConfig):
    """``(out_desc, out_t_desc)``: 3-D (batch, m, m) descriptors of a contiguous output with
    ``BLOCK_M × BLOCK_N`` and ``BLOCK_N × BLOCK_M`` tiles (``BLOCK_M²`` for two-strip tiles,
    stored in halves), or ``None`` if its rows are not 16-byte aligned. 3-D so that TMA clips at
    each matrix's own edge, never writing into the next.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m = out.shape[-1]
    if not tma_supported(out.device) or out.data_ptr() % 16 or (m * out.element_size()) % 16:
        return None
    batch = out.shape[0] if out.dim() == 3 else 1
    shape, strides = [batch, m, m], [m * m, m, 1]
    if config.cols == 2 * config.block:  # two-strip tiles store square halves (see _tma_tile)
        square = TensorDescriptor(out, shape, strides, [1, config.block, config.block])
        return square, square
    return (
        TensorDescriptor(out, shape, strides, [1, config.block, config.cols]),
        TensorDescriptor(out, shape, strides, [1, config.cols, config.block]),
    )


@functools.cache
def _triton_has_descriptors() -> bool:
    """Host-side TMA descriptors (``triton.tools.tensor_descriptor``) exist in this Triton."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(tl, "make_tensor_descriptor")


def tma_supported(device: torch.device) -> bool:
    """Whether TMA descriptors can be used on ``device``: SM90+ GPUs, or CPU under the interpreter
    (and a Triton with host-side descriptors; older ones keep the pointer kernel)."""
    if not _triton_has_descriptors():
        return False
    if device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return _capability_major(device.index) >= 9


@functools.cache
def _capability_major(device_index: int | None) -> int:
    # Asked on every launch (operand and output descriptors): read the device once.
    return torch.cuda.get_device_capability(device_index)[0]


def _flat_rows(t: Tensor) -> tuple[int, int] | None:
    """``(rows, row_stride)`` of a row-major stack viewed as one 2-D matrix, if TMA can read it.

    The stack must be one evenly strided block of rows (batch stride = rows · row stride), its
    rows 16-byte aligned (base address and row stride), and its last dimension contiguous.
    """
    rows, cols = t.shape[-2], t.shape[-1]
    batch = t.shape[0] if t.dim() == 3 else 1
    row_stride = t.stride(-2) if rows > 1 else cols
    if t.stride(-1) != 1 and cols > 1:
        return None
    if t.dim() == 3 and batch > 1 and t.stride(0) != rows * row_stride:
        return None
    if t.data_ptr() % 16 or (row_stride * t.element_size()) % 16 or row_stride < cols:
        return None
    return batch * rows, row_stride


def tma_descriptors(a: Tensor, b: Tensor | None, config: TileConfig):
    """``(a_desc, b_desc, b_narrow_desc, a_rows_are_m, b_rows_are_n)`` for the TMA kernel, or
    ``None``.

    ``None`` means the layout does not fit TMA. ``b_narrow_desc`` reads ``b`` in ``BLOCK_M``-wide
    tiles (the narrow diagonal tiles of the two-strip schedule).

    Each operand is read through a 2-D descriptor over its whole stack, in whichever of its two
    orientations is row-major: ``a`` as ``(batch·m, k)`` (row-major ``a``) or as the rows of
    ``aᵀ``, ``(batch·k, m)`` (column-major ``a``, e.g. the transposed view of a tall matrix);
    ``b`` likewise as ``(batch·k, m)`` or as the rows of ``bᵀ``. For SYRK, ``b`` is ``aᵀ``:
    the same memory as ``a``. A descriptor whose rows run along K may only be used for a
    stack when ``k`` is a multiple of ``BLOCK_K`` (else a K tile would read the next
    matrix's rows). ``None`` sends the call to the pointer kernel with the same tiles.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_supported(a.device) or a.numel() == 0:  # a descriptor needs every dimension > 0
        return None
    k = a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    k_tiles_stay_inside = batch == 1 or k % config.block_k == 0

    def describe(t: Tensor, rows_block: int, cols_block: int, k_along_rows_ok: bool):
        """(descriptor, rows_are_outer) of ``t`` (m_or_k × k_or_m): row-major, else its
        transpose."""
        flat = _flat_rows(t)
        if flat is not None and t.stride(-1) == 1:
            return TensorDescriptor(
                t, [flat[0], t.shape[-1]], [flat[1], 1], [rows_block, cols_block]
            ), True
        if not k_along_rows_ok:
            return None
        flat_t = _flat_rows(t.mT)
        if flat_t is not None:
            return TensorDescriptor(
                t.mT, [flat_t[0], t.shape[-2]], [flat_t[1], 1], [cols_block, rows_block]
            ), False
        return None

    a_side = describe(a, config.block, config.block_k, k_tiles_stay_inside)
    if a_side is None:
        return None
    a_desc, a_rows_are_m = a_side
    if b is None:  # b = aᵀ: the rows of the output's columns are a's rows
        if a_rows_are_m:
            b_desc = TensorDescriptor(
                a, list(a_desc.shape), list(a_desc.strides), [config.cols, config.block_k]
            )
        else:
            b_desc = TensorDescriptor(
                a.mT, list(a_desc.shape), list(a_desc.strides), [config.block_k, config.cols]
            )
        return a_desc, b_desc, a_desc, a_rows_are_m, a_rows_are_m  # narrow b tiles = a's tiles
    # b is (k, m): its row-major orientation has rows along K, its transpose rows along N.
    bt_side = describe(b.mT, config.cols, config.block_k, k_tiles_stay_inside)
    if bt_side is None:
        return None
    b_desc, b_rows_are_n = bt_side
    if config.cols == config.block:  # square tiles: the narrow tiles are b's own tiles
        return a_desc, b_desc, b_desc, a_rows_are_m, b_rows_are_n
    narrow_block = (
        [config.block, config.block_k] if b_rows_are_n else [config.block_k, config.block]
    )
    b_narrow_desc = TensorDescriptor(
        b_desc.base, list(b_desc.shape), list(b_desc.strides), narrow_block
    )
    return a_desc, b_desc, b_narrow_desc, a_rows_are_m, b_rows_are_n
