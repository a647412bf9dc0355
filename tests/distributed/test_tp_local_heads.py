"""Per-head Newton–Schulz under TP 2 where each TP shard holds whole heads: every member
orthogonalises its own heads, no gather, no scatter (``_stages.tp.stage.local_blocks_layout``).

q/k/v (column-parallel, 4 heads over TP 2) and o (row-parallel, its head columns) hold whole
heads; gate (heads cut across the sharded rows), up (a fused part straddling the shard
boundary) and down (one matrix) still go through the TP owner. The TP run trains as one
process with the same layouts, and the gathers it issued name only the latter (the control
that the shortcut ran); with the shortcut switched off every TP matrix is gathered and the
result is bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks, train_steps
from .test_tp import _check, _muon, _whole_state, build_tp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 3
ALIGNED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
STRADDLING = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _set_layouts(model) -> None:
    import dmuon_compile as dmuon
    from dmuon_compile import Layout

    head_dim = models.D // models.HEADS
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            dmuon.set_layout(proj.weight, Layout.heads(head_dim))
        dmuon.set_layout(attn.o_proj.weight, Layout.heads(head_dim, dim=1))
        dmuon.set_layout(mlp.gate_proj.weight, Layout.heads(head_dim, dim=1))  # across shards
        dmuon.set_layout(mlp.up_proj.weight, Layout.fused((16, 48)))  # 16..64 spans row 32


def _reference():
    model = models.build_llama()
    _set_layouts(model)
    opt = _muon(model, predicate=models.proj_predicate, adjust_lr_fn="original")
    losses = train_steps(model, opt, models.batches(STEPS, 1))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, local: bool):
    from dmuon_compile.distributed import dedicated_runtime

    model, dp_rank = build_tp(rank, world, 1, world)
    _set_layouts(model)
    stage = dedicated_runtime(model).tp
    if not local:  # every TP matrix through its TP owner, as before the shortcut
        stage._local_layout = lambda dp, layout: None
    gathered = set()
    gather_parts = stage._gather_parts

    def recording(bucket, updates):
        gathered.update(row.param.fqn for row in bucket)
        return gather_parts(bucket, updates)

    stage._gather_parts = recording
    opt = _muon(model, adjust_lr_fn="original")  # o's (32, 8) heads: scale 2, the whole 1
    losses = train_steps(model, opt, models.batches(STEPS, 1), dp_rank, 1)
    summary = stage.summary(dedicated_runtime(model))
    return {
        "losses": losses,
        "state": _whole_state(model),
        "gathered": sorted(gathered),
        "local": sorted(r["fqn"] for r in summary["matrices"] if r["local_blocks"]),
        "gather_bytes": summary["gather_bytes_per_step"],
    }


@pytest.fixture(scope="module")
def local_run():
    return run_ranks(_train, 2, True, timeout=120)


def _names(suffixes) -> list[str]:
    return sorted(f"layers.{i}.{s}.weight" for i in range(models.LAYERS) for s in suffixes)


def test_whole_heads_run_locally_and_train_as_one_process(local_run):
    ref_losses, ref_state = _reference()
    _check(local_run, ref_losses, ref_state)
    for res in local_run:
        assert res["gathered"] == _names(STRADDLING)  # no q/k/v/o gathered on any rank
        assert res["local"] == _names(ALIGNED)
    assert any(res["gather_bytes"] > 0 for res in local_run)  # the MLP's shards still travel


def test_whole_heads_match_the_gathered_path_bit_for_bit(local_run):
    gathered = run_ranks(_train, 2, False, timeout=120)
    for res in gathered:
        assert res["gathered"] == _names(ALIGNED + STRADDLING)
    for got, want in zip(local_run, gathered):
        assert got["losses"] == want["losses"]
        for name, value in want["state"].items():
            assert torch.equal(got["state"][name], value), name
