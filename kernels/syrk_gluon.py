"""A warp-specialised, persistent Gluon kernel for the symmetric product (SM90).

``out = alpha·A·B + beta·C + gamma·I`` with the result known to be symmetric (SYRK: ``B = Aᵀ``;
``sym_mm``: ``A·B`` symmetric), computing only the lower triangle, exactly as the Triton
kernels of ``lower_tiles.py`` do and with the same element rule, so the output is bitwise
symmetric. Written in Gluon (``triton.experimental.gluon``), which exposes what the Triton
kernels leave to the compiler: warp specialisation, ``wgmma``, TMA and mbarriers.

Partitions (``gl.warp_specialize``), one persistent CTA per SM:

- *operand loader* (1 warp): walks the CTA's tiles and streams ``A`` and ``B`` K-slices into a
  ring of ``STAGES`` shared-memory stages through TMA (``ready``/``empty`` mbarriers);
- *C loader* (1 warp, only with a ``beta·C`` term): streams each tile's ``C`` blocks into a ring
  of ``C_SLOTS`` buffers, so ``C`` arrives while the main loop runs instead of after it;
- *consumers* (``CONSUMERS`` × warpgroups): asynchronous ``warpgroup_mma`` over the stages,
  then the epilogue. With one consumer (``num_warps`` 4 or 8) it owns every tile; with two
  (``num_warps`` 4 or 8 each, "ping-pong") they take alternate tiles, so one consumer's
  epilogue runs while the other's MMAs keep the tensor cores busy.

Tiles. A tile is ``128 × (128·SPLIT)``: ``SPLIT`` 128×128 *blocks* side by side, one fp32
accumulator each. The tiles walk the lower triangle of each matrix as ``lower_tiles.py``
describes (super-tiles of ``128·SPLIT`` in ``SPLIT`` row strips, the flat index over the
stack, a persistent grid of one CTA per SM). A block strictly below the diagonal is stored
by TMA twice, in place and transposed (the transpose is written into the staging buffer
through a permuted shared-memory view); a block on the diagonal is made symmetric in
registers (``where(i ≥ j, v, vᵀ)``, ``vᵀ`` read back through the permuted view) and stored
once by TMA; a block above the diagonal (the right half of a diagonal strip) is neither
multiplied nor stored. TMA clips every store at the matrix's own edge (3-D descriptors), so
``m`` need not be a multiple of the tile. A *wide* tile (``GluonConfig.wide``) is one 128×256
accumulator instead of two blocks (one N = 256 ``wgmma`` per K-slice); its epilogue stages the
whole tile, mirrors a diagonal half in shared memory and stores by halves
(:func:`_store_wide`).

Requirements (:func:`gluon_supported`): an SM90 GPU and a Triton with Gluon; fp16/bf16
operands; ``a`` row-major ``(m, k)`` or ``(batch, m, k)`` (contiguous), ``b`` ``None`` or a
row-major ``(batch, k, m)``, ``c`` ``None`` or contiguous ``m×m`` per matrix; rows 16-byte
aligned (``k`` and ``m`` multiples of 8). :func:`launch_gluon_kernel` raises a ``ValueError``
naming the unsupported property otherwise.
"""

import functools
from dataclasses import asdict, dataclass

import torch
import triton
from dmuon_compile.kernels.lower_tiles import multiprocessor_count, product_output
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK: int = 128  # rows of a tile and side of a block (the wgmma M of one consumer warpgroup)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SMEM_LIMIT = 232448  # bytes of dynamic shared memory per CTA on SM90 (227 KiB)


