"""``dmuon.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` for gradients on several meshes.

Dedicated gradients are DTensors on their owners' one-rank meshes (``_owned.py``) next to FSDP2's
gradients on the data-parallel mesh. ``torch.nn.utils.clip_grad_norm_`` stacks all per-tensor
norms into one DTensor and fails on mixed meshes ("must have the same mesh"; pytorch issue
180346 — torchtitan meets the same with expert-parallel meshes). This function takes the same
arguments and groups by mesh: FSDP2 and plain gradients go through torch's ``get_total_norm``
(placement-aware), owner gradients are summed over every rank (each matrix has exactly one
owner, so nothing is counted twice); every gradient is then scaled by one factor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon_compile.distributed._collectives import scalar_device
from dmuon_compile.distributed._owned import is_owned, local_of


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients of ``parameters`` (or of a model) to total norm ``max_norm``.

    Same arguments and result as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on
    one process; ``parameters`` may also be the model itself. Collective when any gradient is
    distributed: call it on every rank after ``backward()`` and before ``optimizer.step()``.
    Returns the total norm before clipping as a plain 0-d tensor, the same on every rank.
    ``norm_type`` is 2 or ``inf``.

    Example::

        loss.backward()
        dmuon.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    params = [params] if isinstance(params, Tensor) else list(params)
    grads = [p.grad for p in params if p.grad is not None]
    owned = [local_of(g) for g in grads if is_owned(g)]  # whole on this rank, or empty
    by_mesh: dict = {}
    for g in grads:
        if not is_owned(g):
            by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    flag_device = scalar_device(local_of(grads[0]).device if grads else torch.device("cpu"))

    parts = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        full_tensor = getattr(norm, "full_tensor", None)
        parts.append((full_tensor() if callable(full_tensor) else norm).float().to(flag_device))
    if owned:
        mine = [g for g in owned if g.numel()]
        local = (torch.nn.utils.get_total_norm(mine, norm_type).float().to(flag_device)
                 if mine else torch.zeros((), device=flag_device))
        value = (local.square() if norm_type == 2.0 else local).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX)
        parts.append(value.sqrt().reshape(()) if norm_type == 2.0 else value.reshape(()))
    if not parts:
        return torch.zeros(())
    stacked = torch.stack(parts)
    total = stacked.norm(2) if norm_type == 2.0 else stacked.max()
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"clip_grad_norm_: the total gradient norm is {float(total)}; pass "
            "error_if_nonfinite=False to clip anyway (Muon's nonfinite_grads check still runs)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:  # scaling is linear: scaling each local tensor scales any placement
        local = local_of(g)
        if local.numel():
            local.mul_(coef.to(local.device))
    return total
