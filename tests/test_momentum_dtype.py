"""``Muon(momentum_dtype=torch.bfloat16)``: the momentum stored in bf16, μ·buf + g computed in
the gradient's dtype and rounded once where it is stored; the eager and compiled steps agree
with a reference loop written here; checkpoints of either setting load into the other.

The reference is the Muon step written out per matrix in float32 with the package's eager
Newton–Schulz (``functional.orthogonalize``), rounding the stored momentum to bf16 after each
step. Control: a momentum rounded twice per step (μ·buf, then + g, each in bf16) leaves that
reference by more than the tolerance, so the comparison can tell the two apart.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.newton_schulz import NewtonSchulz

MU, LR = 0.9, 0.02
NS = NewtonSchulz(backend="direct", work_dtype=torch.float32)


def _grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _reference(weights, grads, round_twice=False):
    """Per-matrix Muon with a bf16 momentum, rounded once per step (``round_twice``: the
    control's double rounding)."""
    ws = [w.clone() for w in weights]
    bufs = [torch.zeros(w.shape, dtype=torch.bfloat16) for w in ws]
    for step in grads:
        for i, (w, g) in enumerate(zip(ws, step)):
            if round_twice:
                new = (bufs[i] * MU).to(torch.bfloat16).float() + g
            else:
                new = bufs[i].float() * MU + g
            u = g + MU * new
            o = F.orthogonalize([u], NS)[0]
            w.add_(o.float(), alpha=-LR * F.lr_scale(w.shape, "match_rms_adamw"))
            bufs[i] = new.to(torch.bfloat16)
    return ws, bufs


def _muon(weights, grads, **kwargs):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = dmuon.Muon(params, lr=LR, momentum=MU, ns_backend=NS, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return params, opt


@settings(max_examples=10, deadline=None)
@given(
    m=st.integers(2, 12),
    n=st.integers(2, 12),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_bf16_momentum_matches_the_reference_loop(m, n, steps, seed):
    weights = [torch.randn(m, n, generator=torch.Generator().manual_seed(seed))]
    grads = _grads([(m, n)], steps, seed + 1)
    params, opt = _muon(weights, grads, compile=False, momentum_dtype=torch.bfloat16)
    ref_w, ref_b = _reference(weights, grads)
    buf = opt.state[params[0]]["momentum_buffer"]
    assert buf.dtype == torch.bfloat16 and buf.element_size() == 2
    torch.testing.assert_close(buf, ref_b[0], rtol=0, atol=0)
    torch.testing.assert_close(params[0].detach(), ref_w[0], rtol=1e-5, atol=1e-6)


def test_control_double_rounding_leaves_the_reference():
    weights = [torch.randn(8, 12, generator=torch.Generator().manual_seed(1))]
    grads = _grads([(8, 12)], 4, 2)
    _, good = _reference(weights, grads)
    _, bad = _reference(weights, grads, round_twice=True)
    assert not torch.equal(good[0], bad[0])


def test_the_compiled_step_equals_the_eager_one():
    shapes = [(8, 12), (8, 12), (12, 6)]
    weights = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)
    ]
    grads = _grads(shapes, 3, 7)
    eager, eager_opt = _muon(weights, grads, compile=False, momentum_dtype=torch.bfloat16)
    compiled, compiled_opt = _muon(weights, grads, compile=True, momentum_dtype=torch.bfloat16)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        sa, sb = eager_opt.state[a]["momentum_buffer"], compiled_opt.state[b]["momentum_buffer"]
        assert sb.dtype == torch.bfloat16
        torch.testing.assert_close(sa.float(), sb.float(), rtol=0, atol=2e-2 * sa.abs().max())


def test_the_default_keeps_the_parameter_dtype_and_bf16_stays_close_to_it():
    weights = [torch.randn(16, 24, generator=torch.Generator().manual_seed(3))]
    grads = _grads([(16, 24)], 5, 4)
    fp32, fp32_opt = _muon(weights, grads, compile=False)
    bf16, _ = _muon(weights, grads, compile=False, momentum_dtype=torch.bfloat16)
    assert fp32_opt.state[fp32[0]]["momentum_buffer"].dtype == torch.float32
    moved = (fp32[0] - weights[0]).norm()
    gap = (bf16[0] - fp32[0]).norm()
    assert 0 < gap < 1e-2 * moved  # bf16 rounding of the momentum: a small, non-zero drift


@pytest.mark.parametrize("saved,loaded", [(torch.bfloat16, None), (None, torch.bfloat16)])
def test_a_checkpoint_of_one_setting_loads_into_the_other(saved, loaded):
    weights = [torch.randn(8, 12, generator=torch.Generator().manual_seed(5))]
    grads = _grads([(8, 12)], 4, 6)
    params, opt = _muon(weights, grads[:2], compile=False, momentum_dtype=saved)
    state = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = dmuon.Muon(resumed, lr=LR, momentum=MU, ns_backend=NS, momentum_dtype=loaded)
    opt2.load_state_dict(state)
    for step in grads[2:]:
        resumed[0].grad = step[0].clone()
        opt2.step()
    buf = opt2.state[resumed[0]]["momentum_buffer"]
    assert buf.dtype == (loaded or torch.float32)
    # The same as continuing with the loaded setting from the saved buffer, converted.
    start = state["state"][0]["momentum_buffer"].to(loaded or torch.float32)
    w, b = params[0].detach().clone(), start.clone()
    for step in grads[2:]:
        new = b.float() * MU + step[0]
        o = F.orthogonalize([step[0] + MU * new], NS)[0]
        w.add_(o.float(), alpha=-LR * F.lr_scale(w.shape, "match_rms_adamw"))
        b = new.to(b.dtype)
    torch.testing.assert_close(resumed[0].detach(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buf, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.float16, torch.uint8, "fp8"])
def test_an_unsupported_dtype_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="torch.bfloat16"):
        dmuon.Muon([torch.nn.Parameter(torch.randn(4, 4))], momentum_dtype=bad)


@pytest.mark.parametrize("verdict", [True, False])
def test_the_commit_under_a_device_verdict_rounds_once_or_changes_nothing(verdict):
    """``commit_muon_step(commit_if=...)`` (the compiled step's deferred verdict) with a bf16
    momentum: the same buffer and weight as the plain commit, or both untouched."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(6, 10, generator=gen)
    g = torch.randn(6, 10, generator=gen)
    buf = torch.randn(6, 10, generator=gen).to(torch.bfloat16)
    o = torch.randn(6, 10, generator=gen).to(torch.bfloat16)
    plain = [w.clone()], [buf.clone()]
    F.commit_muon_step(plain[0], [g], plain[1], [o], lr=LR, weight_decay=0.0, momentum=MU)
    selected = [w.clone()], [buf.clone()]
    F.commit_muon_step(
        selected[0],
        [g],
        selected[1],
        [o],
        lr=LR,
        weight_decay=0.0,
        momentum=MU,
        commit_if=torch.tensor(verdict),
    )
    want = plain if verdict else ([w], [buf])
    assert selected[1][0].dtype == torch.bfloat16
    assert torch.equal(selected[0][0], want[0][0]) and torch.equal(selected[1][0], want[1][0])
