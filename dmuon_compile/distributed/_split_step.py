"""Split Newton–Schulz inside ``Muon.step``: a matrix the owner plan split over a group of ranks.

The owner holds the whole weight, its reduced gradient and its momentum, as for any dedicated
matrix. In the step it computes the Nesterov input, scatters its pieces to the group, the group
orthogonalises it together (:func:`~dmuon_compile.distributed.split_ns.split_newton_schulz`)
and the pieces of the result are gathered back to the owner, which commits as usual. Every rank
walks the split matrices in the plan's order and takes part in those of its groups: the same
collectives in the same order on every member (SPMD). A rank that failed earlier in the step
still sends (zeros as the owner's input), so its peers never wait on it; the step then aborts
everywhere at the agreement.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed import _collectives as C
from dmuon_compile.distributed.owner_plan import OwnerPlan
from dmuon_compile.distributed.split_ns import split_bounds, split_dim, split_newton_schulz


@dataclass(frozen=True)
class SplitGroup:
    """One split matrix and the ranks that orthogonalise it."""

    fqn: str
    param_id: int  # ``id`` of its registered parameter (the optimizer's key)
    shape: tuple[int, int]  # (out, in)
    ranks: tuple[int, ...]  # global ranks, ascending: the group's rank order
    owner: int  # global rank of the owner
    pg: dist.ProcessGroup | None = None  # the group's process group; None on ranks outside it

    @property
    def owner_index(self) -> int:
        return self.ranks.index(self.owner)


def build_split_groups(
    plan: OwnerPlan,
    params: dict[str, object],
    rank_grid,
    timeout: datetime.timedelta | None = None,
) -> tuple[SplitGroup, ...]:
    """The plan's split matrices with their process groups, in the plan's (name) order.

    ``params``: fqn → registered parameter; ``rank_grid``: global rank of each (replica, shard)
    plan slot. Collective over the world: every rank calls it, and ``new_group`` runs for every
    distinct group in the same order on every rank.
    """
    entries = [e for e in plan.entries if getattr(e, "split_ranks", ())]
    if not entries:
        return ()
    width = rank_grid.shape[1]

    def global_rank(slot: int) -> int:
        return int(rank_grid[slot // width, slot % width])

    me = dist.get_rank()
    groups: dict[tuple[int, ...], tuple[tuple[int, ...], object]] = {}
    for block in sorted({tuple(e.split_ranks) for e in entries}):
        ranks = tuple(sorted(global_rank(s) for s in block))
        pg = dist.new_group(ranks=list(ranks), timeout=timeout or C.default_timeout())
        groups[block] = (ranks, pg if me in ranks else None)
    out = []
    for e in entries:
        ranks, pg = groups[tuple(e.split_ranks)]
        shape = (int(e.shape[0]), int(e.shape[1]))
        out.append(SplitGroup(e.fqn, id(params[e.fqn]), shape, ranks, global_rank(e.owner), pg))
    return tuple(out)


def orthogonalize_split(u: Tensor | None, split: SplitGroup, ns, like: Tensor) -> Tensor | None:
    """NS(u) computed by ``split``'s ranks (a member calls it; collective over the group).

    ``u``: the owner's Nesterov input, the whole (out, in) matrix (ignored on the others);
    ``like``: a tensor of the input's dtype and device. Returns NS(u) (the work dtype) on the
    owner, ``None`` on the other members. The pieces travel padded to the longest (scatter and
    gather take equal sizes)."""
    p, owner = len(split.ranks), split.owner_index
    me = dist.get_rank(split.pg)
    bounds = split_bounds(split.shape, p)
    dim = split_dim(split.shape)
    longest = max(b - a for a, b in bounds)
    padded = list(split.shape)
    padded[dim] = longest
    inputs = None
    if me == owner:
        inputs = [u.new_zeros(padded) for _ in bounds]
        for t, (a, b) in zip(inputs, bounds):
            t.narrow(dim, 0, b - a).copy_(u.narrow(dim, a, b - a))
    piece = torch.empty(padded, dtype=like.dtype, device=like.device)
    what = f"the split Newton–Schulz input of {split.fqn}"
    C.wait(C.scatter(piece, inputs, owner, split.pg), what, split.pg)
    del inputs
    a, b = bounds[me]
    out = split_newton_schulz(
        piece.narrow(dim, 0, b - a), ns, split.pg, full_shape=split.shape, bounds=bounds
    )
    send = out.new_zeros(padded)
    send.narrow(dim, 0, b - a).copy_(out)
    outputs = [torch.empty_like(send) for _ in bounds] if me == owner else None
    what = f"the split Newton–Schulz result of {split.fqn}"
    C.wait(C.gather(send, outputs, owner, split.pg), what, split.pg)
    if me != owner:
        return None
    return torch.cat([t.narrow(dim, 0, b - a) for t, (a, b) in zip(outputs, bounds)], dim=dim)
