"""The step's verdict left on the device: the compiled commit and AdamW select on it
(``where(ok, new, old)``, the fused AdamW's skip), the host reads it one call later
(``StepAgreement.settle``: the next ``step()``, ``state_dict()``, ``last_step_committed()``).

- the selects themselves (``functional.commit_muon_step`` / ``adamw_update(commit_if=...)``)
  against the plain updates: a true verdict writes the same bits, a false one writes nothing,
  NaN/Inf gradients included;
- ``Muon`` with the compiled step leaves its verdict to the next call, an eager ``Muon`` reads
  at once (the control), and a deferred non-finite step raises or skips one call later: every
  weight and every state unchanged, no state left by a first step, the batch of the call that
  raised still there to step on;
- the finite flags of the compiled matrices come from the directions (the norm NS takes):
  exactly the matrices whose gradient or momentum holds a NaN/Inf are flagged, and the
  gradient check reads only the other gradients.
"""

from __future__ import annotations

import copy

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


@pytest.fixture
def reads(monkeypatch):
    """Each host read of a verdict, with whether a step was running when it happened."""
    calls = []
    real = step_agreement.StepAgreement._read_verdict

    def spy(self, check, votes, failure, deferred=False):
        calls.append(deferred)
        return real(self, check, votes, failure, deferred)

    monkeypatch.setattr(step_agreement.StepAgreement, "_read_verdict", spy)
    return calls


@pytest.mark.timeout(300)
def test_the_compiled_step_leaves_its_verdict_to_the_next_call(settles, reads):
    """The compiled step never reads its verdict: the next ``step()`` does (the deferred read),
    and it trains as the eager step, which reads at once (the control)."""
    compiled_model, eager_model = _models()
    compiled = dmuon.Muon(compiled_model, lr=0.02, compile=True)
    eager = dmuon.Muon(eager_model, lr=0.02, compile=False)
    for step in range(3):
        for model, opt in ((compiled_model, compiled), (eager_model, eager)):
            opt.zero_grad()
            _backward(model, step)
            before = list(reads)
            opt.step()
            if opt is compiled:  # the previous step's verdict read, this one's left held
                assert reads[len(before) :] == ([True] if step else [])
                assert compiled._agreement.pending is not None
            else:
                assert reads[len(before) :] == [False] and eager._agreement.pending is None
    assert compiled.last_step_committed() is True and compiled._agreement.pending is None
    assert len(settles) == 3  # the compiled optimizer's three steps; the eager one read first
    for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(
        not torch.equal(a, b) for a, b in zip(compiled_model.parameters(), _Tiny().parameters())
    )


