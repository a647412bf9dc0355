"""DCP checkpoints of a TP model reshard: model and optimizer state, through the registered
parameters (TP shards are DTensors of the global shape on their owner TP group).

- dp 1 × tp 2 saves at step 3; one plain process (no TP, no dedicate_params) loads it and the
  next 5 losses equal the uninterrupted TP run (rel 1e-5);
- a 1-D dedicated run on 2 ranks saves; dp 1 × tp 2 loads it and continues like the 1-D run;
- control: the same TP resume with a fresh optimizer (no momentum / AdamW moments) misses;
- full state dicts (HF ``save_pretrained``-style): torch's ``get_model_state_dict(
  full_state_dict=True)``, ``dmuon.get_model_state_dict`` and ``p.full_tensor()`` give every
  weight whole on every rank, equal to the one-process model after 3 steps (dp 1 × tp 2; dp 2 ×
  tp 2 with plain dedicated weights beside the TP ones and ``cpu_offload=True``). Control: with
  DTensor's own ``redistribute`` (a rank outside a weight's owner group keeps its empty local
  tensor) the dict misses;
- the same full state dicts on HSDP × TP (replicate 2 × shard 1 × tp 2), read right after the
  last step, its replicate publish left in flight (``replicate_async=True``);
- ``dmuon.set_model_state_dict`` loads the one-process model's full dict into dp 2 × tp 2 and
  into HSDP 2 × 1 × tp 2 (the other replica's copies included).
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks
from .test_registered_params import CONTINUE, SAVE_AT, _batches, _build, _global_loss, _opt
from .test_tp import WEIGHT_ATOL, _muon, build_tp, reference, tp_owners

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _build_tp(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    model = models.build_llama(seed=seed)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_owners())
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


FULL_STEPS = 3


def _full_state(rank, world, dp, attention, offload, replicas=1):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._owner.tensor import OwnerTensor

    model, dp_rank = build_tp(rank, world, dp, 2, replicas=replicas, attention=attention)
    opt = _muon(model)  # HSDP: replicate_async, the last step's publish is left in flight
    for x in models.batches(FULL_STEPS, dp):
        per = x.shape[0] // dp
        model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
    out = {
        "torch": get_model_state_dict(model, options=options),
        "dmuon": dmuon.get_model_state_dict(model, cpu_offload=offload),
        "full_tensor": {n: p.full_tensor() for n, p in model.named_parameters()},
    }
    mine = OwnerTensor.redistribute
    OwnerTensor.redistribute = DTensor.redistribute  # control: DTensor's own gather
    try:
        control = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    finally:
        OwnerTensor.redistribute = mine
    out["control_shapes"] = {k: list(v.shape) for k, v in control.items()}
    dist.barrier()
    return out


@pytest.mark.parametrize(
    ("dp", "attention", "offload", "replicas"),
    [(1, True, False, 1), (2, False, True, 1), (2, True, False, 2)],
    ids=["dp1xtp2", "dp2xtp2-mixed-offload", "hsdp2x1xtp2"],
)
def test_full_state_dict_matches_single_process(dp, attention, offload, replicas):
    results = run_ranks(_full_state, 2 * dp, dp, attention, offload, replicas, timeout=200)
    _, ref = reference(dp, steps=FULL_STEPS)
    for rank, res in enumerate(results):
        for kind in ("torch", "dmuon", "full_tensor"):
            state = res[kind]
            if offload and rank > 0 and kind != "full_tensor":
                assert state == {}, (rank, kind)  # torch's convention: the dict on rank 0 only
                continue
            assert set(state) == set(ref), (rank, kind)
            for name, want in ref.items():
                torch.testing.assert_close(
                    state[name], want, atol=WEIGHT_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
                )
    # The control misses where a rank is outside an owner group: with dp 2 every rank is outside
    # some; with dp 1 every rank is in every owner group and DTensor's own gather is right too.
    missed = [
        sorted(n for n, shape in r["control_shapes"].items() if shape != list(ref[n].shape))
        for r in results
    ]
    assert all(missed) if dp > 1 else not any(missed), missed


def _load_full(rank, world, dp, state, replicas=1, control=False):
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    model, _ = build_tp(rank, world, dp, 2, replicas=replicas, attention=replicas > 1)
    runtime = dedicated_runtime(model)
    with torch.no_grad():  # other values than the dict's: the load must replace them all
        for p in model.parameters():
            p.to_local().add_(1.0)
        for dp_ in runtime.params:
            if dp_.replica is not None:  # HSDP's column copies too (what their forward reads)
                dp_.replica.add_(1.0)
    before = dmuon.get_model_state_dict(model, cpu_offload=False)
    if control:  # the load without its HSDP publish: the other replicas keep their old copies
        runtime.publish = lambda wait=True: None
    dmuon.set_model_state_dict(model, state)
    # Every whole weight (or TP shard) this rank holds, master or HSDP replica, against its
    # piece of the dict: the load reached the copies the next forward unshards from.
    held = {}
    for dp_ in runtime.params:
        if dp_.source is None:
            continue
        want = state[dp_.fqn]
        if getattr(dp_, "global_shape", None) is not None:  # TP shard t on TP rank t
            size = dp_.shape[dp_.shard_dim]
            want = want.narrow(dp_.shard_dim, runtime.tp.info.rank * size, size)
        held[dp_.fqn] = (dp_.source.clone(), want.clone(), dp_.master is None)
    return before, dmuon.get_model_state_dict(model, cpu_offload=False), held


@pytest.mark.parametrize("replicas", [1, 2], ids=["dp2xtp2", "hsdp2x1xtp2"])
def test_full_state_dict_loads_into_tp_model(replicas):
    """The one-process model's dict (HF ``from_pretrained``-style) into dp 2 × tp 2 (plain
    attention weights beside the TP MLP) and into HSDP 2 × 1 × tp 2: every weight, TP shards
    included, reads back bit for bit, and every copy a rank holds (HSDP: the other replica's
    too) equals its piece of the dict; before the load none did."""
    _, ref = reference(2, steps=FULL_STEPS)
    results = run_ranks(_load_full, 4, 2, ref, replicas, timeout=200)
    replica_copies = 0
    for before, after, held in results:
        assert set(after) == set(ref)
        for name, want in ref.items():
            assert torch.equal(after[name], want), name
            assert not torch.equal(before[name], want), name
        assert held  # every rank holds some weights whole (or their TP shards)
        for name, (got, want, is_replica) in held.items():
            assert torch.equal(got, want), name
            replica_copies += is_replica
    assert (replica_copies > 0) == (replicas > 1)  # HSDP: the replicas were checked too


def test_hsdp_tp_load_control_without_publish_misses():
    """Control of the HSDP load check: without the publish to the other replicas their copies
    keep the old values, and the per-copy check above sees it (the owners' dict still reads
    back right: only the replica check catches it)."""
    _, ref = reference(2, steps=FULL_STEPS)
    missed, replica_copies = [], 0
    for _, after, held in run_ranks(_load_full, 4, 2, ref, 2, True, timeout=200):
        assert all(torch.equal(after[name], want) for name, want in ref.items())
        for name, (got, want, is_replica) in held.items():
            replica_copies += is_replica
            if not torch.equal(got, want):
                assert is_replica, name  # the global owners' masters did load
                missed.append(name)
    assert missed and len(missed) == replica_copies
