"""Quick GPU check of the in-place mirror kernel and both ops' dispatch (run before the bench)."""

import torch
from dmuon_compile.kernels.mirror import mirror_lower_inplace
from dmuon_compile.kernels.ops import sym_mm_reference, syrk_reference

import dmuon_compile  # noqa: F401

for shape in [(1, 1), (77, 77), (3, 300, 300), (2048, 2048), (5, 1000, 1000)]:
    p = torch.randn(shape, device="cuda").half()
    expect = torch.tril(p) + torch.tril(p, -1).mT
    p = p + torch.triu(torch.full_like(p, float("nan")), 1)
    out = mirror_lower_inplace(p)
    assert torch.equal(out, expect), f"mirror wrong at {shape}"
for shape in [(700, 900), (3, 1000, 2500)]:  # cuBLAS verdicts (small), mirrored by the kernel
    x = torch.randn(shape, device="cuda").half() / shape[-1] ** 0.25
    out = torch.ops.dmuon.syrk(x, None, 1.0, 0.0, 1.0)
    ref = syrk_reference(x.double(), None, 1.0, 0.0, 1.0)
    err = float((out.double() - ref).norm() / ref.norm())
    assert torch.equal(out, out.mT) and err < 1e-2, (shape, err)
    r = out
    out2 = torch.ops.dmuon.sym_mm(r, r, r, 0.5, 2.0, 0.0)
    ref2 = sym_mm_reference(r.double(), r.double(), r.double(), 0.5, 2.0, 0.0)
    err2 = float((out2.double() - ref2).norm() / ref2.norm())
    assert torch.equal(out2, out2.mT) and err2 < 1e-2, (shape, err2)
print("GPU mirror/dispatch check passed", flush=True)