@dataclass(frozen=True)
class GluonConfig:
    """One configuration of the Gluon kernel.

    >>> GluonConfig(split=2, stages=3).name
    'g128x256_k64_s3_c1w8_cs2'
    """

    split: int = 1  # 128×128 blocks per tile: 1 (128×128 tiles) or 2 (128×256)
    block_k: int = 64
    stages: int = 4  # operand ring depth
    consumers: int = 1  # consumer partitions: 1 (cooperative) or 2 (ping-pong, 4 or 8 warps each)
    num_warps: int = 8  # warps of each consumer: 4 or 8 (8: two warpgroups share a tile)
    c_slots: int = 2  # C ring depth, in 128×128 blocks (only with a beta·C term)
    # Staging buffers of each consumer's stores: with 2, a block's transposed store is written
    # while its in-place store is still being read out by TMA, and each buffer waits only for
    # the store issued two stores before it (with 1, every store waits for the previous one).
    store_slots: int = 1
    # Wide tiles (split=2 only): one 128×256 accumulator and one N = 256 wgmma per K-slice, so
    # the A slice is read from shared memory once per slice (twice with two 128-column
    # blocks); B and C arrive in one load each, the epilogue stages the whole tile.
    wide: bool = False
    maxnreg: int | None = None  # per-thread register cap of the launch (None: Triton's)

    def __post_init__(self) -> None:
        if self.split not in (1, 2):
            raise ValueError(f"GluonConfig: split={self.split} must be 1 or 2")
        if self.consumers not in (1, 2):
            raise ValueError(f"GluonConfig: consumers={self.consumers} must be 1 or 2")
        if self.num_warps not in (4, 8):
            raise ValueError(f"GluonConfig: num_warps={self.num_warps} must be 4 or 8")
        if self.consumers == 2 and (self.split != 1 or self.c_slots < 2):
            raise ValueError(
                "GluonConfig: two consumers take 128×128 tiles (split=1) and c_slots >= 2 "
                "(a consumer must never wait on a C slot two ring passes ahead)"
            )
        if self.stages < 2 or self.c_slots < 1:
            raise ValueError("GluonConfig: stages >= 2 and c_slots >= 1")
        if self.store_slots not in (1, 2):
            raise ValueError(f"GluonConfig: store_slots={self.store_slots} must be 1 or 2")
        if self.wide and (self.split != 2 or self.consumers != 1 or self.num_warps != 8):
            raise ValueError(
                "GluonConfig: wide tiles are 128×256 (split=2) with one 8-warp consumer"
            )
        if self.wide and self.store_slots != 1:
            raise ValueError("GluonConfig: wide tiles stage the whole tile once (store_slots=1)")

    kernel = "gluon"  # how an autotune verdict names the kernel (TileConfig: "triton")

    @property
    def cols(self) -> int:
        return BLOCK * self.split

    def to_dict(self) -> dict:
        return {**asdict(self), "kernel": self.kernel}

    @classmethod
    def from_dict(cls, data: dict) -> "GluonConfig":
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)

    @property
    def name(self) -> str:
        return (
            f"g{BLOCK}x{self.cols}_k{self.block_k}_s{self.stages}"
            f"_c{self.consumers}w{self.num_warps}_cs{self.c_slots}"
            + (f"_o{self.store_slots}" if self.store_slots > 1 else "")
            + ("_n256" if self.wide else "")
            + (f"_r{self.maxnreg}" if self.maxnreg else "")
        )

    def smem_bytes(self, operand_size: int, c_size: int | None, out_size: int) -> int:
        """Shared memory the kernel allocates (operand ring, C ring, staging, barriers)."""
        operands = self.stages * (BLOCK + self.cols) * self.block_k * operand_size
        block = BLOCK * (self.cols if self.wide else BLOCK)  # elements of one C / staging block
        c_ring = 0 if c_size is None else self.c_slots * block * c_size
        staging = self.consumers * self.store_slots * block * out_size
        barriers = 8 * 2 * (self.stages + self.c_slots + 1)
        return operands + c_ring + staging + barriers + 512  # + alignment padding


DEFAULT_CONFIG = GluonConfig()


