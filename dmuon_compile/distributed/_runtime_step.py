"""The step side of a :class:`~dmuon_compile.distributed._runtime.DedicatedRuntime`: the plan
``Muon.step`` walks, and the HSDP publishes around it.

``step_plan`` names the parts of a step and the runtime's actions around them (drain the
pending updates first; with HSDP, step the group the next forward needs first and publish it at
once, publish the rest last; with TP, the TP stage). The publishes are the replicate
broadcasts of the global owners' new weights; each is a pending update (``_pending.py``) that
the next unshard of its group, or any read of its weights, waits for. ``DedicatedRuntime``
inherits :class:`RuntimeStepSide`; it reads the runtime's ``groups``, ``forward_order``,
``pending``, ``replicated``, ``tp`` and ``record_profile``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from dmuon_compile.distributed.step_plan import PLAIN_STEP, StepPart, StepPlan

if TYPE_CHECKING:
    from dmuon_compile.distributed._dedicated_group import DedicatedGroup


class RuntimeStepSide:
    """The runtime's step plan and HSDP publishes (see the module docstring)."""

    @torch.compiler.disable  # eager and identical on every rank, even under a compiled step
    def publish(self, wait: bool = False) -> None:
        """Issue every group's replicate broadcast (global owners → replicate peers).

        ``wait=False`` keeps the works; each group waits for its own right before its next
        unshard. A publish still in flight is drained first. No-op without HSDP. Collective:
        every rank calls it at the same point. ``Muon(model).step`` calls it; call it yourself
        after writing the global owners' masters outside a step (e.g. loading weights), or
        the other replicas keep the old values until the next step.

        Example::

            dmuon.distributed.dedicated_runtime(model).publish(wait=True)
        """
        self._publish_groups(g for g in self.groups if g.replicate is not None)
        self.pending.publish_due = False
        if wait:
            self.wait_publish()

    def _publish_groups(self, groups) -> None:
        for group in groups:
            self.pending.wait_group(id(group))  # a publish still in flight finishes first
            entry = group.replicate.publish(group.profile if self.record_profile else None)
            self.pending.add(id(group), entry)

    def wait_publish(self) -> None:
        """Apply every pending update: wait for the replicate broadcasts and deferred TP
        scatters in flight (no profile entry: not a forward wait)."""
        self.pending.drain()

    @torch.compiler.disable
    def before_step(self) -> None:
        """The step plan's first action: the masters are a broadcast source until it finished,
        and a step without a forward since the last applies that one's updates first."""
        self.pending.drain()
        self._published_early = set()

    def early_group(self) -> DedicatedGroup | None:
        """The group the next forward unshards first (plan order before any forward ran)."""
        order = self.forward_order or self.groups
        first = order[0] if order else None
        return first if first is not None and first.replicate is not None else None

    def step_plan(self) -> StepPlan:
        """The plan ``Muon.step`` walks (``step_plan.py``): drain first, publish last (HSDP);
        with HSDP and two or more groups, this rank's masters of :meth:`early_group` are stepped
        first and that group is published at once, so its broadcast runs under the rest of the
        step; with TP, the TP stage.

        The parts and actions depend only on state every rank shares (plan, forward order),
        never on what this rank owns, so every rank issues the same collectives at the same
        points: SPMD. Without HSDP and TP: :data:`PLAIN_STEP` (nothing to do around the step).
        Weights a backward without gradient sync kept unsharded are dropped first (the step
        changes them; a syncing backward drops them anyway)."""
        if self.kept:
            self.drop_kept()
        split = self.split
        if not self.replicated and self.tp is None:
            return PLAIN_STEP if not split else StepPlan(split=split)
        parts = (StepPart("all"),)
        group = self.early_group()
        if group is not None and len(self.groups) >= 2:  # one group: nothing to overlap with
            mine = frozenset(id(p.param) for p in group.params if p.owns)
            publish = functools.partial(self._publish_early, group)
            parts = (StepPart("early", mine, after=publish), StepPart("rest"))
        return StepPlan(
            parts, before=self.before_step, finish=self.after_step, tp=self.tp, split=split
        )

    @torch.compiler.disable
    def _publish_early(self, group: DedicatedGroup) -> None:
        """Mid-step (the early part's ``after``): broadcast ``group`` now; :meth:`after_step`
        publishes the rest."""
        self._publish_groups([group])
        self._published_early.add(id(group))

    @torch.compiler.disable
    def after_step(self, wait: bool = False) -> None:
        """The step plan's last action (also when the step raised or skipped): publish the
        weights the early part has not published; ``wait``: wait for them here
        (``Muon(replicate_async=False)``), else leave them in flight for the next forward."""
        early = self._published_early
        self._publish_groups(
            g for g in self.groups if g.replicate is not None and id(g) not in early
        )
        self._published_early = set()
        self.pending.publish_due = False
        if wait:
            self.wait_publish()

    def pending_collectives(self) -> int:
        """Collectives still in flight (unshard, reduce, replicate); 0 after :meth:`wait_all`."""
        n = self.pending.collectives()
        for g in self.groups:
            n += len(g.works) + sum(len(w) for w, *_ in g.pending_reduce)
            if g.replicate is not None:
                n += g.replicate.pending()
        return n
