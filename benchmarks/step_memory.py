"""benchmarks/README.md §B1m: peak memory of the optimizer step against the owned state.

    python benchmarks/step_memory.py                       # S, M, G: CUDA, eager and compiled
    python benchmarks/step_memory.py --model S --out /tmp/step_memory.md
    python benchmarks/step_memory.py --device cpu          # tiny model, CPU, eager only

The matrices are bench_step.py's (``matrix_shapes``: fp32 parameters, random gradients); a model
that only ``bench_fsdp.py`` defines (G: grouped-query k/v; its projection weights, read off the
model built on the meta device) is accepted too. Each configuration runs on its own copy of the
parameters:

- ``ours_eager``: ``dmuon.Muon(compile=False)``: the first half of the step
  (``functional.muon_directions``) bucket by bucket, keeping only the Newton–Schulz outputs
  (the directions) for the commit;
- ``eager_all_at_once``: the same optimizer with every matrix's Nesterov input computed before
  the first bucket's Newton–Schulz (the control: every ``u`` alive at once, next to the
  directions);
- ``ours_compiled``: ``dmuon.Muon(compile=True)`` (CUDA, or ``--configs`` on CPU: slow);
- ``eager_unbounded`` / ``compiled_unbounded``: the same with no stack budget
  (``NewtonSchulz(stack_bytes=2**62)``: each shape bucket one batched call, the schedule before
  the budget) — the control for the budget's memory and its speed.

``L70`` is one shape bucket of a Llama-3 70B layer stack: 12 FFN matrices of 28672×8192 (fp32,
11 GiB of NS input: past the 4 GiB default budget, so the bucket runs as three stacks).

Per configuration, after ``--warmup`` steps (the compile included): the step's peak extra memory,
``torch.cuda.max_memory_allocated()`` during one ``step()`` minus the allocated bytes before it
(on the CPU: the peak of the CPU allocator's live bytes from ``torch.profiler`` allocation
events), against the owned state (parameter + momentum bytes), against the directions' bytes
(every matrix in Newton–Schulz's work dtype: kept from the first half to the commit) and, what
remains above the directions, against the largest shape bucket's fp32 bytes (one bucket's
working set is the rest of the bound).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
CONFIGS = (
    "ours_eager",
    "eager_all_at_once",
    "ours_compiled",
    "eager_unbounded",
    "compiled_unbounded",
)
EXTRA_MODELS = {"L70": [(28672, 8192)] * 12}  # one 70B shape bucket (see the docstring)
UNBOUNDED = 2**62
LR = 0.02


def _sibling(name: str):
    """A module of this directory (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_dmuon_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_models() -> list[str]:
    models = set(_sibling("bench_step").MODELS) | set(EXTRA_MODELS)
    try:
        models |= set(_sibling("bench_fsdp").MODELS)
    except Exception:  # noqa: BLE001 - bench_fsdp needs nothing beyond the package; be lenient
        pass
    return sorted(models)


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """The 2-D weight shapes of model ``name``: bench_step.py's ``matrix_shapes``, else the
    projection weights of bench_fsdp.py's model built on the meta device."""
    if name in EXTRA_MODELS:
        return list(EXTRA_MODELS[name])
    step = _sibling("bench_step")
    if name in step.MODELS:
        return [tuple(s) for s in step.matrix_shapes(name)]
    fsdp = _sibling("bench_fsdp")
    if name not in fsdp.MODELS:
        raise ValueError(f"model {name!r}: neither bench_step.py nor bench_fsdp.py defines it")
    if hasattr(fsdp, "matrix_shapes"):
        return [tuple(s) for s in fsdp.matrix_shapes(name)]
    with torch.device("meta"):
        kv_groups = getattr(fsdp, "KV_GROUPS", {}).get(name, 1)
        model = fsdp.Stack(*fsdp.MODELS[name], fsdp.HEAD_DIM, kv_groups)
    return [tuple(p.shape) for n, p in model.named_parameters() if fsdp.is_proj(n, p)]


def make_params(shapes, device, seed: int = 0) -> list[torch.nn.Parameter]:
    import dmuon_compile as dmuon

    g = torch.Generator(device="cpu").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).mul_(0.02).to(device))
        p.grad = torch.randn(shape, generator=g).to(device)
        if p.ndim == 3:  # bench_step's expert stacks (model E): per-expert Newton–Schulz
            dmuon.set_layout(p, dmuon.Layout.experts())
        params.append(p)
    return params


@contextmanager
def all_at_once_schedule():
    """The control: ``muon_directions`` with every Nesterov input computed before the first
    bucket's Newton–Schulz (``orthogonalize`` of the whole list), the schedule the bucketed
    step replaces. Same math, same directions kept."""
    from dmuon_compile import functional as F

    bucketed = F.muon_directions

    def all_at_once(grads, bufs, *, momentum, nesterov, ns, layouts=None):
        updates = F.nesterov_input(grads, bufs, F.hyper(momentum), nesterov)
        return F.orthogonalize(updates, ns, layouts=layouts)

    F.muon_directions = all_at_once
    try:
        yield
    finally:
        F.muon_directions = bucketed


