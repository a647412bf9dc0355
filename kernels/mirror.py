"""The mirror kernel: a square stack made exactly symmetric from its lower triangle, in place.

cuBLAS computes a full product whose two triangles may differ in the last bit; the CUDA path of
``syrk.py`` mirrors its lower triangle with this kernel (one launch, half a matrix read and half
written) so that every backend's result is bitwise symmetric.
"""

from __future__ import annotations

import triton
import triton.language as tl
from dmuon_compile.kernels.lower_tiles import _lower_tile_coords, stack_strides
from torch import Tensor


def _mirror_launch_metadata(grid, metadata, args) -> dict:
    """Profiler name and bytes of one mirror launch: the strict lower triangle read, the strict
    upper one written (no FLOPs)."""
    p, m = args["p_ptr"], args["m"]
    batch = p.shape[0] if p.dim() == 3 else 1
    return {
        "name": f"mirror_lower {m}x{m} b{batch}",
        "bytes": batch * m * (m - 1) * p.element_size(),
    }


@triton.jit(launch_metadata=_mirror_launch_metadata)
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
    sb, sm, sn = stack_strides(p)
    _mirror_lower_kernel[grid](p, m, sb, sm, sn, BLOCK=block, num_warps=4)
    return p
