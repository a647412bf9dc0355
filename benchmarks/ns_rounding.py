"""Gram NS's rounding on the CPU: the package's chain with every product rounded as the GPU
kernels round it, against float64, for two ways of writing a step.

The symmetric kernels accumulate in fp32, add their epilogue (β·C, γ·I) in fp32 and round once
to fp16 on store; cuBLAS's rectangular products round once too. ``HalfRounding`` below does
exactly that on the CPU (the custom ops' torch references on fp16 operands), so the package's
own ``newton_schulz.gram_ns`` runs here with the GPU's rounding points. Two forms of a step
(coefficients a, b, c; R the Gram matrix):

- ``c_terms`` (the package's): Z = b·R + c·R²; Q ← Q·Z + a·Q; RZ = R·Z + a·R;
  R ← Z·RZ + a·RZ. a·I never meets a rounding, at the cost of a C term on every product.
- ``w`` (tried, not shipped): W = a·I + b·R + c·R²; Q ← Q·W; RW = R·W; R ← W·RW. a·I is
  rounded into W once; three of a step's four products have no C term (faster kernels), but
  the error on decaying spectra grows (benchmarks/RESULTS.md §15).

Inputs: Gaussian (the error gate's inputs on the GPU), a spectrum decaying over four decades,
and rank 8 plus noise. Prints the largest relative Frobenius error over ``--trials`` per case:

    python benchmarks/ns_rounding.py            # 256×704, 512×1792, 384×1152; ~1 min
    python benchmarks/ns_rounding.py --sizes 64x176 --trials 1

``--square`` asks whether square matrices could join the Gram stacks of their row size: on
m×m inputs it compares the package's square path (direct NS, fp16, kernel rounding) with Gram
NS (fp16, C-term form) and direct NS in bf16, each against float64:

    python benchmarks/ns_rounding.py --square --sizes 256 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmuon_compile.kernels.ops import (  # noqa: E402
    sym_mm_reference,
    symmetric_epilogue,
    syrk_reference,
)

from dmuon_compile.coefficients import polar_express  # noqa: E402
from dmuon_compile.newton_schulz import direct_ns, gram_ns  # noqa: E402

HALF = torch.float16


class HalfRounding:
    """NS primitives that round each product once to the operands' half dtype (fp16, or bf16)
    from an fp32 accumulate: the symmetric products are the custom ops' own torch references
    (``kernels/ops.py``: fp32 product and epilogue, lower triangle mirrored, one cast), the
    rectangular Q·X a float32 matmul rounded once, as cuBLAS does."""

    @staticmethod
    def gram(x):
        return syrk_reference(x, None, 1.0, 0.0, 0.0)

    @staticmethod
    def sym_addmm(c, a, b, beta, alpha, gamma=0.0):
        return sym_mm_reference(a, b, c, alpha, beta, gamma)

    @staticmethod
    def sym_mm(a, b):
        return sym_mm_reference(a, b, None, 1.0, 0.0, 0.0)

    @staticmethod
    def add_identity(a, gamma):
        return symmetric_epilogue(a.float(), None, 1.0, 0.0, gamma, a.dtype)

    @staticmethod
    def apply_left(c, q, x, beta):
        acc = q.float() @ x.float()
        if beta != 0.0:
            acc = acc + beta * c.float()
        return acc.to(q.dtype)


def gram_ns_w_form(x, table, restarts=(2,), ops=HalfRounding):
    """The W form of a Gram NS step (module docstring), for comparison only."""
    r, q, steps = ops.gram(x), None, len(table)
    for i, (a, b, c) in enumerate(table):
        if i in restarts and q is not None:
            x = ops.apply_left(x, q, x, beta=0.0)
            r, q = ops.gram(x), None
        w = ops.sym_addmm(r, r, r, beta=b, alpha=c, gamma=a)
        q = w if q is None else ops.sym_mm(q, w)
        if not (i + 1 == steps or (i + 1) in restarts):
            rw = ops.sym_mm(r, w)
            r = ops.sym_mm(w, rw)
    return ops.apply_left(x, q, x, beta=0.0)


def reference(x: torch.Tensor, table) -> torch.Tensor:
    """The same polynomial iteration in float64, directly on X."""
    x = x.double()
    for a, b, c in table:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def make_input(kind: str, m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    g = torch.randn(m, n, dtype=torch.float64, generator=gen)
    if kind == "decay":
        u, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=gen))
        v, _ = torch.linalg.qr(torch.randn(n, m, dtype=torch.float64, generator=gen))
        g = (u * torch.logspace(0, -4, m, dtype=torch.float64)) @ v.mT
    elif kind == "low_rank":
        low = torch.randn(m, 8, dtype=torch.float64, generator=gen)
        g = low @ torch.randn(8, n, dtype=torch.float64, generator=gen) + 1e-3 * g
    return g / (g.norm() + 1e-7)


def errors(m: int, n: int, kind: str, trials: int, seed: int = 0) -> dict[str, float]:
    """Largest relative Frobenius error vs float64 of each form over ``trials`` inputs."""
    table = polar_express(5)
    gen = torch.Generator().manual_seed(seed)
    worst = {"w": 0.0, "c_terms": 0.0}
    for _ in range(trials):
        x = make_input(kind, m, n, gen)
        ref = reference(x, table)
        x16 = x.to(HALF)
        outs = {
            "w": gram_ns_w_form(x16, table),
            "c_terms": gram_ns(x16, table, (2,), HalfRounding),
        }
        for name, out in outs.items():
            err = float((out.double() - ref).norm() / ref.norm())
            worst[name] = max(worst[name], err)
    return worst


def error_by_band(m: int, n: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """On one decaying-spectrum input: per band of σ/σ_max, each form's relative error on the
    output's part along those left singular directions ``(band, W, C-term)``."""
    table = polar_express(5)
    x = make_input("decay", m, n, torch.Generator().manual_seed(seed))
    ref = reference(x, table)
    u, sv, _ = torch.linalg.svd(x, full_matrices=False)
    outs = (gram_ns_w_form(x.to(HALF), table), gram_ns(x.to(HALF), table, (2,), HalfRounding))
    rel = sv / sv[0]
    rows = []
    for lo, hi in ((1e-1, 2.0), (1e-2, 1e-1), (1e-3, 1e-2), (0.0, 1e-3)):
        basis = u[:, (rel >= lo) & (rel < hi)]
        part = (basis.mT @ ref).norm()
        w, c = (float((basis.mT @ (o.double() - ref)).norm() / part) for o in outs)
        rows.append((f"[{lo:g}, {min(hi, 1.0):g}]", w, c))
    return rows


