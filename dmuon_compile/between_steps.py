"""What ``Muon`` does outside ``step()``: ``zero_grad``, ``load_state_dict``, ``restore_dedicated``.

- ``zero_grad`` also drops the gradients of dedicated weights still in flight (after an
  exception in forward or backward), so a batch that failed on every rank can be skipped; it
  agrees with every rank first, and raises where the pass failed on some ranks only;
- ``load_state_dict`` checks that the state fits (a dedicated parameter's state loads only where
  it was saved) before anything is loaded;
- ``restore_dedicated`` puts the dedicated weights back in the parameter lists after a wrapper
  swapped them (accelerate's FSDP2 prepare).

``Muon`` holds a :class:`BetweenSteps` (``opt._between``) and calls it from those three methods
with what it needs (the parameter groups, the namer, torch's own ``zero_grad``); it never reads
the optimizer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._owner.tensor import OwnerTensor, is_owned, owner_rank
from dmuon_compile.normuon import SECOND_MOMENT, moment_shape

if TYPE_CHECKING:
    from torch import nn

    from dmuon_compile.layouts import Layout


def _layout(t: Tensor) -> str:
    """Where a tensor lives, for errors: the owner rank, or the mesh's ranks (a DeviceMesh's
    repr leaves its ranks out, so two one-rank meshes print alike)."""
    if not hasattr(t, "placements"):
        return "a plain tensor"
    if is_owned(t):
        return f"owned by rank {owner_rank(t)} {tuple(t.placements)}"
    return f"a DTensor on ranks {t.device_mesh.mesh.tolist()} {tuple(t.placements)}"


def _fits(value: Tensor, p: Tensor) -> bool:
    """Whether state ``value`` has ``p``'s layout: the same owner, or the same mesh (its ranks
    in its shape, not the object: a loaded state holds copies) and placements, so that each rank
    holds the piece of ``p`` it steps. Global shapes are checked before."""
    if is_owned(p):
        return is_owned(value) and owner_rank(value) == owner_rank(p)
    if not isinstance(p, DTensor):
        return not isinstance(value, DTensor)
    return (
        isinstance(value, DTensor)
        and not is_owned(value)
        and value.device_mesh.device_type == p.device_mesh.device_type
        and value.device_mesh.mesh.tolist() == p.device_mesh.mesh.tolist()
        and tuple(value.placements) == tuple(p.placements)
    )


def _fsdp_backward_aborted(model) -> bool:
    """Whether FSDP2's end-of-backward callback is still due: a backward raised before it ran
    (what ``_compat.fsdp.finish_aborted_backward`` would finish, collectively)."""
    from dmuon_compile.distributed._compat import fsdp as _fsdp_compat

    feature = "Muon.zero_grad after a failed backward"
    for module in _fsdp_compat.fsdp_modules(model):
        state = _fsdp_compat._state(module)
        if not _fsdp_compat._require(state, "_is_root", feature):
            continue
        ctx = _fsdp_compat._require(state, "_state_ctx", feature)
        if _fsdp_compat._require(ctx, "post_backward_final_callback_queued", feature):
            return True
    return False


def _pass_unfinished(model, runtime) -> bool:
    """Whether a forward or backward was left unfinished (an exception in it), by local state."""
    if runtime is not None and runtime.pass_unfinished():
        return True
    return _fsdp_backward_aborted(model)


# Agreements so far in this process: every rank makes the same ones in the same order (each
# skips the same aborted passes), which names their keys in the store.
_AGREEMENTS = itertools.count()


def _process_groups(model, runtime) -> dict[str, object]:
    """The process groups the model's collectives go over, by name: the default group, the
    meshes of its DTensor parameters (FSDP2's, TP's) and the dedicated runtime's."""
    from dmuon_compile.distributed._compat.c10d import default_group

    groups = [default_group()]
    meshes = {}
    for p in model.parameters():
        if isinstance(p, DTensor) and not is_owned(p):
            meshes.setdefault(id(p.device_mesh), p.device_mesh)
    for mesh in meshes.values():
        try:
            groups += mesh.get_all_groups()
        except RuntimeError:  # a mesh without process groups (a TP weight's owner group)
            continue
    if runtime is not None:
        groups += runtime.process_groups()
    return {g.group_name: g for g in groups}