# ----------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _acc_layout(num_warps, cols):
    """The wgmma accumulator layout of a 128×``cols`` block over ``num_warps`` warps."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16]
    )


@gluon.jit
def _tile_origin(tile, tiles_per_matrix, SPLIT: gl.constexpr):
    """Flat tile index -> ``(batch_index, first_m, first_n)`` of the lower-triangle walk.

    ``t // SPLIT`` is a super-tile ``(row, col)``, ``col <= row``, by the square-root formula
    of ``lower_tiles._lower_tile_coords``; ``t % SPLIT`` is the 128-row strip in it.
    """
    batch_index = tile // tiles_per_matrix
    t = tile - batch_index * tiles_per_matrix
    s = t // SPLIT
    row = ((gl.sqrt((8 * s + 1).to(gl.float32)) - 1.0) * 0.5).to(gl.int32)
    # fp32 rounding of the square root can land one off on either side: correct it.
    row = gl.where((row + 1) * (row + 2) // 2 <= s, row + 1, row)
    row = gl.where(row * (row + 1) // 2 > s, row - 1, row)
    col = s - row * (row + 1) // 2
    first_m = row * (BLOCK_C * SPLIT) + (t % SPLIT) * BLOCK_C
    first_n = col * (BLOCK_C * SPLIT)
    return batch_index, first_m, first_n


BLOCK_C = gl.constexpr(BLOCK)


@gluon.jit
def _operand_loader(state, SPLIT: gl.constexpr, SYRK: gl.constexpr, B_PARTS: gl.constexpr):
    """Operand loader partition: every K-slice of every tile of this CTA, in order; a tile's
    B slice arrives in ``B_PARTS`` loads (``SPLIT`` blocks of 128 columns, or one of 256)."""
    a_desc, b_desc, a_bufs, b_bufs, ready, empty, m, k, total_tiles, tiles_per_matrix = state
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    B_COLS: gl.constexpr = SPLIT * BLOCK_C // B_PARTS
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + B_PARTS * b_desc.block_type.nbytes
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_steps = gl.cdiv(k, BLOCK_K)
    pos = 0
    for tile in range(pid, total_tiles, programs):
        batch_index, first_m, first_n = _tile_origin(tile, tiles_per_matrix, SPLIT)
        for ks in range(k_steps):
            stage = pos % STAGES
            phase = (pos // STAGES) & 1
            # mbarriers start as if phase 1 had completed: the first pass finds every stage free.
            mbarrier.wait(empty.index(stage), phase ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, STAGE_BYTES)
            k0 = ks * BLOCK_K
            tma.async_copy_global_to_shared(
                a_desc, [batch_index * m + first_m, k0], bar, a_bufs.index(stage)
            )
            for h in gl.static_range(B_PARTS):
                b_buf = b_bufs.index(stage * B_PARTS + h)
                if SYRK:  # B = Aᵀ: the columns' operand is A's rows
                    tma.async_copy_global_to_shared(
                        b_desc, [batch_index * m + first_n + h * B_COLS, k0], bar, b_buf
                    )
                else:
                    tma.async_copy_global_to_shared(
                        b_desc, [batch_index, k0, first_n + h * B_COLS], bar, b_buf
                    )
            pos += 1


@gluon.jit
def _c_loader(state, SPLIT: gl.constexpr, C_PARTS: gl.constexpr):
    """C loader partition: each tile's C in ``C_PARTS`` blocks (``SPLIT`` of 128 columns, or
    one of 256) into the C ring, in tile order."""
    c_desc, c_bufs, c_ready, c_empty, total_tiles, tiles_per_matrix = state
    C_SLOTS: gl.constexpr = c_bufs.shape[0]
    C_COLS: gl.constexpr = SPLIT * BLOCK_C // C_PARTS
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    pos = 0
    for tile in range(pid, total_tiles, programs):
        batch_index, first_m, first_n = _tile_origin(tile, tiles_per_matrix, SPLIT)
        for h in gl.static_range(C_PARTS):
            slot = pos % C_SLOTS
            mbarrier.wait(c_empty.index(slot), ((pos // C_SLOTS) & 1) ^ 1)
            bar = c_ready.index(slot)
            mbarrier.expect(bar, c_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                c_desc, [batch_index, first_m, first_n + h * C_COLS], bar, c_bufs.index(slot)
            )
            pos += 1


@gluon.jit
def _b_view(b_bufs, index, SYRK: gl.constexpr):
    """The K×N B operand of one load (N = 128, or 256 for a wide tile): A's rows read
    transposed (SYRK) or B's own tile."""
    if SYRK:
        return b_bufs.index(index).permute((1, 0))
    else:
        return b_bufs.index(index).reshape([b_bufs.shape[2], b_bufs.shape[3]])


@gluon.jit
def _staging_slot(out_bufs, first_slot, stores, STORE_SLOTS: gl.constexpr):
    """The consumer's next staging buffer, once the store that last read it is done.

    Stores rotate over ``STORE_SLOTS`` buffers; the one issued ``STORE_SLOTS`` stores ago used
    this buffer. ``store_wait(n)`` (``cp.async.bulk.wait_group.read n``) returns once at most the
    ``n`` most recent bulk groups are pending and every earlier one has read its source, and
    every consumer thread commits one group per store, so ``n = STORE_SLOTS - 1`` waits for
    exactly that store.
    """
    tma.store_wait(STORE_SLOTS - 1)
    return out_bufs.index(first_slot + stores % STORE_SLOTS)


