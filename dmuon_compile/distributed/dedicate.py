"""``dedicate_params``: the entry point that makes chosen matrices live whole on one owner rank.

Each dedicated weight stays a registered parameter of its module under its original name: an
``nn.Parameter`` holding a DTensor of its global shape on its owner's one-rank mesh (whole on the
owner, empty elsewhere; ``_owner/tensor.py``), the way FSDP2 registers its sharded parameters as
``Shard(0)`` DTensors. Its module's class becomes a holder subclass
(``_owner/holder.py``) so that the user's plain ``fully_shard(block); fully_shard(model)`` calls
(made afterwards, the documented order) leave it alone. The group hooks (``_runtime/runtime.py``)
swap the unsharded compute copy in for forward and backward. The design, tensor by tensor:
docs/dedicated_params.md.

The planning (which weights, their layouts and hook groups, the owner plan) is
:func:`plan_dedicated`, a pure function of the model's names, shapes and dtypes: the dry run
(``python -m dmuon_compile.plan``, docs/dry_run.md) runs the same code on a meta-device model.

HSDP (``replicate_mesh`` of size R > 1 next to the shard mesh of size S): the plan balances the
owners over all R × S ranks, so every matrix has exactly one global owner and Newton–Schulz
runs once per matrix in the whole job; the owner's shard coordinate in the other replicas keeps
a copy that the replicate broadcast refreshes after each step (see ``_runtime/replicate.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon_compile import env
from dmuon_compile.dedicated_registry import attach_runtime, runtime_of
from dmuon_compile.distributed import mesh_checks
from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat
from dmuon_compile.distributed._owner.holder import make_holder, mark_ancestors
from dmuon_compile.distributed._owner.init import key_fills
from dmuon_compile.distributed._owner.meshes import owner_mesh, set_dp_mesh
from dmuon_compile.distributed._owner.param import DedicatedParam
from dmuon_compile.distributed._runtime.group import DedicatedGroup
from dmuon_compile.distributed._runtime.replicate import ReplicateStage
from dmuon_compile.distributed._runtime.runtime import DedicatedRuntime
from dmuon_compile.distributed._stages import tp as _tp
from dmuon_compile.distributed._stages.split_step import build_split_groups
from dmuon_compile.distributed.owner_plan import (
    MatrixSpec,
    OwnerPlan,
    extract_layer_id,
    plan_owners,
)
from dmuon_compile.distributed.policy import resolve_dtypes
from dmuon_compile.layouts import Layout, infer_layout, resolve_layout, set_layout
from dmuon_compile.routing import routing_module

PROFILE_ENV = env.RECORD_FORWARD_PROFILE


def _call_predicate(predicate, name: str, param: Tensor, modules: list[nn.Module]):
    """``False``, ``True``, or the :class:`Layout` the predicate returned (selected).

    The default leaves expert stacks to FSDP2: sharded along the expert dim (its default
    ``Shard(0)``), every rank holds whole experts and orthogonalises its own, so their Newton–
    Schulz spreads over all ranks (dedicated whole, one rank would run a stack's every expert).
    A predicate may still select them (each stack then has one owner)."""
    if predicate is None:
        from dmuon_compile.routing import default_muon_predicate, routing_module

        module = routing_module(modules)
        layout = infer_layout(name, param, module)
        if layout is not None and layout.kind == "experts":
            return False
        return default_muon_predicate(name, param, module)
    verdict = predicate(name, param)
    return verdict if isinstance(verdict, Layout) else bool(verdict)


def _check_arguments(
    predicate, hook_boundary_predicate, layer_id_fn, timeout, split_size=1
) -> None:
    """Bad arguments fail here, naming the argument and the fix, before anything changes."""
    for arg, value, form in (
        ("predicate", predicate, "lambda name, param: name.endswith('proj.weight')"),
        ("hook_boundary_predicate", hook_boundary_predicate, "lambda name, module: ..."),
        ("layer_id_fn", layer_id_fn, "lambda fqn: fqn.split('.')[1]"),
    ):
        if value is not None and not callable(value):
            raise TypeError(
                f"dedicate_params: {arg} must be a callable or None, got "
                f"{type(value).__name__} {value!r}; e.g. {arg}={form}"
            )
    if timeout is not None and (
        not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0
    ):
        raise ValueError(
            f"dedicate_params: timeout must be a positive datetime.timedelta, got {timeout!r}; "
            "e.g. timeout=datetime.timedelta(minutes=5)"
        )
    if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < 1:
        raise ValueError(
            f"dedicate_params: split_size must be a positive int (ranks sharing one matrix's "
            f"Newton–Schulz), got {split_size!r}; e.g. split_size=8 for a node of 8 GPUs, or 1"
        )


def _no_match_warning(model: nn.Module) -> None:
    shown = [f"{n} {tuple(p.shape)}" for n, p in model.named_parameters() if p.ndim == 2][:6]
    hint = ", ".join(shown) if shown else "(the model has no 2-D parameters)"
    warnings.warn(
        "dedicate_params: no parameters matched the predicate; nothing is dedicated (every "
        f"parameter stays under FSDP2). 2-D parameters of this model include: {hint}. Debug "
        "with: for name, p in model.named_parameters(): print(name, p.shape) if p.ndim == 2 "
        "else None — and adjust the predicate to match those names.",
        UserWarning,
        stacklevel=3,
    )


def _boundary_module(
    model: nn.Module, fqn: str, hook_boundary_predicate, layer_id_fn
) -> tuple[str, nn.Module]:
    """The module whose forward hooks unshard/reshard this parameter (its hook group)."""
    module_path = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    parts = module_path.split(".") if module_path else []
    if hook_boundary_predicate is not None:
        for k in range(len(parts), -1, -1):  # nearest ancestor first, the module itself included
            path = ".".join(parts[:k])
            module = model.get_submodule(path)
            if hook_boundary_predicate(path, module):
                return path, module
        return module_path, model.get_submodule(module_path)
    layer = (layer_id_fn or extract_layer_id)(fqn)
    if layer is not None:
        try:
            return layer, model.get_submodule(layer)
        except AttributeError:
            pass
    parent = ".".join(parts[:-1])  # the parent of the parameter's module (e.g. the attention block)
    return parent, model.get_submodule(parent)


def _check_boundary_runs(fqn: str, path: str, module: nn.Module) -> None:
    """A hook group's module must run forward, or its weights are never gathered."""
    if type(module).forward is nn.Module.forward:  # ModuleList, ModuleDict: no forward of their own
        raise ValueError(
            f"dedicate_params: {fqn} would be gathered by the forward hooks of "
            f"{path or '<root>'!r}, a {type(module).__name__}, which never runs forward (its "
            "children are called one by one), so the weight would never be gathered. Fix: pass "
            "hook_boundary_predicate=lambda name, module: <True for modules that run forward, "
            "e.g. the parameter's own module>, or layer_id_fn= mapping the name to such a "
            "module's path."
        )


def _check_no_reentrant_wrapper(model: nn.Module, selected: list) -> None:
    """Refuse a reentrant ``checkpoint_wrapper`` around dedicated weights, applied before this
    call (the documented error). Applied after, the recomputation hook raises it; applied
    before, the wrapper is the hook group, outside the recomputation, and the weights would
    silently take the reentrant backward. Duck-typed on the wrapper's ``checkpoint_impl`` (an
    enum member named ``REENTRANT``): no import of torch's private module."""
    for path, module in model.named_modules():
        impl = getattr(module, "checkpoint_impl", None)
        if getattr(impl, "name", None) != "REENTRANT":
            continue
        prefix = f"{path}." if path else ""
        inside = [name for name, _ in selected if name.startswith(prefix)]
        if inside:
            raise RuntimeError(
                f"dmuon_compile: {path or '<root>'!r} is a checkpoint_wrapper with "
                f"CheckpointImpl.REENTRANT around dedicated weights ({inside[0]}"
                f"{f' and {len(inside) - 1} more' if len(inside) > 1 else ''}): reentrant "
                "activation checkpointing is not supported (its first forward runs without "
                "gradients, and the dedicated runtime follows only non-reentrant "
                "recomputation). Fix: checkpoint_wrapper with its default "
                "CheckpointImpl.NO_REENTRANT, or torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False)."
            )


def _whole_on(p: Tensor, device: torch.device) -> Tensor | None:
    """This rank's whole copy of an owned weight on ``device``; ``None`` for a meta weight (its
    master is allocated, uninitialised, where it lives: see ``_allocate_master``)."""
    return None if p.is_meta else p.detach().to(device)


def _allocate_master(dp: DedicatedParam, device: torch.device) -> Tensor:
    """The master of a weight built on the meta device: uninitialised memory, as
    ``model.to_empty`` gives the other parameters; initialisation or a load fills it."""
    return torch.empty(dp.shape, dtype=dp.orig_dtype, device=device)


def _check_plan_identical(
    plan, pg, device, rank: int, axis: str = "shard", on_meta: bool = False
) -> None:
    # Whether the weights are on the meta device decides whether dedicate_params publishes
    # (HSDP, a collective) or defers it to the first forward: it must agree too.
    mine = hashlib.sha256(f"{plan.digest()} meta={on_meta}".encode()).hexdigest()
    digests = C.all_gather_digests(mine, pg, device)
    if len(set(digests)) != 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            f"dedicate_params: the owner plan differs across ranks of the {axis} group (rank "
            f"{rank}: "
            f"{digests[rank][:12]}; ranks {differing} differ from rank 0: {digests[0][:12]}). A "
            "plan "
            "mismatch would hang "
            "the first collective, so this stops here. Fix: build the same model on every rank "
            "(on the meta device everywhere or nowhere) and pass the same predicate / "
            "layer_id_fn / hook_boundary_predicate / param_policy everywhere (no rank-dependent "
            "logic in them)."
        )


