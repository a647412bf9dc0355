"""Muon optimizer: parity with torch.optim.Muon, routing, AdamW part, state, schedulers, errors."""

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.functional import adamw_update, lr_scale
from dmuon_compile.newton_schulz import NewtonSchulz


class TinyLM(nn.Module):
    def __init__(self, vocab=17, d=16, hidden=40):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def _loss(model, seed=0):
    idx = torch.randint(0, 17, (4, 9), generator=torch.Generator().manual_seed(seed))
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _train(model, opt, steps, seed0=0):
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = _loss(model, seed0 + i)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- parity
def test_matches_torch_optim_muon_step_for_step():
    torch.manual_seed(0)
    mats = [nn.Parameter(torch.randn(24, 40) * 0.1), nn.Parameter(torch.randn(40, 16) * 0.1)]
    ours_p = [nn.Parameter(p.detach().clone()) for p in mats]
    theirs = torch.optim.Muon(
        mats, lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original"
    )
    ns = NewtonSchulz(backend="direct", coefficients="keller_jordan", work_dtype=torch.bfloat16)
    ours = dmuon.Muon(
        ours_p, lr=0.05, weight_decay=0.1, momentum=0.9, ns_backend=ns, adjust_lr_fn="original"
    )
    for step in range(6):
        grads = [torch.randn_like(p, generator=None) for p in mats]
        for p, q, g in zip(mats, ours_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        before = [p.detach().clone() for p in mats]
        theirs.step()
        ours.step()
        for p, q, b in zip(mats, ours_p, before):
            # Each step moves a weight by lr·scale·NS(u); both NS runs are bf16, so the moves
            # agree to bf16 rounding (the inputs differ by a constant factor, see below).
            move_theirs, move_ours = p.detach() - b, q.detach() - b
            rel = (move_ours - move_theirs).norm() / move_theirs.norm()
            assert rel < 0.03, f"step {step}: update differs by {rel:.3g}"
            p.data.copy_(q.detach())  # re-align so differences do not compound
        # torch.optim.Muon keeps buf ← lerp(buf, g, 1−μ) = (1−μ)·Σ μ^k g; ours keeps Σ μ^k g.
        # NS normalises the input, so the constant factor (1−μ) does not change the update.
        for p, q in zip(mats, ours_p):
            theirs_buf = theirs.state[p]["momentum_buffer"]
            ours_buf = ours.state[q]["momentum_buffer"]
            torch.testing.assert_close(theirs_buf, (1 - 0.9) * ours_buf, rtol=1e-5, atol=1e-6)


def test_adjust_lr_functions():
    assert lr_scale((1024, 4096), "match_rms_adamw") == pytest.approx(0.2 * 64)
    assert lr_scale((4096, 1024), "original") == pytest.approx(2.0)
    assert lr_scale((1024, 4096), "original") == pytest.approx(1.0)
    assert lr_scale((7, 9), "none") == 1.0
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        lr_scale((2, 2), "bogus")


def test_default_update_is_lr_times_internal_scale():
    w = nn.Parameter(torch.zeros(32, 128))
    g = torch.randn(32, 128)
    w.grad = g.clone()
    ns = NewtonSchulz(work_dtype=torch.float64)
    opt = dmuon.Muon([w], lr=0.02, momentum=0.0, nesterov=False, ns_backend=ns)
    opt.step()
    expected = -0.02 * 0.2 * 128**0.5 * ns(g.double()).float()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-7)


