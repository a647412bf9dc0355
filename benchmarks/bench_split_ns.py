"""Split Newton–Schulz: one rank's compute share of a matrix split over p ranks, on one GPU.

    python benchmarks/bench_split_ns.py                       # 53248×16384 (405B's FFN), p 1 2 4 8
    python benchmarks/bench_split_ns.py --shape 28672 8192 --p 1 2 4 8

One rank of the group runs ``split_ns._blocked_ns`` on its piece with the collectives replaced
by local stand-ins of the same shapes (the all-reduce returns the rank's own Gram, the
all-gather tiles its own rows): the compute a rank does, without the communication, which a
one-GPU machine cannot measure (``split_flops`` gives its bytes: printed next to the times).
p = 1 is the one-rank path of the same code; ``ns(U)`` (the step's whole-matrix NS) is timed
beside it. Median of ``--repeats`` CUDA-event timings after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


class _LocalComm:
    """Collectives as local stand-ins of the same shapes (one rank's compute only)."""

    def __init__(self, p: int) -> None:
        self.p, self.ranks = p, [0]

    def all_reduce(self, parts):
        return parts[0]

    def all_gather_rows(self, parts, m: int):
        (part,) = parts
        return part.repeat(self.p, 1)[:m]


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(53248, 16384))
    ap.add_argument("--p", type=int, nargs="+", default=(1, 2, 4, 8))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from dmuon_compile.distributed import split_ns
    from dmuon_compile.newton_schulz import NewtonSchulz

    ns = NewtonSchulz()
    shape = tuple(args.shape)
    u = torch.randn(shape, device="cuda")
    whole = _time(lambda: ns(u), args.repeats)
    work = ns.work_dtype_for(u.device)
    print(
        f"| {shape[0]}×{shape[1]} | p | one rank's compute ms | whole-matrix ns(U) ms | "
        "speed-up | all-reduce MiB | all-gather MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in args.p:
        bounds = split_ns.split_bounds(shape, p)
        a, b = bounds[0]
        piece = u.narrow(split_ns.split_dim(shape), a, b - a)
        norm = split_ns._total_norm(split_ns._piece_sumsq(piece, work).reshape(1), work)
        x = split_ns._oriented(piece, shape, work, ns.eps, norm)
        ms = _time(
            lambda x=x, p=p: split_ns._blocked_ns([x], ns, _LocalComm(p), max(shape)), args.repeats
        )
        cost = split_ns.split_flops(shape, p, ns)
        print(
            f"| | {p} | {ms:.2f} | {whole:.2f} | {whole / ms:.2f}× | "
            f"{cost.all_reduce_bytes / 2**20:.0f} | {cost.all_gather_bytes / 2**20:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
