"""Where the first compiled Muon step's time goes: SYRK autotune, Triton compiles, Dynamo, Inductor.

    DMUON_CACHE_DIR=$T/d TRITON_CACHE_DIR=$T/t TORCHINDUCTOR_CACHE_DIR=$T/i \\
        python benchmarks/cold_compile.py --model S M --out cold.md     # cold: empty caches
    python benchmarks/cold_compile.py --model S                          # warm: caches kept
    python benchmarks/cold_compile.py --model S --cprofile 60            # + the top functions

One process per call (the caches are the environment's); the first ``Muon(compile=True).step()``
on each model's matrix set (``bench_step.py``'s shapes, fp32, random gradients) is timed
through the public API. The autotune is measured by wrapping ``kernels.autotune.tune``: per key
its wall time, and per candidate the first launch (Triton compile + run) against the timing
loop. Dynamo's and Inductor's phases come from ``torch._dynamo.utils.compile_times``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import make_params, matrix_shapes  # noqa: E402


class AutotuneMeter:
    """Wraps ``autotune.tune`` for the process: seconds per key and per candidate phase."""

    def __init__(self) -> None:
        from dmuon_compile.kernels import autotune

        self.keys: dict[str, float] = {}
        self.first_launch_s: dict[str, float] = defaultdict(float)  # config name -> compile+run
        self.timing_s = 0.0
        self._tune = autotune.tune
        autotune.tune = self._wrapped

    def _wrapped(self, key, candidates, run_candidate, run_cublas, matches):
        seen: set[str] = set()

        def timed_candidate(config):
            if config.name in seen:
                return run_candidate(config)
            seen.add(config.name)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run_candidate(config)
            torch.cuda.synchronize()
            self.first_launch_s[config.name] += time.perf_counter() - t0
            return out

        t0 = time.perf_counter()
        verdict = self._tune(key, candidates, timed_candidate, run_cublas, matches)
        self.keys[key] = time.perf_counter() - t0
        return verdict


def first_step(
    model: str, device: torch.device, meter: AutotuneMeter | None, cprofile: int = 0
) -> dict:
    import dmuon_compile as dmuon

    params = make_params(matrix_shapes(model), device)
    opt = dmuon.Muon(params, lr=0.02, compile=True)
    profiler = cProfile.Profile() if cprofile else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    opt.step()
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.disable()
    total = time.perf_counter() - t0
    if profiler is not None:  # cProfile slows Python-heavy phases: read shares, not seconds
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(cprofile)
        print(f"== cProfile of {model}'s first step (cumulative)\n{stream.getvalue()}")
    phases = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    row = {"model": model, "first_step_s": total, "phases": phases}
    if meter is not None:
        row["autotune_s"] = sum(meter.keys.values())
        row["keys"] = len(meter.keys)
        row["candidate_first_launch_s"] = sum(meter.first_launch_s.values())
        row["per_key"] = dict(meter.keys)
        meter.keys.clear()
        meter.first_launch_s.clear()
    torch._dynamo.reset()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["S", "M"], choices=["S", "M"])
    ap.add_argument("--out", default=None, help="append a markdown table here")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N top cProfile entries")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cold_compile.py measures GPU compiles: run it on a CUDA machine")
    device = torch.device("cuda")
    meter = AutotuneMeter()
    rows = [first_step(m, device, meter, args.cprofile) for m in args.model]
    lines = [
        f"caches: DMUON_CACHE_DIR={os.environ.get('DMUON_CACHE_DIR')} "
        f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')} "
        f"TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR')} "
        f"DMUON_SYRK_AUTOTUNE={os.environ.get('DMUON_SYRK_AUTOTUNE', '1')}",
        "",
        "| model | first step s | autotune s | keys tuned | candidates' first launches s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['first_step_s']:.1f} | {r.get('autotune_s', 0):.1f} | "
            f"{r.get('keys', 0)} | {r.get('candidate_first_launch_s', 0):.1f} |"
        )
    for r in rows:
        lines.append(
            f"\n{r['model']} per key (s): "
            + ", ".join(f"{k} {v:.1f}" for k, v in r.get("per_key", {}).items())
        )
        lines.append(f"{r['model']} Dynamo/Inductor phases (s):\n{r['phases']}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
