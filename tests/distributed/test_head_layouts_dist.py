"""Per-head layouts on dedicated weights (``dmuon.set_head_layouts`` before
``dedicate_params``): each owner orthogonalises its projections head by head, and 2 gloo ranks
train as one process with the same layouts. Control: the one-process run without them ends
elsewhere."""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import full_state, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 3


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _reference(world: int, heads: bool):
    import dmuon_compile as dmuon

    model = models.build_llama()
    if heads:
        dmuon.set_head_layouts(model)
    opt = dmuon.Muon(model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False)
    train_steps(model, opt, models.batches(STEPS, world))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _distributed(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    model = models.build_llama()
    layouts = dmuon.set_head_layouts(model)
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False)
    kept = sorted(
        name for name, p in model.named_parameters() if dmuon.get_layout(p) in layouts.values()
    )
    train_steps(model, opt, models.batches(STEPS, world), rank, world)
    return {"state": full_state(model), "layouts": sorted(layouts), "kept": kept}


def test_two_ranks_with_per_head_layouts_equal_one_process():
    world = 2
    results = run_ranks(_distributed, world)
    reference = _reference(world, heads=True)
    whole = _reference(world, heads=False)
    attention = [n for n in reference if ".self_attn." in n]
    assert attention and all(n in results[0]["layouts"] for n in attention)
    assert results[0]["kept"] == results[0]["layouts"]  # the layouts survive dedicate_params
    for r in results:
        for name, value in reference.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(reference[n], whole[n], atol=1e-5) for n in attention)
