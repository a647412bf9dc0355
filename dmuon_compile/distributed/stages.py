"""Stages: the one seam through which a matrix's Newton–Schulz in ``Muon.step`` reaches other ranks.

A stage (:class:`StepStage`) takes its matrices out of the step's jobs and orthogonalises them
with other ranks: the TP stage (``_stages/tp/stage.py``: Nesterov inputs gathered to each matrix's
TP owner, NS there, the update's shards scattered back), split NS (``_stages/split_step.py``: a
group of ranks shares one owner's NS) and the expert reshard (``_stages/expert_shards.py``: stacks
sharded inside their experts, NS on whole experts). The step's plan lists them in the order every
rank walks them (``step_plan.StepPlan.stages``); a dense model's plan has none, and its step runs
none of their code.

``Muon`` keeps the local math. Per step it hands every stage, in order and eagerly (collectives,
meshes and process groups never enter a traced step), the jobs (:class:`MuonJob`), its
Newton–Schulz (:class:`StepNS`) and the step's failure list, and takes back the jobs' other
matrices and the stage's halves (:class:`StepHalf`). A stage issues every collective of its
walk on every rank whatever happened locally (placeholders after a failure, which it records in
the list) and writes nothing. After the agreement, ``Muon`` commits each half's local tensors
and then calls :meth:`StepStage.commit` of the halves a stage keeps work in (``stage_half``);
a step that does not commit has the agreement call :meth:`StepStage.abort` of them instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from torch import Tensor

from dmuon_compile.distributed._owner.tensor import is_owned, local_of
from dmuon_compile.layouts import whole_expert_shards

# Where a Muon half's finite flags came from (``StepHalf.path``, the agreement's error names it):
# the compiled directions (NS's norms of u = g + μ·buf), the eager directions (NS's output, NaN
# wherever u held a NaN/Inf) or a direct read of the gradient (and the Muon momentum buffer) in
# ``StepAgreement.check_finite``; or the split NS's output, which a group of ranks computed
# (``_stages/split_step.py``: NaN wherever u or a member's piece was).
COMPILED, EAGER, READ, SPLIT = "compiled", "eager", "read", "split"


class MuonJob(NamedTuple):
    """Some of a Muon group's matrices for one part of the plan: what ``Muon._prepare`` hands
    the stages and then the directions (one compiled graph per part and group)."""

    part: str  # the plan's part (``StepPart.name``)
    group: dict
    params: list
    grads: list
    bufs: list  # momentum buffers
    layouts: list  # each matrix's Layout
    moments: list  # NorMuon's second moments (``None`` entries without normuon)

    def split(self, taken: Sequence[bool]) -> tuple[MuonJob, MuonJob]:
        """``(the matrices where taken, the others)``, each in the job's order.

        >>> job = MuonJob("all", {}, ["a", "b"], ["ga", "gb"], [1, 2], [None] * 2, [None] * 2)
        >>> [j.params for j in job.split([False, True])]
        [['b'], ['a']]
        """
        out = []
        for want in (True, False):
            idx = [i for i, t in enumerate(taken) if bool(t) is want]
            out.append(MuonJob(self.part, self.group, *([xs[i] for i in idx] for xs in self[2:])))
        return out[0], out[1]


def local_job(job: MuonJob) -> MuonJob:
    """``job`` with the local tensors of the matrices this rank holds whole (plain tensors pass
    through): a dedicated weight on its owner, an expert stack's local whole experts. Owner
    tensors with no local elements (another rank's) are dropped."""
    kept: tuple[list, list, list, list, list] = ([], [], [], [], [])
    for p, g, b, lay, m in zip(*job[2:]):
        if is_owned(p) or whole_expert_shards(p, lay):
            p, g, b = local_of(p), local_of(g), local_of(b)
            m = None if m is None else local_of(m)
            if p.numel() == 0:
                continue
        for xs, x in zip(kept, (p, g, b, lay, m)):
            xs.append(x)
    return MuonJob(job.part, job.group, *kept)


@dataclass
class StepHalf:
    """What the first half of a step leaves for the commit (or the abort) of some matrices:
    their local tensors and directions (committed by ``Muon``), and, where a stage keeps work of
    its own for after the agreement, that stage and its half (``stage.commit(stage_half)``)."""

    group: dict
    params: list
    grads: list
    bufs: list
    ortho: list | None
    compiled: Any = None  # the directions' CompiledMuonStep (``compiled_step.py``): commits too
    finite: Tensor | None = None  # per matrix of ``grads``: finite? (gradient and momentum)
    layouts: list | None = None  # each matrix's Layout (what NS and the lr rule see)
    matrix_shapes: list | None = None  # whole matrices' shapes when the tensors are shards
    path: str | None = None  # who took ``finite``, when not the half's own NS (SPLIT)
    moments: list | None = None  # NorMuon's second moments (the state), per matrix
    new_moments: list | None = None  # their v′ from the directions, stored by the commit
    # buf′ of each matrix kept from the directions (``Muon(keep_new_momentum=True)``): the
    # commit takes it as the momentum instead of computing it again (``take_kept_momentum``)
    new_bufs: list | None = None
    stage: StepStage | None = None  # the stage that commits or aborts ``stage_half``
    stage_half: Any = None
    # A streamed stored momentum's shape buckets, as [(indices, the bucket's compiled step or
    # None)]: ``Muon(offload="state")`` commits the masters bucket by bucket in them.
    buckets: list | None = None

    def normuon_commit(self) -> dict:
        """The commit's NorMuon arguments (none without it)."""
        if self.new_moments is None:
            return {}
        return {"second_moments": self.moments, "new_second_moments": self.new_moments}


@dataclass(frozen=True)
class StepNS:
    """The optimizer's Newton–Schulz as the stages call it, for one step."""

    ns: Any  # the NewtonSchulz (``Muon.ns``): eager NS, its work dtype and stack size
    # ``compiled(group, mats, part=...)``: the group's compiled step (``compiled_step_for``;
    # ``None`` where ``compile`` is off), its ``orthogonalize`` compiled like the rest of the step.
    compiled: Callable[..., Any]
    # Per direction NS(u): finite? (the eager step's check, ``step_agreement.directions_finite``).
    finite: Callable[[list[Tensor]], Tensor | None]
    # The user's ``torch.compile(opt.step)`` traces this step: the jobs the directions get become
    # local tensors, so a stage whose owners hold whole matrices leaves them to those owners.
    traced: bool = False
    # NorMuon's β₂ and ε (``normuon.NorMuon``; ``None``: off) for a stage that normalises
    # (``StepStage.normuon_ok``).
    normuon: Any = None


class StageDirections(NamedTuple):
    """A stage's first half: the jobs' other matrices (per part, per job) and its halves (per
    part, committed with that part)."""

    jobs: list[list[MuonJob]]
    halves: list[list[StepHalf]]


class StepStage(Protocol):
    """One way a matrix's Newton–Schulz reaches other ranks, as ``Muon.step`` drives it."""

    # What it is, as an error names it. NorMuon refuses a stage (``normuon.refuse_unsupported``)
    # unless its class says ``normuon_ok = True``: its halves come normalised, with their
    # ``moments`` and ``new_moments`` (the expert reshard, TP and split NS all do).
    what: ClassVar[str]
    # A step with this stage may leave its verdict on the device (``Muon._defers``): its commit
    # is the optimizer's elementwise select, with no collective of its own.
    defers: ClassVar[bool]
    # Its commit may leave updates in the runtime's pending-update queue: the plan drains that
    # queue before the next step (``StepSide.plan``).
    queues: ClassVar[bool]
    # It takes the expert stacks sharded inside their experts (``Shard(1)``/``Shard(2)``) to
    # whole experts: without such a stage those stacks cannot be stepped per expert.
    whole_experts: ClassVar[bool] = False

    def directions(self, jobs: list[list[MuonJob]], ns: StepNS, failure: list) -> StageDirections:
        """Take this stage's matrices out of ``jobs`` and compute their directions with the
        other ranks. Every collective goes out on every rank, also after a failure (recorded in
        ``failure``; placeholders are sent); nothing is written."""
        ...

    def commit(self, half: Any, defer: bool) -> None:
        """After the agreement: the stage's own part of a committed half (``defer``: updates
        may stay queued, ``Muon(replicate_async=True)``)."""
        ...

    def abort(self, half: Any) -> None:
        """A step not committed: wait for the half's collectives and drop their results."""
        ...


def no_halves(jobs: list[list[MuonJob]]) -> list[list[StepHalf]]:
    """One empty list of halves per part of ``jobs``."""
    return [[] for _ in jobs]
