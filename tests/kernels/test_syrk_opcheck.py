"""``torch.library.opcheck`` of ``dmuon::syrk`` and ``dmuon::sym_mm`` on CPU (the torch reference).

opcheck runs the schema, fake-tensor (register_fake: exact sizes and strides), autograd
registration and AOT-dispatch checks; the CUDA kernels share the same schema and fake impl.
"""

from __future__ import annotations

import dmuon_compile.kernels  # noqa: F401  (registers the ops)
import pytest
import torch

SYRK_SAMPLES = [
    (torch.randn(5, 7), None, 1.0, 0.0, 0.0),
    (torch.randn(3, 6, 4), torch.randn(3, 6, 6), 0.5, 2.0, 1.5),
    (torch.randn(4, 9).half(), torch.randn(4, 4).half(), -1.0, 1.0, 0.25),
    (torch.randn(8, 3).mT, None, 2.0, 0.0, 1.0),  # column-major input
    (torch.randn(1, 1, 5).bfloat16(), None, 1.0, 0.0, 0.0),
]
SYM_MM_SAMPLES = [
    (torch.randn(5, 5), torch.randn(5, 5), None, 1.0, 0.0, 0.0),
    (torch.randn(2, 4, 6), torch.randn(2, 6, 4), torch.randn(2, 4, 4), 1.0, 3.0, -0.5),
    (
        torch.randn(6, 6).half(),
        torch.randn(6, 6).half().mT,
        torch.randn(6, 6).half(),
        0.5,
        1.0,
        0.0,
    ),
]


@pytest.mark.parametrize(
    "args", SYRK_SAMPLES, ids=lambda a: str(tuple(a[0].shape)) if isinstance(a, tuple) else None
)
def test_opcheck_syrk(args):
    torch.library.opcheck(torch.ops.dmuon.syrk.default, args)


@pytest.mark.parametrize("args", SYM_MM_SAMPLES)
def test_opcheck_sym_mm(args):
    torch.library.opcheck(torch.ops.dmuon.sym_mm.default, args)


def test_fake_impl_gives_contiguous_exact_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 10, 40, dtype=torch.bfloat16)
        out = torch.ops.dmuon.syrk(x, None, 1.0, 0.0, 0.0)
        assert (
            out.shape == (3, 10, 10)
            and out.stride() == (100, 10, 1)
            and out.dtype == torch.bfloat16
        )
        a = torch.empty(7, 7, dtype=torch.float16)
        out = torch.ops.dmuon.sym_mm(a, a, None, 1.0, 0.0, 0.0)
        assert out.shape == (7, 7) and out.stride() == (7, 1)


def test_real_outputs_match_fake_layout():
    x = torch.randn(2, 5, 3).mT  # (2, 3, 5) column-major
    out = torch.ops.dmuon.syrk(x, None, 1.0, 0.0, 0.0)
    assert out.shape == (2, 3, 3) and out.is_contiguous()
    assert torch.equal(out, out.mT)


def test_cuda_kernels_are_registered_for_cuda_only():
    pytest.importorskip("triton")
    from dmuon_compile.kernels import TRITON_KERNELS_IMPORT_ERROR

    assert TRITON_KERNELS_IMPORT_ERROR is None
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dmuon::syrk", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dmuon::sym_mm", "CUDA")
