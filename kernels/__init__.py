"""Kernels for the Newton–Schulz chain, installed as ``dmuon_compile.kernels``.

``ops`` defines the project's custom ops (``torch.ops.dmuon.*``) with a torch reference
implementation for every device; the Triton kernels register themselves as the CUDA
implementation when Triton and a CUDA GPU are present.
"""

from dmuon_compile.kernels import ops  # noqa: F401  (registers torch.ops.dmuon.*)
from dmuon_compile.kernels.availability import triton_status

__all__ = ["ops", "triton_status"]
