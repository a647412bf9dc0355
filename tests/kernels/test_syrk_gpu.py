"""GPU tests of the symmetric-product kernels at real sizes (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from dmuon_compile.kernels.ops import sym_mm_reference, syrk_reference

pytestmark = pytest.mark.gpu


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(
        torch.linalg.vector_norm(out.double() - ref.double())
        / torch.linalg.vector_norm(ref.double())
    )


def _ref64_syrk(x, c, alpha, beta, gamma):
    return syrk_reference(x.double(), None if c is None else c.double(), alpha, beta, gamma)


def _needs_triton():
    from dmuon_compile.kernels.availability import triton_status

    ok, why = triton_status()
    if not ok:
        pytest.skip(f"Triton kernels unavailable: {why}")


def _with_c_loads():
    """Every candidate, and the shortlist with C read by TMA (``c_load="prologue"`` and
    ``"tma"``), as the autotune times them for products with C."""
    from dataclasses import replace

    from dmuon_compile.kernels.syrk import CANDIDATES, SHORTLIST

    loads = ("prologue", "tma")
    return list(CANDIDATES) + [replace(c, c_load=load) for c in SHORTLIST for load in loads]


# Each (config, dtype, layout class) is a separate Triton compile, so dtypes and layouts are
# paired rather than crossed: fp16 is what Gram NS runs, bf16 what direct NS runs.
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((4096, 14336), torch.float16),
        ((4096, 14336), torch.bfloat16),  # TMA-readable, EVEN_K
        ((3, 1000, 3000), torch.float16),  # TMA-readable stack, ragged K
        ((1, 513, 777), torch.bfloat16),  # unaligned rows: pointer loads for every config
    ],
)
def test_triton_syrk_every_config_real_sizes(shape, dtype):
    _needs_triton()
    from dmuon_compile.kernels.symmetric_product import launch_symmetric_product

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, generator=gen, device="cuda").to(dtype) / shape[-1] ** 0.25
    m = shape[-2]
    c = torch.randn(shape[:-2] + (m, m), generator=gen, device="cuda").to(dtype)
    ref = _ref64_syrk(x, c, 0.5, 0.25, 1.0)
    for config in _with_c_loads():
        out = torch.full(shape[:-2] + (m, m), float("nan"), device="cuda", dtype=dtype)
        launch_symmetric_product(x, None, c, 0.5, 0.25, 1.0, config, out=out)
        assert torch.isfinite(out).all(), f"{config.name}: unwritten or non-finite elements"
        assert torch.equal(out, out.mT), f"{config.name}: not bitwise symmetric"
        assert _rel_err(out, ref) < 1e-2, f"{config.name}: rel err {_rel_err(out, ref)}"


@pytest.mark.parametrize("layout", ["row_b", "col_b", "col_a"])
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 1000, 1000)])
def test_triton_sym_mm_every_config_real_sizes(layout, shape):
    """Every candidate (pointer and TMA loads) on the operand layouts NS produces: symmetric
    row-major Gram-space matrices, and the column-major (transposed) views of tall matrices."""
    _needs_triton()
    from dmuon_compile.kernels.symmetric_product import launch_symmetric_product

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(shape, generator=gen, device="cuda") / shape[-1] ** 0.5
    r = (x @ x.mT).half()
    z = (-4.0 * r.float() + 2.0 * r.float() @ r.float()).half()
    a = r.mT.contiguous().mT if layout == "col_a" else r
    b = z.mT.contiguous().mT if layout == "col_b" else z
    ref = sym_mm_reference(a.double(), b.double(), r.double(), 1.0, 3.0, 0.5)
    m = shape[-1]
    for config in _with_c_loads():
        out = torch.full(shape[:-2] + (m, m), float("nan"), device="cuda", dtype=torch.float16)
        launch_symmetric_product(a, b, r, 1.0, 3.0, 0.5, config, out=out)
        assert torch.isfinite(out).all(), f"{config.name}: unwritten or non-finite elements"
        assert torch.equal(out, out.mT), f"{config.name}: not bitwise symmetric"
        assert _rel_err(out, ref) < 1e-2, f"{config.name}: rel err {_rel_err(out, ref)}"


def test_triton_syrk_of_a_tall_matrix_view_every_config():
    """SYRK of the transposed view of a tall matrix (column-major operand), as Gram NS calls it."""
    _needs_triton()
    from dmuon_compile.kernels.symmetric_product import launch_symmetric_product
    from dmuon_compile.kernels.syrk import CANDIDATES

    tall = torch.randn(2, 6144, 2048, device="cuda").half() / 6144**0.25
    x = tall.mT  # (2, 2048, 6144), column-major
    ref = _ref64_syrk(x, None, 1.0, 0.0, 0.0)
    for config in CANDIDATES:
        out = torch.full((2, 2048, 2048), float("nan"), device="cuda", dtype=torch.float16)
        launch_symmetric_product(x, None, None, 1.0, 0.0, 0.0, config, out=out)
        assert torch.isfinite(out).all() and torch.equal(out, out.mT), config.name
        assert _rel_err(out, ref) < 1e-2, f"{config.name}: rel err {_rel_err(out, ref)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_syrk_op_dispatch_matches_reference(dtype):
    x = torch.randn(2, 1536, 4000, device="cuda").to(dtype) / 4000**0.25
    out = torch.ops.dmuon.syrk(x, None, 1.0, 0.0, 0.0)
    assert torch.equal(out, out.mT)
    tol = 1e-2 if dtype != torch.float32 else 2e-3  # cuBLAS fp32 may use TF32
    assert _rel_err(out, _ref64_syrk(x, None, 1.0, 0.0, 0.0)) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [(), (4,)])
def test_sym_mm_op_on_commuting_gram_polynomials(dtype, batch):
    x = torch.randn(batch + (2048, 6000), device="cuda") / 6000**0.5
    r = (x @ x.mT).to(dtype)
    z = (-4.0 * r.float() + 2.0 * r.float() @ r.float()).to(dtype)
    out = torch.ops.dmuon.sym_mm(r, z, r, 1.0, 3.0, 0.5)
    ref = sym_mm_reference(r.double(), z.double(), r.double(), 1.0, 3.0, 0.5)
    assert torch.equal(out, out.mT)
    assert _rel_err(out, ref) < 1e-2


def test_newton_schulz_triton_matches_cublas():
    _needs_triton()
    from dmuon_compile import NewtonSchulz

    g = torch.randn(1024, 4096, device="cuda")
    ours = NewtonSchulz(kernel="triton")(g).float()
    cublas = NewtonSchulz(kernel="cublas")(g).float()
    assert torch.isfinite(ours).all()
    assert _rel_err(ours, cublas) < 3e-2


@pytest.mark.parametrize("shape", [(4096, 14336), (5, 2048, 5632), (3, 37, 1001)])
@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float16, torch.bfloat16),
    ],
)
def test_scale_cast_kernel_bitwise_equals_torch(shape, in_dtype, out_dtype):
    """NS's one-pass normalisation: the Triton kernel gives torch's bits (fp32 division,
    round-to-nearest-even store)."""
    _needs_triton()
    from dmuon_compile.kernels.scale_cast import scale_cast, scale_cast_reference

    from dmuon_compile.newton_schulz import normalize

    g = (torch.randn(shape, device="cuda") * 30.0).to(in_dtype)
    denom = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.float32) + 1e-7
    out = scale_cast(g, denom, out_dtype)
    assert torch.equal(out, scale_cast_reference(g, denom, out_dtype))
    traced_expression = g.float() / (
        torch.linalg.vector_norm(g.float(), dim=(-2, -1), keepdim=True) + 1e-7
    )
    assert torch.equal(
        normalize(g, out_dtype, 1e-7, transpose=True), traced_expression.mT.to(out_dtype)
    )


def _add_launch_hook(hook):
    """Install ``hook`` as Triton's launch-enter hook, as its profiler does; returns the undo."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        chain = knobs.runtime.launch_enter_hook
        if hasattr(chain, "add"):  # a chain of hooks (Triton 3.6)
            chain.add(hook)
            return lambda: chain.remove(hook)
        knobs.runtime.launch_enter_hook = hook
        return lambda: setattr(knobs.runtime, "launch_enter_hook", chain)
    from triton.compiler.compiler import CompiledKernel  # Triton 3.3: a class attribute

    previous = CompiledKernel.launch_enter_hook
    CompiledKernel.launch_enter_hook = hook
    return lambda: setattr(CompiledKernel, "launch_enter_hook", previous)