def _agree_to_skip(model, runtime) -> None:
    """Return once every rank is here with the same number of collectives issued on every
    process group the model uses (then finishing or dropping the aborted pass issues the same
    collectives everywhere); raise otherwise, having issued none.

    The agreement goes through the rendezvous store, not a process group: a peer that did not
    raise waits inside a collective of the aborted pass, and anything this rank issued on that
    group would pair with it. That peer never comes here (or comes after its own collective
    timed out, with more collectives issued): this raises by the default group's timeout.
    """
    import datetime
    import json

    import torch.distributed as dist

    from dmuon_compile import _compat
    from dmuon_compile.distributed._comm import collectives as C
    from dmuon_compile.distributed._compat.c10d import default_group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    issued = {
        name: _compat.collectives_issued(g) for name, g in _process_groups(model, runtime).items()
    }
    store = _compat.default_store()
    prefix = f"dmuon/zero_grad/{next(_AGREEMENTS)}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[me], json.dumps(issued))
    timeout = C.group_timeout(default_group()) or datetime.timedelta(minutes=30)
    restart = (
        "A forward or backward that failed on some ranks only cannot be skipped: the other "
        "ranks are inside one of its collectives, which ends at the process-group timeout (gloo "
        "then closes the connections, NCCL aborts the communicator). Muon.zero_grad issued "
        "nothing. End every rank and restart from the last checkpoint (torchrun --max-restarts); "
        "only an exception raised on every rank at the same point (or one inside opt.step(), "
        "dmuon.MuonStepError) is skipped by catching it and calling opt.zero_grad()."
    )
    try:
        store.wait(keys, timeout)
    except RuntimeError as err:  # DistStoreError: a peer did not come within the timeout
        here = [r for r, key in enumerate(keys) if _store_has(store, key)]
        missing = sorted(set(range(world)) - set(here))
        if missing:  # (all here: the last came as the wait ended, compare below)
            raise RuntimeError(
                f"dmuon_compile: Muon.zero_grad after an exception in forward or backward on "
                f"rank {me}: ranks {missing} did not come to skip that pass within {timeout} "
                f"(ranks {here} did). {restart}"
            ) from err
    views = [json.loads(store.get(key)) for key in keys]
    for name in issued:
        counts = {r: v[name] for r, v in enumerate(views) if v.get(name) is not None}
        if len(set(counts.values())) > 1:
            raise RuntimeError(
                f"dmuon_compile: Muon.zero_grad after an exception in forward or backward on "
                f"rank {me}: the ranks left that pass at different points (collectives issued "
                f"on process group {name!r}, by rank: {counts}), so their collectives no "
                f"longer pair. {restart}"
            )


def _store_has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:  # the store itself is gone (its host rank ended)
        return False


class _Slots(NamedTuple):
    """One group's parameter list as it was built (what ``restore_dedicated`` puts back)."""

    count: int  # its length
    dedicated: dict[int, Tensor]  # its dedicated weights (owner tensors), by position
    layouts: list  # each parameter's Layout (``None`` in an AdamW group), by position


