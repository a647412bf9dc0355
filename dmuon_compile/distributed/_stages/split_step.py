"""Split Newton–Schulz inside ``Muon.step``: a matrix the owner plan split over a group of ranks.

The owner holds the whole weight, its reduced gradient and its momentum, as for any dedicated
matrix. In the step it computes the Nesterov input, scatters its pieces to the group, the group
orthogonalises it together (:func:`~dmuon_compile.distributed.split_ns.split_newton_schulz`)
and the pieces of the result are gathered back to the owner, which commits as usual. Every rank
walks the split matrices in the plan's order and takes part in those of its groups: the same
collectives in the same order on every member (SPMD). A rank that failed earlier in the step
still sends (zeros as the owner's input), so its peers never wait on it; the step then aborts
everywhere at the agreement.

NorMuon (``Muon(normuon=True)``, ``normuon.py``): the owner gets the whole Newton–Schulz result
back and holds the whole second moment (a dedicated weight's state), so it normalises there,
right after the gather, as one process does; its half carries ``v′`` to the optimizer's commit
(stored under the step's verdict) and ``v′``'s finiteness joins its flags. No other member
takes part: the split math is unchanged.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile import functional as F
from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._owner.tensor import local_of
from dmuon_compile.distributed.owner_plan import OwnerPlan
from dmuon_compile.distributed.split_ns import (
    _finish_collectives,
    _GroupComm,
    split_bounds,
    split_dim,
    split_newton_schulz,
)
from dmuon_compile.distributed.stages import (
    SPLIT,
    MuonJob,
    StageDirections,
    StepHalf,
    StepNS,
    no_halves,
)
from dmuon_compile.layouts import Layout
from dmuon_compile.normuon import moments_finite, normalize_all
from dmuon_compile.step_phases import PHASE_EAGER, PHASE_SPLIT_NS, guarded
from dmuon_compile.trace_labels import NS, label


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


class _SplitMatrix(NamedTuple):
    """A split matrix found in the step's jobs."""

    group: dict
    param: Tensor
    grad: Tensor
    buf: Tensor
    layout: Layout
    moment: Tensor | None  # NorMuon's second moment (the whole one on the owner; None: off)


