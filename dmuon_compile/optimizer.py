"""``Muon``: the optimizer users construct. A thin ``torch.optim.Optimizer`` over ``functional``.

Matrices chosen for Muon (dedicated parameters, or by the routing rule below) get
momentum → Newton–Schulz → scaled update; every other parameter gets AdamW in the same
optimizer, so one ``step()``, one ``state_dict()`` and one LR scheduler drive both.

``Muon`` is one class in torch.optim's shape (``_init_group``, ``step``); it owns its groups and
state and holds three collaborators, none of which imports this module:

- ``_routing`` (:class:`~dmuon_compile.param_groups.GroupRouting`): groups, names, layouts;
- ``_agreement`` (:class:`~dmuon_compile.step_agreement.StepAgreement`): between the step's two
  halves, every rank commits, skips or raises together;
- ``_between`` (:class:`~dmuon_compile.between_steps.BetweenSteps`): ``zero_grad``,
  ``load_state_dict`` and ``restore_dedicated``'s checks and bookkeeping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon_compile import functional as F
from dmuon_compile import normuon as _normuon
from dmuon_compile.between_steps import BetweenSteps
from dmuon_compile.distributed._owner.tensor import OwnerTensor, local_of
from dmuon_compile.distributed.stages import MuonJob, StepHalf, StepNS, StepStage, local_job
from dmuon_compile.distributed.step_plan import EXPERT_NS, PLAIN_STEP, StepPlan, expert_stage
from dmuon_compile.layouts import Layout, needs_reshard, whole_expert_shards
from dmuon_compile.momentum_storage import (
    CODES,
    HOST,
    IN_FLIGHT,
    SCALES,
    STORED_KEYS,
    MomentumStorage,
    check_kept_momentum,
    is_streamed,
    take_kept_momentum,
)
from dmuon_compile.newton_schulz import resolve_ns_backend, set_active_ns
from dmuon_compile.normuon_state import second_moment
from dmuon_compile.param_groups import (
    GroupRouting,
    _check_nonneg,
    _hold_hypers,
    _tensor_hypers,
    plain_hypers,
    restore_hypers,
)
from dmuon_compile.routing import HEAD_NAMES, default_muon_predicate, routing_module  # noqa: F401
from dmuon_compile.step_agreement import (  # noqa: F401 - MuonStepError: the public name
    COMPILED,
    EAGER,
    NONFINITE_MODES,
    FiniteFlags,
    MuonStepError,
    StepAgreement,
    _StepCheck,
    directions_finite,
)
from dmuon_compile.step_phases import (  # noqa: F401 - the phases' names, where users look
    PHASE_CHECK,
    PHASE_COMPILED,
    PHASE_EAGER,
    PHASE_MASTERS,
    PHASE_SPLIT_NS,
    PHASE_STATE,
    PHASE_TP_MOMENTUM,
    PHASE_TP_NS_COMPILED,
    PHASE_TP_NS_EAGER,
    STEP_PHASES,
    guarded,
)
from dmuon_compile.trace_labels import NS, STEP, label

if TYPE_CHECKING:
    from dmuon_compile.compiled_step import CompiledMuonStep, StepKey


class AdamWJob(NamedTuple):
    """An AdamW group's local tensors with gradients, as ``functional.adamw_update`` takes them."""

    group: dict
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    steps: list


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for everything else, in one optimizer.

    Args:
        params: an ``nn.Module`` (``dmuon.Muon(model, ...)``, the usual way), an iterable of
            parameters, or param groups. With a module, dedicated parameters (see
            ``dedicate_params``) get Muon, others by ``predicate`` or the default rule
            (≥2-D weights except embeddings and output heads). Named parameters
            (``model.named_parameters()``, ``(name, p)`` pairs or a group's ``param_names``)
            follow the same rule by name (an ``nn.Embedding`` is recognised by type only with a
            module); with plain parameters, ≥2-D tensors get Muon; a group may set
            ``use_muon`` explicitly.
        lr: Muon learning rate (default 0.02).
        momentum: Muon momentum μ (default 0.95).
        nesterov: Nesterov momentum (default True).
        weight_decay: decoupled weight decay for Muon matrices (default 0).
        ns_backend: ``"gram"`` (default), ``"direct"`` or a ``NewtonSchulz``.
        adjust_lr_fn: ``"match_rms_adamw"`` (default, 0.2·√max(m, n)), ``"original"``
            (√max(1, m/n), torch.optim.Muon's default) or ``"none"``.
        predicate: ``predicate(name, param) -> bool | Layout`` choosing Muon matrices (module
            input only); a ``dmuon.Layout`` also says what a ≥3-D parameter's matrices are.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters for the
            other parameters (defaults 3e-4, (0.9, 0.95), 1e-8, 0).
        nonfinite_grads: ``"raise"`` (default) raises ``FloatingPointError`` naming the
            parameters with NaN/Inf gradients (or Muon momentum buffers, e.g. from a loaded
            state) and which of the two, before anything is updated; ``"skip"`` warns and
            skips the whole step (weights and state unchanged).
        replicate_async: with HSDP (``dedicate_params(..., replicate_mesh=...)``) publish new
            weights to the other replicas asynchronously, overlapping the next forward
            (default True); no effect without a replicate mesh.
        compile: run the Muon matrices' step as one ``torch.compile``d graph with the NS-chain
            pass (``dmuon_compile.compiled_step``); ``None`` (default) = on for CUDA
            parameters, off on CPU.
        compile_mode: ``torch.compile`` mode of that step, e.g. ``"reduce-overhead"`` (CUDA
            graphs; keep gradients in place with ``zero_grad(set_to_none=False)``).
        normuon: NorMuon (``dmuon_compile/normuon.py``): each Muon matrix's update normalised
            per output neuron by a second moment of its rows, its Frobenius norm kept.
            ``False`` (default), ``True`` (β₂ = 0.95, ε = 1e-10) or ``dmuon.NorMuon(beta2=...,
            eps=...)``. State: ``normuon_second_moment`` (fp32, one value per row of each
            matrix). With dedicated weights (tensor-parallel ones and split Newton–Schulz
            included) and expert stacks in any FSDP2/EP/HSDP layout, stacks sharded inside
            their experts and ``expert_ns="once"`` included.
        momentum_dtype: the dtype the Muon momentum is stored in: ``None`` (default, the
            parameter's), ``torch.bfloat16`` (half the momentum's memory and bytes per step;
            μ·buf + g is computed in the gradient's dtype and rounded once to nearest where
            it is stored) or ``torch.int8`` (blockwise 8-bit: a quarter of fp32's memory;
            the step computes in the parameter's dtype, stochastic rounding; see
            ``dmuon_compile.momentum_storage``); names (``"bf16"``, ``"int8"``) work too.
        offload: ``None`` (default) or ``"momentum"``: the Muon momentum lives in host
            memory (pinned) between steps; each step copies it in on a side stream, bucket by
            bucket (``momentum_in_flight``), and the commit keeps the new momentum copied out,
            so the forward and backward run with none of it on the GPU. The same math as on
            the GPU, bit for bit. Combines with ``momentum_dtype``. ``"state"``: the momentum
            so, and the masters of the dedicated weights this rank owns in pinned host memory
            between steps too; the GPU keeps their cast to the forward's dtype (what the
            unshard sends), and the commit brings the masters in (streamed: bucket by
            bucket, after the verdict) and copies the new ones out in place. Needs
            ``Muon(model)`` with dedicated weights computing in a lower dtype than their masters
            (``ParamPolicy(defaults=MixedPrecision(param_dtype=torch.bfloat16))``), 1-D, HSDP,
            TP or split NS (TP and split: the masters copied in all at once; not ``qk_clip``:
            a ``ValueError`` says so); the same bits as on the GPU (docs/memory.md).
            A checkpoint of any of these settings loads into any other (converted at the
            next step): checkpoints hold ``momentum_buffer`` in the parameter's dtype.
        momentum_in_flight: with a stored momentum (8-bit or offloaded): how many shape
            buckets' working momentum the step holds at once (default 2: the bucket whose
            Newton–Schulz runs and the next, copied in or decoded under it on a side stream);
            each bucket's new momentum goes to a shadow of the stored form, which the commit
            keeps. Buckets are Newton–Schulz's (``NewtonSchulz(stack_bytes=...)`` bounds
            them). ``None``: every matrix's working buffer at once, before the first
            Newton–Schulz (the step's peak of an in-place momentum). Steps with tensor
            parallelism, split NS or the expert reshard, and steps traced by the user's
            ``torch.compile``, materialise all at once whatever this says (docs/memory.md).
        per_head: ``True`` runs ``dmuon.set_head_layouts(model)`` first (needs ``Muon(model)``):
            the attention projections it recognises are orthogonalised head by head
            (docs/recipes.md). Default ``False``: layouts as declared.
        expert_ns: where HSDP replicates expert stacks: ``"per_replica"`` (default) — each
            replica orthogonalises its copy of its experts (R replicas: the expert NS R times
            in the job) — or ``"once"``: the replicas split the experts between them and one
            all-gather over the replicate dim (in NS's output dtype) gives each all the
            results; per-rank expert NS falls R×, for that all-gather's bytes (docs/moe.md).
            No effect without expert stacks replicated over a mesh dim.
        keep_new_momentum: ``False`` (default) or ``True``: the step keeps each matrix's new
            momentum buf′ = μ·buf + g from where its Newton–Schulz input is computed until the
            commit, which then swaps it in as the momentum (no copy) instead of reading the
            momentum and the gradient again: 8 fewer bytes per fp32 Muon value per step, for
            one more momentum's worth of memory (4 B per value, fp32) held from the Newton–
            Schulz to the commit. The same bits either way. For the in-place momentum (not
            with ``momentum_dtype="int8"`` or ``offload``, nor ``compile_mode=
            "reduce-overhead"``: a ``ValueError`` names them); a step traced by the user's
            ``torch.compile`` and the matrices a stage steps (tensor parallelism, split NS,
            the expert reshard) compute buf′ in the commit as without it (docs/memory.md).
        qk_clip: ``None`` (default) or τ > 0: QK-clip (MuonClip) after every step, the heads
            whose max attention logit in the last forward exceeded τ get W_q and W_k scaled
            back to τ (``dmuon.QKClip``; needs ``Muon(model)``). The clip is
            :attr:`qk_clip`; its state rides in ``state_dict()`` under ``"qk_clip"``.

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
        normuon: bool | _normuon.NorMuon = False,
        momentum_dtype: torch.dtype | str | None = None,
        offload: str | None = None,
        qk_clip: float | None = None,
        per_head: bool = False,
        expert_ns: str = "per_replica",
        momentum_in_flight: int | None = IN_FLIGHT,
        keep_new_momentum: bool = False,
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
        if per_head:  # before routing reads the layouts
            if self.model is None:
                raise ValueError(
                    "Muon(per_head=True) needs the model (Muon(model, ...)) to find its attention "
                    "modules; with parameters, call dmuon.set_head_layouts(model) first"
                )
            from dmuon_compile.layouts import set_head_layouts

            set_head_layouts(self.model)
        # Where and in what form the Muon momentum lives between steps (momentum_storage.py):
        # in place (the default, bf16), or a stored copy (8-bit, host memory) that each step
        # materialises as working buffers, bucket by bucket (streamed) or all at once.
        self._storage = MomentumStorage(momentum_dtype, offload, momentum_in_flight)
        self._keep_new_momentum = check_kept_momentum(
            keep_new_momentum, momentum_dtype, offload, compile_mode
        )
        self._working: list[tuple[dict, Tensor, str, Tensor]] = []  # all at once: for keep
        self._streams_momentum = False  # this step streams its stored momentum (_prepare)
        # The streamed step's compiled buf′ = μ·buf + g, one graph per kind of bucket (StepKey).
        self._momentum_graphs: dict[StepKey, Callable] = {}
        # The streamed step's kinds of bucket (group, part, shapes, dtypes, layouts) → their
        # number in the StepKey: alike buckets share one compiled graph.
        self._bucket_kinds: dict[tuple, int] = {}
        self.ns = resolve_ns_backend(ns_backend)
        set_active_ns(self.ns)
        self.nonfinite_grads = nonfinite_grads
        self.normuon = _normuon.resolve(normuon)  # None: off
        self.replicate_async = bool(replicate_async)
        self.expert_ns = expert_ns  # validated by the property
        from dmuon_compile.compiled_step import check_compile_args  # late: loads the passes

        check_compile_args(compile, compile_mode)
        self.compile, self._compile_mode = compile, compile_mode
        # The compiled Muon steps, one graph each, by StepKey(group position, part): positions
        # survive load_state_dict (it replaces the group dicts, not this attribute).
        self.compiled_steps: dict[StepKey, CompiledMuonStep] = {}
        # Whether every Muon matrix is compiled (``_defers``), by the groups' sizes.
        self._compiles_all: tuple[tuple, bool] = ((), False)
        # The expert reshard stage of the Muon matrices (``_with_stages``), by their ids.
        self._expert_stage: tuple[tuple, StepStage | None] = ((), None)

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
        # The collaborators (see the module docstring): what add_param_group fills a new group
        # from and the rule that routes it; the step's agreement; the work between steps.
        self._routing = GroupRouting(
            self.model, predicate, {True: muon_defaults, False: adamw_defaults}
        )
        self._agreement = StepAgreement(self)
        self._between = BetweenSteps(self.model)
        # The 0-d tensors a step pre-hook puts back when a scheduler or the user writes a float
        # hyper-parameter into a group, by (group position, key): see ``_hold_hypers``.
        self._held_hypers: dict[tuple[int, str], Tensor] = {}
        groups = self._routing.build(params)
        if not groups:
            raise ValueError("Muon got no parameters that require grad")
        # ``momentum`` (Muon's μ) as torch's momentum optimizers expose it: OneCycleLR/CyclicLR
        # with cycle_momentum=True (their default) cycle group["momentum"].
        self._building = True  # torch's __init__ adds our complete groups through add_param_group
        super().__init__(groups, defaults=dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        self._building = False
        _tensor_hypers(self.param_groups)
        self._hold_hypers_hook = self.register_step_pre_hook(_hold_hypers)
        self.qk_clip = None
        if qk_clip is not None:
            if self.model is None:
                raise ValueError(
                    "Muon(qk_clip=...) needs the model (Muon(model, ...)) to find its attention "
                    "heads; with parameters, attach one yourself: dmuon.QKClip(model, tau)"
                    ".attach(opt)"
                )
            from dmuon_compile.qk_clip import QKClip

            self.qk_clip = QKClip(self.model, qk_clip).attach(self)
        # Per group: where its dedicated weights sit and each parameter's layout, by slot
        # (``restore_dedicated``); an unknown ≥3-D layout raises here, not at step().
        for group in self.param_groups:
            self._between.add_group(group["params"], self._routing.group_layouts(group))
        # offload="state": the owners' masters in host memory between steps (last: every check
        # above passed before any master moves).
        self._host_masters = None
        self._host_masters = self._masters_for(self._storage.offload)

    def _masters_for(self, offload: str | None):
        """The ``HostMasters`` of ``offload="state"`` (offloaded; the model's, if another
        optimizer offloaded them already), else ``None``; raises ``ValueError`` where the model
        cannot hold them so, or where another optimizer left them in host memory."""
        from dmuon_compile.dedicated_registry import runtime_of

        runtime = None if self.model is None else runtime_of(self.model)
        held = None if runtime is None else runtime.host_masters
        if offload != "state":
            if held is not None and held is not self._host_masters:
                raise ValueError(
                    "this model's dedicated masters are in host memory (another optimizer was "
                    "built with offload='state'): build this one with offload='state' too, or "
                    "set offload=None on that one first (it moves them back)"
                )
            return None
        from dmuon_compile.distributed._owner.host_masters import HostMasters, check_supported

        check_supported(runtime, self.qk_clip)
        masters = held if held is not None else HostMasters(runtime)
        masters.offload()
        return masters

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group`` with Muon's defaults: a group without
        ``use_muon`` is routed by the rule the constructor used (a ``Muon(model)``: the model's
        routing; parameters: ≥2-D → Muon), so one call may add two groups (Muon and AdamW).
        Missing hyper-parameters come from this optimizer's Muon or AdamW defaults. ``(name,
        parameter)`` pairs or ``param_names`` name the parameters; on a ``Muon(model)`` the
        model's names are filled in. Errors (a parameter already in a group, a 1-D tensor with
        ``use_muon=True``) raise here, before any group is added.

        Example::

            opt.add_param_group({"params": model.head.parameters(), "use_muon": False})
        """
        if getattr(self, "_building", False):
            super().add_param_group(param_group)
            return
        groups = self._routing.complete(param_group, "add_param_group's group")
        self._routing.name_from_model(groups, self.param_groups)
        held = {id(p) for g in self.param_groups for p in g["params"]}
        for group in groups:
            for p in group["params"]:
                if id(p) in held:
                    raise ValueError(
                        f"Muon.add_param_group: {self.param_name(p)} is already in a param group"
                    )
        if not groups:
            raise ValueError("Muon.add_param_group: the group has no parameters")
        for group in groups:  # an unknown ≥3-D layout raises before any group is added
            self._routing.group_layouts(group)
        for group in groups:
            super().add_param_group(group)  # fills "momentum" into AdamW groups too
            new = self.param_groups[-1]
            _tensor_hypers([new], taken=self.param_groups[:-1])
            self._between.add_group(new["params"], self._routing.group_layouts(new))

    @property
    def compile_mode(self) -> str | None:
        """The compiled step's ``torch.compile`` mode; settable between steps (the next step
        compiles again), checked as the constructor checks it."""
        return self._compile_mode

    @compile_mode.setter
    def compile_mode(self, value) -> None:
        from dmuon_compile.compiled_step import check_compile_args

        check_compile_args(self.compile, value)
        storage = self._storage
        check_kept_momentum(self.keep_new_momentum, storage.dtype, storage.offload, value)
        self._compile_mode = value

    @property
    def keep_new_momentum(self) -> bool:
        """Whether the step keeps buf′ from its directions to the commit
        (``Muon(keep_new_momentum=...)``); settable between steps, checked as the constructor
        checks it."""
        return self._keep_new_momentum

    @keep_new_momentum.setter
    def keep_new_momentum(self, value) -> None:
        storage = self._storage
        self._keep_new_momentum = check_kept_momentum(
            value, storage.dtype, storage.offload, self.compile_mode
        )

    @property
    def momentum_dtype(self) -> torch.dtype | None:
        """The momentum's storage dtype (``None``: the parameter's). Settable, like
        :attr:`offload`, on a live optimizer: the next step converts each matrix's momentum."""
        return self._storage.dtype

    @momentum_dtype.setter
    def momentum_dtype(self, value) -> None:
        storage = MomentumStorage(value, self._storage.offload, self._storage.in_flight)
        check_kept_momentum(self.keep_new_momentum, value, storage.offload, self.compile_mode)
        self._storage.synchronize()  # write-backs in flight land in the old form first
        self._storage = storage

    @property
    def offload(self) -> str | None:
        """Where the momentum lives between steps: ``None`` (its device), ``"momentum"`` or
        ``"state"`` (with the owners' masters). Settable between steps: the masters move at
        once, the momentum at the next step."""
        return self._storage.offload

    @offload.setter
    def offload(self, value) -> None:
        storage = MomentumStorage(self._storage.dtype, value, self._storage.in_flight)
        check_kept_momentum(self.keep_new_momentum, storage.dtype, value, self.compile_mode)
        masters = self._masters_for(storage.offload)  # raises before anything moved
        self._storage.synchronize()
        if self._host_masters is not None and masters is None:
            self._host_masters.restore()
        self._host_masters = masters
        self._storage = storage

    @property
    def momentum_in_flight(self) -> int | None:
        """A stored momentum's shape buckets materialised at once during a step (``None``:
        all); settable between steps."""
        return self._storage.in_flight

    @momentum_in_flight.setter
    def momentum_in_flight(self, value) -> None:
        self._storage.synchronize()
        storage = self._storage
        self._storage = MomentumStorage(storage.dtype, storage.offload, value)

    def param_name(self, p: Tensor) -> str:
        """``p``'s name (from the model or the groups), or its shape when it has none."""
        return self._routing.name(p)

    def _layout(self, p: Tensor) -> Layout:
        """``p``'s :class:`~dmuon_compile.layouts.Layout`: from routing, declared on it
        (``dmuon.set_layout``), or one matrix for a 2-D tensor; otherwise an error naming it."""
        return self._routing.layout(p)

    @property
    def _layouts(self) -> dict[int, Layout]:
        """Each Muon parameter's Layout by id (``GroupRouting.layouts``; tests read it)."""
        return self._routing.layouts

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
            grad = p.grad  # read once: on a dedicated weight each read is a torch function
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients ({self.param_name(p)})")
            state = self.state[p]
            params.append(p)
            grads.append(grad)
            if group["use_muon"]:
                state_b.append(self._second_moment(p, state))  # NorMuon's (None: off)
                if not self._storage.stored:
                    state_a.append(self._storage.in_place(state, p))
                    continue
                name = self.param_name(p)
                if self._streams_momentum and local_of(p).numel():  # by bucket, in _directions
                    state_a.append(self._storage.streamed(state, p, name))
                    continue
                work = self._storage.working(state, p, name)
                self._working.append((state, p, name, work))
                state_a.append(work)
            else:
                # The step count lives on the parameter's device: the fused AdamW kernel reads
                # it there, and a skipped step takes its increment back there (no host read).
                device = local_of(grad).device
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != device:  # a state saved with host step counts
                    state["step"] = state["step"].to(device, torch.float32)
                state_a.append(state["exp_avg"])
                state_b.append((state["exp_avg_sq"], state["step"]))

    def _second_moment(self, p: Tensor, state: dict) -> Tensor | None:
        """NorMuon's per-row second moment of Muon matrix ``p`` (created on first use), or
        ``None`` without ``normuon``."""
        if self.normuon is None:
            return None
        return second_moment(state, p, self._layout(p))

    def _check_whole_matrices(self, ids: set[int]) -> None:
        """Raise if a Muon group holds a sharded, not dedicated, matrix (among ``ids``).

        ``Muon(model)`` refuses those when it is built; this catches the ones that became
        shards afterwards — a plain weight routed to Muon, then sharded by a wrapper's
        ``fully_shard`` (accelerate's FSDP2 prepare, a Trainer given ``Muon`` and a flat
        parameter list). Newton–Schulz of a shard is not the shard of Newton–Schulz. The same
        on every rank (the groups and FSDP2's DTensors are), before any collective.
        """
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if (
                    id(p) in ids
                    and isinstance(p, DTensor)
                    and not isinstance(p, OwnerTensor)
                    and not whole_expert_shards(p, self._layout(p))
                    and not needs_reshard(p, self._layout(p))
                ):
                    raise ValueError(
                        f"Muon: {self.param_name(p)} is a Muon matrix but a DTensor shard "
                        f"({tuple(p.placements)} on {p.device_mesh}): it was sharded after the "
                        "optimizer routed it, and Newton–Schulz needs the whole matrix. "
                        "Dedicate it before fully_shard (dmuon.dedicate_params; with "
                        "accelerate: dmuon_compile.integrations.accelerate.dedicate_params, "
                        "before accelerator.prepare) and build dmuon.Muon(model) after that, "
                        "or route it to AdamW (Muon(model, predicate=...))."
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

        The compiled step leaves its verdict on the device (the host never waits for the
        step): that error, a non-finite step's ``FloatingPointError`` or skip warning, comes
        out of the next ``step()`` (before it does anything: call it again to step on its
        batch), ``state_dict()`` or :meth:`last_step_committed`, naming the previous step.

        Example::

            opt.step(); opt.step()  # safe: the second step drains the first one's publish
        """
        # The previous step's verdict, if the compiled step left it on the device: its error
        # (or skip warning) comes out here, before this step issues anything.
        if self._agreement.pending is not None:
            self._agreement.settle()
        with label(STEP):
            plan = _step_plan(self.model)  # the runtime's actions and stages around the step
            if plan is PLAIN_STEP:
                return self._step(closure, plan)
            plan.before()
            try:
                return self._step(closure, plan)
            finally:
                plan.finish(not self.replicate_async)

    def _step(self, closure, plan: StepPlan):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        masters = self._host_masters  # offload="state": the masters on the GPU for the step
        if masters is None:
            self._step_on(plan)
            return loss
        committed = False  # _prepare swaps the masters in (the step's momentum decides how)
        try:
            committed = self._step_on(plan)
        finally:
            masters.swap_out(committed)  # a step that did not commit keeps the host masters
        return loss

    def _step_on(self, plan: StepPlan) -> bool:
        """The step after the closure; whether it committed (``False``: skipped; a deferred
        verdict counts as committed: its commit selects on the device)."""
        # Two halves with one agreement between them: first every Muon matrix's update is
        # computed (the plan's stages, then the local math; nothing written; a failure on this
        # rank is recorded in ``failure`` and the step's collectives still go out), then all
        # ranks agree on non-finite gradients and failures, and only then is anything written:
        # a step that fails on one rank raises on every rank and changes nothing anywhere.
        # Under the user's torch.compile(opt.step) the local math is traced on plain local
        # tensors: DTensors (meshes, process groups) and the stages stay eager.
        failure: list = []  # this rank's [(phase, exception)]
        jobs, adamw, halves = self._prepare(plan, torch.compiler.is_compiling(), failure)
        for part_jobs, part_halves in zip(jobs, halves):  # after the stages' halves
            part_halves += [self._directions(job, failure) for job in part_jobs]
        # Only the stages' halves and (local gradients, flags, path) cross into the agreement
        # (eager): the other halves' groups hold DTensors, whose meshes Dynamo cannot pass out.
        masters = self._host_masters
        if masters is not None and not failure:  # offload="state": memory for the commit, now
            streamed = [(h.params, [i for i, _ in h.buckets or ()]) for hs in halves for h in hs]
            in_flight = self._storage.in_flight
            guarded(failure, PHASE_MASTERS, lambda: masters.reserve(streamed, in_flight), None)
        unsent = [(h.stage, h.stage_half) for hs in halves for h in hs if h.stage is not None]
        self._agreement.check_finite(_finite_flags(halves), failure)
        verdict = self._agree(failure, unsent, self._defers(plan))
        if verdict is False:
            return False  # skipped (nonfinite_grads="skip")
        # A deferred verdict stays on the device: the commit and AdamW select on it and the
        # host reads it at the next step() (``settle``), never waiting for this step's kernels.
        pending = None if isinstance(verdict, bool) else verdict  # else a PendingVerdict
        if self._host_masters is not None:  # offload="state": those copied in at the start
            self._host_masters.ready()
        self._commit_all(plan, halves, adamw, pending)
        if pending is not None:
            self._agreement.hold(pending)
        return True

    def _commit_all(self, plan: StepPlan, halves: list, adamw: list, pending) -> None:
        """The second half, after the agreement: the plan's parts in order, each part's local
        commits, then its stages' own (TP rank 0 broadcasts the plain weights it just
        committed), then its action (HSDP: the group the next forward needs first is published
        first, under the rest of the step; deferred, it publishes what the select wrote); the
        stored momentum written back; AdamW. ``pending``: a deferred verdict (``None``: known
        true); where this rank's own work failed, its halves hold placeholders and the verdict
        is known to be false: it writes nothing, its actions' collectives still go out."""
        write = pending is None or not pending.failure
        commit_if = None if pending is None else pending.ok
        # Offloaded masters are copied out right after the step: a stage's updates are applied
        # now, not queued for the next forward (TP's scatters).
        defer = self.replicate_async and self._host_masters is None
        for part, part_halves in zip(plan.parts, halves):
            for half in part_halves if write else ():
                self._commit(half, commit_if)
            for half in part_halves if write else ():
                if half.stage is not None:
                    half.stage.commit(half.stage_half, defer)
            if part.after is not None:
                part.after()
        if self._storage.stored:  # a stored momentum (8-bit, offloaded): the committed values
            self._keep_working()
        for job in adamw if write else ():
            hypers = {key: job.group[key] for key in ("lr", "betas", "eps", "weight_decay")}
            F.adamw_update(
                job.params,
                job.grads,
                job.exp_avgs,
                job.exp_avg_sqs,
                job.steps,
                **hypers,
                commit_if=commit_if,
            )

    def _defers(self, plan: StepPlan) -> bool:
        """Whether this step leaves its verdict on the device (read at the next ``step()``):
        every Muon matrix is compiled (its commit's select fuses into the commit's kernel; the
        eager reference reads first), the momentum kept in place (a stored copy is written
        back only after a verdict read on the host), every stage's commit a select
        (``StepStage.defers``; not TP's: it scatters updates that the TP ranks apply), and not
        under the user's ``torch.compile`` (the commit is traced into their graph). HSDP's
        publishes broadcast whatever the select wrote: the same collectives either way. Decided
        from the configuration alone: the same on every rank."""
        if (
            any(not stage.defers for stage in plan.stages)
            or torch.compiler.is_compiling()
            or self._storage.stored
        ):
            return False
        key = tuple(len(g["params"]) for g in self.param_groups)
        if self._compiles_all[0] != key:  # the groups changed (add_param_group): look again
            from dmuon_compile.compiled_step import compile_enabled

            mats = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
            self._compiles_all = (key, compile_enabled(self.compile, mats))
        return self._compiles_all[1]

    @property
    def expert_ns(self) -> str:
        """``"per_replica"`` or ``"once"`` (see the class's arguments); settable between steps:
        the next step plans its expert stage again."""
        return self._expert_ns

    @expert_ns.setter
    def expert_ns(self, value: str) -> None:
        if value not in EXPERT_NS:
            raise ValueError(f"expert_ns={value!r}: choose one of {EXPERT_NS}")
        self._expert_ns = value

    def _with_stages(self, plan: StepPlan) -> StepPlan:
        """``plan`` with the expert reshard stage where some Muon matrices are expert stacks
        sharded inside their experts (``step_plan.expert_stage``: the layouts are this
        optimizer's), looked for once per set of Muon matrices."""
        mats = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        key = (self.expert_ns, *map(id, mats))
        if self._expert_stage[0] != key:
            matrices = [(p, self._layout(p)) for p in mats]
            self._expert_stage = (key, expert_stage(matrices, self.expert_ns))
        stage = self._expert_stage[1]
        return plan if stage is None else plan.adding(stage)

    @torch.compiler.disable  # DTensor bookkeeping, state creation and the stages stay eager
    def _prepare(
        self, plan: StepPlan, traced: bool, failure: list
    ) -> tuple[list[list[MuonJob]], list[AdamWJob], list[list[StepHalf]]]:
        """Create state, split the Muon groups into the plan's parts and run the plan's stages.

        Returns ``(jobs, adamw, halves)``: per part of ``plan``, a :class:`MuonJob` of each Muon
        group holding the local tensors of the matrices left to this rank's own directions (the
        owners' whole matrices); an :class:`AdamWJob` per AdamW group (local tensors: FSDP2's
        shards, AdamW is elementwise); per part, the halves of the stages
        (``distributed/stages.py``), which take their matrices out of the jobs first, in the
        plan's order, on every rank (their collectives, meshes and process groups stay eager:
        no DTensor crosses into a traced step). ``traced``: the user's
        ``torch.compile(opt.step)`` traces the step (``StepNS.traced``). Hands the agreement what
        it reads (``StepAgreement.begin``: the parameters with gradients, those whose state this
        step created: dropped again if the step does not commit; their finite flags are added
        after the directions, by ``StepAgreement.check_finite``).
        A failure here is appended to ``failure``; the lists then hold placeholders (the
        gradients): the step only sends them, never commits.
        """
        plan = self._with_stages(plan)
        if self.normuon is not None:  # paths that would skip it: refused before any collective
            muon = [g["params"] for g in self.param_groups if g["use_muon"]]
            muon = [(p, self._layout(p)) for params in muon for p in params]
            _normuon.refuse_unsupported(plan, muon)
        with_grad = [
            p for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        fresh = [p for p in with_grad if not self.state.get(p)]  # state created by this step
        self._working = []
        self._storage.begin_step()
        # A stored momentum streams by bucket in ``_directions`` unless a stage takes matrices
        # (it reads their buffers before the local directions run) or the user's compile traces
        # the directions (host copies per bucket would break its graph): then all at once.
        self._streams_momentum = self._storage.streaming and not plan.stages and not traced
        if self._host_masters is not None:  # offload="state": the masters for the step
            by_bucket = frozenset()
            if self._streams_momentum:  # the Muon matrices': committed bucket by bucket
                muon = {id(p) for g in self.param_groups if g["use_muon"] for p in g["params"]}
                by_bucket = frozenset(id(p) for p in with_grad if id(p) in muon)
            self._host_masters.swap_in(by_bucket)
        if fresh:
            self._check_whole_matrices({id(p) for p in fresh})
        jobs: list[list[MuonJob]] = [[] for _ in plan.parts]
        adamw: list[AdamWJob] = []
        for group in self.param_groups:
            params, grads, state_a, state_b = [], [], [], []
            if not failure:
                guarded(
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
            lays = [self._layout(p) for p in params] if group["use_muon"] else []
            if not group["use_muon"]:
                # AdamW is elementwise: it runs on the local tensors (FSDP2's shards), never
                # through DTensor dispatch (~0.1 ms of host time per op and parameter).
                lists = (params, grads, state_a, [b[0] for b in state_b])
                lists = tuple([local_of(t) for t in xs] for xs in lists)
                adamw.append(AdamWJob(group, *lists, [b[1] for b in state_b]))
                continue
            moments = [None] * len(params) if failure else state_b
            if len(plan.parts) == 1 and plan.parts[0].params is None:  # the lists as they are
                whole = (params, grads, state_a, lays, moments)
                jobs[0].append(MuonJob(plan.parts[0].name, group, *whole))
                continue
            taken: set[int] = set()
            for part, part_jobs in zip(plan.parts, jobs):
                idx = [
                    i
                    for i, p in enumerate(params)
                    if i not in taken and (part.params is None or id(p) in part.params)
                ]
                taken.update(idx)
                if idx:
                    picked = ([params[i] for i in idx], [grads[i] for i in idx])
                    rest = ([state_a[i] for i in idx], [lays[i] for i in idx])
                    rest += ([moments[i] for i in idx],)
                    part_jobs.append(MuonJob(part.name, group, *picked, *rest))
        for device in {w.device for *_, w in self._working}:  # offloaded momentum copied in
            self._storage.ready(device)
        halves: list[list[StepHalf]] = [[] for _ in plan.parts]
        if plan.stages:
            from dmuon_compile.compiled_step import compiled_step_for

            compiled = functools.partial(compiled_step_for, self)
            ns = StepNS(self.ns, compiled, directions_finite, traced, normuon=self.normuon)
            for stage in plan.stages:  # in the plan's order: the same collectives everywhere
                jobs, taken_halves = stage.directions(jobs, ns, failure)
                for part_halves, more in zip(halves, taken_halves):
                    part_halves += more
        jobs = [[local_job(job) for job in part_jobs] for part_jobs in jobs]
        # The finite flags are taken after the directions (``check_finite``): the compiled
        # ones bring their matrices' flags from the norms NS takes anyway.
        self._agreement.begin(_StepCheck(with_grad, None, fresh))
        return jobs, adamw, halves

    def _directions(self, job: MuonJob, failure: list) -> StepHalf:
        """The first half of Muon for the matrices of a job this rank holds whole (local
        tensors; ``job.part`` names the subset: one compiled graph each): the compiled step if
        enabled, else the eager reference. After a failure on this rank (``failure`` non-empty)
        nothing is computed: the step only sends the stages' placeholders, never commits."""
        from dmuon_compile.compiled_step import compile_enabled, compiled_step_for

        part, group, params, grads, bufs, layouts, moments = job
        half = StepHalf(group, params, grads, bufs, None, layouts=layouts)
        half.moments = moments if self.normuon is not None else None
        if not params or failure:
            return half

        def directions():
            # Both run functional.muon_directions: compiled (one graph) or called eagerly (also
            # what a user's torch.compile(opt.step) traces).
            compiled = half.compiled = compiled_step_for(self, group, params, part=part)
            if is_streamed(bufs):  # a stored momentum, bucket by bucket
                return self._streamed_directions(half, part)
            keep = self.keep_new_momentum and not torch.compiler.is_compiling()
            hypers = dict(momentum=group["momentum"], nesterov=group["nesterov"], layouts=layouts)
            if half.moments is not None:  # NorMuon: normalised per row; v′ comes after
                hypers.update(second_moments=half.moments, normuon=self.normuon)
            with label(NS):
                if compiled is not None:
                    ortho, half.finite, *new = compiled.directions(
                        grads, bufs, finite_flags=True, keep_momentum=keep, **hypers
                    )
                    half.new_bufs = new.pop() if keep else None
                    half.new_moments = new[0] if new else None
                    return ortho
                if keep:  # asked for only when kept: the call is otherwise the plain one
                    hypers["keep_momentum"] = True
                ortho = F.muon_directions(grads, bufs, ns=self.ns, **hypers)
                if isinstance(ortho, tuple):  # (directions, [v′], [buf′])
                    ortho, *new = ortho
                    half.new_bufs = new.pop() if keep else None
                    half.new_moments = new[0] if new else None
                # NS's output is NaN wherever g or the momentum held a NaN/Inf: one norm of it
                # checks both, in place of the gradients' read in ``check_finite``.
                half.finite = directions_finite(ortho)
                return ortho

        if torch.compiler.is_compiling():  # traced: an error raises where torch raises it
            half.ortho = directions()
        else:
            compiling = compile_enabled(self.compile, params)
            half.ortho = guarded(
                failure, PHASE_COMPILED if compiling else PHASE_EAGER, directions, None
            )
            if half.ortho is None:
                half.finite = None  # a failed call's flags do not count
        return half

    def _commit(self, half: StepHalf, commit_if: Tensor | None = None) -> None:
        """The second half of a half's local math: momentum and weights written (elementwise,
        after the agreement; a stage's own part follows, ``_step``). ``commit_if``: a deferred
        verdict (0-d bool on the device); every value is then written as
        ``where(commit_if, new, old)``."""
        if not half.params:  # a stage's half only (TP), or nothing of this job here
            return
        masters = self._host_masters
        if masters is not None and half.buckets and masters.holds_stand_ins(half.params):
            # offload="state", streamed: the masters come to the GPU a few buckets at a time
            commit = functools.partial(self._commit_bucket, half)
            masters.commit_by_bucket(half.params, [idx for idx, _ in half.buckets], commit)
            return
        group = half.group
        commit = F.commit_muon_step if half.compiled is None else half.compiled.commit
        grads, bufs = half.grads, half.bufs
        # buf′ is in its shadows (_streamed_directions) or kept (keep_new_momentum): the
        # commit writes the weights only
        if is_streamed(bufs) or half.new_bufs is not None:
            grads, bufs = _scratch_momentum(grads[0])
        commit(
            half.params,
            grads,
            bufs,
            half.ortho or [],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            adjust_lr_fn=group["adjust_lr_fn"],
            commit_if=commit_if,
            layouts=half.layouts,
            **({"matrix_shapes": half.matrix_shapes} if half.matrix_shapes else {}),
            **half.normuon_commit(),
        )
        if half.new_bufs is not None:
            take_kept_momentum(half.bufs, half.new_bufs, commit_if)
            half.new_bufs = None

    def _commit_bucket(self, half: StepHalf, k: int, params: list[Tensor]) -> None:
        """The commit of shape bucket ``k`` of a streamed half (``half.buckets``) on ``params``
        (its masters on the GPU; ``HostMasters.commit_by_bucket``), by the bucket's compiled
        step as its directions ran: the same elementwise math per matrix as the half's."""
        idx, step = half.buckets[k]
        sub = StepHalf(
            half.group,
            params,
            [half.grads[i] for i in idx],
            [half.bufs[i] for i in idx],
            [half.ortho[i] for i in idx],
            compiled=step,
            layouts=[half.layouts[i] for i in idx],
        )
        if half.new_moments is not None:  # NorMuon: its v′ is written with the weights
            sub.moments = [half.moments[i] for i in idx]
            sub.new_moments = [half.new_moments[i] for i in idx]
        self._commit(sub)

    def _streamed_directions(self, half: StepHalf, part: str) -> list[Tensor]:
        """``_directions``' math for a half whose stored momentum streams
        (``momentum_storage.BucketStream``), one shape bucket of Newton–Schulz at a time (the
        buckets ``functional.muon_directions`` walks): the bucket's working buffers taken, its
        directions (compiled: a graph per bucket), its buf′ = μ·buf + g computed in them by the
        commit's own ``functional.store_momentum`` (compiled as the commit compiles it) and
        staged to the stored form's shadows, its buffers released. The same operations per
        matrix as the step that materialises everything; the commit then writes the weights."""
        group, grads, lays, moments = half.group, half.grads, half.layouts, half.moments
        mu = group["momentum"]
        buckets = F.shape_buckets(grads, lays, self._storage.bucket_bytes(self.ns.stack_bytes))
        stream = self._storage.stream(half.bufs, buckets)
        half.buckets = []
        ortho: list = [None] * len(grads)
        new_moments = None if moments is None else [None] * len(grads)
        flags, order = [], []
        for k, idx in enumerate(buckets):
            mine = [grads[i] for i in idx]
            hypers = dict(momentum=mu, nesterov=group["nesterov"], layouts=[lays[i] for i in idx])
            if moments is not None:
                hypers.update(second_moments=[moments[i] for i in idx], normuon=self.normuon)
            new = None
            with label(NS):
                work = stream.take(k)
                if half.compiled is None:
                    out = F.muon_directions(mine, work, ns=self.ns, **hypers)
                    if moments is not None:
                        out, new = out
                    F.store_momentum(mine, work, F.hyper(mu))
                    step = None
                else:
                    out, finite, new, step = self._bucket_directions(half, part, idx, work, hypers)
                    flags.append(finite)
                    order += idx
                half.buckets.append((idx, step))  # offload="state" commits the masters by them
                stream.stage(k, work)
                del work  # released: the next buckets may take its memory
            for j, i in enumerate(idx):
                ortho[i] = out[j]
                if new_moments is not None:
                    new_moments[i] = new[j]
        half.new_moments = new_moments
        if half.compiled is None:
            half.finite = directions_finite(ortho)
        elif flags:  # in grads' order, as the one graph returns them
            where = [0] * len(order)
            for position, i in enumerate(order):
                where[i] = position
            half.finite = torch.cat(flags)[where]
        return ortho

    def _bucket_directions(self, half: StepHalf, part: str, idx, work, hypers):
        """One bucket of ``_streamed_directions``, compiled: the ``CompiledMuonStep`` of its
        kind (``StepKey(group, "<part>/momentum bucket <n>")``, ``n`` numbering the distinct
        buckets — shapes, dtypes, layouts — in first-seen order: buckets alike share one graph,
        compiled once, as a 70B job's many buckets of one matrix shape are; each kind has its
        own recompile budget), then buf′ by a compiled ``store_momentum`` of the bucket.
        Returns ``(directions, finite flags, NorMuon's v′ or None, the bucket's step)``."""
        from dmuon_compile.compiled_step import StepKey, compiled_step_for

        group = half.group
        mine = [half.grads[i] for i in idx]
        position = next(i for i, g in enumerate(self.param_groups) if g is group)
        kind = (
            position,
            part,
            tuple((tuple(g.shape), g.dtype, g.device) for g in mine),
            tuple(w.dtype for w in work),
            tuple(hypers["layouts"]),
            "second_moments" in hypers,
        )
        number = self._bucket_kinds.setdefault(kind, len(self._bucket_kinds))
        name = f"{part}/momentum bucket {number}"
        step = compiled_step_for(self, group, [half.params[i] for i in idx], part=name)
        out, finite, *new = step.directions(mine, work, finite_flags=True, **hypers)
        key = StepKey(position, name)
        graph = self._momentum_graphs.get(key)
        if graph is None:
            from dmuon_compile.momentum_storage import compiled_store_momentum

            graph = self._momentum_graphs[key] = compiled_store_momentum()
        graph(mine, work, step.hyper_tensor(mine[0].device, group["momentum"]))
        return out, finite, new[0] if new else None, step

    @torch.compiler.disable  # a collective, a host read, the stored momentum's shadows: eager
    def _agree(self, failure: list, unsent: list, defer: bool):
        """``StepAgreement.agree``; a step that will not commit (skipped, or raising) drops
        its stored momentum's shadows and working buffers at once: nothing of it is written."""
        try:
            verdict = self._agreement.agree(failure, unsent, defer)
        except BaseException:
            self._drop_working()
            raise
        if verdict is False:
            self._drop_working()
        return verdict

    def _drop_working(self) -> None:
        self._working = []
        self._storage.drop_staged()

    @torch.compiler.disable  # host copies and quantisation: eager
    def _keep_working(self) -> None:
        """Write this step's working momentum buffers back to their stored form, and put the
        streamed buckets' shadows in the state."""
        self._storage.keep(self._working)
        self._working = []
        self._storage.commit_staged()

    # ------------------------------------------------------------------ between steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, plus: gradients of dedicated weights still in
        flight are dropped (after an exception in forward or backward, reduces already issued
        would otherwise land on the owners' gradients after this call). Cheap after a step.

        After a forward or backward that raised, it first agrees with every rank, through the
        rendezvous store (no process group), that all of them left that pass at the same point
        (the same number of collectives issued on every group); only then does it finish
        FSDP2's aborted backward and drop the collectives in flight (waited for until finished,
        also on CUDA), which is collective. An exception on some ranks only cannot be skipped:
        the other ranks wait inside one of the pass's collectives until the process-group
        timeout, and this raises a ``RuntimeError`` by that timeout, having issued nothing
        (restart from a checkpoint). One inside ``step()`` reaches every rank
        (``MuonStepError``) and is skipped.

        Example::

            try:
                loss = model(x).loss; loss.backward(); opt.step()
            except (torch.OutOfMemoryError, dmuon.MuonStepError):
                opt.zero_grad()  # drop this batch on every rank, then go on
        """
        self._between.zero_grad(functools.partial(super().zero_grad, set_to_none=set_to_none))

    @torch.compiler.disable  # bookkeeping on the parameter lists: eager
    def restore_dedicated(self) -> None:
        """Put the dedicated weights back where they were in each group's parameter list, after
        a wrapper replaced the lists; ``dmuon_compile.integrations.accelerate`` calls it once,
        right after accelerate's FSDP2 prepare swapped the optimizer's parameters.

        That swap replaces every parameter by the one ``fully_shard`` registered under its
        name, found by data address. It maps FSDP2's parameters to their shards, but no address
        tells a dedicated weight apart (a wrapper's ``data_ptr()`` is 0; accelerate versions key
        the two sides differently): those slots come back with any weight or none. Dedicated
        weights never change (``fully_shard`` leaves them alone), so each goes back to its
        position by identity; any other change of a dedicated weight's place raises.
        """
        layouts = self._between.restore_dedicated(self.param_groups, self.param_name)
        if self.model is not None:  # the names of the parameters the lists now hold
            self._routing.names.update({id(p): n for n, p in self.model.named_parameters()})
        self._routing.layouts = layouts

    def last_step_committed(self) -> bool:
        """Read the last step's verdict now: ``True`` if it committed, ``False`` if it was
        skipped (``nonfinite_grads="skip"``, with its warning), or its error
        (``FloatingPointError``, :class:`MuonStepError`) — on every rank alike.

        The compiled step leaves its verdict on the device and the host reads it at the next
        ``step()`` (or ``state_dict()``), so the host never waits for the step's kernels; a
        step that turns out bad has changed nothing anywhere. Call this after the last step
        of a run, or wherever the answer is wanted at once. ``zero_grad()`` does not read it:
        it usually follows ``step()`` at once, and reading there would make the host wait.

        Example::

            opt.step()
            if not opt.last_step_committed():
                logging.getLogger(__name__).warning("step skipped: non-finite gradients")
        """
        return self._agreement.settle()

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict``, after reading the last step's verdict (a step
        that did not commit must not leave the state it created in a checkpoint; its error
        raises here). The groups' ``lr``, ``weight_decay`` and ``momentum`` are Python floats,
        as torch's optimizers save them (the 0-d tensors the groups hold for a compiled step
        stay inside: ``param_groups.plain_hypers``), so ``json.dumps(sd["param_groups"])``
        works; :meth:`load_state_dict` puts them back into those tensors."""
        self._agreement.settle()
        if self._host_masters is not None:
            # DCP reads (and loads in place into) the model's host masters right after this
            # call: the last step's copies out land first.
            self._host_masters.runtime.pending.drain()
        state = super().state_dict()
        state["param_groups"] = plain_hypers(state["param_groups"])
        if self._storage.stored:  # 8-bit or host copies: as momentum_buffer, like p
            self._storage.synchronize()
            params = [p for g in self.param_groups for p in g["params"]]
            for i, entry in list(state["state"].items()):
                if any(key in entry for key in STORED_KEYS):
                    form = self._storage.checkpoint_form(entry, params[i])
                    kept = {k: v for k, v in entry.items() if k not in STORED_KEYS}
                    state["state"][i] = {**kept, "momentum_buffer": form}
        return state

    @torch.no_grad()
    def to_checkpoint_form(self) -> None:
        """Put each stored momentum (8-bit, offloaded) back in the state as its checkpoint form,
        ``momentum_buffer`` (a tensor like the parameter, in its dtype); the next step stores
        it again. ``state_dict()`` gives that form by itself; call this before loading a
        *flattened* optimizer state dict (``torch.distributed.checkpoint.state_dict.
        set_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=
        True))``, torchtitan's checkpointer), which takes from the dict only the keys the live
        state has: without it the stored momentum would not be loaded.
        ``dmuon_compile.integrations.torchtitan.MuonOptimizers`` calls it before every load."""
        if not self._storage.stored:
            return
        self._storage.synchronize()
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            entry = self.state.get(p)
            if entry and any(key in entry for key in STORED_KEYS):
                form = self._storage.checkpoint_form(entry, p)
                for key in STORED_KEYS:
                    entry.pop(key, None)
                entry["momentum_buffer"] = form

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict`` after checking that the state fits.

        State of a dedicated parameter must have been saved with the same owner, state of an
        FSDP2 shard on the same mesh and placements (an ``opt.state_dict()`` holds each rank's
        own view). Anything else — another model, another routing, another cluster shape —
        raises a ``ValueError`` naming the parameter before anything is loaded. To resume on
        another mesh or world size, checkpoint through ``torch.distributed.checkpoint``
        (``get_state_dict`` / ``set_state_dict``), which reshards.

        Example::

            opt.load_state_dict(opt.state_dict())  # same run, same ranks
        """
        self._between.check_loadable(state_dict, self.param_groups, self.param_name)
        _check_no_lost_momentum(state_dict)
        self._agreement.drop()  # a last step's verdict not read yet: the loaded state replaces it
        before = list(self.param_groups)
        super().load_state_dict(state_dict)
        # Saved floats go back into the groups' own 0-d tensors (the same ones as before the
        # load): a user-compiled step sees a new value, not a new input, and never recompiles.
        restore_hypers(self.param_groups, before)


def _check_no_lost_momentum(state_dict: dict) -> None:
    """Raise ``ValueError`` where a loaded entry holds a stored-momentum key without a tensor:
    what an unflattened state dict gives when the live state showed its stored keys (the
    checkpoint holds ``momentum_buffer``), so loading it would lose the momentum."""
    for i, entry in state_dict.get("state", {}).items():
        lost = [k for k in (HOST, CODES, SCALES) if k in entry and not torch.is_tensor(entry[k])]
        if lost:
            raise ValueError(
                f"Muon.load_state_dict: the state of parameter {i} holds {lost[0]!r} without a "
                "tensor: a flattened optimizer state dict (set_optimizer_state_dict(..., "
                "flatten_optimizer_state_dict=True)) read the live state's stored-momentum keys, "
                "not the checkpoint's 'momentum_buffer'; call opt.to_checkpoint_form() before "
                "loading it. Nothing was loaded."
            )


def _scratch_momentum(grad: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """A one-value (gradient, momentum) pair for the commit of a half whose momentum a streamed
    step stored already: the commit's momentum ops need a non-empty list, the weights'
    update is the same."""
    z = torch.zeros(1, dtype=grad.dtype, device=grad.device)
    return [z], [z.clone()]


def _finite_flags(halves: list[list[StepHalf]]) -> list[FiniteFlags]:
    """The Muon halves' finite flags (compiled: NS's norms; eager: a norm of NS's output),
    covering gradient and momentum; the agreement reads the other gradients itself."""
    return [
        FiniteFlags(h.grads, h.finite, h.path or (EAGER if h.compiled is None else COMPILED))
        for part_halves in halves
        for h in part_halves
        if h.finite is not None
    ]


def _step_plan(model: nn.Module | None) -> StepPlan:
    """The step plan of the runtime ``dedicate_params`` attached to ``model``
    (``distributed/step_plan.py``;
    :data:`PLAIN_STEP` without one)."""
    from dmuon_compile.dedicated_registry import runtime_of

    runtime = runtime_of(model)
    return PLAIN_STEP if runtime is None else runtime.step_plan()
