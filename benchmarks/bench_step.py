"""benchmarks/README.md §B1: the optimizer step alone over the matrices of models S, M, E (one GPU).

    python benchmarks/bench_step.py --out benchmarks/RESULTS_step.md       # S and M, CUDA
    python benchmarks/bench_step.py --model E --out /tmp/step_E.md         # the MoE model E
    python benchmarks/bench_step.py --quick --out /tmp/step.md             # fewer repeats
    python benchmarks/bench_step.py --quick --device cpu                   # tiny CPU smoke run
    python benchmarks/bench_step.py --quick --device cpu --model tiny_E    # tiny MoE on CPU
    python benchmarks/bench_step.py --profile prof/                        # + where the time goes
    python benchmarks/bench_step.py --normuon --configs ours_compiled       # with NorMuon
    python benchmarks/bench_step.py --quick --device cpu --profile /tmp/p  # (CPU: no GPU events)

Matrices: per layer q, k, v, o (D×D), gate, up (F×D), down (D×F); S: D=2048, F=5632, 8 layers
(56 matrices); M: D=4096, F=14336, 4 layers (28 matrices); fp32 parameters, random normal
gradients (never zeros). E (mixture of experts, DeepSeek-V3's MoE layer at reduced width, as
bench_fsdp.py's model E): per layer q, k, v, o (2048×2048), the shared expert's gate, up
(1536×2048) and down (2048×1536), and the routed experts as torchtitan's ``GroupedExperts``
stacks w1, w3 (64, 768, 2048) and w2 (64, 2048, 768), 4 layers: 28 matrices and 12 expert
stacks (796 matrices); the router (64×2048) gets AdamW and is not in the set. Our optimizer
gets the stacks as 3-D tensors declared ``dmuon.Layout.experts()`` (Newton–Schulz per expert);
``torch.optim.Muon`` takes 2-D parameters only, so it gets each stack as its 64 experts, 64
separate 2-D matrices of the same values (the per-expert peer). Configurations, each on its own
copy of the parameters:

1. ``torch_muon``: ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``, eager — the baseline;
2. ``torch_muon_compiled``: the same with ``opt.step = torch.compile(opt.step)``;
3. ``ours_eager_cublas``: ``dmuon.Muon(compile=False, ns_backend=NewtonSchulz(kernel="cublas"))``
   — our eager step on cuBLAS, the reference of the compiled step's 1.3× target;
   ``ours_eager``: ``dmuon.Muon(compile=False)`` (Gram NS, default kernels: Triton where tuned);
4. ``ours_compiled``: ``dmuon.Muon(compile=True)`` (one compiled graph + the NS-chain pass);
5. ``ours_compiled_cudagraphs`` (CUDA only): ``compile_mode="reduce-overhead"``;
   ``ours_compiled_kept`` (only when named): ``keep_new_momentum=True`` (buf′ kept from the
   directions and swapped in at the commit).

Peers that take the expert stacks whole (3-D, one Newton–Schulz per expert, as ours), each run
with its own code, on one device without communication (issue 49):

6. ``dion_muon``: microsoft/dion's ``dion.Muon`` (``pip install .wheels/dion-*.whl``,
   benchmarks/README.md §B1 "peers") with ``distributed_mesh=None`` (one device, no process
   group), plain tensors, ``flatten=False`` (a 3-D stack is a batch of 2-D matrices),
   ``adjust_lr="rms_norm"`` (lr·0.2·sqrt(max(rows, cols)), our ``match_rms_adamw``),
   ``nesterov=True`` and ``weight_decay=0`` (ours); its default NS: ``use_polar_express=True,
   use_triton=False``, i.e. ``dion.polar_express.polar_express`` — 5 Polar Express iterations
   in bf16, no restart, under ``torch.compile(dynamic=False, fullgraph=True)``, every
   same-shape parameter stacked into one batched call; momentum ``M = mu·M + G`` and the
   update, each one compiled ``_foreach`` graph per shape group;
   ``dion_muon_triton`` (CUDA only): the same with ``use_triton=True``
   (``polar_express_triton``: its symmetric Triton kernels for X·Xᵀ and c·A·A + b·A; the first
   step tunes them, minutes by dion's README);
7. ``titan_distmuon``: torchtitan's ``DistMuon``
   (``torchtitan.distributed.flex_shard.build_dist_muon``) on one rank: the benchmark opens a
   1-rank process group if none is open (nccl on CUDA, gloo on CPU, an in-process store) and a
   1-device mesh named ``dp``; every parameter is a DTensor ``Shard(0)`` on it (FSDP2's
   storage, the whole tensor on one rank) sharing the storage of the plain parameter, with a
   DTensor gradient; compute layouts ``Owned()`` for a 2-D matrix and ``Shard(0)`` for an
   expert stack ``[E, R, C]`` (the batch-first 3-D path: whole experts per rank), one bucket
   ``*``; ``adjust_lr_fn="match_rms_adamw"``, ``weight_decay=0``, its default NS: Keller
   Jordan's coefficients (3.4445, −4.7750, 2.0315), 5 steps, bf16, eager ``addmm`` per matrix /
   ``baddbmm`` per stack (no compile), parameter by parameter. On one rank every bucket is
   local: no collective runs. ``DistMuon`` refuses non-CUDA parameters ("DistMuon requires one
   CUDA device per process"); for the CPU smoke run only, the benchmark builds it through a
   subclass whose storage check accepts the CPU (everything else is torchtitan's code).

Per configuration: median step time (CUDA events on GPU, perf_counter on CPU) over
``--repeats`` steps after ``--warmup``; the first step's wall time (trace + compile + run, with
an empty Inductor cache: ``--fresh-cache``, default on) and, for ours compiled, the first step
of a second optimizer after ``torch._dynamo.reset()`` (FX graph cache hit). Every claim is a
ratio of two numbers of this run; the headline ratios are the last lines printed.

``--profile DIR``: after timing, each configuration runs 3 more steps under ``torch.profiler``
(CUDA activity on GPU) and ``benchmarks/trace_analysis.py`` sorts the GPU time into GEMM,
Triton, NCCL, attention, elementwise/other and memcpy/memset (ms per step, plus the top
kernels): printed per configuration, added to the markdown, and kept in the row as
``row["profile"]``. The ``ours_compiled`` trace is kept, gzipped, as
``DIR/trace_step_<model>_ours_compiled.json.gz``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

# benchmarks/ is not a package: sibling modules import by name from this folder.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MODELS = {  # D, F, layers (E: F is the shared expert's hidden width)
    "S": (2048, 5632, 8),
    "M": (4096, 14336, 4),
    "E": (2048, 1536, 4),
    "tiny": (64, 176, 2),  # CPU smoke run
    "tiny_E": (64, 96, 2),  # CPU smoke run of E
}
# Mixture-of-experts models: routed experts, each expert's hidden width, top-k (the router's
# choice; the step does not read it). The same as bench_fsdp.py's MOE: E is DeepSeek-V3's MoE
# layer (256 experts of hidden 2048 at dim 7168, top-8, one shared expert) scaled to dim 2048:
# 64 experts of hidden 768 (DeepSeek-V2-Lite / Moonlight's dim and expert count), top-6, one
# shared expert of 2·768; attention q/k/v/o dense 2048×2048 (no MLA low-rank projections).
MOE = {
    "E": (64, 768, 6),
    "tiny_E": (8, 32, 2),
}
DEFAULT_CONFIGS = (  # what runs without --configs
    "torch_muon",
    "torch_muon_compiled",
    "ours_eager_cublas",
    "ours_eager",
    "ours_compiled",
    "ours_compiled_cudagraphs",
)
PEERS = ("dion_muon", "dion_muon_triton", "titan_distmuon")  # only when named in --configs
CONFIGS = DEFAULT_CONFIGS + ("ours_compiled_kept",) + PEERS
CUDA_ONLY = ("ours_compiled_cudagraphs", "dion_muon_triton")
DION_INSTALL = (
    "microsoft/dion is not installed: build its wheel and install it "
    "(benchmarks/README.md §B1 'peers'): pip install --no-deps .wheels/dion-*.whl"
)


class PeerMissing(RuntimeError):
    """A peer's package is not importable: main() reports it and goes on with the others."""