@dataclass
class _Selection:
    """The parameters a predicate selects, and every module that holds each parameter."""

    module_of: dict[int, list[nn.Module]]
    verdicts: dict[str, object]  # False, True or the Layout the predicate returned
    selected: list[tuple[str, Tensor]]


def _select(model: nn.Module, predicate) -> _Selection:
    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)
    verdicts = {
        name: _call_predicate(predicate, name, p, module_of[id(p)]) if p.requires_grad else False
        for name, p in model.named_parameters()
    }
    selected = [(name, p) for name, p in model.named_parameters() if verdicts[name] is not False]
    return _Selection(module_of, verdicts, selected)


@dataclass
class DedicatedPlan:
    """What ``dedicate_params`` decides before it touches a tensor or a process group: the
    selected weights, their layouts and hook groups, and the owner plan. A pure function of the
    model's names, shapes and dtypes (:func:`plan_dedicated`), so a model on the meta device
    plans without GPUs (``python -m dmuon_compile.plan``)."""

    selected: list[tuple[str, Tensor]]
    module_of: dict[int, list[nn.Module]]
    layouts: dict[str, Layout]
    # fqn -> (path, module) whose forward hooks unshard it: its hook group
    boundaries: dict[str, tuple[str, nn.Module]]
    specs: list[MatrixSpec]
    # owners over replicate_size × world_size ranks (replicate_size set); ``None``: nothing
    # was selected
    plan: OwnerPlan | None
    tp_owners: _tp.TPOwners | None = None
    tp_fqns: set[str] = field(default_factory=set)

    def owners(self) -> dict[str, int]:
        return self.plan.owners() if self.plan is not None else {}


