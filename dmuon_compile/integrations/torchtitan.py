"""Switch a torchtitan job to dmuon: a ``parallelize_fn`` wrapper and an optimizer container.

Two changes to a torchtitan trainer config (docs/integrations.md: torchtitan)::

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    spec = model_registry("8B")
    spec = dataclasses.replace(spec, parallelize_fn=dmuon_tt.dedicating(spec.parallelize_fn))
    config = Trainer.Config(
        model_spec=spec,
        optimizer=dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-4),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", ...),  # or "full_dtensor"
        ...
    )

- :func:`dedicating` runs ``dmuon.dedicate_params`` inside torchtitan's ``parallelize_fn``
  after TP, activation checkpointing and compile, right before FSDP2: it wraps the
  ``apply_fsdp_to_decoder`` call of that function (torchtitan's shared FSDP step of every
  decoder, which receives the data-parallel mesh: ``fsdp``, or ``("dp_replicate", "fsdp")``
  for HSDP, the TP mesh derived from the same flattened root) for the duration of the call.
  torchtitan builds the model on the meta device and calls ``init_weights`` after
  ``to_empty``; both work on dedicated weights (docs/meta_device.md).
  ``spmd_backend="full_dtensor"`` hands that step the dense storage mesh with
  ``dp_mesh_dims`` instead: the data-parallel axes it names are the meshes dedicated over.
  ``"spmd_types"`` (torchtitan's default) is refused, naming why (:data:`SPMD_TYPES_ERROR`).
- :class:`MuonOptimizers` is torchtitan's ``OptimizersContainer`` holding one ``dmuon.Muon``
  per model part, its groups carrying ``param_names`` (canonical FQNs), so torchtitan's
  checkpointer saves and loads its FQN-keyed state.
- Pipeline parallelism (``pipeline_llm``) needs no other line: ``parallelize_fn`` runs once per
  stage's model part, each gets its own owners over its data-parallel ranks, and the stages'
  once-per-step gradient reduce (``PipelineStage.perform_reduce_grad``) reduces the dedicated
  gradients its micro-batches accumulated too. The stages a rank holds (looped schedules) are
  planned over the Newton–Schulz loads of the ones planned before them on the same
  data-parallel mesh, so their sum is balanced. :func:`summarize_stages` shows each stage's plan
  and the sum (docs/pipeline.md). torchtitan's checkpointer gathers a fused ``wqkv`` with
  ``redistribute(Replicate)``: a dedicated weight gathers over its own stage's ranks.
- Expert parallelism needs no other line either: the expert stacks stay with EP and FSDP2, and a
  dedicated weight's owner mesh has a named dim (not ``"ep"``), which torchtitan's EP-aware
  gradient clipping reads to take it as a dense weight (docs/moe.md).

torchtitan is an optional dependency: importing this module without it raises an
``ImportError`` naming the extra.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as exc:  # pragma: no cover - exercised without torchtitan
    raise ImportError(
        "dmuon_compile.integrations.torchtitan needs torchtitan: "
        'pip install "dmuon_compile[torchtitan]"'
    ) from exc

import torch
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.dedicated_registry import runtime_of
from dmuon_compile.layouts import head_layouts
from dmuon_compile.momentum_storage import (
    IN_FLIGHT,
    MOMENTUM_DTYPES,
    check_in_flight,
    check_offload,
)
from dmuon_compile.routing import is_router

__all__ = [
    "MuonOptimizers",
    "dedicating",
    "default_predicate",
    "muon_predicate",
    "summarize_stages",
]

FSDP_STEP = "apply_fsdp_to_decoder"  # the name parallelize_fn calls FSDP2 through


def default_predicate(name: str, param: torch.Tensor) -> bool:
    """The weights ``dedicating`` dedicates: the transformer blocks' 2-D weights
    (``layers.*``), not the embeddings, the head or a mixture-of-experts router
    (``moe.router.gate``: AdamW, ``dmuon_compile.routing.is_router``). Expert stacks
    (``GroupedExperts``' 3-D ``w1``/``w2``/``w3``) stay with FSDP2 and expert parallelism,
    sharded along the expert dim; ``MuonOptimizers`` gives them Muon, each rank
    orthogonalising its own whole experts."""
    return name.startswith("layers.") and param.ndim == 2 and not is_router(name)


def muon_predicate(name: str, param: torch.Tensor) -> bool:
    """Every matrix that gets Muon in a ``dedicating`` job: :func:`default_predicate`'s and
    the blocks' expert stacks (a one-process reference of the same job uses it)."""
    return default_predicate(name, param) or (name.startswith("layers.") and param.ndim == 3)


def _dp_dims(dp_mesh):
    """``(shard mesh, replicate mesh or None)`` of the mesh torchtitan gives FSDP2."""
    if dp_mesh.ndim == 1:
        return dp_mesh, None
    names = dp_mesh.mesh_dim_names
    if dp_mesh.ndim != 2 or names is None:
        raise ValueError(
            f"dmuon: torchtitan passed FSDP2 a {dp_mesh.ndim}-D mesh named {names}; dedicated "
            "weights need the 1-D fsdp mesh or the 2-D (dp_replicate, fsdp) HSDP mesh. Set "
            'parallelism.spmd_backend="partial_dtensor".'
        )
    return dp_mesh[names[1]], dp_mesh[names[0]]


SPMD_TYPES_ERROR = (
    'dmuon: parallelism.spmd_backend="spmd_types" is not supported: that backend leaves the '
    "parameters plain tensors carrying spmd_types annotations and hands fully_shard the dense "
    "storage mesh with dp_mesh_dims, which this torch's FSDP2 accepts only for DTensor "
    'parameters (it raises "all parameters must be DTensors on the full SPMD mesh" with or '
    'without dmuon). Set parallelism.spmd_backend="partial_dtensor" (the tested and cheaper '
    'path) or "full_dtensor" (the same meshes, DTensor parameters).'
)
CPU_OFFLOAD_ERROR = (
    "dmuon: training.enable_cpu_offload (FSDP2's CPUOffloadPolicy) is not supported with "
    "dedicated weights: each lives whole on its owner's GPU, where its Newton-Schulz runs, and "
    "torchtitan's offload builds the model in host memory. Set training.enable_cpu_offload = "
    "false; to save the optimizer's memory, keep the Muon momentum in host memory "
    '(MuonOptimizers.Config(offload="momentum"), streamed in for the step), with the owners\' '
    'fp32 master weights too (offload="state": the GPU keeps their bf16 copies for the forward) '
    'and/or in a smaller dtype (momentum_dtype="bf16" or "int8").'
)


def _check_backend(backend: str, parallel_dims) -> None:
    if backend == "spmd_types":
        raise ValueError(SPMD_TYPES_ERROR)
    if backend not in ("partial_dtensor", "full_dtensor"):
        raise ValueError(
            f"dmuon: parallelism.spmd_backend={backend!r}; dedicated weights need "
            '"partial_dtensor" or "full_dtensor".'
        )
    if backend == "full_dtensor" and parallel_dims.cp_enabled:
        raise ValueError(
            'dmuon: spmd_backend="full_dtensor" with context parallelism is not supported '
            '(FSDP2 shards over (dp_shard, cp) there); use spmd_backend="partial_dtensor".'
        )


def _storage_dp_dims(storage, dims):
    """``(shard mesh, replicate mesh or None)``: the data-parallel axes ``dp_mesh_dims`` names
    on full_dtensor's dense storage mesh."""
    shard_names, replicate_names = tuple(dims.shard_names), tuple(dims.replicate_names)
    if len(shard_names) != 1 or len(replicate_names) > 1:
        raise ValueError(
            f"dmuon: FSDP2's data-parallel axes are shard={shard_names}, "
            f"replicate={replicate_names}; dedicated weights need one shard axis and at most "
            "one replicate axis."
        )
    replicate = storage[replicate_names[0]] if replicate_names else None
    return storage[shard_names[0]], replicate


def _take_tp_views(module: nn.Module, storage, dims, predicate) -> dict:
    """Replace each weight ``predicate`` selects, a DTensor on full_dtensor's storage mesh
    (replicated over the data-parallel axes), by its view on the axes left (TP): a DTensor on
    the TP submesh, or the local tensor without TP: the parameters ``dedicate_params`` takes.
    Returns ``{fqn: (placements, gradient placements, global shape, stride)}`` on the storage
    mesh, for the forward."""
    from torch.distributed.tensor import DTensor, Partial

    names = storage.mesh_dim_names
    dp = set(dims.shard_names) | set(dims.replicate_names)
    keep = [i for i, n in enumerate(names) if n not in dp]
    views = {}
    for fqn, param in list(module.named_parameters()):
        if not isinstance(param, DTensor) or not predicate(fqn, param):
            continue
        if param.device_mesh != storage or any(
            not param.placements[i].is_replicate() for i, n in enumerate(names) if n in dp
        ):
            raise ValueError(
                f"dmuon: {fqn} is a DTensor on {param.device_mesh} with {param.placements}; "
                f"dedicated weights need {storage}, replicated over its data-parallel axes."
            )
        local = param.to_local()
        if keep:
            tp_mesh = storage[tuple(names[i] for i in keep)]
            local = DTensor.from_local(
                local, tp_mesh, [param.placements[i] for i in keep], run_check=False
            )
        owner, _, attr = fqn.rpartition(".")
        module.get_submodule(owner).register_parameter(
            attr, nn.Parameter(local, requires_grad=param.requires_grad)
        )
        # Their gradient leaves the forward Partial over the DP axes: its local part is this
        # rank's contribution, which the dedicated reduce sums (no all-reduce on the way).
        grad = [Partial() if n in dp else p for n, p in zip(names, param.placements)]
        views[fqn] = (tuple(param.placements), tuple(grad), param.shape, param.stride())
    return views


def _compute_on_storage_mesh(module: nn.Module, storage, views: dict) -> None:
    """full_dtensor computes on DTensors of the storage mesh: during the forward of each module
    holding a dedicated weight, the compute copy stands in as one (the same memory). Its
    gradient comes back to the compute copy as this rank's part, as with partial_dtensor."""
    from torch.distributed.tensor import DTensor

    runtime = runtime_of(module)
    if runtime is None:
        return
    by_module: dict[int, list] = {}
    for p in runtime.params:
        if p.fqn in views:
            by_module.setdefault(id(p.module), []).append(p)
    for params in by_module.values():
        standing_in: dict[str, torch.Tensor] = {}

        def pre(_m, _args, params=params, standing_in=standing_in):
            for p in params:
                copy = p.module._parameters[p.attr]
                if copy is not p.unsharded:
                    continue  # not unsharded: the forward fails naming the mixed tensors
                placements, grad, shape, stride = views[p.fqn]
                local = copy.to_local() if isinstance(copy, DTensor) else copy
                standing_in[p.fqn] = p.module._parameters[p.attr] = DTensor.from_local(
                    local,
                    storage,
                    placements,
                    shape=shape,
                    stride=stride,
                    grad_placements=grad,
                )

        def post(_m, _args, _out, params=params, standing_in=standing_in):
            for p in params:
                if p.module._parameters[p.attr] is standing_in.pop(p.fqn, None):
                    p.module._parameters[p.attr] = p.unsharded

        params[0].module.register_forward_pre_hook(pre)
        params[0].module.register_forward_hook(post, always_call=True)


def dedicating(
    parallelize_fn: Callable,
    predicate: Callable[[str, torch.Tensor], bool] = default_predicate,
    *,
    balance_stages: bool = True,
    per_head: bool = False,
    **dedicate_kwargs,
) -> Callable:
    """``parallelize_fn`` (e.g. torchtitan's ``parallelize_llama``) with ``dedicate_params``
    run right before its FSDP2 step, on the mesh that step shards over.

    The dedicated weights compute in FSDP2's ``param_dtype`` (torchtitan's
    ``training.mixed_precision_param``) unless ``param_policy=``/``compute_dtype=`` is given;
    other keyword arguments go to ``dmuon.dedicate_params``. Needs
    ``parallelism.spmd_backend="partial_dtensor"`` or ``"full_dtensor"``. Under full_dtensor
    FSDP2 gets the dense storage mesh and ``dp_mesh_dims``: the weights are dedicated over its
    ``dp_shard`` axis (``dp_replicate``: HSDP) from their view on the remaining TP axis, and
    during each forward the compute copy stands in as a DTensor of the storage mesh
    (:func:`_compute_on_storage_mesh`). torchtitan's default, ``"spmd_types"``, raises: this
    torch's FSDP2 cannot shard that backend's parameters, with or without dmuon
    (:data:`SPMD_TYPES_ERROR`). With pipeline parallelism ``pipeline_llm`` calls it once
    per model part (stage): each stage's weights get owners among its data-parallel ranks, and
    the stage's once-per-step gradient reduce (``PipelineStage.perform_reduce_grad``) reduces
    the dedicated gradients its micro-batches accumulated (docs/pipeline.md).

    ``balance_stages`` (default True; pipeline parallelism without TP): a looped schedule puts
    several stages on one rank, all planned over the same data-parallel mesh, so each stage
    after the first is planned with ``base_loads=`` the Newton–Schulz loads of the stages this
    wrapped function planned before it on that mesh object (one record per mesh, dropped with
    the mesh): the ranks' summed work is balanced instead of each stage's alone. Every rank of
    the mesh holds the same stages and plans them in the same order, so the records agree.
    ``False``: each stage planned alone.

    ``per_head``: ``dmuon.set_head_layouts`` on each model part before it is planned, as
    ``MuonOptimizers.Config(per_head=True)`` does before its ``Muon`` (give both): the owner
    plan then prices each head's Newton–Schulz, and under TP spreads a projection whose shards
    hold whole heads over its owner column's TP ranks, instead of pricing whole matrices.
    """
    if getattr(parallelize_fn, "_dmuon_dedicating", False):
        raise TypeError("dmuon: this parallelize_fn is already wrapped by dedicating(...)")
    if "base_loads" in dedicate_kwargs:
        raise TypeError(
            "dmuon: dedicating(...) sets base_loads itself (the loads of the stages planned "
            "before on the same mesh); pass balance_stages=False to plan each stage alone"
        )
    # Through other wrappers (functools.wraps): the function whose module calls FSDP2.
    inner = inspect.unwrap(parallelize_fn)
    namespace = getattr(inner, "__globals__", {})
    fsdp_step = namespace.get(FSDP_STEP) or _torchtitan_fsdp_step()
    if not any(name.startswith("apply_fsdp_to_") for name in namespace):
        raise TypeError(
            f"dmuon: {getattr(inner, '__qualname__', inner)} does not call torchtitan's "
            f"{FSDP_STEP}; call dmuon.dedicate_params(model, mesh) yourself between TP/compile "
            "and fully_shard."
        )

    # id(dp mesh) -> (weak reference to it, NS FLOPs per owner slot of the stages planned on it)
    planned: dict[int, tuple[weakref.ref, list[float]]] = {}

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims, parallelism, **kwargs):
        _check_backend(parallelism.spmd_backend, parallel_dims)
        if getattr(kwargs.get("training"), "enable_cpu_offload", False):
            raise ValueError(CPU_OFFLOAD_ERROR)
        if parallel_dims.pp_enabled:
            _reduce_at_stage_end()
        # Without PP one part is planned per job; the TP planner takes no carried loads.
        carry = balance_stages and parallel_dims.pp_enabled and not parallel_dims.tp_enabled
        calls = []

        def dedicate_then_fsdp(module, dp_mesh, *args, **kw):
            # full_dtensor: dp_mesh is the dense storage mesh, dp_mesh_dims names its DP axes.
            dims, views = kw.get("dp_mesh_dims"), None
            if dims is None:
                shard, replicate = _dp_dims(dp_mesh)
            else:
                shard, replicate = _storage_dp_dims(dp_mesh, dims)
                views = _take_tp_views(module, dp_mesh, dims, predicate)
            options = dict(dedicate_kwargs)
            if "param_policy" not in options and "compute_dtype" not in options:
                options["compute_dtype"] = kw.get("param_dtype")
            if "reshard_after_forward" not in options:  # as torchtitan's FSDP2 modules
                options["reshard_after_forward"] = _fsdp_reshards_after_forward(
                    fsdp_step, module, dp_mesh, args, kw
                )
            if carry:
                options["base_loads"] = _carried_loads(planned, dp_mesh)
            chosen = predicate
            if per_head:  # the head layouts as the predicate's verdicts: planned per head
                chosen = _with_layouts(predicate or default_predicate, head_layouts(module))
            dmuon.dedicate_params(
                module, shard, predicate=chosen, replicate_mesh=replicate, **options
            )
            if carry:
                _record_loads(planned, dp_mesh, runtime_of(module))
            if views is not None:
                _compute_on_storage_mesh(module, dp_mesh, views)
            calls.append(module)
            return fsdp_step(module, dp_mesh, *args, **kw)

        # Every torchtitan module that imported the FSDP step (DeepSeek-V3's MTP decoder calls
        # it from its own module), for the duration of the call.
        holders = _holders_of(fsdp_step)
        for holder in holders:
            holder[FSDP_STEP] = dedicate_then_fsdp
        try:
            out = parallelize_fn(
                model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs
            )
        finally:
            for holder in holders:
                holder[FSDP_STEP] = fsdp_step
        if len(calls) != 1:
            raise RuntimeError(f"dmuon: {FSDP_STEP} ran {len(calls)} times (expected once)")
        return out

    parallelize._dmuon_dedicating = True
    return parallelize