LR = 0.02
# What each peer runs (the table's footnote; ours: opt.ns.describe()).
PEER_NS = {
    "torch_muon": "torch.optim.Muon: Keller Jordan NS, 5 steps, bf16, per 2-D matrix "
    "(each expert a parameter of its own)",
    "dion_muon": "microsoft/dion Muon: Polar Express, 5 iterations, bf16, torch.compile, "
    "same-shape parameters stacked (a stack: its experts), lr rule rms_norm",
    "dion_muon_triton": "microsoft/dion Muon: Polar Express with its symmetric Triton "
    "kernels (use_triton=True), bf16, same-shape parameters stacked, lr rule rms_norm",
    "titan_distmuon": "torchtitan DistMuon (1 rank): Keller Jordan NS, 5 steps, bf16, eager "
    "addmm per matrix / baddbmm per expert stack, lr rule match_rms_adamw",
}
PROFILE_STEPS = 3
SAVED_TRACES = ("ours_compiled",)


def matrix_shapes(model: str) -> list[tuple[int, ...]]:
    """The Muon weight shapes of one model, layer by layer (q, k, v, o, gate, up, down); a MoE
    model's MLP is its shared expert (gate, up, down) and its expert stacks w1, w3
    ``(E, hidden, D)`` and w2 ``(E, D, hidden)``, 3-D (torchtitan's ``GroupedExperts``).

    >>> len(matrix_shapes("S")), len(matrix_shapes("M")), len(matrix_shapes("E"))
    (56, 28, 40)
    """
    d, f, layers = MODELS[model]
    per_layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f)]
    if model in MOE:
        experts, hidden, _top_k = MOE[model]
        per_layer += [(experts, hidden, d), (experts, hidden, d), (experts, d, hidden)]
    return per_layer * layers