def test_launch_metadata_reaches_a_launch_hook():
    """Every kernel family reports its name, the lower triangle's FLOPs and its bytes to a
    launch hook (what profiler traces show), on the pointer, TMA and mirror launches."""
    _needs_triton()
    from dmuon_compile.kernels.lower_tiles import TileConfig
    from dmuon_compile.kernels.mirror import mirror_lower_inplace
    from dmuon_compile.kernels.symmetric_product import launch_symmetric_product
    from dmuon_compile.kernels.syrk_tma import tma_supported

    batch, m, k = 3, 512, 256
    x = torch.randn(batch, m, k, device="cuda", dtype=torch.float16)
    configs = [TileConfig(128, 64, 8, 4, 1)]
    if tma_supported(x.device):
        configs.append(TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True))
    seen = []
    undo = _add_launch_hook(lambda metadata: seen.append(dict(metadata.get())))
    try:
        for config in configs:
            launch_symmetric_product(x, None, None, 1.0, 0.0, 0.0, config)
        mirror_lower_inplace(torch.randn(batch, m, m, device="cuda"))
        torch.cuda.synchronize()
    finally:
        undo()
    ours = [meta for meta in seen if meta["name"].startswith(("syrk_", "mirror_lower"))]
    loads = ["ptr", "tma"][: len(configs)]
    assert [meta["name"] for meta in ours] == [
        f"syrk_{kind} {m}x{k} b{batch} 128x128x64" for kind in loads
    ] + [f"mirror_lower {m}x{m} b{batch}"]
    for meta in ours[:-1]:
        assert meta["flops16"] == batch * m * (m + 1) * k
        assert meta["bytes"] == 2 * batch * (m * k + m * m)
    assert ours[-1]["bytes"] == 4 * batch * m * (m - 1)