def _with_layouts(predicate, layouts: dict) -> Callable:
    """``predicate`` returning ``layouts[name]`` where it selects a weight that has one."""

    def chosen(name: str, param: torch.Tensor):
        verdict = predicate(name, param)
        if name in layouts and verdict and not isinstance(verdict, dmuon.Layout):
            return layouts[name]
        return verdict

    return chosen


def _fsdp_reshards_after_forward(fsdp_step, module, dp_mesh, args, kw) -> bool:
    """Whether torchtitan's FSDP step reshards its modules after forward: its
    ``reshard_after_forward_policy`` ("default": not with pipeline parallelism, whose
    micro-batches would otherwise gather every weight again in each forward), so the dedicated
    groups do the same."""
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

    bound = inspect.signature(fsdp_step).bind(module, dp_mesh, *args, **kw).arguments
    policy = bound.get("reshard_after_forward_policy", "default")
    return get_fsdp_reshard_after_forward_policy(policy, bool(bound.get("pp_enabled", False)))


def _carried_loads(planned: dict, dp_mesh) -> list[float] | None:
    """The summed NS loads of the stages planned before on ``dp_mesh`` (this object), or None."""
    entry = planned.get(id(dp_mesh))
    if entry is None or entry[0]() is not dp_mesh:  # a new mesh that reuses a dead one's id
        return None
    return list(entry[1])


