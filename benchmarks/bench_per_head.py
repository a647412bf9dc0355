"""Per-head Newton–Schulz against whole-matrix Newton–Schulz: the optimizer step of a
Llama-3-8B- and a DeepSeek-V3-shaped set of attention weights (one GPU; docs/recipes.md).

    python benchmarks/bench_per_head.py                                  # both sets, compiled
    python benchmarks/bench_per_head.py --configs whole_compiled per_head_compiled \\
        whole_eager per_head_eager --out /tmp/per_head.md                # + eager
    python benchmarks/bench_per_head.py --sets dsv3 --layers 4           # 4 MLA layers
    python benchmarks/bench_per_head.py --smoke                          # tiny dims, CPU, eager

Weight sets (fp32 parameters, random normal gradients, ``nn.Linear`` weights ``(out, in)``):

- ``llama3``: Llama-3-8B attention, ``--layers`` layers (default 4): per layer ``wq`` (4096×4096:
  32 heads of 128), ``wk``, ``wv`` (1024×4096: 8 kv heads of 128), ``wo`` (4096×4096, heads along
  its columns). Per head: 80 matrices a layer; whole: 4.
- ``dsv3``: DeepSeek-V3 multi-head latent attention (dim 7168, 128 heads, q_lora_rank 1536,
  kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128), ``--layers`` layers (default 2):
  ``wq_a`` (1536×7168) and ``wkv_a`` (576×7168) whole, ``wq_b`` (128·192×1536) per head,
  ``wkv_b`` (128·256×512) per head and per k/v part, ``wo`` (7168×128·128) per head's columns.
  Per head: 514 matrices a layer; whole: 5.

The per-head layouts are those ``dmuon.set_head_layouts`` sets on torchtitan-named modules of
these shapes (built on the meta device, then checked against the hand-written presets of
docs/recipes.md); ``whole`` leaves every weight one matrix. Configurations, each on its own
copy of the same values: ``whole_compiled``, ``per_head_compiled`` (``dmuon.Muon(params,
compile=True)``), and ``whole_eager``, ``per_head_eager`` (``compile=False``).

Per configuration: the matrices Newton–Schulz orthogonalises; the first step's wall time
(trace + compile + autotune + run; with ``--fresh-cache``, default on, each configuration gets
an empty Inductor cache, so every first compiled step is cold); the median and min step time
over ``--repeats`` steps after ``--warmup`` more, wall clock with the device synchronised
before and after each step; the peak of ``torch.cuda.max_memory_allocated`` over the run (CUDA);
and per_head / whole for the same set and mode (compiled or eager).

Memory (DeepSeek-V3 at real dims): 187.1 M values a layer, so fp32 weights, gradients and
momentum take 2.09 GiB a layer; the step's working set (bf16 copies of the stacked matrices,
Gram matrices up to 7168² for the whole ``wo``, the fp32 update) adds ~1.4 GiB. Measured peak
on an H100 (compiled, whole / per head): 6.9 / 5.8 GiB at 2 layers, 28.5 / 26.6 GiB at 8, so
~3.6 GiB a layer: 78 GiB holds ~20 layers. Llama-3-8B: 4 layers peak at 5.2 GiB.

The first step includes the SYRK autotune of shapes not yet seen by this process (verdicts
persist in ``DMUON_CACHE_DIR`` when it is set): the configuration that runs first pays for the
shapes it shares with the others (DeepSeek-V3's whole ``wq_a`` and ``wkv_a``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

LR = 0.02
CONFIGS = ("whole_compiled", "per_head_compiled", "whole_eager", "per_head_eager")
SETS = ("llama3", "dsv3")
DEFAULT_LAYERS = {"llama3": 4, "dsv3": 2}
# Real dims, and the --smoke dims (same structure, tiny; CPU).
DIMS = {
    "llama3": dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128),
    "dsv3": dict(
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}
SMOKE_DIMS = {
    "llama3": dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16),
    "dsv3": dict(
        dim=96,
        n_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    ),
}
GiB = 1 << 30


class Attention(nn.Module):
    """torchtitan's Llama attention projections (its ``Attention``: wq, wk, wv, wo)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)


