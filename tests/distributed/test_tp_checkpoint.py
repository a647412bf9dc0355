"""DCP checkpoints of a TP model reshard: model and optimizer state, through the registered
parameters (TP shards are DTensors of the global shape on their owner TP group).

- dp 1 × tp 2 saves at step 3; one plain process (no TP, no dedicate_params) loads it and the
  next 5 losses equal the uninterrupted TP run (rel 1e-5);
- a 1-D dedicated run on 2 ranks saves; dp 1 × tp 2 loads it and continues like the 1-D run;
- control: the same TP resume with a fresh optimizer (no momentum / AdamW moments) misses.
"""

from __future__ import annotations

import pytest

from . import models
from .harness import run_ranks
from .test_registered_params import CONTINUE, SAVE_AT, _batches, _build, _global_loss, _opt
from .test_tp import tp_plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _build_tp(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    model = models.build_llama(seed=seed)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan())
    dmuon.dedicate_params(model, mesh["dp"], predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _model(layout: str, world: int, seed: int):
    if layout == "tp":
        return _build_tp(seed), 0, 1  # one DP rank: every TP rank sees the whole batch
    if layout == "plain":
        return models.build_llama(seed=seed), 0, 1
    return _build(world, (world,), seed=seed), None, world


def _loss(model, xb, rank, dp_rank, dp):
    return _global_loss(model, xb, rank if dp_rank is None else dp_rank, dp)


def _train_and_save(rank, world, layout, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, dp_rank, dp = _model(layout, world, 0)
    opt = _opt(model)
    losses = []
    for i, xb in enumerate(_batches(SAVE_AT + CONTINUE)):
        if i == SAVE_AT:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        losses.append(_loss(model, xb, rank, dp_rank, dp))
        opt.step()
        opt.zero_grad()
    return losses


def _resume(rank, world, layout, path, fresh_optimizer=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model, dp_rank, dp = _model(layout, world, 5)  # other initial values: the load replaces them
    opt = _opt(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    if fresh_optimizer:
        set_model_state_dict(model, state["model"])
        opt = _opt(model)
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for xb in _batches(SAVE_AT + CONTINUE)[SAVE_AT:]:
        losses.append(_loss(model, xb, rank, dp_rank, dp))
        opt.step()
        opt.zero_grad()
    return losses


def _close(got, want, rel=1e-5):
    return all(g == pytest.approx(w, rel=rel) for g, w in zip(got, want))


def test_tp2_checkpoint_loads_in_one_process_and_control(tmp_path):
    path = str(tmp_path / "tp2")
    saved = run_ranks(_train_and_save, 2, "tp", path)
    assert saved[0] == saved[1]
    expected = saved[0][SAVE_AT:]
    assert _close(run_ranks(_resume, 1, "plain", path)[0], expected)
    assert _close(run_ranks(_resume, 2, "tp", path)[0], expected)
    fresh = run_ranks(_resume, 2, "tp", path, True)[0]
    assert fresh[0] == pytest.approx(expected[0], rel=1e-5)  # the weights did load
    assert max(abs(a - b) / abs(b) for a, b in zip(fresh[1:], expected[1:])) > 1e-4


def test_1d_checkpoint_loads_into_tp2(tmp_path):
    path = str(tmp_path / "fsdp2")
    expected = run_ranks(_train_and_save, 2, "fsdp", path)[0][SAVE_AT:]
    assert _close(run_ranks(_resume, 2, "tp", path)[0], expected)