def square_errors(m: int, kind: str, trials: int) -> dict[str, float]:
    """Largest relative error vs float64 on m×m inputs of each way to orthogonalise them."""
    table = polar_express(5)
    gen = torch.Generator().manual_seed(m)
    worst = {"direct_fp16": 0.0, "gram_fp16": 0.0, "direct_bf16": 0.0}
    for _ in range(trials):
        x = make_input(kind, m, m, gen)
        ref = reference(x, table)
        outs = {
            "direct_fp16": direct_ns(x.to(HALF), table, HalfRounding),
            "gram_fp16": gram_ns(x.to(HALF), table, (2,), HalfRounding),
            "direct_bf16": direct_ns(x.to(torch.bfloat16), table, HalfRounding),
        }
        for name, out in outs.items():
            worst[name] = max(worst[name], float((out.double() - ref).norm() / ref.norm()))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["256x704", "512x1792", "384x1152"])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--square", action="store_true", help="square inputs: direct vs Gram NS")
    args = ap.parse_args(argv)
    if args.square:
        print(
            "| m×m | input | direct fp16 (package) | Gram fp16 | direct bf16 | Gram / direct fp16 |"
            "\n|---|---|---|---|---|---|"
        )
        for size in args.sizes:
            m = int(size.split("x")[0])
            for kind in ("gaussian", "decay", "low_rank"):
                e = square_errors(m, kind, args.trials)
                ratio = e["gram_fp16"] / e["direct_fp16"]
                print(
                    f"| {m}×{m} | {kind} | {e['direct_fp16']:.3e} | {e['gram_fp16']:.3e} "
                    f"| {e['direct_bf16']:.3e} | {ratio:.1f} |"
                )
        return 0
    print("| m×n | input | W form | C-term form (package) | W / C-term |\n|---|---|---|---|---|")
    for size in args.sizes:
        m, n = (int(v) for v in size.split("x"))
        for kind in ("gaussian", "decay", "low_rank"):
            e = errors(m, n, kind, args.trials)
            ratio = e["w"] / e["c_terms"]
            print(f"| {m}×{n} | {kind} | {e['w']:.3e} | {e['c_terms']:.3e} | {ratio:.2f} |")
    m, n = (int(v) for v in args.sizes[0].split("x"))
    print(f"\nDecaying spectrum, {m}×{n}: error along the input's singular directions by σ/σ_max")
    print("| σ/σ_max | W form | C-term form (package) |\n|---|---|---|")
    for band, w, c in error_by_band(m, n):
        print(f"| {band} | {w:.2e} | {c:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
