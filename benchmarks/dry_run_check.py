"""The dry run's 1-GPU step predictions against measured steps (models S, M, G; E optional).

    python benchmarks/dry_run_check.py                  # GPU: measures the compiled step
    python benchmarks/dry_run_check.py --models S M G E --shapes --rates-out rates.json
    python benchmarks/dry_run_check.py --quick          # CPU: predictions, RESULTS.md numbers,
                                                        # and the measuring path on a tiny model

For each model, ``dmuon_compile.plan.dry_run(model, 1)`` predicts rank 0's Newton–Schulz ms and
step ms (all matrices on one GPU) from the rates in ``dmuon_compile/ns_rates.py``. On a GPU the
script then measures the compiled ``dmuon.Muon`` step over the same matrices (fp32 parameters,
random gradients: ``bench_step.py``'s ``make_params``/``build``/``timed_steps``) and prints one
markdown table with predicted / measured. On the CPU it prints the predictions next to the
``benchmarks/RESULTS.md`` numbers the rates were calibrated on (``ns_rates.STEP_MEASURED``).

``--shapes`` (GPU) also times eager NS on the shapes the rates come from (``ns_rates.MEASURED``
and ``CHECKS``); ``--rates-out`` writes those timings as a JSON file that
``python -m dmuon_compile.plan --rates`` and ``NSRates.load`` read (recalibration in one command).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
DEFAULT_MODELS = ("S", "M", "G")


def _sibling(name: str):
    """A module of this directory (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_dmuon_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def predict(model: str) -> dict:
    """The dry run of preset ``model`` on one GPU: rank 0's NS ms, step ms and matrices, and
    the Muon weights' shapes (dedicated matrices and expert stacks) it priced, in module order:
    what this script measures."""
    from dmuon_compile.plan import build_model, dry_run

    _, module = build_model(model)
    report = dry_run(module, 1)
    row = report.rows[0]
    shapes = [
        tuple(p.shape)
        for name, p in module.named_parameters()
        if name in report.owners or (p.ndim == 3 and name.rsplit(".", 2)[-2] == "experts")
    ]
    return {"ns_ms": row.ns_ms, "step_ms": row.step_ms, "matrices": row.matrices, "shapes": shapes}


def benchmark_shapes(model: str) -> list[tuple[int, ...]] | None:
    """The benchmark's own shapes (bench_step.py, else bench_fsdp.py via step_memory.py)."""
    step = _sibling("bench_step")
    if model in step.MODELS:
        return [tuple(s) for s in step.matrix_shapes(model)]
    try:
        return [tuple(s) for s in _sibling("step_memory").model_shapes(model)]
    except (ValueError, ImportError):
        return None


def measure_step(shapes, device, warmup: int, repeats: int, config: str) -> float:
    """Median ms of ``bench_step.py``'s ``config`` step over ``shapes`` (fp32, random grads)."""
    step = _sibling("bench_step")
    params = step.make_params(shapes, device)
    opt = step.build(config, params)
    step.first_step_s(opt, device)  # compile (and autotune) outside the timing
    for _ in range(warmup):
        opt.step()
    step.sync(device)
    ms = statistics.median(step.timed_steps(opt, device, repeats))
    del opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def measure_shapes(device, repeats: int = 10) -> list[list]:
    """Eager NS on the rates' shapes: ``[[m, n], batch, ms, source]`` rows (CUDA events)."""
    import dmuon_compile as dmuon
    from dmuon_compile import ns_rates

    ns = dmuon.NewtonSchulz()
    out = []
    for item in ns_rates.MEASURED + ns_rates.CHECKS + (ns_rates.SINGLE_2048,):
        shape, batch = item.shape, item.batch
        g = (
            torch.randn(batch, *shape, device=device)
            if batch > 1
            else torch.randn(*shape, device=device)
        )
        for _ in range(3):
            ns(g)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ns(g)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out.append([list(shape), batch, statistics.median(times), "dry_run_check.py --shapes"])
        print(f"NS {batch}×{shape}: {out[-1][2]:.3f} ms (RESULTS.md: {item.ms})", flush=True)
        del g
    return out


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| model | matrices | predicted NS ms | predicted step ms | measured step ms | "
        "predicted / measured | measured NS ms | predicted / measured NS | measured where |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['step_ms'] / r['measured_ms']:.3f}" if r.get("measured_ms") else "–"
        ns_ratio = f"{r['ns_ms'] / r['measured_ns_ms']:.3f}" if r.get("measured_ns_ms") else "–"
        measured = f"{r['measured_ms']:.2f}" if r.get("measured_ms") else "–"
        measured_ns = f"{r['measured_ns_ms']:.2f}" if r.get("measured_ns_ms") else "–"
        lines.append(
            f"| {r['model']} | {r['matrices']} | {r['ns_ms']:.2f} | {r['step_ms']:.2f} | "
            f"{measured} | {ratio} | {measured_ns} | {ns_ratio} | {r['source']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, help="presets (default: S M G)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few steps")
    ap.add_argument("--config", default="ours_compiled", help="bench_step.py configuration")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shapes", action="store_true", help="GPU: time eager NS per rates shape")
    ap.add_argument("--rates-out", help="write the --shapes timings as an NSRates JSON file")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    from dmuon_compile import ns_rates

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device; run without it for the CPU table")
    models = args.models or list(DEFAULT_MODELS)
    rows = []
    for model in models:
        row = {"model": model, **predict(model)}
        shapes = row.pop("shapes")
        bench = benchmark_shapes(model)
        if bench is not None and sorted(bench) != sorted(shapes):
            print(f"warning: preset {model}'s matrices differ from the benchmark's", flush=True)
        step_ms, ns_ms, source = ns_rates.STEP_MEASURED.get(model, (None, None, "–"))
        if device.type == "cuda":
            row["measured_ms"] = measure_step(
                shapes, device, args.warmup, args.repeats, args.config
            )
            row["source"] = f"this run ({args.config}); RESULTS.md: {step_ms or '–'} ms"
        else:
            row.update(measured_ms=step_ms, measured_ns_ms=ns_ms, source=source)
        rows.append(row)
        print(
            f"{model}: predicted {row['step_ms']:.2f} ms, measured {row['measured_ms']}", flush=True
        )
    if args.quick and device.type == "cpu":  # the measuring path itself, on a tiny model
        row = {"model": "tiny", **predict("tiny")}
        row["measured_ms"] = measure_step(row.pop("shapes"), device, 1, 2, "ours_eager")
        row["source"] = "this CPU (ours_eager; H200 rates: the ratio means nothing here)"
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    now = datetime.datetime.now(datetime.timezone.utc)
    header = (
        f"### Dry run vs measured 1-GPU step ({now:%Y-%m-%d %H:%M} UTC, {name}, torch "
        f"{torch.__version__})\n\nRates: {ns_rates.H200.device}. Command: "
        f"`python {' '.join(sys.argv)}`"
    )
    table = markdown(rows, header)
    if args.shapes:
        if device.type != "cuda":
            ap.error("--shapes times NS on a GPU")
        measured = measure_shapes(device)
        rates = ns_rates.NSRates.from_measurements(
            [m for m in measured if m[2] > ns_rates.H200.call_ms], call_ms=ns_rates.H200.call_ms
        )
        table += "\nRates from this run's shapes: " + json.dumps(rates.to_dict()["anchors"]) + "\n"
        if args.rates_out:
            with open(args.rates_out, "w", encoding="utf-8") as f:
                card = {  # the card's memory: the dry run checks each rank's peak against it
                    "device": name,
                    "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
                }
                out = {"measured": measured, "call_ms": ns_rates.H200.call_ms, **card}
                json.dump(out, f, indent=1)
    print()
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
