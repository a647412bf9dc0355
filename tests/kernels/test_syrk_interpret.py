"""The Triton symmetric-product kernel on CPU through ``TRITON_INTERPRET=1``.

The kernel runs in a worker subprocess (``interpret_worker.py``) started with the interpreter
switched on, so the variable never leaks into this pytest process or other test modules. Every
output is poisoned with NaN first and checked everywhere: against the reference of
``kernels/ops.py``, for bitwise symmetry and for finiteness.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dmuon_compile.kernels.ops import sym_mm_reference, syrk_reference
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

WORKER = Path(__file__).with_name("interpret_worker.py")
# Small tiles so that m in {1, 5, 16, 33} spans 1..3 tile rows; few "SMs" so that every
# program walks several tiles of the persistent loop.
SMALL_TILES = {"block": 16, "block_k": 16, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 1}
WIDE_K_TILES = {"block": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 1}
# Rectangular strips (the 128×256 GPU candidates at small scale): 16×32 strips of 32² super-
# tiles, so m in {1, 5, 16, 33} has diagonal super-tiles whose upper strip parts are dropped.
STRIP_TILES = {
    "block": 16,
    "block_k": 16,
    "num_warps": 4,
    "num_stages": 2,
    "ctas_per_sm": 1,
    "block_n": 32,
}
WIDE_STRIP_TILES = {
    "block": 8,
    "block_k": 16,
    "num_warps": 4,
    "num_stages": 2,
    "ctas_per_sm": 1,
    "block_n": 32,
}
# The TMA kernel (descriptor loads; the interpreter emulates TMA's bounds and zero fill), with
# square tiles and with flattened strips.
TMA_TILES = dict(SMALL_TILES, tma=True)
TMA_FLAT_STRIP_TILES = dict(STRIP_TILES, tma=True, flatten=True)
# Half precision: the result is rounded once to the output dtype (the interpreter may round
# fp32 -> bf16 differently from torch, so allow two units in the last place).
ULP = {torch.float32: 2.0**-20, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


class InterpretedKernel:
    """A long-lived TRITON_INTERPRET=1 worker process that runs one kernel case per request."""

    def __init__(self, tmp_dir: Path) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        self.tmp_dir = tmp_dir
        self.count = 0
        self.last_loads = None  # "tma" or "ptr": which loads the last kernel case used
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"interpret worker failed to start: {ready!r}")

    def _request(self, case: dict, what: str) -> torch.Tensor:
        """Send one case to the worker; return what it computed."""
        self.count += 1
        in_path = self.tmp_dir / f"case{self.count}.pt"
        out_path = self.tmp_dir / f"case{self.count}.out.pt"
        torch.save(case, in_path)
        self.proc.stdin.write(f"{in_path} {out_path}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer.split()[:1] != ["ok"]:
            raise AssertionError(f"{what} failed in the interpreter: {answer}")
        self.last_loads = answer.split()[1] if len(answer.split()) > 1 else None
        return torch.load(out_path)

    def run(self, a, b, c, alpha, beta, gamma, config=SMALL_TILES, num_sms=3) -> torch.Tensor:
        m = a.shape[-2]
        out = torch.full(tuple(a.shape[:-2]) + (m, m), float("nan"), dtype=a.dtype)
        return self._request(
            {
                "a": a,
                "b": b,
                "c": c,
                "alpha": alpha,
                "beta": beta,
                "gamma": gamma,
                "config": config,
                "num_sms": num_sms,
                "out": out,
            },
            "kernel",
        )

    def mirror(self, p: torch.Tensor, block: int) -> torch.Tensor:
        return self._request({"kind": "mirror", "p": p, "block": block}, "mirror kernel")

    def scale_cast(self, g: torch.Tensor, denom: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._request(
            {"kind": "scale_cast", "g": g, "denom": denom, "dtype": dtype}, "scale_cast kernel"
        )

    def copy_unless(self, flag, dst, src) -> torch.Tensor:
        return self._request(
            {"kind": "copy_unless", "flag": flag, "dst": dst, "src": src}, "copy_unless kernel"
        )

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    worker = InterpretedKernel(tmp_path_factory.mktemp("interpret"))
    yield worker
    worker.close()


def _random(shape, dtype, gen, transposed=False):
    if transposed:  # a column-major view of the same logical shape
        t = torch.randn(tuple(shape[:-2]) + (shape[-1], shape[-2]), generator=gen)
        return t.to(dtype).mT
    return torch.randn(tuple(shape), generator=gen).to(dtype)


def check_against_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous()
    assert torch.isfinite(out).all(), (
        "unwritten (NaN-poisoned) or non-finite elements in the output"
    )
    assert torch.equal(out, out.mT), "output is not bitwise symmetric"
    scale = float(ref.float().abs().max()) + 1.0
    tol = 2 * ULP[out.dtype] * scale
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.0, atol=tol)


def _batch_shape(batch):
    return () if batch is None else (batch,)


# m in {1, 5, 16, 33}; k not a multiple of the 16-wide K tile (and one that is); 2-D,
# batch 1 and batch 3; every dtype once per op.
GRID = [
    (1, 3, None, torch.float32),
    (5, 7, 1, torch.float16),
    (16, 16, 3, torch.bfloat16),
    (33, 40, None, torch.bfloat16),
    (33, 17, 3, torch.float16),
    (16, 50, 1, torch.float32),
]


@pytest.mark.parametrize("m,k,batch,dtype", GRID)
def test_syrk_kernel_matches_reference(kernel, m, k, batch, dtype):
    gen = torch.Generator().manual_seed(m * 100 + k)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    out = kernel.run(x, None, c, 0.75, -0.5, 1.25)
    check_against_reference(out, syrk_reference(x, c, 0.75, -0.5, 1.25))


@pytest.mark.parametrize("m,k,batch,dtype", GRID)
def test_sym_mm_kernel_matches_reference(kernel, m, k, batch, dtype):
    gen = torch.Generator().manual_seed(m * 100 + k + 1)
    a = _random(_batch_shape(batch) + (m, k), dtype, gen)
    b = _random(
        _batch_shape(batch) + (k, m), dtype, gen
    )  # a·b need not be symmetric: lower tiles only
    out = kernel.run(a, b, None, 1.5, 0.0, -0.25)
    check_against_reference(out, sym_mm_reference(a, b, None, 1.5, 0.0, -0.25))


def test_sym_mm_of_commuting_symmetric_matrices(kernel):
    """The NS use: R and Z = b·R + c·R² commute, R·Z is symmetric and equals the full product."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 33, 70, generator=gen) / 8
    r = x @ x.mT
    z = -4.0 * r + 2.0 * r @ r
    out = kernel.run(r.half(), z.half(), r.half(), 1.0, 3.0, 0.0, config=WIDE_K_TILES, num_sms=2)
    check_against_reference(out, sym_mm_reference(r.half(), z.half(), r.half(), 1.0, 3.0, 0.0))
    full = (r.half().float() @ z.half().float() + 3.0 * r.half().float()).half()
    torch.testing.assert_close(out.float(), full.float(), rtol=4e-3, atol=4e-3)


