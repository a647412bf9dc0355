"""The TMA symmetric-product kernel and its descriptors (SM90+; ``TileConfig(tma=True)``).

Operand tiles come through Hopper's tensor-memory accelerator (TMA) instead of per-thread
pointer loads, for row- or column-major operands with 16-byte aligned rows
(:func:`tma_descriptors`; ``None`` sends the launch to the pointer kernel with the same tiles).
Square tiles walk the lower triangle as the pointer kernel does (``lower_tiles.py``);
128×256-style two-strip tiles use the balanced schedule described in the kernel. With
``tma_store=True``, tiles strictly below the diagonal are stored through output descriptors
(:func:`output_descriptors`): the epilogue is the bottleneck of the Gram-space products. The
epilogue of tiles that touch the diagonal is ``lower_tiles.py``'s.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from dmuon_compile.kernels.lower_tiles import (
    TileConfig,
    _epilogue_value,
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


def _tma_launch_metadata(grid, metadata, args) -> dict:
    """Profiler name, FLOPs and bytes of one launch (``lower_tiles.product_metadata``).

    The kernel has no SYRK switch: SYRK's ``b`` descriptor is built over ``a``'s own memory
    (see :func:`tma_descriptors`), which is how the name tells it from ``sym_mm`` (a ``sym_mm``
    whose ``b`` is ``a``'s memory, ``b = aᵀ``, is that SYRK and is named so).
    """
    out = args["out_ptr"]
    return product_metadata(
        "tma",
        syrk=args["b_desc"].base.data_ptr() == args["a_desc"].base.data_ptr(),
        batch=args["batch"],
        m=args["m"],
        k=args["k"],
        operand_size=args["a_desc"].base.element_size(),
        c_size=args["c_ptr"].element_size() if args["HAS_C"] or args["C_PROLOGUE"] else 0,
        out_size=out.element_size(),
        tile=(args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]),
    )


@triton.jit
def _c_tile(c_desc, batch_index, first_m, first_n, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The ROWS × COLS tile of C at (first_m, first_n) in fp32, loaded through ``c_desc``
    (:func:`c_descriptor`: the output descriptors' tiles, so two square halves for a strip).
    TMA zero-fills past each matrix's edge."""
    if COLS == 2 * ROWS:
        left = tl.reshape(c_desc.load([batch_index, first_m, first_n]), (ROWS, ROWS))
        right = tl.reshape(c_desc.load([batch_index, first_m, first_n + ROWS]), (ROWS, ROWS))
        tile = tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (ROWS, COLS))
    else:
        tile = tl.reshape(c_desc.load([batch_index, first_m, first_n]), (ROWS, COLS))
    return tile.to(tl.float32)


