"""A tiny mixture-of-experts model in torchtitan's layout: ``GroupedExperts`` holds ``w1``/``w3``
as ``(E, hidden, dim)`` and ``w2`` as ``(E, dim, hidden)``; a router picks the top-k experts per
token. The module's class name is what the layout rule recognises (as torchtitan's is)."""

from __future__ import annotations

import torch
from torch import nn

D, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2


class GroupedExperts(nn.Module):
    def __init__(self, dim: int = D, hidden: int = HIDDEN, experts: int = EXPERTS) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` (tokens, dim); ``weights`` (tokens, E): the router's weight of each expert
        (zero where an expert was not chosen). Dense over experts: an expert no token chose
        gets an exactly zero gradient, as a grouped GEMM gives it."""
        h = torch.nn.functional.silu(torch.einsum("td,ehd->teh", x, self.w1))
        h = h * torch.einsum("td,ehd->teh", x, self.w3)
        out = torch.einsum("teh,edh->ted", h, self.w2)
        return torch.einsum("ted,te->td", out, weights)


class MoEBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.router = nn.Linear(dim, EXPERTS, bias=False)
        self.experts = GroupedExperts(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        top = scores.topk(TOP_K, dim=-1)
        weights = torch.zeros_like(scores).scatter(-1, top.indices, top.values)
        return x + self.proj(self.experts(x, weights))


class TinyMoE(nn.Module):
    def __init__(self, layers: int = 2, dim: int = D) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(dim) for _ in range(layers))
        self.norm_w = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.norm_w


def build_moe(seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE()


def expert_batches(model: TinyMoE, steps: int, world: int, per_rank: int = 6, seed: int = 7):
    """``steps`` global batches of ``world × per_rank`` tokens; the last rank's tokens lie along
    the first layer's router rows of experts 0 and 1, so on that rank they reach only those two
    experts (its other experts' gradients are zero there)."""
    g = torch.Generator().manual_seed(seed)
    gate = model.layers[0].router.weight.detach()
    lean = 4.0 * (gate[0] + gate[1]) / (gate[0] + gate[1]).norm()
    out = []
    for _ in range(steps):
        x = torch.randn(world * per_rank, D, generator=g)
        x[-per_rank:] = 0.1 * x[-per_rank:] + lean
        out.append(x)
    return out


def experts_reached(model: TinyMoE, x: torch.Tensor) -> set[int]:
    """The experts of the first layer that some token of ``x`` reaches."""
    with torch.no_grad():
        scores = model.layers[0].router(x).softmax(-1)
    return set(scores.topk(TOP_K, dim=-1).indices.flatten().tolist())