def test_poison_is_detected(kernel):
    """The check above can fail: a NaN left in the output is reported."""
    x = torch.randn(5, 7)
    out = kernel.run(x, None, None, 1.0, 0.0, 0.0)
    out[4, 0] = float("nan")
    with pytest.raises(AssertionError):
        check_against_reference(out, syrk_reference(x, None, 1.0, 0.0, 0.0))


def test_zero_inner_dimension_gives_epilogue_only(kernel):
    x = torch.randn(2, 6, 0)
    c = torch.randn(2, 6, 6)
    out = kernel.run(x, None, c, 1.0, 2.0, 3.0)
    check_against_reference(out, syrk_reference(x, c, 1.0, 2.0, 3.0))


@settings(max_examples=6, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 70),
    batch=st.sampled_from([None, 1, 2]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    alpha=st.sampled_from([1.0, -0.5, 2.0]),
    beta=st.sampled_from([0.0, 1.0, 0.3]),
    gamma=st.sampled_from([0.0, 1.5]),
    transposed=st.booleans(),
    use_c=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_syrk_property(kernel, m, k, batch, dtype, alpha, beta, gamma, transposed, use_c, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen, transposed=transposed)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen) if use_c else None
    out = kernel.run(x, None, c, alpha, beta, gamma)
    check_against_reference(out, syrk_reference(x, c, alpha, beta, gamma))


