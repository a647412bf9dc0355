"""Weak spots a user meets, on 2 gloo ranks: a reentrant ``checkpoint_wrapper`` applied before
``dedicate_params`` raises as documented; the fix snippets of mesh errors name the job's device
type (``"cpu"`` on gloo, not ``"cuda"``); a NaN momentum buffer of a dedicated matrix stops
every rank (the owner names it, the other rank points at it)."""

from __future__ import annotations

import pytest

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _error(fn) -> str | None:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def _reentrant_first(world: int) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for impl in (CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT):
        model = models.build_llama(layers=2)
        for i, block in enumerate(model.layers):  # torchtitan's order: wrap, then dedicate
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
        out[impl.name] = _error(
            lambda m=model: dmuon.dedicate_params(m, mesh, predicate=models.proj_predicate)
        )
    return out


def _mesh_snippets(world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dmuon_compile as dmuon

    def dedicate(mesh, **kw):
        return lambda: dmuon.dedicate_params(
            models.build_llama(), mesh, predicate=models.proj_predicate, **kw
        )

    mesh = init_device_mesh("cpu", (world,))
    two_d = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    tp_model = models.build_llama()
    w = tp_model.layers[0].mlp.up_proj.weight
    unnamed = init_device_mesh("cpu", (world,))
    tp_model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        distribute_tensor(w.detach(), unnamed, [Replicate()])
    )
    return {
        "not_a_mesh": _error(dedicate("not a mesh")),
        "two_d": _error(dedicate(two_d)),
        "replicate": _error(dedicate(two_d["shard"], replicate_mesh="replicate")),
        "tp_unnamed": _error(
            lambda: dmuon.dedicate_params(tp_model, mesh, predicate=models.proj_predicate)
        ),
    }


def _nan_momentum(rank: int, world: int) -> str:
    import dmuon_compile as dmuon

    model, owners = models.build_dedicated(world)
    opt = dmuon.Muon(model, compile=False)
    x = models.batches(2, world)
    per = x[0].shape[0] // world
    for batch in x:
        opt.zero_grad()
        model(batch[rank * per : (rank + 1) * per]).square().mean().backward()
        if batch is x[-1] and rank == 0:  # poison a buffer only rank 0 holds (e.g. a bad load)
            name = next(n for n, o in owners.items() if o == 0)
            p = dict(model.named_parameters())[name]
            opt.state[p]["momentum_buffer"].to_local()[0, 0] = float("nan")
        try:
            opt.step()
        except FloatingPointError as exc:
            return str(exc)
    return "stepped"


def _all(rank: int, world: int) -> dict:
    return {
        "reentrant": _reentrant_first(world),
        "snippets": _mesh_snippets(world),
        "nan_momentum": _nan_momentum(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, 2, timeout=100)


def test_a_reentrant_wrapper_before_dedicate_params_raises(results):
    for r in results:
        err = r["reentrant"]["REENTRANT"]
        assert err is not None, "a reentrant checkpoint_wrapper was accepted"
        assert "reentrant activation checkpointing is not supported" in err
        assert "'layers.0'" in err and "NO_REENTRANT" in err and "use_reentrant=False" in err
        assert r["reentrant"]["NO_REENTRANT"] is None  # the supported order still works


def test_mesh_error_snippets_name_the_jobs_device_type(results):
    for r in results:
        for label, err in r["snippets"].items():
            assert err is not None, label
            assert "init_device_mesh(" in err, (label, err)
            assert '"cuda"' not in err and '"cpu"' in err, (label, err)


def test_a_nan_momentum_buffer_of_a_dedicated_matrix_stops_every_rank(results):
    owner, other = (r["nan_momentum"] for r in results)
    assert "(momentum buffer)" in owner and "loaded checkpoint" in owner, owner
    assert "another rank" in other, other
