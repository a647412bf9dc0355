"""``Muon``'s parameter groups: how what the user passes becomes complete Muon and AdamW groups.

A module, parameters, ``(name, parameter)`` pairs or group dicts of those; each group gets
``use_muon`` (given, or chosen by the routing rule of ``routing.py``), that kind's defaults and,
for named parameters, ``param_names`` (as ``torch.optim`` keeps them). Hyper-parameters live as
0-d tensors (:func:`_tensor_hypers`, :func:`_hold_hypers`), so a scheduler never makes a
user-compiled step recompile. ``Muon`` holds a :class:`GroupRouting` (it never reads the
optimizer) and registers :func:`_hold_hypers` as its step pre-hook.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from dmuon_compile.functional import MATRIX
from dmuon_compile.layouts import get_layout, resolve_layout
from dmuon_compile.routing import default_muon_predicate
from dmuon_compile.routing import route_model as _route_model

if TYPE_CHECKING:
    from collections.abc import Callable

    from dmuon_compile.layouts import Layout


class HookedOptimizer(Protocol):
    """What the step pre-hook :func:`_hold_hypers` reads of the optimizer it is registered on."""

    param_groups: list[dict]
    _held_hypers: dict[tuple[int, str], Tensor]

    def param_name(self, p: Tensor) -> str: ...


class GroupRouting:
    """How what the user passes becomes complete groups, and each parameter's name and layout.

    ``Muon`` holds one (``opt._routing``) and calls it from ``__init__``, ``add_param_group``,
    ``param_name`` and ``_layout``; it never reads the optimizer.

    Args:
        model: the module of a ``Muon(model)`` (its routing and names), else ``None``.
        predicate: the user's routing predicate (module input only).
        defaults: a new group's defaults by kind: ``{True: Muon's, False: AdamW's}``.
    """

    def __init__(
        self,
        model: nn.Module | None,
        predicate: Callable | None,
        defaults: dict[bool, dict],
    ) -> None:
        self.model = model
        self.predicate = predicate
        self.defaults = defaults
        self.names: dict[int, str] = {}  # each parameter's name, by id
        # Each Muon parameter's Layout (what its matrices are), by id: routing fills it for a
        # Muon(model); ``layout`` resolves the rest (declared, or 2-D).
        self.layouts: dict[int, Layout] = {}

    def build(self, params) -> list[dict]:
        """Complete param groups from what the user passed: a module, parameters, ``(name,
        parameter)`` pairs (``model.named_parameters()``) or group dicts of either. Each group
        carries ``use_muon`` and that optimizer's defaults; named parameters also ``param_names``
        (as torch.optim keeps them: state_dict, DCP and torchtitan's checkpointer read them)."""
        if isinstance(params, nn.Module):
            from dmuon_compile.dedicated_registry import runtime_of

            runtime = runtime_of(params)
            if runtime is not None:
                runtime.check_registered()
                runtime.check_compute_dtypes()
            muon, adamw = _route_model(params, self.predicate, layouts=self.layouts)
            _refuse_cpu_offloaded(params, muon)
            if not muon and not _has_dedicated(params):
                warnings.warn(
                    "Muon: no parameter was routed to Muon (all get AdamW). Check predicate= or "
                    "call dmuon.dedicate_params(model, mesh, predicate=...) first.",
                    stacklevel=3,
                )
            groups = []
            for use_muon, named in ((True, muon), (False, adamw)):
                if named:
                    self.names.update({id(p): n for n, p in named})
                    groups.append(
                        dict(
                            self.defaults[use_muon],
                            params=[p for _, p in named],
                            param_names=[n for n, _ in named],
                        )
                    )
            return groups
        if self.predicate is not None:
            raise ValueError(
                "predicate= needs a model (names); with parameter lists set use_muon per group"
            )
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        groups = []
        for g_index, group in enumerate(params):
            groups.extend(self.complete(group, f"param_groups[{g_index}]"))
        return groups

    def complete(self, group: dict, where: str) -> list[dict]:
        """One user group as complete Muon/AdamW groups: ``use_muon`` given, or chosen by the
        constructor's rule (``route``; it may split the group in two), the rest filled from
        that kind's defaults."""
        if not isinstance(group, dict):
            raise TypeError(f"Muon: {where} must be a dict with 'params', got {type(group)}")
        if "params" not in group:
            raise ValueError(f"Muon: {where} has no 'params' key")
        tensors, names = _split_names(group, where)
        for p_index, p in enumerate(tensors):
            default = names[p_index] if names else f"{where}[{p_index}]"
            self.names.setdefault(id(p), default)
        extra = {k: v for k, v in group.items() if k not in ("params", "param_names", "use_muon")}
        if "use_muon" in group:
            chosen = [bool(group["use_muon"])] * len(tensors)
        else:
            chosen = self.route(tensors, names)
        groups = []
        for use_muon in (True, False):
            idx = [i for i, c in enumerate(chosen) if c is use_muon]
            if not idx:
                continue
            if use_muon and any(tensors[i].ndim < 2 for i in idx):
                bad = next(self.name(tensors[i]) for i in idx if tensors[i].ndim < 2)
                raise ValueError(
                    f"Muon: {where} has use_muon=True but {bad} has fewer than 2 dims: Muon "
                    "needs matrices. Put it in a group with use_muon=False (AdamW)."
                )
            new = dict(self.defaults[use_muon], **extra, params=[tensors[i] for i in idx])
            if names is not None:
                new["param_names"] = [names[i] for i in idx]
            groups.append(new)
        return groups

    def route(self, tensors: list[Tensor], names: list[str] | None) -> list[bool]:
        """Muon or not for each tensor of a group without ``use_muon``: a ``Muon(model)``
        routes its model's parameters as the constructor did; named parameters go by the
        default rule's names (≥2-D, not an output head, not an ``embed*`` module); unnamed
        ones: ≥2-D → Muon."""
        if names is None:
            chosen = {id(p): p.ndim >= 2 for p in tensors}
        else:
            chosen = {id(p): default_muon_predicate(n, p) for n, p in zip(names, tensors)}
        if self.model is not None:
            muon, adamw = _route_model(
                self.model, self.predicate, only=set(chosen), layouts=self.layouts
            )
            chosen.update({id(p): True for _, p in muon})
            chosen.update({id(p): False for _, p in adamw})
        return [chosen[id(p)] for p in tensors]

    def name_from_model(self, groups: list[dict], param_groups: list[dict]) -> None:
        """Unnamed new groups of a ``Muon(model)`` (whose groups, ``param_groups``, are named)
        get the model's names: torch.optim requires all groups named or none."""
        if self.model is None or not all("param_names" in g for g in param_groups):
            return
        names = {id(p): n for n, p in self.model.named_parameters()}
        for group in groups:
            if "param_names" not in group and all(id(p) in names for p in group["params"]):
                group["param_names"] = [names[id(p)] for p in group["params"]]
                self.names.update({id(p): names[id(p)] for p in group["params"]})

    def name(self, p: Tensor) -> str:
        return self.names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")

    def layout(self, p: Tensor) -> Layout:
        """``p``'s :class:`~dmuon_compile.layouts.Layout`: from routing, declared on it
        (``dmuon.set_layout``), or one matrix for a 2-D tensor; otherwise an error naming it."""
        layout = self.layouts.get(id(p))
        if layout is None:
            if get_layout(p) is None and p.ndim == 2:
                layout = MATRIX
            else:
                layout = resolve_layout(self.name(p), p)
            self.layouts[id(p)] = layout
        return layout

    def group_layouts(self, group: dict) -> list:
        """Each parameter's layout in a group (``None`` in an AdamW group)."""
        return [self.layout(p) if group["use_muon"] else None for p in group["params"]]


def _has_dedicated(model: nn.Module) -> bool:
    from dmuon_compile.dedicated_registry import dedicated_names

    return bool(dedicated_names(model))  # a rank may own no dedicated matrix: no warning


# The hyper-parameters a group holds as 0-d tensors: lr (LR schedulers), momentum (OneCycleLR and
# CyclicLR cycle it), weight_decay (schedules users write).
HYPER_TENSORS = ("lr", "weight_decay", "momentum")
# The 0-d tensors this module made for them, by id (a user's own tensor is not among them):
# ``state_dict`` gives their values as floats, as torch's optimizers keep a float.
_OWN_HYPERS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def _own_hyper(value: float, into: Tensor | None = None) -> Tensor:
    """A 0-d float64 CPU tensor holding ``value`` (``into`` refilled, if given): one of ours."""
    t = torch.tensor(float(value), dtype=torch.float64) if into is None else into.fill_(value)
    _OWN_HYPERS[id(t)] = t
    return t


def _is_own(value) -> bool:
    return isinstance(value, Tensor) and _OWN_HYPERS.get(id(value)) is value


def plain_hypers(groups: list[dict]) -> list[dict]:
    """``state_dict()["param_groups"]`` with the hyper-parameters as Python floats, as torch's
    optimizers save them (JSON-serialisable, loadable by any optimizer): the 0-d tensors a
    group holds for a compiled step (:func:`_tensor_hypers`) are this package's own business.
    A scheduler's ``initial_lr`` (its copy of such a tensor ``lr``) too. A tensor the user put
    into a group is saved as given (as torch does). ``groups``: the packed groups (changed in
    place and returned)."""
    for group in groups:
        ours = _is_own(group.get("lr"))
        for key in HYPER_TENSORS:
            if _is_own(group.get(key)):
                group[key] = float(group[key].item())
        initial = group.get("initial_lr")
        if ours and isinstance(initial, Tensor) and initial.numel() == 1:
            group["initial_lr"] = float(initial.item())
    return groups


def restore_hypers(groups: list[dict], before: list[dict]) -> None:
    """After ``load_state_dict``: each float hyper-parameter goes back into a 0-d tensor, the
    one the group at the same position held before the load where it was ours (a user-compiled
    ``opt.step`` then keeps its graph: the same tensor input, a new value). A 0-d float64 CPU
    tensor (what this package saved before) counts as a float; other tensors loaded as such
    stay as they are. ``betas`` a JSON round trip made a list is a tuple again (the
    type the step was traced with)."""
    for index, group in enumerate(groups):
        old = before[index] if index < len(before) else {}
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
        for key in HYPER_TENSORS:
            value = group.get(key)
            if value is None or (isinstance(value, Tensor) and not _saved_by_us(value)):
                continue
            held = old.get(key)
            group[key] = _own_hyper(float(value), held if _is_own(held) else None)


def _saved_by_us(value: Tensor) -> bool:
    """A 0-d float64 CPU tensor: what this package's ``state_dict`` saved before it gave
    floats (such a checkpoint loads as one with floats)."""
    return value.dim() == 0 and value.dtype == torch.float64 and value.device.type == "cpu"


def _tensor_hypers(groups: list[dict], taken: list[dict] = ()) -> None:
    """Each group's ``lr``, ``weight_decay`` and ``momentum`` become 0-d float64 CPU tensors
    of their own.

    torch's compiled-optimizer recipe: an LR scheduler refills a tensor ``lr`` in place, so a
    user-compiled ``opt.step`` sees a new value, not a new constant, and never recompiles (a
    float is guarded by value). Eager steps read them as Python floats (``functional.hyper``):
    the same arithmetic as float groups. ``group["lr"] = 0.01`` (a float) keeps working.
    A tensor the user passed is kept unless another group (here or in ``taken``) already holds
    it (a scheduler refills each group's own).
    """
    seen = {id(g.get(key)) for g in taken for key in HYPER_TENSORS}
    for group in groups:
        for key in HYPER_TENSORS:
            value = group.get(key)
            if isinstance(value, Tensor) and id(value) not in seen:
                seen.add(id(value))
                continue
            if value is not None:
                group[key] = _own_hyper(float(value))
                seen.add(id(group[key]))


@torch.compiler.disable  # eager: what the traced step then reads is the same tensor every step
def _hold_hypers(opt: HookedOptimizer, args, kwargs) -> None:
    """Step pre-hook: a float written into a group's ``lr``/``weight_decay``/``momentum``
    (OneCycleLR and CyclicLR assign ``group["momentum"] = m`` every step) goes back into that
    group's own 0-d tensor, so a user-compiled ``opt.step`` sees one tensor input whose value
    changed, not a new constant that fails Dynamo's guard and recompiles.

    First it checks every group's values (:func:`_check_group_hypers`): a NaN/Inf/negative
    value set after construction raises here, naming the group, before anything changes."""
    for index, group in enumerate(opt.param_groups):
        _check_group_hypers(opt, index, group)
    for index, group in enumerate(opt.param_groups):
        for key in HYPER_TENSORS:
            value = group.get(key)
            if value is None or isinstance(value, Tensor):
                continue
            held = opt._held_hypers.get((index, key))
            held = opt._held_hypers[(index, key)] = _own_hyper(float(value), held)
            group[key] = held


def _check_group_hypers(opt: HookedOptimizer, index: int, group: dict) -> None:
    """A group's hyper-parameters as the step will use them, checked at every ``step()``: a
    scheduler, ``load_state_dict`` or ``group["lr"] = ...`` may write any value after the
    constructor checked its own. Muon groups: lr, weight_decay ≥ 0, momentum in [0, 1); AdamW
    groups: lr, weight_decay, eps ≥ 0, betas in [0, 1) (their ``momentum`` is unused). Host
    reads of 0-d CPU tensors only: a value the user put on an accelerator is not read (that
    would sync the device)."""
    use_muon = group.get("use_muon", True)
    unit = ("momentum",) if use_muon else ("betas",)
    keys = ("lr", "weight_decay", "momentum") if use_muon else ("lr", "weight_decay", "eps")
    checks = [(key, key, group.get(key)) for key in keys]
    if not use_muon:
        checks += [(f"betas[{i}]", "betas", b) for i, b in enumerate(group.get("betas") or ())]
    for label, key, value in checks:
        if isinstance(value, Tensor):
            if value.device.type != "cpu" or value.numel() != 1:
                continue
            value = value.item()
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        top = 1.0 if key in unit else math.inf
        if 0.0 <= number < top:  # NaN fails it; an Inf lr or weight decay too
            continue
        params = group["params"]
        first = f", first {opt.param_name(params[0])}" if params else ""
        rule = "in [0, 1)" if key in unit else ">= 0"
        raise ValueError(
            f"Muon.step: param_groups[{index}] (the {'Muon' if use_muon else 'AdamW'} group of "
            f"{len(params)} parameters{first}) has {label}={value!r}; it must be a finite "
            f"number {rule}. Fix what wrote it (an LR scheduler, load_state_dict, "
            f"group[{key!r}] = ...). The step changed nothing."
        )


def _split_names(group: dict, where: str) -> tuple[list[Tensor], list[str] | None]:
    """A group's tensors and their names: from ``(name, tensor)`` pairs (what
    ``named_parameters()`` yields) or a ``param_names`` list; ``None`` when unnamed."""
    params = group["params"]
    if isinstance(params, Tensor):
        items = [params]
    elif isinstance(params, set):
        raise TypeError(
            f"Muon: {where}'s params is a set; pass an ordered collection (a list): the order "
            "of a set changes between runs and so would the optimizer state's"
        )
    else:
        items = list(params)
    pairs = [isinstance(item, tuple) for item in items]
    if any(pairs) and not all(pairs):
        raise ValueError(
            f"Muon: {where} mixes (name, parameter) pairs and bare parameters; name all or none"
        )
    names = None
    if items and all(pairs):
        names = [str(item[0]) for item in items]
        items = [item[1] for item in items]
        if "param_names" in group:
            raise ValueError(
                f"Muon: {where} has (name, parameter) pairs and param_names; give one of them"
            )
    elif "param_names" in group:
        names = [str(n) for n in group["param_names"]]
        if len(names) != len(items):
            raise ValueError(
                f"Muon: {where} has {len(items)} parameters but {len(names)} param_names"
            )
    for item in items:
        if not isinstance(item, Tensor):
            raise TypeError(
                f"Muon: {where} holds a {type(item).__name__}; it takes parameters, (name, "
                "parameter) pairs (model.named_parameters()) or group dicts of those"
            )
    return items, names


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} as a Tensor must have one element, got shape {tuple(value.shape)}"
            )
        value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):  # NaN fails the first test
        raise ValueError(f"Muon: {name} must be a finite number >= 0, got {value}")


