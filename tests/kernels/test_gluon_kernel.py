"""The Gluon symmetric-product kernel (``kernels/syrk_gluon.py``).

On the CPU: the kernel compiles for sm_90 (Triton's own compiler and bundled ptxas, no GPU;
``benchmarks/kernel_resources.py``)
within the shared-memory budget and without register spills, and bad inputs get a clear
error. On an H200 (``gpu`` marker): property tests against the torch reference of ``ops.py``.
"""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon (3.5+ has)")


from dmuon_compile.kernels import syrk_gluon as gluon_kernel  # noqa: E402

GluonConfig = gluon_kernel.GluonConfig

# The offline compile for sm_90 is benchmark tooling (benchmarks/kernel_resources.py).
resources = load_benchmark("kernel_resources")

# What the GPU tests run: every partition layout (one 8-warp consumer, two 4-warp consumers),
# both tile widths and both staging rings, each within the shared-memory budget with a C term.
CONFIGS = [
    GluonConfig(split=1, stages=4),
    GluonConfig(split=2, stages=3, c_slots=1),
    GluonConfig(split=1, stages=3, consumers=2, num_warps=4),
    GluonConfig(split=1, stages=4, c_slots=1, store_slots=2),
    GluonConfig(split=2, block_k=32, stages=4, c_slots=1, wide=True),
    GluonConfig(split=1, stages=3, consumers=2, num_warps=8),
]
# Configurations whose shared memory fits only without C: the 4-deep ping-pong that the autotune
# times for plain X·Xᵀ (kernels/syrk.py: GLUON_SYRK_SHORTLIST_FIELDS).
CONFIGS_WITHOUT_C = [GluonConfig(split=1, stages=4, consumers=2, num_warps=4)]


# ----------------------------------------------------------------------------------------------
# CPU: compiles for sm_90, clear errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,syrk,has_c",
    [
        (CONFIGS[0], True, False),
        (CONFIGS[1], False, True),
        (CONFIGS[2], True, True),
        (CONFIGS[0], False, False),
        (CONFIGS[3], False, True),
        (CONFIGS[4], False, True),
        (CONFIGS[4], True, False),
        (CONFIGS[5], False, True),
        (CONFIGS[5], True, True),
        (CONFIGS_WITHOUT_C[0], True, False),
        (CONFIGS_WITHOUT_C[0], False, False),
    ],
    ids=lambda v: v.name if isinstance(v, GluonConfig) else str(v),
)
def test_kernel_compiles_for_sm90(config, syrk, has_c):
    """The partitions, TMA and wgmma lower to sm_90a PTX and a cubin, within 227 KiB of shared
    memory and without spills (a CPU check that the kernel still builds)."""
    try:
        compiled = resources.compile_for_target(
            config, syrk=syrk, has_c=has_c, dtype=torch.bfloat16
        )
    except (ImportError, FileNotFoundError) as exc:  # no bundled ptxas / CUDA backend
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    # Wide tiles issue one N = 256 wgmma per K-slice, the others N = 128.
    assert ("m64n256k16" in ptx) == config.wide and ("m64n128k16" in ptx) != config.wide
    assert "setmaxnreg" in ptx  # warp specialisation with register reallocation
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and stores
    assert compiled.asm["cubin"]
    shared = compiled.metadata.shared
    assert shared <= gluon_kernel.SMEM_LIMIT
    # The launcher's budget check must not under-estimate what the compiler allocates.
    assert config.smem_bytes(2, 2 if has_c else None, 2) >= shared
    usage = resources.ptxas_resource_usage(compiled)
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, usage


@pytest.mark.parametrize("sym_mm", [False, True])
def test_launch_arguments_bind_to_the_kernel(sym_mm):
    """The host side builds exactly the kernel's parameters (descriptors over the stack, the
    tile counts of the walk), so the first GPU launch does not fail on a name or a count."""
    a = torch.randn(3, 264, 40).bfloat16()
    b = torch.randn(3, 40, 264).bfloat16() if sym_mm else None
    c = torch.randn(3, 264, 264).bfloat16()
    out = torch.empty(3, 264, 264, dtype=torch.bfloat16)
    config = GluonConfig(split=2, stages=2)
    args, options = gluon_kernel.kernel_arguments(a, b, c, out, 1.0, 0.5, 2.0, config)
    names = gluon_kernel._symmetric_product_gluon_kernel.arg_names
    assert list(names[: len(args)]) == [
        "a_desc", "b_desc", "c_desc", "out_desc", "m", "k", "total_tiles", "tiles_per_matrix",
        "alpha", "beta", "gamma",
    ]  # fmt: skip
    assert set(names[len(args) :]) == set(options) - {"maxnreg"}
    assert options["SYRK"] is not sym_mm and options["HAS_C"] and options["SPLIT"] == 2
    # 264 rows in 256-wide super-tiles: 2 per side, 3 lower super-tiles of 2 strips each.
    assert args[6:8] == (3 * 6, 6)
    assert list(args[0].block_shape) == [128, 64]
    assert list(args[1].block_shape) == ([1, 64, 128] if sym_mm else [128, 64])
    assert list(args[3].shape) == [3, 264, 264] and list(args[3].block_shape) == [1, 128, 128]


