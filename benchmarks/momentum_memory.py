"""The momentum's storage settings side by side: GPU memory between steps, the step's peak, host
memory and step time (``Muon(momentum_dtype=..., offload=...)``).

    python benchmarks/momentum_memory.py                         # L70, M, E on CUDA, compiled
    python benchmarks/momentum_memory.py --models M --settings fp32 offload
    python benchmarks/momentum_memory.py --models L70 --settings fp32 offload int8 \
        --in-flight 2 1 all --stack-bytes 1073741824             # streamed vs all at once
    python benchmarks/momentum_memory.py --device cpu --models S --eager   # smoke

The matrices are step_memory.py's (``model_shapes``: bench_step.py's models and ``L70``, one
shape bucket of a Llama-3 70B layer stack; fp32 parameters, random gradients, E's expert stacks
per expert). Per setting, on its own copy of the parameters, after ``--warmup`` steps (compile
included):

- ``resident``: ``torch.cuda.memory_allocated()`` after a step (device synchronised) minus the
  parameters and gradients: the momentum (and the step's small constants) the GPU keeps
  between steps, where the forward and backward run;
- ``step peak``: ``max_memory_allocated()`` during one ``step()`` minus the parameters and
  gradients: the momentum, its working buffers and the step's own working set;
- ``in flight`` (8-bit and offload: ``Muon(momentum_in_flight=...)``, ``--in-flight``, one row
  each): the shape buckets whose working momentum the step holds at once, ``all`` for every
  matrix's (the step before streaming); ``working``: the most bytes of working momentum alive
  at once in the measured step (``MomentumStorage.peak_working_bytes``, also on a CPU);
  ``--stack-bytes``: ``NewtonSchulz(stack_bytes=...)``, the buckets' size;
- ``host``: the bytes of the stored state in host memory (pinned);
- ``step ms``: median wall time of ``--repeats`` steps, the device synchronised after each
  (the write-back on the side stream included); ``step ms, compute``: the same up to an event on
  the step's own stream (the write-back left to overlap what follows).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
SETTINGS = {
    "fp32": {},
    "bf16": {"momentum_dtype": torch.bfloat16},
    "int8": {"momentum_dtype": torch.int8},
    "offload": {"offload": "momentum"},
    "int8+offload": {"momentum_dtype": torch.int8, "offload": "momentum"},
}
GiB = 1 << 30


def _step_memory():
    spec = importlib.util.spec_from_file_location(
        "_dmuon_bench_step_memory", _HERE / "step_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _host_bytes(opt) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.device.type == "cpu"
    )


def _time(opt, device, repeats: int, whole: bool) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            if whole:
                torch.cuda.synchronize(device)
            else:
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _stored(setting: str) -> bool:
    return setting in ("int8", "offload", "int8+offload")


def run(
    model: str,
    setting: str,
    device: torch.device,
    compile: bool,
    warmup: int,
    repeats: int,
    in_flight: int | None = 2,
    stack_bytes: int | None = None,
):
    import dmuon_compile as dmuon

    sm = _step_memory()
    params = sm.make_params(sm.model_shapes(model), device)
    base = sum(2 * p.numel() * p.element_size() for p in params)  # weights + gradients
    ns = (
        dmuon.NewtonSchulz() if stack_bytes is None else dmuon.NewtonSchulz(stack_bytes=stack_bytes)
    )
    opt = dmuon.Muon(
        params,
        lr=0.02,
        compile=compile,
        ns_backend=ns,
        momentum_in_flight=in_flight,
        **SETTINGS[setting],
    )
    for _ in range(warmup):
        opt.step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        opt.step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before + resident
    else:
        resident = peak = 0
    if not cuda:
        opt.step()  # the measured step, for the working-momentum counter
    row = {
        "model": model,
        "setting": setting,
        "in_flight": (in_flight or "all") if _stored(setting) else "—",
        "working_gib": opt._storage.peak_working_bytes / GiB,
        "resident_gib": resident / GiB,
        "peak_gib": peak / GiB,
        "host_gib": _host_bytes(opt) / GiB,
        "step_ms": _time(opt, device, repeats, whole=True),
        "step_ms_compute": _time(opt, device, repeats, whole=False),
    }
    del opt, params
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    out = [
        "| model | setting | in flight | resident GiB | working GiB | step peak GiB | host GiB "
        "| step ms | step ms, compute | vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["model"]: r for r in rows if r["setting"] == "fp32"}
    for r in rows:
        ref = base.get(r["model"])
        ratio = f"{r['step_ms'] / ref['step_ms']:.2f}×" if ref else "—"
        out.append(
            f"| {r['model']} | {r['setting']} | {r['in_flight']} | {r['resident_gib']:.2f} | "
            f"{r['working_gib']:.2f} | {r['peak_gib']:.2f} | {r['host_gib']:.2f} | "
            f"{r['step_ms']:.2f} | {r['step_ms_compute']:.2f} | {ratio} |"
        )
    return "\n".join(out)


def _in_flight(value: str) -> int | None:
    if value == "all":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a positive number of buckets, or 'all'")
    return number


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=["L70", "M", "E"])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--eager", action="store_true", help="compile=False")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--in-flight",
        nargs="+",
        type=_in_flight,
        default=[2],
        help="Muon(momentum_in_flight=...) of the 8-bit and offload rows, one row each: a "
        "number of shape buckets, or 'all' (every matrix's working momentum at once)",
    )
    ap.add_argument(
        "--stack-bytes", type=int, default=None, help="NewtonSchulz(stack_bytes=...): 4 GiB"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for model in args.models:
        for setting in args.settings:
            for in_flight in args.in_flight if _stored(setting) else [2]:
                row = run(
                    model,
                    setting,
                    device,
                    not args.eager,
                    args.warmup,
                    args.repeats,
                    in_flight,
                    args.stack_bytes,
                )
                print(row, flush=True)
                rows.append(row)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
