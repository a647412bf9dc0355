"""The hooks of a model's dedicated groups: forward unshard with prefetch, reshard, pre-backward
unshard, owner gradient reduce.

One :class:`DedicatedRuntime` per model (``dedicated_registry.runtime_of(model)``). An iteration,
per hook group G, in the forward order recorded on the first forward (the same on every rank, so
every rank issues the collectives in the same order):

forward pre-hook(G)   wait G's unshard (issue it if no prefetch did), prefetch the next group
forward hook(G)       reshard G (not the group whose forward ends last: its backward follows at
                      once); hook "pre-backward(G)" on the output tensors' gradients (the output
                      object itself is never touched)
pre-backward(G)       unshard G again, prefetch the group whose forward ended just before G's (a
                      group enclosing others — a root holding a ``pos_embed`` — ends last, so
                      its backward comes first)
recompute(G)          activation checkpointing runs G's forward hooks inside backward: wait G's
                      unshard only, no prefetch (the groups after G are done)
grad hooks            once G has every gradient — or, for a weight this rank did not use (zeros),
                      once backward reached the output of a group whose forward ended before G's
                      started, or ended — reduce to the owners (async), reshard G, finish the
                      previous group's reduce (one in flight bounds the gradient buffers). Every
                      rank reduces in one order: the groups that ran forward, last started first
end of backward       (autograd callback) wait all reduces: each owned ``param.grad`` holds the
                      full gradient
Muon.step()           NS on this rank's masters, walking the plan of :class:`StepSide`; the next
                      forward's unshard reads the new masters, which publishes them

HSDP adds the replicate stage (``_runtime/replicate.py``): the reduce to owners goes on over the
replicate group to the global owner, and the step ends with the global owners' broadcast of their
new weights, left in flight (``Muon(replicate_async=True)``, the default) as a pending update
(``_comm/pending.py``) that each group applies right before its next unshard. On CUDA a side stream
makes that wait and then issues the unshard, so a prefetch never holds the current group's
forward back. Weights updated by anything but ``Muon(model).step`` (another optimizer, a
parameter-list ``Muon``) are published by the first forward after a synchronising backward.

The hooks run eagerly (``torch.compiler.disable``, as FSDP2's): ``torch.compile`` traces only the
model's math, and Dynamo calls the hooks around it. The reduces follow the ``fully_shard`` module
that would manage each group's weights (:meth:`DedicatedRuntime.follow_fsdp`): its divide factor
and reduce dtype; with its gradient sync off the reduce is skipped and the local gradients
accumulate until the sync step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from enum import Enum, auto

import torch
from torch import Tensor, nn

from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._comm.pending import CommContext, PendingUpdates
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat
from dmuon_compile.distributed._compat.autograd import in_backward, queue_callback
from dmuon_compile.distributed._owner.param import DedicatedParam
from dmuon_compile.distributed._runtime.group import DedicatedGroup, GroupState
from dmuon_compile.distributed._runtime.step import StepSide
from dmuon_compile.distributed._stages.split_step import SplitStage
from dmuon_compile.distributed.owner_plan import OwnerPlan
from dmuon_compile.distributed.step_plan import StepPlan

# HSDP: the groups whose replicate reduces (and column sums) may be in flight in a backward; an
# older one is finished (on CUDA a stream dependency) first, so the sums do not pile up.
REPLICATE_REDUCES_IN_FLIGHT = 2


class RuntimeState(Enum):
    """Where a model's iteration is (FSDP2's ``TrainingState``)."""

    IDLE = auto()  # no backward running, no whole forward waiting for one (also mid-forward)
    FORWARD_DONE = auto()  # the last group's forward ended, no backward yet: copies it kept
    # unsharded may go stale (a step without backward), so the next forward reshards them
    BACKWARD = auto()  # the end-of-backward callback is queued


def iter_tensors(obj, _depth: int = 0) -> Iterator[Tensor]:
    """Tensors inside a module output (tensor, tuple/list, dict/ModelOutput, dataclass)."""
    if _depth > 8:
        return
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):  # includes HuggingFace ModelOutput (an OrderedDict)
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _depth + 1)


def _eager_hook(fn):
    """``fn`` run eagerly, outside any ``torch.compile`` trace (as FSDP2's hooks): a hook issues
    async collectives, reads autograd state and swaps module parameters, none of which belongs
    in a graph."""
    return torch.compiler.disable(fn, recursive=True)


class DedicatedRuntime:
    """The dedicated parameters of one model: plan, groups, hooks, and the step side
    (:class:`StepSide`, ``step_side``) that plans ``Muon.step`` and publishes (HSDP)."""

    def __init__(
        self,
        model: nn.Module,
        plan: OwnerPlan,
        params: list[DedicatedParam],
        groups: list[DedicatedGroup],
        mesh,
        rank: int,
        world: int,
        record_profile: bool,
        replicate_mesh=None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.params = params
        self.groups = groups
        self.mesh = mesh
        self.replicate_mesh = replicate_mesh
        self.rank = rank
        self.world = world
        self.record_profile = record_profile
        self.comm = CommContext()  # its groups and the TP stage share it (``_comm/pending.py``)
        self.step_side = StepSide(groups, self.comm, record_profile)
        self._index: dict[int, int] = {}
        # By forward *end*, the order of backward prefetches: a root group enclosing others ends
        # after them, so its backward comes first.
        self.end_order: list[DedicatedGroup] = []
        self._end_index: dict[int, int] = {}
        # Forward clock: a tick per group forward with gradients; each group's first start and
        # last end since the last backward. A group started after G's forward ended has finished
        # its backward once backward reaches G's output; one nested in G's forward has not.
        self._clock = 0
        self._started_at: dict[int, int] = {}
        self._ended_at: dict[int, int] = {}
        self.state = RuntimeState.IDLE
        self._sync: bool | None = None
        self._reducing: list[DedicatedGroup] = []
        # HSDP: groups whose replicate reduce is in flight, oldest first, at most
        # REPLICATE_REDUCES_IN_FLIGHT; ``replicate_peak``: the most at once (tests).
        self._replicating: list[DedicatedGroup] = []
        self.replicate_peak = 0
        self._reduces_issued = 0  # groups of this backward's reduce order that reduced
        self._order_frozen = False  # forward_order is complete once a backward has run
        self.kept = False  # a backward without sync kept groups unsharded (``drop_kept``)
        self.handles: list = []
        self.replicated = bool(self.step_side.published)
        self.dtype_mismatch: str | None = None  # set by check_compute_dtypes
        self._dtypes_checked = False  # the first forward checks when Muon(model) has not
        self.tp = None  # TP stage (``_stages/tp/stage.py``), set by attach_tp
        # Muon(offload="state"): the owned masters in host memory (``_owner/host_masters.py``)
        self.host_masters = None
        # split-NS groups (``_stages/split_step.py``), set by dedicate_params
        self.split: tuple = ()
        self._split_stage: SplitStage | None = None  # their stage (``stages``)
        self._fsdp_managers: dict[int, dict[str, nn.Module]] | None = None  # see follow_fsdp
        # Wrapped once: torch.compiler.disable would wrap on every forward otherwise.
        self._backward_hooks: dict[int, object] = {}
        self._end_of_backward = _eager_hook(self._post_backward)
        for group in groups:
            group.record_profile = record_profile
            group.comm = self.comm
            self._install(group)
        # state_dict() (and so DCP) reads every weight current.
        self.handles.append(model.register_state_dict_pre_hook(self._before_state_dict))
        if self.replicated:
            # A load (DCP, load_state_dict) writes the global owners' masters on every rank at
            # once: the next forward publishes them.
            self.handles.append(model.register_load_state_dict_post_hook(self._after_load))
            self.comm.watch()

    @property
    def pending(self) -> PendingUpdates:
        """The one queue of pending updates (``self.comm.pending``)."""
        return self.comm.pending

    @property
    def forward_order(self) -> list[DedicatedGroup]:
        """The groups by forward start (first forward): ``self.comm.forward_order``."""
        return self.comm.forward_order

    # ------------------------------------------------------------------ step side
    def step_plan(self) -> StepPlan:
        """The plan ``Muon.step`` walks (:meth:`StepSide.plan`), with this runtime's stages
        (:meth:`stages`). Weights a backward without gradient sync kept unsharded are dropped
        first: the step changes them."""
        if self.kept:
            self.drop_kept()
        return self.step_side.plan(self.stages())

    def stages(self) -> tuple:
        """The ways this model's Newton–Schulz reaches other ranks (``stages.StepStage``), in
        the order every rank walks them: split NS (``_stages.split_step.SplitStage``), then TP."""
        stages: tuple = ()
        if self.split:
            if self._split_stage is None or self._split_stage.groups is not self.split:
                self._split_stage = SplitStage(self.split)  # once per set of groups
            stages += (self._split_stage,)
        if self.tp is not None:
            stages += (self.tp,)
        return stages

    def publish(self, wait: bool = False) -> None:
        """Issue every group's replicate broadcast (global owners → replicate peers).

        ``wait=False`` leaves them in flight; each group waits for its own right before its next
        unshard. A publish still in flight is applied first. No-op without HSDP. Collective:
        every rank calls it at the same point. ``Muon(model).step`` publishes by itself; call it
        after writing the global owners' masters outside a step (e.g. loading weights), or the
        other replicas keep the old values until the next step.

        Example::

            dmuon.distributed.dedicated_runtime(model).publish(wait=True)
        """
        self.step_side.publish(wait)

    def pending_collectives(self) -> int:
        """Collectives still in flight (unshard, reduce, replicate); 0 after :meth:`wait_all`."""
        n = self.pending.collectives()
        for g in self.groups:
            n += len(g.works) + sum(len(r.works) for r in g.pending_reduce)
            if g.replicate is not None:
                n += g.replicate.pending()
        return n

    # ------------------------------------------------------------------ registry API
    def param_names(self) -> list[str]:
        return [p.fqn for p in self.params]

    def owners(self) -> dict[str, int]:
        return {p.fqn: p.owner for p in self.params}

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``[(fqn, registered parameter)]``: the same list on every rank."""
        return [(p.fqn, p.param) for p in self.params]

    def attach_tp(self, stage) -> None:
        self.tp = stage
        stage.record_profile = self.record_profile
        stage.pending = self.pending
        self.comm.watch()  # its deferred scatters are pending updates

    def _before_state_dict(self, *_args, **_kwargs) -> None:
        self.pending.drain()

    def _after_load(self, _module, _incompatible) -> None:
        self.pending.note_write()

    def request_publish(self) -> None:
        """The global owners' masters were written outside a step (a meta-device model's
        initialisation, ``nn.init`` on a dedicated weight; writes through the registered
        parameters are noted by themselves): the next forward publishes them first (HSDP;
        otherwise nothing to do)."""
        self.pending.note_write()

    def check_registered(self) -> None:
        """Every dedicated weight is still the registered parameter of its module (raises with
        the fix when e.g. ``fully_shard`` was applied in a way that took one)."""
        for p in self.params:
            current = p.module._parameters.get(p.attr)
            if current is not p.param and current is not p.unsharded:
                raise RuntimeError(
                    f"{p.fqn} is no longer the dedicated parameter dmuon.dedicate_params "
                    f"registered (found {type(current).__name__}): something replaced it after "
                    "dedicate_params (fully_shard with a torch version whose parameter collection "
                    "dmuon_compile does "
                    "not know, or a reassignment of the weight). Order: dmuon.dedicate_params → "
                    "fully_shard(blocks) → fully_shard(model) → dmuon.Muon(model); do not reassign "
                    "dedicated weights."
                )

    # ------------------------------------------------------------------ hooks
    def _install(self, group: DedicatedGroup) -> None:
        self.handles.append(
            group.module.register_forward_pre_hook(
                _eager_hook(lambda _m, _a, g=group: self._pre_forward(g))
            )
        )
        self.handles.append(
            group.module.register_forward_hook(
                _eager_hook(lambda _m, _a, out, g=group: self._post_forward(g, out)),
                always_call=True,
            )
        )
        self._backward_hooks[id(group)] = _eager_hook(lambda _grad, g=group: self._pre_backward(g))
        for p in group.params:
            self.handles.append(
                p.unsharded.register_post_accumulate_grad_hook(
                    _eager_hook(lambda _t, g=group, p=p: self._on_grad(g, p))
                )
            )

    def _neighbour(self, group: DedicatedGroup, step: int, by_end: bool = False):
        """The group ``step`` places from ``group`` in forward order (``by_end``: in the order
        the forwards ended), or ``None``."""
        order = self.end_order if by_end else self.forward_order
        i = (self._end_index if by_end else self._index).get(id(group))
        if i is None:
            return None
        j = i + step
        return order[j] if 0 <= j < len(order) else None

    def _last_group(self) -> DedicatedGroup | None:
        """The group whose forward ends last, so whose backward comes first: known once the
        order is frozen (a root group enclosing the blocks, else the last block)."""
        return self.end_order[-1] if self._order_frozen and self.end_order else None

    def check_compute_dtypes(self) -> None:
        """Note a dedicated compute dtype FSDP2 does not compute in (``Muon(model)`` calls it,
        and the first forward, for a forward before the optimizer exists): outside autocast the
        forward would then fail deep in ``F.linear``, naming neither."""
        self.follow_fsdp()  # unsupported gradient settings fail at Muon(model), not in backward
        self._note_dtype_mismatch()

    def _note_dtype_mismatch(self) -> None:
        self._dtypes_checked = True
        theirs = _fsdp_compat.compute_dtypes(self.model)
        ours = {g.compute_dtype for g in self.groups}
        if theirs and not ours <= theirs:
            self.dtype_mismatch = (
                f"dmuon_compile: dedicated weights compute in {sorted(map(str, ours))} but "
                f"FSDP2 computes the rest of the model in {sorted(map(str, theirs))}, so "
                "activations and weights meet in different dtypes. Fix: give both the same "
                "dtype, e.g. fully_shard(..., mp_policy=MixedPrecisionPolicy("
                "param_dtype=torch.bfloat16)) next to dmuon.ParamPolicy(defaults="
                "dmuon.MixedPrecision(param_dtype=torch.bfloat16)), or "
                "drop param_policy=; or run the forward under torch.autocast."
            )

    def _pre_forward(self, group: DedicatedGroup) -> None:
        if not self._dtypes_checked:
            self._note_dtype_mismatch()
        if self.dtype_mismatch is not None and not torch.is_autocast_enabled(
            self.groups[0].device.type
        ):
            raise RuntimeError(self.dtype_mismatch)
        if in_backward():
            self._pre_recompute(group)
            return
        # No backward is running: forget one that raised before its end-callback ran.
        self._sync, self._reduces_issued = None, 0
        if self.state == RuntimeState.BACKWARD:
            self.state = RuntimeState.FORWARD_DONE
        if self.pending.publish_due:  # weights written by something other than Muon(model).step
            self.step_side.publish()
        if self.state == RuntimeState.FORWARD_DONE and group is self.forward_order[0]:
            # A forward after a whole one without backward (or that kept its last group): the
            # weights may have changed since, drop the unsharded copies.
            self.state = RuntimeState.IDLE
            for g in self.groups:
                if g.state == GroupState.UNSHARDED:
                    g.reshard()
            self.kept = False
        if id(group) not in self._index:
            self._index[id(group)] = len(self.forward_order)
            self.forward_order.append(group)
        if torch.is_grad_enabled():
            group.ran_forward = True  # its reduce is due
            self._clock += 1
            self._started_at.setdefault(id(group), self._clock)
        group.wait_unshard()
        nxt = self._neighbour(group, +1)
        if nxt is not None and nxt.state == GroupState.SHARDED:
            nxt.unshard(prefetch=True)

    def _pre_recompute(self, group: DedicatedGroup) -> None:
        """Forward pre-hook inside backward (activation-checkpoint recomputation): wait the
        unshard, prefetch nothing — the groups after it are done, and the pre-backward hooks
        prefetch (FSDP2 skips its forward hooks in recomputation too)."""
        if not group.ran_forward:
            # Reentrant checkpointing ran the forward without gradients: no reduce is due, the
            # gradients would be dropped. Fail on every rank alike.
            raise RuntimeError(
                f"dmuon_compile: dedicated hook group {group.name!r} is recomputed in backward "
                "but its forward did not run with gradients in this iteration: reentrant "
                "activation checkpointing is not supported (its dedicated weights would get no "
                "gradient). Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                "checkpoint_wrapper with its default CheckpointImpl.NO_REENTRANT."
            )
        group.wait_unshard()

    def _post_forward(self, group: DedicatedGroup, output) -> None:
        if not in_backward():
            if id(group) not in self._end_index:
                self._end_index[id(group)] = len(self.end_order)
                self.end_order.append(group)
            if torch.is_grad_enabled():
                self._ended_at[id(group)] = self._clock
            if group is self._last_group():
                self.state = RuntimeState.FORWARD_DONE
        if not torch.is_grad_enabled():
            group.reshard()  # no backward follows: keep no weights a step could stale
            return
        if not group.reshard_after_forward or in_backward():
            # Recomputation inside backward: the weights are about to be used; the
            # end-of-backward callback frees them.
            return
        hooked = [t for t in iter_tensors(output) if t.requires_grad]
        if not hooked:
            return  # nothing would trigger the backward unshard: keep it until backward ends
        for t in hooked:
            t.register_hook(self._backward_hooks[id(group)])
        if group is self._last_group():
            # Its backward comes next: a reshard would only add an exposed all-gather (FSDP2
            # keeps its root unsharded for the same reason).
            return
        group.reshard()

    def _queue_backward_end(self) -> None:
        if self.state != RuntimeState.BACKWARD:
            self.state = RuntimeState.BACKWARD
            queue_callback(self._end_of_backward)

    def _pre_backward(self, group: DedicatedGroup) -> None:
        self._queue_backward_end()
        # Backward reached G's output: the groups whose forward started after G's ended are
        # done (not those nested in G). Their reduces go out now, also those still waiting for
        # a gradient that will not come (a weight unused here), before G's prefetch: the
        # collective order is the same on every rank whichever weights each rank used.
        if self._sync_on():
            self._issue_reduces(until=self._finished_before(group))
        group.wait_unshard()
        prev = self._neighbour(group, -1, by_end=True)
        if prev is not None and prev.state == GroupState.SHARDED and prev.reshard_after_forward:
            prev.unshard(prefetch=True)

    def _sync_on(self) -> bool:
        if self._sync is None:
            self._sync = self.follow_fsdp()
        return self._sync

    def follow_fsdp(self) -> bool:
        """Give every group the gradient settings of the ``fully_shard`` module that would
        manage its weights were they not dedicated (``_compat.fsdp.managing_module``): divide
        factor and reduce dtype (``DedicatedGroup.follow_fsdp``). Returns whether this backward
        synchronises (``set_requires_gradient_sync``). Reads local state only (no collective);
        settings the dedicated reduce cannot follow raise here, on every rank alike."""
        managers = self._fsdp_managers
        if managers is None:
            managers = {}
            for group in self.groups:
                found = (_fsdp_compat.managing_module(self.model, p.fqn) for p in group.params)
                managers[id(group)] = dict(m for m in found if m is not None)
            if any(managers.values()):  # fully_shard ran: the tree no longer changes
                self._fsdp_managers = managers
        syncs: dict[str, bool] = {}
        for group in self.groups:
            settings = {
                path or "<root>": _fsdp_compat.grad_reduction(module, path or "<root>")
                for path, module in managers[id(group)].items()
            }
            if len(set(settings.values())) > 1:
                raise RuntimeError(
                    f"dmuon_compile: the weights of dedicated group {group.name!r} lie in "
                    f"fully_shard modules with different gradient settings {settings}, but a "
                    "group reduces its weights together. Fix: give those modules the same "
                    "settings, or pass dedicate_params(hook_boundary_predicate=...) so that each "
                    "hook group lies inside one fully_shard module."
                )
            reduction = next(iter(settings.values()), _fsdp_compat.GradReduction())
            group.follow_fsdp(reduction.divide_factor, reduction.reduce_dtype)
            group.keep_after_backward = not reduction.reshard_after_backward
            syncs.update(dict.fromkeys(settings, reduction.sync))
        if len(set(syncs.values())) > 1:
            raise RuntimeError(
                "dmuon_compile: set_requires_gradient_sync differs between fully_shard modules "
                f"that hold dedicated weights ({syncs}); the dedicated gradients of one backward "
                "are reduced all together or not at all. Fix: set it on the root module, "
                "model.set_requires_gradient_sync(flag) (recursive by default)."
            )
        return all(syncs.values())

    def _reduce_order(self) -> list[DedicatedGroup]:
        """The groups whose forward ran this iteration, last first: the backward order, the
        order in which every rank issues their reduces (whichever weights got gradients)."""
        return [g for g in reversed(self.forward_order) if g.ran_forward]

    def _finished_before(self, group: DedicatedGroup) -> int:
        """How many groups at the head of the reduce order have finished their backward when
        backward reaches ``group``'s output: those whose forward started after ``group``'s
        ended. Counted from the head and stopped at the first other one, so a group nested in
        ``group``'s forward (or one without ticks this iteration) is never counted."""
        end = self._ended_at.get(id(group))
        if end is None:
            return 0
        n = 0
        for g in self._reduce_order():
            if self._started_at.get(id(g), end) <= end:
                break
            n += 1
        return n

    def _reset_clock(self) -> None:
        self._clock = 0
        self._started_at.clear()
        self._ended_at.clear()

    def _issue_reduces(self, until: int | None = None, ready: DedicatedGroup | None = None) -> None:
        """Issue, in reduce order, every reduce not issued yet that may go now: the first
        ``until`` groups of the order unconditionally, the others once all their gradients
        arrived (``ready`` just got its last one)."""
        order = self._reduce_order()
        limit = len(order) if until is None else until
        while self._reduces_issued < len(order):
            group = order[self._reduces_issued]
            complete = len(group.grads_ready) == len(group.params)
            if self._reduces_issued >= limit and not complete:
                return
            self._reduces_issued += 1
            group.reduce_grads()
            group.reshard()
            # One reduce in flight, as FSDP2's reduce-scatters: finishing the previous one frees
            # its send buffer (on CUDA a stream dependency, not a host block).
            for other in self._reducing:
                if other is not group:
                    other.finish_reduce()
                    if other.replicate is not None and other.replicate.pending():
                        self._replicating.append(other)
            self._reducing = [group]
            while len(self._replicating) > REPLICATE_REDUCES_IN_FLIGHT:
                self._replicating.pop(0).replicate.finish_reduce()
            if self.replicated:
                alive = sum(1 for g in self.groups if g.replicate and g.replicate.pending())
                self.replicate_peak = max(self.replicate_peak, alive)

    def _on_grad(self, group: DedicatedGroup, param: DedicatedParam) -> None:
        self._queue_backward_end()
        if not self._sync_on():
            return  # gradient accumulation: the grads stay on the unsharded leaves
        group.grads_ready.add(id(param))
        if len(group.grads_ready) == len(group.params):
            self._issue_reduces(until=0)

    def _post_backward(self) -> None:
        self.state = RuntimeState.IDLE  # everything below is resharded anyway
        self._reset_clock()
        self._order_frozen = bool(self.forward_order)
        sync = bool(self._sync)
        if sync:
            # Every group that ran forward reduces, in one order on every rank; weights unused
            # here contribute zeros.
            self._issue_reduces()
        self._reducing, self._replicating = [], []
        self._sync = None
        self._reduces_issued = 0
        for group in self.groups:
            group.drain()
            if not sync and group.keep_after_backward and group.state == GroupState.UNSHARDED:
                # FSDP2's set_reshard_after_backward(False): the next micro-batch uses them
                # again (a step drops them first: ``drop_kept``).
                self.kept = True
            elif group.state == GroupState.UNSHARDED or group.reshard_after_forward is False:
                group.reshard()
            if group.reduced:
                # A zero-row gradient where this rank owns none: every rank's parameters() have
                # gradients alike, so clipping and the optimizer issue the same collectives.
                for p in group.params:
                    if not p.owns and p.param.grad is None:
                        p.accumulate_grad(None)
                group.reduced = False
            if sync:
                group.ran_forward = False
        if sync and self.replicated:
            self.pending.note_write()

    def reduce_accumulated(self) -> None:
        """Reduce now, as the end of a synchronising backward would, the gradients that
        backwards without gradient sync left on the compute copies: a pipeline stage runs every
        micro-batch's backward with sync off and then reduces FSDP2's gradients by hand (torch's
        ``PipelineStage.perform_reduce_grad``, which ``integrations.torchtitan`` extends with
        this call). Collective over the data-parallel ranks; nothing to do while sync is off or
        when no forward with gradients ran since the last synchronising backward."""
        if in_backward():
            raise RuntimeError("dmuon_compile: reduce_accumulated() runs after backward, not in it")
        if not any(g.ran_forward for g in self.groups) or not self.follow_fsdp():
            return
        self._sync = True
        self._post_backward()

    def pass_unfinished(self) -> bool:
        """Whether a forward with gradients or a backward began and did not finish its
        synchronising backward: what an exception in forward or backward leaves (local state
        only). False right after a step, and after forwards without gradients that ended."""
        return (
            self.state == RuntimeState.BACKWARD
            or self._reduces_issued > 0
            or any(
                g.ran_forward or g.pending_reduce or g.state == GroupState.UNSHARDING
                for g in self.groups
            )
        )

    def process_groups(self) -> list:
        """The process groups this model's collectives go over: the meshes' (FSDP2's too, when
        it shards over the same mesh), the dedicated groups', HSDP's replicate and TP's."""
        groups = list(self.mesh.get_all_groups())
        if self.replicate_mesh is not None:
            groups += self.replicate_mesh.get_all_groups()
        for group in self.groups:
            groups.append(group.pg)
            if group.replicate is not None:
                groups.append(group.replicate.pg)
        if self.tp is not None:
            groups.append(self.tp.pg)
        groups += [split.pg for split in self.split if split.pg is not None]
        return groups

    def discard_backward(self) -> None:
        """Drop every gradient still in flight or on the compute copies (``Muon.zero_grad``).

        After an exception in forward or backward, issued reduces would otherwise land on the
        owners' gradients later, and local gradients join the next backward's. The collectives
        in flight are waited for until finished (not only ordered on the CUDA stream: a rank
        that never issued its part makes this raise by the group timeout instead of letting the
        next step's collectives mispair) and dropped; the last step's HSDP publish is kept (it
        carries weights). Cheap when nothing is pending.
        """
        for group in self.groups:
            if group.state == GroupState.UNSHARDING:
                for w in group.works:  # finished for real, as the reduces below (pairing)
                    C.wait_finished(w, f"the unshard of dedicated group {group.name!r}", group.pg)
                group.wait_unshard()
            group.discard_reduces()
            for p in group.params:
                p.unsharded.grad = None
            group.grads_ready.clear()
            group.reduced = False
            group.ran_forward = False
            group.reshard()
        self.state, self._sync, self._reducing = RuntimeState.IDLE, None, []
        self._replicating = []
        self._reduces_issued = 0
        self._reset_clock()

    @torch.compiler.disable
    def drop_kept(self) -> None:
        """Reshard the groups a backward without gradient sync kept unsharded (FSDP2's
        ``set_reshard_after_backward(False)``): the step is about to change their weights."""
        for group in self.groups:
            if group.state == GroupState.UNSHARDED:
                group.reshard()
        self.kept = False

    # ------------------------------------------------------------------ draining
    def wait_all(self) -> None:
        """Finish every collective in flight and free every unsharded buffer."""
        self.pending.drain()
        for group in self.groups:
            group.drain()
            group.reshard()
            group.grads_ready.clear()
        self.state, self._sync, self._reducing = RuntimeState.IDLE, None, []  # all resharded
        self._replicating = []
        self._reduces_issued = 0
        self._reset_clock()
