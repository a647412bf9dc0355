"""Tiny models for the distributed tests: a Llama-like stack and a ModelOutput-returning one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

D, FFN, HEADS, LAYERS = 32, 64, 4, 3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape

        def split(y):  # -1: the local heads when q/k/v are column-parallel (TP)
            return y.view(b, t, -1, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int = D, ffn: int = FFN, heads: int = HEADS) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, ffn)

    def forward(self, x):
        h = x + self.self_attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class TinyLlama(nn.Module):
    def __init__(
        self, dim: int = D, ffn: int = FFN, heads: int = HEADS, layers: int = LAYERS
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, ffn, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, dim, bias=False)

    checkpoint = False  # activation checkpointing (non-reentrant) around each block

    def forward(self, x):
        for block in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.norm(x))


def proj_predicate(name: str, param) -> bool:
    return name.endswith("_proj.weight")


def build_llama(seed: int = 0, **kw) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(**kw)
    with torch.no_grad():  # non-trivial norm weights so AdamW-routed params matter
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batches(steps: int, world: int, per_rank: int = 2, seq: int = 8, dim: int = D, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world * per_rank, seq, dim, generator=g) for _ in range(steps)]


@dataclass
class BlockOutput:
    """A ModelOutput-like dataclass: the test checks hooks keep its type and attributes."""

    hidden: torch.Tensor
    aux: tuple


# A pytree node, as transformers registers its ModelOutput: FSDP2 on torch 2.11 finds the tensors
# of an output by tree_flatten (2.13 also looks into unregistered dataclasses).
torch.utils._pytree.register_dataclass(BlockOutput)


class OutputBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.inner = Block(dim)

    def forward(self, x):
        h = self.inner(x)
        return BlockOutput(hidden=h, aux=(h.mean(),))


class OutputModel(nn.Module):
    def __init__(self, dim: int = D, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(OutputBlock(dim) for _ in range(layers))

    def forward(self, x):
        outs = []
        for block in self.layers:
            out = block(x)
            outs.append(out)
            x = out.hidden
        return outs


def build_dedicated(
    world: int, seed: int = 0, hsdp: bool = False, device: str = "cpu", shards: int = 1
):
    """The Llama-like model with its ``*_proj`` matrices dedicated and FSDP2 on the rest.

    ``hsdp=True`` builds ``world // shards`` replicas of ``shards`` shards each (one by default:
    a ``replicate_mesh`` of size world).
    Returns ``(model, owners)``. Call inside an initialised gloo process group; ``device``: the
    harness's (``"cuda"``: this rank's current CUDA device).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    from .harness import local_device

    model = build_llama(seed=seed).to(local_device(device))
    if hsdp:
        mesh = init_device_mesh(
            device, (world // shards, shards), mesh_dim_names=("replicate", "shard")
        )
        owners = dmuon.dedicate_params(
            model, mesh["shard"], predicate=proj_predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh(device, (world,))
        owners = dmuon.dedicate_params(model, mesh, predicate=proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, owners


def interrupt_forward(model, x, layer: int = 1) -> None:
    """Run ``model(x)`` with a ``KeyboardInterrupt`` raised entering ``layers[layer].mlp``
    (swallowed): collectives and buffers are left as a real interrupt leaves them."""

    def boom(*_):
        raise KeyboardInterrupt(f"simulated interrupt in layers.{layer}")

    handle = model.layers[layer].mlp.register_forward_pre_hook(boom)
    try:
        model(x)
    except KeyboardInterrupt:
        pass
    finally:
        handle.remove()


def owned_masters(model) -> list:
    """``[(fqn, master)]`` of the dedicated weights this rank owns: the registered DTensors'
    whole local tensors (writable in place)."""
    import dmuon_compile as dmuon

    return [
        (n, p.to_local())
        for n, p in dmuon.dedicated_registry.dedicated_parameters(model)
        if p.to_local().numel() == p.numel()
    ]


def owned_grads(model) -> dict:
    """``{fqn: gradient}`` of the dedicated weights this rank owns (the live local tensors)."""
    import dmuon_compile as dmuon

    return {
        n: p.grad.to_local()
        for n, p in dmuon.dedicated_registry.dedicated_parameters(model)
        if p.grad is not None and p.grad.to_local().numel() == p.numel()
    }


# Grouped-query attention, Llama-3 8B's layout at a tiny width: k/v have a quarter of q's heads
# (and rows), the MLP is 3.5× wide. Its hook groups cannot be split evenly over 4+ ranks.
GQA_D, GQA_HEADS, GQA_KV_HEADS, GQA_FFN = 32, 4, 1, 112  # 112 = 3.5 × 32


class GQAAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape

        def split(y):  # -1: the local heads when q/k/v are column-parallel (TP)
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        repeat = q.shape[1] // k.shape[1]  # each k/v head serves `repeat` query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class GQABlock(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.self_attn = GQAAttention(dim, heads, kv_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, ffn)

    def forward(self, x):
        h = x + self.self_attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class GQALlama(nn.Module):
    def __init__(
        self,
        dim: int = GQA_D,
        ffn: int = GQA_FFN,
        heads: int = GQA_HEADS,
        kv_heads: int = GQA_KV_HEADS,
        layers: int = LAYERS,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GQABlock(dim, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_gqa(seed: int = 0, **kw) -> GQALlama:
    torch.manual_seed(seed)
    model = GQALlama(**kw)
    with torch.no_grad():  # non-trivial norm weights so AdamW-routed params matter
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model
