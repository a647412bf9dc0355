"""Expert stacks sharded inside each expert (FSDP2's ``Shard(1)``): Newton–Schulz on whole
experts, each expert once per shard group.

torchtitan shards expert stacks ``Shard(1)`` over the expert-data-parallel mesh when that
mesh times the EP degree exceeds the number of experts (so no rank holds padding). A local
shard then holds a slice of every local expert's rows, and Newton–Schulz of a slice is not a
slice of Newton–Schulz. So, per step and per stack: the Nesterov input is redistributed to
``Shard(0)`` on those mesh dims (one all-to-all: each rank receives whole experts, a share of
them; with fewer experts than ranks some receive none), orthogonalised there, and the result
redistributed back to the stack's own placements, where the elementwise commit applies it.
Every rank issues the same redistributions in the same order (the parameter lists are the
same everywhere); a rank whose step already failed sends its placeholders, as the TP stage
does, so the collectives stay paired.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon_compile.layouts import Layout, whole_expert_shards


def needs_reshard(param: Tensor, layout: Layout) -> bool:
    """An expert stack (a DTensor) some of whose mesh dims shard inside the experts."""
    return (
        layout.kind == "experts"
        and isinstance(param, DTensor)
        and not whole_expert_shards(param, layout)
        and all(isinstance(pl, (Shard, Replicate)) or _strided(pl) for pl in param.placements)
    )


def _strided(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"


def whole_expert_placements(placements) -> tuple:
    """The placements with every in-expert ``Shard(d)`` (d ≥ 1) made ``Shard(0)``."""
    return tuple(
        Shard(0) if isinstance(pl, Shard) and not _strided(pl) and pl.dim != 0 else pl
        for pl in placements
    )


def _as_dtensor(local: Tensor, like: DTensor, placements=None) -> DTensor:
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements if placements is None else placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


@torch.no_grad()
def orthogonalize_resharded(
    params: list[DTensor], updates: list[Tensor], layouts: list[Layout], orthogonalize
) -> list[Tensor]:
    """``orthogonalize(mats, layouts)`` of each stack's whole experts, returned as this rank's
    local shards in the stacks' own placements. ``updates``: the local Nesterov inputs (or
    placeholders of their shapes)."""
    out = []
    for p, u, lay in zip(params, updates, layouts):
        whole = whole_expert_placements(p.placements)
        experts = _as_dtensor(u.to(p.dtype), p).redistribute(p.device_mesh, whole)
        local = experts.to_local()
        if local.numel():  # fewer experts than ranks: some hold none
            local = orthogonalize([local], [lay])[0].to(p.dtype)
        back = _as_dtensor(local, p, whole).redistribute(p.device_mesh, p.placements)
        out.append(back.to_local())
    return out
