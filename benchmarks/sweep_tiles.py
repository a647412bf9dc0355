"""Sweep tile configurations of the symmetric-product kernel against cuBLAS on one GPU.

Times every configuration of ``syrk.CANDIDATES`` plus the exploratory ones below on the
products Gram NS actually runs (their shapes and operand layouts), each next to the plain
cuBLAS product of the same call, and prints one markdown table per case. This is how the
autotune candidate list is chosen: a configuration earns its place only where it wins.

    python benchmarks/sweep_tiles.py --out sweep.md                # all cases
    python benchmarks/sweep_tiles.py --cases syrk_wide --extra     # one case, exploratory too

"actual TFLOP/s" counts the FLOPs the kernel does (the lower super-tiles only, about half of
``2·m²·k``); "vs cuBLAS" is cuBLAS time / kernel time, both measured here with the autotuner's
own timing (``autotune.time_ms``: medians of ``triton.testing.do_bench``), so a sweep predicts
what the autotune will pick.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
from dmuon_compile.kernels.autotune import time_ms
from dmuon_compile.kernels.lower_tiles import TileConfig
from dmuon_compile.kernels.symmetric_product import launch_symmetric_product
from dmuon_compile.kernels.syrk import CANDIDATES, candidate_matches, symmetric_product_cublas
from dmuon_compile.kernels.syrk_tma import tma_descriptors

# Configurations tried besides the candidates (--extra): the plain strip walk, descriptor
# stores on square tiles and on strips.
EXPLORATORY = (
    TileConfig(128, 64, 8, 3, 1, block_n=256),  # strips through pointers: the plain strip walk
    TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True),
    TileConfig(128, 64, 4, 3, 2, tma=True, tma_store=True),
    TileConfig(64, 64, 4, 4, 2, tma=True, tma_store=True),
    # Strips with descriptor stores in two square halves (the one-piece 128×256 store does not
    # fit shared memory).
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True),
    TileConfig(128, 64, 8, 2, 1, block_n=256, tma=True, tma_store=True),
    # beta·C loaded by TMA into the accumulator's start instead of by pointers in the epilogue,
    # where the 128-row tiles spill registers (kernels/syrk_tma.py, C_PROLOGUE), or by TMA in
    # the epilogue, half a strip at a time (C_TMA).
    TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True, c_load="prologue"),
    TileConfig(128, 64, 4, 3, 2, tma=True, tma_store=True, c_load="prologue"),
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True, c_load="prologue"),
    TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True, c_load="tma"),
    TileConfig(128, 64, 4, 3, 2, tma=True, tma_store=True, c_load="tma"),
    TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True, c_load="tma"),
)


def _inputs(case: str, gen: torch.Generator):
    """(a, b, c, beta, description) of one case: the operands of a Gram NS product."""
    half = torch.float16

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).to(half)

    if case == "syrk_wide":  # R = X·Xᵀ of a 4096×14336 matrix
        return randn(4096, 14336, scale=14336**-0.25), None, None, 0.0, "syrk 4096×14336, row-major"
    if case == "syrk_tall":  # the transposed view of a 14336×4096 matrix
        return (
            randn(14336, 4096, scale=14336**-0.25).mT,
            None,
            None,
            0.0,
            "syrk 4096×14336, column-major",
        )
    if case == "syrk_huge":
        return randn(8192, 28672, scale=28672**-0.25), None, None, 0.0, "syrk 8192×28672, row-major"
    if case == "gram_4096":  # Z·RZ + a·RZ: symmetric row-major 4096² operands, with C
        r = randn(4096, 4096, scale=4096**-0.5)
        return r, randn(4096, 4096, scale=4096**-0.5), r, 0.5, "sym_mm 4096² (k=4096) + C"
    if case == "gram_4096_tune":  # what the autotuner times for that key (syrk._tuning_inputs)
        from dmuon_compile.kernels.syrk import _tuning_inputs

        r = randn(4096, 4096)
        a, b, c = _tuning_inputs(r, r, r)
        return a, b, c, 0.5, "sym_mm 4096² + C, the autotuner's inputs (b = aᵀ)"
    if case == "gram_4096_ns":  # RZ = R·Z + a·R with R, Z of a real Gram NS on 4096×14336
        from dmuon_compile import coefficients

        x = torch.randn(4096, 14336, generator=gen, device="cuda")
        x = (x / x.norm()).to(half)
        r = x @ x.mT
        a0, b0, c0 = coefficients.polar_express()[0]
        z = torch.addmm(r, r, r, beta=b0, alpha=c0)
        return r, z, r, a0, "sym_mm 4096² + C, operands of a real Gram NS (R·Z + a·R)"
    if case == "syrk_stack":  # 32 × (2048×5632), the batched model-M class
        return randn(32, 2048, 5632, scale=5632**-0.25), None, None, 0.0, "syrk 32×2048×5632"
    if case == "gram_stack":
        r = randn(32, 2048, 2048, scale=2048**-0.5)
        return r, randn(32, 2048, 2048, scale=2048**-0.5), r, 0.5, "sym_mm 32×2048² + C"
    # Model E's expert bucket (8 stacks of 64 experts, 768×2048 each) and a 1536-row stack
    if case == "syrk_expert768":
        return randn(512, 768, 2048, scale=2048**-0.25), None, None, 0.0, "syrk 512×768×2048"
    if case == "gram_expert768":
        r = randn(512, 768, 768, scale=768**-0.5)
        return r, randn(512, 768, 768, scale=768**-0.5), r, 0.5, "sym_mm 512×768² + C"
    if case == "syrk_expert1536":
        return randn(16, 1536, 4096, scale=4096**-0.25), None, None, 0.0, "syrk 16×1536×4096"
    if case == "gram_expert1536":
        r = randn(16, 1536, 1536, scale=1536**-0.5)
        return r, randn(16, 1536, 1536, scale=1536**-0.5), r, 0.5, "sym_mm 16×1536² + C"
    raise SystemExit(f"unknown case {case!r}")


CASES = (
    "syrk_wide",
    "syrk_tall",
    "syrk_huge",
    "gram_4096",
    "gram_4096_tune",
    "gram_4096_ns",
    "syrk_stack",
    "gram_stack",
    "syrk_expert768",
    "gram_expert768",
    "syrk_expert1536",
    "gram_expert1536",
)


def sweep_case(case: str, configs) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b, c, beta, what = _inputs(case, gen)
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    flops = 2.0 * batch * m * m * k
    reference = symmetric_product_cublas(a, b, c, 1.0, beta, 0.0, mirror=False)
    t_cublas = time_ms(lambda: symmetric_product_cublas(a, b, c, 1.0, beta, 0.0, mirror=False))
    rows = [
        f"### {what}",
        "",
        f"cuBLAS: {t_cublas:.3f} ms, {flops / t_cublas / 1e9:.0f} TFLOP/s",
        "",
        "| config | loads | ms | actual TFLOP/s | vs cuBLAS | matches |",
        "|---|---|---|---|---|---|",
    ]
    for config in configs:
        loads = "tma" if config.tma and tma_descriptors(a, b, config) is not None else "ptr"
        if config.tma and loads == "ptr":
            continue  # the same pointer kernel as a non-TMA config
        try:
            out = launch_symmetric_product(a, b, c, 1.0, beta, 0.0, config)
            ok = candidate_matches(out, reference)
            t = time_ms(
                lambda config=config: launch_symmetric_product(a, b, c, 1.0, beta, 0.0, config)
            )
            rows.append(
                f"| {config.name} | {loads} | {t:.3f} | {flops / 2 / t / 1e9:.0f} | "
                f"{t_cublas / t:.2f}× | {'yes' if ok else 'NO'} |"
            )
        except Exception as exc:  # a config that does not fit the GPU is a result too
            rows.append(
                f"| {config.name} | {loads} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |"
            )
        print(rows[-1], flush=True)
    del a, b, c, reference
    torch.cuda.empty_cache()
    return rows + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {CASES}")
    parser.add_argument(
        "--extra", action="store_true", help="also time the exploratory configurations"
    )
    parser.add_argument("--out", default=None, help="write the markdown tables here")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated substrings: time only configurations whose name has one (e.g. _st)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = list(CANDIDATES) + (
        [c for c in EXPLORATORY if c not in CANDIDATES] if args.extra else []
    )
    if args.only:
        configs = [c for c in configs if any(part in c.name for part in args.only.split(","))]
    lines = [
        f"## Tile sweep, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}",
        "",
    ]
    for case in args.cases.split(","):
        start = time.time()
        print(f"== {case}", flush=True)
        lines += sweep_case(case.strip(), configs)
        print(f"== {case} done in {time.time() - start:.0f} s", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
