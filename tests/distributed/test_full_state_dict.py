"""torch's full state dicts on a model with dedicated weights, and plain optimizer loads
across meshes.

``torch.distributed.checkpoint.state_dict``'s ``get_*`` / ``set_*_state_dict`` with
``full_state_dict=True`` (the dict on every rank, or with ``cpu_offload`` on rank 0 and
``broadcast_from_rank0`` back) save and load a model with dedicated weights and its ``Muon``
state: a fresh run that loads them continues bit for bit like the run that saved. Before, the
loads raised ``DeviceMesh process groups not initialized!`` (the dict on every rank) or a size
mismatch on a non-owner (``broadcast_from_rank0``).

A plain ``opt.load_state_dict`` of another mesh's per-rank state raises a ``ValueError`` naming
the parameter and the DCP path before anything is loaded (before: accepted, and the next step
failed with a raw size mismatch).
"""

from __future__ import annotations

import copy

import pytest
import torch

from . import models
from .harness import run_ranks
from .test_registered_params import _batches, _build, _global_loss, _opt

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

SAVE_AT, CONTINUE = 2, 2


def _train(model, opt, batches, rank, world) -> list[float]:
    losses = []
    for xb in batches:
        losses.append(_global_loss(model, xb, rank, world))
        opt.step()
        opt.zero_grad()
    return losses


def _full_round_trip(rank, world):
    import torch.distributed.checkpoint.state_dict as dsd

    import dmuon_compile as dmuon

    x = _batches(SAVE_AT + CONTINUE)
    model = _build(world, (world,))
    opt = _opt(model)
    _train(model, opt, x[:SAVE_AT], rank, world)
    everywhere = dsd.StateDictOptions(full_state_dict=True)
    on_rank0 = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Copies, each on its own: torch's dicts share tensors with the live state (AdamW's step
    # counts), and a load shares them with the loading optimizer.
    saved = {
        how: copy.deepcopy(
            (
                dsd.get_model_state_dict(model, options=options),
                dsd.get_optimizer_state_dict(model, opt, options=options),
            )
        )
        for how, options in (("every", everywhere), ("rank0", on_rank0))
    }
    ours = dmuon.get_model_state_dict(model, cpu_offload=False)
    model_sd = saved["every"][0]
    out = {
        "keys": sorted(model_sd),
        "same_as_dmuon": all(torch.equal(model_sd[k].cpu(), ours[k].cpu()) for k in ours),
        "rank0_keys": sorted(saved["rank0"][0]),
        "expected": _train(model, opt, x[SAVE_AT:], rank, world),  # the uninterrupted run
    }
    loads = {
        "every": dsd.StateDictOptions(full_state_dict=True),
        "rank0": dsd.StateDictOptions(
            full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True
        ),
    }
    for how, options in loads.items():
        fresh = _build(world, (world,), seed=5)  # other weights: the load must replace them
        fresh_opt = _opt(fresh)
        model_sd, optim_sd = saved[how]
        dsd.set_model_state_dict(fresh, model_sd, options=options)
        dsd.set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=options)
        out[how] = _train(fresh, fresh_opt, x[SAVE_AT:], rank, world)
    return out


def test_torch_full_state_dicts_save_and_resume_exactly():
    reference = models.build_llama()
    results = run_ranks(_full_round_trip, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["keys"] == sorted(reference.state_dict()), rank
        assert r["same_as_dmuon"], rank
        assert r["rank0_keys"] == (r["keys"] if rank == 0 else []), rank  # torch's convention
        assert r["every"] == r["expected"], rank
        assert r["rank0"] == r["expected"], rank
    assert results[0]["expected"] == results[1]["expected"]


# ---------------------------------------------------------------------------------- plain loads
def _plain_load_across_meshes(rank, world):
    flat = _build(world, (world,))
    flat_opt = _opt(flat)
    _train(flat, flat_opt, _batches(1), rank, world)
    hsdp = _build(world, (2, 2))
    opt = _opt(hsdp)
    _train(hsdp, opt, _batches(1), rank, world)
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    try:
        opt.load_state_dict(flat_opt.state_dict())
        error = None
    except ValueError as exc:
        error = str(exc)
    after = opt.state_dict()["state"]
    unchanged = all(
        torch.equal(_local(v), _local(after[k][n])) for k, s in before.items() for n, v in s.items()
    )
    return {"error": error, "unchanged": unchanged}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_plain_optimizer_load_across_meshes_raises_before_loading():
    for r in run_ranks(_plain_load_across_meshes, 4, timeout=120):
        error = r["error"]
        assert error is not None and "Muon.load_state_dict" in error, r
        assert ".weight" in error and "torch.distributed.checkpoint" in error, error
        assert "[[0, 1], [2, 3]]" in error, error  # the HSDP mesh, not the 1-D one it was saved on
        assert r["unchanged"], r
