"""Whether the Triton kernel path can run here, and why not when it cannot."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_status(device_index: int | None = None) -> tuple[bool, str]:
    """Return ``(available, reason)`` for the Triton SYRK kernels on the current CUDA device.

    >>> ok, why = triton_status()
    """
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") == "1":
            return False, "no CUDA device (TRITON_INTERPRET=1 runs kernels only in tests)"
        return False, "no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - CUDA torch ships triton
        return False, f"triton is not importable ({exc}); pip install 'dmuon_compile[triton]'"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return False, f"SM{major}{minor} < SM80: the kernels need Ampere or newer"
    return True, f"SM{major}{minor}"


def device_tag(device: torch.device | None = None) -> str:
    """``"SM90"`` on a CUDA device, ``"CPU"`` otherwise."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"SM{major}{minor}"
    return device.type.upper()
