"""Host (CPU) time per call of the symmetric-product op, and where it goes.

Small products finish on the GPU faster than Python can issue them, so an eager op call's
wall time is its host time. This script measures, per call and without synchronising, the
time to *enqueue* each piece of ``torch.ops.dmuon.syrk`` on one GPU, and prints cProfile's
top functions for the op on a cuBLAS-verdict shape and on a Triton-verdict shape:

    python benchmarks/host_overhead.py

Needs a CUDA GPU. The numbers explain the small-shape rows of bench_kernels.py §C.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch


def enqueue_us(fn, calls: int = 300) -> float:
    """Mean host microseconds per call (the GPU queue absorbs the work; synchronised at the end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def top_functions(fn, calls: int = 200, top: int = 12) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> int:
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from dmuon_compile.kernels import syrk
    from dmuon_compile.kernels.mirror import mirror_lower_inplace

    import dmuon_compile  # noqa: F401  (registers torch.ops.dmuon.*)

    cases = {
        "1024×1024 (cuBLAS verdict)": torch.randn(1024, 1024, device="cuda").to(torch.bfloat16),
        "16×1024×3584 (Triton verdict)": torch.randn(16, 1024, 3584, device="cuda").to(
            torch.bfloat16
        ),
        "16×2048×5632 fp16 (model S's Gram of gate/up)": torch.randn(
            16, 2048, 5632, device="cuda"
        ).to(torch.float16),
    }
    print("| case | piece | host µs per call |\n|---|---|---|")
    for name, a in cases.items():
        torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0)  # tune or load the verdict
        verdict = syrk.tuned_choice("syrk", a, None, None, 0.0)
        p = a @ a.mT
        pieces = {
            "torch.mm(a, aᵀ)": lambda: a @ a.mT,
            "torch.ops.dmuon.syrk (whole op)": lambda: torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0),
            "syrk_cuda (no dispatcher)": lambda: syrk.syrk_cuda(a, None, 1.0, 0.0, 0.0),
            "tuned_choice (memoised verdict)": lambda: syrk.tuned_choice(
                "syrk", a, None, None, 0.0
            ),
            "mirror_lower_inplace (Triton launch)": lambda: mirror_lower_inplace(p),
        }
        if verdict != "cublas":
            pieces[f"launch_config ({verdict.name})"] = lambda: syrk.launch_config(
                a, None, None, 1.0, 0.0, 0.0, verdict
            )
        for piece, fn in pieces.items():
            print(f"| {name} | {piece} | {enqueue_us(fn):.1f} |", flush=True)
    # Model S's direct-NS polynomial b·A + c·A² on its stack of 32 squares (a β·C product: the
    # Gluon kernel's verdict on SM90), against cuBLAS's baddbmm of the same operands.
    g = torch.randn(32, 2048, 2048, device="cuda").to(torch.bfloat16)
    g = (g + g.mT) / 64
    torch.ops.dmuon.sym_mm(g, g, g, 2.0, -4.0, 0.0)
    verdict = syrk.tuned_choice("sym_mm", g, g, g, -4.0)
    name = "32×2048² sym_mm + C bf16 (model S's direct-NS polynomial)"
    pieces = {
        "torch.baddbmm (cuBLAS)": lambda: torch.baddbmm(g, g, g, beta=-4.0, alpha=2.0),
        "torch.ops.dmuon.sym_mm (whole op)": lambda: torch.ops.dmuon.sym_mm(
            g, g, g, 2.0, -4.0, 0.0
        ),
        "tuned_choice (memoised verdict)": lambda: syrk.tuned_choice("sym_mm", g, g, g, -4.0),
    }
    if verdict != "cublas":
        pieces[f"launch_config ({verdict.name})"] = lambda: syrk.launch_config(
            g, g, g, 2.0, -4.0, 0.0, verdict
        )
    for piece, fn in pieces.items():
        print(f"| {name} | {piece} | {enqueue_us(fn, calls=100):.1f} |", flush=True)
    print(f"\n### cProfile, torch.ops.dmuon.sym_mm on {name}\n")
    print(top_functions(lambda: torch.ops.dmuon.sym_mm(g, g, g, 2.0, -4.0, 0.0), calls=100))
    for name, a in cases.items():
        print(f"\n### cProfile, torch.ops.dmuon.syrk on {name}\n")
        print(top_functions(lambda a=a: torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
