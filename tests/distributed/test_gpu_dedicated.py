"""The CPU equivalence test on CUDA + NCCL (1 or 2 GPUs): streams, storage resize, NCCL order.

Run on a GPU machine: ``pytest tests/distributed/test_gpu_dedicated.py``. fp32 everywhere
(TF32 off), the same tolerances as on CPU.
"""

from __future__ import annotations

import pytest
import torch

from .test_dedicated_training import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_dedicated_matches_single_process_on_gpus():
    torch.backends.cuda.matmul.allow_tf32 = False
    world = min(2, torch.cuda.device_count())
    check_against_reference(world, "cuda")
