"""Expert stacks on the multi-rank CUDA tier: ranks share ``cuda:0`` over gloo, on CUDA tensors
(see test_gpu_tier.py). FSDP2-sharded expert stacks (each rank its whole experts) and dedicated
dense matrices, eager and compiled, HSDP with the stacks dedicated whole and with the stacks
orthogonalised once per job: equal to one process on the same device.
``DMUON_TIER_DEVICE=cpu`` runs them on the CPU.

Expert parallelism too (stacks ``Shard(0)`` over an ``ep`` mesh, with and without FSDP2 over the
expert-data-parallel mesh). Not ``Shard(1)`` expert FSDP: the step's redistribution to whole
experts runs DTensor's functional collectives, which crash on CUDA tensors over gloo on torch
2.11 (NCCL runs them); the CPU tests cover it.
"""

from __future__ import annotations

import pytest

from .test_gpu_tier import _fp32_matmuls  # noqa: F401 - the tier's autouse fixture (fp32 refs)
from .test_moe_dedicated import check_expert_once, check_expert_parallel, check_expert_stacks

pytestmark = [pytest.mark.gpu, pytest.mark.tier, pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fsdp2_sharded_expert_stacks_match_single_process(tier_device, compile, cache_dir):
    check_expert_stacks(2, 1, False, device=tier_device, compile=compile)


def test_hsdp_dedicated_expert_stacks_match_single_process(tier_device):
    check_expert_stacks(2, 2, True, device=tier_device)


def test_hsdp_expert_stacks_once_per_job_match_single_process(tier_device):
    """``expert_ns="once"`` on ``Shard(0)`` stacks: the replicas' all-gather of NS results,
    asynchronous, on CUDA tensors."""
    check_expert_once(0, device=tier_device)


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)], ids=["ep2", "ep2xefsdp2"])
def test_expert_parallel_matches_single_process(tier_device, world, ep):
    check_expert_parallel(world, ep, 0, device=tier_device)
