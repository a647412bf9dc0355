"""What ``Muon.step`` hands its AdamW part: local tensors (FSDP2's shards), never DTensors,
whose dispatch costs host time per op and parameter while the GPU waits."""

from __future__ import annotations

import pytest

from . import models
from .harness import run_ranks


def _adamw_inputs(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    import dmuon_compile as dmuon
    from dmuon_compile import functional as F

    model, _ = models.build_dedicated(world)
    opt = dmuon.Muon(model, lr=0.02, compile=False)
    seen: list = []
    original = F.adamw_update

    def recording(params, grads, exp_avgs, exp_avg_sqs, steps, **kw):
        seen.append([isinstance(t, DTensor) for t in (*params, *grads, *exp_avgs, *exp_avg_sqs)])
        return original(params, grads, exp_avgs, exp_avg_sqs, steps, **kw)

    x = models.batches(1, world)[0][rank * 2 : rank * 2 + 2]
    F.adamw_update = recording
    try:
        model(x).square().mean().backward()
        opt.step()
    finally:
        F.adamw_update = original
    registered = [
        isinstance(p, DTensor) for g in opt.param_groups if not g["use_muon"] for p in g["params"]
    ]
    return {"dtensor": [flag for flags in seen for flag in flags], "registered": registered}


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_the_adamw_part_runs_on_local_tensors():
    for got in run_ranks(_adamw_inputs, 2, timeout=90):
        assert got["registered"] and all(got["registered"])  # FSDP2 holds them as DTensors
        assert got["dtensor"] and not any(got["dtensor"])  # the update sees their shards
