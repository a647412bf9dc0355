"""``Muon``: the optimizer users construct. A thin ``torch.optim.Optimizer`` over ``functional``.

Matrices chosen for Muon (dedicated parameters, or by the routing rule below) get
momentum → Newton–Schulz → scaled update; every other parameter gets AdamW in the same
optimizer, so one ``step()``, one ``state_dict()`` and one LR scheduler drive both.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon_compile import functional as F
from dmuon_compile.distributed import _collectives as C
from dmuon_compile.distributed._collectives import scalar_device
from dmuon_compile.distributed._owned import is_owned, local_of, same_layout
from dmuon_compile.newton_schulz import resolve_ns_backend, set_active_ns
from dmuon_compile.routing import HEAD_NAMES, default_muon_predicate, routing_module  # noqa: F401
from dmuon_compile.routing import route_model as _route_model
from dmuon_compile.step_phases import (  # noqa: F401 - the phases' names, where users look
    PHASE_CHECK,
    PHASE_COMPILED,
    PHASE_EAGER,
    PHASE_STATE,
    PHASE_TP_MOMENTUM,
    PHASE_TP_NS_COMPILED,
    PHASE_TP_NS_EAGER,
    STEP_PHASES,
)
from dmuon_compile.trace_labels import NS, STEP, label

if TYPE_CHECKING:
    from dmuon_compile.compiled_step import CompiledMuonStep, StepKey

NONFINITE_MODES = ("raise", "skip")


class MuonStepError(RuntimeError):
    """Raised by ``Muon.step`` on every rank when the step failed on some rank (an exception
    in its local work: OOM, a compile or autotune error, ...). ``failed`` maps each failing rank
    to its phase; on a failing rank the original exception is the ``__cause__``. No weight and
    no optimizer state changed on any rank, and every rank left the same collectives behind:
    ``opt.zero_grad()`` on every rank and training goes on (the batch is skipped)."""

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for everything else, in one optimizer.

    Args:
        params: an ``nn.Module`` (``dmuon.Muon(model, ...)``, the usual way), an iterable of
            parameters, or param groups. With a module, dedicated parameters (see
            ``dedicate_params``) get Muon, others by ``predicate`` or the default rule
            (≥2-D weights except embeddings and output heads). With plain parameters, ≥2-D
            tensors get Muon; a group may set ``use_muon`` explicitly.
        lr: Muon learning rate (default 0.02).
        momentum: Muon momentum μ (default 0.95).
        nesterov: Nesterov momentum (default True).
        weight_decay: decoupled weight decay for Muon matrices (default 0).
        ns_backend: ``"gram"`` (default), ``"direct"`` or a ``NewtonSchulz``.
        adjust_lr_fn: ``"match_rms_adamw"`` (default, 0.2·√max(m, n)), ``"original"``
            (√max(1, m/n), torch.optim.Muon's default) or ``"none"``.
        predicate: ``predicate(name, param) -> bool`` choosing Muon matrices (module input only).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters for the
            other parameters (defaults 3e-4, (0.9, 0.95), 1e-8, 0).
        nonfinite_grads: ``"raise"`` (default) raises ``FloatingPointError`` naming the
            parameters with NaN/Inf gradients before anything is updated; ``"skip"`` warns and
            skips the whole step (weights and state unchanged).
        replicate_async: with HSDP (``dedicate_params(..., replicate_mesh=...)``) publish new
            weights to the other replicas asynchronously, overlapping the next forward
            (default True); no effect without a replicate mesh.
        compile: run the Muon matrices' step as one ``torch.compile``d graph with the NS-chain
            pass (``dmuon_compile.compiled_step``); ``None`` (default) = on for CUDA
            parameters, off on CPU.
        compile_mode: ``torch.compile`` mode of that step, e.g. ``"reduce-overhead"`` (CUDA
            graphs; keep gradients in place with ``zero_grad(set_to_none=False)``).

    Attributes:
        compiled_steps: the compiled steps (``dmuon_compile.compiled_step.CompiledMuonStep``,
            one graph each) keyed by ``StepKey(group, part)``: the group's position in
            ``param_groups`` and ``"all"`` (HSDP: ``"early"``/``"rest"``). Empty until a
            compiled step runs; kept across ``load_state_dict`` (no recompile).

    Example::

        opt = dmuon.Muon(model, lr=0.02)
        loss = model(x).square().mean(); loss.backward()
        opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        *,
        ns_backend="gram",
        adjust_lr_fn: str = "match_rms_adamw",
        predicate: Callable[[str, Tensor], bool] | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        nonfinite_grads: str = "raise",
        replicate_async: bool = True,
        compile: bool | None = None,
        compile_mode: str | None = None,
    ) -> None:
        _check_nonneg("lr", lr)
        _check_nonneg("weight_decay", weight_decay)
        _check_nonneg("adamw_lr", adamw_lr)
        _check_nonneg("adamw_weight_decay", adamw_weight_decay)
        _check_nonneg("adamw_eps", adamw_eps)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        for i, beta in enumerate(adamw_betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"adamw_betas[{i}] must be in [0, 1), got {beta}")
        if adjust_lr_fn not in F.ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {F.ADJUST_LR_FNS}")
        if nonfinite_grads not in NONFINITE_MODES:
            raise ValueError(
                f"nonfinite_grads={nonfinite_grads!r}: choose one of {NONFINITE_MODES}"
            )

        self.model = params if isinstance(params, nn.Module) else None
        self.ns = resolve_ns_backend(ns_backend)
        set_active_ns(self.ns)
        self.nonfinite_grads = nonfinite_grads
        self.replicate_async = bool(replicate_async)
        from dmuon_compile.compiled_step import check_compile_args  # late: loads the passes

        check_compile_args(compile, compile_mode)
        self.compile, self.compile_mode = compile, compile_mode
        # The compiled Muon steps, one graph each, by StepKey(group position, part): positions
        # survive load_state_dict (it replaces the group dicts, not this attribute).
        self.compiled_steps: dict[StepKey, CompiledMuonStep] = {}
        self._param_names: dict[int, str] = {}
        self._step_check: _StepCheck | None = None  # from _prepare to _agree, within a step

        muon_defaults = dict(
            use_muon=True,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
        )
        adamw_defaults = dict(
            use_muon=False,
            lr=adamw_lr,
            betas=tuple(adamw_betas),
            eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )
        groups = self._build_groups(params, predicate, muon_defaults, adamw_defaults)
        if not groups:
            raise ValueError("Muon got no parameters that require grad")
        _tensor_hypers(groups)
        # ``momentum`` (Muon's μ) as torch's momentum optimizers expose it: OneCycleLR/CyclicLR
        # with cycle_momentum=True (their default) cycle group["momentum"].
        super().__init__(groups, defaults=dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    # ------------------------------------------------------------------ groups
    def _build_groups(self, params, predicate, muon_defaults, adamw_defaults) -> list[dict]:
        if isinstance(params, nn.Module):
            from dmuon_compile.dedicated_registry import runtime_of

            runtime = runtime_of(params)
            if runtime is not None:
                runtime.check_registered()
                runtime.check_compute_dtypes()
            muon, adamw = _route_model(params, predicate)
            if not muon and not self._has_dedicated(params):
                warnings.warn(
                    "Muon: no parameter was routed to Muon (all get AdamW). Check predicate= or "
                    "call dmuon.dedicate_params(model, mesh, predicate=...) first.",
                    stacklevel=3,
                )
            groups = []
            for defaults, named in ((muon_defaults, muon), (adamw_defaults, adamw)):
                if named:
                    self._param_names.update({id(p): n for n, p in named})
                    groups.append(dict(defaults, params=[p for _, p in named]))
            return groups
        if predicate is not None:
            raise ValueError(
                "predicate= needs a model (names); with parameter lists set use_muon per group"
            )
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        groups = []
        for g_index, group in enumerate(params):
            tensors = (
                list(group["params"])
                if not isinstance(group["params"], Tensor)
                else [group["params"]]
            )
            extra = {k: v for k, v in group.items() if k != "params"}
            for p_index, p in enumerate(tensors):
                self._param_names.setdefault(id(p), f"param_groups[{g_index}][{p_index}]")
            if "use_muon" in extra:
                split = {bool(extra["use_muon"]): tensors}
            else:
                split = {
                    True: [p for p in tensors if p.ndim >= 2],
                    False: [p for p in tensors if p.ndim < 2],
                }
            for use_muon, ps in split.items():
                if not ps:
                    continue
                if use_muon and any(p.ndim < 2 for p in ps):
                    raise ValueError(
                        "a group with use_muon=True holds a parameter with fewer than 2 dims"
                    )
                base = muon_defaults if use_muon else adamw_defaults
                groups.append(
                    dict(base, **{k: v for k, v in extra.items() if k != "use_muon"}, params=ps)
                )
        return groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, plus: gradients of dedicated weights still in
        flight are dropped (after an exception in forward or backward, reduces already issued
        would otherwise land on the owners' gradients after this call). Collective when such
        reduces are pending (every rank issued them; they are waited for until finished, also on
        CUDA, or this raises by the group timeout); cheap otherwise.

        The exception must reach every rank: one inside ``step()`` does (``MuonStepError`` on
        every rank); one in forward or backward must happen, or be caught, on every rank.

        Example::

            try:
                loss = model(x).loss; loss.backward(); opt.step()
            except (torch.OutOfMemoryError, dmuon.MuonStepError):
                opt.zero_grad()  # drop this batch on every rank, then go on
        """
        from dmuon_compile.dedicated_registry import runtime_of
        from dmuon_compile.distributed import _fsdp_compat
        from dmuon_compile.distributed._pending import gradient_writes
        from dmuon_compile.distributed._runtime import in_backward

        if self.model is not None and not in_backward():
            _fsdp_compat.finish_aborted_backward(self.model)
        runtime = runtime_of(self.model)
        if runtime is not None:
            runtime.discard_backward()
        with gradient_writes():  # set_to_none=False zeroes gradients, no weight: no publish
            super().zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _has_dedicated(model: nn.Module) -> bool:
        from dmuon_compile.dedicated_registry import dedicated_names

        return bool(dedicated_names(model))  # a rank may own no dedicated matrix: no warning

    def param_name(self, p: Tensor) -> str:
        return self._param_names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")

    # ------------------------------------------------------------------ state
    def _init_group(
        self, group: dict, params: list, grads: list, state_a: list, state_b: list
    ) -> None:
        """Fill the lists with the params that have grads and their state, creating state eagerly.

        torch.optim's convention (lists in, nothing out): under ``torch.compile(opt.step)`` Dynamo
        runs a method of this name eagerly and maps the lists' new items to guarded sources; a
        returned tuple of tensors would fail its ``ConstantVariable`` return path.
        """
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients ({self.param_name(p)})")
            state = self.state[p]
            params.append(p)
            grads.append(p.grad)
            if group["use_muon"]:
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                state_a.append(state["momentum_buffer"])
            else:
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state_a.append(state["exp_avg"])
                state_b.append((state["exp_avg_sq"], state["step"]))

    def _finite_flags(self, grads: list[Tensor]) -> Tensor | None:
        """Per gradient: finite or not, on the device (read on the host by the agreement)."""
        if not grads:
            return None
        norms = torch._foreach_norm([_local(g).float() for g in grads])
        return torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))

    @torch.compiler.disable  # a collective, the step's one host read, Python exceptions: eager
    def _agree(self, failure: list, tp_halves: list) -> bool:
        """Between the two halves of the step: whether to commit (``False``: skip), or raise.

        Every rank's verdict on its gradients (finite?) and on its local work (did it raise,
        in which phase?) goes into the one all-reduce of the step, so every rank commits, skips
        or raises together; before raising or skipping, the TP scatters the step issued are
        waited for and dropped (every member issued them): the ranks' collectives stay paired.
        """
        check, self._step_check = self._step_check, None
        try:
            commit = self._verdict(check.params, check.finite, failure)
        except BaseException:
            self._abort(tp_halves, check.fresh)
            raise
        if not commit:
            self._abort(tp_halves, check.fresh)
        return commit

    def _verdict(self, params: list[Tensor], finite: Tensor | None, failure: list) -> bool:
        bad: list[str] = []
        if not self._grads_differ_across_ranks(params):
            if failure:  # nothing to agree on (one process, or replicated data parallel)
                raise failure[0][1]
            if finite is not None and not bool(finite.all()):  # one host sync per step
                bad = self._nonfinite_names(params, finite)
        else:
            # Shards and owners see different gradients and run different local work: agree on
            # the verdict, or one rank raises/skips while the others enter the next collective.
            rank, world = dist.get_rank(), dist.get_world_size()
            votes = torch.zeros(world + 1, device=scalar_device())
            if finite is not None:
                votes[0:1].copy_((~finite.all()).reshape(1))
            if failure:
                phase = failure[0][0]
                votes[1 + rank] = STEP_PHASES.index(phase) + 1 if phase in STEP_PHASES else -1
            C.wait(
                dist.all_reduce(votes, op=dist.ReduceOp.SUM, async_op=True),
                "Muon.step's agreement on non-finite gradients and failed ranks (all-reduce)",
                dist.distributed_c10d._get_default_group(),
            )
            values = votes.tolist()  # one host sync per step
            failed = {
                r: STEP_PHASES[int(c) - 1] if c > 0 else "an unnamed phase"
                for r, c in enumerate(values[1:])
                if c != 0
            }
            if failed:
                raise _step_error(failed, failure)
            if values[0] > 0:
                bad = (
                    self._nonfinite_names(params, finite)
                    if finite is not None and not bool(finite.all())
                    else []
                ) or ["a gradient held by another rank (see that rank's error)"]
        if bad:
            shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            message = (
                f"non-finite (NaN/Inf) gradient in {shown}. Check whether AdamW alone shows the "
                "same NaN (then the cause is upstream: data, model, dtype); pass "
                "nonfinite_grads='skip' to skip such steps instead."
            )
            if self.nonfinite_grads == "raise":
                raise FloatingPointError("Muon.step: " + message)
            warnings.warn("Muon.step skipped: " + message, stacklevel=5)
            return False
        return True

    def _nonfinite_names(self, params: list[Tensor], finite: Tensor) -> list[str]:
        return [self.param_name(p) for p, ok in zip(params, finite.tolist()) if not ok]

    def _abort(self, tp_halves: list, fresh: list) -> None:
        """A step that does not commit: no state of its own left behind, TP scatters drained."""
        for p in fresh:
            self.state.pop(p, None)
        tp = getattr(_replicated_runtime(self.model), "tp", None)
        for half in tp_halves:
            if half is not None:
                tp.abort(half)

    def _grads_differ_across_ranks(self, params: list[Tensor]) -> bool:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        from dmuon_compile.dedicated_registry import dedicated_names

        if self.model is not None and dedicated_names(self.model):
            return True
        return any(hasattr(p, "to_local") for group in self.param_groups for p in group["params"])

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict`` after checking that the state fits.

        State of a dedicated parameter must have been saved with the same owner and mesh (an
        ``opt.state_dict()`` holds each rank's own view). Anything else — another model, another
        routing, another cluster shape — raises a ``ValueError`` naming the parameter before
        anything is loaded. To resume on another mesh or world size, checkpoint through
        ``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict``), which reshards.

        Example::

            opt.load_state_dict(opt.state_dict())  # same run, same ranks
        """
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)

    def _check_loadable(self, state_dict: dict) -> None:
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"Muon.load_state_dict: the state has {len(saved_groups)} param groups, this "
                f"optimizer {len(self.param_groups)} (Muon + AdamW groups of another model or "
                "routing). Build the optimizer the way the saved run did, or load through "
                "torch.distributed.checkpoint's "
                "set_state_dict, which maps state by parameter name."
            )
        index_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"Muon.load_state_dict: a saved group has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])} (first here: "
                    f"{self.param_name(group['params'][0])}). Load through "
                    "torch.distributed.checkpoint's set_state_dict to map state by name."
                )
            index_to_param.update(zip(saved["params"], group["params"]))
        fix = (
            "Optimizer state of a dedicated parameter only loads where it was saved (same owner, "
            "same mesh). To resume on another cluster shape, save and load with "
            "torch.distributed.checkpoint: state = get_state_dict(model, opt); "
            "dcp.load(state, ...); "
            "set_state_dict(model, opt, model_state_dict=..., optim_state_dict=...)."
        )
        for index, values in state_dict.get("state", {}).items():
            p = index_to_param.get(index)
            if p is None:
                continue
            for key, value in values.items():
                if key == "step" or not isinstance(value, Tensor):
                    continue
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"Muon.load_state_dict: {key} of {self.param_name(p)} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(p.shape)}. {fix}"
                    )
                if is_owned(p) and not (is_owned(value) and same_layout(value, p)):
                    where = (
                        f"{value.device_mesh} {tuple(value.placements)}"
                        if hasattr(value, "placements")
                        else "a plain tensor"
                    )
                    raise ValueError(
                        f"Muon.load_state_dict: {key} of {self.param_name(p)} was saved as "
                        f"{where}; the "
                        f"parameter is {p.device_mesh} {tuple(p.placements)}. {fix}"
                    )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; returns ``closure()``'s loss when a closure is given.

        HSDP (``dedicate_params(..., replicate_mesh=...)``, optimizer built as ``Muon(model)``):
        the step first waits for replicate broadcasts an earlier step left in flight (so two
        ``step()`` calls without a forward in between are safe), and ends — also when it
        skips or raises — by publishing the new dedicated weights to the other replicas:
        left in flight with ``replicate_async=True`` (waited for in the next forward), waited
        for here with ``False``. ``dmuon.wait_all_replicate_broadcasts(model)`` drains them.

        An exception in one rank's part of the step (OOM, a compile or autotune error, ...)
        raises :class:`MuonStepError` on every rank of a sharded or dedicated model, before
        any weight or state changed anywhere: ``opt.zero_grad()`` on every rank and go on.

        Example::

            opt.step(); opt.step()  # safe: the second step drains the first one's publish
        """
        with label(STEP):
            runtime = _replicated_runtime(self.model)
            if runtime is None:
                return self._step(closure)
            runtime.before_step()
            try:
                return self._step(closure, runtime)
            finally:
                runtime.after_step(self.replicate_async)

    def _step(self, closure=None, runtime=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Two halves with one agreement between them (``_agree``): first every Muon matrix's
        # update is computed (nothing written; a failure on this rank is caught and recorded
        # in ``failure``, and the step's collectives still go out), then all ranks agree on
        # non-finite gradients and failures, and only then is anything written. A step that
        # fails on one rank therefore raises on every rank and changes nothing anywhere.
        # Under the user's torch.compile(opt.step) the math is traced on plain local tensors:
        # the owners' and FSDP2's DTensors (meshes, process groups) stay in eager code.
        failure: list = []  # this rank's [(phase, exception)]
        split, early_parts, rest_parts, adamw = self._prepare(
            runtime, torch.compiler.is_compiling(), failure
        )
        halves = [self._muon_directions(*part, failure) for part in early_parts + rest_parts]
        if not self._agree(failure, [h.tp_half for h in halves]):
            return loss  # skipped (nonfinite_grads="skip")
        # HSDP: the first group the next forward needs is committed and published first, so its
        # broadcast runs under the rest of the step instead of in front of the next forward.
        for half in halves[: len(early_parts)]:
            self._commit(half)
        if split:
            runtime.publish_early()
        for half in halves[len(early_parts) :]:
            self._commit(half)
        for group, params, grads, exp_avgs, exp_avg_sqs, steps in adamw:
            F.adamw_update(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
        return loss

    @torch.compiler.disable  # DTensor bookkeeping and state creation stay eager
    def _prepare(self, runtime, local: bool, failure: list):
        """Create state, split the Muon groups (HSDP early part), flag non-finite gradients.

        Returns ``(split, early_parts, rest_parts, adamw)`` and keeps what ``_agree`` reads in
        ``self._step_check`` (the parameters with gradients, their finite flags on the device,
        those whose state this step created: dropped again if the step does not commit).
        ``local=True`` gives local tensors (the owners' whole matrices, FSDP2's shards: AdamW
        is elementwise) instead of DTensors. A failure here is appended to ``failure``; the
        lists then hold placeholders (the gradients): the step only sends them, never commits.
        """
        with_grad = [
            p for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        all_grads = [p.grad for p in with_grad]
        fresh = [p for p in with_grad if not self.state.get(p)]  # state created by this step
        finite = _guarded(failure, PHASE_CHECK, lambda: self._finite_flags(all_grads), None)
        split, early = runtime.early_split() if runtime is not None else (False, set())
        early_parts, rest_parts, adamw = [], [], []
        for group in self.param_groups:
            params, grads, state_a, state_b = [], [], [], []
            if not failure:
                _guarded(
                    failure,
                    PHASE_STATE,
                    lambda g=group, lists=(params, grads, state_a, state_b): self._init_group(
                        g, *lists
                    ),
                    None,
                )
            if failure:
                params = [p for p in group["params"] if p.grad is not None]
                grads = [p.grad for p in params]
                state_a, state_b = list(grads), [(g, None) for g in grads]
            if not group["use_muon"]:
                lists = (params, grads, state_a, [b[0] for b in state_b])
                if local:
                    lists = tuple([local_of(t) for t in xs] for xs in lists)
                adamw.append((group, *lists, [b[1] for b in state_b]))
                continue
            if not split:
                rest_parts.append(("all", group, params, grads, state_a))
                continue
            for part, keep in (("early", True), ("rest", False)):
                idx = [i for i, p in enumerate(params) if (id(p) in early) is keep]
                if idx:
                    picked = ([params[i] for i in idx], [grads[i] for i in idx])
                    (early_parts if keep else rest_parts).append(
                        (part, group, *picked, [state_a[i] for i in idx])
                    )
        if local:
            early_parts, rest_parts = (
                [(part, g, *_owned_locals(ps, gs, bs)) for part, g, ps, gs, bs in parts]
                for parts in (early_parts, rest_parts)
            )
        self._step_check = _StepCheck(with_grad, finite, fresh)
        return split, early_parts, rest_parts, adamw

    def _muon_directions(
        self, part: str, group: dict, params: list, grads: list, bufs: list, failure: list
    ) -> _StepHalf:
        """The first half of Muon for some of a group's matrices (``part`` names the subset:
        one compiled graph each): the compiled step if enabled, else the eager reference.

        Dedicated parameters are owner DTensors (one-rank meshes): the math runs on their local
        tensors (the whole matrix on its owner); ranks that hold no rows of a matrix skip it.
        After a failure on this rank (``failure`` non-empty) only the collectives go out.
        """
        from dmuon_compile.compiled_step import compile_enabled, compiled_step_for

        tp = getattr(_replicated_runtime(self.model), "tp", None)
        tp_half = None
        if tp is not None:  # TP shards: gather → NS on the whole matrix → scatter (``_tp.py``)
            from dmuon_compile.distributed._tp import TPStepCalls

            calls = TPStepCalls(
                self.ns, lambda mats: compiled_step_for(self, group, mats, part="tp"), _guarded
            )
            (params, grads, bufs), tp_half = tp.directions(
                group, params, grads, bufs, failure, calls
            )
        params, grads, bufs = _owned_locals(params, grads, bufs)
        half = _StepHalf(group, params, grads, bufs, None, tp, tp_half)
        if not params or failure:
            return half
        if tp is not None and not tp.updates_plain():
            # Plain weights of a TP model: one master per TP column, stepped on TP rank 0; the
            # other TP ranks take weights and momentum from its broadcast in the commit.
            half.receive_plain = True
            return half

        def directions():
            # Both run functional.muon_directions: compiled (one graph) or called eagerly (also
            # what a user's torch.compile(opt.step) traces).
            compiled = half.compiled = compiled_step_for(self, group, params, part=part)
            hypers = dict(momentum=group["momentum"], nesterov=group["nesterov"])
            with label(NS):
                if compiled is not None:
                    return compiled.directions(grads, bufs, **hypers)
                return F.muon_directions(grads, bufs, ns=self.ns, **hypers)

        if torch.compiler.is_compiling():  # traced: an error raises where torch raises it
            half.ortho = directions()
        else:
            compiling = compile_enabled(self.compile, params)
            half.ortho = _guarded(
                failure, PHASE_COMPILED if compiling else PHASE_EAGER, directions, None
            )
        return half

    def _commit(self, half: _StepHalf) -> None:
        """The second half: momentum and weights written (elementwise, after the agreement)."""
        group = half.group
        if half.tp_half is not None:
            half.tp.commit(half.tp_half, self.replicate_async)
        if half.receive_plain:
            half.tp.broadcast_plain(half.params, half.bufs)
            return
        commit = F.commit_muon_step if half.compiled is None else half.compiled.commit
        commit(
            half.params,
            half.grads,
            half.bufs,
            half.ortho or [],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            adjust_lr_fn=group["adjust_lr_fn"],
        )
        if half.tp is not None:  # TP rank 0's new plain masters and momentum to its column
            half.tp.broadcast_plain(half.params, half.bufs)


@dataclass
class _StepCheck:
    """What ``Muon._prepare`` leaves for ``Muon._agree``, kept on the optimizer: never passed
    through a user-compiled step (the parameters are DTensors, the list lengths change after
    the first step: Dynamo would have to rebuild or guard them)."""

    params: list  # the parameters with gradients
    finite: Tensor | None  # their finite flags, on the device
    fresh: list  # those whose state this step created: dropped if the step does not commit


@dataclass
class _StepHalf:
    """What the first half of a step leaves for the commit (or the abort) of one part."""

    group: dict
    params: list
    grads: list
    bufs: list
    ortho: list | None
    tp: object = None  # the TP stage, when the model has one
    tp_half: object = None  # its half of this part (``_tp.TPStepHalf``)
    receive_plain: bool = False  # plain TP-model weights this TP rank takes from TP rank 0
    compiled: object = None  # the CompiledMuonStep of the directions: it commits too


def _guarded(failure: list, phase: str, compute, placeholder):
    """``compute()``, or on an exception: ``(phase, exception)`` appended to ``failure`` and
    ``placeholder`` returned (``Muon.step``'s agreement then makes every rank raise)."""
    try:
        return compute()
    except Exception as err:  # noqa: BLE001 - re-raised on every rank by the agreement
        failure.append((phase, err))
        return placeholder


def _step_error(failed: dict[int, str], failure: list) -> MuonStepError:
    where = "; ".join(f"rank {r} in {phase}" for r, phase in sorted(failed.items()))
    own = failure[0][1] if failure else None
    cause = f": {type(own).__name__}: {own}" if own is not None else " (see that rank's error)"
    err = MuonStepError(
        f"Muon.step failed on {where}{cause}. Every rank raises this error at the same point; "
        "the step changed no weight and no optimizer state on any rank, and every rank issued "
        "the same collectives: call opt.zero_grad() on every rank and go on (the batch is "
        "skipped), or fix the cause on the failing rank.",
        dict(failed),
    )
    err.__cause__ = own
    return err


def _owned_locals(params: list, grads: list, bufs: list) -> tuple[list, list, list]:
    """Local tensors of the matrices this rank holds whole (plain tensors pass through)."""
    kept: tuple[list, list, list] = ([], [], [])
    for p, g, b in zip(params, grads, bufs):
        if is_owned(p):
            p, g, b = local_of(p), local_of(g), local_of(b)
            if p.numel() == 0:
                continue
        kept[0].append(p)
        kept[1].append(g)
        kept[2].append(b)
    return kept


def _replicated_runtime(model: nn.Module | None):
    """The HSDP/TP runtime ``dedicate_params`` attached to ``model`` (``None`` without either)."""
    from dmuon_compile.dedicated_registry import runtime_of

    runtime = runtime_of(model)
    wanted = getattr(runtime, "replicated", False) or getattr(runtime, "tp", None) is not None
    return runtime if wanted else None


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, the tensor itself otherwise (read directly: ``to_local()``
    is an autograd function call, per gradient and step)."""
    return local_of(t)


HYPER_TENSORS = ("lr", "weight_decay")


def _tensor_hypers(groups: list[dict]) -> None:
    """Each group's ``lr`` and ``weight_decay`` become 0-d float64 CPU tensors of their own.

    torch's compiled-optimizer recipe: an LR scheduler refills a tensor ``lr`` in place, so a
    user-compiled ``opt.step`` sees a new value, not a new constant, and never recompiles (a
    float is guarded by value). Eager steps read them as Python floats (``functional.hyper``):
    the same arithmetic as float groups. ``group["lr"] = 0.01`` (a float) keeps working.
    A tensor the user passed is kept unless another group already holds it (a scheduler
    refills each group's own).
    """
    seen: set[int] = set()
    for group in groups:
        for key in HYPER_TENSORS:
            value = group.get(key)
            if isinstance(value, Tensor) and id(value) not in seen:
                seen.add(id(value))
                continue
            if value is not None:
                group[key] = torch.tensor(float(value), dtype=torch.float64)
                seen.add(id(group[key]))


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} as a Tensor must have one element, got shape {tuple(value.shape)}"
            )
        value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):  # NaN fails the first test
        raise ValueError(f"Muon: {name} must be a finite number >= 0, got {value}")
