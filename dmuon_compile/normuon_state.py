"""Where NorMuon's second moments live: ``state["normuon_second_moment"]`` of each Muon matrix.

The math is ``normuon.py``'s (below the runtime); this is the state ``Muon._init_group`` keeps,
shaped by :func:`~dmuon_compile.normuon.moment_shape`, fp32. A parameter that is a DTensor gets
a DTensor of the same kind, so ``torch.distributed.checkpoint`` saves and reshards it like the
momentum: a dedicated weight's owner tensor (a one-rank owner mesh: the whole second moment on
the owner, an empty piece elsewhere), an expert stack (``_stages.expert_shards.moment_placements``:
the stack's mesh and placements, but replicated where they cut the matrices' input dim, which
the moment reduces to one column: each rank holds every moment of its rows).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._owner.tensor import OwnerTensor, is_owned, local_of, make_owned
from dmuon_compile.layouts import Layout
from dmuon_compile.normuon import SECOND_MOMENT, moment_shape


def second_moment(state: dict, p: Tensor, layout: Layout) -> Tensor:
    """``state["normuon_second_moment"]`` of Muon matrix ``p``: created (zeros, fp32) on first
    use, converted to fp32 once when loaded in another dtype (torch's ``load_state_dict`` casts
    state to the parameter's dtype).

    >>> state = {}
    >>> second_moment(state, torch.zeros(4, 3), Layout()).shape
    torch.Size([4, 1])
    """
    v = state.get(SECOND_MOMENT)
    if v is None:
        v = state[SECOND_MOMENT] = _zeros(p, layout)
    elif v.dtype != torch.float32:
        v = state[SECOND_MOMENT] = v.to(torch.float32)
    return v


def fresh(p: Tensor, layout: Layout) -> Tensor:
    """A zero second moment of ``p``, laid out as the step creates it (a loaded one must sit on
    the same owner, mesh and placements: ``Muon.load_state_dict`` checks against this)."""
    return _zeros(p, layout)


def _zeros(p: Tensor, layout: Layout) -> Tensor:
    shape = moment_shape(layout, p.shape)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    local = local_of(p)
    if is_owned(p):  # a one-rank owner mesh: the whole tensor on the owner, empty elsewhere
        owner = tuple(local.shape) == tuple(p.shape)
        held = torch.zeros(shape, dtype=torch.float32, device=local.device) if owner else None
        return make_owned(held, p.device_mesh, shape, torch.float32, local.device)
    if isinstance(p, OwnerTensor):  # a TP weight on its owner TP group
        from dmuon_compile.distributed._stages.tp.moments import zeros

        return zeros(p, layout)
    # An expert stack (the step refuses other sharded matrices): the local experts' rows, on
    # the stack's mesh and placements, replicated where they cut the matrices' input dim (the
    # expert reshard's ``moment_placements``: it moves them).
    from dmuon_compile.distributed._stages.expert_shards import (
        local_moment_shape,
        moment_placements,
    )

    piece = torch.zeros(local_moment_shape(p, layout), dtype=torch.float32, device=local.device)
    stride = torch.empty(shape, device="meta").stride()
    placements = moment_placements(p, layout)
    return DTensor.from_local(
        piece, p.device_mesh, placements, run_check=False, shape=shape, stride=stride
    )