class MLA(nn.Module):
    """torchtitan's DeepSeek-V3 ``MLA`` projections (q_lora_rank > 0; its RMSNorms are not
    Muon weights and are left out)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)


class Layer(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention


def skeleton(weight_set: str, layers: int, smoke: bool) -> nn.Module:
    """The set's modules on the meta device (shapes and names only, no memory)."""
    dims = (SMOKE_DIMS if smoke else DIMS)[weight_set]
    cls = Attention if weight_set == "llama3" else MLA
    with torch.device("meta"):
        return nn.ModuleList(Layer(cls(**dims)) for _ in range(layers))


def expected_layouts(weight_set: str, model: nn.Module, smoke: bool) -> dict:
    """The per-head layouts of docs/recipes.md, written out by hand."""
    from dmuon_compile import Layout

    d = (SMOKE_DIMS if smoke else DIMS)[weight_set]
    if weight_set == "llama3":
        h = d["head_dim"]
        per = {"wq": Layout.heads(h), "wk": Layout.heads(h), "wv": Layout.heads(h)}
        per["wo"] = Layout.heads(h, dim=1)
    else:
        per = {
            "wq_b": Layout.heads(d["qk_nope_head_dim"] + d["qk_rope_head_dim"]),
            "wkv_b": Layout.heads(d["qk_nope_head_dim"]),  # k_nope and v of one size (128)
            "wo": Layout.heads(d["v_head_dim"], dim=1),
        }
    return {
        name: per[name.split(".")[-2]]
        for name, _ in model.named_parameters()
        if name.split(".")[-2] in per
    }


def head_layouts(weight_set: str, layers: int, smoke: bool) -> tuple[nn.Module, dict]:
    """The skeleton and ``dmuon.set_head_layouts``'s layouts for it, by parameter name;
    raises if they are not the hand-written presets."""
    import dmuon_compile as dmuon

    model = skeleton(weight_set, layers, smoke)
    layouts = dmuon.set_head_layouts(model)
    expected = expected_layouts(weight_set, model, smoke)
    if layouts != expected:
        raise AssertionError(
            f"{weight_set}: set_head_layouts gave {layouts}, the recipes say {expected}"
        )
    return model, layouts


def make_params(weight_set: str, layers: int, smoke: bool, per_head: bool, device, seed=0):
    """fp32 parameters of the set's shapes with random gradients (the same values for every
    configuration: one seed); ``per_head``: with the set's per-head layouts."""
    import dmuon_compile as dmuon

    model, layouts = head_layouts(weight_set, layers, smoke)
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for name, meta in model.named_parameters():
        p = nn.Parameter(torch.randn(meta.shape, device=device, generator=g).mul_(0.02))
        p.grad = torch.randn(meta.shape, device=device, generator=g)
        if per_head and name in layouts:
            dmuon.set_layout(p, layouts[name])
        params.append(p)
    return params


