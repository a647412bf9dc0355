"""Kernels for the Newton–Schulz chain, installed as ``dmuon_compile.kernels``.

``ops`` defines the project's custom ops (``torch.ops.dmuon.*``) with a torch reference
implementation for every device; the Triton kernels (``syrk``) register themselves as the CUDA
implementation when Triton is importable. A machine without Triton still imports this package
(CUDA then runs the torch reference); ``TRITON_KERNELS_IMPORT_ERROR`` says why.
"""

from dmuon_compile.kernels import ops  # noqa: F401  (registers torch.ops.dmuon.*)
from dmuon_compile.kernels.availability import triton_status
from dmuon_compile.kernels.consistency import check_ns_backend_consistent

try:
    from dmuon_compile.kernels import syrk  # noqa: F401  (registers the CUDA kernels)

    TRITON_KERNELS_IMPORT_ERROR: str | None = None
except ImportError as _exc:  # pragma: no cover - depends on the environment
    TRITON_KERNELS_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

__all__ = ["ops", "triton_status", "check_ns_backend_consistent", "TRITON_KERNELS_IMPORT_ERROR"]
