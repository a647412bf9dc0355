"""The plan of one ``Muon.step``: which parts of the Muon groups are stepped, in which order, and
what runs before, between and after them.

Below both the optimizer and the runtime: a model's runtime builds the plan
(``DedicatedRuntime.step_plan``) without seeing the optimizer, and ``Muon.step`` walks it,
calling ``functional`` itself. Every action of a plan issues the same collectives on every rank
(it depends on the owner plan and the forward order, which every rank shares, never on what this
rank owns): the step stays SPMD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dmuon_compile.distributed._split_step import SplitGroup
    from dmuon_compile.distributed._tp.stage import TPStage


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
    """One step's parts in order, and the actions around them.

    ``Muon.step`` runs ``before()``; then for every part the directions (the TP matrices:
    momentum, ``tp.gather``, Newton–Schulz, ``tp.scatter``); after the agreement, every part's
    commit followed by its ``after``; the AdamW groups; and last ``finish(wait)`` — also when
    the step raised or skipped.
    """

    parts: tuple[StepPart, ...] = (StepPart("all"),)
    # First: apply the pending updates an earlier step left in flight (the masters are a
    # broadcast source until then, and a second step without a forward reads them).
    before: Callable[[], None] = _nothing
    # Last: publish the new weights (HSDP); ``wait``: wait for the broadcasts here instead of
    # leaving them in flight for the next forward (``Muon(replicate_async=False)``).
    finish: Callable[[bool], None] = _publish_nothing
    # The TP stage (``distributed/_tp/stage.py``), or ``None``: its matrices' Nesterov inputs are
    # gathered to their TP owners around Newton–Schulz and the updates scattered back; a TP
    # model's plain weights are stepped on TP rank 0 and broadcast over the TP group.
    tp: TPStage | None = None
    # Matrices whose Newton–Schulz a group of ranks shares (``distributed/_split_step.py``
    # ``SplitGroup``s, in the owner plan's order): stepped before the parts, on every member.
    split: tuple[SplitGroup, ...] = ()


PLAIN_STEP = StepPlan()
"""The plan of a step without a runtime (or one with neither HSDP nor TP): one part, no action."""