@functools.lru_cache(maxsize=1)
def host_values(shapes: tuple, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each shape's (value, gradient) on the host, drawn once per model and reused by its
    configurations (E's 1.3 G values take seconds to draw on the CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        (torch.randn(shape, generator=g).mul_(0.02), torch.randn(shape, generator=g))
        for shape in shapes
    ]


def make_params(shapes, device, seed: int = 0, split_experts: bool = False):
    """fp32 parameters of ``shapes`` with random gradients. A 3-D shape is an expert stack:
    declared ``dmuon.Layout.experts()`` (one Newton–Schulz per expert), or, with
    ``split_experts`` (for ``torch.optim.Muon``, 2-D only), its experts as separate 2-D
    parameters holding the same values."""
    import dmuon_compile as dmuon

    params = []
    for shape, (data, grad) in zip(shapes, host_values(tuple(map(tuple, shapes)), seed)):
        split = split_experts and len(shape) == 3
        for d, gr in zip(data.unbind(0), grad.unbind(0)) if split else [(data, grad)]:
            p = torch.nn.Parameter(d.to(device, copy=True))  # a copy: the host values are reused
            p.grad = gr.to(device, copy=True)  # kept in place: CUDA-graph safe
            if p.ndim == 3:
                dmuon.set_layout(p, dmuon.Layout.experts())
            params.append(p)
    return params


# Extra dmuon.Muon arguments of every ``ours_*`` configuration (``--normuon``).
OURS: dict = {}


def build(config: str, params):
    import dmuon_compile as dmuon

    if config.startswith("torch_muon"):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError("torch.optim.Muon is missing in this torch")
        opt = torch.optim.Muon(params, lr=LR, adjust_lr_fn="match_rms_adamw")
        if config == "torch_muon_compiled":
            opt.step = torch.compile(opt.step)
        return opt
    if config == "ours_eager_cublas":
        return dmuon.Muon(
            params, lr=LR, compile=False, ns_backend=dmuon.NewtonSchulz(kernel="cublas"), **OURS
        )
    if config == "ours_eager":
        return dmuon.Muon(params, lr=LR, compile=False, **OURS)
    if config == "ours_compiled":
        return dmuon.Muon(params, lr=LR, compile=True, **OURS)
    if config == "ours_compiled_kept":
        return dmuon.Muon(params, lr=LR, compile=True, keep_new_momentum=True, **OURS)
    if config == "ours_compiled_cudagraphs":
        return dmuon.Muon(params, lr=LR, compile=True, compile_mode="reduce-overhead", **OURS)
    if config.startswith("dion_muon"):
        return build_dion(params, use_triton=config == "dion_muon_triton")
    if config == "titan_distmuon":
        return build_titan(params)
    raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")


def build_dion(params, use_triton: bool = False, distributed_mesh=None):
    """microsoft/dion's Muon (configuration 6 of the module docstring): on one device
    (``distributed_mesh=None``: no process group, no communication), or over FSDP2's mesh
    (bench_fsdp.py's ``dion_muon``). ``params``: tensors or dion's parameter groups."""
    try:
        from dion import Muon as DionMuon
    except ImportError as e:
        raise PeerMissing(f"{DION_INSTALL} ({e})") from e
    return DionMuon(
        params,
        distributed_mesh=distributed_mesh,
        lr=LR,
        mu=0.95,
        weight_decay=0.0,
        nesterov=True,
        adjust_lr="rms_norm",  # lr·0.2·sqrt(max(rows, cols)) = our match_rms_adamw
        flatten=False,  # a 3-D expert stack is a batch of 2-D matrices: NS per expert
        use_polar_express=True,  # dion's default NS
        use_triton=use_triton,
    )


# The 1-rank process group this module opened for titan_distmuon (closed by release_group).
_OWN_GROUP: list = []


def one_rank_mesh(device):
    """A 1-device mesh named ``dp``, opening a 1-rank process group (nccl on CUDA, gloo on CPU,
    an in-process store) where none is open."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWN_GROUP.append(True)
    if dist.get_world_size() != 1:
        raise RuntimeError("titan_distmuon runs on one rank: launch bench_step.py as one process")
    return DeviceMesh(device.type, [dist.get_rank()], mesh_dim_names=("dp",))


def release_group() -> None:
    """Close the process group that ``one_rank_mesh`` opened, if it opened one."""
    import torch.distributed as dist

    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP.clear()


def titan_names(params) -> list[str]:
    """Parameter FQNs for DistMuon: ``matrices.i`` (2-D) and ``experts.i`` (3-D stacks)."""
    return [f"{'experts' if p.ndim == 3 else 'matrices'}.{i}" for i, p in enumerate(params)]


def build_titan(params):
    """torchtitan's DistMuon on one rank (configuration 7 of the module docstring): each
    parameter becomes a DTensor ``Shard(0)`` on a 1-device mesh, holding the same storage (its
    updates land in ``params``), with a DTensor gradient over the same gradient storage."""
    flex = titan_modules()
    try:
        return _build_titan(params, flex)
    except BaseException:
        release_group()
        raise


def titan_modules():
    """torchtitan's ``flex_shard`` (DistMuon and its layouts), or :class:`PeerMissing`."""
    from torchtitan_steps import _torchtitan_on_this_torch

    _torchtitan_on_this_torch()  # torchtitan 0.3.0 on torch < 2.12
    try:
        from torchtitan.distributed import flex_shard
    except ImportError as e:
        raise PeerMissing(
            "torchtitan's DistMuon (torchtitan >= 0.3.0, torchtitan.distributed.flex_shard) is "
            f"not importable: {e}; carry its wheels (benchmarks/README.md §B1 'peers')"
        ) from e
    return flex_shard


def titan_kwargs(flex, names, params, lr: float = LR) -> dict:
    """DistMuon's options for these parameters: a 2-D matrix whole on one owner (``Owned``), a
    3-D stack ``[E, R, C]`` as whole experts over the ``dp`` ranks (``Shard(0)``: one batched NS
    per rank), one bucket, Nesterov, our learning-rate rule (``match_rms_adamw``)."""
    from torch.distributed.tensor import Shard

    layouts = {
        name: flex.ComputeLayout({"dp": Shard(0) if p.ndim == 3 else flex.Owned()})
        for name, p in zip(names, params)
    }
    return dict(
        compute_sharding_by_fqn=layouts,
        bucket_configs=[flex.BucketConfig(patterns=("*",), name="all")],
        lr=lr,
        weight_decay=0.0,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )


def _build_titan(params, flex):
    from torch.distributed.tensor import DTensor, Shard

    device = params[0].device
    mesh = one_rank_mesh(device)
    names = titan_names(params)
    dparams = []
    for p in params:
        d = torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False))
        d.grad = DTensor.from_local(p.grad, mesh, [Shard(0)], run_check=False)
        dparams.append(d)
    kwargs = titan_kwargs(flex, names, params)
    groups = [{"params": dparams, "param_names": names}]
    opt = titan_dist_muon(flex.dist_muon, groups, device, kwargs)
    opt.dtensor_params = dparams  # keeps the DTensor views alive with the optimizer
    return opt


