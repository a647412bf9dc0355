"""benchmarks/bench_kernels.py's decaying-spectrum input: the spectrum it promises."""

from __future__ import annotations

import torch
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given, settings
from hypothesis import strategies as st

bench_kernels = load_benchmark("bench_kernels")


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from([(24, 40), (40, 24), (3, 16, 32)]),
    st.floats(1.0, 4.0),
    st.integers(0, 2**16),
)
def test_the_decaying_input_has_the_spectrum_it_names(shape, decades, seed):
    gen = torch.Generator().manual_seed(seed)
    x = bench_kernels.decaying_spectrum(shape, gen, decades)
    assert x.shape == torch.Size(shape) and x.dtype == torch.bfloat16
    sigma = torch.linalg.svdvals(x.double())
    r = min(shape[-2:])
    want = torch.logspace(0, -decades, r, dtype=torch.float64)
    # bf16 rounding of the entries moves the small singular values most: compare in log space
    # on the top decades, where the rounding is far below the spacing.
    top = want >= 1e-2
    assert torch.allclose(
        sigma[..., top].log10(), want[top].log10().expand_as(sigma[..., top]), atol=0.02
    )