@settings(max_examples=5, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 50),
    batch=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    alpha=st.sampled_from([1.0, -2.0]),
    beta=st.sampled_from([0.0, 1.0, -0.7]),
    gamma=st.sampled_from([0.0, 0.5]),
    transposed_b=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sym_mm_property(kernel, m, k, batch, dtype, alpha, beta, gamma, transposed_b, seed):
    gen = torch.Generator().manual_seed(seed)
    a = _random(_batch_shape(batch) + (m, k), dtype, gen)
    b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=transposed_b)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    out = kernel.run(a, b, c, alpha, beta, gamma, config=WIDE_K_TILES)
    check_against_reference(out, sym_mm_reference(a, b, c, alpha, beta, gamma))


@pytest.mark.parametrize(
    "shape,block",
    [((1, 1), 16), ((5, 5), 16), ((3, 33, 33), 16), ((40, 40), 32), ((2, 16, 16), 16)],
)
def test_mirror_lower_inplace(kernel, shape, block):
    """The cuBLAS path's in-place mirror: upper := lowerᵀ, lower and diagonal untouched."""
    p = torch.randn(shape, generator=torch.Generator().manual_seed(3)).half()
    p = p + torch.triu(torch.full_like(p, float("nan")), diagonal=1)  # upper poisoned
    out = kernel.mirror(p, block)
    assert torch.isfinite(out).all(), "upper triangle not fully written"
    assert torch.equal(out, out.mT)
    assert torch.equal(torch.tril(out), torch.tril(torch.nan_to_num(p)))


@pytest.mark.parametrize("config", [STRIP_TILES, WIDE_STRIP_TILES], ids=["16x32", "8x32"])
@pytest.mark.parametrize("m,k,batch,dtype", GRID)
def test_strip_tiles_match_reference(kernel, config, m, k, batch, dtype):
    """BLOCK_N > BLOCK_M: every element written once (poisoned output), bitwise symmetric."""
    gen = torch.Generator().manual_seed(m * 100 + k + 2)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    out = kernel.run(x, None, c, 0.75, -0.5, 1.25, config=config, num_sms=2)
    check_against_reference(out, syrk_reference(x, c, 0.75, -0.5, 1.25))
    a = _random(_batch_shape(batch) + (m, k), dtype, gen)
    b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=True)
    out = kernel.run(a, b, None, 1.5, 0.0, -0.25, config=config, num_sms=3)
    check_against_reference(out, sym_mm_reference(a, b, None, 1.5, 0.0, -0.25))


def test_tile_config_names_and_round_trip():
    from dmuon_compile.kernels.lower_tiles import TileConfig

    square, strips = TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 3, 1, block_n=256)
    assert square.name == "b128_k64_w8_s3_p1" and strips.name == "b128x256_k64_w8_s3_p1"
    assert TileConfig.from_dict(strips.to_dict()) == strips
    assert (
        TileConfig.from_dict({k: v for k, v in square.to_dict().items() if k != "block_n"})
        == square
    )
    with pytest.raises(ValueError, match="multiple"):
        TileConfig(128, 64, 8, 3, 1, block_n=192)


def run_and_check(kernel, a, b, c, alpha, beta, gamma, config, num_sms=3, loads=None) -> None:
    """Run one case and check it against the reference (``syrk`` when ``b`` is None, else
    ``sym_mm``); ``loads``, if given, is the load path the launch must have taken."""
    out = kernel.run(a, b, c, alpha, beta, gamma, config=config, num_sms=num_sms)
    if loads is not None:
        assert kernel.last_loads == loads, (
            f"expected {loads} loads, b transposed={b is not None and b.stride(-2) == 1}"
        )
    reference = (
        syrk_reference(a, c, alpha, beta, gamma)
        if b is None
        else sym_mm_reference(a, b, c, alpha, beta, gamma)
    )
    check_against_reference(out, reference)


# (m, k, batch, dtype, row-major b readable by TMA). Every k keeps rows 16-byte aligned, so a
# and a column-major b always go through TMA; a row-major (k, m) b needs 16-byte rows of m and,
# in a stack, K tiles that never cross into the next matrix (k % 16 == 0).
TMA_GRID = [
    (33, 40, None, torch.bfloat16, False),  # m·2 bytes not 16-aligned
    (16, 16, 3, torch.float16, True),
    (33, 24, 3, torch.float32, False),
    (5, 8, 1, torch.bfloat16, False),
    (40, 48, 2, torch.float16, True),
    (16, 24, 3, torch.float16, False),  # a K tile would cross into the next matrix
    (8, 40, None, torch.float32, True),  # 2-D: the last K tile is zero-filled
]