@dataclass(frozen=True, eq=False)
class SplitStage:
    """The split matrices of one model as a stage of ``Muon.step`` (``stages.StepStage``):
    ``groups`` in the owner plan's order, built by the runtime (``DedicatedRuntime.step_plan``).
    """

    groups: tuple[SplitGroup, ...]
    what: ClassVar[str] = "split Newton–Schulz (dedicate_params(split_size=...))"
    defers: ClassVar[bool] = True  # the owner's half commits like any other
    queues: ClassVar[bool] = False
    normuon_ok: ClassVar[bool] = True  # the owner normalises the gathered result (module doc)

    def directions(self, jobs: list[list[MuonJob]], ns: StepNS, failure: list) -> StageDirections:
        """The first half of Muon for the split matrices: taken out of ``jobs`` (every part);
        every rank walks them in the plan's order and joins the collectives of its groups; the
        owner gets NS(u) and a half of its own (per Muon group, with the first part).

        Under a user's ``torch.compile(opt.step)`` (``ns.traced``) nothing is taken: the jobs
        become local tensors and each owner runs its matrix's NS whole, the same math, on every
        rank the same. Inside the step's failure guard: an exception in this rank's part (its
        Nesterov input, its piece of a split NS) goes into ``failure`` and every collective still
        goes out, so the agreement raises ``MuonStepError`` everywhere; the owner's half brings
        the finite flags of its NS result (a non-finite piece from any member makes it NaN), as
        the ordinary directions do."""
        halves = no_halves(jobs)
        if ns.traced:
            return StageDirections(jobs, halves)
        wanted = {s.param_id for s in self.groups}
        found: dict[int, _SplitMatrix] = {}
        kept_jobs = []
        for part_jobs in jobs:
            kept = []
            for job in part_jobs:
                taken, rest = job.split([id(p) in wanted for p in job.params])
                for p, g, b, lay, m in zip(*taken[2:7]):
                    found[id(p)] = _SplitMatrix(job.group, p, g, b, lay, m)
                kept.append(rest)
            kept_jobs.append(kept)
        by_group: dict[int, StepHalf] = {}
        for sg in self.groups:
            if sg.pg is None or sg.param_id not in found:  # not a member / no gradient anywhere
                continue
            group, p, g, b, lay, m = found[sg.param_id]
            lp, lg, lb = local_of(p), local_of(g), local_of(b)
            owner = lp.numel() > 0
            u = None
            if owner:
                u = lg  # a placeholder (never committed) when this rank has failed
                if not failure:
                    momentum, nesterov = F.hyper(group["momentum"]), group["nesterov"]
                    u = guarded(
                        failure,
                        PHASE_EAGER,
                        lambda lg=lg, lb=lb: F.nesterov_input([lg], [lb], momentum, nesterov)[0],
                        lg,
                    )
            with label(NS):  # a failure here: recorded, every collective still goes out
                like = lg if owner else lp
                ortho = orthogonalize_split(u, sg, ns.ns, like=like, failure=failure)
            if owner:
                half = by_group.setdefault(
                    id(group), StepHalf(group, [], [], [], [], layouts=[], path=SPLIT)
                )
                for xs, x in zip(
                    (half.params, half.grads, half.bufs, half.ortho, half.layouts),
                    (lp, lg, lb, ortho, lay),
                ):
                    xs.append(x)
                if ns.normuon is not None:  # on the owner's whole result, as one process
                    _normalize_into(half, local_of(m) if m is not None else None, ns, failure)
        for half in by_group.values():
            # The check the ordinary directions get (``ns.finite``): the split result is NaN
            # wherever the gradient, the momentum or any member's piece was not finite. After a
            # failure the agreement raises anyway; a placeholder's flags do not count.
            if not failure:
                half.finite = guarded(
                    failure, PHASE_SPLIT_NS, lambda h=half: _finite_flags(h, ns), None
                )
        halves[0] += by_group.values()
        return StageDirections(kept_jobs, halves)

    def commit(self, half, defer: bool) -> None:  # noqa: ARG002 - the owner's half is Muon's
        """Nothing: the owner's half is committed by the optimizer like any other."""

    def abort(self, half) -> None:  # noqa: ARG002 - every collective was waited for
        """Nothing: every collective of the walk was waited for in :meth:`directions`."""


def _normalize_into(half: StepHalf, v: Tensor | None, ns: StepNS, failure: list) -> None:
    """NorMuon of the owner's last split result in ``half`` (its whole ``v``): the direction
    replaced by ``Ô``, ``v`` and ``v′`` appended to the half's ``moments``/``new_moments``
    (committed by the optimizer). After a failure nothing is computed (never committed)."""
    if half.moments is None:
        half.moments, half.new_moments = [], []
    if failure or v is None:
        return
    o, lay = half.ortho[-1], half.layouts[-1]
    (o,), (new,) = guarded(
        failure,
        PHASE_SPLIT_NS,
        lambda: normalize_all([o], [v], [lay], ns.normuon),
        ([o], [v]),
    )
    half.ortho[-1] = o
    half.moments.append(v)
    half.new_moments.append(new)


def _finite_flags(half: StepHalf, ns: StepNS) -> Tensor:
    """Per matrix of ``half``: its direction finite (``ns.finite``), and with NorMuon its
    ``v′`` (a loaded non-finite ``v``), as ``functional.muon_directions`` flags them."""
    flags = ns.finite(half.ortho)
    if flags is not None and half.new_moments:
        flags = flags & moments_finite(half.new_moments).to(flags.device)
    return flags


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
