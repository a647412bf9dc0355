"""What ``Muon`` does outside ``step()``: ``zero_grad``, ``load_state_dict``, ``restore_dedicated``.

- ``zero_grad`` also drops the gradients of dedicated weights still in flight (after an
  exception in forward or backward), so a failed batch can be skipped on every rank;
- ``load_state_dict`` checks that the state fits (a dedicated parameter's state loads only where
  it was saved) before anything is loaded;
- ``restore_dedicated`` puts the dedicated weights back in the parameter lists after a wrapper
  swapped them (accelerate's FSDP2 prepare).

``Muon`` inherits :class:`BetweenSteps`; it reads the optimizer's ``model``, ``param_groups``,
``_dedicated_slots`` and ``param_name``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmuon_compile.distributed._owned import OwnerTensor, is_owned, owner_rank, same_layout


def _layout(t: Tensor) -> str:
    """Where a tensor lives, for errors: the owner rank, or the mesh's ranks (a DeviceMesh's
    repr leaves its ranks out, so two one-rank meshes print alike)."""
    if not hasattr(t, "placements"):
        return "a plain tensor"
    if is_owned(t):
        return f"owned by rank {owner_rank(t)} {tuple(t.placements)}"
    return f"a DTensor on ranks {t.device_mesh.mesh.flatten().tolist()} {tuple(t.placements)}"


class BetweenSteps:
    """``Muon``'s methods outside the step (see the module docstring)."""

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
        from dmuon_compile.distributed._autograd_compat import in_backward
        from dmuon_compile.distributed._pending import gradient_writes

        if self.model is not None and not in_backward():
            _fsdp_compat.finish_aborted_backward(self.model)
        runtime = runtime_of(self.model)
        if runtime is not None:
            runtime.discard_backward()
        with gradient_writes():  # set_to_none=False zeroes gradients, no weight: no publish
            super().zero_grad(set_to_none=set_to_none)

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
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            built, where = self._dedicated_slots[index]
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
                    f"{self.param_name(params[stray[0]])} at position {stray[0]}, where the "
                    "optimizer was built with another parameter. Build the optimizer on the "
                    "model after dmuon.dedicate_params and let it keep its dedicated weights."
                )
        if self.model is not None:  # the names of the parameters the lists now hold
            self._param_names.update({id(p): n for n, p in self.model.named_parameters()})
        # The layouts by slot (the swap is one for one): rebuilt, not extended, since the old
        # parameters' ids may now belong to other tensors.
        self._layouts = {
            id(p): layout
            for group, layouts in zip(self.param_groups, self._slot_layouts)
            for p, layout in zip(group["params"], layouts)
            if layout is not None
        }

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
                    raise ValueError(
                        f"Muon.load_state_dict: {key} of {self.param_name(p)} was saved as "
                        f"{_layout(value)}; the parameter is {_layout(p)}. {fix}"
                    )
