"""The troubleshooting page's HSDP × TP lines, verbatim but for ``"cuda"`` → ``"cpu"``, on gloo.

``parallelize_module(model, mesh["tp"], plan)`` → ``dmuon.dedicate_params(model, mesh["shard"],
replicate_mesh=mesh["replicate"])`` (default predicate) → ``fully_shard(model, mesh=mesh[
"replicate","shard"])`` → ``dmuon.Muon(model, lr=0.02, replicate_async=False)`` on a 2 × 1 × 2
mesh trains like one process with ``dmuon.Muon(model, lr=0.02)`` and the global batch, and
``replicate_async=True`` gives bit-identical losses.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks, train_steps
from .test_tp import tp_owners

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3
REPLICATE, SHARD, TP = 2, 1, 2


def _seed_run(rank, world, replicate_async=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    model = models.build_llama()
    plan = tp_owners()
    mesh = init_device_mesh(
        "cpu", (REPLICATE, SHARD, TP), mesh_dim_names=("replicate", "shard", "tp")
    )
    # -- the page's lines --
    parallelize_module(model, mesh["tp"], plan)
    dmuon.dedicate_params(model, mesh["shard"], replicate_mesh=mesh["replicate"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    optimizer = dmuon.Muon(model, lr=0.02, replicate_async=False)
    # --
    optimizer.replicate_async = replicate_async  # the same run with the async publish
    dp_rank = mesh["replicate"].get_local_rank() * SHARD + mesh["shard"].get_local_rank()
    dp = REPLICATE * SHARD
    losses = train_steps(model, optimizer, models.batches(STEPS, dp), dp_rank, dp)
    routes = dmuon.summarize_param_groups(model, optimizer)["counts_by_route"]
    return {"losses": losses, "routes": routes}


def test_seed_hsdp_tp_lines_run_and_match_one_process():
    import dmuon_compile as dmuon

    results = run_ranks(_seed_run, REPLICATE * SHARD * TP)
    model = models.build_llama()
    opt = dmuon.Muon(model, lr=0.02)
    ref = train_steps(model, opt, models.batches(STEPS, REPLICATE * SHARD))
    for res in results:
        assert res["routes"]["dedicated/muon"] == 7 * models.LAYERS
        for got, want in zip(res["losses"], ref):
            assert got == pytest.approx(want, rel=1e-4)
    assert ref[-1] != ref[0] and torch.isfinite(torch.tensor(ref)).all()
    # Sync and async post-step paths: bit-identical losses on the 3-D mesh.
    async_results = run_ranks(_seed_run, REPLICATE * SHARD * TP, True)
    assert [r["losses"] for r in async_results] == [r["losses"] for r in results]
