"""The CPU equivalence test on CUDA + NCCL, one GPU per rank: streams, storage resize, NCCL order.

Needs 2 GPUs (skipped with fewer: one rank would test nothing distributed). On a one-GPU machine
the same check runs with 2 ranks sharing ``cuda:0`` over gloo in the multi-rank CUDA tier
(``tests/distributed/test_gpu_tier.py``). fp32 everywhere (TF32 off), the CPU tolerances.
"""

from __future__ import annotations

import pytest
import torch

from .test_dedicated_training import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} CUDA GPUs (one NCCL rank per GPU); one GPU: the multi-rank CUDA tier",
)
def test_fsdp2_dedicated_matches_single_process_on_gpus():
    torch.backends.cuda.matmul.allow_tf32 = False
    check_against_reference(WORLD, "cuda", backend="nccl")
