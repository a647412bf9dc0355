"""Launch metadata of the Triton kernels (``@triton.jit(launch_metadata=...)``), on CPU.

Each launcher runs with its kernel replaced by a recorder that keeps the grid and the arguments
exactly as the launcher passes them; the kernel's metadata function is then called on them the
way Triton's launch hook calls it, ``fn(grid, compiled-kernel metadata, {name: value})``. The
FLOPs must be those of the lower triangle (``2·k`` per element ``i >= j``, counted here from
``torch.tril``) and the bytes those of each operand read once and the output written once; a
metadata function that counts the full product must fail the same check. The normalisation
kernel (``scale_cast``) reports one fp32 division per element and the bandwidth floor.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from dmuon_compile.kernels import mirror, scale_cast, syrk_pointer, syrk_tma  # noqa: E402
from dmuon_compile.kernels.lower_tiles import TileConfig  # noqa: E402
from dmuon_compile.kernels.symmetric_product import launch_symmetric_product  # noqa: E402

SQUARE = TileConfig(16, 16, 4, 2)
STRIPS = TileConfig(16, 16, 4, 2, block_n=32)
TMA_SQUARE = TileConfig(16, 16, 4, 2, tma=True, tma_store=True)
TMA_STRIPS = TileConfig(16, 16, 4, 2, block_n=32, tma=True)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the
    grid and ``{parameter name: value}`` (launch options such as ``num_warps`` dropped, as
    Triton does) instead of launching."""

    def __init__(self, kernel) -> None:
        self.params = list(inspect.signature(kernel.fn).parameters)
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.params, args))
            named.update((k, v) for k, v in kwargs.items() if k in self.params)
            assert set(named) == set(self.params), f"unset: {set(self.params) - set(named)}"
            self.calls.append((grid, named))

        return launch


def wired_metadata(kernel):
    """The metadata function a kernel was decorated with (a compiled kernel keeps it as an
    attribute; an interpreted one, under ``TRITON_INTERPRET=1``, in its keyword arguments)."""
    fn = getattr(kernel, "launch_metadata", None)
    return fn if fn is not None else getattr(kernel, "kwargs", {}).get("launch_metadata")


def recorded_launch(monkeypatch, module, name, run):
    """Run ``run()`` with ``module.name`` recorded; return ``(grid, args, metadata function)``
    of its single launch."""
    kernel = getattr(module, name)
    recorder = Recorder(kernel)
    monkeypatch.setattr(module, name, recorder)
    run()
    assert len(recorder.calls) == 1, f"{name}: {len(recorder.calls)} launches"
    grid, args = recorder.calls[0]
    return grid, args, wired_metadata(kernel)


def lower_elements(m: int) -> int:
    return int(torch.tril(torch.ones(m, m)).sum())


def check_product_metadata(meta, *, op, loads, a, b, c, out, tile) -> None:
    """``meta`` names the launch and counts the lower triangle's FLOPs and the bytes moved."""
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    key = f"flops{8 * a.element_size()}"
    assert meta["name"] == f"{op}_{loads} {m}x{k} b{batch} {tile}", meta["name"]
    assert [name for name in meta if name.startswith("flops")] == [key], meta
    expected_flops = 2 * k * batch * lower_elements(m)
    assert meta[key] == expected_flops, f"flops {meta[key]} != lower triangle {expected_flops}"
    expected_bytes = (
        a.numel() * a.element_size()
        + (0 if b is None else b.numel() * b.element_size())
        + (0 if c is None else batch * lower_elements(m) * c.element_size())
        + out.numel() * out.element_size()
    )
    assert meta["bytes"] == expected_bytes, f"bytes {meta['bytes']} != {expected_bytes}"


def _random(shape, dtype, transposed=False):
    gen = torch.Generator().manual_seed(sum(shape))
    if transposed:
        return torch.randn(shape[:-2] + (shape[-1], shape[-2]), generator=gen).to(dtype).mT
    return torch.randn(shape, generator=gen).to(dtype)


# (shape of a, dtype, sym_mm, c given, beta, config)
POINTER_CASES = [
    ((37, 20), torch.float16, False, False, 0.0, SQUARE),
    ((3, 40, 24), torch.bfloat16, False, True, 0.5, STRIPS),
    ((2, 33, 16), torch.float32, True, True, 0.0, SQUARE),  # beta = 0: c is never read
    ((1, 5, 7), torch.float16, True, False, 0.0, STRIPS),
]


