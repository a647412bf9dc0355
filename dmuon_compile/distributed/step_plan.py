"""The plan of one ``Muon.step``: which parts of the Muon groups are stepped, in which order, and
what runs before, between and after them.

The runtime's description of a step to the optimizer, in the runtime's folder (below the
optimizer, which imports it, and beside the stages it names): a model's runtime builds the plan
(``DedicatedRuntime.step_plan``) without seeing the optimizer, and ``Muon.step`` walks it,
calling ``functional`` itself. Every action of a plan issues the same collectives on every rank
(it depends on the owner plan and the forward order, which every rank shares, never on what this
rank owns): the step stays SPMD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from dmuon_compile.distributed._split_step import SplitGroup
    from dmuon_compile.distributed._tp.stage import TPDirections, TPStepHalf


def _nothing() -> None:
    pass


def _publish_nothing(wait: bool) -> None:  # noqa: ARG001 - the signature of StepPlan.finish
    pass


class TPStep(Protocol):
    """The TP stage as ``Muon.step`` drives it (``distributed/_tp/stage.py`` ``TPStage``).

    The step's two halves around the agreement: :meth:`directions` hands the stage a Muon
    group's lists and the optimizer's Newton–Schulz; the stage issues every collective
    (the same on every member of a TP group, also after a local failure) and writes nothing.
    After the agreement, :meth:`commit` (momentum, the scattered updates: applied or queued) or
    :meth:`abort` (drain the scatters) of each half. A TP model's plain weights: stepped where
    :meth:`updates_plain`, then :meth:`broadcast_plain` over the TP group in the commit.
    """

    def directions(
        self,
        group: dict,
        params: list,
        grads: list,
        bufs: list,
        orthogonalize: Callable[[list[Tensor]], list[Tensor]],
        failure: list,
    ) -> TPDirections:
        """The TP matrices' first half (``orthogonalize``: NS on the TP owner's whole matrices,
        returning its input after a failure; failures recorded in ``failure``): the TP half
        (``None`` if none here) and the lists' other matrices."""
        ...

    def commit(self, half: TPStepHalf, defer: bool) -> None:
        """Momentum and updates of a half written (``defer``: the updates may stay queued)."""
        ...

    def abort(self, half: TPStepHalf) -> None:
        """A step not committed: wait for the half's collectives and drop their results."""
        ...

    def orthogonalize(self, mats: list[Tensor], ns) -> list[Tensor]:
        """The eager Newton–Schulz on whole matrices (where ``compile`` is off)."""
        ...

    def updates_plain(self) -> bool:
        """Whether this rank steps the plain weights of a TP model (else receives them)."""
        ...

    def broadcast_plain(self, masters: list[Tensor], bufs: list[Tensor]) -> None:
        """The plain weights and momenta, from the TP rank that steps them to the others."""
        ...


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
    """One step's parts in order, and the actions around them.

    ``Muon.step`` runs ``before()``; then for every part the directions (the TP matrices through
    ``tp.directions``); after the agreement, every part's commit (``tp.commit``) followed by its
    ``after``; the AdamW groups; and last ``finish(wait)`` — also when the step raised or
    skipped.
    """

    parts: tuple[StepPart, ...] = (StepPart("all"),)
    # First: apply the pending updates an earlier step left in flight (the masters are a
    # broadcast source until then, and a second step without a forward reads them).
    before: Callable[[], None] = _nothing
    # Last: publish the new weights (HSDP); ``wait``: wait for the broadcasts here instead of
    # leaving them in flight for the next forward (``Muon(replicate_async=False)``).
    finish: Callable[[bool], None] = _publish_nothing
    # The TP stage (:class:`TPStep`, ``distributed/_tp/stage.py``), or ``None``: its matrices'
    # Nesterov inputs are gathered to their TP owners around Newton–Schulz and the updates
    # scattered back; a TP model's plain weights are stepped on TP rank 0 and broadcast over the
    # TP group.
    tp: TPStep | None = None
    # Matrices whose Newton–Schulz a group of ranks shares (``distributed/_split_step.py``
    # ``SplitGroup``s, in the owner plan's order): stepped before the parts, on every member.
    split: tuple[SplitGroup, ...] = ()


PLAIN_STEP = StepPlan()
"""The plan of a step without a runtime (or one with neither HSDP nor TP): one part, no action."""