@gluon.jit
def _store_block(
    value,
    out_desc,
    out_bufs,
    first_slot,
    stores,
    batch_index,
    first_m,
    first_n,
    rows_exist,
    layout: gl.constexpr,
    STORE_SLOTS: gl.constexpr,
):
    """Store one 128×128 block of the lower-triangle walk with its mirror (the element rule);
    returns the consumer's store count.

    Strictly below the diagonal: in place and transposed (two TMA stores through the staging
    ring). On the diagonal: ``where(i >= j, v, vᵀ)`` in place. Above, or in a strip that
    starts past the matrix's last row (``rows_exist`` False): nothing.
    """
    if (first_n + BLOCK_C <= first_m) & rows_exist:
        staging = _staging_slot(out_bufs, first_slot, stores, STORE_SLOTS)
        tile = staging.reshape([BLOCK_C, BLOCK_C])
        tile.store(value)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [batch_index, first_m, first_n], staging)
        staging = _staging_slot(out_bufs, first_slot, stores + 1, STORE_SLOTS)
        tile = staging.reshape([BLOCK_C, BLOCK_C])
        tile.permute((1, 0)).store(value)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [batch_index, first_n, first_m], staging)
        stores += 2
    elif (first_n == first_m) & rows_exist:
        staging = _staging_slot(out_bufs, first_slot, stores, STORE_SLOTS)
        tile = staging.reshape([BLOCK_C, BLOCK_C])
        tile.store(value)
        transposed = tile.permute((1, 0)).load(layout)
        rows = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        symmetric = gl.where(rows[:, None] >= cols[None, :], value, transposed)
        gl.thread_barrier()  # every lane has read vᵀ before the tile is overwritten
        tile.store(symmetric)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [batch_index, first_m, first_m], staging)
        stores += 1
    return stores


