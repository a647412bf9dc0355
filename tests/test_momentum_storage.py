"""The momentum's stored forms (``Muon(momentum_dtype=torch.int8)``, ``Muon(offload="momentum")``;
``dmuon_compile/momentum_storage.py``).

- The 8-bit format's error stays within its stated bound, for both roundings, over shapes and
  scales (hypothesis); its stochastic rounding is unbiased where nearest rounding is not: a
  decaying momentum (g = 0) keeps decaying (the control, rounded to nearest, sticks).
- An offloaded momentum gives the in-place step's weights and momentum bit for bit (fp32 and bf16,
  a plain matrix and an expert stack); control: a different μ differs.
- An 8-bit step's stored momentum is within the bound of the fp32 step's momentum, each step.
- Checkpoints hold ``momentum_buffer`` in the parameter's dtype and load into every other setting;
  a skipped step leaves the stored copy untouched.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import momentum_storage as S
from dmuon_compile.newton_schulz import NewtonSchulz

NS = NewtonSchulz(backend="direct", work_dtype=torch.float32)
MU = 0.9


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    log_scale=st.floats(-30, 30),
    zeros=st.booleans(),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_8bit_error_is_within_its_bound(shape, log_scale, zeros, stochastic, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 2.0**log_scale
    x = x * torch.randn(shape, generator=gen).exp()  # values of several magnitudes per block
    if zeros:
        x.view(-1)[::3] = 0
    codes, scales = S.quantize_blockwise(x, seed if stochastic else None)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.numel() == -(-x.numel() // S.BLOCK)
    back = S.dequantize_blockwise(codes, scales, torch.float32)
    err = (back - x).abs()
    assert bool((err <= S.error_bound(x, scales) * (1 + 1e-5) + 1e-30).all())
    assert bool((back[x == 0] == 0).all())  # zeros stay exactly zero


def _decay(stochastic: bool, steps: int = 100) -> float:
    """A momentum left alone (g = 0) for ``steps`` steps of μ = 0.95, stored in 8 bits each
    step; the ratio of what is left to the exact μ^steps·x (1 = no bias), one block whose
    largest value is refreshed each step so the scale stays put."""
    x = torch.full((S.BLOCK,), 0.3)
    x[0] = 1.0
    codes, scales = S.quantize_blockwise(x, 0 if stochastic else None)
    for step in range(steps):  # a new seed per store, as MomentumStorage counts them
        v = S.dequantize_blockwise(codes, scales, torch.float32) * 0.95
        v[0] = 1.0  # the block's maximum, refreshed (a busy neighbour in the row)
        codes, scales = S.quantize_blockwise(v, step + 1 if stochastic else None)
    left = S.dequantize_blockwise(codes, scales, torch.float32)[1:].mean().item()
    return left / (0.3 * 0.95**steps)


def test_stochastic_rounding_keeps_a_decaying_momentum_unbiased():
    assert abs(_decay(stochastic=True) - 1) < 0.35
    # control: rounded to nearest, the decay sticks at a code (the value stops shrinking)
    assert _decay(stochastic=False) > 5


def _run(weights, grads, layout=None, **kwargs):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    if layout is not None:
        for p in params:
            dmuon.set_layout(p, layout)
    opt = dmuon.Muon(params, lr=0.02, momentum=kwargs.pop("momentum", MU), ns_backend=NS, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return params, opt


def _momenta(opt, params):
    return [opt.state_dict()["state"][i]["momentum_buffer"] for i in range(len(params))]


CASES = {
    "matrices": ([(8, 12), (12, 6)], None),
    "expert_stack": ([(3, 8, 6)], dmuon.Layout.experts()),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_an_offloaded_momentum_steps_bit_for_bit_like_the_one_in_place(case, dtype):
    shapes, layout = CASES[case]
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    on, on_opt = _run(weights, grads, layout, compile=False, momentum_dtype=dtype)
    off, off_opt = _run(
        weights, grads, layout, compile=False, momentum_dtype=dtype, offload="momentum"
    )
    for p in off_opt.state.values():  # the step's buffers went back to the stored copy
        assert "momentum_buffer" not in p and p[S.HOST].device.type == "cpu"
    for a, b in zip(on, off):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
    for a, b in zip(_momenta(on_opt, on), _momenta(off_opt, off)):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=0, atol=0)
    # control: the comparison sees the momentum (another μ ends elsewhere)
    other, _ = _run(weights, grads, layout, compile=False, momentum=0.5, offload="momentum")
    assert not torch.equal(other[0].detach(), on[0].detach())


@settings(max_examples=8, deadline=None)
@given(m=st.integers(2, 24), n=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_each_8bit_step_stores_the_fp32_momentum_within_the_bound(m, n, seed):
    """From one stored state, a step's 8-bit momentum is the fp32 step's momentum (μ·buf + g,
    buf the dequantised state) within the format's bound."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(m, n, generator=gen)]
    grads = [[torch.randn(m, n, generator=gen) * 10.0 ** (k - 1)] for k in range(3)]
    params, opt = _run(weights, grads[:2], compile=False, momentum_dtype=torch.int8)
    state = opt.state[params[0]]
    before = S.dequantize_blockwise(state[S.CODES], state[S.SCALES], torch.float32)
    params[0].grad = grads[2][0].clone()
    opt.step()
    exact = MU * before + grads[2][0]
    stored = S.dequantize_blockwise(state[S.CODES], state[S.SCALES], torch.float32)
    assert state[S.CODES].dtype == torch.int8
    assert bool(((stored - exact).abs() <= S.error_bound(exact, state[S.SCALES]) * 1.0001).all())


