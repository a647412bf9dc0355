"""The NS-chain rewrite on aten graphs (make_fx, no Inductor): what fires, what is left alone.

Every rewritten graph is also *run* and compared with the function it came from, so a rewrite
that maps an argument wrongly fails here even if the counts are right.
"""

import pytest
import sympy
import torch
from dmuon_compile.passes import NSChainPass, SymmetryAnalysis, rewrite_ns_chain
from dmuon_compile.passes import polynomial as P
from dmuon_compile.passes.symmetry import is_gram_product
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from dmuon_compile import coefficients as coeffs
from dmuon_compile.newton_schulz import NewtonSchulz

aten = torch.ops.aten
SYRK = torch.ops.dmuon.syrk.default
SYM_MM = torch.ops.dmuon.sym_mm.default
TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def leftover_gram_products(gm) -> int:
    return sum(
        1 for n in gm.graph.nodes if n.op == "call_function" and is_gram_product(n) is not None
    )


def rewrite(gm, **kw):
    stats = rewrite_ns_chain(gm.graph, **kw)
    gm.graph.lint()
    gm.recompile()
    return stats


def expected_gram_counts(steps: int, restarts: tuple[int, ...]) -> tuple[int, int]:
    """(syrk, sym_mm) of Gram NS: one X·Xᵀ per segment; per step Z, Q (not on a segment's
    first step), RZ and R (not on a segment's last step)."""
    segments = len(restarts) + 1
    return segments, steps + (steps - segments) + 2 * (steps - segments)


