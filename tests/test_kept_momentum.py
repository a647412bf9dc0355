"""``Muon(keep_new_momentum=True)``: buf′ = μ·buf + g kept from the directions and swapped in
as the momentum at the commit, instead of computed again there.

- the same bits as the default step, over several steps, for matrices and expert stacks,
  Nesterov or not, fp32 or bf16 momentum, NorMuon, eager and compiled;
- the swap happened (the momentum's storage changed while its tensor object stayed: the
  control that the kept path ran at all);
- a deferred verdict that turns out false (the compiled step, a NaN gradient skipped) leaves the
  momentum exactly as it was (the undo of ``kernels/copy_unless.py``);
- where a buffer does not own its storage whole, buf′ is copied in instead;
- the settings it cannot combine with raise, naming them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.layouts import Layout
from dmuon_compile.momentum_storage import MOMENTUM, take_kept_momentum


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24, bias=False)
        self.down = nn.Linear(24, 8, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 8, 6) / 3)  # a stack of 3 experts' 8×6
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        h = torch.einsum("bi,eio->beo", h, self.experts).mean(1)
        return self.head(h)


def _route(name: str, p: torch.Tensor):
    if name == "experts":
        return Layout.experts()
    return p.dim() == 2 and not name.startswith("head")


def _backward(model, seed: int, poison: bool = False) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    if poison:
        model.up.weight.grad[0, 0] = float("nan")


def _pair(**kwargs):
    torch.manual_seed(0)
    model = _Model()
    twin = copy.deepcopy(model)
    plain = dmuon.Muon(model, predicate=_route, **kwargs)
    kept = dmuon.Muon(twin, predicate=_route, keep_new_momentum=True, **kwargs)
    return (model, plain), (twin, kept)


def _momenta(opt) -> dict[str, torch.Tensor]:
    return {opt.param_name(p): s[MOMENTUM] for p, s in opt.state.items() if MOMENTUM in s}


def _same(a: nn.Module, b: nn.Module, opt_a, opt_b) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name
    ma, mb = _momenta(opt_a), _momenta(opt_b)
    assert ma.keys() == mb.keys() and len(ma) == 3
    for name in ma:
        assert ma[name].dtype == mb[name].dtype and torch.equal(ma[name], mb[name]), name


@settings(max_examples=12, deadline=None)
@given(
    nesterov=st.booleans(),
    momentum_dtype=st.sampled_from([None, torch.bfloat16]),
    normuon=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.1]),
)
def test_the_kept_momentum_steps_as_the_default_bit_for_bit(
    nesterov, momentum_dtype, normuon, weight_decay
):
    hypers = dict(
        lr=0.02,
        nesterov=nesterov,
        momentum_dtype=momentum_dtype,
        normuon=normuon,
        weight_decay=weight_decay,
        compile=False,
    )
    (model, plain), (twin, kept) = _pair(**hypers)
    swapped = 0
    for step in range(3):
        for m, opt in ((model, plain), (twin, kept)):
            opt.zero_grad()
            _backward(m, step)
            before = {n: (id(t), t.data_ptr()) for n, t in _momenta(opt).items()}
            opt.step()
            after = {n: (id(t), t.data_ptr()) for n, t in _momenta(opt).items()}
            for name in before:  # the state keeps its tensor objects either way
                assert before[name][0] == after[name][0], name
                if opt is kept:
                    swapped += before[name][1] != after[name][1]
                else:  # the control: in place, the same storage
                    assert before[name][1] == after[name][1], name
        _same(model, twin, plain, kept)
    assert swapped == 2 * 3  # steps 2 and 3 swapped every momentum's storage


@pytest.mark.timeout(600)
def test_the_compiled_kept_momentum_steps_as_the_default_and_undoes_a_skipped_step():
    """The compiled step (its verdict left on the device): the same bits as the default's
    compiled step over good steps, and a skipped one (a NaN gradient) leaves weights and
    momentum exactly as they were: the new storage swapped in gets the old values back."""
    (model, plain), (twin, kept) = _pair(lr=0.02, compile=True, nonfinite_grads="skip")
    for step in range(2):
        for m, opt in ((model, plain), (twin, kept)):
            opt.zero_grad()
            _backward(m, step)
            opt.step()
    _same(model, twin, plain, kept)
    saved = {n: t.clone() for n, t in _momenta(kept).items()}
    pointers = {n: t.data_ptr() for n, t in _momenta(kept).items()}
    weights = {k: v.clone() for k, v in twin.state_dict().items()}
    kept.zero_grad()
    _backward(twin, 2, poison=True)
    kept.step()
    with pytest.warns(UserWarning, match="skipped"):
        assert kept.last_step_committed() is False
    for name, t in _momenta(kept).items():
        assert t.data_ptr() != pointers[name], name  # swapped, then undone in the new storage
        assert torch.equal(t, saved[name]), name
    for k, v in twin.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for step in (3, 4):  # and training goes on as the default's, which never saw that batch
        for m, opt in ((model, plain), (twin, kept)):
            opt.zero_grad()
            _backward(m, step)
            opt.step()
    assert plain.last_step_committed() and kept.last_step_committed()
    _same(model, twin, plain, kept)


@pytest.mark.parametrize("verdict", [None, True, False])
def test_a_buffer_that_is_a_view_gets_buf_prime_copied_in(verdict):
    flat = torch.zeros(2, 12)
    buf = flat[1].view(3, 4)  # a view of a larger buffer: never swapped
    new = torch.arange(12.0).view(3, 4)
    plain = torch.zeros(3, 4)
    flag = None if verdict is None else torch.tensor(verdict)
    take_kept_momentum([buf, plain], [new, new.clone()], flag)
    want = torch.zeros(3, 4) if verdict is False else new
    assert torch.equal(flat[1].view(3, 4), want) and torch.equal(buf, want)
    assert torch.equal(plain, want)
    assert torch.equal(flat[0], torch.zeros(12))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(momentum_dtype="int8"), "momentum_dtype=torch.int8"),
        (dict(offload="momentum"), "offload='momentum'"),
        (dict(compile_mode="reduce-overhead"), "reduce-overhead"),
    ],
)
def test_settings_the_kept_momentum_cannot_combine_with_raise(kwargs, match):
    model = _Model()
    with pytest.raises(ValueError, match=match):
        dmuon.Muon(model, predicate=_route, keep_new_momentum=True, **kwargs)
    opt = dmuon.Muon(model, predicate=_route, keep_new_momentum=True)
    key, value = next(iter(kwargs.items()))
    # the live setters check too, and leave the setting as it was
    with pytest.raises(ValueError, match="keep_new_momentum"):
        setattr(opt, key, value)
    assert opt.momentum_dtype is None and opt.offload is None and opt.compile_mode is None
    # and the other way round: keep_new_momentum turned on beside the setting
    plain = dmuon.Muon(model, predicate=_route, **kwargs)
    with pytest.raises(ValueError, match=match):
        plain.keep_new_momentum = True
    assert plain.keep_new_momentum is False
    plain.keep_new_momentum = False  # control: turning it off is always allowed
    with pytest.raises(ValueError, match="True or False"):
        dmuon.Muon(model, predicate=_route, keep_new_momentum="yes")


# ---------------------------------------------------------------- on a GPU (skipped without one)
# Two matrices past the compiled step's computed-where-read size (64M values: buf′ written by
# the kernel that takes the norm), a stack of 8 experts and small ones (the foreach path).
GPU_SHAPES = [(8192, 8192), (8192, 8192), (8, 768, 2048), (512, 1024), (1024, 512)]


def _gpu_run(keep: bool, poison_step: int | None = None, steps: int = 4, **kwargs):
    gen = torch.Generator(device="cuda").manual_seed(3)
    params = [nn.Parameter(torch.randn(s, device="cuda", generator=gen) / 64) for s in GPU_SHAPES]
    for p in params:
        if p.dim() == 3:
            dmuon.set_layout(p, Layout.experts())
    opt = dmuon.Muon(
        params,
        lr=0.02,
        compile=True,
        nonfinite_grads="skip",
        keep_new_momentum=keep,
        **kwargs,
    )
    for step in range(steps):
        gen.manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        if step == poison_step:
            params[0].grad[0, 0] = float("nan")
        opt.step()
    opt.last_step_committed()
    torch.cuda.synchronize()
    return params, opt


@pytest.mark.gpu
@pytest.mark.parametrize("momentum_dtype", [None, torch.bfloat16])
def test_on_the_gpu_the_kept_momentum_steps_as_the_default_bit_for_bit(momentum_dtype):
    """CUDA: buf′ written by Inductor's kernels where the Nesterov input is read, the swap and
    the undo of a skipped step (``copy_unless`` on the device) — the same weights and momenta
    as the default compiled step, bit for bit."""
    ref, ref_opt = _gpu_run(False, poison_step=2, momentum_dtype=momentum_dtype)
    got, got_opt = _gpu_run(True, poison_step=2, momentum_dtype=momentum_dtype)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
        assert torch.equal(ref_opt.state[a][MOMENTUM], got_opt.state[b][MOMENTUM])