def titan_dist_muon(dist_muon, groups, device, kwargs):
    """``dist_muon.build_dist_muon(groups, **kwargs)`` on CUDA; on CPU (the smoke runs) the same
    optimizer, its one-CUDA-device-per-process check replaced by a DTensor check."""
    from torch.distributed.tensor import DTensor

    if device.type == "cuda":
        return dist_muon.build_dist_muon(groups, **kwargs)

    class CPUDistMuon(dist_muon.DistMuon):
        def _validate_parameter_storage(self):
            for group in self.param_groups:
                for param in group["params"]:
                    if not isinstance(param, DTensor):
                        raise TypeError("DistMuon requires DTensor parameters")
            return device

    return CPUDistMuon(dist_muon._normalize_param_groups(groups), **kwargs)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(opt, device, repeats: int) -> list[float]:
    """Per-step milliseconds: CUDA events on GPU, wall clock on CPU."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def first_step_s(opt, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    return time.perf_counter() - t0


def trace_analysis():
    """benchmarks/ is not a package: import the sibling module from this file's directory."""
    import trace_analysis as ta

    return ta


def run_config(
    config: str, model: str, device, warmup: int, repeats: int, profile_dir: str | None = None
) -> dict:
    # torch.optim.Muon takes 2-D parameters only: each expert stack as its E experts (same values).
    params = make_params(matrix_shapes(model), device, split_experts=config.startswith("torch"))
    opt = build(config, params)
    row = {"model": model, "config": config, "first_step_s": first_step_s(opt, device)}
    for _ in range(warmup):
        opt.step()
    sync(device)
    times = timed_steps(opt, device, repeats)
    row["median_ms"] = statistics.median(times)
    row["min_ms"] = min(times)
    if device.type == "cuda":  # one more step: what it allocates above what lives between steps
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        sync(device)
        row["step_extra_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    if profile_dir is not None:
        save = (
            os.path.join(profile_dir, f"trace_step_{model}_{config}.json.gz")
            if config in SAVED_TRACES
            else None
        )
        row["profile"] = trace_analysis().profile_calls(opt.step, PROFILE_STEPS, device, save)
    if config.startswith("ours_compiled"):
        # A second optimizer after a Dynamo reset: Inductor's FX graph cache now holds the graph.
        torch._dynamo.reset()
        opt2 = build(config, params)
        row["warm_first_step_s"] = first_step_s(opt2, device)
        del opt2
    if config.startswith("ours"):
        row["ns"] = opt.ns.describe()
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    row["finite"] = finite
    del opt, params
    gc.collect()
    if config == "titan_distmuon":
        release_group()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        (
            "| model | configuration | median step ms | min ms | first step s | "
            "warm first step s | × torch.optim.Muon | × ours eager | × ours eager-cuBLAS | "
            "step extra GiB |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            (x for x in rows if x["model"] == r["model"] and x["config"] == "torch_muon"), None
        )
        eager = next(
            (x for x in rows if x["model"] == r["model"] and x["config"] == "ours_eager"), None
        )
        vs_base = f"{base['median_ms'] / r['median_ms']:.2f}" if base else "–"
        vs_eager = f"{eager['median_ms'] / r['median_ms']:.2f}" if eager else "–"
        ecub = next(
            (x for x in rows if x["model"] == r["model"] and x["config"] == "ours_eager_cublas"),
            None,
        )
        vs_ecub = f"{ecub['median_ms'] / r['median_ms']:.2f}" if ecub else "–"
        warm = f"{r['warm_first_step_s']:.1f}" if "warm_first_step_s" in r else "–"
        lines.append(
            f"| {r['model']} | {r['config']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
            f"{r['first_step_s']:.1f} | {warm} | {vs_base} | {vs_eager} | {vs_ecub} | "
            + (f"{r['step_extra_gib']:.2f} |" if "step_extra_gib" in r else "– |")
        )
    ns = sorted({r["ns"] for r in rows if "ns" in r})
    if ns:
        lines += ["", "NS backend (ours): " + "; ".join(ns)]
    peers = [
        c for c in dict.fromkeys(r["config"] for r in rows) if c.split("_compiled")[0] in PEER_NS
    ]
    if peers:
        lines += [""] + [f"- {c}: {PEER_NS[c.split('_compiled')[0]]}" for c in peers]
    profiled = [r for r in rows if r.get("profile", {}).get("gpu_events")]
    if profiled:
        cats = list(profiled[0]["profile"]["breakdown_ms_per_step"])
        title = (
            f"Where the GPU time goes (ms per step, {PROFILE_STEPS} profiled steps; "
            "sum of kernel durations):"
        )
        lines += [
            "",
            title,
            "",
            "| model | configuration | GPU ms | " + " | ".join(cats) + " |",
            "|---|---|---|" + "---|" * len(cats),
        ]
        for r in profiled:
            p = r["profile"]
            lines.append(
                f"| {r['model']} | {r['config']} | {p['gpu_ms_per_step']:.2f} | "
                + " | ".join(f"{p['breakdown_ms_per_step'][c]:.2f}" for c in cats)
                + " |"
            )
    for r in profiled:
        top = r["profile"].get("top_kernels") or []
        if top:
            lines += [
                "",
                f"Top kernels, {r['model']} / {r['config']} (ms and launches per step):",
                "",
                "| kernel | category | ms | launches |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| `{k['name'][:90]}` | {k['category']} | {k['ms_per_step']:.2f} | "
                f"{k['count_per_step']:.0f} |"
                for k in top
            ]
    if not all(r["finite"] for r in rows):
        lines += [
            "",
            "WARNING: non-finite parameters after the run: "
            + ", ".join(f"{r['model']}/{r['config']}" for r in rows if not r["finite"]),
        ]
    return "\n".join(lines) + "\n"


def headline(rows: list[dict]) -> list[str]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["config"]: r for r in rows if r["model"] == model}
        comp = by.get("ours_compiled")
        if comp is None:
            continue
        if "torch_muon" in by:
            out.append(
                f"{model}: ours compiled vs torch.optim.Muon = "
                f"{by['torch_muon']['median_ms'] / comp['median_ms']:.2f}x (target >= 2x on M)"
            )
        if "ours_eager_cublas" in by:
            out.append(
                f"{model}: ours compiled vs ours eager-cuBLAS = "
                f"{by['ours_eager_cublas']['median_ms'] / comp['median_ms']:.2f}x "
                "(target >= 1.3x on M)"
            )
        if "ours_eager" in by:
            out.append(
                f"{model}: ours compiled vs ours eager (Triton where tuned) = "
                f"{by['ours_eager']['median_ms'] / comp['median_ms']:.2f}x"
            )
        for peer, label in (
            ("dion_muon", "microsoft/dion Muon"),
            ("dion_muon_triton", "microsoft/dion Muon (Triton NS)"),
            ("titan_distmuon", "torchtitan DistMuon"),
        ):
            if peer in by:
                out.append(
                    f"{model}: ours compiled vs {label} = "
                    f"{by[peer]['median_ms'] / comp['median_ms']:.2f}x"
                )
        out.append(
            f"{model}: first compiled step {comp['first_step_s']:.1f} s cold "
            "(target <= 60 s on M), "
            f"{comp.get('warm_first_step_s', float('nan')):.1f} s warm (target <= 10 s)"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--model",
        nargs="+",
        default=None,
        choices=sorted(MODELS),
        help="models to run (default: S M on CUDA, tiny with --device cpu; E: the MoE model, "
        "tiny_E its CPU smoke size)",
    )
    ap.add_argument("--configs", nargs="+", default=None, choices=CONFIGS)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (and tiny shapes on CPU)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--fresh-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use an empty Inductor cache dir so the first step measures a cold compile",
    )
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help=f"after timing, profile {PROFILE_STEPS} steps per configuration: "
        "GPU time by kernel category",
    )
    ap.add_argument(
        "--gluon-shortlist",
        default=None,
        metavar="SPEC",
        help="the Gluon configurations the SYRK autotune times, in gluon_probe.py's --configs "
        "syntax (e.g. 'split=1,stages=4;split=2,block_k=32,stages=4,c_slots=1,wide=1'); for "
        "A/B runs of a shortlist (give each run its own DMUON_CACHE_DIR: verdicts are cached)",
    )
    ap.add_argument(
        "--gluon-syrk-shortlist",
        default=None,
        metavar="SPEC",
        help="the same for plain SYRKs (X·Xᵀ without C; none by default); 'none' for none",
    )
    ap.add_argument(
        "--size-gate",
        default=None,
        metavar="ROWS,BATCH",
        help="let stacks of >= BATCH matrices with >= ROWS rows run the symmetric kernels "
        "(bench_kernels.py --size-gate), e.g. 512,8 for model E's 768-row expert stacks",
    )
    ap.add_argument(
        "--normuon",
        action="store_true",
        help="our configurations with Muon(normuon=True) (NorMuon's per-row normalisation); "
        "time a run with and one without it",
    )
    args = ap.parse_args(argv)
    if args.normuon:
        OURS["normuon"] = True
    if args.size_gate:
        from bench_kernels import set_size_gate

        set_size_gate(args.size_gate)
    for spec, name in (
        (args.gluon_shortlist, "GLUON_SHORTLIST_FIELDS"),
        (args.gluon_syrk_shortlist, "GLUON_SYRK_SHORTLIST_FIELDS"),
    ):
        if spec:
            from dmuon_compile.kernels import syrk
            from gluon_probe import parse_configs

            configs = [] if spec == "none" else parse_configs(spec)
            fields = tuple({k: v for k, v in c.to_dict().items() if k != "kernel"} for c in configs)
            setattr(syrk, name, fields)
            print(f"Gluon shortlist {name}: {[c.name for c in configs]}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device; pass --device cpu for a smoke run")
    models = args.model or (["tiny"] if device.type == "cpu" else ["S", "M"])
    configs = list(args.configs or DEFAULT_CONFIGS)
    if device.type != "cuda":  # CUDA graphs, dion's Triton kernels: CUDA only
        configs = [c for c in configs if c not in CUDA_ONLY]
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dmuon_bench_inductor_")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"

    def header() -> str:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (
            f"### B1: optimizer step ({now:%Y-%m-%d %H:%M} "
            f"UTC, {name}, torch {torch.__version__}, triton {triton_version})\n\n"
            f"Command: `python {' '.join(sys.argv)}`; warmup {warmup}, repeats {repeats}."
        )

    rows = []
    missing = {}
    for model in models:
        for config in configs:
            if config in missing:
                continue
            try:
                row = run_config(config, model, device, warmup, repeats, args.profile)
            except PeerMissing as e:  # the others still run; the exit status says it
                missing[config] = str(e)
                print(f"{config}: NOT RUN: {e}", flush=True)
                continue
            rows.append(row)
            print(
                f"{model:5s} {config:26s} median {row['median_ms']:9.2f} ms  first step "
                f"{row['first_step_s']:6.1f} s",
                flush=True,
            )
            if "profile" in row:
                print("\n".join(trace_analysis().where_the_time_goes(row["profile"])), flush=True)
            # The table after each configuration, so a run cut off by a time limit leaves one.
            if args.out:
                with open(args.out, "w") as f:
                    f.write(markdown(rows, header()))

    table = markdown(rows, header())
    if missing:
        table += "\n" + "".join(f"NOT RUN {c}: {why}\n" for c, why in missing.items())
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    for line in headline(rows):
        print(line)
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
