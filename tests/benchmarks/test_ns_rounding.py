"""benchmarks/ns_rounding.py: its comparison form is the same polynomial, and its rounding is
the kernels' (one fp16 rounding per product)."""

from __future__ import annotations

import torch
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_compile.coefficients import polar_express
from dmuon_compile.newton_schulz import TorchPrimitives, gram_ns

rounding = load_benchmark("ns_rounding")


class W64(TorchPrimitives):
    """float64 torch primitives with the C-less product the W form needs."""

    @staticmethod
    def sym_mm(a, b):
        return a @ b


@settings(max_examples=10, deadline=None)
@given(m=st.integers(2, 12), extra=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_both_forms_are_the_reference_polynomial_in_float64(m, extra, seed):
    """Without rounding (float64 torch primitives) the package's C-term form, the script's W
    form and the direct iteration agree: the script compares roundings, not two maths."""
    gen = torch.Generator().manual_seed(seed)
    x = rounding.make_input("gaussian", m, m + extra, gen)
    table = polar_express(5)
    ref = rounding.reference(x, table)
    torch.testing.assert_close(gram_ns(x, table, (2,), TorchPrimitives), ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        rounding.gram_ns_w_form(x, table, ops=W64), ref, rtol=1e-9, atol=1e-9
    )


def test_half_rounding_rounds_once_per_product():
    """A product with C and γ·I is rounded once, after the fp32 epilogue (not per term), and
    is exactly symmetric, as the kernels' output is."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=gen).to(torch.float16)
    c = torch.randn(6, 6, generator=gen).to(torch.float16)
    c = c + c.mT  # symmetric, as every C of Newton–Schulz is
    out = rounding.HalfRounding.sym_addmm(c, a, a.mT, beta=0.5, alpha=2.0, gamma=3.0)
    want = (2.0 * (a.float() @ a.float().mT) + 0.5 * c.float() + 3.0 * torch.eye(6)).half()
    assert out.dtype == torch.float16 and torch.equal(torch.tril(out), torch.tril(want))
    assert torch.equal(out, out.mT)


def test_errors_are_small_for_gaussian_inputs():
    e = rounding.errors(32, 88, "gaussian", trials=1)
    assert 0 < e["w"] < 1e-2 and 0 < e["c_terms"] < 1e-2


def test_error_by_band_covers_the_spectrum():
    rows = rounding.error_by_band(24, 64)
    assert len(rows) == 4 and all(w > 0 and c > 0 for _, w, c in rows)