@pytest.mark.parametrize("sym_mm", [False, True])
def test_wide_tiles_load_256_columns_at_once(sym_mm):
    """A wide tile's B slice and C block are one 256-column TMA box each; stores stay 128²."""
    a = torch.randn(3, 264, 40).bfloat16()
    b = torch.randn(3, 40, 264).bfloat16() if sym_mm else None
    c = torch.randn(3, 264, 264).bfloat16()
    out = torch.empty(3, 264, 264, dtype=torch.bfloat16)
    config = GluonConfig(split=2, block_k=32, stages=4, c_slots=1, wide=True)
    args, options = gluon_kernel.kernel_arguments(a, b, c, out, 1.0, 0.5, 2.0, config)
    assert options["WIDE"] and options["SPLIT"] == 2
    assert list(args[1].block_shape) == ([1, 32, 256] if sym_mm else [256, 32])
    assert list(args[2].block_shape) == [1, 128, 256]
    assert list(args[3].block_shape) == [1, 128, 128]
    assert args[6:8] == (3 * 6, 6)  # the same walk as 128×256 tiles of two blocks


def test_configs_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="split"):
        GluonConfig(split=3)
    with pytest.raises(ValueError, match="c_slots >= 2"):
        GluonConfig(consumers=2, num_warps=4, c_slots=1)
    with pytest.raises(ValueError, match="store_slots"):
        GluonConfig(store_slots=3)
    two = GluonConfig(split=1, stages=4, store_slots=2)  # a second staging buffer: 32 KiB more
    assert two.smem_bytes(2, 2, 2) - GluonConfig(split=1, stages=4).smem_bytes(2, 2, 2) == 32768
    assert two.smem_bytes(2, 2, 2) > gluon_kernel.SMEM_LIMIT  # so it takes one C slot
    with pytest.raises(ValueError, match="wide tiles are 128×256"):
        GluonConfig(split=1, wide=True)
    with pytest.raises(ValueError, match="store_slots=1"):
        GluonConfig(split=2, wide=True, store_slots=2)
    # A wide tile's C and staging blocks are 128×256: with BK=64 and 3 stages it cannot fit.
    assert GluonConfig(split=2, stages=3, wide=True).smem_bytes(2, 2, 2) > gluon_kernel.SMEM_LIMIT
    over = GluonConfig(split=2, stages=3, c_slots=2)  # 128×256, 3 stages and two C blocks
    assert over.smem_bytes(2, 2, 2) > gluon_kernel.SMEM_LIMIT


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.randn(64, 64), None, None), "dtype"),
        (lambda: (torch.randn(64, 100).bfloat16(), None, None), "multiples of 8"),
        (lambda: (torch.randn(2, 64, 0).bfloat16(), None, None), "k=0"),
        (lambda: (torch.randn(64, 64).bfloat16().mT, None, None), "contiguous"),
        (
            lambda: (torch.randn(64, 32).bfloat16(), torch.randn(64, 32).bfloat16().mT, None),
            "b must be contiguous",
        ),
        (
            lambda: (torch.randn(64, 32).bfloat16(), torch.randn(32, 64).half(), None),
            "dtypes differ",
        ),
        (lambda: (torch.randn(64, 32).bfloat16(), None, torch.randn(32, 32)), "c must have"),
        (lambda: (torch.randn(64, 32).bfloat16(), None, None), "SM90"),  # CPU tensors
    ],
)
def test_unsupported_inputs_raise_a_clear_error(make, match):
    a, b, c = make()
    with pytest.raises(ValueError, match=match):
        gluon_kernel.launch_gluon_kernel(a, b, c, 1.0, 1.0, 0.0)
    assert not gluon_kernel.gluon_supported(a, b, c)


