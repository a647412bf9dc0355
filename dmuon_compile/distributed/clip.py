"""``dmuon.clip_grad_norm_``: a thin alias of ``torch.nn.utils.clip_grad_norm_``.

Dedicated gradients are ``OwnerTensor`` DTensors whose norms land on FSDP2's mesh (on a TP
model, on the DP × TP mesh, with FSDP2's norms lifted onto it; ``_owner/norms.py``), so torch's own
``clip_grad_norm_(model.parameters(), max_norm)`` sees them and returns the norm one process
would. This alias also accepts the model itself and returns the norm as a plain 0-d tensor
(torch returns a DTensor when the gradients are DTensors: call ``.full_tensor()`` on it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters (or a model); the norm as a plain tensor.

    Collective when the gradients are DTensors (FSDP2, dedicated weights): call it on every rank,
    after ``backward()`` and before ``optimizer.step()``. Returns the total norm before clipping,
    the same on every rank. ``norm_type`` is 2 or ``inf``.

    Example::

        loss.backward()
        dmuon.clip_grad_norm_(model, 1.0)
        # the same as torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    full_tensor = getattr(total, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else total
