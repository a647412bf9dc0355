"""The step side of a runtime: the plan ``Muon.step`` walks, and the HSDP publishes around it.

A :class:`~dmuon_compile.distributed._runtime.runtime.DedicatedRuntime` holds one :class:`StepSide`
(``runtime.step_side``), built from its groups and its comm context only: the step side never
sees the hooks' state. A publish is the replicate broadcast of the global owners' new weights,
queued as a pending update (``_comm/pending.py``) that the group's next unshard, or any read of its
weights, waits for.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from dmuon_compile.distributed.step_plan import PLAIN_STEP, StepPart, StepPlan

if TYPE_CHECKING:
    from dmuon_compile.distributed._comm.pending import CommContext
    from dmuon_compile.distributed._runtime.group import DedicatedGroup
    from dmuon_compile.distributed.stages import StepStage


class StepSide:
    """A runtime's step plan and HSDP publishes.

    ``groups``: the runtime's hook groups in plan order; ``comm``: its comm context (the
    pending-update queue and the forward order); ``record_profile``: count publishes in the
    groups' profiles.
    """

    def __init__(
        self, groups: list[DedicatedGroup], comm: CommContext, record_profile: bool
    ) -> None:
        self.groups = groups
        self.comm = comm
        self.record_profile = record_profile
        self.published = [g for g in groups if g.replicate is not None]  # HSDP's groups
        self._published_early: set[int] = set()  # after_step skips these

    @torch.compiler.disable  # eager and identical on every rank, even under a compiled step
    def publish(self, wait: bool = False) -> None:
        """Issue every group's replicate broadcast; ``wait``: apply them here (see
        ``DedicatedRuntime.publish``)."""
        self._publish(self.published)
        self.comm.pending.publish_due = False
        if wait:
            self.comm.pending.drain()

    def _publish(self, groups) -> None:
        pending = self.comm.pending
        for group in groups:
            pending.wait_group(id(group))  # a publish still in flight finishes first
            entry = group.replicate.publish(group.profile if self.record_profile else None)
            pending.add(id(group), entry)

    @torch.compiler.disable
    def before_step(self) -> None:
        """The plan's first action: the masters are a broadcast source until it finished, and
        a step without a forward since the last applies that one's updates first."""
        self.comm.pending.drain()
        self._published_early = set()

    def early_group(self) -> DedicatedGroup | None:
        """The group the next forward unshards first (plan order before any forward ran)."""
        order = self.comm.forward_order or self.groups
        first = order[0] if order else None
        return first if first is not None and first.replicate is not None else None

    def plan(self, stages: tuple[StepStage, ...] = ()) -> StepPlan:
        """The plan ``Muon.step`` walks (``step_plan.py``): drain first, publish last (HSDP, or
        a stage that queues updates: TP); with HSDP and two or more groups, this rank's masters
        of :meth:`early_group` are stepped first and that group is published at once, so its
        broadcast runs under the rest of the step; ``stages``: the runtime's stages (split NS,
        TP), in the order every rank walks them.

        The plan depends only on state every rank shares (owner plan, forward order), never on
        what this rank owns, so every rank issues the same collectives at the same points.
        Without HSDP and stages: :data:`PLAIN_STEP`.
        """
        if not self.published and not any(stage.queues for stage in stages):
            return PLAIN_STEP if not stages else StepPlan(stages=stages)
        parts = (StepPart("all"),)
        group = self.early_group()
        if group is not None and len(self.groups) >= 2:  # one group: nothing to overlap with
            mine = frozenset(id(p.param) for p in group.params if p.owns)
            publish = functools.partial(self._publish_early, group)
            parts = (StepPart("early", mine, after=publish), StepPart("rest"))
        return StepPlan(parts, before=self.before_step, finish=self.after_step, stages=stages)

    @torch.compiler.disable
    def _publish_early(self, group: DedicatedGroup) -> None:
        self._publish([group])
        self._published_early.add(id(group))

    @torch.compiler.disable
    def after_step(self, wait: bool = False) -> None:
        """The plan's last action (also when the step raised or skipped): publish what the
        early part has not; ``wait``: apply it here (``Muon(replicate_async=False)``), else
        leave it in flight for the next forward."""
        early = self._published_early
        self._publish(g for g in self.published if id(g) not in early)
        self._published_early = set()
        self.comm.pending.publish_due = False
        if wait:
            self.comm.pending.drain()