@gluon.jit
def _tile_value(acc, c_ring, c_pos, first_m, first_n, scale, dtype, HAS_C: gl.constexpr):
    """fp32 ``alpha·acc + beta·C + gamma·I`` of one accumulator (a 128×128 block or a 128×256
    wide tile; ``scale = (alpha, beta, gamma)``), rounded once to ``dtype``; C comes from slot
    ``c_pos`` of the C ring ``(buffers, ready, empty)``, which is handed back to the C loader
    once every lane has read it."""
    c_bufs, c_ready, c_empty = c_ring
    alpha, beta, gamma = scale
    layout: gl.constexpr = acc.type.layout
    ROWS: gl.constexpr = acc.shape[0]
    COLS: gl.constexpr = acc.shape[1]
    value = acc * alpha
    if HAS_C:
        C_SLOTS: gl.constexpr = c_bufs.shape[0]
        slot = c_pos % C_SLOTS
        mbarrier.wait(c_ready.index(slot), (c_pos // C_SLOTS) & 1)
        c_tile = c_bufs.index(slot).reshape([ROWS, COLS]).load(layout)
        fence_async_shared()  # generic-proxy reads before the next TMA write of the slot
        gl.thread_barrier()  # every lane has read the slot before the C loader may refill it
        mbarrier.arrive(c_empty.index(slot), count=1)
        value += beta * c_tile.to(gl.float32)
    rows = first_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = first_n + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    value += gl.where(rows[:, None] == cols[None, :], gamma, 0.0)
    return value.to(dtype)


@gluon.jit
def _consumer_blocks(
    state,
    CONSUMER: gl.constexpr,
    CONSUMERS: gl.constexpr,
    SPLIT: gl.constexpr,
    SYRK: gl.constexpr,
    HAS_C: gl.constexpr,
    STORE_SLOTS: gl.constexpr,
):
    """Consumer partition: wgmma over the stages of its tiles, then the epilogue.

    Consumer ``CONSUMER`` takes every ``CONSUMERS``-th tile of this CTA; a tile's K-slices sit
    at ring positions ``local_tile·k_steps + ks`` whichever consumer takes it.
    """
    a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty, out_desc, out_bufs, turns = state[0]
    m, k, total_tiles, tiles_per_matrix, alpha, beta, gamma = state[1]
    scale = (alpha, beta, gamma)
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    CONSUMER_WARPS: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = _acc_layout(CONSUMER_WARPS, BLOCK_C)
    first_slot = CONSUMER * STORE_SLOTS
    stores = 0
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_steps = gl.cdiv(k, BLOCK_K)
    local = CONSUMER
    for tile in range(pid + CONSUMER * programs, total_tiles, CONSUMERS * programs):
        batch_index, first_m, first_n = _tile_origin(tile, tiles_per_matrix, SPLIT)
        acc0 = gl.zeros((BLOCK_C, BLOCK_C), gl.float32, layout)
        acc1 = gl.zeros((BLOCK_C, BLOCK_C), gl.float32, layout)
        # The right block of a diagonal strip lies above the diagonal: not multiplied.
        right = first_n < first_m
        if CONSUMERS == 2:
            # Main loops take turns in tile order: a consumer waits on a stage at most one
            # ring pass ahead of the loader (mbarrier phases are parities), and its MMAs run
            # while the other consumer is in its epilogue.
            n = local // 2
            if CONSUMER == 1:
                mbarrier.wait(turns.index(0), n & 1)
            else:
                mbarrier.wait(turns.index(1), (n - 1) & 1, pred=n > 0)
        pos = local * k_steps
        for ks in range(k_steps):
            stage = pos % STAGES
            mbarrier.wait(ready.index(stage), (pos // STAGES) & 1)
            a = a_bufs.index(stage)
            b0 = _b_view(b_bufs, stage * SPLIT, SYRK)
            # One K-slice's MMAs stay in flight while the next slice is awaited.
            if SPLIT == 2:
                if right:
                    acc0 = warpgroup_mma(a, b0, acc0, is_async=True)
                    b1 = _b_view(b_bufs, stage * SPLIT + 1, SYRK)
                    acc1 = warpgroup_mma(a, b1, acc1, is_async=True)
                    acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
                else:
                    acc0 = warpgroup_mma(a, b0, acc0, is_async=True)
                    acc0 = warpgroup_mma_wait(1, deps=(acc0,))
            else:
                acc0 = warpgroup_mma(a, b0, acc0, is_async=True)
                acc0 = warpgroup_mma_wait(1, deps=(acc0,))
            # The previous stage's MMAs are complete: hand it back to the loader.
            if ks > 0:
                if CONSUMER_WARPS > 4:
                    gl.thread_barrier()  # both warpgroups are past their wait
                mbarrier.arrive(empty.index((pos - 1) % STAGES), count=1)
            pos += 1
        if CONSUMERS == 2:
            mbarrier.arrive(turns.index(CONSUMER), count=1)
        if SPLIT == 2:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(0, deps=(acc0,))
        if CONSUMER_WARPS > 4:
            gl.thread_barrier()
        mbarrier.arrive(empty.index((pos - 1) % STAGES), count=1)

        # The epilogue, block by block: the value (fp32, rounded once), stored by the rule.
        rows_exist = first_m < m
        c_pos = local * SPLIT
        c_ring = (c_bufs, c_ready, c_empty)
        dtype = out_desc.dtype
        value = _tile_value(acc0, c_ring, c_pos, first_m, first_n, scale, dtype, HAS_C)
        stores = _store_block(
            value, out_desc, out_bufs, first_slot, stores, batch_index, first_m, first_n,
            rows_exist, layout, STORE_SLOTS,
        )  # fmt: skip
        if SPLIT == 2:
            first_r = first_n + BLOCK_C
            value = _tile_value(acc1, c_ring, c_pos + 1, first_m, first_r, scale, dtype, HAS_C)
            stores = _store_block(
                value, out_desc, out_bufs, first_slot, stores, batch_index, first_m, first_r,
                rows_exist, layout, STORE_SLOTS,
            )  # fmt: skip
        local += CONSUMERS
    tma.store_wait(0)


@gluon.jit
def _mirror_lower(block):
    """Make a 128×128 shared-memory block on the diagonal exactly symmetric in place:
    ``where(i >= j, v, vᵀ)``, through a plain blocked layout (any layout reads it)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    value = block.load(layout)
    transposed = block.permute((1, 0)).load(layout)
    rows = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
    symmetric = gl.where(rows[:, None] >= cols[None, :], value, transposed)
    gl.thread_barrier()  # every lane has read vᵀ before the block is overwritten
    block.store(symmetric)


@gluon.jit
def _store_wide(value, out_desc, out_bufs, batch_index, first_m, first_n, rows_exist):
    """Store one 128×256 wide tile's rounded value (:func:`_tile_value`): staged whole, then
    stored by the element rule half by half (two 128×128 blocks).

    In place: the left half always (on or below the diagonal), the right half when it is not
    above it; a half on the diagonal is mirrored in shared memory first. Transposed (the
    staging buffer reinterpreted as 256×128): each half strictly below the diagonal.
    """
    if rows_exist:
        staging = out_bufs.index(0)  # 1 × 128 × 256
        tile = staging.reshape([BLOCK_C, 2 * BLOCK_C])
        tma.store_wait(0)  # the previous tile's transposed stores have read the buffer
        tile.store(value)
        gl.thread_barrier()  # the whole tile is staged before a diagonal half is mirrored
        if first_n == first_m:  # first strip of a diagonal super-tile: left half on it
            _mirror_lower(tile.slice(0, BLOCK_C, dim=1))
        elif first_n + BLOCK_C == first_m:  # second strip: right half on it
            _mirror_lower(tile.slice(BLOCK_C, BLOCK_C, dim=1))
        fence_async_shared()
        tma.async_copy_shared_to_global(
            out_desc, [batch_index, first_m, first_n], staging.slice(0, BLOCK_C, dim=2)
        )
        if first_n + BLOCK_C <= first_m:
            tma.async_copy_shared_to_global(
                out_desc,
                [batch_index, first_m, first_n + BLOCK_C],
                staging.slice(BLOCK_C, BLOCK_C, dim=2),
            )
            # The left half lies strictly below the diagonal: its mirror, and the right
            # half's where that one is strictly below too.
            transposed_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [1, 2 * BLOCK_C, BLOCK_C], out_desc.dtype
            )
            flipped = staging._reinterpret(
                out_desc.dtype, [1, 2 * BLOCK_C, BLOCK_C], transposed_layout
            )
            tma.store_wait(0)  # the in-place stores have read the buffer
            flipped.reshape([2 * BLOCK_C, BLOCK_C]).permute((1, 0)).store(value)
            fence_async_shared()
            tma.async_copy_shared_to_global(
                out_desc, [batch_index, first_n, first_m], flipped.slice(0, BLOCK_C, dim=1)
            )
            if first_n + 2 * BLOCK_C <= first_m:
                tma.async_copy_shared_to_global(
                    out_desc,
                    [batch_index, first_n + BLOCK_C, first_m],
                    flipped.slice(BLOCK_C, BLOCK_C, dim=1),
                )


@gluon.jit
def _consumer_wide(state, SYRK: gl.constexpr, HAS_C: gl.constexpr):
    """The one consumer of wide tiles: a 128×256 accumulator, one ``N = 256`` wgmma per
    K-slice (the A slice is read from shared memory once per slice, not once per block),
    then :func:`_store_wide`."""
    a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty, out_desc, out_bufs, turns = state[0]
    m, k, total_tiles, tiles_per_matrix, alpha, beta, gamma = state[1]
    scale = (alpha, beta, gamma)
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    layout: gl.constexpr = _acc_layout(gl.num_warps(), 2 * BLOCK_C)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_steps = gl.cdiv(k, BLOCK_K)
    local = 0
    for tile in range(pid, total_tiles, programs):
        batch_index, first_m, first_n = _tile_origin(tile, tiles_per_matrix, 2)
        acc = gl.zeros((BLOCK_C, 2 * BLOCK_C), gl.float32, layout)
        pos = local * k_steps
        for ks in range(k_steps):
            stage = pos % STAGES
            mbarrier.wait(ready.index(stage), (pos // STAGES) & 1)
            b = _b_view(b_bufs, stage, SYRK)
            acc = warpgroup_mma(a_bufs.index(stage), b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if ks > 0:  # the previous slice's MMA is complete: its stage goes back
                gl.thread_barrier()
                mbarrier.arrive(empty.index((pos - 1) % STAGES), count=1)
            pos += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((pos - 1) % STAGES), count=1)
        rows_exist = first_m < m
        c_ring = (c_bufs, c_ready, c_empty)
        value = _tile_value(acc, c_ring, local, first_m, first_n, scale, out_desc.dtype, HAS_C)
        _store_wide(value, out_desc, out_bufs, batch_index, first_m, first_n, rows_exist)
        local += 1
    tma.store_wait(0)


@gluon.jit
def _consumer(
    state,
    CONSUMER: gl.constexpr,
    CONSUMERS: gl.constexpr,
    SPLIT: gl.constexpr,
    SYRK: gl.constexpr,
    HAS_C: gl.constexpr,
    STORE_SLOTS: gl.constexpr,
    WIDE: gl.constexpr,
):
    """A consumer partition: :func:`_consumer_wide` for wide tiles, else
    :func:`_consumer_blocks`."""
    if WIDE:
        _consumer_wide(state, SYRK, HAS_C)
    else:
        _consumer_blocks(state, CONSUMER, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS)


# Sizes only feed TMA coordinates and loop bounds: specialising on them (==1, %16) would compile
# one binary per shape class for nothing.
@gluon.jit(do_not_specialize=["m", "k", "total_tiles", "tiles_per_matrix"])
def _symmetric_product_gluon_kernel(
    a_desc,
    b_desc,
    c_desc,
    out_desc,
    m,
    k,
    total_tiles,
    tiles_per_matrix,
    alpha,
    beta,
    gamma,
    SPLIT: gl.constexpr,
    STAGES: gl.constexpr,
    C_SLOTS: gl.constexpr,
    CONSUMERS: gl.constexpr,
    SYRK: gl.constexpr,
    HAS_C: gl.constexpr,
    STORE_SLOTS: gl.constexpr,
    WIDE: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    # A wide tile's B slice and C block arrive whole (one load of 256 columns each).
    PARTS: gl.constexpr = 1 if WIDE else SPLIT
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(
        dtype, [STAGES * PARTS] + b_desc.block_type.shape, b_desc.layout
    )
    if WIDE:  # one 128×256 staging buffer, stored from in two halves
        wide_shape: gl.constexpr = [1, BLOCK_C, 2 * BLOCK_C]
        out_bufs = gl.allocate_shared_memory(
            out_desc.dtype,
            [1] + wide_shape,
            gl.NVMMASharedLayout.get_default_for(wide_shape, out_desc.dtype),
        )
    else:
        out_bufs = gl.allocate_shared_memory(
            out_desc.dtype, [CONSUMERS * STORE_SLOTS] + out_desc.block_type.shape, out_desc.layout
        )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if HAS_C:
        c_bufs = gl.allocate_shared_memory(
            c_desc.dtype, [C_SLOTS] + c_desc.block_type.shape, c_desc.layout
        )
        c_ready = gl.allocate_shared_memory(gl.int64, [C_SLOTS, 1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [C_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(C_SLOTS):
            mbarrier.init(c_ready.index(i), count=1)
            mbarrier.init(c_empty.index(i), count=1)
    else:  # never read (HAS_C is False): the operand ring stands in
        c_bufs = a_bufs
        c_ready = ready
        c_empty = empty
    if CONSUMERS == 2:
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
    else:  # never used with one consumer
        turns = ready

    # Partitions take their tensors as one tuple and their constexprs as literal arguments
    # (a constexpr stored in a tuple variable becomes a tensor).
    consumer = (
        (a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty, out_desc, out_bufs, turns),
        (m, k, total_tiles, tiles_per_matrix, alpha, beta, gamma),
    )
    loader = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, m, k, total_tiles, tiles_per_matrix)
    c_loader = (c_desc, c_bufs, c_ready, c_empty, total_tiles, tiles_per_matrix)
    # Registers per thread of the second consumer (the first, the default partition, gets what
    # the register file has left): 4-warp consumers take 232; two 8-warp consumers share 64 Ki
    # registers with the loaders, and at 112 each the products with C compile without spills
    # (sm_90 ptxas; benchmarks/gluon_probe.py --compile-only).
    CONSUMER_REGS: gl.constexpr = 232 if num_warps == 4 else 112
    if CONSUMERS == 2:
        if HAS_C:
            gl.warp_specialize(
                [
                    (_consumer, (consumer, 0, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_consumer, (consumer, 1, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_operand_loader, (loader, SPLIT, SYRK, PARTS)),
                    (_c_loader, (c_loader, SPLIT, PARTS)),
                ],
                [num_warps, 1, 1],
                [CONSUMER_REGS, 40, 40],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, (consumer, 0, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_consumer, (consumer, 1, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_operand_loader, (loader, SPLIT, SYRK, PARTS)),
                ],
                [num_warps, 1],
                [CONSUMER_REGS, 40],
            )
    else:
        if HAS_C:
            gl.warp_specialize(
                [
                    (_consumer, (consumer, 0, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_operand_loader, (loader, SPLIT, SYRK, PARTS)),
                    (_c_loader, (c_loader, SPLIT, PARTS)),
                ],
                [1, 1],
                [40, 40],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, (consumer, 0, CONSUMERS, SPLIT, SYRK, HAS_C, STORE_SLOTS, WIDE)),
                    (_operand_loader, (loader, SPLIT, SYRK, PARTS)),
                ],
                [1],
                [40],
            )


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _gl_dtype(dtype: torch.dtype):
    return {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[
        dtype
    ]


def _is_row_major(t: Tensor) -> bool:
    return t.is_contiguous()


def unsupported_reason(a: Tensor, b: Tensor | None, c: Tensor | None = None) -> str | None:
    """Why the Gluon kernel cannot take these operands, or ``None`` if it can."""
    if a.dtype not in SUPPORTED_DTYPES:
        return f"dtype {a.dtype} is not one of {SUPPORTED_DTYPES}"
    if a.dim() not in (2, 3):
        return f"a must be 2-D or 3-D, got shape {tuple(a.shape)}"
    if not _is_row_major(a):
        return "a must be contiguous (row-major); pass a.contiguous()"
    m, k = a.shape[-2], a.shape[-1]
    if k == 0:
        return "k=0 (an empty inner dimension): the product is beta·C + gamma·I, no kernel needed"
    size = a.element_size()
    if (k * size) % 16 or (m * size) % 16:
        return f"rows must be 16-byte aligned for TMA: m={m} and k={k} must be multiples of 8"
    if a.data_ptr() % 16:
        return "a's base address must be 16-byte aligned"
    if b is not None:
        if b.dtype != a.dtype:
            return f"operand dtypes differ ({a.dtype} vs {b.dtype})"
        if b.shape[:-2] != a.shape[:-2] or tuple(b.shape[-2:]) != (k, m):
            return f"b must have shape {tuple(a.shape[:-2]) + (k, m)}, got {tuple(b.shape)}"
        if not _is_row_major(b) or b.data_ptr() % 16:
            return "b must be contiguous (row-major, 16-byte aligned); pass b.contiguous()"
    if c is not None:
        if tuple(c.shape) != tuple(a.shape[:-2]) + (m, m):
            return f"c must have shape {tuple(a.shape[:-2]) + (m, m)}, got {tuple(c.shape)}"
        if c.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"c dtype {c.dtype} is not fp16/bf16/fp32"
        if not c.is_contiguous() or c.data_ptr() % 16:
            return "c must be contiguous and 16-byte aligned; pass c.contiguous()"
    return None


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def gluon_supported(a: Tensor, b: Tensor | None, c: Tensor | None = None) -> bool:
    """Whether :func:`launch_gluon_kernel` can run these operands here (SM90 and the layout)."""
    if not a.is_cuda or _capability(a.device.index)[0] != 9:
        return False
    return unsupported_reason(a, b, c) is None


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype):
    """A tile's shared-memory layout: built once per (block, dtype), not per launch (four
    descriptors a launch made building it a visible share of the launcher's host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(t: Tensor, shape: list, strides: list, block: list):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape, strides, block, _shared_layout(tuple(block), t.dtype))


def lower_tile_count(m: int, batch: int, split: int) -> tuple[int, int]:
    """``(tiles per matrix, tiles in the stack)`` of the lower-triangle walk."""
    side = triton.cdiv(m, BLOCK * split)
    per_matrix = side * (side + 1) // 2 * split
    return per_matrix, batch * per_matrix


def kernel_arguments(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    out: Tensor,
    alpha: float,
    beta: float,
    gamma: float,
    config: GluonConfig,
) -> tuple[tuple, dict]:
    """``(positional arguments, constexprs and launch options)`` of one launch."""
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    bk = config.block_k
    cols = config.cols if config.wide else BLOCK  # columns of one B load and one C load
    a_desc = _descriptor(a, [batch * m, k], [k, 1], [BLOCK, bk])
    if b is None:
        b_desc = _descriptor(a, [batch * m, k], [k, 1], [cols, bk])
    else:  # 3-D: a K-slice past k is zero-filled instead of reading the next matrix
        b_desc = _descriptor(b, [batch, k, m], [k * m, m, 1], [1, bk, cols])
    out_desc = _descriptor(out, [batch, m, m], [m * m, m, 1], [1, BLOCK, BLOCK])
    has_c = c is not None and beta != 0.0
    c_desc = _descriptor(c, [batch, m, m], [m * m, m, 1], [1, BLOCK, cols]) if has_c else out_desc
    per_matrix, total = lower_tile_count(m, batch, config.split)
    args = (a_desc, b_desc, c_desc, out_desc, m, k, total, per_matrix)
    args += (float(alpha), float(beta), float(gamma))
    options = dict(
        SPLIT=config.split,
        STAGES=config.stages,
        C_SLOTS=config.c_slots,
        CONSUMERS=config.consumers,
        SYRK=b is None,
        HAS_C=has_c,
        STORE_SLOTS=config.store_slots,
        WIDE=config.wide,
        num_warps=config.num_warps,
    )
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return args, options


def launch_gluon_kernel(
    a: Tensor,
    b: Tensor | None,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    out: Tensor | None = None,
    config: GluonConfig = DEFAULT_CONFIG,
    num_sms: int | None = None,
) -> Tensor:
    """``alpha·a·aᵀ`` (``b=None``) or ``alpha·a·b``, ``+ beta·c + gamma·I``, exactly symmetric.

    The contract of ``symmetric_product.launch_symmetric_product`` for the layouts the Gluon
    kernel reads (module docstring); anything else raises ``ValueError`` naming the fix.
    ``out``, if given, must be contiguous with the result's shape and dtype.
    """
    why = unsupported_reason(a, b, c)
    if why is not None:
        raise ValueError(f"Gluon symmetric-product kernel: {why}")
    if not a.is_cuda or _capability(a.device.index)[0] != 9:
        raise ValueError(
            "Gluon symmetric-product kernel: needs an SM90 (Hopper) GPU; "
            "use launch_symmetric_product elsewhere"
        )
    out = product_output(a, out, "Gluon symmetric-product kernel")
    if out.numel() == 0:
        return out
    has_c = c is not None and beta != 0.0
    need = config.smem_bytes(a.element_size(), c.element_size() if has_c else None, 2)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"Gluon symmetric-product kernel: {config.name} needs {need} bytes of shared memory "
            f"(> {SMEM_LIMIT}); use fewer stages or C slots"
        )
    args, options = kernel_arguments(a, b, c, out, alpha, beta, gamma, config)
    if num_sms is None:
        num_sms = multiprocessor_count(a.device.index)
    programs = max(1, min(args[6], num_sms))
    _symmetric_product_gluon_kernel[(programs,)](*args, **options)
    return out