@pytest.mark.parametrize("shape,dtype,sym_mm,with_c,beta,config", POINTER_CASES)
def test_pointer_kernel_metadata(monkeypatch, shape, dtype, sym_mm, with_c, beta, config):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no descriptors: the pointer kernel
    a = _random(shape, dtype)
    m, k = shape[-2], shape[-1]
    b = _random(shape[:-2] + (k, m), dtype) if sym_mm else None
    c = _random(shape[:-2] + (m, m), dtype) if with_c else None
    out = torch.empty(shape[:-2] + (m, m), dtype=dtype)
    grid, args, fn = recorded_launch(
        monkeypatch,
        syrk_pointer,
        "_symmetric_product_kernel",
        lambda: launch_symmetric_product(a, b, c, 1.0, beta, 0.5, config, out=out),
    )
    assert fn is syrk_pointer._pointer_launch_metadata
    check_product_metadata(
        fn(grid, None, args),
        op="sym_mm" if sym_mm else "syrk",
        loads="ptr",
        a=a,
        b=b,
        c=c if beta != 0.0 else None,
        out=out,
        tile=f"{config.block}x{config.cols}x{config.block_k}",
    )


# (shape of a, dtype, sym_mm with a column-major b, config)
TMA_CASES = [
    ((2, 40, 32), torch.float16, False, TMA_SQUARE),
    ((48, 16), torch.bfloat16, True, TMA_STRIPS),
    ((3, 16, 32), torch.float32, True, TMA_SQUARE),
]


@pytest.mark.parametrize("shape,dtype,sym_mm,config", TMA_CASES)
def test_tma_kernel_metadata(monkeypatch, shape, dtype, sym_mm, config):
    # CPU tensors get descriptors only "under the interpreter"; the launch itself is recorded.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not syrk_tma.tma_supported(torch.device("cpu")):
        pytest.skip("this Triton has no host-side TMA descriptors")
    a = _random(shape, dtype)
    m, k = shape[-2], shape[-1]
    b = _random(shape[:-2] + (k, m), dtype, transposed=True) if sym_mm else None
    c = _random(shape[:-2] + (m, m), dtype)
    out = torch.empty(shape[:-2] + (m, m), dtype=dtype)
    grid, args, fn = recorded_launch(
        monkeypatch,
        syrk_tma,
        "_symmetric_product_tma_kernel",
        lambda: launch_symmetric_product(a, b, c, 1.0, 2.0, 0.0, config, out=out),
    )
    assert fn is syrk_tma._tma_launch_metadata
    check_product_metadata(
        fn(grid, None, args),
        op="sym_mm" if sym_mm else "syrk",
        loads="tma",
        a=a,
        b=b,
        c=c,
        out=out,
        tile=f"{config.block}x{config.cols}x{config.block_k}",
    )


