"""The plan of one ``Muon.step``: which parts of the Muon groups are stepped, in which order, the
stages through which their Newton–Schulz reaches other ranks, and what runs before, between and
after them.

The runtime's description of a step to the optimizer, in the runtime's folder (below the
optimizer, which imports it, and beside the stages it names): a model's runtime builds the plan
(``DedicatedRuntime.step_plan``) without seeing the optimizer, and ``Muon.step`` walks it,
calling ``functional`` itself. Every action of a plan issues the same collectives on every rank
(it depends on the owner plan and the forward order, which every rank shares, never on what this
rank owns): the step stays SPMD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from dmuon_compile.distributed.stages import StepStage
    from dmuon_compile.layouts import Layout


def _nothing() -> None:
    pass


def _publish_nothing(wait: bool) -> None:  # noqa: ARG001 - the signature of StepPlan.finish
    pass


@dataclass(frozen=True)
class StepPart:
    """Some of each Muon group's matrices, stepped (directions, then commit) together."""

    name: str  # the compiled step's part (``StepKey``): "all", or HSDP's "early" / "rest"
    # ``id`` of the parameters in this part (this rank's masters); ``None``: every Muon matrix
    # no earlier part took.
    params: frozenset[int] | None = None
    # After the part's commit, on every rank (HSDP: publish the group the next forward
    # unshards first, so its broadcast runs under the rest of the step).
    after: Callable[[], None] | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step's parts in order, the stages, and the actions around them.

    ``Muon.step`` runs ``before()``; then every stage's directions (``stages``, in order, over
    every part's jobs) and the directions of the matrices left; after the agreement, every part's
    commit (the stages' halves through ``stage.commit``) followed by its ``after``; the AdamW
    groups; and last ``finish(wait)`` — also when the step raised or skipped.
    """

    parts: tuple[StepPart, ...] = (StepPart("all"),)
    # First: apply the pending updates an earlier step left in flight (the masters are a
    # broadcast source until then, and a second step without a forward reads them).
    before: Callable[[], None] = _nothing
    # Last: publish the new weights (HSDP); ``wait``: wait for the broadcasts here instead of
    # leaving them in flight for the next forward (``Muon(replicate_async=False)``).
    finish: Callable[[bool], None] = _publish_nothing
    # The ways Newton–Schulz reaches other ranks (``stages.StepStage``), in the order every rank
    # walks them: split NS (``_stages.split_step.SplitStage``), the TP stage
    # (``_stages.tp.stage.TPStage``), the expert reshard
    # (``_stages.expert_shards.ExpertReshardStage``). None on a dense model.
    stages: tuple[StepStage, ...] = ()

    def adding(self, *stages: StepStage) -> StepPlan:
        """This plan with ``stages`` walked after its own."""
        return dataclasses.replace(self, stages=(*self.stages, *stages))


PLAIN_STEP = StepPlan()
"""The plan of a step without a runtime (or one with neither HSDP nor TP): one part, no action."""


# ``Muon(expert_ns=...)``: where HSDP replicates expert stacks, each replica orthogonalises its
# copy, or the replicas split the experts and all-gather the results (each expert once per job).
EXPERT_NS = ("per_replica", "once")


def expert_stage(
    matrices: list[tuple[Tensor, Layout]], expert_ns: str = "per_replica"
) -> StepStage | None:
    """The expert reshard stage (``_stages.expert_shards.ExpertReshardStage``) of ``matrices``
    (every Muon matrix with its layout: the optimizer's routing decides the layouts, so the
    optimizer asks, once per set of matrices), or ``None`` when none of them is an expert stack
    sharded inside its experts — nor, with ``expert_ns="once"``, replicated over HSDP's replicate
    dim: a dense model's step never reaches the reshard's code.

    >>> import torch
    >>> from dmuon_compile.layouts import Layout
    >>> expert_stage([(torch.zeros(2, 3), Layout.matrix())]) is None
    True
    """
    from dmuon_compile.layouts import needs_reshard, replicated_stack, whole_expert_shards

    once = expert_ns == "once"
    stacks = frozenset(
        id(p)
        for p, lay in matrices
        if needs_reshard(p, lay)
        or (once and whole_expert_shards(p, lay) and replicated_stack(p, lay))
    )
    if not stacks:
        return None
    from dmuon_compile.distributed._stages.expert_shards import ExpertReshardStage

    return ExpertReshardStage(stacks, tuple(matrices), split_replicas=once)