def _first_three(items: list[str]) -> str:
    """``"a, b, c and 4 more"``: a list for an error message."""
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if items[3:] else "")


def _refuse_cpu_offloaded(model: nn.Module, muon: list[tuple[str, Tensor]]) -> None:
    """Raise if FSDP2 keeps any Muon matrix of ``model`` in host memory: its Newton–Schulz
    would run on the CPU, hundreds of times slower than on the GPU, with nothing to tell."""
    from dmuon_compile.distributed._compat.fsdp import cpu_offloaded  # late: FSDP2's internals

    offloaded = cpu_offloaded(model)
    names = [name for name, p in muon if id(p) in offloaded]
    if names:
        modules = sorted({offloaded[id(p)] for _, p in muon if id(p) in offloaded})
        shown, where = _first_three(names), _first_three(modules)
        raise ValueError(
            f"Muon: FSDP2 CPU offload (fully_shard(offload_policy=CPUOffloadPolicy()), "
            f"torchtitan's training.enable_cpu_offload) keeps {len(names)} Muon matrices in "
            f"host memory ({shown}), where their Newton-Schulz would run on the CPU. Turn the "
            f"offload policy off for the fully_shard modules holding them ({where}); to save "
            "the optimizer's memory, keep the momentum in host memory instead "
            "(Muon(offload='momentum'), streamed in for the step) and/or in a smaller dtype "
            "(momentum_dtype=torch.bfloat16 or torch.int8)."
        )
