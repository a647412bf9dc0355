"""The dry run's models: presets of public architectures and the benchmark models, built on
the meta device (a preset, a JSON config or a ``module:function`` factory)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


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
        self.head_dim, self.num_heads = c.hd, c.heads  # what dmuon.set_head_layouts reads
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
        self.num_heads, self.v_head_dim = c.heads, c.v_head_dim  # what set_head_layouts reads
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.hd, c.rope_dim
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