def matrices(params) -> int:
    """How many matrices Newton–Schulz orthogonalises per step."""
    import dmuon_compile as dmuon

    return sum((dmuon.get_layout(p) or dmuon.Layout.matrix()).count(p.shape) for p in params)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(opt, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def fresh_inductor_cache(enabled: bool):
    """An empty Inductor cache dir (and Dynamo reset) for one configuration."""
    torch._dynamo.reset()
    if not enabled:
        yield
        return
    from torch._inductor.utils import clear_caches

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dmuon_per_head_inductor_")
    clear_caches()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        clear_caches()


def run_config(
    weight_set, config, layers, smoke, device, warmup, repeats, fresh_cache: bool
) -> dict:
    import dmuon_compile as dmuon

    per_head = config.startswith("per_head")
    compiled = config.endswith("compiled")
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    params = make_params(weight_set, layers, smoke, per_head, device)
    row = {
        "set": weight_set,
        "layers": layers,
        "config": config,
        "mode": "compiled" if compiled else "eager",
        "layout": "per_head" if per_head else "whole",
        "matrices": matrices(params),
        "values_m": sum(p.numel() for p in params) / 1e6,
    }
    with fresh_inductor_cache(fresh_cache and compiled):
        opt = dmuon.Muon(params, lr=LR, compile=compiled)
        row["first_step_s"] = step_ms(opt, device) / 1e3
        for _ in range(warmup):
            opt.step()
        times = [step_ms(opt, device) for _ in range(repeats)]
    row["median_ms"] = statistics.median(times)
    row["min_ms"] = min(times)
    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB if cuda else None
    row["finite"] = all(bool(torch.isfinite(p).all()) for p in params)
    del opt, params
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _ratio(rows, r, key) -> str:
    if r["layout"] != "per_head":
        return "1.00" if any(x is not r and x["set"] == r["set"] for x in rows) else "–"
    whole = next(
        (
            x
            for x in rows
            if x["set"] == r["set"] and x["mode"] == r["mode"] and x["layout"] == "whole"
        ),
        None,
    )
    return f"{r[key] / whole[key]:.2f}" if whole else "–"


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| set | layers | configuration | matrices | values (M) | first step s | median step ms "
        "| min ms | peak GiB | per_head / whole (step) | per_head / whole (first step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        lines.append(
            f"| {r['set']} | {r['layers']} | {r['config']} | {r['matrices']} | "
            f"{r['values_m']:.1f} | {r['first_step_s']:.1f} | {r['median_ms']:.2f} | "
            f"{r['min_ms']:.2f} | {peak} | {_ratio(rows, r, 'median_ms')} | "
            f"{_ratio(rows, r, 'first_step_s')} |"
        )
    bad = [f"{r['set']}/{r['config']}" for r in rows if not r["finite"]]
    if bad:
        lines += ["", "WARNING: non-finite parameters after the run: " + ", ".join(bad)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers per set (default: llama3 4, dsv3 2)",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        choices=CONFIGS,
        help="default: whole_compiled per_head_compiled (--smoke: the eager ones)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (--smoke: 1)")
    ap.add_argument("--repeats", type=int, default=None, help="default 10 (--smoke: 3)")
    ap.add_argument(
        "--fresh-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an empty Inductor cache per compiled configuration (a cold first step)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny dims on the CPU, eager only (< 30 s)"
    )
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke and args.device is None:
        device = torch.device("cpu")
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: threads only add noise on a shared host
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device; pass --smoke for a CPU run")
    configs = args.configs or (
        ["whole_eager", "per_head_eager"] if args.smoke else ["whole_compiled", "per_head_compiled"]
    )
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    repeats = args.repeats if args.repeats is not None else (3 if args.smoke else 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    now = datetime.datetime.now(datetime.timezone.utc)
    header = (
        f"### Per-head vs whole-matrix Newton–Schulz ({now:%Y-%m-%d %H:%M} UTC, {name}, "
        f"torch {torch.__version__}{', smoke dims' if args.smoke else ''})\n\n"
        f"Command: `python {' '.join(sys.argv)}`; warmup {warmup}, repeats {repeats}; "
        "step ms: wall clock, device synchronised."
    )

    rows = []
    for weight_set in args.sets:
        layers = args.layers or DEFAULT_LAYERS[weight_set]
        for config in configs:
            row = run_config(
                weight_set, config, layers, args.smoke, device, warmup, repeats, args.fresh_cache
            )
            rows.append(row)
            peak = f"  peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
            print(
                f"{weight_set:6s} x{layers} {config:18s} {row['matrices']:6d} matrices  "
                f"median {row['median_ms']:9.2f} ms  first step {row['first_step_s']:7.2f} s"
                + peak,
                flush=True,
            )
            if args.out:  # after each configuration: a run cut off still leaves a table
                with open(args.out, "w") as f:
                    f.write(markdown(rows, header))
    table = markdown(rows, header)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
