"""The user-compiled step: ``@torch.compile def step(): opt.step()`` and
``opt.step = torch.compile(opt.step)`` never recompile when an LR scheduler changes ``lr`` every
step, or ``OneCycleLR`` cycles ``momentum`` (it assigns a float every step), and give the eager
step's weights.

Recompiles are counted with Dynamo's ``CompileCounterWithBackend`` (frames compiled).
Control: without Muon's step pre-hook (which puts a float written into a group back into the
group's own 0-d tensor), a float ``lr`` or ``momentum`` is a new guarded constant each step,
and the same counter sees the recompiles.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import dmuon_compile as dmuon

STEPS = 5
CONTROL_STEPS = 3  # enough for the controls to show a recompile (each one is slow)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2, weight_decay=0.01, compile=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(4, 8, generator=g) for _ in range(STEPS)]


def _train(form: str, float_lr_writes: bool = False, hold: bool = True, steps: int = STEPS):
    torch._dynamo.reset()
    model, opt, sched = _setup()
    if not hold:
        opt._hold_hypers_hook.remove()  # the control: floats reach the traced step
    counter = CompileCounterWithBackend("aot_eager")
    if form == "eager":
        step = opt.step
    elif form == "decorated":

        @torch.compile(backend=counter)
        def step():
            opt.step()

    else:
        opt.step = torch.compile(opt.step, backend=counter)
        step = opt.step
    frames, lrs = [], []
    for i, x in enumerate(_batches()[:steps]):
        model(x).square().mean().backward()
        if float_lr_writes:
            for group in opt.param_groups:
                group["lr"] = 0.02 / (1 + i)  # a float, as a user may write it
        step()
        opt.zero_grad()
        sched.step()
        frames.append(counter.frame_count)
        lrs.append(float(opt.param_groups[0]["lr"]))
    return model.state_dict(), frames, lrs


@pytest.mark.parametrize("form", ["decorated", "assigned"])
def test_user_compiled_step_never_recompiles_and_equals_eager(form):
    expected, _, eager_lrs = _train("eager")
    state, frames, lrs = _train(form)
    assert len(set(lrs)) == STEPS and lrs == eager_lrs  # the schedule changed lr every step
    assert frames[0] >= 1  # the step was compiled ...
    assert frames == [frames[0]] * STEPS  # ... once: no recompile over the schedule
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


def test_float_lr_writes_do_not_recompile():
    expected, _, _ = _train("eager", float_lr_writes=True)
    state, frames, _ = _train("assigned", float_lr_writes=True)
    assert frames == [frames[0]] * STEPS
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


def test_control_float_lr_writes_recompile_without_the_hook():
    _, frames, _ = _train("assigned", float_lr_writes=True, hold=False, steps=CONTROL_STEPS)
    assert frames[-1] > frames[0]


def _train_one_cycle(compiled: bool, hold: bool = True, steps: int = STEPS):
    """OneCycleLR with its defaults: lr (filled in place) and momentum (assigned a float)
    change every step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tiny()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2, compile=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 1e-2], total_steps=steps + 1)
    if not hold:
        opt._hold_hypers_hook.remove()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=counter) if compiled else opt.step
    frames, momenta = [], []
    for x in _batches()[:steps]:
        momenta.append(float(opt.param_groups[0]["momentum"]))
        model(x).square().mean().backward()
        step()
        opt.zero_grad()
        sched.step()
        frames.append(counter.frame_count)
    return model.state_dict(), frames, momenta


def test_one_cycle_momentum_never_recompiles_and_equals_eager():
    expected, _, eager_momenta = _train_one_cycle(compiled=False)
    state, frames, momenta = _train_one_cycle(compiled=True)
    assert len(set(momenta)) == STEPS and momenta == eager_momenta  # μ changed every step
    assert frames[0] >= 1 and frames == [frames[0]] * STEPS
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


def test_control_one_cycle_float_momentum_recompiles():
    _, frames, momenta = _train_one_cycle(compiled=True, hold=False, steps=CONTROL_STEPS)
    assert len(set(momenta)) == CONTROL_STEPS
    assert frames[-1] > frames[0]


def test_float_lr_is_still_honoured_in_eager():
    model, opt, _ = _setup()
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(_batches()[0]).square().mean().backward()
    opt.step()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_groups_hold_their_own_hyper_parameter_tensors():
    _, opt, _ = _setup()
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in lrs)
    assert len({id(v) for v in lrs}) == len(lrs)  # a scheduler refills each group's own
    assert [float(v) for v in lrs] == [0.02, 1e-2]


def test_one_cycle_lr_defaults_cycle_muon_momentum():
    torch.manual_seed(0)
    model = Tiny()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2, compile=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 1e-2], total_steps=STEPS)
    momenta = []
    for x in _batches()[: STEPS - 1]:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        momenta.append(opt.param_groups[0]["momentum"])
    assert len(set(momenta)) > 1 and all(0.85 <= m <= 0.95 for m in momenta)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_user_compiled_step_says_it_is_tracing_once(capfd, monkeypatch):
    from dmuon_compile import compiled_step

    monkeypatch.setattr(compiled_step, "_announced_user_trace", False)
    monkeypatch.delenv("DMUON_COMPILE_LOG", raising=False)
    _train("assigned")
    _train("decorated")  # a second trace in the same process stays quiet
    err = capfd.readouterr().err
    assert err.count("tracing the Muon step into your torch.compile graph") == 1
    assert "[DMuon][rank=" in err