@pytest.mark.parametrize("shape", [(8, 24), (3, 8, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_direct_chain_fully_rewritten(trace, shape, dtype):
    ns = NewtonSchulz(backend="direct", kernel="cublas", work_dtype=dtype)
    x = torch.randn(shape)
    gm = trace(ns, x)
    assert leftover_gram_products(gm) == 5  # the test can fail: the chain has them before
    stats = rewrite(gm)
    assert stats.rewrites["syrk"] == 5 and stats.rewrites["sym_mm"] == 5
    # B + a·I: the identity term folded into each polynomial's epilogue (gamma).
    assert stats.rewrites["fold_identity"] == 5
    assert leftover_gram_products(gm) == 0
    assert targets(gm).count(SYRK) == 5 and targets(gm).count(SYM_MM) == 5
    # (B + a·I)·X is rectangular: it stays a BLAS mm/bmm without a C term (no copy of X into
    # the output), one per step.
    rect = aten.mm.default if len(shape) == 2 else aten.bmm.default
    assert targets(gm).count(rect) == 5
    assert aten.addmm.default not in targets(gm) and aten.baddbmm.default not in targets(gm)
    torch.testing.assert_close(gm(x).float(), ns(x).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("restarts", [(2,), ()], ids=["restart2", "norestart"])
def test_gram_chain_fully_rewritten(trace, restarts):
    ns = NewtonSchulz(backend="gram", kernel="cublas", restart_iterations=restarts)
    x = torch.randn(2, 8, 40)
    gm = trace(ns, x)
    stats = rewrite(gm)
    n_syrk, n_sym = expected_gram_counts(5, restarts)
    assert (stats.rewrites["syrk"], stats.rewrites["sym_mm"]) == (n_syrk, n_sym)
    assert leftover_gram_products(gm) == 0
    assert aten.baddbmm.default not in targets(gm)  # every m×m product became symmetric
    assert targets(gm).count(aten.bmm.default) == n_syrk  # Q·X, once per segment
    torch.testing.assert_close(gm(x).float(), ns(x).float(), atol=1e-2, rtol=1e-2)


def test_non_symmetric_a_is_left_alone(trace):
    """b·A + c·A·A matches the direct-NS shape for any A; only a symmetric A may be rewritten."""

    def poly_of_input(a):
        return torch.addmm(a, a, a, beta=-4.775, alpha=2.0315), -4.775 * a + 2.0315 * (a @ a)

    a = torch.randn(16, 16)  # not symmetric
    gm = trace(poly_of_input, a)
    stats = rewrite(gm)
    assert sum(stats.rewrites.values()) == 0
    assert SYM_MM not in targets(gm) and SYRK not in targets(gm)
    assert any("not provably symmetric" in s for s in stats.skipped)
    for got, want in zip(gm(a), poly_of_input(a)):
        torch.testing.assert_close(got, want)

    def poly_of_gram(x):  # positive control: the same shapes on A = X·Xᵀ are rewritten
        return poly_of_input(x @ x.T)

    x = torch.randn(16, 48)
    gm = trace(poly_of_gram, x)
    stats = rewrite(gm)
    assert stats.rewrites["sym_mm"] + stats.rewrites["fold_epilogue"] >= 2
    for got, want in zip(gm(x), poly_of_gram(x)):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_provenance_survives_dtype_conversions(trace):
    """bf16 chains computed with fp32 products add convert_element_type between the ops."""

    def mixed(x):
        xf = x.float()
        a = (xf @ xf.T).to(torch.bfloat16)  # Gram in fp32, kept in bf16
        b = torch.addmm(a, a, a, beta=-4.775, alpha=2.0315)
        return torch.addmm(a.float(), b.float(), a.float(), beta=0.5)  # fp32 again: still a poly

    x = (torch.randn(8, 24) / 24**0.5).to(torch.bfloat16)  # NS-like scale: |A| ~ 1
    gm = trace(mixed, x)
    stats = rewrite(gm)
    assert stats.rewrites["syrk"] == 1 and stats.rewrites["sym_mm"] == 2
    assert stats.proved == 2
    torch.testing.assert_close(gm(x), mixed(x), atol=5e-2, rtol=5e-2)


def test_symmetric_but_not_commuting_is_left_alone(trace):
    """A·B of two unrelated symmetric matrices is not symmetric: no sym_mm."""

    def f(x, y):
        a, b = x @ x.T, y @ y.T
        return a @ b, torch.addmm(a, a, b), a @ (a @ a)

    x, y = torch.randn(8, 20), torch.randn(8, 20)
    gm = trace(f, x, y)
    stats = rewrite(gm)
    assert stats.rewrites["syrk"] == 2
    assert stats.rewrites["sym_mm"] == 2  # only a·a and a·(a·a)
    assert sum("not polynomials of one root" in s for s in stats.skipped) == 2
    for got, want in zip(gm(x, y), f(x, y)):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_unrelated_matmuls_left_alone(trace):
    def model_like(x, w, v):
        h = x @ w.T  # a linear layer: X·Wᵀ with W ≠ X
        s = h @ v  # rectangular
        g = w.T @ w  # Wᵀ·W: symmetric, but not the X·Xᵀ form the pass looks for
        sq = torch.addmm(g, g, w.T @ w)  # symmetric operands, but no shared root known
        return torch.addmm(s, h, v), s, g @ torch.ones(16, 3), sq

    args = (torch.randn(8, 16), torch.randn(12, 16), torch.randn(12, 5))
    gm = trace(model_like, *args)
    before = targets(gm)
    stats = rewrite(gm)
    assert sum(stats.rewrites.values()) == 0
    assert targets(gm) == before
    for got, want in zip(gm(*args), model_like(*args)):
        torch.testing.assert_close(got, want)


def test_raw_form_folds_into_one_sym_mm(trace):
    """User code writes b·A + c·(A@A); the epilogue fold gives one sym_mm with c=A."""

    def raw(x):
        a = x @ x.mT
        return 3.0 * a + 2.0 * (a @ a) - 0.5 * torch.eye(8)

    x = torch.randn(2, 8, 24)
    gm = trace(raw, x)
    stats = rewrite(gm)
    assert stats.rewrites["syrk"] == 1 and stats.rewrites["fold_epilogue"] == 1
    assert stats.rewrites["fold_identity"] == 1
    sym = [n for n in gm.graph.nodes if n.target == SYM_MM]
    assert len(sym) == 1 and sym[0].args[3:] == (2.0, 3.0, -0.5)
    assert aten.bmm.default not in targets(gm) and aten.add.Tensor not in targets(gm)
    torch.testing.assert_close(gm(x), raw(x), atol=1e-4, rtol=1e-5)


def test_rewrite_proofs_reject_a_wrong_mapping():
    r = P.root_poly()
    z = P.affine_product(r, r, r, alpha=2.0315, beta=-4.775, gamma=0)
    assert P.prove_same(z, P.affine_product(r, r, r, 2.0315, -4.775, 0))
    assert not P.prove_same(z, P.affine_product(r, r, r, -4.775, 2.0315, 0))  # swapped
    assert not P.prove_same(z, P.affine_product(r, r, None, 2.0315, 0.0, 0))  # dropped c
    assert not P.prove_same(z, None)


def test_provenance_polynomial_is_the_composed_ns_polynomial(trace):
    """The Q the traced Gram chain builds is q(R) with x·q(x²) = the NS polynomial (exact)."""
    table = coeffs.polar_express(3)
    ns = NewtonSchulz(
        backend="gram",
        kernel="cublas",
        coefficients=table,
        restart_iterations=(),
        work_dtype=torch.float32,
    )
    gm = trace(ns, torch.randn(6, 30))
    analysis = SymmetryAnalysis()
    for node in gm.graph.nodes:
        analysis.visit(node)
    final = [n for n in gm.graph.nodes if n.target == aten.mm.default][-1]  # X ← Q·X
    q = analysis.get(final.args[0])
    assert q is not None and q.poly is not None
    x = sympy.Symbol("x")
    applied = sympy.expand(x * q.poly.as_expr().subs(P.R, x**2))
    assert sympy.expand(applied - P.composed_ns_polynomial(table)) == 0
    # and a different table gives a different polynomial (the check can fail)
    other = P.composed_ns_polynomial(coeffs.resolve("keller_jordan", "keller_jordan", 3))
    assert sympy.expand(applied - other) != 0


@settings(max_examples=12)
@given(
    backend=st.sampled_from(["gram", "direct"]),
    batch=st.sampled_from([0, 1, 3]),
    m=st.integers(2, 12),
    aspect=st.sampled_from([1.0, 1.7, 3.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    table=st.sampled_from(["keller_jordan", "you", "polar_express"]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rewritten_graph_equals_original(backend, batch, m, aspect, dtype, table, transposed, seed):
    if backend == "gram" and dtype == torch.bfloat16:
        dtype = torch.float16  # Gram NS iterates in fp16 (docs/architecture.md, Newton–Schulz)
    n = max(m, round(m * aspect))
    shape = ((batch,) if batch else ()) + ((n, m) if transposed else (m, n))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    ns = NewtonSchulz(backend=backend, kernel="cublas", coefficients=table, work_dtype=dtype)
    gm = make_fx(ns, tracing_mode="fake")(x)
    stats = rewrite(gm)
    assert stats.rewrites["syrk"] >= 1 and stats.rewrites["sym_mm"] >= 1
    assert leftover_gram_products(gm) == 0
    got, want = gm(x).float(), ns(x).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=8 * TOL[dtype], rtol=8 * TOL[dtype])


def test_nschainpass_runs_user_pass_first_and_hashes_it(trace):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class UserPass(CustomGraphPass):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, graph):
            seen.append(sum(1 for n in graph.nodes if n.target == SYRK))  # before ours: 0

        def uuid(self):
            return self.tag

    gm = trace(lambda x: (x @ x.T) @ (x @ x.T), torch.randn(4, 9))
    p = NSChainPass(UserPass("a"))
    p(gm.graph)
    assert seen == [0] and p.last_stats.rewrites["syrk"] == 2
    assert NSChainPass().uuid() == NSChainPass().uuid()  # stable: the FX cache stays usable
    assert p.uuid() != NSChainPass(UserPass("b")).uuid() != NSChainPass().uuid()
    assert NSChainPass(subpasses=("syrk",)).uuid() != NSChainPass().uuid()
    assert NSChainPass(lambda graph: None).uuid() is None  # a plain function has no uuid
    with pytest.raises(ValueError, match="twice"):
        NSChainPass(p)
    with pytest.raises(ValueError, match="unknown dmuon sub-pass"):
        NSChainPass(subpasses=("syrk", "nope"))


@pytest.mark.parametrize(
    "shape,rewritten",
    [
        ((1024, 3000), False),  # one 1024² product: cuBLAS, as eager NS
        ((4096, 100), True),
        ((8, 2048, 64), True),  # a stack of 8 × 2048²: Triton
        ((4, 2048, 64), False),
    ],
)
def test_cuda_products_below_the_size_gate_stay_on_cublas(shape, rewritten):
    """On CUDA the pass applies eager NS's size gate (``kernel_choice.size_gate``): small
    products keep the plain cuBLAS ``mm`` (no mirror pass, no op dispatch), and say why. Fake
    CUDA tensors: shapes and devices only, so this runs on CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(shape, device="cuda", dtype=torch.float16)
    gm = make_fx(lambda x: x @ x.mT, tracing_mode="fake")(x)
    stats = rewrite_ns_chain(gm.graph)
    assert (targets(gm).count(SYRK) == 1) == rewritten
    assert stats.rewrites["syrk"] == int(rewritten)
    assert any("size gate" in why for why in stats.skipped) != rewritten


def test_cpu_products_are_rewritten_at_every_size(trace):
    """The gate is CUDA-only: the CPU reference path (and these tests) rewrite small products."""
    gm = trace(lambda x: x @ x.mT, torch.randn(5, 7))
    assert rewrite(gm).rewrites["syrk"] == 1


def test_size_gate_leaves_rectangular_products_to_the_usual_rule():
    """A small rectangular CUDA product (Q·X) is not reported as gated: it is skipped for being
    rectangular, as everywhere."""
    from dmuon_compile.passes.ns_rewrite import below_size_gate
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(64, 64, device="cuda", dtype=torch.float16)
        x = torch.empty(64, 256, device="cuda", dtype=torch.float16)
    gm = make_fx(lambda q, x: q @ x, tracing_mode="fake")(q, x)
    (mm,) = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    assert below_size_gate(mm) is None
    assert rewrite(gm).rewrites["syrk"] == 0 and targets(gm).count(aten.mm.default) == 1
