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
from dmuon_compile.distributed.split_ns import (
    _finish_collectives,
    _GroupComm,
    split_bounds,
    split_dim,
    split_newton_schulz,
)
from dmuon_compile.step_phases import PHASE_SPLIT_NS, guarded


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


def orthogonalize_split(
    u: Tensor | None, split: SplitGroup, ns, like: Tensor, failure: list | None = None
) -> Tensor | None:
    """NS(u) computed by ``split``'s ranks (a member calls it; collective over the group).

    ``u``: the owner's Nesterov input, the whole (out, in) matrix (ignored on the others);
    ``like``: a tensor of the input's dtype and device. Returns NS(u) (the work dtype) on the
    owner, ``None`` on the other members. The pieces travel padded to the longest (scatter and
    gather take equal sizes).

    ``failure``: ``Muon.step``'s list of this rank's failures. An exception in this rank's
    local work (cutting the pieces, its part of the split NS, the result) is appended to it in
    :data:`~dmuon_compile.step_phases.PHASE_SPLIT_NS` and this rank still issues every
    collective of the call (zeros in place of what failed): its peers never wait, and the
    step's agreement makes every rank raise ``MuonStepError`` before anything is written. After
    an earlier failure on this rank (``failure`` non-empty) only the collectives go out. The
    owner's result may then be a placeholder (never committed). Without ``failure`` an
    exception is raised after the collectives (the peers' results are then meaningless)."""
    own = failure if failure is not None else []
    p, owner = len(split.ranks), split.owner_index
    me = dist.get_rank(split.pg)
    bounds = split_bounds(split.shape, p)
    dim = split_dim(split.shape)
    longest = max(b - a for a, b in bounds)
    padded = list(split.shape)
    padded[dim] = longest
    a, b = bounds[me]

    def zeros() -> Tensor:
        return torch.zeros(padded, dtype=like.dtype, device=like.device)

    inputs = None
    if me == owner:
        if not own:
            inputs = guarded(own, PHASE_SPLIT_NS, lambda: _pieces(u, bounds, dim, padded), None)
        if inputs is None:  # failed (here or before): zeros go out, the step aborts
            inputs = [zeros() for _ in bounds]
    piece = torch.empty(padded, dtype=like.dtype, device=like.device)
    what = f"the split Newton–Schulz input of {split.fqn}"
    C.wait(C.scatter(piece, inputs, owner, split.pg), what, split.pg)
    del inputs
    block = piece.narrow(dim, 0, b - a)
    if own:  # failed before (here or earlier in the step): only the collectives go out
        finish_split_collectives(block, ns, split)
        out = None
    else:
        out = guarded(
            own,
            PHASE_SPLIT_NS,
            lambda: split_newton_schulz(
                block, ns, split.pg, full_shape=split.shape, bounds=bounds, finish_on_error=True
            ),
            None,
        )
    send = guarded(own, PHASE_SPLIT_NS, lambda: _padded(out, padded, dim, b - a), None)
    if send is None:
        send = torch.zeros(padded, dtype=_work_dtype(ns, like), device=like.device)
    outputs = [torch.empty_like(send) for _ in bounds] if me == owner else None
    what = f"the split Newton–Schulz result of {split.fqn}"
    C.wait(C.gather(send, outputs, owner, split.pg), what, split.pg)
    if failure is None and own:
        raise own[0][1]
    if me != owner:
        return None
    pieces = [t.narrow(dim, 0, b - a) for t, (a, b) in zip(outputs, bounds)]
    return guarded(own, PHASE_SPLIT_NS, lambda: torch.cat(pieces, dim=dim), u)


def finish_split_collectives(block: Tensor, ns, split: SplitGroup) -> None:
    """The collectives of this member's ``split_newton_schulz`` call without its math (a rank
    that has failed already): zeros sent, its peers' schedule kept."""
    p = len(split.ranks)
    comm = _GroupComm(split.pg, dist.get_rank(split.pg), p)
    _finish_collectives(comm, split.shape, split_bounds(split.shape, p), ns, block.device)


def _pieces(u: Tensor, bounds, dim: int, padded: list[int]) -> list[Tensor]:
    """The owner's input cut into the group's pieces, each padded to the longest."""
    inputs = [u.new_zeros(padded) for _ in bounds]
    for t, (a, b) in zip(inputs, bounds):
        t.narrow(dim, 0, b - a).copy_(u.narrow(dim, a, b - a))
    return inputs


def _padded(out: Tensor | None, padded: list[int], dim: int, length: int) -> Tensor | None:
    """This member's piece of the result, padded for the gather (``None``: failed)."""
    if out is None:
        return None
    send = out.new_zeros(padded)
    send.narrow(dim, 0, length).copy_(out)
    return send


def _work_dtype(ns, like: Tensor) -> torch.dtype:
    """The dtype the split NS returns on ``like``'s device (what every member gathers)."""
    return ns.work_dtype_for(like.device)
