"""The README's recovery recipe after an exception in forward or backward on one rank only.

gloo on CPU, 2 processes, the tiny Llama with dedicated weights and FSDP2. Rank 1 raises in
forward or in backward; every rank catches whatever it gets and calls ``opt.zero_grad()`` (the
recipe). Rank 0 is then inside a collective of that pass which rank 1 never issues, so it can
only end at the process-group timeout. ``zero_grad`` must not issue anything before every rank
agreed to skip the pass: on rank 1 it waits for that agreement (beside the process groups) and
raises by the timeout, naming the restart; rank 0 ends with its collective's timeout, and its
own ``zero_grad`` raises the same way. Neither rank crashes or goes on to the next batch.

Before, rank 1's ``zero_grad`` finished FSDP2's aborted backward alone: its reduce-scatters
paired with rank 0's pending collectives and gloo aborted rank 0 ("Connection reset by peer",
the process killed); after a forward, rank 1 went on to the next batch alone.

(A pass that raised on every rank at the same point is skipped exactly:
``test_faults.py::test_exception_mid_backward_then_zero_grad_equals_skipping_the_batch``.)
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed import models
from tests.distributed.harness import run_ranks_with_victim
from tests.distributed.test_faults import SkipBatch, _on_output_grad

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

PG_TIMEOUT_S = 4.0
FAILING, FAIL_AT = 1, 1  # the rank that raises, and the batch it raises in


def _readme_recipe(rank, world, where, layer, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    torch.manual_seed(0)
    model = models.TinyLlama()
    if hsdp:  # world replicas of one shard: the publish to the replicas is in play too
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(
            model, mesh["shard"], predicate=models.proj_predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2)
    batch = [None]

    def maybe_raise(grad=None):
        if rank == FAILING and batch[0] == FAIL_AT:
            raise SkipBatch
        return grad

    if where == "forward":
        model.layers[layer].register_forward_pre_hook(lambda *_: maybe_raise())
    else:
        _on_output_grad(model.layers[layer], maybe_raise)
    log, started = [], None
    for i in range(4):
        batch[0] = i
        if i == FAIL_AT:
            started = time.monotonic()
        x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(100 * rank + i))
        try:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            log.append((i, "stepped", ""))
        except Exception as exc:  # noqa: BLE001 - the recipe: caught on every rank
            log.append((i, "raised", type(exc).__name__))
            try:
                opt.zero_grad()
            except RuntimeError as err:
                log.append((i, "zero_grad raised", str(err)))
                return {"log": log, "after_s": time.monotonic() - started}
            log.append((i, "zero_grad returned", ""))
    return {"log": log, "after_s": None}


@pytest.mark.parametrize(
    "where,layer,hsdp",
    [("backward", 1, False), ("backward", 0, False), ("forward", 1, False), ("forward", 1, True)],
    ids=["backward_mid", "backward_last_block", "forward", "forward_hsdp2x1"],
)
def test_one_rank_exception_ends_every_rank_cleanly(where, layer, hsdp):
    out = run_ranks_with_victim(
        _readme_recipe, 2, -1, where, layer, hsdp, timeout=60, pg_timeout_s=PG_TIMEOUT_S
    )
    for rank, r in out.items():
        log = r["log"]
        assert log[0] == (0, "stepped", ""), (rank, log)
        # the failed batch ends this rank: no step, no next batch
        assert [e[0] for e in log[1:]] == [FAIL_AT, FAIL_AT], (rank, log)
        assert log[1][1] == "raised", (rank, log)
        assert log[1][2] == ("SkipBatch" if rank == FAILING else "RuntimeError"), (rank, log)
        assert log[2][1] == "zero_grad raised", (rank, log)
        message = log[2][2]
        assert "Muon.zero_grad" in message and "restart from the last checkpoint" in message, (
            rank,
            message,
        )
        # by the timeout: the failing rank waits for the agreement, the other for its collective
        # and then (at most) for the agreement
        assert r["after_s"] <= 2 * PG_TIMEOUT_S + 3, (rank, r["after_s"])