SETTINGS = {
    "fp32": {},
    "bf16": {"momentum_dtype": torch.bfloat16},
    "int8": {"momentum_dtype": torch.int8},
    "offload": {"offload": "momentum"},
    "int8_offload": {"momentum_dtype": "int8", "offload": "momentum"},
}


@pytest.mark.parametrize("second", sorted(SETTINGS))
@pytest.mark.parametrize("first", sorted(SETTINGS))
def test_a_checkpoint_of_any_setting_loads_into_any_other(first, second):
    gen = torch.Generator().manual_seed(11)
    weights = [torch.randn(6, 10, generator=gen)]
    grads = [[torch.randn(6, 10, generator=gen)] for _ in range(3)]
    params, opt = _run(weights, grads[:2], compile=False, **SETTINGS[first])
    saved = opt.state_dict()
    buf = saved["state"][0]["momentum_buffer"]
    assert set(saved["state"][0]) == {"momentum_buffer"}
    want = torch.bfloat16 if first == "bf16" else torch.float32
    assert buf.dtype == want and buf.shape == (6, 10)
    stream = io.BytesIO()
    torch.save(saved, stream)
    stream.seek(0)
    loaded = torch.load(stream, weights_only=True)
    # the resumed step equals the step of an optimizer built with ``second`` holding that momentum
    resumed = [torch.nn.Parameter(params[0].detach().clone())]
    opt2 = dmuon.Muon(
        resumed, lr=0.02, momentum=MU, ns_backend=NS, compile=False, **SETTINGS[second]
    )
    opt2.load_state_dict(loaded)
    resumed[0].grad = grads[2][0].clone()
    opt2.step()
    ref = [torch.nn.Parameter(params[0].detach().clone())]
    opt3 = dmuon.Muon(ref, lr=0.02, momentum=MU, ns_backend=NS, compile=False)
    opt3.state[ref[0]]["momentum_buffer"] = buf.float().clone()
    ref[0].grad = grads[2][0].clone()
    opt3.step()
    tol = 2e-2 if "int8" in second or second == "bf16" else 0.0  # stored after the load
    torch.testing.assert_close(resumed[0].detach(), ref[0].detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("second", sorted(SETTINGS))
@pytest.mark.parametrize("first", sorted(SETTINGS))
def test_the_setting_changed_on_a_live_optimizer_keeps_the_momentum(first, second):
    gen = torch.Generator().manual_seed(12)
    weights = [torch.randn(6, 10, generator=gen)]
    grads = [[torch.randn(6, 10, generator=gen)] for _ in range(3)]
    params, opt = _run(weights, grads[:2], compile=False, **SETTINGS[first])
    held = opt.state_dict()["state"][0]["momentum_buffer"].float().clone()
    start = params[0].detach().clone()
    opt.momentum_dtype = SETTINGS[second].get("momentum_dtype")
    opt.offload = SETTINGS[second].get("offload")
    params[0].grad = grads[2][0].clone()
    opt.step()
    ref = [torch.nn.Parameter(start.clone())]
    opt3 = dmuon.Muon(ref, lr=0.02, momentum=MU, ns_backend=NS, compile=False)
    opt3.state[ref[0]]["momentum_buffer"] = held
    ref[0].grad = grads[2][0].clone()
    opt3.step()
    tol = 2e-2 if "int8" in second or second == "bf16" else 0.0
    torch.testing.assert_close(params[0].detach(), ref[0].detach(), rtol=0, atol=tol)
    keys = {k for k in opt.state[params[0]] if k.startswith("momentum")}
    assert keys == (
        {"momentum_buffer"} if second in ("fp32", "bf16") else keys - {"momentum_buffer"}
    )


def test_a_skipped_step_leaves_the_stored_momentum_untouched():
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(6, 10, generator=gen)]
    grads = [[torch.randn(6, 10, generator=gen)] for _ in range(2)]
    for kwargs in SETTINGS.values():
        if not kwargs:
            continue
        params, opt = _run(weights, grads, compile=False, nonfinite_grads="skip", **kwargs)
        before = {
            k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[params[0]].items()
        }
        params[0].grad = torch.full((6, 10), float("nan"))
        with pytest.warns(UserWarning):
            opt.step()
        after = opt.state[params[0]]
        assert set(after) == set(before)
        for k, v in before.items():
            assert torch.equal(after[k], v) if torch.is_tensor(v) else after[k] == v


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"offload": "state"}, "offload='state'.*dedicate_params.*offload='momentum'"),
        ({"offload": True}, "'momentum'"),
        ({"momentum_dtype": "fp8"}, "int8"),
    ],
)
def test_bad_settings_name_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dmuon.Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_on_the_gpu_the_offloaded_momentum_is_pinned_and_steps_like_the_one_in_place(compile):
    """CUDA: the copies in on the side stream are ordered before the step, the write-back after
    it (a race shows as a mismatch, also under ``CUDA_LAUNCH_BLOCKING=1``'s absence); the host
    copies are pinned; eager bit for bit, compiled within fp32 rounding (its graphs differ)."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(256, 512), (512, 256), (8, 128, 64)]
    weights = [torch.randn(s, generator=gen).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=gen).cuda() for s in shapes] for _ in range(4)]

    def run(**kwargs):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        dmuon.set_layout(params[2], dmuon.Layout.experts())
        opt = dmuon.Muon(params, lr=0.02, momentum=MU, compile=compile, **kwargs)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        torch.cuda.synchronize()
        return params, opt

    on, _ = run()
    off, off_opt = run(offload="momentum")
    assert all(s[S.HOST].is_pinned() for s in off_opt.state.values())
    tol = 0.0 if not compile else 1e-6
    for a, b in zip(on, off):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=tol)
    int8, int8_opt = run(momentum_dtype=torch.int8)
    assert all(s[S.CODES].is_cuda for s in int8_opt.state.values())
    for a, b in zip(on, int8):  # 8-bit: the same training, to the format's precision
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=5e-3)


def test_the_rounding_noise_is_uniform_and_differs_by_seed():
    """The counter hash behind stochastic rounding: uniform in [0, 1) (mean, spread, no
    repeats between neighbours), the same for the same seed, unrelated for another."""
    a, b = S.rounding_noise(1 << 16, 7, "cpu"), S.rounding_noise(1 << 16, 8, "cpu")
    assert torch.equal(a, S.rounding_noise(1 << 16, 7, "cpu"))
    assert 0 <= float(a.min()) and float(a.max()) < 1
    assert abs(float(a.mean()) - 0.5) < 0.01 and abs(float(a.var()) - 1 / 12) < 0.005
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([a[1:], a[:-1]]))[0, 1])) < 0.02


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_codec_is_the_eager_one():
    """CUDA runs the codec compiled: the same format (codes within one level of the eager
    ops' — the division and square root may round differently — and the same error bound)."""
    x = torch.randn(3, 1000, 77, device="cuda") * torch.rand(3, 1000, 1, device="cuda")
    codes, scales = S.quantize_blockwise(x, seed=123)
    eager_codes, eager_scales = S._quantize(x, 123, True)
    assert torch.equal(scales, eager_scales)
    assert int((codes.int() - eager_codes.int()).abs().max()) <= 1
    back = S.dequantize_blockwise(codes, scales, torch.float32)
    torch.testing.assert_close(back, S._dequantize(codes, scales, torch.float32))
    assert bool(((back - x).abs() <= S.error_bound(x, scales) * (1 + 1e-5)).all())


def test_a_failing_compiled_codec_falls_back_to_the_eager_ops(monkeypatch):
    """The compiled codec runs on CUDA only; here a stand-in 'compiled' function that raises
    takes its place, on a tensor that claims to be on CUDA: the eager ops answer, once warned."""

    class CudaLike:  # what _on_device reads of its tensor
        device = torch.device("cuda")

    def broken(*args):
        raise RuntimeError("a compiler that cannot build it")

    monkeypatch.setitem(S._COMPILED, "quantize", broken)
    x = torch.randn(3, 300)
    with pytest.warns(UserWarning, match="compiled 8-bit momentum quantize failed"):
        codes, scales = S._on_device("quantize", S._quantize, CudaLike())(x, 7, True)
    want = S._quantize(x, 7, True)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    assert S._COMPILED["quantize"] is False  # from then on: eager, no warning
    assert S._on_device("quantize", S._quantize, CudaLike()) is S._quantize


@pytest.mark.parametrize("stored", [{"offload": "momentum"}, {"momentum_dtype": "int8"}])
def test_a_flattened_optimizer_state_dict_loads_after_to_checkpoint_form(stored):
    """torch's ``set_optimizer_state_dict(flatten_optimizer_state_dict=True)`` (torchtitan's
    checkpoint layout) takes from the dict only the keys the live state has:
    ``Muon.to_checkpoint_form()`` first shows the stored momentum's ``momentum_buffer`` key, and
    the saved momentum comes back. Without it the unflattened dict holds no momentum, and
    ``load_state_dict`` refuses it, naming the fix, with the state unchanged."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4))
    opt = dmuon.Muon(model, compile=False, **stored)

    def step():
        model(torch.randn(3, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def momentum():
        return opt.state_dict()["state"][0]["momentum_buffer"].clone()

    step()
    saved = {
        k: v.clone() if torch.is_tensor(v) else v
        for k, v in get_optimizer_state_dict(model, opt, options=flat).items()
    }
    want = momentum()
    step()
    assert not torch.equal(momentum(), want)
    before = momentum()
    with pytest.raises(ValueError, match=r"opt\.to_checkpoint_form\(\) before"):
        set_optimizer_state_dict(model, opt, dict(saved), options=flat)
    assert torch.equal(momentum(), before)
    opt.to_checkpoint_form()
    set_optimizer_state_dict(model, opt, dict(saved), options=flat)
    assert torch.equal(momentum(), want)
    step()  # and the next step stores it again
    assert any(
        k.startswith("momentum_") and k != "momentum_buffer" for k in opt.state[model[0].weight]
    )
