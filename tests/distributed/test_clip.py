"""torch.nn.utils.clip_grad_norm_(model.parameters()) sees the dedicated gradients, as does the
dmuon.clip_grad_norm_ alias: the norm and the clipped gradients equal one process's (1-D, HSDP)."""

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


def _clip(rank, world, max_norm, use_torch, hsdp):
    import dmuon_compile as dmuon

    model, _ = models.build_dedicated(world, hsdp=hsdp)
    x = next(iter(models.batches(1, world)))
    per = x.shape[0] // world
    model(x[rank * per : (rank + 1) * per]).square().mean().backward()
    if use_torch:  # the user's unchanged FSDP2 line
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
    else:
        total = dmuon.clip_grad_norm_(model, max_norm)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
    owned = sorted(n for n, p in model.named_parameters() if p.grad.to_local().numel() == p.numel())
    return float(total), grads, owned


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clips", "no-op"])
@pytest.mark.parametrize("use_torch", [True, False], ids=["torch", "alias"])
def test_clip_matches_single_process(max_norm, use_torch):
    ref_total, ref_grads = _reference(max_norm)
    results = run_ranks(_clip, 2, max_norm, use_torch, False, timeout=90)
    for total, grads, _ in results:
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7)
    # the dedicated gradients really are split between the ranks (the test has teeth)
    dedicated = {n for n in ref_grads if models.proj_predicate(n, None)}
    assert not dedicated <= set(results[0][2]) and not dedicated <= set(results[1][2])


def test_torch_clip_hsdp():
    ref_total, ref_grads = _reference(1e-3)
    for total, grads, _ in run_ranks(_clip, 2, 1e-3, True, True, timeout=90):
        assert total == pytest.approx(ref_total, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7)


def test_bad_norm_type():
    import dmuon_compile as dmuon

    with pytest.raises(ValueError, match="norm_type"):
        dmuon.clip_grad_norm_(models.build_llama(), 1.0, norm_type=1.0)
