"""The class a module holding dedicated weights gets: FSDP2 leaves those weights alone.

``dedicate_params`` swaps the class of each module that holds a dedicated weight for a subclass
of its own (``DedicatedLinear`` for an ``nn.Linear``; FSDP2 swaps the classes of the modules it
shards the same way). The subclass changes two things:

- ``named_parameters(recurse=False)`` called *by FSDP2* (any module under
  ``torch.distributed.fsdp``) leaves the dedicated names out. ``fully_shard`` collects exactly
  that call's parameters, so the user's plain ``fully_shard(block)`` never shards a dedicated
  weight; every other caller — ``model.parameters()``, ``state_dict()``, DCP, optimizers, the
  user — sees it. No FSDP2 code is changed; tests/distributed/test_registered_params.py fails
  if a new torch collects parameters another way, and ``DedicatedRuntime.check_registered``
  (run when ``Muon(model)`` is built) raises if anything replaced one.
- ``_apply`` (``model.to``/``.cuda()``/``.double()``): the other parameters and buffers convert
  as usual; a conversion that would change a dedicated weight's dtype or device raises an error
  saying how to change them instead (the owner's master, its optimizer state and the group's
  buffers would all have to move together). ``model.to_empty(device=...)`` of a model built on
  the meta device passes: ``dedicate_params`` already allocated the masters on that device.

The check runs before anything converts: ``nn.Module._apply`` converts the children one after
the other, so a check inside the holder alone would raise after its siblings (and their
parameters) were converted, leaving a model whose next backward fails. Every module above a
holder (up to the model ``dedicate_params`` was given) therefore gets ``DedicatedAncestor``,
whose ``_apply`` first tries the conversion on every dedicated weight below it — on an empty
probe tensor — and only then converts. The ancestors keep their class name (HF's
``save_pretrained`` records it).
"""

from __future__ import annotations

import torch
from torch import nn

from dmuon_compile.distributed._compat.fsdp import called_by_fsdp, check_parameter_collection

_HOLDER_CLASSES: dict[type, type] = {}


class DedicatedAncestor(nn.Module):
    """Mixin of the modules above a dedicated weight: ``_apply`` checks before it converts."""

    def _apply(self, fn, recurse: bool = True):
        check_conversion(self, fn)
        return super()._apply(fn, recurse)


class DedicatedHolder(DedicatedAncestor):
    """Mixin placed before the module's own class (see the module docstring)."""

    _dmuon_dedicated: dict  # attr -> DedicatedParam

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        items = super().named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )
        if recurse or not called_by_fsdp(1):
            return items
        hidden = {f"{prefix}.{a}" if prefix else a for a in self._dmuon_dedicated}
        return ((name, p) for name, p in items if name not in hidden)

    def _apply(self, fn, recurse: bool = True):
        # DedicatedAncestor._apply checks first; the dedicated weights themselves never convert.
        dedicated = self._dmuon_dedicated
        held = {a: self._parameters.pop(a) for a in dedicated if a in self._parameters}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters.update(held)


def check_conversion(module: nn.Module, fn) -> None:
    """Raise if ``fn`` (what ``_apply`` would apply) changes the dtype or device of a dedicated
    weight in ``module``'s subtree; tried on an empty probe, so nothing changes either way."""
    for holder in module.modules():
        for dp in getattr(holder, "_dmuon_dedicated", {}).values():
            probe = torch.empty(0, dtype=dp.orig_dtype, device=dp.master_device)
            with torch.no_grad():
                moved = fn(probe)
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise RuntimeError(
                    f"{type(module).__name__}._apply: this conversion would move the dedicated "
                    f"weight {dp.fqn} from {probe.dtype} on {probe.device} to {moved.dtype} on "
                    f"{moved.device}; nothing was converted. Dedicated weights keep the dtype and "
                    "device they had at dmuon.dedicate_params: convert the model before "
                    "dedicate_params (model.to(dtype) / model.to(device)), or "
                    "choose the forward/backward dtype with dedicate_params(..., param_policy="
                    "dmuon.ParamPolicy(defaults=dmuon.MixedPrecision(param_dtype=...))) and keep "
                    "the masters as they are."
                )


_ANCESTOR_CLASSES: dict[type, type] = {}


def mark_ancestors(model: nn.Module) -> None:
    """Give every module above a holder (``model`` included) the ``DedicatedAncestor`` class,
    keeping its class name, so ``model.to(...)`` checks before converting anything."""
    holders = [n for n, m in model.named_modules() if isinstance(m, DedicatedHolder)]
    above = {".".join(n.split(".")[:i]) for n in holders for i in range(len(n.split(".")))}
    for name in sorted(above):
        module = model.get_submodule(name)
        if isinstance(module, DedicatedAncestor):
            continue
        cls = type(module)
        ancestor = _ANCESTOR_CLASSES.get(cls)
        if ancestor is None:
            ancestor = type(
                cls.__name__,
                (DedicatedAncestor, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
            )
            _ANCESTOR_CLASSES[cls] = ancestor
        module.__class__ = ancestor


def make_holder(module: nn.Module, attr: str, dedicated_param) -> None:
    """Give ``module`` the holder class (once) and record ``attr`` as dedicated on it."""
    cls = type(module)
    check_parameter_collection()
    if not isinstance(module, DedicatedHolder):
        holder = _HOLDER_CLASSES.get(cls)
        if holder is None:
            holder = type(f"Dedicated{cls.__name__}", (DedicatedHolder, cls), {})
            _HOLDER_CLASSES[cls] = holder
        module.__class__ = holder
        module._dmuon_dedicated = {}
    module._dmuon_dedicated[attr] = dedicated_param
