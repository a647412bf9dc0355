"""The pass inside Inductor and the compiled Muon step (CPU; torch.ops.dmuon run their CPU code).

Compiles are slow on a 2-core CPU (~10–40 s each): every test here compiles at most a few
small graphs, and the hypothesis test keeps to a handful of examples.
"""

import re

import pytest
import torch
from dmuon_compile.passes import NSChainPass, compile_options, install_global_pass
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.compiled_step import CompiledMuonStep, StepKey, default_compile_options
from dmuon_compile.newton_schulz import NewtonSchulz


def _count(code: str, pattern: str) -> int:
    return len(re.findall(pattern, code))


class RecordingUserPass(CustomGraphPass):
    """A user's own post-grad pass: it must still run, before ours, on the raw graph."""

    def __init__(self):
        self.calls = 0
        self.mm_seen = 0

    def __call__(self, graph):
        self.calls += 1
        self.mm_seen += sum(1 for n in graph.nodes if n.target == torch.ops.aten.mm.default)

    def uuid(self):
        return "recording-user-pass-v1"


def test_pass_fires_in_inductor_direct_2d_bf16_and_wraps_user_pass():
    ns = NewtonSchulz(backend="direct", kernel="cublas", work_dtype=torch.bfloat16)
    user = RecordingUserPass()
    x = torch.randn(16, 48)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=user):
        options = compile_options()  # wraps the configured user pass, never overwrites it
        assert options["post_grad_custom_pre_pass"].user_pass is user
        fn = torch.compile(lambda g: ns(g), fullgraph=True, options=options)
        out, (code, *_) = run_and_get_code(fn, x)
    # It saw the raw chain: 5 × mm(X, Xᵀ) and 5 × mm(B + a·I, X).
    assert user.calls == 1 and user.mm_seen == 10
    FileCheck().check_count("torch.ops.dmuon.syrk.default(", 5, exactly=True).run(code)
    FileCheck().check_count("torch.ops.dmuon.sym_mm.default(", 5, exactly=True).run(code)
    assert _count(code, r"extern_kernels\.mm\(") == 5  # (B + a·I)·X (rectangular) stays
    assert _count(code, r"extern_kernels\.addmm\(") == 0  # no C term: no copy of X
    assert "eye" not in code  # a·I went into the polynomial's epilogue
    assert counters["dmuon"]["syrk"] == 5 and counters["dmuon"]["sym_mm"] == 5
    torch.testing.assert_close(out.float(), ns(x).float(), atol=3e-2, rtol=3e-2)


def test_pass_fires_in_inductor_gram_3d_fp16():
    ns = NewtonSchulz(backend="gram", kernel="cublas")  # fp16, Polar Express, restart at 2
    x = torch.randn(3, 8, 40)
    fn = torch.compile(lambda g: ns(g), fullgraph=True, options=compile_options())
    out, (code, *_) = run_and_get_code(fn, x)
    FileCheck().check_count("torch.ops.dmuon.syrk.default(", 2, exactly=True).run(code)
    FileCheck().check_count("torch.ops.dmuon.sym_mm.default(", 14, exactly=True).run(code)
    # Every Gram-space product carries its C term (Q·Z + a·Q, not Q·(Z + a·I): see gram_ns).
    assert _count(code, r"sym_mm\.default\(\w+, \w+, None,") == 0
    assert _count(code, r"extern_kernels\.baddbmm\(") == 0
    assert _count(code, r"extern_kernels\.bmm\(") == 2  # Q·X, once per segment
    torch.testing.assert_close(out.float(), ns(x).float(), atol=1e-2, rtol=1e-2)


def test_non_symmetric_a_left_alone_by_inductor():
    def poly(a):
        return torch.addmm(a, a, a, beta=-4.775, alpha=2.0315)

    a = torch.randn(12, 12)
    fn = torch.compile(poly, fullgraph=True, options=compile_options())
    out, (code, *_) = run_and_get_code(fn, a)
    assert "torch.ops.dmuon" not in code
    assert counters["dmuon"]["sym_mm"] == 0 and counters["dmuon"]["skipped"] >= 1
    torch.testing.assert_close(out, poly(a))


