"""What the symmetric-product kernels share: the tile configuration, the lower-triangle
schedule, the symmetric epilogue, and the host-side arithmetic of a launch.

Schedule. Only the ``T·(T+1)/2`` lower-triangle super-tiles of each ``m×m`` output
(``T = ⌈m/BLOCK_N⌉``, each ``BLOCK_N`` square) are computed, each as ``BLOCK_N/BLOCK_M`` row
strips of ``BLOCK_M × BLOCK_N`` (one program tile each; on a diagonal super-tile the part of a
strip above the diagonal is computed but not stored). A *persistent* grid of
``min(tiles, SMs·ctas_per_sm)`` programs walks the flat index
``tile = batch_index·tiles_per_matrix + t``; ``t // strips`` maps to the super-tile
``(row, col)`` with ``col ≤ row`` by the square-root formula ``row = ⌊(√(8t+1) − 1)/2⌋``
(corrected by one where fp32 rounding lands on the wrong side), ``col = t − row·(row+1)/2``
(:func:`_lower_tile_coords`). A stack of same-shape matrices is one launch: batching is what
fills the chip for small ``m``.

Epilogue (fp32): ``acc·alpha + beta·C + gamma·I``; each element ``(i, j)`` of a tile with
``i ≥ j`` is written in place, and with ``i > j`` also mirrored to ``(j, i)``
(:func:`_store_symmetric_tile`). Every lower element lies in exactly one strip, so every output
element comes from exactly one fp32 value and the result is bitwise symmetric — the same rule as
the reference in ``ops.py``.

Launch metadata. Every kernel that is launched from the host is decorated with
``@triton.jit(launch_metadata=...)``: a function of ``(grid, compiled-kernel metadata,
{argument name: value})`` that Triton calls only when a launch hook is installed (Triton's
profiler, proton, reads ``name``, ``flops8/16/32/64`` and ``bytes``). :func:`product_metadata`
is the one formula both product kernels report; ``TRITON_INTERPRET=1`` never calls it.

This module and the kernel modules import only triton and torch and register nothing, so a test
can load a second, interpreted copy of them under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
C_LOADS = ("pointer", "prologue", "tma")


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
    # Where the TMA kernel reads beta·C: "pointer" (masked loads in the epilogue), "prologue"
    # (by TMA into the accumulator's start, before the K loop) or "tma" (by TMA in the epilogue
    # of tiles below the diagonal, half a strip at a time). See kernels/syrk_tma.py.
    c_load: str = "pointer"

    def __post_init__(self) -> None:
        if self.block_n and self.block_n % self.block:
            raise ValueError(
                f"TileConfig: block_n={self.block_n} must be a multiple of block={self.block}"
            )
        if self.c_load not in C_LOADS:
            raise ValueError(f"TileConfig: c_load={self.c_load!r}: choose one of {C_LOADS}")
        if (self.flatten or self.tma_store or self.c_load != "pointer") and not self.tma:
            raise ValueError(
                "TileConfig: flatten=True, tma_store=True and c_load other than 'pointer' belong "
                "to the TMA kernel; set tma=True too"
            )
        if self.c_load == "tma" and not self.tma_store:
            raise ValueError("TileConfig: c_load='tma' reads C where tma_store=True stores tiles")

    kernel = "triton"  # how an autotune verdict names the kernel (GluonConfig: "gluon")

    @property
    def cols(self) -> int:
        return self.block_n or self.block

    @property
    def name(self) -> str:
        shape = f"b{self.block}" if self.cols == self.block else f"b{self.block}x{self.cols}"
        loads = (
            (
                "_tma"
                + ("_flat" if self.flatten else "")
                + ("_st" if self.tma_store else "")
                + {"pointer": "", "prologue": "_cp", "tma": "_ct"}[self.c_load]
            )
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
            c_load=str(data.get("c_load", "pointer")),
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
def _store_symmetric_tile(
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
    HAS_C: tl.constexpr,
):
    """fp32 epilogue ``alpha·acc + beta·C + gamma·I`` of one tile, stored with its mirror.

    ``c_strides`` and ``out_strides`` are ``(batch, row, col)`` strides, ``coeffs`` is
    ``(alpha, beta, gamma)``.
    """
    value = _epilogue_value(
        acc, offs_m, offs_n, batch64, m, c_ptr, c_strides, coeffs, out_ptr.dtype.element_ty, HAS_C
    )
    in_bounds = (offs_m[:, None] < m) & (offs_n[None, :] < m)

    # Element rule, the same for every tile: (i, j) with i >= j is stored in place, and
    # i > j also at (j, i). Off the diagonal super-tiles every element qualifies; on them
    # the upper part of a strip was computed but is never stored.
    out_base = out_ptr + batch64 * out_strides[0]
    lower_mask = in_bounds & (offs_m[:, None] >= offs_n[None, :])
    tl.store(
        out_base + offs_m[:, None] * out_strides[1] + offs_n[None, :] * out_strides[2],
        value,
        mask=lower_mask,
    )
    # The mirror is stored as the transposed tile, indexed (n, m), so consecutive lanes
    # write consecutive addresses (the transpose goes through shared memory) instead of
    # one element per output row.
    mirror_mask = (
        (offs_n[:, None] < m) & (offs_m[None, :] < m) & (offs_m[None, :] > offs_n[:, None])
    )
    tl.store(
        out_base + offs_n[:, None] * out_strides[1] + offs_m[None, :] * out_strides[2],
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
    c_strides,
    coeffs,
    OUT_DTYPE: tl.constexpr,
    HAS_C: tl.constexpr,
):
    """``alpha·acc + beta·C + gamma·I`` in fp32, rounded once to the output dtype (``coeffs``
    is ``(alpha, beta, gamma)``; ``HAS_C=False`` when C is absent or already in ``acc``)."""
    in_bounds = (offs_m[:, None] < m) & (offs_n[None, :] < m)
    acc = acc * coeffs[0]
    if HAS_C:
        c_tile = tl.load(
            c_ptr
            + batch64 * c_strides[0]
            + offs_m[:, None] * c_strides[1]
            + offs_n[None, :] * c_strides[2],
            mask=in_bounds,
            other=0.0,
        )
        acc += coeffs[1] * c_tile.to(tl.float32)
    acc += tl.where(offs_m[:, None] == offs_n[None, :], coeffs[2], 0.0)
    return acc.to(OUT_DTYPE)


@functools.cache
def multiprocessor_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def product_output(a: Tensor, out: Tensor | None, kernel: str) -> Tensor:
    """The output of a symmetric product of ``a`` (``(…, m, k)`` → ``(…, m, m)``, ``a``'s
    dtype): a new tensor, or ``out`` checked to be contiguous with that shape and dtype
    (tests pass a poisoned ``out`` to prove every element is written). ``kernel`` names the
    caller in the error."""
    m = a.shape[-2]
    out_shape = tuple(a.shape[:-2]) + (m, m)
    if out is None:
        return torch.empty(out_shape, dtype=a.dtype, device=a.device)
    if tuple(out.shape) != out_shape or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(
            f"{kernel}: out must be contiguous {out_shape} {a.dtype}, "
            f"got {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}"
        )
    return out


def stack_strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, row, col) strides; batch stride 0 for a 2-D tensor viewed as a stack of one."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def lower_tile_count(m: int, batch: int, config: TileConfig) -> int:
    """Program tiles of the lower-triangle walk: ``batch·T·(T+1)/2`` super-tiles of ``strips``."""
    tiles_per_side = triton.cdiv(m, config.cols)
    return batch * tiles_per_side * (tiles_per_side + 1) // 2 * (config.cols // config.block)


def persistent_programs(work_items: int, num_sms: int, config: TileConfig) -> int:
    """Size of the persistent grid: one program per work item, at most ``ctas_per_sm`` per SM."""
    return max(1, min(work_items, num_sms * config.ctas_per_sm))


def epilogue_operand(c: Tensor | None, out: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """``(c_ptr argument, its strides)``; without ``c``, ``out`` stands in as a valid pointer that
    is never read (``HAS_C`` is False)."""
    if c is None:
        return out, (0, 0, 0)
    return c, stack_strides(c)


def tile_constexprs(a: Tensor, c: Tensor | None, beta: float, config: TileConfig) -> dict:
    """Compile-time switches and launch options both product kernels take from a config."""
    return dict(
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


def product_metadata(
    loads: str,
    *,
    syrk: bool,
    batch: int,
    m: int,
    k: int,
    operand_size: int,
    c_size: int,
    out_size: int,
    tile: tuple[int, int, int],
) -> dict:
    """Launch metadata of one symmetric-product launch (see the module docstring).

    ``flops`` counts the useful products of the lower triangle, ``2·k`` per element ``i ≥ j``:
    ``batch·m·(m+1)·k``, half a general product plus the diagonal (the kernels' padding and the
    upper parts of diagonal tiles are not counted, so a trace's FLOP/s is comparable with a
    GEMM's). The key carries the operands' width, ``flops16`` for fp16/bf16, ``flops32`` for
    fp32. ``bytes`` is each operand element read once (``b`` only for ``sym_mm``; ``c``'s lower
    triangle when the ``beta·C`` term is loaded, ``c_size = 0`` otherwise) and the whole output
    written once. The name says the op, the loads, the shape and the tile.
    """
    lower = m * (m + 1) // 2
    operands = (1 if syrk else 2) * m * k * operand_size
    op = "syrk" if syrk else "sym_mm"
    return {
        "name": f"{op}_{loads} {m}x{k} b{batch} {tile[0]}x{tile[1]}x{tile[2]}",
        f"flops{8 * operand_size}": 2 * batch * lower * k,
        "bytes": batch * (operands + lower * c_size + m * m * out_size),
    }
