"""One-pass ``g / denom`` rounded to the NS work dtype: the eager normalisation's fast path.

``NewtonSchulz`` starts every orthogonalisation with ``X = g / (‖g‖_F + eps)`` in fp32, cast to
fp16. Written in torch ops on a half-precision gradient that is either two fp32 temporaries
the size of ``g`` or, with ``torch.div(..., out=half)``, PyTorch's dynamically casting
elementwise loop, which is not vectorised (a sizeable share of a batched Gram NS).
This kernel reads ``g`` once in its own dtype and writes the work dtype once: the bandwidth
floor.

The arithmetic is the reference's exactly: upcast to fp32 (exact), IEEE-rounded division by
the matrix's fp32 ``denom`` (``div_rn``), one round-to-nearest-even cast on the store. So the
kernel and :func:`scale_cast_reference` agree bit for bit, which the tests check.

Only contiguous CUDA tensors take the kernel; anything else runs the reference.

Launch metadata (``@triton.jit(launch_metadata=...)``, read by Triton's profiler, proton, as for
the other kernels: ``kernels/lower_tiles.py``): the name says the shape and the two dtypes,
``flops32`` counts one fp32 division per element, ``bytes`` is ``g`` read once, one fp32
denominator per matrix and the output written once (the bandwidth floor above).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048  # elements per program: 8 warps × 32 lanes × 8 contiguous values


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scale_cast_launch_metadata(grid, metadata, args) -> dict:
    """Profiler name, FLOPs and bytes of one launch (see the module docstring)."""
    g, out, denom = args["g_ptr"], args["out_ptr"], args["denom_ptr"]
    m, n = g.shape[-2], g.shape[-1]
    batch = args["numel"] // args["per_matrix"]
    return {
        "name": f"scale_cast {m}x{n} b{batch} {_short(g.dtype)}->{_short(out.dtype)}",
        "flops32": args["numel"],
        "bytes": args["numel"] * (g.element_size() + out.element_size())
        + batch * denom.element_size(),
    }


@triton.jit(launch_metadata=_scale_cast_launch_metadata)
def _scale_cast_kernel(g_ptr, denom_ptr, out_ptr, numel, per_matrix, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    values = tl.load(g_ptr + offsets, mask=inside).to(tl.float32)
    denom = tl.load(denom_ptr + offsets // per_matrix, mask=inside, other=1.0)
    scaled = tl.math.div_rn(values, denom)
    tl.store(
        out_ptr + offsets,
        scaled.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=inside,
    )


def scale_cast_reference(g: Tensor, denom: Tensor, dtype: torch.dtype) -> Tensor:
    """``g / denom`` computed in ``denom``'s dtype and rounded once to ``dtype`` (torch ops).

    ``denom`` has one value per matrix (shape ``(..., 1, 1)``). The result keeps ``g``'s layout.

    >>> g = torch.ones(2, 2, dtype=torch.bfloat16)
    >>> scale_cast_reference(g, torch.full((1, 1), 4.0), torch.float16)
    tensor([[0.2500, 0.2500],
            [0.2500, 0.2500]], dtype=torch.float16)
    """
    out = torch.empty_like(g, dtype=dtype)
    return torch.div(g, denom, out=out)


def scale_cast(g: Tensor, denom: Tensor, dtype: torch.dtype) -> Tensor:
    """``g / denom`` rounded once to ``dtype``: the Triton kernel on contiguous CUDA inputs.

    ``g`` is a ``(m, n)`` matrix or a ``(batch, m, n)`` stack; ``denom`` holds one fp32 value
    per matrix, shaped ``(1, 1)`` / ``(batch, 1, 1)`` (what ``vector_norm(..., keepdim=True)``
    returns). Same bits as :func:`scale_cast_reference`.
    """
    if g.dim() not in (2, 3) or denom.numel() != (g.shape[0] if g.dim() == 3 else 1):
        raise ValueError(
            f"scale_cast needs a (m, n) or (batch, m, n) tensor and one denominator per matrix, "
            f"got g {tuple(g.shape)} and denom {tuple(denom.shape)}"
        )
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests run it on CPU tensors
    if (
        not (g.is_cuda or interpreting)
        or not g.is_contiguous()
        or denom.dtype != torch.float32
        or g.numel() == 0
    ):
        return scale_cast_reference(g, denom, dtype)
    out = torch.empty_like(g, dtype=dtype)
    per_matrix = g.shape[-2] * g.shape[-1]
    grid = (triton.cdiv(g.numel(), BLOCK),)
    _scale_cast_kernel[grid](
        g, denom.contiguous(), out, g.numel(), per_matrix, BLOCK=BLOCK, num_warps=8
    )
    return out
