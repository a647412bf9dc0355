"""Dry run: predict a dedicated-Muon job per rank before it starts, without GPUs.

    python -m dmuon_compile.plan --model llama3-70b --gpus 8 64 512 4096
    python -m dmuon_compile.plan --model llama3-405b --gpus 1024 --hsdp 4 --split-size 8
    python -m dmuon_compile.plan --model mypkg.models:build --gpus 64 --per-rank --json
    python -m dmuon_compile.plan --model deepseek-v3 --gpus 64 2048 --ep 8
    python -m dmuon_compile.plan --model llama3-405b --gpus 512 --pp 8 --stages-per-rank 2

The model is built on the meta device (a preset, a JSON config or your own factory) and goes
through the planning ``dedicate_params`` itself runs
(:func:`~dmuon_compile.distributed.dedicate.plan_dedicated`: the same predicate, checks,
layouts, hook groups and owner plan), for ``replicate × shard × tp`` ranks, with no process
group; ``ep`` lays the expert stacks out as torchtitan's expert parallelism does, ``pp`` splits
the decoder into pipeline stages as torchtitan does (each PP rank's ranks own its stages'
weights). Per rank it
reports the dedicated Muon state it owns, the FSDP2-sharded state, the step's peak memory, the
Newton–Schulz milliseconds (from the measured kernel rates of :mod:`dmuon_compile.ns_rates`),
the communication volume per step, idle ranks and split matrices. docs/dry_run.md states the
model behind every column.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from dmuon_compile.ns_rates import H200, NSRates, TargetFlops, default_stack_bytes, useful_flops

GiB = 1 << 30
# The compiled step holds about one stack's fp32 working set above the directions, eager about
# two (an upper bound of benchmarks/step_memory.py's ratio, for the peak estimate).
WORKING_SET_FACTOR = {"compiled": 1.0, "eager": 2.0}
NS_WORK_ITEMSIZE = 2  # the directions live in NS's fp16/bf16 work dtype until the commit


# ----------------------------------------------------------------------------- model presets
@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder (HF names: ``model.layers.N.self_attn.q_proj`` ...; embeddings,
    norms, the head and routers get AdamW, the projections Muon). ``experts > 0`` makes the
    MLP of layers ``dense_layers..`` a mixture of experts: a router, expert stacks
    ``(experts, expert_ffn, dim)`` (a ``*Experts`` module: per-expert NS) and a shared expert
    of width ``shared_ffn``. ``q_lora > 0`` gives DeepSeek's MLA attention projections."""

    dim: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int | None = None
    vocab: int = 0  # 0: no embedding and head (the benchmark models)
    head_dim: int | None = None
    experts: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "ffn"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"ModelConfig: heads={self.heads} not divisible by kv_heads")

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads


PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(4096, 32, 32, 14336, kv_heads=8, vocab=128256),
    "llama3-70b": ModelConfig(8192, 80, 64, 28672, kv_heads=8, vocab=128256),
    "llama3-405b": ModelConfig(16384, 126, 128, 53248, kv_heads=8, vocab=128256),
    # DeepSeek-V3 (671B): MLA attention, 3 dense layers, then 256 routed experts + 1 shared.
    "deepseek-v3": ModelConfig(
        7168,
        61,
        128,
        18432,
        vocab=129280,
        head_dim=128,
        experts=256,
        expert_ffn=2048,
        shared_ffn=2048,
        dense_layers=3,
        q_lora=1536,
        kv_lora=512,
        rope_dim=64,
        v_head_dim=128,
    ),
    # The repository's benchmark models (benchmarks/bench_step.py, bench_fsdp.py): their Muon
    # matrices, no embedding or head.
    "S": ModelConfig(2048, 8, 16, 5632),
    "M": ModelConfig(4096, 4, 32, 14336),
    "G": ModelConfig(2048, 8, 16, 7168, kv_heads=4),
    "E": ModelConfig(2048, 4, 16, 1536, experts=64, expert_ffn=768, shared_ffn=1536),
    "tiny": ModelConfig(64, 2, 4, 176, kv_heads=2, vocab=256),
}


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        kv = (c.kv_heads or c.heads) * c.hd
        self.q_proj = nn.Linear(c.dim, c.heads * c.hd, bias=False)
        self.k_proj = nn.Linear(c.dim, kv, bias=False)
        self.v_proj = nn.Linear(c.dim, kv, bias=False)
        self.o_proj = nn.Linear(c.heads * c.hd, c.dim, bias=False)

    def forward(self, x):  # shapes only: the dry run never calls it
        return self.o_proj(self.q_proj(x) + 0 * self.k_proj(x).sum() + 0 * self.v_proj(x).sum())


class _MLA(nn.Module):
    """DeepSeek-V3's multi-head latent attention projections."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        qk = c.hd + c.rope_dim
        self.q_a_proj = nn.Linear(c.dim, c.q_lora, bias=False)
        self.q_a_layernorm = nn.RMSNorm(c.q_lora)
        self.q_b_proj = nn.Linear(c.q_lora, c.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.dim, c.kv_lora + c.rope_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora)
        self.kv_b_proj = nn.Linear(c.kv_lora, c.heads * (c.hd + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.heads * c.v_head_dim, c.dim, bias=False)

    def forward(self, x):
        return self.o_proj(self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))


class _MLP(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """Expert stacks as torchtitan's ``GroupedExperts``: w1, w3 ``(E, ffn, dim)``, w2
    ``(E, dim, ffn)``; the ``*Experts`` name gives them ``Layout.experts()``."""

    def __init__(self, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, dim))

    def forward(self, x):
        return x @ self.w1[0].T @ self.w2[0].T


class _MoE(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.dim, c.experts, bias=False)  # the router: AdamW
        self.experts = GroupedExperts(c.dim, c.expert_ffn, c.experts)
        self.shared_experts = _MLP(c.dim, c.shared_ffn) if c.shared_ffn else None

    def forward(self, x):
        y = self.experts(x) * self.gate(x).sum()
        return y if self.shared_experts is None else y + self.shared_experts(x)


class _Block(nn.Module):
    def __init__(self, c: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.dim)
        self.self_attn = _MLA(c) if c.q_lora else _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.dim)
        moe = c.experts and index >= c.dense_layers
        self.mlp = _MoE(c) if moe else _MLP(c.dim, c.ffn)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.dim) if c.vocab else None
        self.layers = nn.ModuleList(_Block(c, i) for i in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)

    def forward(self, x):
        x = self.embed_tokens(x) if self.embed_tokens is not None else x
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(nn.Module):
    """The preset models' module tree (built on the meta device by :func:`build_model`)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = _Body(c)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False) if c.vocab else None

    def forward(self, x):
        h = self.model(x)
        return self.lm_head(h) if self.lm_head is not None else h


def build_model(spec) -> tuple[str, nn.Module]:
    """``(name, model on the meta device)`` from a preset name, a :class:`ModelConfig`, a dict
    of its fields, a JSON file path (``*.json``), a ``"module:function"`` factory returning an
    ``nn.Module``, or an ``nn.Module`` (returned as it is)."""
    if isinstance(spec, nn.Module):
        return type(spec).__name__, spec
    if isinstance(spec, dict):
        return "config", _build(_config_from_dict(spec, "the config dict"))
    if isinstance(spec, ModelConfig):
        return "config", _build(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"dry_run: model must be an nn.Module, a preset name, a ModelConfig, a dict or "
            f"'module:function', got {type(spec).__name__}"
        )
    if spec in PRESETS:
        return spec, _build(PRESETS[spec])
    if spec.endswith(".json"):
        try:
            with open(spec, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"--config {spec}: cannot read it ({e})") from e
        return spec, _build(_config_from_dict(data, spec))
    if ":" in spec:
        return spec, _from_factory(spec)
    raise ValueError(
        f"unknown model {spec!r}: choose a preset ({', '.join(PRESETS)}), pass --config "
        "path.json (ModelConfig fields: dim, layers, heads, ffn, kv_heads, vocab, ...) or a "
        "factory 'package.module:function' that returns an nn.Module"
    )


def _config_from_dict(data: dict, where: str) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown ModelConfig fields {unknown}; the fields are {sorted(known)}"
        )
    try:
        return ModelConfig(**data)
    except TypeError as e:
        raise ValueError(f"{where}: {e}; required: dim, layers, heads, ffn") from e


def _build(config: ModelConfig) -> nn.Module:
    with torch.device("meta"):
        return CausalLM(config)


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"model factory {spec!r}: cannot import it ({e}); pass 'package.module:function' "
            "importable from here (PYTHONPATH) whose function returns an nn.Module"
        ) from e
    with torch.device("meta"):  # the factory's tensors land on the meta device
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec!r} returned {type(model).__name__}, not nn.Module")
    return model