def peak_extra_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the CPU allocator's allocation and free
    events as ``torch.profiler(profile_memory=True)`` records them, summed in time order."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def largest_bucket_fp32_bytes(shapes) -> int:
    by_shape: dict[tuple, int] = {}
    for s in shapes:
        by_shape[tuple(s)] = by_shape.get(tuple(s), 0) + 4 * torch.Size(s).numel()
    return max(by_shape.values())


def run_config(config: str, model: str, device: torch.device, warmup: int) -> dict:
    import dmuon_compile as dmuon

    shapes = model_shapes(model)
    params = make_params(shapes, device)
    budget = {"stack_bytes": UNBOUNDED} if config.endswith("_unbounded") else {}
    ns = dmuon.NewtonSchulz(**budget)
    compiled = config in ("ours_compiled", "compiled_unbounded")
    opt = dmuon.Muon(params, lr=LR, compile=compiled, ns_backend=ns)
    schedule = all_at_once_schedule() if config == "eager_all_at_once" else _nothing()
    with schedule:
        for _ in range(warmup):
            opt.step()
        peak = peak_extra_bytes(opt.step, device)
        step_ms = _step_ms(opt, device)
    owned = sum(p.numel() * p.element_size() for p in params)
    owned += sum(s["momentum_buffer"].numel() * 4 for s in opt.state.values())
    work = torch.empty((), dtype=opt.ns.work_dtype_for(device)).element_size()
    row = {
        "model": model,
        "config": config,
        "matrices": len(shapes),
        "buckets": len(set(shapes)),
        "owned_bytes": owned,
        "bucket_bytes": largest_bucket_fp32_bytes(shapes),
        "directions_bytes": sum(p.numel() for p in params) * work,
        "peak_bytes": peak,
        "step_ms": step_ms,
        "stack_bytes": ns.stack_bytes,
    }
    del opt, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _step_ms(opt, device: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``repeats`` steps (CUDA: synchronised around each)."""
    import time

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@contextmanager
def _nothing():
    yield


def markdown(rows: list[dict], header: str) -> str:
    mib = 2.0**20
    lines = [
        header,
        "",
        "| model | configuration | matrices | buckets | owned state MiB | largest bucket fp32 "
        "MiB | directions MiB | step peak extra MiB | peak / owned | (peak − directions) / "
        "largest bucket | stack budget | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['matrices']} | {r['buckets']} | "
            f"{r['owned_bytes'] / mib:.1f} | {r['bucket_bytes'] / mib:.1f} | "
            f"{r['directions_bytes'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | "
            f"{r['peak_bytes'] / r['owned_bytes']:.2f} | "
            f"{(r['peak_bytes'] - r['directions_bytes']) / r['bucket_bytes']:.2f} | "
            f"{_budget(r['stack_bytes'])} | {r['step_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _budget(nbytes: int) -> str:
    return "none" if nbytes >= UNBOUNDED else f"{nbytes / 2**30:g} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--model", nargs="+", default=None, help="default: S M G L70 on CUDA, tiny on CPU"
    )
    ap.add_argument("--configs", nargs="+", default=None, choices=CONFIGS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device; pass --device cpu for a smoke run")
    known = known_models()
    if args.model is None:
        on_gpu = [m for m in ("S", "M", "G", "L70") if m in known]
        models = ["tiny"] if device.type == "cpu" else on_gpu
    else:
        models = args.model
    for m in models:
        if m not in known:
            ap.error(f"--model {m}: choose from {known}")
    configs = list(args.configs or CONFIGS)
    if args.configs is None and device.type == "cpu":
        for slow in ("ours_compiled", "compiled_unbounded"):  # CPU Inductor: minutes; ask
            configs.remove(slow)
    rows = []
    for model in models:
        for config in configs:
            row = run_config(config, model, device, args.warmup)
            rows.append(row)
            print(
                f"{model:5s} {config:18s} peak extra {row['peak_bytes'] / 2**20:9.1f} MiB = "
                f"{row['peak_bytes'] / row['owned_bytes']:.2f} x owned, directions + "
                f"{(row['peak_bytes'] - row['directions_bytes']) / row['bucket_bytes']:.2f} x "
                f"largest bucket, step {row['step_ms']:.2f} ms "
                f"(budget {_budget(row['stack_bytes'])})",
                flush=True,
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"### B1m: optimizer step peak memory "
        f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {name}, "
        f"torch {torch.__version__})\n\nCommand: `python {' '.join(sys.argv)}`; "
        f"warmup {args.warmup}."
    )
    table = markdown(rows, header)
    print()
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
