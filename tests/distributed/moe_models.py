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


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the gradient is reduce-scattered back (sum). Plain
    c10d collectives: gloo runs them on CUDA tensors too (the multi-rank CUDA tier)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sum(grad, ctx.group), None


class _ScatterSum(torch.autograd.Function):
    """Reduce-scatter (sum) along dim 0 over ``group``; the gradient is all-gathered back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherTokens.forward(ctx, grad, ctx.group), None


def _scatter_sum(x, group):
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class EPGroupedExperts(GroupedExperts):
    """``GroupedExperts`` with its stacks ``Shard(0)`` over an ``ep`` mesh (expert parallelism):
    every rank computes its local experts for all of the ep group's tokens — an all-gather in
    and a reduce-scatter out, the dense equivalent of the all-to-all dispatch — so each local
    expert's gradient sums every ep rank's tokens. An expert no token reached gets zeros."""

    ep_mesh = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        group, r = self.ep_mesh.get_group(), self.ep_mesh.get_local_rank()
        xs = _GatherTokens.apply(x, group)
        ws = _GatherTokens.apply(weights, group)
        # Each local expert's gradient sums the ep group's tokens; FSDP2 over the expert-data-
        # parallel mesh divides by its own size only: 1/ep more makes it the global average
        # (torchtitan sets FSDP2's gradient divide factor instead, a PREMUL_SUM gloo lacks).
        scale = 1.0 / self.ep_mesh.size()
        w1, w2, w3 = (_GradScale.apply(w.to_local(), scale) for w in (self.w1, self.w2, self.w3))
        local = w1.shape[0]
        ws = ws[:, r * local : (r + 1) * local]
        h = torch.nn.functional.silu(torch.einsum("td,ehd->teh", xs, w1))
        h = h * torch.einsum("td,ehd->teh", xs, w3)
        out = torch.einsum("ted,te->td", torch.einsum("teh,edh->ted", h, w2), ws)
        return _ScatterSum.apply(out, group)


def make_expert_parallel(model: TinyMoE, ep_mesh) -> None:
    """Shard every block's expert stacks ``Shard(0)`` over ``ep_mesh`` (torchtitan's EP
    layout), in place; the experts then run :class:`EPGroupedExperts`' forward."""
    from torch.distributed.tensor import DTensor, Shard

    n, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for block in model.layers:
        experts = block.experts
        experts.__class__ = EPGroupedExperts
        experts.ep_mesh = ep_mesh
        for name in ("w1", "w2", "w3"):
            whole = getattr(experts, name).detach()  # the same on every rank (one seed)
            local = whole.chunk(n)[r].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(shard))