# ----------------------------------------------------------------------------- the report
@dataclass
class RankRow:
    """One GPU rank's prediction (bytes; ms per step). ``rank`` is the global rank in the
    ``(replicate, shard, tp)`` mesh order: ``(r · shard_size + s) · tp_size + t``."""

    rank: int
    matrices: int = 0  # dedicated matrices (or TP/split pieces) this rank runs NS on
    dedicated_bytes: int = 0  # owned dedicated masters + momentum (TP: its shards)
    replica_bytes: int = 0  # HSDP column copies (compute dtype), beyond its own masters
    sharded_muon_bytes: int = 0  # FSDP2-sharded Muon weights (expert stacks) + momentum
    adamw_bytes: int = 0  # FSDP2-sharded AdamW weights + exp_avg + exp_avg_sq
    grad_bytes: int = 0  # gradients of what this rank steps
    step_extra_bytes: int = 0  # directions + one stack's working set
    ns_ms: float = 0.0
    step_ms: float = 0.0
    fsdp_comm_bytes: int = 0
    dedicated_comm_bytes: int = 0
    replicate_comm_bytes: int = 0
    tp_comm_bytes: int = 0
    # Expert stacks left to FSDP2 / EP (part of the columns above): the per-expert matrices this
    # rank orthogonalises (whole experts, after the reshard of a stack sharded inside its
    # experts), their NS ms alone, and that reshard's traffic (also in ``comm_bytes``).
    expert_matrices: int = 0
    expert_ns_ms: float = 0.0
    expert_reshard_comm_bytes: int = 0
    _elements: int = field(default=0, repr=False)
    _buckets: dict = field(default_factory=dict, repr=False)
    _expert_buckets: dict = field(default_factory=dict, repr=False)
    _reshard_peak: int = field(default=0, repr=False)  # largest reshard transient (bytes)

    @property
    def peak_bytes(self) -> int:
        return (
            self.dedicated_bytes
            + self.replica_bytes
            + self.sharded_muon_bytes
            + self.adamw_bytes
            + self.grad_bytes
            + self.step_extra_bytes
        )

    @property
    def comm_bytes(self) -> int:
        return (
            self.fsdp_comm_bytes
            + self.dedicated_comm_bytes
            + self.replicate_comm_bytes
            + self.tp_comm_bytes
            + self.expert_reshard_comm_bytes
        )

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["peak_bytes"] = self.peak_bytes
        out["comm_bytes"] = self.comm_bytes
        return out