@triton.jit
def _tma_tile(
    descs,
    ptrs,
    epilogue,
    batch_index,
    first_m,
    first_n,
    m,
    k,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_ROWS_ARE_M: tl.constexpr,
    B_ROWS_ARE_N: tl.constexpr,
    HAS_C: tl.constexpr,
    C_PROLOGUE: tl.constexpr,
    C_TMA: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """One ROWS × COLS output tile at (first_m, first_n) of matrix ``batch_index``: TMA loads,
    dot, epilogue. The kernel's runtime arguments come packed as the kernel builds them once:
    ``descs`` = (a, b, c, out, out_t) descriptors, ``ptrs`` = (c, out) pointers, ``epilogue`` =
    (C strides, output strides, (alpha, beta, gamma)), strides as (batch, row, col). The
    compile-time switches stay separate parameters: a tuple of them would reach the callee as
    runtime values, and every branch would then be compiled.

    C enters in one of three ways: with C_PROLOGUE the accumulator starts at (beta/alpha)·C,
    loaded by TMA before the K loop (the launcher only sets it for alpha != 0), so the epilogue
    only scales and adds gamma·I; with HAS_C the epilogue loads C by masked pointer loads, and
    with C_TMA too the tiles below the diagonal load it by TMA instead, half a strip at a time
    (the pointer loads of a whole 128×256 tile beside its accumulator spill registers).
    With TMA_STORE, a tile entirely below the diagonal (every element stored, in place and
    mirrored) is written through the (batch, m, m) output descriptors: TMA clips rows and
    columns past m, so no mask is needed. Tiles that touch the diagonal keep masked stores.
    """
    a_desc, b_desc, c_desc, out_desc, out_t_desc = descs
    c_ptr, out_ptr = ptrs
    c_strides, out_strides, coeffs = epilogue
    if C_PROLOGUE:
        acc = _c_tile(c_desc, batch_index, first_m, first_n, ROWS, COLS) * (coeffs[1] / coeffs[0])
    else:
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
    batch64 = batch_index.to(tl.int64)
    # Tiles entirely below the diagonal go through the output descriptors (TMA_STORE), the
    # others through masked stores. The masked store is written twice on purpose: one flag
    # set under ``if TMA_STORE`` reaches a later ``if`` as a runtime value in Triton 3.6, which
    # would compile the descriptor stores for configurations whose descriptors are placeholders.
    if TMA_STORE:
        if first_m >= first_n + COLS:
            _store_below_diagonal(
                acc,
                batch_index,
                first_m,
                first_n,
                m,
                c_ptr,
                c_strides,
                c_desc,
                out_desc,
                out_t_desc,
                coeffs,
                out_ptr.dtype.element_ty,
                HAS_C,
                C_TMA,
            )
        else:
            _store_symmetric_tile(
                acc,
                offs_m,
                offs_n,
                batch64,
                m,
                c_ptr,
                c_strides,
                out_ptr,
                out_strides,
                coeffs,
                HAS_C,
            )
    else:
        _store_symmetric_tile(
            acc, offs_m, offs_n, batch64, m, c_ptr, c_strides, out_ptr, out_strides, coeffs, HAS_C
        )


@triton.jit
def _store_below_diagonal(
    acc,
    batch_index,
    first_m,
    first_n,
    m,
    c_ptr,
    c_strides,
    c_desc,
    out_desc,
    out_t_desc,
    coeffs,
    OUT_DTYPE: tl.constexpr,
    HAS_C: tl.constexpr,
    C_TMA: tl.constexpr,
):
    """Epilogue of a tile entirely below the diagonal: every element is stored in place and
    mirrored, through the (batch, m, m) output descriptors (TMA clips rows and columns past
    m, so no mask is needed)."""
    ROWS: tl.constexpr = acc.shape[0]
    COLS: tl.constexpr = acc.shape[1]
    if C_TMA:
        # No diagonal element here: alpha·acc + beta·C, with C's tile loaded by TMA per square
        # half (see _store_tile_and_mirror).
        value = acc
    else:
        offs_m = first_m + tl.arange(0, ROWS)
        offs_n = first_n + tl.arange(0, COLS)
        value = _epilogue_value(
            acc,
            offs_m,
            offs_n,
            batch_index.to(tl.int64),
            m,
            c_ptr,
            c_strides,
            coeffs,
            OUT_DTYPE,
            HAS_C,
        )
    if COLS == 2 * ROWS:
        # Strips store as two square halves through ROWS×ROWS descriptors (out_desc serves
        # both orientations): half the epilogue's staging buffer of a 128×256 tile, which in
        # one piece does not fit beside the pipeline.
        halves = tl.split(tl.permute(tl.reshape(value, (ROWS, 2, ROWS)), (0, 2, 1)))
        for half in tl.static_range(2):  # unrolled: ``half`` is a compile-time constant
            _store_tile_and_mirror(
                halves[half],
                c_desc,
                out_desc,
                out_desc,
                batch_index,
                first_m,
                first_n + half * ROWS,
                coeffs,
                OUT_DTYPE,
                C_TMA,
            )
    else:
        _store_tile_and_mirror(
            value,
            c_desc,
            out_desc,
            out_t_desc,
            batch_index,
            first_m,
            first_n,
            coeffs,
            OUT_DTYPE,
            C_TMA,
        )


@triton.jit
def _store_tile_and_mirror(
    value,
    c_desc,
    out_desc,
    out_t_desc,
    batch_index,
    first_m,
    first_n,
    coeffs,
    OUT_DTYPE: tl.constexpr,
    C_TMA: tl.constexpr,
):
    """``value`` at (first_m, first_n) of matrix ``batch_index`` and its transpose at
    (first_n, first_m), through the output descriptors. With C_TMA, ``value`` is the fp32
    accumulator and ``alpha·value + beta·C`` is stored, C's tile loaded by TMA."""
    rows: tl.constexpr = value.shape[0]
    cols: tl.constexpr = value.shape[1]
    if C_TMA:
        c_tile = tl.reshape(c_desc.load([batch_index, first_m, first_n]), (rows, cols))
        value = (value * coeffs[0] + coeffs[1] * c_tile.to(tl.float32)).to(OUT_DTYPE)
    out_desc.store([batch_index, first_m, first_n], tl.reshape(value, (1, rows, cols)))
    out_t_desc.store([batch_index, first_n, first_m], tl.reshape(tl.trans(value), (1, cols, rows)))


# Stack size and grid size take any value: specialising on them (Triton keys ints on ==1 and
# %16) would compile a stack of 8 apart from one of 16, a cold compile's biggest cost.
@triton.jit(launch_metadata=_tma_launch_metadata, do_not_specialize=["batch", "num_programs"])
def _symmetric_product_tma_kernel(
    a_desc,
    b_desc,
    b_narrow_desc,
    c_desc,
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
    C_PROLOGUE: tl.constexpr,
    C_TMA: tl.constexpr,
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
    # The arguments every tile takes, packed once (see _tma_tile).
    descs = (a_desc, b_desc, c_desc, out_desc, out_t_desc)
    narrow_descs = (a_desc, b_narrow_desc, c_desc, out_desc, out_t_desc)
    ptrs = (c_ptr, out_ptr)
    epilogue = (
        (stride_cb, stride_cm, stride_cn),
        (stride_ob, stride_om, stride_on),
        (alpha, beta, gamma),
    )
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
                    descs,
                    ptrs,
                    epilogue,
                    batch_index,
                    row * BLOCK_N + strip * BLOCK_M,
                    col * BLOCK_N,
                    m,
                    k,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    A_ROWS_ARE_M,
                    B_ROWS_ARE_N,
                    HAS_C,
                    C_PROLOGUE,
                    C_TMA,
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
                            narrow_descs,
                            ptrs,
                            epilogue,
                            batch_index,
                            first,
                            first,
                            m,
                            k,
                            BLOCK_M,
                            BLOCK_M,
                            BLOCK_K,
                            A_ROWS_ARE_M,
                            B_ROWS_ARE_N,
                            HAS_C,
                            C_PROLOGUE,
                            C_TMA,
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
                descs,
                ptrs,
                epilogue,
                batch_index,
                row * BLOCK_N + strip * BLOCK_M,
                col * BLOCK_N,
                m,
                k,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                A_ROWS_ARE_M,
                B_ROWS_ARE_N,
                HAS_C,
                C_PROLOGUE,
                C_TMA,
                INPUT_PRECISION,
                DOT_IN_FP32,
                TMA_STORE,
            )


def launch_tma_kernel(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    config: TileConfig,
    num_sms: int,
    out: Tensor,
    descriptors: tuple,
) -> Tensor:
    """Launch :func:`_symmetric_product_tma_kernel` into ``out`` with the operand
    ``descriptors`` of :func:`tma_descriptors` (``out`` checked and non-empty: see
    ``symmetric_product.launch_symmetric_product``); returns ``out``."""
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    a_desc, b_desc, b_narrow_desc, a_rows_are_m, b_rows_are_n = descriptors
    two_strips = config.cols == 2 * config.block
    if two_strips:  # the balanced two-strip schedule (see the kernel)
        tiles_per_side = triton.cdiv(m, config.cols)
        work_items = batch * tiles_per_side**2 + triton.cdiv(batch * tiles_per_side, 2)
    else:
        work_items = lower_tile_count(m, batch, config)
    num_programs = persistent_programs(work_items, num_sms, config)
    c_arg, (scb, scm, scn) = epilogue_operand(c, out)
    sob, som, son = stack_strides(out)
    out_descs = output_descriptors(out, config) if config.tma_store else None
    out_desc, out_t_desc = (
        out_descs if out_descs is not None else (a_desc, a_desc)
    )  # unused if None
    constexprs = tile_constexprs(a, c, beta, config)
    # C by TMA (config.c_load): into the accumulator (alpha != 0: it enters as (beta/alpha)·C),
    # or in the epilogue of the tiles stored through descriptors.
    wanted = constexprs["HAS_C"] and (
        (config.c_load == "prologue" and alpha != 0)
        or (config.c_load == "tma" and out_descs is not None)
    )
    c_desc = c_descriptor(c, config) if wanted else None
    c_prologue = c_desc is not None and config.c_load == "prologue"
    if c_prologue:  # C goes into the accumulator, not the epilogue
        constexprs["HAS_C"] = False
    _symmetric_product_tma_kernel[(num_programs,)](
        a_desc,
        b_desc,
        b_narrow_desc,
        c_desc if c_desc is not None else a_desc,  # unused if None
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
        FLATTEN=config.flatten and not two_strips,
        TMA_STORE=out_descs is not None,
        C_PROLOGUE=c_prologue,
        C_TMA=c_desc is not None and not c_prologue,
        **constexprs,
    )
    return out


def c_descriptor(c: Tensor, config: TileConfig):
    """A 3-D (batch, m, m) descriptor of ``c`` with the output descriptors' tiles (the kernel's
    C_PROLOGUE and C_TMA loads), or ``None`` if ``c`` is not a contiguous stack with 16-byte
    rows (the epilogue then loads C by pointers)."""
    if not c.is_contiguous():
        return None
    return output_descriptors(c, config)[0] if output_descriptors(c, config) else None


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
