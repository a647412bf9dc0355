"""Gradient-norm clipping over a model with dedicated parameters.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does not see the dedicated
matrices (they are not parameters of their modules any more, and their full gradients live on
their owners only), so it would clip with a norm that misses most of the model. This module's
:func:`clip_grad_norm_` adds them: FSDP2 (DTensor) gradients through torch's
``get_total_norm`` (placement-aware), owned dedicated gradients summed over all ranks (each
matrix has exactly one owner, so nothing is counted twice), then every gradient scaled by the
same factor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon_compile.dedicated_registry import dedicated_names, dedicated_parameters
from dmuon_compile.distributed._collectives import scalar_device


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients of ``model`` — dedicated matrices included — to total norm ``max_norm``.

    Collective when the model has dedicated parameters: call it on every rank, after
    ``backward()`` and before ``optimizer.step()``. Returns the total norm before clipping (a
    0-d tensor, the same on every rank). ``norm_type`` is 2 or ``inf``.

    Example::

        loss.backward()
        dmuon.clip_grad_norm_(model, 1.0)
        opt.step()
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
    regular = [p.grad for p in model.parameters() if p.grad is not None]
    owned = [m.grad for _, m in dedicated_parameters(model) if m.grad is not None]
    device = (regular or owned)[0].device if (regular or owned) else torch.device("cpu")
    flag_device = scalar_device(device)

    parts = []
    if regular:
        norm = torch.nn.utils.get_total_norm(regular, norm_type)
        full_tensor = getattr(norm, "full_tensor", None)
        parts.append((full_tensor() if callable(full_tensor) else norm).float().to(flag_device))
    if dedicated_names(model):
        local = (torch.nn.utils.get_total_norm(owned, norm_type).float().to(flag_device)
                 if owned else torch.zeros((), device=flag_device))
        if norm_type == 2.0:
            squared = local.square().reshape(1)
            if dist.is_initialized():
                dist.all_reduce(squared, op=dist.ReduceOp.SUM)
            parts.append(squared.sqrt().reshape(()))
        else:
            peak = local.reshape(1)
            if dist.is_initialized():
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            parts.append(peak.reshape(()))
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
    for g in regular + owned:
        g.mul_(coef.to(g.device) if not hasattr(g, "to_local") else float(coef))
    return total
