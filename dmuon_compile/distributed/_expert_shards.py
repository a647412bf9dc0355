"""Expert stacks sharded inside each expert (FSDP2's ``Shard(1)``): Newton–Schulz on whole
experts, each expert once per shard group.

torchtitan shards expert stacks ``Shard(1)`` over the expert-data-parallel mesh when that
mesh times the EP degree exceeds the number of experts (so no rank holds padding). A local
shard then holds a slice of every local expert's rows, and Newton–Schulz of a slice is not a
slice of Newton–Schulz. So, per step and per stack, for each mesh dim that shards inside the
experts: one all-to-all over that dim's process group gives each member whole experts — a
contiguous run of the local experts (with fewer local experts than members some get none) —
and after NS the inverse all-to-all brings the result back to
the local shards, where the elementwise commit applies it. Only the ranks that hold slices of
the same experts exchange data: never the EP group (its ranks hold different experts).

Who orthogonalises which experts (:class:`ExpertWalk`): each member gets ``local // n`` of a
stack's ``local`` experts and ``local % n`` members one more: the least loaded so far (the
experts of the step's earlier stacks, and on the last cut the dedicated weights each rank
owns), ties going round from where the previous stack's extra experts ended. With fewer local
experts than members (DeepSeek-V3 on 2048 GPUs, EP 8: 32 local experts over 256 members) a
fixed split gives every stack's experts to the same first members and leaves the others idle;
the walk spreads them over all members, away from the dedicated owners (the dry run's
numbers: benchmarks/RESULTS.md §20).

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

from collections.abc import Callable
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


def ns_cost(shape) -> int:
    """What the walk weighs one matrix's Newton–Schulz by: ``min(m, n)² · max(m, n)``, the
    order of its FLOPs for Gram and direct NS alike (the same on every rank, and in the dry run,
    whatever NS configuration each has).

    >>> ns_cost((2048, 7168))
    30064771072
    """
    small, large = sorted(int(d) for d in shape)
    return small * small * large


class ExpertWalk:
    """Which members of each in-expert process group orthogonalise which experts, over one step.

    Per group: every member's load so far (``ns_cost`` of the experts it was given) and where
    the last extra experts ended. ``base``: global rank → the load it has anyway (the dedicated
    weights it owns), added on a stack's last cut, where Newton–Schulz runs. The members of a
    group walk the same stacks with the same local experts in the same order, so they keep the
    same state and agree on every split without a collective. One walk per step, given to every
    ``orthogonalize_resharded`` call of it in order; the dry run walks the same way.
    """

    def __init__(self, base: dict[int, int] | Callable[[], dict[int, int]] | None = None) -> None:
        self._base = base  # a callable is called at the first split (a step without one: never)
        self._groups: dict = {}  # key -> [next start, loads per member]

    @property
    def base(self) -> dict[int, int]:
        if callable(self._base):
            self._base = self._base()
        return self._base or {}

    def shares(self, key, ranks, local: int, cost: int, last: bool = True) -> tuple[int, ...]:
        """How many of ``local`` whole experts (``cost`` each) each member gets, by group rank
        (member ``j``'s follow member ``j - 1``'s): ``local // n`` each and one more for the
        ``local % n`` least loaded. ``key``: the group (any hashable); ``ranks``: its members'
        global ranks.

        >>> walk = ExpertWalk(base={0: 5})
        >>> walk.shares("g", [0, 1, 2], local=2, cost=1)  # rank 0 owns a dedicated weight
        (0, 1, 1)
        >>> walk.shares("g", [0, 1, 2], local=2, cost=1)  # ties: round from member 0
        (1, 1, 0)
        """
        n = len(ranks)
        state = self._groups.setdefault(key, [0, [0] * n])
        start, loads = state
        q, r = divmod(local, n)
        base = [self.base.get(g, 0) if last else 0 for g in ranks]
        order = sorted(range(n), key=lambda j: (loads[j] + base[j], (j - start) % n))
        extra = set(order[:r])
        out = tuple(q + (j in extra) for j in range(n))
        for j in range(n):
            loads[j] += out[j] * cost
        state[0] = (start + r) % n
        return out


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
    ranks: tuple[int, ...]  # the members' global ranks


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
        ranks = [dist.get_global_rank(group, j) for j in range(n)]
        if mesh.mesh[tuple(along)].tolist() != ranks:
            return None
        size = param.shape[pl.dim]  # what mesh dim i cuts: dim d after the earlier dims' cuts
        for k in range(i):
            before = placements[k]
            if isinstance(before, Shard) and not _strided(before) and before.dim == pl.dim:
                size = chunk_size(size, mesh.size(k), coord[k])
        pieces = tuple(chunk_size(size, n, j) for j in range(n))
        cuts.append(_Cut(group, pl.dim, pieces, coord[i], tuple(ranks)))
    return cuts[::-1]


def _all_to_all(out: Tensor, inp: Tensor, out_splits, in_splits, group) -> None:
    """One all-to-all of flat buffers (element counts per member, by group rank). A module
    function so that tests can record what goes out."""
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group)


def _piece_shape(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _to_whole(x: Tensor, cut: _Cut, shares: tuple[int, ...]) -> Tensor:
    """Members' pieces of dim ``cut.dim`` of their common local experts → whole ``cut.dim``
    for a contiguous run of those experts, ``shares[j]`` of them to member ``j``."""
    n, c, d = len(cut.pieces), cut.member, cut.dim
    assert x.shape[d] == cut.pieces[c], (tuple(x.shape), cut.pieces, c)
    local = x.shape[0]
    assert sum(shares) == local and len(shares) == n, (shares, local, n)
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
    return torch.cat([part.view(s) for part, s in zip(parts, received)], dim=d)


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
    params: list[DTensor],
    updates: list[Tensor],
    layouts: list[Layout],
    orthogonalize,
    walk: ExpertWalk | None = None,
) -> list[Tensor]:
    """``orthogonalize(mats, layouts)`` of each stack's whole experts, returned as this rank's
    local shards in the stacks' own placements. ``updates``: the local Nesterov inputs (or
    placeholders of their shapes). ``walk``: who gets which experts (:class:`ExpertWalk`, one
    per step, given to every call of it in the same order on every rank); a new one if
    ``None``."""
    walk = ExpertWalk() if walk is None else walk
    out = []
    for p, u, lay in zip(params, updates, layouts):
        cuts = _direct_cuts(p)
        if cuts is None:  # a layout the direct path does not cut (see _direct_cuts)
            out.append(_reference_one(p, u, lay, orthogonalize))
            continue
        x, undo = u.to(p.dtype), []
        cost = ns_cost(lay.matrix_shape(p.shape)) * lay.count((1, *p.shape[1:]))  # per expert
        for k, cut in enumerate(cuts):
            shares = walk.shares(cut.group, cut.ranks, x.shape[0], cost, last=k == len(cuts) - 1)
            x = _to_whole(x, cut, shares)
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
