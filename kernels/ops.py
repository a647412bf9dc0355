"""Custom ops of the Newton–Schulz chain: ``torch.ops.dmuon.syrk`` and ``torch.ops.dmuon.sym_mm``.

Both compute a *symmetric* result, so a kernel only needs its lower-triangle tiles:

- ``syrk(x, c, alpha, beta, gamma)   = alpha·x·xᵀ + beta·c + gamma·I``
- ``sym_mm(a, b, c, alpha, beta, gamma) = alpha·a·b + beta·c + gamma·I`` where the caller
  guarantees ``a·b`` is symmetric (``a`` and ``b`` are commuting symmetric matrices, e.g.
  polynomials of the same Gram matrix).

Inputs are 2-D ``(m, k)`` or batched 3-D ``(batch, m, k)``; ``c`` may be ``None``. The result
has the input dtype; products accumulate in fp32 and the ``beta·c + gamma·I`` epilogue runs in
fp32, as the Triton kernels do. The implementation registered here is the torch reference
and runs on every device; ``dmuon_compile.kernels.syrk`` overrides it on CUDA with Triton.
The reference mirrors its lower triangle, so its output is exactly symmetric too.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_operands(name: str, a: Tensor, b: Tensor | None, c: Tensor | None) -> None:
    if a.dim() not in (2, 3):
        raise ValueError(f"dmuon::{name}: expected a 2-D or 3-D tensor, got shape {tuple(a.shape)}")
    if b is not None and (b.shape[:-2] != a.shape[:-2] or b.shape[-2] != a.shape[-1]):
        raise ValueError(
            f"dmuon::{name}: operand shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply"
        )
    m = a.shape[-2]
    if c is not None and tuple(c.shape) != tuple(a.shape[:-2]) + (m, m):
        raise ValueError(
            f"dmuon::{name}: c has shape {tuple(c.shape)}, expected {tuple(a.shape[:-2]) + (m, m)}"
        )


def mirror_lower(acc: Tensor) -> Tensor:
    """Return the symmetric matrix whose lower triangle is ``acc``'s (batched over dim 0)."""
    lower = torch.tril(acc)
    return lower + torch.tril(acc, diagonal=-1).mT


def symmetric_epilogue(
    product_fp32: Tensor,
    c: Tensor | None,
    alpha: float,
    beta: float,
    gamma: float,
    dtype: torch.dtype,
) -> Tensor:
    """fp32 ``alpha·product + beta·c + gamma·I`` mirrored from the lower triangle, cast to dtype."""
    acc = product_fp32 * alpha if alpha != 1.0 else product_fp32
    if c is not None and beta != 0.0:
        acc = acc + beta * c.float()
    if gamma != 0.0:
        acc = acc + gamma * torch.eye(acc.shape[-1], device=acc.device, dtype=acc.dtype)
    return mirror_lower(acc).to(dtype).contiguous()


def syrk_reference(x: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float) -> Tensor:
    xf = x.float()
    return symmetric_epilogue(xf @ xf.mT, c, alpha, beta, gamma, x.dtype)


def sym_mm_reference(
    a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float
) -> Tensor:
    return symmetric_epilogue(a.float() @ b.float(), c, alpha, beta, gamma, a.dtype)


@torch.library.custom_op("dmuon::syrk", mutates_args=())
def syrk(x: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float) -> Tensor:
    """``alpha·x·xᵀ + beta·c + gamma·I`` (symmetric; lower tiles computed, mirror written)."""
    _check_operands("syrk", x, None, c)
    return syrk_reference(x, c, alpha, beta, gamma)


@syrk.register_fake
def _syrk_fake(x: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float) -> Tensor:
    m = x.shape[-2]
    return x.new_empty(tuple(x.shape[:-2]) + (m, m))


@torch.library.custom_op("dmuon::sym_mm", mutates_args=())
def sym_mm(
    a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float
) -> Tensor:
    """``alpha·a·b + beta·c + gamma·I`` for a product the caller knows to be symmetric."""
    _check_operands("sym_mm", a, b, c)
    if a.shape[-2] != b.shape[-1]:
        raise ValueError(
            "dmuon::sym_mm: a·b must be square to be symmetric, "
            f"got {tuple(a.shape)}·{tuple(b.shape)}"
        )
    return sym_mm_reference(a, b, c, alpha, beta, gamma)


@sym_mm.register_fake
def _sym_mm_fake(
    a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, gamma: float
) -> Tensor:
    m = a.shape[-2]
    return a.new_empty(tuple(a.shape[:-2]) + (m, m))
