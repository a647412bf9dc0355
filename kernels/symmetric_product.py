"""Entry point of the symmetric-product kernels: ``alpha·A·B + beta·C + gamma·I``, lower tiles.

:func:`launch_symmetric_product` checks the operands, allocates the output and sends the launch
to one of two kernels that share the schedule and epilogue of ``lower_tiles.py``:

- ``syrk_tma.py``: operand tiles through TMA descriptors (SM90+, 16-byte aligned row- or
  column-major operands; ``TileConfig(tma=True)``), with the balanced two-strip schedule and,
  with ``tma_store=True``, off-diagonal tiles stored through output descriptors;
- ``syrk_pointer.py``: operand tiles through pointers, any strides (every other config, and the
  TMA configs' fallback where the descriptors cannot read the layout).

``mirror.py`` holds the kernel that makes a cuBLAS product exactly symmetric. The variants of a
kernel are ``tl.constexpr`` switches of one source rather than rendered files: they differ only
in branches Triton removes at compile time, one readable source is easier to test through
``TRITON_INTERPRET=1`` than a renderer, and Triton's own cache keys compiled binaries on the
constexpr values.
"""

from __future__ import annotations

from dmuon_compile.kernels.lower_tiles import (
    SUPPORTED_DTYPES,
    TileConfig,
    multiprocessor_count,
    product_output,
)
from dmuon_compile.kernels.syrk_pointer import launch_pointer_kernel
from dmuon_compile.kernels.syrk_tma import launch_tma_kernel, tma_descriptors
from torch import Tensor

__all__ = ["TileConfig", "launch_symmetric_product"]


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
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"symmetric-product kernel: dtype {a.dtype} is not one of {SUPPORTED_DTYPES}"
        )
    if b is not None and b.dtype != a.dtype:
        raise TypeError(f"symmetric-product kernel: operand dtypes differ ({a.dtype} vs {b.dtype})")
    if a.dim() not in (2, 3):
        raise ValueError(
            f"symmetric-product kernel: expected 2-D or 3-D input, got {tuple(a.shape)}"
        )
    out = product_output(a, out, "symmetric-product kernel")
    if out.numel() == 0:
        return out
    if num_sms is None:
        num_sms = multiprocessor_count(a.device.index) if a.is_cuda else 4
    descriptors = tma_descriptors(a, b, config) if config.tma else None
    if descriptors is not None:
        return launch_tma_kernel(a, b, c, alpha, beta, gamma, config, num_sms, out, descriptors)
    # Pointer loads: any strides (and the TMA configs' fallback for layouts TMA cannot read).
    return launch_pointer_kernel(a, b, c, alpha, beta, gamma, config, num_sms, out)
