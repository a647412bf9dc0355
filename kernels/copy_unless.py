"""``dst ← src`` only where a flag on the device is false, reading nothing else when it is true.

The compiled Muon step leaves its verdict (commit or not) on the device so that the host never
waits for the step. With ``Muon(keep_new_momentum=True)`` the commit swaps the storage of each
momentum buffer for the new momentum the directions computed (no bytes moved) and must undo
that where the verdict turns out false: the old values copied back into the new storage. A
``torch.where(ok, new, old)`` would read both tensors and write one on every step; this
kernel's programs read the flag first and return at once when it is true, so a committing step
pays one launch and a scalar load per program.

Only contiguous CUDA tensors of one dtype and shape (and CPU tensors under ``TRITON_INTERPRET=1``,
as the tests run it) take the kernel; anything else runs :func:`copy_unless_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # values per loop iteration of one program
PROGRAMS_PER_SM = 4  # a persistent grid: a committing step launches few programs


@triton.jit
def _copy_unless_kernel(flag_ptr, dst_ptr, src_ptr, numel, BLOCK: tl.constexpr):
    keep = tl.load(flag_ptr)
    if keep == 0:
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for first in range(start, numel, step):
            offsets = first + tl.arange(0, BLOCK)
            inside = offsets < numel
            tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=inside), mask=inside)


def copy_unless_reference(flag: Tensor, dst: Tensor, src: Tensor) -> Tensor:
    """``dst`` ← ``where(flag, dst, src)`` in place (torch ops: reads both, writes ``dst``).

    >>> dst, src = torch.zeros(3), torch.ones(3)
    >>> copy_unless_reference(torch.tensor(False), dst, src)
    tensor([1., 1., 1.])
    """
    return dst.copy_(torch.where(flag, dst, src))


def _programs(device: torch.device, numel: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the interpreter: a few programs, each walking several blocks
        sms = 1
    return max(1, min(triton.cdiv(numel, BLOCK), sms * PROGRAMS_PER_SM))


def copy_unless(flag: Tensor, dst: Tensor, src: Tensor) -> Tensor:
    """``dst`` ← ``src`` if the 0-d bool ``flag`` is false, else nothing; returns ``dst``.

    Same values as :func:`copy_unless_reference`; on CUDA no host read of ``flag`` and, when
    it is true, none of ``dst`` or ``src`` either.
    """
    if flag.numel() != 1 or flag.dtype != torch.bool:
        raise ValueError(f"copy_unless needs a one-value bool flag, got {flag.dtype} {flag.shape}")
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
        raise ValueError(
            f"copy_unless copies like into like: dst {dst.dtype} {tuple(dst.shape)} on "
            f"{dst.device}, src {src.dtype} {tuple(src.shape)} on {src.device}"
        )
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if (
        not (dst.is_cuda or interpreting)
        or not (dst.is_contiguous() and src.is_contiguous())
        or flag.device != dst.device
        or dst.numel() == 0
    ):
        return copy_unless_reference(flag.to(dst.device), dst, src)
    numel = dst.numel()
    grid = (_programs(dst.device, numel),)
    _copy_unless_kernel[grid](flag.reshape(()), dst, src, numel, BLOCK=BLOCK, num_warps=4)
    return dst