# ----------------------------------------------------------------------------------------------
# GPU: against the reference
# ----------------------------------------------------------------------------------------------

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs an SM90 GPU")


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written, bitwise symmetric, within two output ulps of the fp32
    reference (rounded once to the output dtype, as the kernel rounds)."""
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite elements"
    assert torch.equal(out, out.mT), "not bitwise symmetric"
    scale = float(ref.float().abs().max()) + 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.0, atol=2 * ULP[out.dtype] * scale)


def _run(a, b, c, alpha, beta, gamma, config):
    from dmuon_compile.kernels.ops import sym_mm_reference, syrk_reference

    m = a.shape[-2]
    out = torch.full(a.shape[:-2] + (m, m), float("nan"), device=a.device, dtype=a.dtype)
    gluon_kernel.launch_gluon_kernel(a, b, c, alpha, beta, gamma, out=out, config=config)
    assert not out.isnan().any(), "elements the kernel left unwritten (NaN poison)"
    if b is None:
        ref = syrk_reference(a.float(), None if c is None else c.float(), alpha, beta, gamma)
    else:
        ref = sym_mm_reference(
            a.float(), b.float(), None if c is None else c.float(), alpha, beta, gamma
        )
    _check(out, ref.to(a.dtype))
    return out


@pytest.mark.gpu
@settings(max_examples=24, deadline=None)
@given(
    m=st.integers(1, 80).map(lambda i: 8 * i),  # 8..640: ragged edges, several tiles
    k=st.integers(1, 90).map(lambda i: 8 * i),
    batch=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    op=st.sampled_from(["syrk", "sym_mm"]),
    use_c=st.booleans(),
    alpha=st.sampled_from([1.0, -0.5]),
    beta=st.sampled_from([1.0, 0.3]),
    gamma=st.sampled_from([0.0, 1.5]),
    config=st.sampled_from(CONFIGS + CONFIGS_WITHOUT_C),
    seed=st.integers(0, 2**16),
)
def test_gluon_matches_reference(m, k, batch, dtype, op, use_c, alpha, beta, gamma, config, seed):
    _needs_sm90()
    assume(not (use_c and config in CONFIGS_WITHOUT_C))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if batch is None else (batch,)

    def rand(*shape):
        return torch.randn(lead + shape, generator=gen, device="cuda").to(dtype)

    a = rand(m, k) / k**0.25
    b = rand(k, m) / k**0.25 if op == "sym_mm" else None
    c = rand(m, m) if use_c else None
    out = _run(a, b, c, alpha, beta, gamma, config)
    assert torch.equal(out, out.mT), "not bitwise symmetric"


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS + CONFIGS_WITHOUT_C, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "shape,op,use_c",
    [
        ((4, 2048, 5632), "syrk", False),  # the first X·Xᵀ of a stack
        ((3, 2048, 2048), "sym_mm", True),  # Gram-space R·R with C
        ((1, 4096, 4096), "sym_mm", True),
        ((8, 2048, 2048), "sym_mm", False),  # a product of two polynomials, no C term
        ((4096, 1000), "syrk", True),  # 2-D, K not a multiple of BLOCK_K
        ((256, 768, 2048), "syrk", False),  # an expert bucket's X·Xᵀ (768-row experts)
        ((256, 768, 768), "sym_mm", True),  # its Gram-space products
    ],
)
def test_gluon_real_sizes(config, shape, op, use_c):
    _needs_sm90()
    if use_c and config in CONFIGS_WITHOUT_C:
        pytest.skip(f"{config.name} fits shared memory only without C")
    gen = torch.Generator(device="cuda").manual_seed(7)
    m, k = shape[-2], shape[-1]
    a = (torch.randn(shape, generator=gen, device="cuda") / k**0.25).bfloat16()
    b = None
    if op == "sym_mm":  # commuting symmetric operands, as Newton–Schulz's Gram products are
        a = (a.float() @ a.float().mT / k**0.5).bfloat16()
        b = (a.float() @ a.float()).bfloat16()
    c = torch.randn(shape[:-2] + (m, m), generator=gen, device="cuda").bfloat16() if use_c else None
    out = _run(a, b, c, 1.0, -0.5 if use_c else 0.0, 0.75, config)
    assert torch.equal(out, out.mT), "not bitwise symmetric"