def _state(opt):
    return {
        id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for p, s in opt.state.items()
    }


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_deferred_nonfinite_step_changes_nothing_and_is_reported_one_call_later(settles, mode):
    model, _ = _models()
    opt = dmuon.Muon(model, lr=0.02, compile=True, nonfinite_grads=mode)
    # A first step with a NaN gradient: nothing written; the next call reports it, and no
    # state of that step is left.
    _backward(model, 0, poison=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()  # returns: the verdict is still on the device
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"previous step.*up\.weight \(gradient"):
            opt.last_step_committed()
    else:
        with pytest.warns(UserWarning, match=r"previous step.*skipped.*up\.weight") as caught:
            assert opt.last_step_committed() is False
        ours = [w for w in caught if "skipped" in str(w.message)]
        assert [w.filename for w in ours] == [__file__]  # it points at the caller's line
    assert len(settles) == 1 and len(opt.state) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    # Good steps, then a poisoned one read by the next step(): the good steps' momentum,
    # moments and step counts stay, and that next step raises (or warns) before doing
    # anything; its own batch's gradients are still there to step on.
    for seed in (1, 2):
        opt.zero_grad()
        _backward(model, seed)
        opt.step()
    assert opt.last_step_committed() is True
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = _state(opt)
    opt.zero_grad()
    _backward(model, 3, poison=True)
    opt.step()
    opt.zero_grad()
    _backward(model, 4)
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"previous step"):
            opt.step()
    else:
        with pytest.warns(UserWarning, match="previous step") as caught:
            opt.step()
        assert [w.filename for w in caught if "skipped" in str(w.message)] == [__file__]
    assert len(settles) == (4 if mode == "raise" else 5)  # the raising call made none
    if mode == "raise":  # nothing of batch 4 was done; its gradients are still there
        for k, v in model.state_dict().items():
            assert torch.equal(v, weights[k]), k
        assert _same_state(_state(opt), state)
        opt.step()  # the retry steps on batch 4
    assert opt.last_step_committed() is True
    assert any(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.timeout(300)
def test_state_dict_reads_the_verdict_first(settles):
    """A checkpoint taken after a step that will not commit holds none of what it created,
    and raises its error (the control: an undeferred read would have raised in step())."""
    model, _ = _models()
    opt = dmuon.Muon(model, lr=0.02, compile=True, nonfinite_grads="skip")
    _backward(model, 0, poison=True)
    opt.step()
    assert len(opt.state) > 0  # the fresh state is still there, masked, until the read
    with pytest.warns(UserWarning, match="skipped"):
        saved = opt.state_dict()
    assert saved["state"] == {} and len(opt.state) == 0
    raising = dmuon.Muon(_models()[0], lr=0.02, compile=True)
    _backward(raising.model, 0, poison=True)
    raising.step()
    with pytest.raises(FloatingPointError, match="previous step"):
        raising.state_dict()
    # load_state_dict forgets a verdict not read yet: the loaded state replaces it.
    _backward(raising.model, 1, poison=True)
    raising.step()
    raising.load_state_dict(saved)
    assert raising._agreement.pending is None and raising.last_step_committed() is True


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=4),
    weight_decay=st.sampled_from([0.0, 0.1]),
    counts=st.lists(st.integers(0, 5), min_size=4, max_size=4),
)
def test_adamw_select_writes_the_plain_update_or_nothing(seed, shapes, weight_decay, counts):
    """``adamw_update(commit_if=...)``: true writes the bits of the plain update, false leaves
    parameters, moments and step counts untouched, NaN/Inf gradients included."""

    def lists(poison):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(s, generator=g) for s in shapes]
        grads = [torch.randn(s, generator=g) for s in shapes]
        m = [torch.randn(s, generator=g) for s in shapes]
        v = [torch.rand(s, generator=g) for s in shapes]
        steps = [torch.tensor(float(c)) for c in counts[: len(shapes)]]
        if poison:
            grads[0].view(-1)[0] = float("nan")
            grads[-1].view(-1)[-1] = float("inf")
        return params, grads, m, v, steps

    hypers = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    plain = lists(False)
    F.adamw_update(*plain, **hypers)
    chosen = lists(False)
    F.adamw_update(*chosen, **hypers, commit_if=torch.tensor(True))
    for xs, ys in zip(plain, chosen):
        assert all(torch.equal(a, b) for a, b in zip(xs, ys))
    kept = lists(True)
    before = copy.deepcopy(kept)
    F.adamw_update(*kept, **hypers, commit_if=torch.tensor(False))
    for i in (0, 2, 3, 4):  # params, moments, step counts
        assert all(torch.equal(a, b) for a, b in zip(kept[i], before[i]))
    assert [float(s) for s in plain[4]] == [c + 1 for c in counts[: len(shapes)]]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_verdict_travels_to_the_host_behind_an_event():
    """On CUDA the held verdict is copied to pinned memory after the commit; the next call
    reads it after the event: a poisoned step is reported, a good one commits."""
    torch.manual_seed(0)
    model = _Tiny().cuda()
    opt = dmuon.Muon(model, lr=0.02, nonfinite_grads="skip")  # compile: on for CUDA
    x = torch.randn(6, 8, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    host = opt._agreement.pending.host
    assert host.event is not None and all(c is None or c.is_pinned() for c in host.copies)
    assert opt.last_step_committed() is True
    opt.zero_grad()
    model(x).square().mean().backward()
    model.up.weight.grad[0, 0] = float("nan")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()
    with pytest.warns(UserWarning, match="skipped"):
        assert opt.last_step_committed() is False
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


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
    opt.step()
    with pytest.raises(FloatingPointError, match=r"down\.weight \(gradient"):
        opt.last_step_committed()


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


@pytest.mark.timeout(300)
def test_a_deferred_message_names_the_momentum_buffer_it_can_still_read():
    """Read one call later, the gradient is gone but the momentum buffer the step left
    unchanged is not: a NaN there is named as the buffer's; a NaN gradient as the gradient's."""
    model, _ = _models()
    opt = dmuon.Muon(model, lr=0.02, compile=True)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    opt.state[model.up.weight]["momentum_buffer"][1, 1] = float("nan")
    _backward(model, 1)
    opt.step()
    opt.zero_grad()  # the gradient is gone; the read comes after
    with pytest.raises(FloatingPointError, match=r"up\.weight \(momentum buffer\)") as raised:
        opt.last_step_committed()
    assert "down.weight" not in str(raised.value) and "load a good state" in str(raised.value)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_step_never_synchronises_the_host():
    """With CUDA's sync debug mode set to raise, a warm compiled step (Muon and AdamW, its
    verdict held) runs through: no host read anywhere in ``step()``. The previous verdict is
    read before the mode is set (that read waits on an event, by design). The control: the
    eager step's in-step read raises under the same mode."""
    torch.manual_seed(0)
    model = _Tiny().cuda()
    x = torch.randn(6, 8, device="cuda")
    for compiled in (True, False):
        opt = dmuon.Muon(model, lr=0.02, compile=compiled)
        for _ in range(2):  # compile and autotune first
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.last_step_committed()
        opt.zero_grad()
        model(x).square().mean().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if compiled:
                opt.step()
            else:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert opt.last_step_committed() is True or not compiled
