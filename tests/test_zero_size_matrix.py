"""A zero-size matrix routed to Muon (shape ``(0, 32)``, e.g. a layer configured with no
outputs) steps like ``torch.optim.Muon`` steps it: NS of an empty matrix is the empty matrix,
its momentum buffer is empty, and the other matrices train exactly as without it.

Control: with the old ``NewtonSchulz.matrices_per_call`` (it divided by the matrix's bytes, 0
here) the same step raises ``ZeroDivisionError``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon_compile as dmuon


def _model(with_empty: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(32, 16, bias=False), nn.Linear(16, 8, bias=False)]
    if with_empty:
        layers.insert(1, nn.Linear(32, 0, bias=False))  # weight (0, 32), not in the forward
    return nn.ModuleList(layers)


def _forward(model: nn.ModuleList, x):
    a, b = model[0], model[-1]
    return b(torch.relu(a(x)))


def _train(with_empty: bool, steps: int = 3):
    model = _model(with_empty)
    opt = dmuon.Muon(
        model,
        predicate=lambda name, p: p.ndim == 2,
        ns_backend=dmuon.NewtonSchulz(work_dtype=torch.float32),
        compile=False,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = _forward(model, torch.randn(4, 32, generator=g)).square().mean()
        loss.backward()
        for p in model.parameters():  # the empty weight gets its (empty) gradient too
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (3, 0, 5)])
def test_newton_schulz_of_an_empty_matrix_is_empty(shape):
    ns = dmuon.NewtonSchulz(work_dtype=torch.float32)
    out = ns(torch.zeros(shape))
    assert out.shape == torch.Size(shape) and out.dtype == torch.float32
    assert ns.matrices_per_call(shape[-2:]) >= 1 << 30  # no bytes: any number per call


def test_zero_size_matrix_steps_like_torch_muon():
    model, opt = _train(with_empty=True)
    empty = model[1].weight
    assert empty.shape == (0, 32) and opt.state[empty]["momentum_buffer"].shape == (0, 32)
    torch_muon = torch.optim.Muon([nn.Parameter(torch.zeros(0, 32))])
    torch_muon.param_groups[0]["params"][0].grad = torch.zeros(0, 32)
    torch_muon.step()  # torch's own Muon takes it too
    ref, _ = _train(with_empty=False)
    for a, b in zip((model[0], model[2]), (ref[0], ref[1])):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)


def test_control_the_old_matrices_per_call_fails_the_step(monkeypatch):
    def old(self, shape, element_size=4):  # what it was: divides by the matrix's bytes
        return max(1, self.stack_bytes // (int(shape[0]) * int(shape[1]) * element_size))

    monkeypatch.setattr(dmuon.NewtonSchulz, "matrices_per_call", old)
    with pytest.raises(ZeroDivisionError):
        _train(with_empty=True, steps=1)