def _plan_selected(
    model: nn.Module,
    selection: _Selection,
    *,
    world_size: int,
    replicate_size: int,
    hook_boundary_predicate,
    layer_id_fn,
    tp_size: int | None,
    tp_fqns: set[str],
    tp_shard_dims: dict[str, int] | None = None,
    split_size: int = 1,
    ns=None,
    base_loads: Sequence[float] | None = None,
) -> DedicatedPlan:
    """Check the selected weights, resolve their layouts and hook groups, plan the owners."""
    selected, module_of, verdicts = selection.selected, selection.module_of, selection.verdicts
    boundaries = {}
    for name, p in selected:
        if p.ndim < 2:
            raise ValueError(
                f"dedicate_params: {name} has shape {tuple(p.shape)}; only ≥2-D weights can be "
                "dedicated"
            )
        if len(module_of[id(p)]) > 1:
            raise ValueError(
                f"dedicate_params: {name} is shared by several modules (tied weights); exclude it "
                "with predicate="
            )
        boundaries[name] = _boundary_module(model, name, hook_boundary_predicate, layer_id_fn)
        _check_boundary_runs(name, *boundaries[name])
    # What each selected weight's matrices are (an expert stack: one per expert); an unknown
    # ≥3-D layout raises here, before anything changed.
    layouts = {
        name: resolve_layout(
            name, p, routing_module(module_of[id(p)]), verdicts[name], dedicating=True
        )
        for name, p in selected
    }
    specs = [MatrixSpec(n, tuple(p.shape), p.element_size(), layouts[n]) for n, p in selected]
    if split_size != 1:  # the planner splits layout-free specs only: a plain 2-D matrix is one
        specs = [replace(s, layout=None) if s.layout == Layout.matrix() else s for s in specs]
    ranks = replicate_size * world_size
    if tp_size is None:
        kwargs = {} if ns is None else {"ns": ns}
        plan = plan_owners(
            specs,
            ranks,
            layer_id_fn=layer_id_fn,
            split_size=split_size,
            base_loads=base_loads,
            **kwargs,
        )
        tp_owners = None
    else:  # owners over DP × TP slots: shard t of a matrix has the same DP owner on every t
        if split_size != 1:
            raise NotImplementedError(
                f"split_size={split_size} with TP (tp_size={tp_size}): split planning covers "
                "data-parallel owners only; plan with split_size=1"
            )
        if base_loads is not None:
            raise NotImplementedError(
                f"base_loads with TP (tp_size={tp_size}): the DP × TP planner starts from "
                "empty slots; plan without base_loads"
            )
        kwargs = {} if ns is None else {"ns": ns}
        plan, tp_owners = _tp.plan_tp_owners(
            specs,
            ranks,
            tp_size,
            tp_fqns,
            tp_shard_dims=tp_shard_dims,
            layer_id_fn=layer_id_fn,
            **kwargs,
        )
    plan.replicate_size = replicate_size
    return DedicatedPlan(
        selected, module_of, layouts, boundaries, specs, plan, tp_owners, set(tp_fqns)
    )


