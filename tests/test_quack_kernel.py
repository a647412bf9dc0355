"""``NewtonSchulz(kernel="quack")``: Dao-AILab's quack ``gemm_symmetric`` for the symmetric
products (the ``[quack]`` extra), or a clear error naming the extra.

On the CPU: the missing-extra error, the GPU requirement, the kernel rules, and the wiring of
``QuackPrimitives`` checked with a stand-in for ``gemm_symmetric`` that computes its documented
result (``alpha·A·B + beta·C``) with torch: Newton–Schulz through it equals the cuBLAS chain.
On the GPU (``@pytest.mark.gpu``, skipped without quack): the real kernels against the eager
cuBLAS reference.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dmuon_compile import coefficients as coeffs
from dmuon_compile.kernel_choice import QUACK_MIN_ROWS, choose_kernel
from dmuon_compile.newton_schulz import (
    NewtonSchulz,
    QuackPrimitives,
    TorchPrimitives,
    direct_ns,
    gram_ns,
)


def _stand_in_quack(monkeypatch, calls: list | None = None) -> None:
    """A ``quack.gemm_interface`` whose ``gemm_symmetric`` is torch's ``alpha·A·B + beta·C``."""

    def gemm_symmetric(A, B, C=None, out=None, out_dtype=None, alpha=1.0, beta=1.0, **_):
        assert isinstance(alpha, float) and isinstance(beta, float)
        if calls is not None:
            calls.append(tuple(A.shape))
        result = alpha * (A @ B)
        return result if C is None else result + beta * C

    package = types.ModuleType("quack")
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_symmetric = gemm_symmetric
    package.gemm_interface = interface
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)


def test_missing_quack_raises_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)  # not installed, whatever this machine has
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    with pytest.raises(ImportError, match=r'pip install "dmuon_compile\[quack\]"'):
        NewtonSchulz(kernel="quack")
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    monkeypatch.setenv("DMUON_NS_KERNEL", "quack")
    with pytest.raises(ImportError, match=r"dmuon_compile\[quack\]"):
        NewtonSchulz()  # the environment's choice is checked the same way
    monkeypatch.delenv("DMUON_NS_KERNEL")
    assert NewtonSchulz().kernel in ("triton", "cublas")  # control: auto never needs quack


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU error")
def test_quack_without_a_gpu_says_so(monkeypatch):
    _stand_in_quack(monkeypatch)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        NewtonSchulz(kernel="quack")


def test_quack_and_deterministic_conflict():
    with pytest.raises(ValueError, match="conflict"):
        NewtonSchulz(kernel="quack", deterministic=True)


def test_kernel_rules_for_quack():
    def eager(m, dtype=torch.float16, device="cuda"):
        return choose_kernel(
            "eager", m=m, dtype=dtype, device=device, requested="quack", resolved="quack"
        ).kernel

    assert eager(QUACK_MIN_ROWS) == "quack" and eager(4096) == "quack"
    assert eager(QUACK_MIN_ROWS - 1) == "cublas"  # below one tile
    assert eager(4096, dtype=torch.float32) == "cublas"  # quack's kernels are fp16/bf16
    assert eager(4096, device="cpu") == "cublas"
    step = choose_kernel("step", requested="quack", resolved="quack")
    assert step.kernel == "quack" and not step.uses_op  # no NS-chain pass in the compiled step
    # control: the same sizes without kernel="quack" never pick it
    assert choose_kernel("eager", m=4096, requested="auto", resolved="cublas").kernel == "cublas"


@pytest.mark.parametrize("algorithm", ["gram", "direct"])
def test_quack_primitives_wiring_equals_the_cublas_chain(monkeypatch, algorithm):
    """Every symmetric product goes to gemm_symmetric with C, alpha and beta in the right
    places: NS through the stand-in equals NS through plain addmm, to the last bit."""
    calls: list = []
    _stand_in_quack(monkeypatch, calls)
    g = torch.randn(2, 48, 160, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = g / g.norm(dim=(-2, -1), keepdim=True)
    table = coeffs.resolve(None, "polar_express", None)
    if algorithm == "gram":
        ref = gram_ns(x, table, (2,), TorchPrimitives)
        out = gram_ns(x, table, (2,), QuackPrimitives)
    else:
        ref = direct_ns(x, table, TorchPrimitives)
        out = direct_ns(x, table, QuackPrimitives)
    assert calls, "gemm_symmetric was never called"
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------- GPU
def _quack_importable() -> bool:
    try:
        import quack.gemm_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        return False
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (8, 512, 1536), (768, 768)])
@pytest.mark.parametrize("backend", ["gram", "direct"])
def test_quack_newton_schulz_matches_the_cublas_reference(shape, backend):
    if not _quack_importable():
        pytest.skip('quack is not installed (pip install "dmuon_compile[quack]")')
    torch.manual_seed(0)
    g = torch.randn(*shape, device="cuda")
    quack_ns = NewtonSchulz(backend, kernel="quack")
    ref_ns = NewtonSchulz(backend, kernel="cublas")
    assert quack_ns.kernel == "quack"
    assert quack_ns.primitives_for(shape[-2], 1, "cuda", torch.float16) is QuackPrimitives
    exact = NewtonSchulz(backend, kernel="cublas", work_dtype=torch.float64)(g.double())
    out, ref = quack_ns(g), ref_ns(g)
    assert torch.isfinite(out).all()
    err = (out.double() - exact).norm() / exact.norm()
    ref_err = (ref.double() - exact).norm() / exact.norm()
    assert err <= 2 * ref_err + 1e-3, (float(err), float(ref_err))