class BetweenSteps:
    """``Muon``'s work outside the step (see the module docstring).

    Args:
        model: the module of a ``Muon(model)``, else ``None``.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self._slots: list[_Slots] = []  # per param group, in order

    def add_group(self, params: list, layouts: list) -> None:
        """Remember a new group's parameter list (its size, where its dedicated weights sit,
        each slot's layout) for :meth:`restore_dedicated`."""
        dedicated = {i: p for i, p in enumerate(params) if isinstance(p, OwnerTensor)}
        self._slots.append(_Slots(len(params), dedicated, list(layouts)))

    def zero_grad(self, zero: Callable[[], None]) -> None:
        """``zero()`` (torch's ``zero_grad``), after finishing or dropping a pass that raised
        and the dedicated gradients still in flight: see ``Muon.zero_grad``."""
        from dmuon_compile.dedicated_registry import runtime_of
        from dmuon_compile.distributed._comm.pending import gradient_writes
        from dmuon_compile.distributed._compat import fsdp as _fsdp_compat
        from dmuon_compile.distributed._compat.autograd import in_backward

        runtime = runtime_of(self.model)
        if self.model is not None and not in_backward():
            if _pass_unfinished(self.model, runtime):
                # What finishes or drops the aborted pass is collective: every rank must have
                # left it at the same point, or this rank's collectives would pair with the ones
                # a peer still waits in (a crash, or a hang).
                _agree_to_skip(self.model, runtime)
            _fsdp_compat.finish_aborted_backward(self.model)
        if runtime is not None:
            runtime.discard_backward()
        with gradient_writes():  # set_to_none=False zeroes gradients, no weight: no publish
            zero()

    def restore_dedicated(
        self, param_groups: list[dict], param_name: Callable[[Tensor], str]
    ) -> dict[int, Layout]:
        """Put each group's dedicated weights back in its parameter list (see
        ``Muon.restore_dedicated``); returns the layouts by the new parameters' ids."""
        for index, group in enumerate(param_groups):
            params = group["params"]
            built, where, _ = self._slots[index]
            if len(params) != built:
                raise ValueError(
                    f"Muon: param_groups[{index}] now holds {len(params)} parameters, "
                    f"{built} when it was built. Replacing parameters is supported one for "
                    "one (a wrapper swapping them for their FSDP2 shards); build a new optimizer "
                    "for another set of parameters."
                )
            for i, p in where.items():
                params[i] = p
            stray = [
                i for i, p in enumerate(params) if isinstance(p, OwnerTensor) and i not in where
            ]
            if stray:
                raise ValueError(
                    f"Muon: param_groups[{index}] holds the dedicated weight "
                    f"{param_name(params[stray[0]])} at position {stray[0]}, where the "
                    "optimizer was built with another parameter. Build the optimizer on the "
                    "model after dmuon.dedicate_params and let it keep its dedicated weights."
                )
        # The layouts by slot (the swap is one for one): rebuilt, not extended, since the old
        # parameters' ids may now belong to other tensors.
        return {
            id(p): layout
            for group, slots in zip(param_groups, self._slots)
            for p, layout in zip(group["params"], slots.layouts)
            if layout is not None
        }

    def check_loadable(
        self, state_dict: dict, param_groups: list[dict], param_name: Callable[[Tensor], str]
    ) -> None:
        """Raise, naming the parameter, if ``state_dict`` does not fit ``param_groups`` (see
        ``Muon.load_state_dict``)."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(param_groups):
            raise ValueError(
                f"Muon.load_state_dict: the state has {len(saved_groups)} param groups, this "
                f"optimizer {len(param_groups)} (Muon + AdamW groups of another model or "
                "routing). Build the optimizer the way the saved run did, or load through "
                "torch.distributed.checkpoint's "
                "set_state_dict, which maps state by parameter name."
            )
        index_to_param, index_to_layout = {}, {}
        for saved, group, slots in zip(saved_groups, param_groups, self._slots):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"Muon.load_state_dict: a saved group has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])} (first here: "
                    f"{param_name(group['params'][0])}). Load through "
                    "torch.distributed.checkpoint's set_state_dict to map state by name."
                )
            index_to_param.update(zip(saved["params"], group["params"]))
            index_to_layout.update(zip(saved["params"], slots.layouts))
        fix = (
            "A plain opt.state_dict() holds each rank's own piece: it loads only where it was "
            "saved (a dedicated parameter on the same owner, an FSDP2 shard on the same mesh and "
            "placements). To resume on another cluster shape, save and load with "
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
                want, of, like = tuple(p.shape), "the parameter", p
                if key == SECOND_MOMENT and index_to_layout.get(index) is not None:
                    from dmuon_compile.normuon_state import fresh

                    layout = index_to_layout[index]
                    want, of = moment_shape(layout, p.shape), "NorMuon wants"
                    like = fresh(p, layout)  # its own placements (a TP row-parallel v: Replicate)
                if tuple(value.shape) != want:
                    raise ValueError(
                        f"Muon.load_state_dict: {key} of {param_name(p)} has shape "
                        f"{tuple(value.shape)}, {of} {want}. {fix}"
                    )
                if not _fits(value, like):
                    here = "the parameter is" if like is p else "NorMuon wants it as"
                    raise ValueError(
                        f"Muon.load_state_dict: {key} of {param_name(p)} was saved as "
                        f"{_layout(value)}; {here} {_layout(like)}. {fix}"
                    )