def plan_dedicated(
    model: nn.Module,
    *,
    world_size: int,
    replicate_size: int = 1,
    predicate: Callable[[str, Tensor], bool] | None = None,
    hook_boundary_predicate: Callable[[str, nn.Module], bool] | None = None,
    layer_id_fn: Callable[[str], str | None] | None = None,
    tp_size: int = 1,
    tp_fqns: set[str] | None = None,
    tp_shard_dims: dict[str, int] | None = None,
    split_size: int = 1,
    ns=None,
    base_loads: Sequence[float] | None = None,
) -> DedicatedPlan:
    """The planning of :func:`dedicate_params`, without a mesh or a process group: which
    weights are dedicated (same predicate, checks and layouts), their hook groups, and the
    owner plan over ``replicate_size × world_size`` ranks (HSDP owners are global:
    ``replica · world_size + shard``). Works on a model built on the meta device.

    ``world_size`` is the shard group's size (``mesh.size()``). ``tp_size > 1``: plan over the
    DP × TP slots as ``dedicate_params`` does for a TP model, with ``tp_fqns`` the TP-sharded
    weights (default: every selected 2-D weight) and ``tp_shard_dims`` their TP shard dims
    (``{fqn: 0 or 1}``: a weight whose shards hold whole heads loads each TP slot with its own
    heads; default: every TP weight gathered whole on one slot). ``split_size``: passed to
    ``plan_owners``
    (split planning). ``ns``: the object whose ``flops(m, n)`` prices Newton–Schulz (default
    ``NewtonSchulz()`` on this machine, as ``dedicate_params``). ``base_loads``: as in
    ``dedicate_params``.

    Example::

        with torch.device("meta"):
            model = MyTransformer()
        planned = plan_dedicated(model, world_size=64, replicate_size=2)
        planned.owners()  # {fqn: global owner rank}
    """
    _check_arguments(predicate, hook_boundary_predicate, layer_id_fn, None)
    for arg, value in (
        ("world_size", world_size),
        ("replicate_size", replicate_size),
        ("tp_size", tp_size),
        ("split_size", split_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan_dedicated: {arg} must be an integer >= 1, got {value!r}")
    selection = _select(model, predicate)
    if not selection.selected:
        return DedicatedPlan([], selection.module_of, {}, {}, [], None)
    _check_no_reentrant_wrapper(model, selection.selected)
    if tp_fqns is None:
        tp_fqns = {n for n, p in selection.selected if p.ndim == 2} if tp_size > 1 else set()
    return _plan_selected(
        model,
        selection,
        world_size=world_size,
        replicate_size=replicate_size,
        hook_boundary_predicate=hook_boundary_predicate,
        layer_id_fn=layer_id_fn,
        tp_size=tp_size if tp_size > 1 else None,
        tp_fqns=set(tp_fqns),
        tp_shard_dims=tp_shard_dims,
        split_size=split_size,
        ns=ns,
        base_loads=base_loads,
    )


def dedicate_params(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, Tensor], bool] | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    param_policy=None,
    replicate_mesh=None,
    hook_boundary_predicate: Callable[[str, nn.Module], bool] | None = None,
    layer_id_fn: Callable[[str], str | None] | None = None,
    reshard_after_forward: bool = True,
    timeout: datetime.timedelta | None = None,
    split_size: int = 1,
    base_loads: Sequence[float] | None = None,
) -> dict[str, int]:
    """Give each selected matrix one owner rank; keep it out of FSDP2; install the hooks.

    Call after any TP ``parallelize_module`` and before your ``fully_shard`` calls. Then build
    ``dmuon.Muon(model, ...)``: dedicated matrices get Muon on their owner, everything else
    (FSDP2 DTensors) AdamW on its shard.

    A model built on the meta device (the way to build one that does not fit on a rank) is
    placed from its shapes: each owner allocates its masters, uninitialised, on the mesh's
    device (HSDP: its owner column's copies too; TP: its shards), and nothing else of a
    dedicated weight is allocated. Then ``fully_shard``, ``model.to_empty(device=...)`` and
    initialise: the model's own ``nn.init`` calls (they fill each dedicated weight on its
    owner), ``dmuon.set_model_state_dict`` or a DCP load. With HSDP the first forward
    publishes the global owners' weights to the other replicas.

    Args:
        model: the root module (FQNs are relative to it): its parameters on the device the
            mesh computes on, or all on the meta device (never a mix across ranks).
        mesh: the 1-D data-parallel (shard) ``DeviceMesh``.
        predicate: ``predicate(name, param) -> bool`` selects the dedicated parameters
            (default: ≥2-D weights except embeddings and output heads).
        compute_dtype: legacy name of ``param_policy.defaults.param_dtype``.
        param_policy: object with ``.defaults.param_dtype`` (and optional ``.reduce_dtype``),
            e.g. ``dmuon.ParamPolicy``; ``None`` inherits each parameter's dtype. Without a
            ``reduce_dtype`` the gradient reduce uses FSDP2's (see ``policy.py``).
        replicate_mesh: HSDP replicate mesh (``hsdp["replicate"]``, with ``mesh=hsdp["shard"]``).
            Owners are then spread over all replicate × shard ranks; gradients are reduced over
            the shard group to the owner's column, then over the replicate group to the one
            global owner (averaged over shard × replicate, or divided by FSDP2's
            ``set_gradient_divide_factor``); after ``Muon.step`` the owner
            broadcasts the new weight to its replicate peers — asynchronously, waited for in
            the next forward, with ``Muon(replicate_async=True)`` (default).
        hook_boundary_predicate: ``(module_name, module) -> bool`` picks the modules whose
            forward hooks move the weights (nearest matching ancestor of each parameter).
            Default: the layer module (``layers.N``...) or the parameter module's parent.
        layer_id_fn: ``fqn -> layer id`` override for the owner plan and the default groups.
        reshard_after_forward: free the unsharded weights after each group's forward (and
            gather them again in backward); ``False`` keeps them until the end of backward.
        timeout: timeout of the process groups this call creates (a frozen or dead peer
            makes every survivor raise after it, naming the collective). Default: the default
            process group's, i.e. ``init_process_group(timeout=...)``. The TP stage runs on
            the TP mesh's own group, with that group's timeout (docs/communicators.md:
            timeouts).
        split_size: ranks that share one matrix's Newton–Schulz (default 1: never). With e.g.
            8 (a node), a 2-D matrix whose NS alone exceeds a rank's balanced share of the
            step is planned over an aligned block of 8 ranks: its owner (the block's first)
            keeps the weight and gradient, and in ``Muon.step`` the block orthogonalises it
            together (``distributed/split_ns.py``); ``summarize_comm_plan(model)["split"]``
            lists them. The data-parallel world (× replicas) must divide by it; not with TP.
        base_loads: Newton–Schulz FLOPs that each of the plan's ranks already runs for other
            models' dedicated weights, one per owner slot (``replicate × shard`` with HSDP,
            indexed as the returned owners), e.g. the summed ``ns_loads()`` of the other
            pipeline stages this data-parallel group holds. The owners then balance those loads
            and this model's together (``plan_owners(base_loads=...)``). Every rank must pass
            the same values (owners that differ fail the plan check). ``None`` (default): this
            model is planned alone. Not with TP.

    Returns:
        ``{fqn: owner rank}`` for every dedicated parameter: ranks of ``mesh``; with HSDP the
        global owner ``replicate_rank * shard_size + shard_rank`` (its rank in the 2-D mesh).

    Example (a meta-device model; a materialised one skips ``to_empty`` and the init)::

        mesh = init_device_mesh("cuda", (world_size,))
        with torch.device("meta"):
            model = MyTransformer()
        owners = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cuda")
        model.init_weights()  # or dmuon.set_model_state_dict(model, full_state_dict)
        opt = dmuon.Muon(model, lr=0.02)

    HSDP (2 replicas of 4-rank shard groups on 8 GPUs)::

        hsdp = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])
        for block in model.layers:
            fully_shard(block, mesh=hsdp)
        fully_shard(model, mesh=hsdp)
        opt = dmuon.Muon(model, lr=0.02)  # replicate_async=True: publish overlaps the next forward
    """
    if runtime_of(model) is not None:
        raise RuntimeError("dedicate_params was already called on this model (call it once)")
    _check_arguments(predicate, hook_boundary_predicate, layer_id_fn, timeout, split_size)
    mesh_checks.check_shard_mesh(mesh)
    mesh_checks.check_replicate_mesh(mesh, replicate_mesh)
    if _fsdp_compat.fsdp_modules(model):
        raise RuntimeError(
            "dedicate_params must run before fully_shard (FSDP2 already owns this model's "
            "parameters). Order: parallelize_module (TP, optional) → dmuon.dedicate_params → "
            "fully_shard(blocks) → fully_shard(model) → dmuon.Muon(model)."
        )

    selection = _select(model, predicate)
    if not selection.selected:
        _no_match_warning(model)
        return {}
    selected = selection.selected
    _check_no_reentrant_wrapper(model, selected)
    tp = _tp.detect_tp(selected, mesh, replicate_mesh)  # None without TP-sharded weights
    if tp is None:  # a TP model whose dedicated weights are all plain: one master per column
        tp = _tp.detect_tp_mesh(model, mesh, replicate_mesh)
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    # The planning the dry run (dmuon_compile.plan) runs too: checks, layouts, the owner plan.
    planned = _plan_selected(
        model,
        selection,
        world_size=mesh.size(),
        replicate_size=replicas,
        hook_boundary_predicate=hook_boundary_predicate,
        layer_id_fn=layer_id_fn,
        tp_size=tp.size if tp is not None else None,
        tp_fqns={n for n, p in selected if isinstance(p, DTensor)},
        tp_shard_dims={
            n: p.placements[0].dim
            for n, p in selected
            if isinstance(p, DTensor) and p.placements[0].is_shard()
        },
        split_size=split_size,
        base_loads=base_loads,
    )
    module_of, layouts = planned.module_of, planned.layouts
    plan, tp_owners = planned.plan, planned.tp_owners

    # A model built on the meta device: each owner allocates its masters here (uninitialised,
    # like model.to_empty); nothing else of a dedicated weight is ever allocated whole.
    on_meta = any(p.is_meta for _, p in selected)
    # Communicators of our own for the dims FSDP2 issues collectives on (shard, replicate): its
    # collectives on the mesh's groups never queue behind ours (docs/communicators.md).
    pg = C.private_group(mesh, timeout)
    rank, world = mesh.get_local_rank(), mesh.size()
    rep_pg = C.private_group(replicate_mesh, timeout) if replicas > 1 else None
    rep_rank = replicate_mesh.get_local_rank() if replicas > 1 else 0
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
    if tp is not None:
        # The TP mesh's own group: FSDP2 never issues collectives on it (only TP's activation
        # collectives do), so a duplicate communicator would buy nothing worth its memory.
        tp_pg = tp.mesh.get_group()
        _check_plan_identical(plan, tp_pg, device, tp.rank, axis="tp", on_meta=on_meta)
    _check_plan_identical(plan, pg, device, rank, on_meta=on_meta)
    if rep_pg is not None:  # shard groups and replicate groups together connect every rank
        _check_plan_identical(plan, rep_pg, device, rep_rank, axis="replicate", on_meta=on_meta)
    owners = plan.owners()

    record = env.record_forward_profile()
    # Global rank of each (shard rank, replica rank): the owners' one-rank meshes use it.
    dp_mesh = _tp.dp_grid_mesh(mesh, replicate_mesh)
    rank_grid = dp_mesh.mesh.reshape(replicas if replicate_mesh is not None else 1, world)
    params: list[DedicatedParam] = []
    initial: dict[str, Tensor] = {}  # this rank's whole copy (owner column), on the device
    grouped: dict[tuple, list[DedicatedParam]] = {}
    group_module: dict[tuple, tuple[str, nn.Module]] = {}
    for name, p in selected:
        module = module_of[id(p)][0]
        attr = name.rsplit(".", 1)[-1]
        param_dtype, reduce_dtype = resolve_dtypes(p.dtype, param_policy, compute_dtype)
        rep_owner, owner = divmod(owners[name], world)
        if tp is not None and name in tp_owners.tp_owner:
            group_ranks = _tp.owner_group_ranks(tp, rank_grid, rep_owner, owner)
            dp = _tp.make_tp_param(
                name, module, attr, owner, p, p.dtype, param_dtype, rep_owner,
                tp_owners.tp_owner[name], tp, group_ranks,
            )  # fmt: skip
            if owner == rank:
                initial[name] = _whole_on(p.to_local(), device)
        else:
            dp = DedicatedParam(
                name, module, attr, owner, p.shape, p.dtype, param_dtype, replica_owner=rep_owner
            )
            if owner == rank:
                initial[name] = _whole_on(p, device)
            elif not p.is_meta:
                p.data = torch.empty(0, dtype=p.dtype, device=device)  # free the non-owner copy
        params.append(dp)
        path, bmod = planned.boundaries[name]
        key = (path, param_dtype, reduce_dtype)
        grouped.setdefault(key, []).append(dp)
        group_module[key] = (path, bmod)

    groups = []
    masters: dict[str, Tensor] = {}  # the global owner's master: its original tensor or a view
    for key, members in grouped.items():
        path, bmod = group_module[key]
        label = path or "<root>"
        if sum(1 for k in grouped if k[0] == path) > 1:
            label = f"{label}[{key[1]}]"
        g = DedicatedGroup(
            label,
            bmod,
            members,
            rank,
            world,
            pg,
            device,
            key[1],
            key[2] or key[1],  # until the runtime reads FSDP2's (``follow_fsdp``)
            reshard_after_forward=reshard_after_forward,
            policy_reduce_dtype=key[2],
        )
        g.build()
        if rep_pg is not None:
            g.replicate = ReplicateStage(
                g.params_of(rank), rep_rank, replicas, world, rep_pg, device, key[1], name=label
            )
            masters.update(g.replicate.build(initial))
        else:
            masters.update(
                {
                    dp.fqn: initial[dp.fqn]
                    if initial[dp.fqn] is not None
                    else _allocate_master(dp, device)
                    for dp in g.params_of(rank)
                }
            )
        groups.append(g)
    for dp in params:
        global_owner = int(rank_grid[dp.replica_owner, dp.owner])
        omesh = owner_mesh(mesh.device_type, global_owner, dp_mesh)
        set_dp_mesh(omesh, dp_mesh)  # where its norms go: FSDP2's mesh (clip_grad_norm_)
        dp.register(omesh, masters.get(dp.fqn), device)
        set_layout(dp.param, layouts[dp.fqn])  # Muon(model) reads it: per-expert NS on the owner
        make_holder(dp.module, dp.attr, dp)
    mark_ancestors(model)  # model.to(dtype) checks every dedicated weight before converting
    for g in groups:
        if g.replicate is not None and not on_meta:
            # the global owner's initial weights are the truth everywhere
            g.replicate.publish().apply(forward=False)
    initial.clear()
    masters.clear()
    runtime = DedicatedRuntime(
        model, plan, params, groups, mesh, rank, world, record, replicate_mesh
    )
    if tp is not None:
        runtime.attach_tp(_tp.build_stage(tp, tp_pg, tp_owners, params, groups, replicas > 1))
    # Every rank creates every split group, in the plan's order (new_group is collective).
    runtime.split = build_split_groups(
        plan, {dp.fqn: dp.param for dp in params}, rank_grid, timeout
    )
    for dp in params:  # random fills of the weight draw from its own generator (_owner/init.py)
        if dp.owns:
            shard = tp.rank if isinstance(dp, _tp.TPDedicatedParam) else 0
            key_fills(dp.param, dp.fqn, shard)
    if on_meta:
        # Nothing to publish yet: the masters are filled after model.to_empty (init or load).
        # The first forward publishes whatever the global owners then hold.
        runtime.request_publish()
    attach_runtime(model, runtime)
    return owners


def dedicated_runtime(model: nn.Module) -> DedicatedRuntime:
    """The runtime ``dedicate_params`` attached to ``model`` (error naming the fix otherwise)."""
    runtime = runtime_of(model)
    if runtime is None:
        raise ValueError(
            "this model has no dedicated parameters: call dmuon.dedicate_params(model, mesh, ...) "
            "first"
        )
    return runtime