def _record_loads(planned: dict, dp_mesh, runtime) -> None:
    """Add a freshly planned stage's NS loads to ``dp_mesh``'s record (nothing for a stage
    without dedicated weights)."""
    if runtime is None:
        return
    loads = runtime.plan.ns_loads()
    carried = _carried_loads(planned, dp_mesh)
    if carried is not None:
        loads = [a + b for a, b in zip(carried, loads)]
    for key in [k for k, (ref, _) in planned.items() if ref() is None]:
        del planned[key]  # records of meshes gone with their jobs
    planned[id(dp_mesh)] = (weakref.ref(dp_mesh), loads)


def _reduce_at_stage_end() -> None:
    """Make torch's pipeline stages reduce dedicated gradients once per step (idempotent).

    A stage runs each micro-batch's backward with FSDP2's gradient sync off, so the dedicated
    gradients accumulate on the compute copies like FSDP2's own; after the last one the schedule
    calls the stage's ``perform_reduce_grad`` (1F1B, GPipe and the looped schedules'
    ``REDUCE_GRAD`` action), which turns sync back on and reduces FSDP2's gradients by hand. Its
    wrapper here then reduces the dedicated ones of a stage whose model part has them
    (``DedicatedRuntime.reduce_accumulated``), before the schedule's gradient scaling, which
    thus scales both. Stages of other models are left as they were.
    """
    from torch.distributed.pipelining import PipelineStage

    original = PipelineStage.perform_reduce_grad
    if getattr(original, "_dmuon_reduces_dedicated", False):
        return

    @functools.wraps(original)
    def perform_reduce_grad(self, grad_scale_factor: int):
        submod = getattr(self.submod, "_orig_mod", self.submod)  # through torch.compile(model)
        runtime = runtime_of(submod)
        if runtime is None:
            return original(self, grad_scale_factor)
        original(self, 1)  # FSDP2's own reduce; gradient sync is on again
        runtime.reduce_accumulated()
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)
        return None

    perform_reduce_grad._dmuon_reduces_dedicated = True
    PipelineStage.perform_reduce_grad = perform_reduce_grad