COLUMNS = (  # (title, value of a RankRow, bytes, ms or count); "{unit}": the report's byte unit
    ("dedicated {unit}", lambda r: r.dedicated_bytes, "bytes"),
    ("replica {unit}", lambda r: r.replica_bytes, "bytes"),
    ("FSDP2 Muon {unit}", lambda r: r.sharded_muon_bytes, "bytes"),
    ("AdamW {unit}", lambda r: r.adamw_bytes, "bytes"),
    ("grads {unit}", lambda r: r.grad_bytes, "bytes"),
    ("step extra {unit}", lambda r: r.step_extra_bytes, "bytes"),
    ("peak {unit}", lambda r: r.peak_bytes, "bytes"),
    ("NS ms", lambda r: r.ns_ms, "ms"),
    ("step ms", lambda r: r.step_ms, "ms"),
    ("comm {unit}/step", lambda r: r.comm_bytes, "bytes"),
)
# Shown with expert parallelism (dry_run(ep=...)) only, so the other reports stay as they were.
EP_COLUMNS = (
    ("expert matrices", lambda r: r.expert_matrices, "count"),
    ("expert NS ms", lambda r: r.expert_ns_ms, "ms"),
    ("reshard {unit}/step", lambda r: r.expert_reshard_comm_bytes, "bytes"),
)
UNITS = (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _count(n: float) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"


@dataclass
class DryRunReport:
    """What :func:`dry_run` predicts: per-rank rows, totals, idle ranks, split matrices."""

    model: str
    world_size: int
    replicate_size: int
    shard_size: int
    tp_size: int
    split_size: int
    rows: list[RankRow]
    owners: dict[str, int]  # fqn -> global data-parallel owner (replica · shard_size + shard)
    dedicated_matrices: int
    dedicated_params: int  # elements
    adamw_params: int
    sharded_muon_params: int
    split: list[dict]
    rates: str
    settings: dict
    plan_s: float = 0.0
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    ep: int | None = None  # expert parallelism modelled (dry_run(ep=...)); None: plain FSDP2
    expert_layout: dict | None = None  # with ep: the expert mesh and placements (see table())
    # Pipeline parallelism (dry_run(pp=...)); None without it, and left out of to_dict().
    pp: int | None = None
    stages_per_rank: int | None = None
    stage_less_layers: list[int] | None = None  # torchtitan's first/last_stage_less_layers
    stages: list[dict] | None = None  # per stage: layers, PP rank, owners (its DP ranks), loads
    pp_ranks: list[dict] | None = None  # per PP rank: its ranks, stages, layers, NS balance

    @property
    def idle_ranks(self) -> list[int]:
        return [r.rank for r in self.rows if r.ns_ms == 0]

    def totals(self) -> dict:
        def total(name):
            return sum(getattr(r, name) for r in self.rows)

        return {
            "dedicated_bytes": total("dedicated_bytes"),
            "replica_bytes": total("replica_bytes"),
            "sharded_muon_bytes": total("sharded_muon_bytes"),
            "adamw_bytes": total("adamw_bytes"),
            "comm_bytes": total("comm_bytes"),
            "ns_ms_max": max((r.ns_ms for r in self.rows), default=0.0),
            "step_ms_max": max((r.step_ms for r in self.rows), default=0.0),
            "peak_bytes_max": max((r.peak_bytes for r in self.rows), default=0),
            "idle_ranks": len(self.idle_ranks),
        }

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        if self.pp is None:  # the report without PP keeps its keys
            for key in ("pp", "stages_per_rank", "stage_less_layers", "stages", "pp_ranks"):
                del out[key]
        else:
            for row in out["rows"]:
                row["pp_rank"] = self.pp_rank(row["rank"])
        out["idle_ranks"] = self.idle_ranks
        out["totals"] = self.totals()
        return out

    def table(self, per_rank: bool | None = None, top: int = 5) -> str:
        """Text: a header, min/median/max per column, the ``top`` busiest ranks, idle ranks and
        split matrices; ``per_rank`` (default: 16 ranks or fewer) adds every rank's row."""
        dims = ["replicate", "shard"] + (["tp"] if self.tp_size > 1 else [])
        sizes = [self.replicate_size, self.shard_size] + (
            [self.tp_size] if self.tp_size > 1 else []
        )
        if self.pp is not None:
            dims, sizes = ["pp", *dims], [self.pp, *sizes]
        mesh = f"{' × '.join(dims)} = {' × '.join(map(str, sizes))}"
        lines = [
            f"{self.model} on {self.world_size} GPUs ({mesh}) — "
            f"{self.dedicated_matrices} dedicated weights ({_count(self.dedicated_params)} "
            f"params), {_count(self.sharded_muon_params)} FSDP2 Muon, "
            f"{_count(self.adamw_params)} AdamW; planned in {self.plan_s:.2f} s, "
            f"reported in {self.total_s:.2f} s",
            f"rates: {self.rates}; " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
        ]
        if self.expert_layout is not None:
            lines.append(_expert_layout_line(self.expert_layout, self.world_size))
        if self.pp is not None:
            lines += self._pipeline_lines()
        columns = self._columns()
        width = max(len(c[0]) for c in columns)
        lines.append(f"{'per rank':<{width}}  {'min':>10} {'median':>10} {'max':>10}")
        for title, get, fmt in columns:
            values = [get(r) for r in self.rows]
            lines.append(
                f"{title:<{width}}  "
                + " ".join(
                    f"{fmt.format(v):>10}"
                    for v in (min(values), statistics.median(values), max(values))
                )
            )
        idle = self.idle_ranks
        lines.append(f"idle ranks (no NS work): {len(idle)} of {self.world_size}{_ranges(idle)}")
        if self.split:
            lines.append(f"split matrices ({len(self.split)}, NS over split_size ranks each):")
            for s in self.split[:top]:
                lines.append(
                    f"  {s['fqn']} {tuple(s['shape'])} on ranks {s['ranks'][0]}.."
                    f"{s['ranks'][-1]}: {s['ns_ms_per_rank']:.2f} ms per rank"
                )
            if len(self.split) > top:
                lines.append(f"  ... and {len(self.split) - top} more")
        else:
            lines.append(
                "split matrices: none"
                + (" (split_size=1)" if self.split_size == 1 else " (none exceeds a fair share)")
            )
        if per_rank or (per_rank is None and self.world_size <= 16):
            lines.append("every rank:")
            lines += self._rows_text(self.rows)
        else:
            busiest = sorted(self.rows, key=lambda r: (-r.step_ms, r.rank))[:top]
            lines.append(f"busiest ranks (by step ms), top {len(busiest)}:")
            lines += self._rows_text(busiest)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _columns(self):
        """``(title, value, format)`` of the columns not zero on every rank (a dense model has
        no FSDP2 Muon), bytes in the largest unit that keeps the biggest value >= 1."""
        biggest = max((r.peak_bytes for r in self.rows), default=0)
        biggest = max(biggest, max((r.comm_bytes for r in self.rows), default=0))
        unit, scale = next(((u, s) for u, s in UNITS if biggest >= s), UNITS[-1])
        out = []
        for title, get, kind in COLUMNS + (EP_COLUMNS if self.ep is not None else ()):
            if not any(get(r) for r in self.rows) and title not in ("NS ms", "step ms"):
                continue
            if kind == "bytes":
                out.append((title.format(unit=unit), lambda r, g=get: g(r) / scale, "{:.2f}"))
            else:
                out.append((title, get, "{:.0f}" if kind == "count" else "{:.2f}"))
        return out

    def pp_rank(self, rank: int) -> int:
        """The PP rank of global ``rank`` (0 without pipeline parallelism)."""
        return rank // (self.world_size // self.pp) if self.pp else 0

    def _pipeline_lines(self) -> list[str]:
        stages = len(self.stages)
        layers = sum(len(s["layers"]) for s in self.stages)
        first, last = self.stage_less_layers
        lines = [
            f"pipeline (torchtitan's split, looped): {stages} stage{'s' * (stages > 1)} of "
            f"{layers} layers, "
            f"{self.stages_per_rank} per PP rank (stage k on PP rank k mod {self.pp}; first/"
            f"last stage less layers {first}/{last}); each PP rank's {self.world_size // self.pp}"
            " data-parallel ranks own its stages' weights; activations and sends between stages"
            " are not modelled"
        ]
        for info in self.pp_ranks:
            parts = []
            for k in info["stages"]:
                s = self.stages[k]
                span = _span(s["layers"])
                ends = (("embeddings", s["embeddings"]), ("output", s["output"]))
                extra = [w for w, on in ends if on]
                parts.append(f"{k} ({' + '.join([span, *extra])})")
            lo, hi = info["ranks"]
            mean = info["ns_ms_mean"]
            word = "stages" if len(parts) > 1 else "stage"
            lines.append(
                f"  PP rank {info['pp_rank']} (ranks {lo}-{hi}): {word} {', '.join(parts)}; "
                f"{info['layers']} layers; NS ms max/mean {info['ns_ms_max']:.2f}/{mean:.2f}"
                + (f" ({info['ns_ms_max'] / mean:.3f})" if mean else "")
            )
        return lines

    def _rows_text(self, rows) -> list[str]:
        columns = self._columns()
        pp = self.pp is not None
        titles = ["rank", *(["pp"] if pp else []), "matrices"] + [c[0] for c in columns]
        cells = [
            [str(r.rank), *([str(self.pp_rank(r.rank))] if pp else []), str(r.matrices)]
            + [f.format(g(r)) for _, g, f in columns]
            for r in rows
        ]
        widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
        out = ["  " + "  ".join(t.rjust(w) for t, w in zip(titles, widths))]
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        return out


def _expert_layout_line(info: dict, world: int) -> str:
    """The report's line on the expert mesh (``dry_run(ep=...)``)."""
    experts = "/".join(map(str, info["experts"]))
    local = "/".join(map(str, info["local_experts"]))
    line = (
        f"experts (torchtitan EP): ep × efsdp = {info['ep']} × {info['efsdp']} per replica, "
        f"{local} of {experts} experts per EP rank, {info['stacks']} stacks; expert FSDP "
    )
    dims = info["shard_dims"]
    if dims == [0]:
        line += "Shard(0): whole experts on each rank, NS where they live"
    else:
        line += (
            f"{' and '.join(f'Shard({d})' for d in dims)} "
            f"({info['resharded_stacks']} stacks sharded inside the experts: NS on whole "
            "experts after a reshard, an all-to-all over efsdp and back)"
        )
    line += f"; {info['ranks_with_experts']} of {world} ranks orthogonalise experts"
    return line


def _span(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    if len(layers) == 1:
        return f"layer {layers[0]}"
    return f"layers {layers[0]}-{layers[-1]}"


def _ranges(ranks: list[int], limit: int = 12) -> str:
    if not ranks:
        return ""
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    shown = ", ".join(spans[:limit]) + (", ..." if len(spans) > limit else "")
    return f": {shown}"


# ----------------------------------------------------------------------------- the dry run
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_sizes(world_size, replicate_size, tp_size, split_size) -> int:
    for name, v in (
        ("world_size", world_size),
        ("replicate_size", replicate_size),
        ("tp_size", tp_size),
        ("split_size", split_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"dry_run: {name} must be an integer >= 1, got {v!r}")
    per = replicate_size * tp_size
    if world_size % per:
        lo = world_size // per * per
        near = f"{lo} or {lo + per}" if lo else f"{per}"
        raise ValueError(
            f"dry_run: {world_size} GPUs are not divisible by replicate_size {replicate_size} × "
            f"tp_size {tp_size} = {per}: pass a world size that is a multiple of {per} (e.g. "
            f"{near}) or change --hsdp/--tp"
        )
    shard = world_size // per
    if split_size > 1 and (replicate_size * shard) % split_size:
        raise ValueError(
            f"dry_run: split_size={split_size} must divide the {replicate_size * shard} "
            "data-parallel ranks (split groups are aligned blocks of them): pass a divisor, "
            "e.g. the GPUs per node"
        )
    return shard


def dry_run(
    model_or_config,
    world_size: int,
    *,
    replicate_size: int = 1,
    tp_size: int = 1,
    split_size: int = 1,
    predicate: Callable | None = None,
    layer_id_fn: Callable | None = None,
    hook_boundary_predicate: Callable | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    compiled: bool = True,
    rates: NSRates = H200,
    stack_bytes: int | None = None,
    ns=None,
    ep: int | None = None,
    expert_shard_dim: int | None = None,
    pp: int | None = None,
    stages_per_rank: int = 1,
    pp_first_stage_less_layers: int = 1,
    pp_last_stage_less_layers: int = 1,
) -> DryRunReport:
    """Predict a job of ``world_size`` GPUs (``[pp ×] replicate_size × shard × tp_size``) per
    rank.

    ``model_or_config``: an ``nn.Module`` (meta device recommended), a preset name
    (:data:`PRESETS`), a :class:`ModelConfig`, a dict of its fields, a JSON path or a
    ``"module:function"`` factory. ``predicate``/``layer_id_fn``/``hook_boundary_predicate``:
    as for ``dedicate_params``. ``param_dtype``/``reduce_dtype``: the mixed-precision policy
    (unsharded compute copies; gradient reduces); ``None`` keeps the weights' dtype.
    ``compiled``: the step's working set (``Muon(compile=True)`` holds one stack, eager about
    two). ``rates``: the device's NS rates (:class:`~dmuon_compile.ns_rates.NSRates`).
    ``stack_bytes``: ``NewtonSchulz(stack_bytes=...)`` (default 4 GiB).
    ``ns``: what prices NS for the owner plan (default: as ``dedicate_params`` on a GPU with
    Triton kernels; pass ``NewtonSchulz()`` to plan exactly as on this machine).
    ``ep``: expert parallelism as torchtitan lays it out (``None``: expert stacks on plain
    FSDP2 ``Shard(0)`` over the shard dim): each stack ``Shard(0)`` over groups of ``ep``
    consecutive shard ranks (``E/ep`` experts each), then expert FSDP over the other
    ``shard/ep`` ranks, ``Shard(0)`` unless ``efsdp · ep > E`` (then ``Shard(1)``, inside the
    experts: the step reshards to whole experts for NS). ``expert_shard_dim`` (0 or 1)
    overrides that choice. ``ep=1`` is torchtitan without EP (``Shard(1)`` when ``shard > E``).
    ``pp``: pipeline parallelism as torchtitan's ``pipeline_llm`` splits a decoder
    (:func:`pipeline_stages`): the model's ``layers`` cut into ``pp · stages_per_rank``
    contiguous stages (``pp_first_stage_less_layers``/``pp_last_stage_less_layers``: torchtitan's
    ``pipeline_parallel_first/last_stage_less_layers``, default 1 each; the embeddings go with
    the first stage, everything after the layers with the last), stage ``k`` on PP rank
    ``k mod pp`` (looped), each PP rank's ``world_size / pp`` data-parallel ranks planning its
    stages' dedicated weights, the later stages of a rank over the earlier ones' NS loads
    (``base_loads``, as ``dedicating(..., balance_stages=True)``). Global rank
    ``pp_rank · world_size / pp + data-parallel rank``. Not with ``tp_size > 1`` or ``ep > 1``.

    Example::

        report = dry_run("llama3-70b", 512, replicate_size=4)
        print(report.table())
    """
    options = dict(
        replicate_size=replicate_size,
        tp_size=tp_size,
        split_size=split_size,
        predicate=predicate,
        layer_id_fn=layer_id_fn,
        hook_boundary_predicate=hook_boundary_predicate,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        compiled=compiled,
        rates=rates,
        stack_bytes=stack_bytes,
        ns=ns,
        ep=ep,
        expert_shard_dim=expert_shard_dim,
    )
    if pp is None:
        if (stages_per_rank, pp_first_stage_less_layers, pp_last_stage_less_layers) != (1, 1, 1):
            raise ValueError(
                "dry_run: stages_per_rank / pp_*_stage_less_layers need pp (pass pp=N, --pp N)"
            )
        return _run_group(model_or_config, world_size, **options)[0]
    less = (pp_first_stage_less_layers, pp_last_stage_less_layers)
    return _pipeline_run(model_or_config, world_size, pp, stages_per_rank, less, options)


def _run_group(
    model_or_config,
    world_size: int,
    *,
    replicate_size: int,
    tp_size: int,
    split_size: int,
    predicate: Callable | None,
    layer_id_fn: Callable | None,
    hook_boundary_predicate: Callable | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    compiled: bool,
    rates: NSRates,
    stack_bytes: int | None,
    ns,
    ep: int | None,
    expert_shard_dim: int | None,
    keep: set[str] | None = None,
    base_loads: list[float] | None = None,
):
    """:func:`dry_run` of one data-parallel group (``world_size`` ranks): ``(report, the
    plan_dedicated result)``. ``keep``: plan only these parameters (a pipeline stage's; the
    others are not on these ranks). ``base_loads``: as ``plan_dedicated``'s."""
    from dmuon_compile.distributed.dedicate import plan_dedicated
    from dmuon_compile.distributed.policy import MixedPrecision, ParamPolicy, resolve_dtypes
    from dmuon_compile.layouts import get_layout, infer_layout
    from dmuon_compile.routing import default_muon_predicate, routing_module

    t_start = time.perf_counter()
    shard = _check_sizes(world_size, replicate_size, tp_size, split_size)
    _check_ep(ep, expert_shard_dim, shard, replicate_size, tp_size)
    name, model = build_model(model_or_config)
    stack_cap = default_stack_bytes() if stack_bytes is None else int(stack_bytes)
    plan_ns = TargetFlops() if ns is None else ns
    rate_ns = getattr(plan_ns, "ns", plan_ns)  # the NS configuration the rates price
    t_plan = time.perf_counter()
    if keep is not None:
        predicate = _only(model, keep, predicate)
    planned = plan_dedicated(
        model,
        world_size=shard,
        replicate_size=replicate_size,
        predicate=predicate,
        hook_boundary_predicate=hook_boundary_predicate,
        layer_id_fn=layer_id_fn,
        tp_size=tp_size,
        split_size=split_size,
        ns=plan_ns,
        base_loads=base_loads,
    )
    plan_s = time.perf_counter() - t_plan
    if ep is not None and ep > 1:
        stacks = [
            x.fqn for x in planned.specs if x.layout is not None and x.layout.kind == "experts"
        ]
        if stacks:  # dedicate_params refuses an expert-parallel (DTensor) stack the same way
            raise ValueError(
                f"dry_run: ep={ep}: the predicate dedicates expert stacks ({stacks[0]}"
                + (f" and {len(stacks) - 1} more" if len(stacks) > 1 else "")
                + "), but an expert-parallel stack cannot be dedicated: leave expert stacks out "
                "of the predicate (the default does) or drop ep"
            )
    R, S, T = replicate_size, shard, tp_size
    rows = [RankRow(g) for g in range(world_size)]
    policy = ParamPolicy(MixedPrecision(param_dtype, reduce_dtype))
    unshards = 2 if reshard_after_forward else 1
    notes: list[str] = []
    per_shard = _PerShard(S)  # what depends on a rank's shard coordinate only

    def gpu(d: int, t: int) -> int:  # data-parallel index d = r · S + s, TP rank t
        return d * T + t

    def add_ns(g: int, shape, count: int, expert: bool = False) -> None:
        b = rows[g]._buckets
        b[shape] = b.get(shape, 0) + count
        if expert:
            rows[g].expert_matrices += count
            b = rows[g]._expert_buckets
            b[shape] = b.get(shape, 0) + count

    # -- dedicated weights: owned state, NS and the hook groups' collectives
    specs = {s.fqn: s for s in planned.specs}
    params = dict(planned.selected)
    split_rows = []
    plan = planned.plan
    entries = plan.entries if plan is not None else []
    tp_owner = planned.tp_owners.tp_owner if planned.tp_owners is not None else {}
    groups: dict[tuple, list[tuple[str, int, int]]] = {}  # key -> [(fqn, shard owner, numel)]
    column_numel: dict[tuple, dict[tuple[int, int], int]] = {}  # per group: (shard, rep) -> n
    for e in entries:
        spec, p = specs[e.fqn], params[e.fqn]
        item = spec.itemsize
        tp = e.fqn in planned.tp_fqns
        local = spec.numel // T if tp else spec.numel
        rep_owner, s_owner = divmod(e.owner, S)
        cdt, rdt = resolve_dtypes(p.dtype, policy, None)
        citem, ritem = _itemsize(cdt), _itemsize(rdt or cdt)
        key = (planned.boundaries[e.fqn][0], cdt, rdt)
        groups.setdefault(key, []).append((e.fqn, s_owner, local))
        col = column_numel.setdefault((key, citem, ritem), {})
        col[(s_owner, rep_owner)] = col.get((s_owner, rep_owner), 0) + local
        for t in range(T):  # TP: every rank of the owner's TP group holds its shard (or copy)
            g = gpu(e.owner, t)
            rows[g].dedicated_bytes += 2 * local * item
            rows[g].grad_bytes += local * item
            if R > 1:  # the owner column's copies: one per other replica
                for r in range(R):
                    if r != rep_owner:
                        rows[gpu(r * S + s_owner, t)].replica_bytes += local * citem
                if cdt != p.dtype:  # the owner's column buffer next to its own master
                    rows[g].replica_bytes += local * citem
        shape, count = spec.matrix_shape, spec.matrix_count
        split = tuple(e.split_ranks)
        if split:  # NS over the aligned block of data-parallel ranks, owner first
            share = (
                rates.call_ms
                + useful_flops(*shape, rate_ns) / len(split) / (rates.rate(min(shape)) * 1e12) * 1e3
            )
            for d in split:
                g = gpu(d, 0)
                rows[g].ns_ms += share
                rows[g].matrices += 1
                rows[g]._elements += spec.numel // len(split)
                rows[g].step_extra_bytes += spec.numel // len(split) * NS_WORK_ITEMSIZE
            split_rows.append(
                {
                    "fqn": e.fqn,
                    "shape": list(spec.shape),
                    "ranks": [gpu(d, 0) for d in split],
                    "ns_ms_per_rank": share,
                    "ns_ms_one_rank": rates.call_ms_of(shape, count, rate_ns),
                }
            )
            _split_comm(rows, split, spec, rate_ns, gpu)
        else:
            # TP matrix: whole-matrix NS on its TP owner; a plain matrix of a TP model: TP rank
            # 0 of the column runs it and broadcasts weight and momentum to the others.
            t_ns = tp_owner.get(e.fqn, 0)
            add_ns(gpu(e.owner, t_ns), shape, count)
            rows[gpu(e.owner, t_ns)].matrices += 1
            if T > 1:
                for t in range(T):
                    if t == t_ns:
                        continue
                    g = gpu(e.owner, t)
                    if tp:  # gather u_t shard (fp32) to the TP owner, update shard back
                        rows[g].tp_comm_bytes += local * 4 + local * item
                        rows[gpu(e.owner, t_ns)].tp_comm_bytes += local * 4 + local * item
                    else:
                        rows[g].tp_comm_bytes += 2 * spec.numel * item
    _dedicated_comm(per_shard, groups, column_numel, R, S, unshards)

    # -- everything else stays on FSDP2: AdamW, and Muon on expert stacks (per expert)
    dedicated = set(params)
    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)
    adamw_params = sharded_muon_params = 0
    padding: list[str] = []
    ep_stacks: list[tuple[str, int, int]] = []  # (fqn, experts, expert FSDP shard dim)
    ctx = _EPContext(ep, S, R, rows, per_shard, gpu, add_ns, rates, stack_cap, rate_ns)
    citem_default = _itemsize(param_dtype) if param_dtype is not None else None
    for pname, p in model.named_parameters():
        if pname in dedicated or not p.requires_grad or (keep is not None and pname not in keep):
            continue
        module = routing_module(module_of.get(id(p), []))
        layout = (get_layout(p) or infer_layout(pname, p, module)) if p.ndim >= 2 else None
        muon = (
            layout is not None
            and layout.kind == "experts"
            and default_muon_predicate(pname, p, module)
        )
        item = p.element_size()
        citem = citem_default or item
        ritem = _itemsize(reduce_dtype) if reduce_dtype is not None else citem
        dim0 = int(p.shape[0]) if p.ndim else 1
        rest = p.numel() // dim0 if dim0 else 0
        chunk = -(-dim0 // S)  # FSDP2 Shard(0): torch.chunk's rows per rank, last ones fewer
        if muon:
            sharded_muon_params += p.numel()
        else:
            adamw_params += p.numel()
        if muon and ep is not None:
            dim = _ep_stack(ctx, pname, p, layout, expert_shard_dim, unshards, citem, ritem)
            ep_stacks.append((pname, int(p.shape[0]), dim))
            continue
        # Per shard coordinate: ranks [0, full) hold ``chunk`` rows, rank ``full`` the rest.
        full, last = divmod(dim0, chunk) if chunk else (0, 0)
        padded = chunk * rest
        per_shard.add_all(
            "fsdp_comm_bytes",
            (S - 1) * padded * (unshards * citem + ritem)
            + 2 * (R - 1) * padded * ritem // R,  # HSDP: all-reduce over the replicas
        )
        state = "sharded_muon_bytes" if muon else "adamw_bytes"
        copies = 2 if muon else 3  # weight + momentum; weight + exp_avg + exp_avg_sq
        for lo, hi, n_rows in ((0, full, chunk), (full, full + 1 if last else full, last)):
            per_shard.add_range("grad_bytes", lo, hi, n_rows * rest * item)
            per_shard.add_range(state, lo, hi, copies * n_rows * rest * item)
            if muon and lo < hi:
                matrices = layout.count((n_rows, *p.shape[1:]))
                for s in range(lo, min(hi, S)):
                    for r in range(R):
                        for t in range(T):
                            add_ns(gpu(r * S + s, t), layout.stacked_shape(p.shape), matrices, True)
        if muon and padded * S > 1.25 * p.numel():
            padding.append(pname)
    per_shard.apply(rows, S, T)
    expert_layout = None
    if ep is not None:
        if not ep_stacks and keep is None:  # a pipeline stage may have none: checked whole
            raise ValueError(
                f"dry_run: ep={ep}, but the model has no expert stacks left to FSDP2/EP (3-D "
                "parameters of an *Experts module such as torchtitan's GroupedExperts, or "
                "declared with dmuon.set_layout(p, dmuon.Layout.experts())): drop ep/--ep for a "
                "dense model"
            )
        resharded = sum(1 for _, _, d in ep_stacks if d)
        expert_layout = {
            "ep": ep,
            "efsdp": S // ep,
            "experts": sorted({e for _, e, _ in ep_stacks}),
            "local_experts": sorted({e // ep for _, e, _ in ep_stacks}),
            "shard_dims": sorted({d for _, _, d in ep_stacks}),
            "stacks": len(ep_stacks),
            "resharded_stacks": resharded,
            "ranks_with_experts": sum(1 for r in rows if r.expert_matrices),
        }
        if ctx.padding:
            notes.append(
                f"{len(ctx.padding)} expert stacks are cut unevenly over the {S // ep} expert-"
                f"FSDP ranks (e.g. {ctx.padding[0]}): FSDP2 pads each rank's chunk, so its "
                "collectives move padding too"
            )
        if resharded:
            notes.append(
                f"{resharded} expert stacks are sharded inside their experts (efsdp · ep > "
                "experts, as torchtitan picks): each step all-to-alls a stack over efsdp to "
                "whole experts (each rank a share of its EP rank's experts), runs their NS "
                "(eagerly, one call per stack) and all-to-alls the result back ('reshard' "
                "column)"
            )
    if padding:
        notes.append(
            f"{len(padding)} FSDP2 weights have fewer dim-0 rows than is even over {S} shard "
            f"ranks (e.g. {padding[0]}): FSDP2 pads each rank's chunk, so its collectives move "
            "padding too"
        )
    if sharded_muon_params and R > 1:
        notes.append(
            "FSDP2-sharded expert stacks: every replica orthogonalises its own copy (R times "
            "the NS of one shard group)"
        )
    if T > 1:
        notes.append(
            "TP: the non-dedicated weights are counted TP-replicated (sharded over the shard "
            "dim only); a TP-sharded embedding or head holds 1/tp of that"
        )

    # -- NS ms, step ms and the step's working set from each rank's shape buckets
    factor = WORKING_SET_FACTOR["compiled" if compiled else "eager"]
    for row in rows:
        widest = 0
        for shape, count in row._buckets.items():
            row.ns_ms += rates.bucket_ms(shape, count, stack_cap, rate_ns)
            row._elements += count * shape[0] * shape[1]
            one = 4 * shape[0] * shape[1]
            per_stack = max(one, stack_cap // one * one)
            widest = max(widest, min(count * one, per_stack))
            row.step_extra_bytes += count * shape[0] * shape[1] * NS_WORK_ITEMSIZE
        row.step_extra_bytes += max(int(factor * widest), row._reshard_peak)
        for shape, count in row._expert_buckets.items():  # the experts' NS alone
            row.expert_ns_ms += rates.bucket_ms(shape, count, stack_cap, rate_ns)
        if row.ns_ms:
            row.step_ms = row.ns_ms + rates.elementwise_ms(row._elements) + rates.start_ms
    if plan is None and keep is None:
        notes.append("nothing matched the predicate: every parameter stays on FSDP2")
    report = DryRunReport(
        model=name,
        world_size=world_size,
        replicate_size=R,
        shard_size=S,
        tp_size=T,
        split_size=split_size,
        rows=rows,
        owners=planned.owners(),
        dedicated_matrices=len(entries),
        dedicated_params=sum(s.numel for s in planned.specs),
        adamw_params=adamw_params,
        sharded_muon_params=sharded_muon_params,
        split=split_rows,
        rates=rates.device,
        settings={
            "param_dtype": _dtype_name(param_dtype),
            "reduce_dtype": _dtype_name(reduce_dtype),
            "step": "compiled" if compiled else "eager",
            "stack cap GiB": round(stack_cap / GiB, 2),
            "NS flops": "as a Triton GPU" if ns is None else type(ns).__name__,
        },
        plan_s=plan_s,
        notes=notes,
        ep=ep,
        expert_layout=expert_layout,
    )
    report.total_s = time.perf_counter() - t_start
    return report, planned


# ----------------------------------------------------------------------------- pipeline
_SUMMED = (  # RankRow fields a PP rank adds up over its stages (each stage's own optimizer)
    "matrices",
    "dedicated_bytes",
    "replica_bytes",
    "sharded_muon_bytes",
    "adamw_bytes",
    "grad_bytes",
    "ns_ms",
    "step_ms",
    "fsdp_comm_bytes",
    "dedicated_comm_bytes",
    "replicate_comm_bytes",
    "tp_comm_bytes",
    "expert_matrices",
    "expert_ns_ms",
    "expert_reshard_comm_bytes",
)


def pipeline_stage_layers(
    num_layers: int, num_stages: int, first_less: int = 1, last_less: int = 1
) -> list[list[int]]:
    """The layer indices of each of ``num_stages`` pipeline stages, cut as torchtitan's
    ``pipeline_llm`` cuts a decoder by default: the embeddings count as ``first_less`` layers of
    the first stage and the output (norm + head) as ``last_less`` of the last
    (``pipeline_parallel_first/last_stage_less_layers``, default 1), the ``num_layers +
    first_less + last_less`` effective layers are dealt evenly, the first stages one more each
    when they do not divide. One stage: every layer."""
    for name, v, least in (
        ("num_layers", num_layers, 1),
        ("num_stages", num_stages, 1),
        ("first_less", first_less, 0),
        ("last_less", last_less, 0),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"pipeline_stage_layers: {name} must be an integer >= {least}")
    if num_stages == 1:
        return [list(range(num_layers))]
    effective = num_layers + first_less + last_less
    each, extra = divmod(effective, num_stages)
    if each < max(1, first_less, last_less):
        raise ValueError(
            f"dry_run: {num_stages} stages over {num_layers} layers (+{first_less} for the "
            f"embeddings, +{last_less} for the output, torchtitan's "
            "pipeline_parallel_first/last_stage_less_layers) leave a stage fewer effective "
            f"layers ({each}) than the embeddings or output count for: pass fewer stages "
            "(--pp / --stages-per-rank) or smaller --pp-first-less-layers/--pp-last-less-layers"
        )
    stages, start = [], 0
    for k in range(num_stages):
        n = each + (k < extra) - (first_less if k == 0 else 0)
        n -= last_less if k == num_stages - 1 else 0
        n = max(0, min(n, num_layers - start))
        stages.append(list(range(start, start + n)))
        start += n
    return stages


def _layers_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's one ``layers`` ModuleList or ModuleDict (what torchtitan's split cuts)."""
    found = [
        (path, m)
        for path, m in model.named_modules()
        if path.rsplit(".", 1)[-1] == "layers" and isinstance(m, (nn.ModuleList, nn.ModuleDict))
    ]
    if len(found) != 1:
        where = ", ".join(p for p, _ in found) or "none"
        raise ValueError(
            f"dry_run: pp needs a decoder with exactly one `layers` ModuleList/ModuleDict (what "
            f"torchtitan's pipeline split cuts); this model has {len(found)} ({where}): pass a "
            "model with one (e.g. a preset or --config) or drop pp/--pp"
        )
    return found[0]


def _stage_params(model: nn.Module, stage_layers: list[list[int]]) -> list[set[str]]:
    """Each stage's parameter names: its layers', those registered before the layers
    (embeddings) with the first stage, those after (norm, head) with the last."""
    path, layers = _layers_of(model)
    stage_of = {}
    for k, indices in enumerate(stage_layers):
        for i in indices:
            stage_of[i] = k
    prefixes = {f"{path}.{key}.": i for i, (key, _) in enumerate(layers.named_children())}
    out: list[set[str]] = [set() for _ in stage_layers]
    seen_layer = False
    for name, _ in model.named_parameters():
        head = name[: name.index(".", len(path) + 1) + 1] if name.startswith(path + ".") else ""
        if head in prefixes:
            out[stage_of[prefixes[head]]].add(name)
            seen_layer = True
        else:
            out[-1 if seen_layer else 0].add(name)
    return out


def _only(model: nn.Module, keep: set[str], predicate):
    """``predicate`` (``None``: ``dedicate_params``' default) restricted to ``keep``."""
    from dmuon_compile.distributed.dedicate import _call_predicate

    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)

    def in_stage(name, param):
        if name not in keep:
            return False
        return _call_predicate(predicate, name, param, module_of.get(id(param), []))

    return in_stage


def _check_pp(pp, per_rank, less, world, options) -> None:
    for name, v, least in (
        ("pp", pp, 1),
        ("stages_per_rank", per_rank, 1),
        ("pp_first_stage_less_layers", less[0], 0),
        ("pp_last_stage_less_layers", less[1], 0),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"dry_run: {name} must be an integer >= {least}, got {v!r}")
    tp, ep, replicate = options["tp_size"], options["ep"], options["replicate_size"]
    if tp != 1:
        raise ValueError(
            f"dry_run: pp={pp} with tp_size={tp} is not modelled (torchtitan's PP stages with TP: "
            "dedicating(...) plans each stage alone on the DP × TP slots, and the package's "
            "pipeline runs are not tested with TP): pass tp_size=1 (--tp 1) or drop pp (--pp)"
        )
    if ep is not None and ep > 1:
        raise ValueError(
            f"dry_run: pp={pp} with ep={ep} is not modelled (the package's pipeline runs are not "
            "tested with expert parallelism, whose EP groups torchtitan carves out of each "
            "stage's data-parallel ranks): pass ep=1 or none (--ep 1 or no --ep) or drop pp"
        )
    per = pp * replicate * tp
    if not isinstance(world, int) or isinstance(world, bool) or world < 1 or world % per:
        lo = world // per * per if isinstance(world, int) else 0
        near = f"{lo} or {lo + per}" if lo else f"{per}"
        raise ValueError(
            f"dry_run: {world} GPUs are not divisible by pp {pp} × replicate_size {replicate} "
            f"× tp_size {tp} = {per} (each PP rank holds world / pp of them): pass a multiple "
            f"of {per} (e.g. {near}) or change --pp/--hsdp"
        )


def _pipeline_run(model_or_config, world_size, pp, per_rank, less, options) -> DryRunReport:
    """:func:`dry_run` with pipeline parallelism: each PP rank's data-parallel group plans its
    stages in order, each over the NS loads of the ones before (``dedicating``'s
    ``balance_stages``); its ranks' rows add its stages up."""
    t_start = time.perf_counter()
    _check_pp(pp, per_rank, less, world_size, options)
    name, model = build_model(model_or_config)
    num_stages = pp * per_rank
    layers = len(_layers_of(model)[1])
    if num_stages > layers:
        fits = max(1, layers // pp)
        raise ValueError(
            f"dry_run: pp {pp} × stages_per_rank {per_rank} = {num_stages} stages for {layers} "
            f"layers: each stage needs at least one layer; pass pp · stages_per_rank <= {layers} "
            f"(e.g. --stages-per-rank {fits} with --pp {pp}, or a smaller --pp)"
        )
    stage_layers = pipeline_stage_layers(layers, num_stages, *less)
    keeps = _stage_params(model, stage_layers)
    group = world_size // pp
    rows = [RankRow(g) for g in range(world_size)]
    owners: dict[str, int] = {}
    stages: list[dict] = [{} for _ in range(num_stages)]
    pp_ranks, split_rows, notes = [], [], []
    first = None  # one stage's report: the group's sizes, rates and settings
    plan_s = 0.0
    totals = {"dedicated_matrices": 0, "dedicated_params": 0, "adamw": 0, "sharded": 0}
    expert = None
    for p in range(pp):
        carried = None  # NS FLOPs per data-parallel slot of this PP rank's stages so far
        base = p * group
        for k in range(p, num_stages, pp):
            report, planned = _run_group(model, group, keep=keeps[k], base_loads=carried, **options)
            first = first or report
            plan_s += report.plan_s
            loads = planned.plan.ns_loads() if planned.plan is not None else []
            if loads:
                carried = loads if carried is None else [a + b for a, b in zip(carried, loads)]
            for d, r in enumerate(report.rows):
                row = rows[base + d]
                for f in _SUMMED:
                    setattr(row, f, getattr(row, f) + getattr(r, f))
                # each stage's optimizer steps in turn: one stage's working set at a time
                row.step_extra_bytes = max(row.step_extra_bytes, r.step_extra_bytes)
            owners.update({fqn: base + o for fqn, o in report.owners.items()})
            for s in report.split:
                split_rows.append({**s, "ranks": [base + g for g in s["ranks"]]})
            notes += [n for n in report.notes if n not in notes]
            totals["dedicated_matrices"] += report.dedicated_matrices
            totals["dedicated_params"] += report.dedicated_params
            totals["adamw"] += report.adamw_params
            totals["sharded"] += report.sharded_muon_params
            if report.expert_layout is not None:
                expert = _merge_expert_layout(expert, report.expert_layout)
            mean = sum(loads) / len(loads) if loads else 0.0
            stages[k] = {
                "stage": k,
                "pp_rank": p,
                "layers": stage_layers[k],
                "embeddings": k == 0,
                "output": k == num_stages - 1,
                "dedicated": report.dedicated_matrices,
                "owners": report.owners,  # data-parallel ranks of the PP rank's group
                "ns_flops_per_rank": loads,
                "ns_max_over_mean": max(loads) / mean if mean else 1.0,
            }
            if not report.dedicated_matrices:
                notes.append(
                    f"stage {k} (PP rank {p}) has no dedicated weights"
                    + (" (only what follows the layers)" if not stage_layers[k] else "")
                )
        ns = [rows[base + d].ns_ms for d in range(group)]
        mean_flops = sum(carried) / len(carried) if carried else 0.0
        pp_ranks.append(
            {
                "pp_rank": p,
                "ranks": [base, base + group - 1],
                "stages": list(range(p, num_stages, pp)),
                "layers": sum(len(stage_layers[k]) for k in range(p, num_stages, pp)),
                "ns_ms_max": max(ns),
                "ns_ms_mean": sum(ns) / group,
                "ns_flops_max_over_mean": max(carried) / mean_flops if mean_flops else 1.0,
            }
        )
    if options["ep"] is not None and expert is None:
        raise ValueError(
            f"dry_run: ep={options['ep']}, but the model has no expert stacks left to FSDP2/EP: "
            "drop ep/--ep for a dense model"
        )
    if expert is not None:
        expert["ranks_with_experts"] = sum(1 for r in rows if r.expert_matrices)
    notes.append(
        "pipeline parallelism: each PP rank counts its own stages only. Not modelled: the "
        "activations and gradients the stages send each other, the schedule's bubbles, and "
        "the unshards per micro-batch (comm counts one forward and backward, as without PP; "
        "dedicated groups are gathered for every micro-batch's forward and backward, FSDP2 "
        "under torchtitan's default policy keeps its weights unsharded after forward)"
    )
    out = DryRunReport(
        model=name,
        world_size=world_size,
        replicate_size=first.replicate_size,
        shard_size=first.shard_size,
        tp_size=first.tp_size,
        split_size=first.split_size,
        rows=rows,
        owners=owners,
        dedicated_matrices=totals["dedicated_matrices"],
        dedicated_params=totals["dedicated_params"],
        adamw_params=totals["adamw"],
        sharded_muon_params=totals["sharded"],
        split=split_rows,
        rates=first.rates,
        settings=first.settings,
        plan_s=plan_s,
        notes=notes,
        ep=options["ep"],
        expert_layout=expert,
        pp=pp,
        stages_per_rank=per_rank,
        stage_less_layers=list(less),
        stages=stages,
        pp_ranks=pp_ranks,
    )
    out.total_s = time.perf_counter() - t_start
    return out


def _merge_expert_layout(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    out = dict(a)
    for key in ("experts", "local_experts", "shard_dims"):
        out[key] = sorted(set(a[key]) | set(b[key]))
    for key in ("stacks", "resharded_stacks"):
        out[key] = a[key] + b[key]
    return out


def _check_ep(ep, shard_dim, shard: int, replicate: int, tp: int) -> None:
    if ep is None:
        if shard_dim is not None:
            raise ValueError("dry_run: expert_shard_dim needs ep (pass ep=1 for no EP)")
        return
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"dry_run: ep must be an integer >= 1, got {ep!r}")
    if shard_dim not in (None, 0, 1):
        raise ValueError(
            f"dry_run: expert_shard_dim must be 0, 1 or None (torchtitan's rule), got {shard_dim!r}"
        )
    if tp > 1:
        raise ValueError(
            f"dry_run: ep={ep} with tp_size={tp} is not modelled (torchtitan's EP borrows TP "
            "ranks and shards experts over them too): plan expert parallelism with tp_size=1 "
            "(--tp 1)"
        )
    if shard % ep:
        below = max(d for d in range(1, ep) if shard % d == 0)
        above = [d for d in range(ep + 1, shard + 1) if shard % d == 0][:1]
        fits = [below, *above]
        raise ValueError(
            f"dry_run: ep={ep} must divide the data-parallel shard size {shard} (world_size / "
            f"replicate_size {replicate}; EP groups are ep consecutive shard ranks, expert FSDP "
            f"the other shard/ep): pass an ep that divides {shard} (e.g. "
            f"{' or '.join(map(str, fits))}) or change the GPU count / --hsdp"
        )


class _EPContext:
    """What :func:`_ep_stack` reads and writes of the dry run in progress."""

    def __init__(self, ep, shards, replicas, rows, per_shard, gpu, add_ns, rates, cap, ns):
        self.ep, self.shards, self.replicas = ep, shards, replicas
        self.rows, self.per_shard, self.gpu, self.add_ns = rows, per_shard, gpu, add_ns
        self.rates, self.stack_cap, self.ns = rates, cap, ns
        self.padding: list[str] = []  # stacks whose expert-FSDP chunks are mostly padding


def _chunk(n: int, k: int, i: int) -> int:
    """Size of piece ``i`` of ``n`` cut in ``k`` as ``torch.chunk`` / DTensor ``Shard`` cut:
    ``ceil(n / k)`` each, the last ones fewer or none."""
    size = -(-n // k)
    return max(0, min(size, n - i * size))


def _ep_stack(ctx: _EPContext, fqn, p, layout, shard_dim, unshards, citem, ritem) -> int:
    """One expert stack ``(E, a, b)`` under torchtitan's EP: ``Shard(0)`` over the ``ep``
    consecutive shard ranks ``s = f · ep + e`` (``E/ep`` experts on EP rank ``e``), expert FSDP
    over ``f`` (``efsdp = shard/ep`` ranks): ``Shard(0)`` of the local experts, or ``Shard(1)``
    of every local expert's rows when ``efsdp · ep > E``. Returns the expert FSDP shard dim."""
    ep, S, R = ctx.ep, ctx.shards, ctx.replicas
    E, a = int(p.shape[0]), int(p.shape[1])
    b = p.numel() // (E * a) if E * a else 0
    if E % ep:
        fits = ", ".join(str(d) for d in range(1, E + 1) if E % d == 0 and S % d == 0)
        raise ValueError(
            f"dry_run: ep={ep} must divide the number of experts of {fqn} (shape "
            f"{tuple(p.shape)}: {E} experts): EP gives each EP rank E/ep whole experts; pass "
            f"an ep dividing both {E} and the shard size {S} (one of {fits})"
        )
    local, F = E // ep, S // ep
    dim = shard_dim if shard_dim is not None else (1 if F * ep > E else 0)
    if dim == 1 and a % F:  # FSDP2 raises NotImplementedError on an uneven Shard(1) too
        raise ValueError(
            f"dry_run: ep={ep}: {fqn} {tuple(p.shape)} would be sharded inside its experts "
            f"(Shard(1), efsdp · ep = {F * ep} > {E} experts) over efsdp = {F} ranks, but its "
            f"{a} rows are not divisible by {F}: FSDP2 refuses uneven sharding on dim 1. Pick "
            "an ep (or GPU count) whose efsdp = shard/ep divides the rows, or one with "
            "efsdp · ep <= experts (Shard(0))"
        )
    item = p.element_size()
    shape = layout.stacked_shape(p.shape)
    ps = ctx.per_shard
    # FSDP2's collectives over efsdp, padded to ceil-sized chunks; HSDP all-reduces the chunk
    padded = (-(-local // F)) * a * b if dim == 0 else local * (-(-a // F)) * b
    ps.add_all(
        "fsdp_comm_bytes",
        (F - 1) * padded * (unshards * citem + ritem) + 2 * (R - 1) * padded * ritem // R,
    )
    for f in range(F):
        lo, hi = f * ep, (f + 1) * ep  # the EP group of expert-FSDP rank f
        if dim == 0:
            n = _chunk(local, F, f)  # whole local experts
            ps.add_range("grad_bytes", lo, hi, n * a * b * item)
            ps.add_range("sharded_muon_bytes", lo, hi, 2 * n * a * b * item)
            if n:
                count = layout.count((n, *p.shape[1:]))
                for s in range(lo, hi):
                    for r in range(R):
                        ctx.add_ns(ctx.gpu(r * S + s, 0), shape, count, True)
            continue
        rows_f = _chunk(a, F, f)  # this rank's rows of each of its local experts
        own = local * rows_f * b
        ps.add_range("grad_bytes", lo, hi, own * item)
        ps.add_range("sharded_muon_bytes", lo, hi, 2 * own * item)
        # The reshard to whole experts (distributed/_expert_shards.py): one all-to-all over
        # efsdp, among the ranks that hold rows of the same E/ep local experts, gives rank f
        # chunk f of those experts whole (m of them; none once f · ceil(local/F) >= local);
        # the inverse all-to-all brings NS's result back to the rows. Received (= sent):
        # there the other rows of its m experts, back its rows of the other local experts.
        m = _chunk(local, F, f)
        there = m * (a - rows_f) * b
        back = (local - m) * rows_f * b
        ps.add_range("expert_reshard_comm_bytes", lo, hi, (there + back) * item)
        # the pieces received and the whole experts they form (then the result's send buffer)
        transient = 2 * m * a * b * item
        count = layout.count((m, a, b)) if m else 0
        ms = ctx.rates.bucket_ms(shape, count, ctx.stack_cap, ctx.ns) if count else 0.0
        one = 4 * shape[0] * shape[1]
        work = WORKING_SET_FACTOR["eager"] * min(count * one, max(one, ctx.stack_cap))
        for s in range(lo, hi):
            for r in range(R):
                row = ctx.rows[ctx.gpu(r * S + s, 0)]
                row.ns_ms += ms
                row.expert_ns_ms += ms
                row.expert_matrices += count
                row._elements += own  # momentum, Nesterov input and commit on the local rows
                row.step_extra_bytes += own * item  # the result back on the rows, until commit
                row._reshard_peak = max(row._reshard_peak, transient + int(work))
    if padded * F > 1.25 * local * a * b:
        ctx.padding.append(fqn)
    return dim


def _dtype_name(dt) -> str:
    return "as stored" if dt is None else str(dt).replace("torch.", "")


class _PerShard:
    """Per-rank values that depend only on the rank's shard coordinate (the same in every
    replica and TP rank): a constant plus range additions, summed once at the end."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.const: dict[str, int] = {}
        self.diff: dict[str, list[int]] = {}

    def add_all(self, name: str, value: int) -> None:
        self.const[name] = self.const.get(name, 0) + value

    def add_range(self, name: str, lo: int, hi: int, value: int) -> None:
        hi = min(hi, self.shards)
        if lo < hi and value:
            d = self.diff.setdefault(name, [0] * (self.shards + 1))
            d[lo] += value
            d[hi] -= value

    def apply(self, rows: list[RankRow], shards: int, tp: int) -> None:
        names = set(self.const) | set(self.diff)
        values = {}
        for name in names:
            acc, out = self.const.get(name, 0), []
            for d in self.diff.get(name, [0] * (shards + 1))[:shards]:
                acc += d
                out.append(acc)
            values[name] = out
        for row in rows:
            s = (row.rank // tp) % shards
            for name in names:
                setattr(row, name, getattr(row, name) + values[name][s])


def _dedicated_comm(per_shard: _PerShard, groups, column_numel, R, S, unshards) -> None:
    """Each hook group: one unshard all-gather (twice with ``reshard_after_forward``) and one
    gradient reduce-scatter over the shard group, owner-packed as ``DedicatedGroup.build``
    packs them (each rank receives the buffer less its own chunk); HSDP adds per group one
    reduce and one broadcast of this rank's column chunk over the replicate group."""
    from dmuon_compile.distributed._dedicated_group import MAX_GATHER_PADDING

    for (key, citem, ritem), col in column_numel.items():
        chunk: dict[int, int] = {}
        for _fqn, s_owner, n in groups[key]:
            chunk[s_owner] = chunk.get(s_owner, 0) + n
        total, widest = sum(chunk.values()), max(chunk.values())
        per_byte = unshards * citem + ritem
        if S == 1:
            pass
        elif widest * S <= (1 + MAX_GATHER_PADDING) * total:  # padded all-gather
            per_shard.add_all("dedicated_comm_bytes", (S - 1) * widest * per_byte)
        else:  # uneven chunks: everything but its own
            per_shard.add_all("dedicated_comm_bytes", total * per_byte)
            for s, n in chunk.items():
                per_shard.add_range("dedicated_comm_bytes", s, s + 1, -n * per_byte)
        if R > 1:
            for (s_owner, _rep), n in col.items():
                per_shard.add_range(
                    "replicate_comm_bytes", s_owner, s_owner + 1, n * (ritem + citem)
                )


def _split_comm(rows, split, spec, ns, gpu) -> None:
    """A split matrix's collectives inside its group (``split_ns.split_flops``: the m×m
    all-reduces and row all-gathers), and its pieces' scatter/gather from the owner (fp32)."""
    from dmuon_compile.distributed import split_ns
    from dmuon_compile.newton_schulz import NewtonSchulz

    cost = split_ns.split_flops(spec.shape, len(split), ns or NewtonSchulz(), "cuda")
    inside = cost.all_reduce_bytes + cost.all_gather_bytes
    piece = spec.numel * 4 // len(split)
    for d in split:
        rows[gpu(d, 0)].dedicated_comm_bytes += inside + (2 * piece if d != split[0] else 0)


# ----------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dmuon_compile.plan",
        description=(
            "Dry run of a dedicated-Muon job: builds the model on the meta device, runs "
            "dedicate_params' planning for each GPU count (no GPUs, no process group) and "
            "prints per rank the owned Muon state, FSDP2 state, peak step memory, predicted "
            "Newton–Schulz ms, communication per step, idle ranks and split matrices."
        ),
        epilog=(
            "Presets: " + ", ".join(PRESETS) + ". Your model: --model package.module:function "
            "(returns an nn.Module; built under torch.device('meta')) or --config path.json "
            "(ModelConfig fields). Example: python -m dmuon_compile.plan --model llama3-70b "
            "--gpus 8 64 512 4096"
        ),
    )
    ap.add_argument("--model", help="preset name or package.module:function factory")
    ap.add_argument("--config", help="JSON file of ModelConfig fields (instead of --model)")
    ap.add_argument(
        "--gpus", type=int, nargs="+", required=True, help="total GPU counts to predict"
    )
    ap.add_argument("--hsdp", type=int, default=1, metavar="R", help="replicate size (HSDP)")
    ap.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size")
    ap.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help="expert parallelism as torchtitan lays it out: expert stacks over groups of N "
        "shard ranks (E/N experts each), expert FSDP over the other shard/N (Shard(0), or "
        "Shard(1) inside the experts when efsdp·N > E); default: plain FSDP2 Shard(0)",
    )
    ap.add_argument(
        "--expert-shard-dim",
        type=int,
        choices=(0, 1),
        help="with --ep: force the expert FSDP shard dim (default: torchtitan's rule)",
    )
    ap.add_argument(
        "--pp",
        type=int,
        metavar="N",
        help="pipeline parallelism as torchtitan splits a decoder: the layers in N·V contiguous "
        "stages, stage k on PP rank k mod N, each PP rank's GPUs/N ranks planning its stages "
        "(activations and sends between stages not modelled)",
    )
    ap.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        metavar="V",
        help="with --pp: stages per PP rank (looped schedules such as Interleaved1F1B: 2); "
        "default 1",
    )
    ap.add_argument(
        "--pp-first-less-layers",
        type=int,
        default=1,
        metavar="K",
        help="with --pp: torchtitan's pipeline_parallel_first_stage_less_layers (default 1)",
    )
    ap.add_argument(
        "--pp-last-less-layers",
        type=int,
        default=1,
        metavar="K",
        help="with --pp: torchtitan's pipeline_parallel_last_stage_less_layers (default 1)",
    )
    ap.add_argument(
        "--split-size",
        type=int,
        default=1,
        help="split NS: matrices above a fair share run over aligned blocks of this many ranks",
    )
    ap.add_argument(
        "--param-dtype",
        choices=[*_DTYPES, "none"],
        default="bf16",
        help="compute dtype of the unsharded weights (default bf16; none: as stored)",
    )
    ap.add_argument(
        "--reduce-dtype",
        choices=[*_DTYPES, "none"],
        default="fp32",
        help="gradient reduce dtype (default fp32; none: the compute dtype)",
    )
    ap.add_argument("--eager", action="store_true", help="size the eager step's working set")
    ap.add_argument(
        "--no-reshard", action="store_true", help="reshard_after_forward=False (one unshard)"
    )
    ap.add_argument("--rates", help="JSON file of your device's NS rates (ns_rates.NSRates.load)")
    ap.add_argument("--stack-gib", type=float, help="NewtonSchulz(stack_bytes=...) in GiB")
    ap.add_argument("--top", type=int, default=5, help="busiest ranks shown (default 5)")
    ap.add_argument("--per-rank", action="store_true", help="print every rank's row")
    ap.add_argument("--json", action="store_true", help="print JSON (every rank) instead")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.model is None) == (args.config is None):
        ap.error("pass one of --model (a preset or package.module:function) or --config")
    spec = args.config if args.config is not None else args.model
    if args.config is not None and not args.config.endswith(".json"):
        ap.error(f"--config {args.config}: expected a .json file of ModelConfig fields")
    try:
        rates = NSRates.load(args.rates) if args.rates else H200
        name, model = build_model(spec)
    except (ValueError, OSError, KeyError) as e:
        ap.error(str(e))
    reports = []
    for gpus in args.gpus:
        try:
            report = dry_run(
                model,
                gpus,
                replicate_size=args.hsdp,
                tp_size=args.tp,
                split_size=args.split_size,
                param_dtype=_DTYPES.get(args.param_dtype),
                reduce_dtype=_DTYPES.get(args.reduce_dtype),
                reshard_after_forward=not args.no_reshard,
                compiled=not args.eager,
                rates=rates,
                stack_bytes=None if args.stack_gib is None else int(args.stack_gib * GiB),
                ep=args.ep,
                expert_shard_dim=args.expert_shard_dim,
                pp=args.pp,
                stages_per_rank=args.stages_per_rank,
                pp_first_stage_less_layers=args.pp_first_less_layers,
                pp_last_stage_less_layers=args.pp_last_less_layers,
            )
        except (ValueError, NotImplementedError) as e:
            ap.error(str(e))
        report.model = name
        reports.append(report)
        if not args.json:
            print(report.table(per_rank=args.per_rank or None, top=args.top), flush=True)
            print(flush=True)
    if args.json:
        json.dump([r.to_dict() for r in reports], sys.stdout, default=str)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
