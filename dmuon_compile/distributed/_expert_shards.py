"""Expert stacks sharded inside each expert (FSDP2's ``Shard(1)``): Newton–Schulz on whole
experts, each expert once per shard group.

torchtitan shards expert stacks ``Shard(1)`` over the expert-data-parallel mesh when that
mesh times the EP degree exceeds the number of experts (so no rank holds padding). A local
shard then holds a slice of every local expert's rows, and Newton–Schulz of a slice is not a
slice of Newton–Schulz. So, per step and per stack, for each mesh dim that shards inside the
experts: one all-to-all over that dim's process group gives each member whole experts — a
contiguous share of the local experts, cut as ``torch.chunk`` cuts (with fewer local experts
than members some get none) — and after NS the inverse all-to-all brings the result back to
the local shards, where the elementwise commit applies it. Only the ranks that hold slices of
the same experts exchange data: never the EP group (its ranks hold different experts).

``DTensor.redistribute`` to :func:`whole_expert_placements` and back computes the same per
expert, but its plan for an EP layout all-gathers over ``ep`` first (to cut the experts over
all ranks), moving ``ep`` times the stack; it stays as the reference
(:func:`_orthogonalize_resharded_reference`) and as the path for layouts the direct one does
not cut (:func:`_direct_cuts`).

Every rank issues the same collectives in the same order (the parameter lists and their
placements are the same everywhere; the split sizes follow from the global shape and the mesh,
never from the data); a rank whose step already failed sends its placeholders, as the TP stage
does, so the collectives stay paired.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
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


def chunk_size(n: int, k: int, i: int) -> int:
    """Size of piece ``i`` of ``n`` cut in ``k`` as ``torch.chunk`` and DTensor's ``Shard``
    cut: ``ceil(n / k)`` each, the last ones fewer or none."""
    size = -(-n // k)
    return max(0, min(size, n - i * size))


@dataclass(frozen=True)
class _Cut:
    """One mesh dim that shards tensor dim ``dim`` (≥ 1) inside the experts: its process group,
    each member's piece of ``dim`` (by group rank = mesh coordinate) and this rank's index."""

    group: dist.ProcessGroup
    dim: int
    pieces: tuple[int, ...]
    member: int


def _direct_cuts(param: DTensor) -> list[_Cut] | None:
    """The in-expert mesh dims of ``param`` in the order the direct path undoes them (the
    last mesh dim first: where two mesh dims cut the same tensor dim, the later one cuts the
    earlier one's piece, so only after it is undone is a member's piece contiguous), or
    ``None`` for a layout the direct path does not cut, which takes the reference path:

    - a ``_StridedShard`` inside the experts (dim ≥ 1): its rows interleave with another mesh
      dim's, so a member's rows are not one contiguous piece;
    - a mesh whose group ranks along a dim are not its coordinates (a ``DeviceMesh`` built
      from a permuted rank tensor): the all-to-all's splits go by group rank.

    Members of one in-expert group share every other coordinate, so they hold the same
    experts and the same piece sizes of every other dim: whole experts need no other rank."""
    mesh, placements = param.device_mesh, param.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    cuts = []
    for i, pl in enumerate(placements):
        if _strided(pl):
            if pl.dim != 0:
                return None
            continue
        if not isinstance(pl, Shard) or pl.dim == 0:
            continue
        group = mesh.get_group(i)
        n = mesh.size(i)
        along = [slice(None) if k == i else c for k, c in enumerate(coord)]
        if mesh.mesh[tuple(along)].tolist() != [dist.get_global_rank(group, j) for j in range(n)]:
            return None
        size = param.shape[pl.dim]  # what mesh dim i cuts: dim d after the earlier dims' cuts
        for k in range(i):
            before = placements[k]
            if isinstance(before, Shard) and not _strided(before) and before.dim == pl.dim:
                size = chunk_size(size, mesh.size(k), coord[k])
        pieces = tuple(chunk_size(size, n, j) for j in range(n))
        cuts.append(_Cut(group, pl.dim, pieces, coord[i]))
    return cuts[::-1]


def _all_to_all(out: Tensor, inp: Tensor, out_splits, in_splits, group) -> None:
    """One all-to-all of flat buffers (element counts per member, by group rank). A module
    function so that tests can record what goes out."""
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group)


def _piece_shape(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _to_whole(x: Tensor, cut: _Cut) -> tuple[Tensor, tuple[int, ...]]:
    """Members' pieces of dim ``cut.dim`` of their common local experts → whole ``cut.dim``
    for a contiguous share of those experts. Returns the result and every member's share."""
    n, c, d = len(cut.pieces), cut.member, cut.dim
    assert x.shape[d] == cut.pieces[c], (tuple(x.shape), cut.pieces, c)
    local = x.shape[0]
    shares = tuple(chunk_size(local, n, j) for j in range(n))
    mine = shares[c]
    per_expert = x[0].numel() if local else 0  # this rank's piece of one expert
    received = [
        (mine, *_piece_shape(x.shape[1:], d - 1, cut.pieces[j])) for j in range(n)
    ]  # member j's piece of each of my experts
    out = x.new_empty(sum(torch.Size(s).numel() for s in received))
    send = x.contiguous().reshape(-1)  # the shares are consecutive runs of dim 0
    _all_to_all(
        out,
        send,
        [torch.Size(s).numel() for s in received],
        [share * per_expert for share in shares],
        cut.group,
    )
    parts = out.split([torch.Size(s).numel() for s in received])
    whole = torch.cat([part.view(s) for part, s in zip(parts, received)], dim=d)
    return whole, shares