@pytest.mark.parametrize(
    "config", [TMA_TILES, TMA_FLAT_STRIP_TILES], ids=["tma16", "tma16x32_flat"]
)
@pytest.mark.parametrize("m,k,batch,dtype,row_b_tma", TMA_GRID)
def test_tma_tiles_match_reference(kernel, config, m, k, batch, dtype, row_b_tma):
    """The TMA kernel: poisoned output fully written, bitwise symmetric, equal to the reference,
    and the launch really used descriptors wherever the layout allows (else the pointer kernel)."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    run_and_check(kernel, x, None, c, 0.75, -0.5, 1.25, config, loads="tma")

    a = _random(_batch_shape(batch) + (m, k), dtype, gen)
    for transposed, expected in ((True, "tma"), (False, "tma" if row_b_tma else "ptr")):
        b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=transposed)
        run_and_check(kernel, a, b, c, 1.5, 0.5, -0.25, config, num_sms=2, loads=expected)


def test_tma_kernel_skips_unaligned_and_strided_operands(kernel):
    """Layouts TMA cannot address (odd row pitch, k = 0, a sliced stack) fall back to pointer
    loads."""
    gen = torch.Generator().manual_seed(11)
    odd_k = _random((9, 7), torch.float16, gen)  # 14-byte rows
    run_and_check(kernel, odd_k, None, None, 1.0, 0.0, 0.0, TMA_TILES, loads="ptr")
    empty_k = torch.zeros(2, 6, 0, dtype=torch.float16)  # k = 0: only the epilogue remains
    c = _random((2, 6, 6), torch.float16, gen)
    run_and_check(kernel, empty_k, None, c, 1.0, 2.0, 3.0, TMA_TILES, loads="ptr")
    sliced = _random((3, 12, 32), torch.float16, gen)[:, :10]  # batch stride 12 rows, m = 10
    run_and_check(kernel, sliced, None, None, 1.0, 0.0, 0.0, TMA_TILES, loads="ptr")


@settings(max_examples=5, deadline=None)
@given(
    m=st.integers(1, 40),
    k8=st.integers(1, 8),
    batch=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    flatten=st.booleans(),
    transposed_b=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tma_property(kernel, m, k8, batch, dtype, flatten, transposed_b, seed):
    """Random shapes through the TMA configs (k a multiple of 8, so a is TMA-aligned)."""
    gen = torch.Generator().manual_seed(seed)
    config = TMA_FLAT_STRIP_TILES if flatten else TMA_TILES
    k = 8 * k8
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    run_and_check(kernel, x, None, None, 1.0, 0.0, 0.5, config, loads="tma")
    b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=transposed_b)
    run_and_check(kernel, x, b, None, -1.0, 0.0, 0.0, config)


def test_tma_config_names_and_flatten_needs_tma():
    from dmuon_compile.kernels.lower_tiles import TileConfig

    tma = TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, flatten=True)
    assert tma.name == "b128x256_k64_w8_s3_p1_tma_flat"
    assert TileConfig(128, 64, 8, 3, tma=True).name == "b128_k64_w8_s3_p1_tma"
    cp = TileConfig(128, 64, 8, 3, tma=True, tma_store=True, c_load="prologue")
    assert cp.name == "b128_k64_w8_s3_p1_tma_st_cp"
    assert TileConfig.from_dict(cp.to_dict()) == cp
    ct = TileConfig(128, 64, 8, 3, tma=True, tma_store=True, c_load="tma")
    assert ct.name == "b128_k64_w8_s3_p1_tma_st_ct"
    assert TileConfig.from_dict(ct.to_dict()) == ct
    with pytest.raises(ValueError, match="tma=True"):
        TileConfig(128, 64, 8, 3, c_load="prologue")
    with pytest.raises(ValueError, match="tma_store=True"):
        TileConfig(128, 64, 8, 3, tma=True, c_load="tma")
    with pytest.raises(ValueError, match="choose one of"):
        TileConfig(128, 64, 8, 3, tma=True, c_load="smem")
    assert TileConfig.from_dict(tma.to_dict()) == tma
    with pytest.raises(ValueError, match="tma=True"):
        TileConfig(128, 64, 8, 3, flatten=True)


@pytest.mark.parametrize(
    "config", [TMA_TILES, TMA_FLAT_STRIP_TILES], ids=["tma16", "tma16x32_flat"]
)
@pytest.mark.parametrize(
    "m,k,batch,expected",
    [
        (16, 32, 3, "tma"),
        (24, 24, None, "tma"),  # one matrix: the last K tile is zero-filled past k rows
        (16, 24, 3, "ptr"),  # a K tile would run into the next matrix
        (9, 32, 2, "ptr"),  # rows of aᵀ are 18 bytes
    ],
)
def test_tma_reads_column_major_a(kernel, config, m, k, batch, expected):
    """A column-major ``a`` (the transposed view NS makes of a tall matrix) is read as ``aᵀ``'s
    rows."""
    gen = torch.Generator().manual_seed(m + k)
    x = _random(_batch_shape(batch) + (m, k), torch.float16, gen, transposed=True)
    assert not x.is_contiguous()
    c = _random(_batch_shape(batch) + (m, m), torch.float16, gen)
    run_and_check(kernel, x, None, c, 1.0, 1.0, 0.5, config, loads=expected)
    b = _random(_batch_shape(batch) + (k, m), torch.float16, gen, transposed=True)
    run_and_check(kernel, x, b, None, 1.0, 0.0, 0.0, config, loads=expected)


TMA_STORE_STRIP_TILES = dict(STRIP_TILES, tma=True, tma_store=True)
TMA_STORE_TILES = dict(SMALL_TILES, tma=True, tma_store=True)


@pytest.mark.parametrize(
    "config", [TMA_STORE_TILES, TMA_STORE_STRIP_TILES], ids=["16_st", "16x32_st"]
)
@pytest.mark.parametrize(
    "m,k,batch,dtype",
    [
        (48, 16, None, torch.float16),  # several tiles strictly below the diagonal
        (40, 24, 3, torch.bfloat16),  # partial last tiles: TMA clips each matrix's own edge
        (72, 8, 2, torch.float32),
        (
            33,
            16,
            2,
            torch.float16,
        ),  # 66-byte rows: the output descriptors are refused, masked stores
    ],
)
def test_tma_store_matches_reference(kernel, config, m, k, batch, dtype):
    """Off-diagonal tiles stored through output descriptors: every element written once
    (poisoned output), nothing written into a neighbouring matrix of the stack, bitwise
    symmetric."""
    gen = torch.Generator().manual_seed(m + 7 * k)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    run_and_check(kernel, x, None, c, 0.5, 2.0, 1.0, config, loads="tma")
    b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=True)
    run_and_check(kernel, x, b, c, -1.0, 1.0, 0.0, config)


C_BY_TMA = {
    "16_cp": (dict(TMA_STORE_TILES, c_load="prologue"), "tma+cp"),
    "16x32_cp": (dict(TMA_STORE_STRIP_TILES, c_load="prologue"), "tma+cp"),
    "16_ct": (dict(TMA_STORE_TILES, c_load="tma"), "tma+ct"),
    "16x32_ct": (dict(TMA_STORE_STRIP_TILES, c_load="tma"), "tma+ct"),
}


@pytest.mark.parametrize("name", list(C_BY_TMA))
@pytest.mark.parametrize(
    "m,k,batch,dtype",
    [
        (48, 16, None, torch.float16),
        (40, 24, 3, torch.bfloat16),  # partial last tiles: TMA zero-fills C past each edge
        (72, 8, 2, torch.float32),
    ],
)
def test_c_by_tma_matches_reference(kernel, name, m, k, batch, dtype):
    """beta·C read by TMA (``c_load``: into the accumulator's start, or in the epilogue of the
    tiles below the diagonal): every element written once, bitwise symmetric, equal to the
    reference; the launch really took that path (``+cp`` / ``+ct``), and falls back to the
    epilogue's pointer loads for a non-contiguous C (and, into the accumulator, alpha = 0)."""
    config, loads = C_BY_TMA[name]
    gen = torch.Generator().manual_seed(m + 11 * k)
    x = _random(_batch_shape(batch) + (m, k), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    run_and_check(kernel, x, None, c, 0.5, 2.0, 1.0, config, loads=loads)
    b = _random(_batch_shape(batch) + (k, m), dtype, gen, transposed=True)
    run_and_check(kernel, x, b, c, -1.0, 1.0, 0.0, config, loads=loads)
    run_and_check(
        kernel, x, None, c, 0.0, 2.0, 1.0, config, loads="tma+ct" if loads == "tma+ct" else "tma"
    )
    strided_c = _random(_batch_shape(batch) + (m, m), dtype, gen, transposed=True)
    run_and_check(kernel, x, None, strided_c, 0.5, 2.0, 1.0, config, loads="tma")


@settings(max_examples=6, deadline=None)
@given(
    m=st.integers(1, 40),
    k8=st.integers(1, 6),
    batch=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    name=st.sampled_from(list(C_BY_TMA)),
    alpha=st.sampled_from([1.0, -0.75, 3.5, 0.0]),
    beta=st.sampled_from([0.0, 1.0, -2.0, 0.25]),
    gamma=st.sampled_from([0.0, 1.5]),
    seed=st.integers(0, 2**16),
)
def test_c_by_tma_property(kernel, m, k8, batch, dtype, name, alpha, beta, gamma, seed):
    """Random shapes and coefficients through the configs that read C by TMA, against the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    x = _random(_batch_shape(batch) + (m, 8 * k8), dtype, gen)
    c = _random(_batch_shape(batch) + (m, m), dtype, gen)
    run_and_check(kernel, x, None, c, alpha, beta, gamma, C_BY_TMA[name][0])


def test_tma_candidates_only_where_descriptors_can_read_the_operands(monkeypatch):
    """The autotune skips TMA candidates on devices / Triton builds without descriptors (they
    would only time the pointer kernel again), and keeps them in the list otherwise."""
    from dmuon_compile.kernels import syrk, syrk_tma

    a = torch.randn(256, 512, dtype=torch.float16)
    assert any(c.tma for c in syrk.candidates_for(256))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not syrk_tma.tma_supported(a.device)  # a CPU tensor outside the interpreter
    assert not any(c.tma for c in syrk.candidates_for(256, a, None))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert syrk_tma.tma_supported(a.device) == syrk_tma._triton_has_descriptors()
    monkeypatch.setattr(syrk_tma, "_triton_has_descriptors", lambda: False)
    assert not syrk_tma.tma_supported(a.device)
    assert syrk_tma.tma_descriptors(a, None, next(c for c in syrk.CANDIDATES if c.tma)) is None


@settings(max_examples=12, deadline=None)
@given(
    batch=st.sampled_from([None, 1, 3]),
    m=st.integers(1, 40),
    n=st.integers(1, 90),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    out_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    log_scale=st.integers(-6, 6),
    seed=st.integers(0, 2**16),
)
def test_scale_cast_kernel_matches_reference_bitwise(
    kernel, batch, m, n, in_dtype, out_dtype, log_scale, seed
):
    """NS's one-pass normalisation kernel against its torch reference: the same bits, for sizes
    that are not multiples of the 2048-element block (and stacks that straddle blocks), inputs
    from 1e-6 to 1e6 and every input/output dtype pair."""
    from dmuon_compile.kernels.scale_cast import scale_cast_reference

    gen = torch.Generator().manual_seed(seed)
    g = (_random(_batch_shape(batch) + (m, n), torch.float32, gen) * 10.0**log_scale).to(in_dtype)
    denom = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.float32) + 1e-7
    out = kernel.scale_cast(g, denom, out_dtype)
    want = scale_cast_reference(g, denom, out_dtype)
    assert out.dtype == out_dtype and out.shape == g.shape
    if out_dtype == torch.float16:
        assert torch.equal(out, want)
    else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest: test_syrk_gpu.py)
        ulp = want.float().abs() * 2.0**-7 + 1e-38
        assert bool(((out.float() - want.float()).abs() <= ulp).all())


@settings(max_examples=10, deadline=None)
@given(
    numel=st.sampled_from([1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 9 * 4096 + 1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    flag=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_copy_unless_kernel_copies_exactly_when_the_flag_is_false(kernel, numel, dtype, flag, seed):
    """The kept momentum's undo: the source's bits everywhere when the flag is false (sizes
    past several persistent-loop iterations of one program, not multiples of the block), the
    destination untouched when true. Control: the reference of the other flag differs."""
    from dmuon_compile.kernels.copy_unless import copy_unless_reference

    gen = torch.Generator().manual_seed(seed)
    dst = torch.randn(numel, generator=gen).to(dtype)
    src = torch.randn(numel, generator=gen).to(dtype)
    ok = torch.tensor(flag)
    out = kernel.copy_unless(ok, dst.clone(), src)
    assert torch.equal(out, copy_unless_reference(ok, dst.clone(), src))
    assert torch.equal(out, dst if flag else src)
    assert not torch.equal(out, copy_unless_reference(~ok, dst.clone(), src))