def summarize_stages(model_parts: list[nn.Module]) -> dict:
    """The owner plans of this rank's pipeline stages (torchtitan's ``model_parts``, in order)
    and the Newton–Schulz work they add up to. Local: no collective.

    ``"stages"``: per model part, ``"plan"`` (``dmuon.summarize_comm_plan`` of the part),
    ``"ranks"`` (the global ranks of its data-parallel shard group, indexed by owner),
    ``"dedicated"`` (its dedicated weights) and ``"ns_flops_per_rank"`` (each of those ranks'
    Newton–Schulz FLOPs of one step for this stage). ``"ns_flops_per_rank"`` and
    ``"ns_max_over_mean"``: summed over the stages, what each rank runs in one step (a looped
    schedule puts several stages on a rank; ``dedicating`` balances their sum, so a stage's own
    ``"balance"`` can be uneven). A part without dedicated weights has ``"plan": {"dedicated":
    False, ...}`` and empty fields; with HSDP the owners span replicate × shard slots and only
    ``"plan"`` is filled.
    """
    stages, totals = [], {}
    for part in model_parts:
        plan = dmuon.summarize_comm_plan(part)
        runtime = runtime_of(part)
        if runtime is None:
            stages.append({"ranks": [], "dedicated": [], "ns_flops_per_rank": {}, "plan": plan})
            continue
        ranks = [int(r) for r in runtime.mesh.mesh.flatten().tolist()]
        loads = plan["ns_flops_per_owner"]
        per_rank = {ranks[int(o)]: f for o, f in loads.items()} if len(loads) == len(ranks) else {}
        for rank, flops in per_rank.items():
            totals[rank] = totals.get(rank, 0.0) + flops
        stages.append(
            {
                "ranks": ranks,
                "dedicated": runtime.param_names(),
                "ns_flops_per_rank": per_rank,
                "plan": plan,
            }
        )
    mean = sum(totals.values()) / len(totals) if totals else 0.0
    return {
        "stages": stages,
        "ns_flops_per_rank": dict(sorted(totals.items())),
        "ns_max_over_mean": max(totals.values()) / mean if mean else 1.0,
    }