def test_metadata_that_counts_the_full_product_fails_the_check(monkeypatch):
    """Control: the check above tells the lower triangle from the whole ``m×m`` product."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = _random((2, 24, 8), torch.float16)
    out = torch.empty(2, 24, 24, dtype=torch.float16)
    grid, args, fn = recorded_launch(
        monkeypatch,
        syrk_pointer,
        "_symmetric_product_kernel",
        lambda: launch_symmetric_product(a, None, None, 1.0, 0.0, 0.0, SQUARE, out=out),
    )
    full = fn(grid, None, args) | {"flops16": 2 * 2 * 24 * 24 * 8}
    with pytest.raises(AssertionError, match="flops"):
        check_product_metadata(
            full, op="syrk", loads="ptr", a=a, b=None, c=None, out=out, tile="16x16x16"
        )
    # ... and the real function passes it on the same launch.
    check_product_metadata(
        fn(grid, None, args), op="syrk", loads="ptr", a=a, b=None, c=None, out=out, tile="16x16x16"
    )


@pytest.mark.parametrize("shape", [(9, 9), (3, 70, 70), (1, 1, 1)])
def test_mirror_kernel_metadata(monkeypatch, shape):
    """The mirror reads the strict lower triangle and writes the strict upper one; no FLOPs."""
    p = _random(shape, torch.bfloat16)
    grid, args, fn = recorded_launch(
        monkeypatch, mirror, "_mirror_lower_kernel", lambda: mirror.mirror_lower_inplace(p, 16)
    )
    assert fn is mirror._mirror_launch_metadata
    meta = fn(grid, None, args)
    m, batch = shape[-1], (shape[0] if len(shape) == 3 else 1)
    strict_lower = int(torch.tril(torch.ones(m, m), diagonal=-1).sum())
    assert meta == {
        "name": f"mirror_lower {m}x{m} b{batch}",
        "bytes": 2 * batch * strict_lower * p.element_size(),
    }


def check_scale_cast_metadata(meta, g, out) -> None:
    """One fp32 division per element; ``g`` read once, one fp32 denominator per matrix, the
    output written once."""
    m, n = g.shape[-2:]
    batch = g.shape[0] if g.dim() == 3 else 1
    src, dst = (str(t.dtype).removeprefix("torch.") for t in (g, out))
    assert meta["name"] == f"scale_cast {m}x{n} b{batch} {src}->{dst}", meta["name"]
    assert [name for name in meta if name.startswith("flops")] == ["flops32"], meta
    assert meta["flops32"] == g.numel()
    expected_bytes = g.numel() * g.element_size() + batch * 4 + out.numel() * out.element_size()
    assert meta["bytes"] == expected_bytes, f"bytes {meta['bytes']} != {expected_bytes}"


# (shape of g, its dtype, the work dtype): numels off the block size, one element, one matrix
SCALE_CAST_CASES = [
    ((37, 20), torch.float32, torch.float16),
    ((3, 40, 24), torch.bfloat16, torch.float16),
    ((2, 70, 33), torch.float16, torch.bfloat16),
    ((1, 1, 1), torch.float32, torch.bfloat16),
]


def _scale_cast_launch(monkeypatch, shape, dtype, work_dtype):
    # scale_cast launches on CPU tensors only "under the interpreter"; the launch is recorded.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = _random(shape, dtype)
    denom = torch.linalg.vector_norm(g.float(), dim=(-2, -1), keepdim=True) + 1e-7
    launches = []
    grid, args, fn = recorded_launch(
        monkeypatch,
        scale_cast,
        "_scale_cast_kernel",
        lambda: launches.append(scale_cast.scale_cast(g, denom, work_dtype)),
    )
    return g, launches[0], fn(grid, None, args), fn


@pytest.mark.parametrize("shape,dtype,work_dtype", SCALE_CAST_CASES)
def test_scale_cast_kernel_metadata(monkeypatch, shape, dtype, work_dtype):
    g, out, meta, fn = _scale_cast_launch(monkeypatch, shape, dtype, work_dtype)
    assert fn is scale_cast._scale_cast_launch_metadata
    assert out.dtype == work_dtype and out.shape == g.shape
    check_scale_cast_metadata(meta, g, out)


def test_scale_cast_metadata_that_counts_a_denominator_per_element_fails(monkeypatch):
    """Control: the check tells one denominator per matrix from one per element (the kernel's
    per-element load of it hits the cache) and a wrong dtype pair in the name."""
    g, out, meta, _ = _scale_cast_launch(monkeypatch, (2, 24, 8), torch.bfloat16, torch.float16)
    per_element = meta | {"bytes": g.numel() * (g.element_size() + 4 + out.element_size())}
    with pytest.raises(AssertionError, match="bytes"):
        check_scale_cast_metadata(per_element, g, out)
    with pytest.raises(AssertionError, match="scale_cast"):
        check_scale_cast_metadata(meta, g, out.to(torch.bfloat16))
    check_scale_cast_metadata(meta, g, out)  # ... and the real function passes


def test_flops_keys_are_what_tritons_profiler_reads():
    """``flops16`` / ``flops32`` are among the metrics proton's launch hook copies."""
    try:
        from triton.profiler.hooks.launch import LaunchHook
    except ImportError as exc:  # proton is not built into every Triton wheel
        pytest.skip(f"triton.profiler unavailable: {exc}")
    assert {"flops16", "flops32", "bytes"} <= set(LaunchHook.metrics)