def _params(shapes, dtype, seed):
    """Parameters of ``shapes``; a 3-D one is declared an expert stack (per-expert NS)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    return [dmuon.set_layout(p, dmuon.Layout.experts()) if p.ndim == 3 else p for p in ps]


def _set_grads(ps_a, ps_b, seed):
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(ps_a, ps_b):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad, q.grad = grad, grad.clone()


@settings(max_examples=3)
@given(
    shapes=st.sampled_from([[(8, 24), (8, 24), (12, 12)], [(20, 6), (6, 10)], [(4, 16, 3)]]),
    work_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    backend=st.sampled_from(["gram", "direct"]),
    coefficients=st.sampled_from(["keller_jordan", "you", "polar_express"]),
    nesterov=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_compiled_step_equals_eager_step(shapes, work_dtype, backend, coefficients, nesterov, seed):
    """fp32 parameters (as Muon keeps them); the NS chain runs in ``work_dtype``.

    bf16 *parameters* are left out on purpose: one update (~0.02) is below a bf16 ulp of the
    weights, so compiled (one rounding) and eager (two roundings) differ by whole ulps.
    """
    if backend == "gram" and work_dtype == torch.bfloat16:
        work_dtype = torch.float16  # Gram NS iterates in fp16 (docs/architecture.md, Newton–Schulz)
    torch._dynamo.reset()
    ps_c, ps_e = _params(shapes, torch.float32, seed), _params(shapes, torch.float32, seed)
    ns = NewtonSchulz(
        backend=backend, kernel="auto", coefficients=coefficients, work_dtype=work_dtype
    )
    kw = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "ns_backend": ns}
    opt_c, opt_e = dmuon.Muon(ps_c, compile=True, **kw), dmuon.Muon(ps_e, compile=False, **kw)
    for step in range(2):
        _set_grads(ps_c, ps_e, seed + step)
        opt_c.step()
        opt_e.step()
    assert counters["dmuon"]["syrk"] >= 1  # the compiled step ran the pass
    tol = 1e-5 if work_dtype == torch.float32 else 1e-3  # updates are ~2e-2: 5% of one step
    for p, q, p0 in zip(ps_c, ps_e, _params(shapes, torch.float32, seed)):
        assert (p - p0).abs().max() > 1e-3  # the step moved the weights
        torch.testing.assert_close(p, q, atol=tol, rtol=0)
        torch.testing.assert_close(
            opt_c.state[p]["momentum_buffer"],
            opt_e.state[q]["momentum_buffer"],
            atol=1e-6,
            rtol=1e-6,
        )


def test_lr_schedule_never_recompiles_and_no_graph_breaks():
    shapes = [(8, 24), (8, 24), (16, 16)]
    ps_c, ps_e = _params(shapes, torch.float32, 0), _params(shapes, torch.float32, 0)
    opts = [
        dmuon.Muon(ps, lr=0.02, weight_decay=0.05, ns_backend="direct", compile=c)
        for ps, c in ((ps_c, True), (ps_e, False))
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    lrs, graphs_after_first = [], None
    for step in range(20):
        _set_grads(ps_c, ps_e, step)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
        lrs.append(float(opts[0].param_groups[0]["lr"]))  # a tensor, refilled in place
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    assert len(set(lrs)) == 20  # the schedule really changed lr every step
    assert graphs_after_first == 2  # the directions (NS) and the commit (momentum, update)
    assert counters["stats"]["unique_graphs"] == 2  # zero recompiles over 19 more steps
    assert list(opts[0].compiled_steps) == [StepKey(group=0, part="all")]
    (compiled,) = opts[0].compiled_steps.values()
    assert compiled.calls == 20  # ... and every step ran the compiled graph, not eager
    # a checkpoint round trip (new group dicts, new momentum tensors) does not recompile either
    for o in opts:
        o.load_state_dict(o.state_dict())
    _set_grads(ps_c, ps_e, 99)
    for o in opts:
        o.step()
    assert counters["stats"]["unique_graphs"] == 2 and compiled.calls == 21
    assert sum(counters["graph_break"].values()) == 0
    for p, q in zip(ps_c, ps_e):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)


def test_user_compiled_opt_step_gets_the_same_rewrite():
    """``opt.step = torch.compile(opt.step)``: Muon installs the pass while Dynamo traces."""
    shapes = [(8, 24), (8, 24)]
    ps_c, ps_e = _params(shapes, torch.float32, 1), _params(shapes, torch.float32, 1)
    opt_c = dmuon.Muon(ps_c, lr=0.02, ns_backend="direct", compile=False)
    opt_e = dmuon.Muon(ps_e, lr=0.02, ns_backend="direct", compile=False)
    opt_c.step = torch.compile(opt_c.step)
    for step in range(2):
        _set_grads(ps_c, ps_e, step)
        opt_c.step()
        opt_e.step()
    assert isinstance(torch._inductor.config.post_grad_custom_pre_pass, NSChainPass)
    # one batched chain of 5 steps per compile of the step's graph
    assert counters["dmuon"]["syrk"] >= 5 and counters["dmuon"]["syrk"] % 5 == 0
    assert counters["dmuon"]["sym_mm"] == counters["dmuon"]["syrk"]
    for p, q in zip(ps_c, ps_e):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)


def test_compile_arguments_are_checked():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="compile_mode='reduce-overhead' needs compile=True"):
        dmuon.Muon(p, compile=False, compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile_mode='fast'"):
        dmuon.Muon(p, compile_mode="fast")
    with pytest.raises(TypeError, match="compile must be True, False or None"):
        dmuon.Muon(p, compile="yes")
    assert dmuon.Muon(p).compile is None  # auto: compiled on CUDA only
    # set on a live optimizer: the same checks, the setting left as it was
    live = dmuon.Muon(p, compile=False)
    with pytest.raises(ValueError, match="compile_mode='reduce-overhead' needs compile=True"):
        live.compile_mode = "reduce-overhead"
    assert live.compile_mode is None
    auto = dmuon.Muon(p)
    with pytest.raises(ValueError, match="compile_mode='fast'"):
        auto.compile_mode = "fast"
    auto.compile_mode = "reduce-overhead"  # control: a valid mode is taken
    assert auto.compile_mode == "reduce-overhead"
    ro = default_compile_options("reduce-overhead")
    assert ro["triton.cudagraphs"] is True and isinstance(
        ro["post_grad_custom_pre_pass"], NSChainPass
    )
    step = CompiledMuonStep(NewtonSchulz(kernel="cublas"), mode="reduce-overhead")
    assert step.options["triton.cudagraphs"] is True


def test_explicit_cublas_kernel_keeps_the_plain_chain_in_the_compiled_step():
    """kernel="cublas" (= deterministic=True) must mean no project kernels, compiled or not:
    the documented way to tell whether the fast SYRK path causes a NaN."""
    from dmuon_compile.compiled_step import pass_enabled

    assert not pass_enabled(NewtonSchulz(kernel="cublas"))
    assert not pass_enabled(NewtonSchulz(deterministic=True))
    if not torch.cuda.is_available():
        assert pass_enabled(
            NewtonSchulz()
        )  # CPU: the ops run their reference (how CI tests the pass)
    # A user-compiled step earlier in the process installs the pass globally: this step must
    # still keep it out (it once inherited the global pass and rewrote the chain).
    install_global_pass()
    w = torch.nn.Parameter(torch.randn(16, 48))
    opt = dmuon.Muon([w], compile=True, ns_backend=NewtonSchulz("direct", kernel="cublas"))
    w.grad = torch.randn_like(w)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(opt.step)
    code = "\n".join(code)
    assert "torch.ops.dmuon" not in code
    assert _count(code, r"extern_kernels\.mm\(") == 10  # per step X·Xᵀ and (B + a·I)·X


def test_without_the_rewrite_a_global_pass_is_unwrapped_to_the_users_own():
    """``rewrite=False`` options drop a globally installed NS-chain pass but keep the user's
    pass it wraps; with the rewrite the same global pass is used (the control)."""
    user = RecordingUserPass()
    torch._inductor.config.post_grad_custom_pre_pass = user
    installed = install_global_pass()
    assert torch._inductor.config.post_grad_custom_pre_pass is installed
    assert default_compile_options(rewrite=False)["post_grad_custom_pre_pass"] is user
    assert default_compile_options(rewrite=True)["post_grad_custom_pre_pass"] is installed


def test_the_compiled_step_compiles_the_eager_function():
    """One implementation: the compiled step's function is a copy of
    ``functional.muon_directions`` (the first half of ``functional.muon_update``: its own code
    object, the same bytecode and keyword defaults), not a second body."""
    step = CompiledMuonStep(NewtonSchulz(kernel="cublas"))
    fn = step.fn._torchdynamo_orig_callable
    assert fn.__code__ is not F.muon_directions.__code__  # a fresh Dynamo cache per step
    assert fn.__code__.co_code == F.muon_directions.__code__.co_code
    assert fn.__kwdefaults__ == F.muon_directions.__kwdefaults__
    assert fn.__code__.co_code != F.adamw_update.__code__.co_code  # the check can tell


def test_compiled_steps_are_keyed_by_group_position_and_part():
    """``Muon.compiled_steps``: one step per (group position, part) — HSDP's two parts get two
    — the same one again after ``load_state_dict`` (new group dicts), a new one when ``opt.ns``
    is replaced. Nothing is compiled here (``torch.compile`` compiles at the first call)."""
    from dmuon_compile.compiled_step import compiled_step_for

    ps = _params([(8, 24), (16, 16)], torch.float32, 0)
    opt = dmuon.Muon(ps, compile=True)
    assert opt.compiled_steps == {}  # created by __init__, empty until a compiled step runs
    group = opt.param_groups[0]
    early = compiled_step_for(opt, group, ps[:1], part="early")
    rest = compiled_step_for(opt, group, ps[1:], part="rest")
    assert early is not rest
    assert set(opt.compiled_steps) == {StepKey(0, "early"), StepKey(0, "rest")}
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0] is not group  # the dicts were replaced ...
    assert compiled_step_for(opt, opt.param_groups[0], ps[:1], part="early") is early  # ... not it
    opt.ns = NewtonSchulz(backend="direct")
    assert compiled_step_for(opt, opt.param_groups[0], ps[:1], part="early") is not early
    assert compiled_step_for(dmuon.Muon(ps, compile=False), group, ps) is None  # eager


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # CUDA: Inductor writes foreach outputs whole there (not on the CPU)
@pytest.mark.parametrize("normalize_each", [True, False])
def test_a_buckets_fp32_inputs_are_never_written_whole(normalize_each, device, monkeypatch):
    """The directions graph stacks a bucket's inputs normalised, in the work dtype: its only
    full-size buffers are the bf16 stack NS reads and NS's own; the fp32 Nesterov inputs are
    computed where the norm and the scaled cast read them, never written. Control: below the
    size where it does so, the fp32 inputs are stacked first, an fp32 buffer of the whole stack."""
    monkeypatch.setattr(F, "COMPUTED_WHERE_READ_MIN_VALUES", 1 if normalize_each else 1 << 30)
    ns = NewtonSchulz(kernel="cublas", work_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 24, 40)] * 3 + [(40, 24)] * 2  # expert stacks; tall matrices (transposed)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    bufs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    lays = [dmuon.Layout.experts()] * 3 + [dmuon.Layout()] * 2

    def directions(grads, bufs, mu):
        return F.muon_directions(
            grads, bufs, momentum=mu, nesterov=True, ns=ns, finite_flags=True, layouts=lays
        )

    torch._dynamo.reset()
    fn = torch.compile(directions, fullgraph=True, dynamic=False)
    mu = torch.tensor(0.95, device=device)
    (out, flags), (code, *_) = run_and_get_code(fn, grads, bufs, mu)
    eager, eager_flags = directions(grads, bufs, mu)
    for a, b in zip(out, eager):  # bf16 iterations: the two differ by its rounding
        assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()
    assert flags.tolist() == eager_flags.tolist() == [True] * 5
    pattern = rf"empty_strided_{device}\(\(12, 24, 40\), \([^)]*\), torch\.(\w+)\)"
    whole = re.findall(pattern, code)
    assert ("float32" in whole) is not normalize_each, whole


def test_a_commit_that_fails_to_compile_commits_eager_and_warns(monkeypatch):
    """The commit runs after the step's verdict, so a compile failure there must not raise: the
    eager reference commits (now and later), with a warning naming the fallback. Control: the
    failing compiled commit was called (once: later steps go eager straight away)."""
    from dmuon_compile import compiled_step

    class CompileFailed(torch._dynamo.exc.TorchDynamoException):
        pass

    calls = []

    def failing_commit(*args, **kwargs):
        calls.append(1)
        raise CompileFailed("backend compiler failed (injected)")

    real_init = compiled_step.CompiledMuonStep.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._commit = failing_commit

    monkeypatch.setattr(compiled_step.CompiledMuonStep, "__init__", init)
    torch._dynamo.reset()
    shapes = [(8, 24), (12, 12)]
    ps_c, ps_e = _params(shapes, torch.float32, 3), _params(shapes, torch.float32, 3)
    ns = NewtonSchulz(kernel="auto", work_dtype=torch.float32)
    kw = {"lr": 0.02, "weight_decay": 0.1, "ns_backend": ns}
    opt_c, opt_e = dmuon.Muon(ps_c, compile=True, **kw), dmuon.Muon(ps_e, compile=False, **kw)
    for step in range(3):
        _set_grads(ps_c, ps_e, 10 + step)
        if step == 0:
            with pytest.warns(RuntimeWarning, match="failed to compile.*eager reference"):
                opt_c.step()
        else:
            opt_c.step()
        opt_e.step()
    assert calls == [1]
    for p, q, p0 in zip(ps_c, ps_e, _params(shapes, torch.float32, 3)):
        assert (p - p0).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
