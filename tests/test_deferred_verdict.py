"""The step's verdict read after the commit: the compiled commit selects on the device-side
verdict (``where(ok, new, old)``), the host reads it afterwards (``StepAgreement.settle``).

- the select itself (``functional.commit_muon_step(commit_if=...)``) against the plain commit:
  a true verdict writes the same bits, a false one writes nothing, NaN/Inf gradients included;
- ``Muon`` with the compiled step defers (it calls ``settle``), an eager ``Muon`` does not
  (the control), and a deferred non-finite step raises or skips exactly as an undeferred one:
  every weight and every state unchanged, no state left by a first step;
- the finite flags of the compiled matrices come from the directions (the norm NS takes):
  exactly the matrices whose gradient or momentum holds a NaN/Inf are flagged, and the
  gradient check reads only the other gradients.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile import step_agreement


def _lists(seed: int, shapes, poison: bool):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    bufs = [torch.randn(s, generator=g) for s in shapes]
    ortho = [torch.randn(s, generator=g) for s in shapes]
    if poison:
        grads[0][0, 0] = float("nan")
        grads[-1][-1, -1] = float("inf")
    return params, grads, bufs, ortho


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=4),
    weight_decay=st.sampled_from([0.0, 0.1]),
    tensors=st.booleans(),
)
def test_the_select_writes_the_plain_commit_or_nothing(seed, shapes, weight_decay, tensors):
    hypers = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9)
    if tensors:  # the compiled step's 0-d tensor hyper-parameters (read as floats in eager)
        hypers = {k: torch.tensor(v) for k, v in hypers.items()}
    plain = _lists(seed, shapes, poison=False)
    F.commit_muon_step(*plain, **hypers)
    chosen = _lists(seed, shapes, poison=False)
    F.commit_muon_step(*chosen, **hypers, commit_if=torch.tensor(True))
    for a, b in zip(plain[0] + plain[2], chosen[0] + chosen[2]):
        assert torch.equal(a, b)
    kept = _lists(seed, shapes, poison=True)
    before = copy.deepcopy(kept)
    F.commit_muon_step(*kept, **hypers, commit_if=torch.tensor(False))
    for a, b in zip(kept[0] + kept[2], before[0] + before[2]):
        assert torch.equal(a, b)
    assert not torch.isfinite(kept[1][0]).all()  # the poisoned gradient did reach the commit


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24, bias=False)
        self.down = nn.Linear(24, 8, bias=False)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def _backward(model, seed: int, poison: bool = False) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    if poison:
        model.up.weight.grad[0, 0] = float("nan")


@pytest.fixture
def settles(monkeypatch):
    """The verdicts a step left on the device (recorded as they are made: a spy around
    ``settle`` would move the skip warning's frame)."""
    calls = []

    class Recorded(step_agreement.PendingVerdict):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            calls.append(self)

    monkeypatch.setattr(step_agreement, "PendingVerdict", Recorded)
    return calls


def _models():
    torch.manual_seed(0)
    model = _Tiny()
    return model, copy.deepcopy(model)


@pytest.mark.timeout(300)
def test_the_compiled_step_defers_and_trains_as_the_eager_step(settles):
    compiled_model, eager_model = _models()
    compiled = dmuon.Muon(compiled_model, lr=0.02, compile=True)
    eager = dmuon.Muon(eager_model, lr=0.02, compile=False)
    for step in range(3):
        for model, opt in ((compiled_model, compiled), (eager_model, eager)):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
    assert len(settles) == 3  # the compiled optimizer's three steps; the eager one read first
    for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(
        not torch.equal(a, b) for a, b in zip(compiled_model.parameters(), _Tiny().parameters())
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_deferred_nonfinite_step_changes_nothing(settles, mode):
    model, _ = _models()
    opt = dmuon.Muon(model, lr=0.02, compile=True, nonfinite_grads=mode)
    # A first step with a NaN gradient: nothing written, no state left behind.
    _backward(model, 0, poison=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"up\.weight"):
            opt.step()
    else:
        with pytest.warns(UserWarning, match=r"skipped.*up\.weight") as caught:
            opt.step()
        ours = [w for w in caught if "skipped" in str(w.message)]
        assert [w.filename for w in ours] == [__file__]  # it points at the caller's step()
        eager_model, _ = _models()
        eager = dmuon.Muon(eager_model, compile=False, nonfinite_grads=mode)
        _backward(eager_model, 0, poison=True)
        with pytest.warns(UserWarning, match="skipped") as caught:
            eager.step()  # the control: read before the commit, the same warning
        assert [w.filename for w in caught if "skipped" in str(w.message)] == [__file__]
    assert len(settles) == 1 and len(opt.state) == 0  # the eager control did not settle
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    # A good step, then a poisoned one: the momentum and the weights of the good step stay.
    opt.zero_grad()
    _backward(model, 1)
    opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    _backward(model, 2, poison=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "raise":
            with pytest.raises(FloatingPointError):
                opt.step()
        else:
            opt.step()
    assert len(settles) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert str(opt.state_dict()) == str(state)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    poison=st.lists(
        st.sampled_from(["none", "grad_nan", "grad_inf", "buf_nan"]), min_size=3, max_size=3
    ),
    nesterov=st.booleans(),
)
def test_directions_flag_exactly_the_nonfinite_inputs(seed, poison, nesterov):
    """``muon_directions(finite_flags=True)``: a matrix is flagged iff its gradient or its
    momentum holds a NaN/Inf (same-shape matrices stacked: flags in ``grads``' order)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 12), (12, 8), (8, 12)]  # two share a bucket
    grads = [torch.randn(s, generator=g) for s in shapes]
    bufs = [torch.randn(s, generator=g) for s in shapes]
    for i, kind in enumerate(poison):
        if kind == "grad_nan":
            grads[i][1, 2] = float("nan")
        elif kind == "grad_inf":
            grads[i][0, 0] = float("-inf")
        elif kind == "buf_nan":
            bufs[i][3, 1] = float("nan")
    ortho, flags = F.muon_directions(
        grads, bufs, momentum=0.9, nesterov=nesterov, ns=dmuon.NewtonSchulz(), finite_flags=True
    )
    assert flags.dtype == torch.bool and flags.tolist() == [k == "none" for k in poison]
    plain = F.muon_directions(grads, bufs, momentum=0.9, nesterov=nesterov, ns=dmuon.NewtonSchulz())
    for a, b in zip(ortho, plain):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.timeout(300)
def test_the_compiled_step_reads_only_the_other_gradients(monkeypatch):
    """The compiled Muon matrices bring their flags from the directions graph: the foreach norm
    reads only the AdamW gradient (the head's weight and bias); a NaN in a Muon gradient is
    still caught, by name."""
    read = []
    real = step_agreement.StepAgreement._finite_flags

    def spy(self, grads):
        read.append(len(grads))
        return real(self, grads)

    monkeypatch.setattr(step_agreement.StepAgreement, "_finite_flags", spy)
    model, _ = _models()
    opt = dmuon.Muon(model, lr=0.02, compile=True)
    _backward(model, 0)
    opt.step()
    assert read == [2]  # head.weight, head.bias: the two Muon matrices were not read again
    opt.zero_grad()
    _backward(model, 1)
    model.down.weight.grad[2, 3] = float("inf")
    with pytest.raises(FloatingPointError, match=r"down\.weight"):
        opt.step()


class _NormCounter(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Counts the per-matrix reductions (sums over the last two dims) of a post-grad graph."""

    def __init__(self):
        self.sums = 0

    def __call__(self, graph):
        self.sums += sum(
            1
            for n in graph.nodes
            if n.target == torch.ops.aten.sum.dim_IntList and list(n.args[1]) == [-2, -1]
        )

    def uuid(self):
        return "dmuon-test-norm-counter-v1"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("finite_flags", [True, False])
def test_the_flags_and_the_normalisation_share_one_norm(finite_flags):
    """The compiled directions take each bucket's norm once: the finite flags and NS's
    normalisation read the same reduction (two calls would stay two full reads of the stack:
    Inductor does not merge them). Without flags (the control) there is one norm as well, so a
    regression that takes the norm twice shows as two reductions per bucket."""
    from dmuon_compile.compiled_step import CompiledMuonStep

    shapes = [(8, 12)] * 3 + [(12, 8)] * 2 + [(8, 8)] * 2  # three buckets
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in shapes]
    bufs = [torch.randn(s, generator=g) for s in shapes]
    counter = _NormCounter()
    step = CompiledMuonStep(dmuon.NewtonSchulz())
    with torch._inductor.config.patch(
        force_disable_caches=True, post_grad_custom_post_pass=counter
    ):
        out = step.directions(grads, bufs, momentum=0.9, nesterov=True, finite_flags=finite_flags)
    assert counter.sums == 3
    ortho = out[0] if finite_flags else out
    plain = F.muon_directions(grads, bufs, momentum=0.9, nesterov=True, ns=dmuon.NewtonSchulz())
    for a, b in zip(ortho, plain):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