def _torchtitan_fsdp_step():
    from torchtitan.distributed import fsdp

    return getattr(fsdp, FSDP_STEP)


def _holders_of(fsdp_step) -> list[dict]:
    """The globals of every loaded torchtitan module bound to ``fsdp_step``."""
    return [
        vars(module)
        for name, module in list(sys.modules.items())
        if name.startswith("torchtitan")
        and module is not None
        and vars(module).get(FSDP_STEP) is fsdp_step
    ]


class MuonOptimizers(OptimizersContainer):
    """torchtitan's optimizer container with one ``dmuon.Muon`` per model part: dedicated
    weights (and ``predicate``'s matrices) get Muon, the rest AdamW, with each group's
    ``param_names`` set for torchtitan's FQN-keyed checkpoint state."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        momentum: float = 0.95
        nesterov: bool = True
        weight_decay: float = 0.0
        adamw_lr: float = 3e-4
        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.0
        ns_backend: str = "gram"
        adjust_lr_fn: str = "match_rms_adamw"
        compile: bool | None = None
        """``Muon(compile=...)``: None compiles the step on CUDA."""
        momentum_dtype: str = "fp32"
        """``Muon(momentum_dtype=...)``: ``"fp32"`` (the weights' dtype), ``"bf16"`` or
        ``"int8"`` (blockwise 8-bit)."""
        offload: str | None = None
        """``Muon(offload=...)``: ``"momentum"`` keeps the Muon momentum in host memory,
        ``"state"`` the owners' master weights too (needs a bf16 ``mixed_precision_param``)."""
        momentum_in_flight: int | None = IN_FLIGHT
        """``Muon(momentum_in_flight=...)``: with an 8-bit or offloaded momentum, the shape
        buckets the step materialises at once (``None``: all)."""
        keep_new_momentum: bool = False
        """``Muon(keep_new_momentum=...)``: the new momentum kept from the directions and
        swapped in at the commit (fewer bytes per step, one more momentum's worth of memory
        during it)."""
        per_head: bool = False
        """``dmuon.set_head_layouts`` on every model part first: q, k, v and o per head (give
        ``dedicating(..., per_head=True)`` too: the owner plan then prices per-head NS)."""
        normuon: bool = False
        """``Muon(normuon=...)``: NorMuon's per-neuron normalisation of each update."""
        qk_clip: float | None = None
        """``Muon(qk_clip=τ)``: QK-clip after every step (each model part's attention)."""
        expert_ns: str = "per_replica"
        """``Muon(expert_ns=...)``: ``"once"`` splits HSDP's replicated expert stacks' NS
        between the replicas (each expert orthogonalised once per job)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.momentum_dtype not in MOMENTUM_DTYPES:  # configs hold the names
            raise ValueError(
                f"MuonOptimizers: momentum_dtype={config.momentum_dtype!r}: choose one of "
                f"{sorted(MOMENTUM_DTYPES)}"
            )
        check_offload(config.offload)
        check_in_flight(config.momentum_in_flight)
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        for model in model_parts:
            if config.per_head:
                dmuon.set_head_layouts(model)
            opt = dmuon.Muon(
                model,
                lr=config.lr,
                momentum=config.momentum,
                nesterov=config.nesterov,
                weight_decay=config.weight_decay,
                ns_backend=config.ns_backend,
                adjust_lr_fn=config.adjust_lr_fn,
                adamw_lr=config.adamw_lr,
                adamw_betas=tuple(config.adamw_betas),
                adamw_eps=config.adamw_eps,
                adamw_weight_decay=config.adamw_weight_decay,
                compile=config.compile,
                momentum_dtype=config.momentum_dtype,
                offload=config.offload,
                momentum_in_flight=config.momentum_in_flight,
                keep_new_momentum=config.keep_new_momentum,
                normuon=config.normuon,
                qk_clip=config.qk_clip,
                expert_ns=config.expert_ns,
            )
            for group in opt.param_groups:  # torchtitan's checkpoint state is keyed by these
                group["param_names"] = [canonical_fqn(opt.param_name(p)) for p in group["params"]]
                all_params.extend(group["params"])
            self.optimizers.append(opt)
        self._validate_params(all_params)
        self._post_init(all_params)

    def state_dict(self) -> dict:
        self._check_state_exists("save")
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_state_exists("load")
        # torchtitan's unflatten takes the keys the live state has: a stored momentum (8-bit,
        # offloaded) shows its checkpoint key again first, or it would load nothing.
        for opt in self.optimizers:
            opt.to_checkpoint_form()
        super().load_state_dict(state_dict)

    def _check_state_exists(self, what: str) -> None:
        """torchtitan's container creates the optimizers' state with a zero step that it skips
        while any gradient is set: a checkpoint would then hold (save) or take (load) no
        momentum at all, silently."""
        for opt in self.optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            if not opt.state and any(p.grad is not None for p in params):
                raise RuntimeError(
                    f"MuonOptimizers: cannot {what} the optimizer state before the first step "
                    "while gradients are set (torchtitan's container would skip creating it, "
                    f"and the checkpoint would {'hold' if what == 'save' else 'take'} no "
                    "momentum): call optimizers.zero_grad() first"
                )
