"""A small GPT-style byte-level language model for the training demo.

Token embedding + learned position embedding → ``layers`` pre-norm blocks → RMSNorm → untied
``lm_head``. A block is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` with causal
``scaled_dot_product_attention`` over ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and a SwiGLU
MLP (``gate_proj``/``up_proj``/``down_proj``). Blocks live in ``blocks.N`` so owner planning can
group parameters by layer.

Every hidden matrix is named ``*_proj.weight``: :func:`is_matrix_param` (the demo's
``dedicate_params``/Muon predicate) selects exactly those. Embeddings, the head and the norm
gains get AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmuon_compile.train.data import VOCAB_SIZE


@dataclass
class GPTConfig:
    """Model size. ``d_model`` must be divisible by ``heads``."""

    vocab_size: int = VOCAB_SIZE
    seq_len: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: float = 8 / 3  # SwiGLU hidden = ratio·d, rounded up to a multiple of 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "layers", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by heads={self.heads}; pick d_model as "
                f"a multiple of {self.heads} "
                f"(e.g. {self.heads * max(1, round(self.d_model / self.heads))})"
            )

    @property
    def mlp_hidden(self) -> int:
        return 64 * math.ceil(self.mlp_ratio * self.d_model / 64)

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply activations: every ``*_proj`` matrix and the head (the
        embeddings are lookups, the norm gains elementwise)."""
        per_block = 4 * self.d_model**2 + 3 * self.d_model * self.mlp_hidden
        return self.layers * per_block + self.d_model * self.vocab_size

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): ``6·N`` for the ``N`` matmul
        parameters plus ``12·layers·seq_len·d_model`` for the attention scores and their
        weighted sum (the PaLM / nanoGPT convention: full ``seq_len × seq_len`` products, the
        causal mask not discounted)."""
        return 6 * self.matmul_params + 12 * self.layers * self.seq_len * self.d_model


def is_matrix_param(name: str, param: Tensor | None = None, *_args, **_kwargs) -> bool:
    """The demo's predicate for ``dedicate_params`` and ``Muon``: every ``*_proj.weight``.

    Accepts ``(name, param)`` and ignores extra arguments so it fits either calling style.
    """
    return name.endswith("_proj.weight")


class Attention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/o projections."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(z: Tensor) -> Tensor:  # -1: the local heads when q/k/v are column-parallel
            return z.view(b, t, -1, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d, hidden = cfg.d_model, cfg.mlp_hidden
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Byte-level GPT: ``forward(idx)`` → logits ``[B, T, vocab]``, ``loss(idx, targets)`` → mean
    cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2-style init: N(0, 0.02), residual outputs scaled by 1/√(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than the model's seq_len={self.cfg.seq_len}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.embed(idx) + self.pos_embed(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
