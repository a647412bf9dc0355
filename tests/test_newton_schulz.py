"""Newton–Schulz eager reference: property tests against float64 and an SVD-based oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import coefficients as C
from dmuon_compile.newton_schulz import (
    NewtonSchulz,
    TorchPrimitives,
    normalize,
    singular_value_band,
)

# Relative Frobenius error of a work-dtype run against the float64 run of the same iteration.
# Measured worst cases on CPU over the shapes below: bf16 gram 0.065, fp16 gram 0.015,
# bf16 direct 0.019, fp16 direct 0.002; fp32 < 1e-5.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.04, torch.bfloat16: 0.12}

shapes = st.one_of(
    st.tuples(st.integers(1, 48), st.integers(1, 160)),  # wide, tall, 1×n, odd sizes
    st.tuples(st.integers(1, 3), st.integers(1, 24), st.integers(1, 80)),  # batched stacks
)
tables = st.sampled_from(["keller_jordan", "you", "polar_express"])
work_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def svd_oracle(g: torch.Tensor, table) -> torch.Tensor:
    """NS computed on singular values: U·p(Σ/‖G‖)·Vᵀ in float64 — independent of both algorithms."""
    g = g.double()
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / (torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True).squeeze(-1) + 1e-7)
    for a, b, c in table:
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag_embed(s) @ vh


@given(
    shape=shapes,
    table=tables,
    backend=st.sampled_from(["gram", "direct"]),
    seed=st.integers(0, 2**16),
)
def test_float64_matches_svd_oracle(shape, table, backend, seed):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ns = NewtonSchulz(backend=backend, coefficients=table, work_dtype=torch.float64)
    out = ns(g)
    assert out.shape == g.shape and out.dtype == torch.float64
    assert _rel(out, svd_oracle(g, ns.coefficients)) < 1e-9


@given(
    shape=shapes,
    table=tables,
    backend=st.sampled_from(["gram", "direct"]),
    dtype=work_dtypes,
    seed=st.integers(0, 2**16),
)
def test_work_dtype_close_to_float64_run(shape, table, backend, dtype, seed):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    ns = NewtonSchulz(backend=backend, coefficients=table, work_dtype=dtype)
    ref = NewtonSchulz(backend=backend, coefficients=table, work_dtype=torch.float64)(g.double())
    out = ns(g)
    assert out.dtype == dtype and out.shape == g.shape
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOLERANCE[dtype]


@given(
    m=st.integers(2, 40),
    aspect=st.floats(2.0, 6.0),
    dtype=work_dtypes,
    seed=st.integers(0, 2**16),
    batch=st.sampled_from([None, 2]),
)
def test_gram_agrees_with_direct_for_wide_matrices(m, aspect, dtype, seed, batch):
    n = int(m * aspect)
    shape = (m, n) if batch is None else (batch, m, n)
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    gram = NewtonSchulz(backend="gram", coefficients="you", work_dtype=dtype)
    direct = NewtonSchulz(backend="direct", coefficients="you", work_dtype=dtype)
    assert gram.uses_gram(m, n)
    # Same polynomial, different association: equal up to the work dtype's rounding (twice).
    assert _rel(gram(g), direct(g)) < 2 * TOLERANCE[dtype]


def test_gram_equals_direct_exactly_in_float64():
    g = torch.randn(3, 24, 100, dtype=torch.float64)
    gram = NewtonSchulz(backend="gram", coefficients="polar_express", work_dtype=torch.float64)(g)
    direct = NewtonSchulz(backend="direct", coefficients="polar_express", work_dtype=torch.float64)(
        g
    )
    assert _rel(gram, direct) < 1e-12


@pytest.mark.parametrize("restarts", [(), (1,), (2,), (1, 3)])
def test_restart_positions_keep_the_polynomial(restarts):
    g = torch.randn(20, 90, dtype=torch.float64)
    ns = NewtonSchulz(backend="gram", restart_iterations=restarts, work_dtype=torch.float64)
    assert _rel(ns(g), svd_oracle(g, ns.coefficients)) < 1e-9


@given(
    shape=st.tuples(st.integers(4, 32), st.integers(4, 96)),
    table=tables,
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_singular_values_inside_promised_band(shape, table, dtype, seed):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ns = NewtonSchulz(backend="gram", coefficients=table, work_dtype=dtype)
    s_in = torch.linalg.svdvals(g / g.norm())
    lo = float(s_in.min())
    if lo < 1e-3:  # nearly rank-deficient draw: the band starts at 0, nothing to check
        return
    band_lo, band_hi = singular_value_band(ns.coefficients, lo=lo)
    s_out = torch.linalg.svdvals(ns(g).double())
    slack = 0.05 if dtype == torch.float16 else 1e-4
    assert float(s_out.min()) >= band_lo - slack
    assert float(s_out.max()) <= band_hi + slack


def test_keller_jordan_band_matches_architecture_note():
    lo, hi = singular_value_band(C.resolve("keller_jordan", "keller_jordan"), lo=0.01)
    assert 0.6 < lo < 0.75 and 1.1 < hi < 1.2


@pytest.mark.parametrize("backend", ["gram", "direct"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-12])
def test_zero_and_tiny_gradients_give_finite_updates(backend, dtype, scale):
    g = torch.randn(16, 64) * scale
    out = NewtonSchulz(backend=backend, work_dtype=dtype)(g)
    assert torch.isfinite(out).all()
    if scale == 0.0:
        assert (out == 0).all()


def test_tall_is_transpose_of_wide():
    g = torch.randn(100, 20, dtype=torch.float64)
    ns = NewtonSchulz(work_dtype=torch.float64)
    torch.testing.assert_close(ns(g), ns(g.T).T)


def test_batched_equals_per_matrix():
    g = torch.randn(4, 16, 48, dtype=torch.float64)
    ns = NewtonSchulz(work_dtype=torch.float64)
    torch.testing.assert_close(ns(g), torch.stack([ns(m) for m in g]))


def test_conv_weight_viewed_as_matrix():
    w = torch.randn(8, 4, 3, 3)
    assert dmuon.matrix_view(w).shape == (8, 36)
    with pytest.raises(ValueError, match="matrix_view"):
        NewtonSchulz()(w)


def test_near_square_uses_direct_and_wide_uses_gram():
    ns = NewtonSchulz(backend="gram")
    assert not ns.uses_gram(64, 64) and ns.uses_gram(64, 256)
    assert not NewtonSchulz(backend="direct").uses_gram(64, 256)


class _CountingOps:
    """TorchPrimitives that record each product's kind, FLOPs (symmetric outputs at half cost)
    and fewest bytes (bf16: operands read once, output written once, a C term's lower
    triangle), from the operands each call actually gets."""

    def __init__(self, direct: bool):
        self.apply_kind = "(B + a·I)·X" if direct else "Q·X"
        self.calls: list[tuple[str, float, float]] = []

    def gram(self, x):
        m, n = x.shape[-2:]
        self.calls.append(("X·Xᵀ", m * m * n, 2 * (m * n + m * m)))
        return TorchPrimitives.gram(x)

    def sym_addmm(self, c, a, b, beta, alpha, gamma=0.0):
        m, k = a.shape[-2:]
        self.calls.append(("m×m with C", m * m * k, 2 * (2 * m * k + m * m / 2 + m * m)))
        return TorchPrimitives.sym_addmm(c, a, b, beta, alpha, gamma)

    def add_identity(self, z, a):
        self.calls.append(("Z + a·I", 0.0, 2 * 2 * z.shape[-1] ** 2))
        return TorchPrimitives.add_identity(z, a)

    def apply_left(self, c, q, x, beta):
        m, n = x.shape[-2:]
        self.calls.append((self.apply_kind, 2 * m * m * n, 2 * (m * m + 2 * m * n)))
        return TorchPrimitives.apply_left(c, q, x, beta)


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(2, 12),
    extra=st.integers(0, 20),
    steps=st.integers(2, 6),
    restarts=st.sets(st.integers(1, 5), max_size=2),
    direct=st.booleans(),
)
def test_ns_products_are_the_products_the_iteration_runs(m, extra, steps, restarts, direct):
    """``gram_ns_products`` / ``direct_ns_products`` (the FLOP floor and the bytes a roofline
    reads) list the products ``gram_ns`` / ``direct_ns`` run: counted call by call from their
    operands, the same kinds, counts, FLOPs and bytes."""
    from collections import Counter

    from dmuon_compile.newton_schulz import (
        direct_ns,
        direct_ns_products,
        gram_ns,
        gram_ns_products,
    )

    n = m + extra
    table = [(3.4445, -4.7750, 2.0315)] * steps
    restarts = sorted(r for r in restarts if r < steps)
    ops = _CountingOps(direct)
    x = torch.randn(m, n) / (m * n) ** 0.5
    if direct:
        direct_ns(x, table, ops=ops)
        listed = direct_ns_products(m, n, steps)
    else:
        gram_ns(x, table, restarts, ops=ops)
        listed = gram_ns_products(m, n, steps, len(restarts))
    ran = Counter(kind for kind, _, _ in ops.calls)
    assert ran == Counter({p.kind: p.count for p in listed if p.count})
    assert sum(f for _, f, _ in ops.calls) == pytest.approx(sum(p.count * p.flops for p in listed))
    assert sum(b for _, _, b in ops.calls) == pytest.approx(sum(p.count * p.bytes for p in listed))


def test_flop_formulas_match_architecture():
    # docs/architecture.md (Newton–Schulz), in m³ units at α = 4, T = 5: direct 90,
    # direct+symmetric 65, Gram 38.
    m, n = 1024, 4096
    from dmuon_compile.newton_schulz import direct_ns_flops, gram_ns_flops

    assert direct_ns_flops(m, n, 5, symmetric=False) == 90 * m**3
    assert direct_ns_flops(m, n, 5, symmetric=True) == 65 * m**3
    assert gram_ns_flops(m, n, 5, restarts=1, symmetric=True) == 38 * m**3


class TestConfiguration:
    def test_cublas_is_deterministic(self):
        assert NewtonSchulz(kernel="cublas").deterministic
        assert NewtonSchulz(deterministic=True).kernel == "cublas"

    def test_describe_is_honest_on_cpu(self):
        if torch.cuda.is_available():
            pytest.skip("CPU-only wording")
        assert NewtonSchulz().describe() == "Gram NS · kernel=cublas (CPU, universal fallback)"
        assert NewtonSchulz("direct").describe().startswith("Direct NS · kernel=cublas")
        assert dmuon.get_ns_backend(NewtonSchulz()) == NewtonSchulz().describe()

    def test_triton_unavailable_raises_clearly(self):
        if torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
        with pytest.raises(RuntimeError, match="kernel='auto'"):
            NewtonSchulz(kernel="triton")

    def test_env_override(self, monkeypatch):
        monkeypatch.setenv("DMUON_NS_KERNEL", "cublas")
        assert NewtonSchulz().kernel == "cublas"
        monkeypatch.setenv("DMUON_NS_KERNEL", "bogus")
        with pytest.raises(ValueError, match="DMUON_NS_KERNEL"):
            NewtonSchulz()

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(backend="svd"), "backend"),
            (dict(kernel="cute"), "kernel"),
            (dict(kernel="triton", deterministic=True), "conflict"),
            (dict(restart_iterations=(0,)), "restart"),
            (dict(restart_iterations=(5,)), "restart"),
            (dict(backend="direct", restart_iterations=(2,)), "restart"),
            (dict(work_dtype=torch.int32), "work_dtype"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            NewtonSchulz(**kwargs)


def test_default_work_dtype_is_fp32_on_cpu_and_half_on_gpus():
    g = torch.randn(8, 32)
    assert NewtonSchulz()(g).dtype == torch.float32
    assert NewtonSchulz().work_dtype == torch.float16  # the accelerator default (gram)
    assert NewtonSchulz("direct").work_dtype == torch.bfloat16
    assert NewtonSchulz(work_dtype=torch.bfloat16)(g).dtype == torch.bfloat16


@given(
    batch=st.integers(0, 3),
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]),
    work_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_normalize_single_pass_equals_upcast_expression(
    batch, m, n, in_dtype, work_dtype, transpose, seed
):
    """The eager one-pass normalisation (no fp32 copy of g) gives the same bits, dtype and
    layout as the plain upcast-divide-cast expression the traced path uses."""
    shape = (batch, m, n) if batch else (m, n)
    g = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(in_dtype)
    got = normalize(g, work_dtype, 1e-7, transpose=transpose)
    gf = g.double() if work_dtype == torch.float64 else g.float()
    norm = torch.linalg.vector_norm(gf, dim=(-2, -1), keepdim=True)
    want = ((gf.mT if transpose else gf) / (norm + 1e-7)).to(work_dtype)
    assert got.dtype == work_dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)


@given(
    batch=st.integers(0, 3),
    m=st.integers(1, 20),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    gamma=st.floats(-10, 10, allow_nan=False),
    seed=st.integers(0, 2**16),
)
def test_add_identity_rounds_once(batch, m, dtype, gamma, seed):
    """Eager a + gamma·I: off-diagonal entries untouched, the diagonal computed in fp32 and
    rounded once (gamma is not rounded to the work dtype first), the input left as it was."""
    from dmuon_compile.newton_schulz import TorchPrimitives

    shape = (batch, m, m) if batch else (m, m)
    a = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    before = a.clone()
    out = TorchPrimitives.add_identity(a, gamma)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    eye = torch.eye(m, dtype=wide)
    want = (a.to(wide) + torch.tensor(gamma, dtype=wide) * eye).to(dtype)
    assert torch.equal(out, want) and out.is_contiguous()
    assert torch.equal(a, before)


@settings(max_examples=15, deadline=None)
@given(
    shape=st.sampled_from([(6, 10), (10, 6), (3, 5, 9), (8, 8)]),
    backend=st.sampled_from(["gram", "direct"]),
    seed=st.integers(0, 2**16),
)
def test_a_given_norm_gives_the_same_result(shape, backend, seed):
    """``ns(g, norm)`` with the norm NS would take itself is ``ns(g)`` bit for bit; a different
    norm (the control) changes the result, so the argument is used."""
    from dmuon_compile.newton_schulz import frobenius_norm

    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    ns = NewtonSchulz(backend=backend)
    norm = frobenius_norm(g, ns.work_dtype_for(g.device))
    assert torch.equal(ns(g, norm), ns(g))
    assert not torch.equal(ns(g, norm * 4), ns(g))


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(6, 10), (10, 6), (3, 5, 9), (2, 40, 7), (1, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    log_scale=st.integers(-30, 30),
    bad=st.sampled_from([None, float("inf"), float("nan")]),
    seed=st.integers(0, 2**16),
)
def test_the_norm_by_rows_is_the_frobenius_norm(shape, dtype, log_scale, bad, seed):
    """``frobenius_norm(by_rows=True)`` (the compiled step's norm of large inputs) equals the
    float64 Frobenius norm of each matrix to fp32 rounding, over scales from 1e-9 to 1e9, and
    is non-finite exactly where the one-reduction norm is (the step's finite flags)."""
    from dmuon_compile.newton_schulz import frobenius_norm

    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    if bad is not None:
        g.view(-1)[seed % g.numel()] = bad
    g = g.to(dtype)
    got = frobenius_norm(g, torch.bfloat16, by_rows=True)
    ref = torch.linalg.vector_norm(g.double(), dim=(-2, -1), keepdim=True)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(torch.isfinite(got), torch.isfinite(frobenius_norm(g, torch.bfloat16)))
    finite = torch.isfinite(ref)
    assert torch.allclose(got.double()[finite], ref[finite], rtol=1e-6, atol=0)
    # control: a norm over the rows only is not it
    rows_only = torch.linalg.vector_norm(g.double(), dim=-1, keepdim=True).amax(-2, keepdim=True)
    if bad is None and shape[-2] > 1:
        assert not torch.allclose(rows_only, ref, rtol=1e-6, atol=0)


def test_a_norm_of_the_wrong_shape_is_refused():
    g = torch.randn(3, 4, 6)
    with pytest.raises(ValueError, match=r"expected \(3, 1, 1\)"):
        NewtonSchulz()(g, torch.ones(3))