def test_adamw_part_matches_torch_adamw():
    torch.manual_seed(1)
    params = [torch.randn(5, 3), torch.randn(7)]
    ref = [nn.Parameter(p.clone()) for p in params]
    ours = [p.clone() for p in params]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    steps = [torch.zeros(()) for _ in ours]
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ours]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        torch_opt.step()
        adamw_update(
            ours, grads, m, v, steps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
        )
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r.detach(), rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(1, 6), min_size=1, max_size=2).map(tuple), min_size=1, max_size=4
    ),
    steps=st.integers(1, 4),
    skipped=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3))),
    weight_decay=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_adamw_part_matches_torch_adamw_with_uneven_step_counts(
    shapes, steps, skipped, weight_decay, seed
):
    """Parameters without a gradient in some steps have their own step count: the foreach body
    takes each one's bias corrections, as torch.optim.AdamW does per parameter."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    ref = [nn.Parameter(p.clone()) for p in params]
    ours = [p.clone() for p in params]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    torch_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    counts = [torch.zeros(()) for _ in ours]
    for step in range(steps):
        live = [i for i in range(len(ours)) if (step, i) not in skipped]
        for r in ref:
            r.grad = None
        grads = {i: torch.randn(shapes[i], generator=gen) for i in live}
        for i in live:
            ref[i].grad = grads[i].clone()
        torch_opt.step()
        if live:
            adamw_update(
                [ours[i] for i in live],
                [grads[i] for i in live],
                [m[i] for i in live],
                [v[i] for i in live],
                [counts[i] for i in live],
                **kw,
            )
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r.detach(), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- routing
def test_model_routing_rule():
    model = TinyLM()
    opt = dmuon.Muon(model)
    muon = {opt.param_name(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {opt.param_name(p) for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon == {"up.weight", "down.weight"}
    assert {"embed.weight", "lm_head.weight", "up.bias", "norm.weight", "norm.bias"} == adamw


def test_predicate_override_and_errors():
    model = TinyLM()
    opt = dmuon.Muon(model, predicate=lambda name, p: name == "down.weight")
    muon = [opt.param_name(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert muon == ["down.weight"]
    with pytest.raises(ValueError, match="2-D"):
        dmuon.Muon(model, predicate=lambda name, p: True)
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        dmuon.Muon(model, predicate=lambda name, p: False)


def test_param_list_and_groups():
    w, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4))
    opt = dmuon.Muon([w, b])
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    opt = dmuon.Muon([{"params": [w], "use_muon": False, "lr": 1e-3}])
    assert opt.param_groups[0]["use_muon"] is False and opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
        (dict(adjust_lr_fn="x"), "adjust_lr_fn"),
        (dict(nonfinite_grads="ignore"), "nonfinite_grads"),
        (dict(ns_backend="svd"), "ns_backend"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dmuon.Muon(TinyLM(), **kwargs)


def test_seed_snippet_ns_backend_object():
    ns = dmuon.NewtonSchulz(kernel="cublas")  # same as deterministic=True
    optimizer = dmuon.Muon(TinyLM(), ns_backend=ns)
    assert optimizer.ns is ns
    assert dmuon.get_ns_backend() == ns.describe()
    assert dmuon.get_ns_backend(optimizer) == ns.describe()
    dmuon.Muon(TinyLM(), lr=0.02, replicate_async=False)


# --------------------------------------------------------------------------- training behaviour
@pytest.mark.parametrize("backend", ["gram", "direct"])
def test_small_model_trains(backend):
    torch.manual_seed(0)
    model = TinyLM()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2, ns_backend=backend)
    losses = [_loss(model, 0).item()]
    for _ in range(30):
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        opt.step()
    losses.append(_loss(model, 0).item())
    assert losses[-1] < 0.7 * losses[0]


def test_state_dict_round_trip_is_exact():
    torch.manual_seed(0)
    model = TinyLM()
    opt = dmuon.Muon(model, weight_decay=0.01, adamw_weight_decay=0.01)
    _train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, 2, seed0=10)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = TinyLM()
    model2.load_state_dict(saved_model)
    opt2 = dmuon.Muon(model2, weight_decay=0.01, adamw_weight_decay=0.01)
    opt2.load_state_dict(saved_opt)
    _train(model2, opt2, 2, seed0=10)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_lr_scheduler_drives_both_groups():
    model = TinyLM()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _train(model, opt, 1)
    sched.step()
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: pytest.approx(0.01), False: pytest.approx(5e-4)}
    w = model.down.weight
    before = w.detach().clone()
    _train(model, opt, 1)
    move = (w.detach() - before).norm()
    # the update of an orthogonalised step has a known size: lr·scale·‖NS(u)‖
    assert 0.0 < move < 0.01 * lr_scale(w.shape, "match_rms_adamw") * (min(w.shape) ** 0.5) * 1.3


def test_none_gradient_is_skipped():
    model = TinyLM()
    opt = dmuon.Muon(model)
    loss = model.down(torch.randn(3, 40)).sum()  # only down.weight gets a gradient
    loss.backward()
    up_before = model.up.weight.detach().clone()
    opt.step()
    assert torch.equal(model.up.weight, up_before)
    assert model.up.weight not in opt.state and model.down.weight in opt.state


def test_nonfinite_gradient_raises_with_name_and_leaves_state():
    model = TinyLM()
    opt = dmuon.Muon(model)
    _train(model, opt, 1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    _loss(model).backward()
    model.up.weight.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"up\.weight"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    assert str(opt.state_dict()) == str(state)


def test_nonfinite_gradient_skip_mode():
    model = TinyLM()
    opt = dmuon.Muon(model, nonfinite_grads="skip")
    _loss(model).backward()
    model.norm.weight.grad[0] = float("inf")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"skipped.*norm\.weight"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    assert len(opt.state) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        _loss(model).backward()
        opt.step()


def test_fsdp_shard_without_dedicate_params_is_a_clear_error(monkeypatch):
    """A sharded matrix routed to Muon would be orthogonalised per shard: wrong math."""
    model = TinyLM()
    monkeypatch.setattr(type(model.up.weight), "to_local", lambda self: self, raising=False)
    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon.Muon(model)
