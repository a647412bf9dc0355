"""Weak spots a user meets, one process: a NaN momentum buffer in the eager step, hyper-parameters
set to NaN/Inf/negative after construction, the error's wording, unknown NS kernels."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.step_agreement import _StepCheck


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _backward(model, seed=0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _stepped(**kwargs):
    """A model and its eager optimizer after one good step (momentum buffers exist)."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = dmuon.Muon(model, compile=False, **kwargs)
    _backward(model)
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())


def _unchanged(model, opt, snapshot) -> None:
    weights, state = snapshot
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert str(opt.state_dict()) == str(state)


# ------------------------------------------------------------------ 1. NaN momentum, eager step
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_eager_step_raises_on_a_nonfinite_momentum_buffer(value):
    model, opt = _stepped()
    opt.state[model.up.weight]["momentum_buffer"][1, 2] = value  # e.g. from a loaded state
    _backward(model, 1)  # finite gradients
    snapshot = _snapshot(model, opt)
    with pytest.raises(FloatingPointError, match=r"up\.weight \(momentum buffer\)") as err:
        opt.step()
    message = str(err.value)
    assert "loaded checkpoint" in message and "found by the eager Muon step" in message
    assert "compiled" not in message
    assert "down.weight" not in message  # only the poisoned matrix is named
    _unchanged(model, opt, snapshot)


def test_eager_step_skips_on_a_nonfinite_momentum_buffer():
    model, opt = _stepped(nonfinite_grads="skip")
    opt.state[model.down.weight]["momentum_buffer"][0, 0] = float("nan")
    _backward(model, 1)
    snapshot = _snapshot(model, opt)
    with pytest.warns(UserWarning, match=r"skipped.*down\.weight \(momentum buffer\)"):
        opt.step()
    _unchanged(model, opt, snapshot)


def test_eager_gradient_error_names_the_gradient_not_a_compiled_step():
    """The eager step's error names what it found (the gradient), not 'a compiled Muon step'."""
    model, opt = _stepped()
    _backward(model, 1)
    model.up.weight.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"up\.weight \(gradient\)") as err:
        opt.step()
    message = str(err.value)
    assert "found by the eager Muon step" in message
    assert "compiled" not in message and "momentum buffer" not in message


def test_read_flags_cover_an_old_momentum_buffer():
    """Muon matrices without flags of their own (TP, expert shards) are read directly: the
    momentum buffer of a matrix with state is read with its gradient."""
    model, opt = _stepped()
    w = model.up.weight
    opt.state[w]["momentum_buffer"][0, 0] = float("nan")
    _backward(model, 1)
    opt._agreement.begin(_StepCheck([w, model.down.weight], None, []))
    opt._agreement.check_finite([], [])
    assert opt._agreement.check.finite.tolist() == [False, True]
    # A matrix whose state this step created has a zero buffer: not read.
    opt._agreement.begin(_StepCheck([w], None, [w]))
    opt._agreement.check_finite([], [])
    assert opt._agreement.check.finite.tolist() == [True]


# ------------------------------------------------------------------ 2. hyper-parameters at step()
@pytest.mark.parametrize(
    "use_muon, key, value, match",
    [
        (True, "lr", float("nan"), r"param_groups\[0\] \(the Muon group.*lr=nan"),
        (True, "lr", float("inf"), r"lr=inf"),
        (True, "weight_decay", -0.1, r"weight_decay=-0\.1.*>= 0"),
        (True, "momentum", 1.5, r"momentum=1\.5.*in \[0, 1\)"),
        (False, "lr", float("nan"), r"param_groups\[1\] \(the AdamW group.*lr=nan"),
        (False, "weight_decay", float("-inf"), r"weight_decay=-inf"),
    ],
)
@pytest.mark.parametrize("write", ["float", "tensor"])
def test_a_bad_hyper_parameter_set_after_construction_raises_at_step(
    use_muon, key, value, match, write
):
    model, opt = _stepped()
    group = next(g for g in opt.param_groups if g["use_muon"] is use_muon)
    if write == "float":
        group[key] = value  # what a user (or OneCycleLR's momentum) writes
    else:
        group[key].fill_(value)  # what an LR scheduler does to a tensor lr
    _backward(model, 1)
    snapshot = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match) as err:
        opt.step()
    assert "gradient" not in str(err.value)
    _unchanged(model, opt, snapshot)


def test_a_scheduler_writing_nan_is_named_at_step():
    model = _Tiny()
    opt = dmuon.Muon(model, compile=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float("nan") if step else 1.0)
    _backward(model)
    opt.step()
    sched.step()
    opt.zero_grad()
    _backward(model, 1)
    with pytest.raises(ValueError, match=r"lr=nan.*LR scheduler"):
        opt.step()


def test_valid_hyper_parameters_still_step():
    model, opt = _stepped()
    opt.param_groups[0]["lr"] = 0.0  # zero is allowed, as at construction
    opt.param_groups[0]["momentum"] = 0.0
    _backward(model, 1)
    steps = [s["step"].item() for s in opt.state.values() if "step" in s]
    assert steps  # the model has AdamW parameters, stepped once already
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    # the step ran: every AdamW state counted it (lr 0 leaves the weights as they were)
    assert [s["step"].item() for s in opt.state.values() if "step" in s] == [n + 1 for n in steps]


# ------------------------------------------------------------------ 9. kernels from elsewhere
@pytest.mark.parametrize(
    "kernel, nearest", [("cute_sm80", "quack"), ("CUTLASS", "quack"), ("syrk", "triton")]
)
def test_a_kernel_name_from_elsewhere_names_the_nearest_kernel(kernel, nearest):
    with pytest.raises(ValueError, match=rf"nearest is kernel='{nearest}'") as err:
        dmuon.NewtonSchulz(kernel=kernel)
    assert "('auto', 'triton', 'quack', 'cublas')" in str(err.value)


def test_an_unknown_kernel_still_lists_the_kernels():
    with pytest.raises(ValueError, match=r"choose one of .*kernel='auto'") as err:
        dmuon.NewtonSchulz(kernel="bogus")
    assert "nearest" not in str(err.value)


# ------------------------------------------------------------------ 4. "Most ranks" for 1 vs 1
def _kernel_mismatch(monkeypatch, backends: list[str]) -> str:
    import torch.distributed as dist
    from dmuon_compile.kernels.consistency import check_ns_backend_consistent

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(backends))
    monkeypatch.setattr(
        dist,
        "all_gather_object",
        lambda out, obj, group=None: out.__setitem__(slice(None), backends),
    )
    with pytest.raises(RuntimeError) as err:
        check_ns_backend_consistent(dmuon.NewtonSchulz(kernel="cublas"))
    return str(err.value)


def test_an_even_split_of_kernels_names_each_side(monkeypatch):
    err = _kernel_mismatch(monkeypatch, ["kernel=triton", "kernel=cublas"])
    assert "Most ranks" not in err, err
    assert "ranks [0]: 'kernel=triton'" in err and "ranks [1]: 'kernel=cublas'" in err, err


def test_a_real_majority_of_kernels_is_most_ranks(monkeypatch):
    err = _kernel_mismatch(monkeypatch, ["kernel=triton", "kernel=cublas", "kernel=triton"])
    assert "Most ranks ([0, 2]) use 'kernel=triton'" in err and "ranks [1]: 'kernel=cublas'" in err