def _to_pieces(y: Tensor, cut: _Cut, shares: tuple[int, ...]) -> Tensor:
    """The inverse of :func:`_to_whole`: each member's piece of dim ``cut.dim`` of my share of
    experts goes back to it; I get my piece of every local expert, in expert order."""
    c, d = cut.member, cut.dim
    offsets = [sum(cut.pieces[:j]) for j in range(len(cut.pieces))]
    sends = [y.narrow(d, o, size).reshape(-1) for o, size in zip(offsets, cut.pieces)]
    mine = _piece_shape(y.shape, d, cut.pieces[c])
    per_expert = torch.Size(mine[1:]).numel()
    out = y.new_empty(sum(shares) * per_expert)
    _all_to_all(
        out,
        torch.cat(sends),
        [share * per_expert for share in shares],
        [s.numel() for s in sends],
        cut.group,
    )
    return out.view(sum(shares), *mine[1:])


@torch.no_grad()
def orthogonalize_resharded(
    params: list[DTensor], updates: list[Tensor], layouts: list[Layout], orthogonalize
) -> list[Tensor]:
    """``orthogonalize(mats, layouts)`` of each stack's whole experts, returned as this rank's
    local shards in the stacks' own placements. ``updates``: the local Nesterov inputs (or
    placeholders of their shapes)."""
    out = []
    for p, u, lay in zip(params, updates, layouts):
        cuts = _direct_cuts(p)
        if cuts is None:  # a layout the direct path does not cut (see _direct_cuts)
            out.append(_reference_one(p, u, lay, orthogonalize))
            continue
        x, undo = u.to(p.dtype), []
        for cut in cuts:
            x, shares = _to_whole(x, cut)
            undo.append((cut, shares))
        if x.numel():  # fewer local experts than members: some hold none
            x = orthogonalize([x], [lay])[0].to(p.dtype)
        for cut, shares in reversed(undo):
            x = _to_pieces(x, cut, shares)
        out.append(x)
    return out


def _as_dtensor(local: Tensor, like: DTensor, placements=None) -> DTensor:
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements if placements is None else placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _reference_one(p: DTensor, u: Tensor, lay: Layout, orthogonalize) -> Tensor:
    """One stack through ``DTensor.redistribute`` to :func:`whole_expert_placements` and back:
    the same per-expert result, over the collectives DTensor plans."""
    whole = whole_expert_placements(p.placements)
    experts = _as_dtensor(u.to(p.dtype), p).redistribute(p.device_mesh, whole)
    local = experts.to_local()
    if local.numel():  # fewer experts than ranks: some hold none
        local = orthogonalize([local], [lay])[0].to(p.dtype)
    back = _as_dtensor(local, p, whole).redistribute(p.device_mesh, p.placements)
    return back.to_local()


@torch.no_grad()
def _orthogonalize_resharded_reference(
    params: list[DTensor], updates: list[Tensor], layouts: list[Layout], orthogonalize
) -> list[Tensor]:
    """:func:`orthogonalize_resharded` through ``DTensor.redistribute`` for every stack (the
    path before the direct all-to-alls; the tests' reference)."""
    return [_reference_one(p, u, lay, orthogonalize) for p, u, lay in zip(params, updates, layouts)]
