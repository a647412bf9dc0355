"""dmuon.clip_grad_norm_ sees the dedicated gradients and equals torch's clip on one process."""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _reference(max_norm):
    model = models.build_llama()
    x = next(iter(models.batches(1, 2)))
    model(x).square().mean().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters()}


def _clip(rank, world, max_norm):
    import dmuon_compile as dmuon

    model, _ = models.build_dedicated(world)
    x = next(iter(models.batches(1, world)))
    per = x.shape[0] // world
    model(x[rank * per:(rank + 1) * per]).square().mean().backward()
    total = dmuon.clip_grad_norm_(model, max_norm)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, master in dmuon.dedicated_registry.dedicated_parameters(model):
        grads[name] = master.grad.clone()
    return float(total), grads


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clips", "no-op"])
def test_clip_matches_single_process(max_norm):
    ref_total, ref_grads = _reference(max_norm)
    results = run_ranks(_clip, 2, max_norm, timeout=90)
    for total, grads in results:
        assert total == pytest.approx(ref_total, rel=1e-5)
        for name, g in grads.items():  # FSDP grads on every rank; dedicated ones on their owner
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7)
    seen = set(results[0][1]) | set(results[1][1])
    assert seen == set(ref_grads)  # every gradient was checked somewhere
    assert len(set(ref_grads) - set(results[0][1])) > 0  # rank 0 does not hold every dedicated grad


def test_bad_norm_type():
    import dmuon_compile as dmuon

    with pytest.raises(ValueError, match="norm_type"):
        dmuon.clip_grad_norm_(models.build_llama(), 1.0, norm_type=1.0)
