"""Eager NS per call: torch.optim.Muon's NS, ours, and ours replayed from a per-shape CUDA graph.

    python benchmarks/ns_graph_probe.py

Measures what a CUDA-graph replay inside eager ``NewtonSchulz`` would give at the small and
medium shapes where eager NS is host-bound (per-call median, ``triton.testing.do_bench``: host
launch cost included). The replay copies the input into the graph's static buffer and clones
the static output (what a public call returning a fresh tensor must do).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import baseline_ns, bench_ms  # noqa: E402

SHAPES = [(1024, 4096), (2048, 5632), (4096, 4096), (4096, 14336), (8, 2048, 5632)]


def graphed(ns, example: torch.Tensor):
    static_in = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: autotune and Triton compiles happen outside the capture
            ns(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ns(static_in)

    def run(g):
        static_in.copy_(g)
        graph.replay()
        return static_out.clone()

    return run


def main() -> int:
    import dmuon_compile as dmuon

    ns = dmuon.NewtonSchulz()
    print(
        "| shape | torch.optim.Muon NS ms | ours eager ms | ours graphed ms | x torch eager "
        "| x torch graphed | max abs diff graphed vs eager |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        g = torch.randn(shape, device="cuda")
        run = graphed(ns, g)
        diff = float((run(g).float() - ns(g).float()).abs().max())
        t_base = bench_ms(lambda: baseline_ns(g))
        t_ours = bench_ms(lambda: ns(g))
        t_graph = bench_ms(lambda: run(g))
        print(
            f"| {'×'.join(map(str, shape))} | {t_base:.3f} | {t_ours:.3f} | {t_graph:.3f} | "
            f"{t_base / t_ours:.2f} | {t_base / t_graph:.2f} | {diff:.2e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
