"""Newton–Schulz of an expert stack whole against the same stack in chunks of a few experts.

Model E's Gram-space products (768 rows) are memory-bound when each runs over the whole stack
of 64 experts (benchmarks/RESULTS.md §33): every product reads its operands from HBM. Run over
a few experts at a time, the chain's m×m operands (a few MB per expert) may still be in the
50 MB L2 when the next product reads them. This probe times, for each stack shape and chunk
size, ``NewtonSchulz(kernel="triton")`` called once per chunk (no copies between: each chunk's
result is its own tensor) against one call on the whole stack, after the autotune of each
chunk's shape, and the error of both against float64 on the same inputs:

    python benchmarks/ns_chunk_probe.py --shapes 64x768x2048,16x1536x4096 --chunks 64,32,16,8,4
    python benchmarks/ns_chunk_probe.py --size-gate 512,1,512,1   # small chunks on our kernels

Needs a CUDA GPU. A measurement, not a test: RESULTS.md records what a run found.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64x768x2048,16x1536x4096")
    ap.add_argument("--chunks", default="64,32,16,8,4", help="experts per call")
    ap.add_argument("--kernel", default="triton", help="NewtonSchulz(kernel=...)")
    ap.add_argument(
        "--size-gate",
        metavar="ROWS,BATCH[,LARGE_ROWS,LARGE_BATCH]",
        help="as bench_kernels.py's: let smaller chunks run the symmetric kernels (else a "
        "chunk below the gate runs cuBLAS), e.g. 512,1,512,1",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ns_chunk_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    if args.size_gate:
        from bench_kernels import set_size_gate

        set_size_gate(args.size_gate)

    from dmuon_compile import NewtonSchulz

    ns = NewtonSchulz(kernel=args.kernel)
    ref = NewtonSchulz(kernel="cublas", work_dtype=torch.float64)
    print(f"ours: {ns.describe()}")
    print("| stack | experts per call | calls | ms | vs whole | rel.err vs float64 |")
    print("|---|---|---|---|---|---|")
    for text in args.shapes.split(","):
        shape = _shape(text)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        exact = ref(x.double()).float()
        whole_ms = None
        for k in [int(c) for c in args.chunks.split(",")]:
            k = min(k, shape[0])
            pieces = list(x.split(k))

            def run(pieces=pieces):
                return [ns(p) for p in pieces]

            out = torch.cat(run()).float()  # also the autotune of this chunk's shape
            err = ((out - exact).norm() / exact.norm()).item()
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            whole_ms = ms if whole_ms is None else whole_ms
            print(
                f"| {text} | {k} | {len(pieces)} | {ms:.3f} | {whole_ms / ms:.2f}× | {err:.2e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
