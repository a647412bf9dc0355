"""Expert stacks sharded inside each expert (FSDP2's ``Shard(1)``): Newton–Schulz on whole
experts, each expert once per shard group.

torchtitan shards expert stacks ``Shard(1)`` over the expert-data-parallel mesh when that
mesh times the EP degree exceeds the number of experts (so no rank holds padding). A local
shard then holds a slice of every local expert's rows, and Newton–Schulz of a slice is not a
slice of Newton–Schulz. So, per step, for each mesh dim that shards inside the experts: one
all-to-all over that dim's process group gives each member whole experts of every stack cut
there — a contiguous run of each stack's local experts (with fewer local experts than members
some get none) — then one NS call takes them all (batched by shape), and the inverse
all-to-all brings the result back to the local shards, where the elementwise commit applies
it. Only the ranks that hold slices of the same experts exchange data: never the EP group (its
ranks hold different experts). Two all-to-alls per batch of stacks, not per stack: at 2048
GPUs each all-to-all spans 256 ranks, and DeepSeek-V3 has 174 stacks.

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

Under HSDP the stacks are copies over the replicate mesh dim, and by default every replica
orthogonalises its copy (R replicas: R times the expert NS of the job). With
``split_replicas`` (``Muon(expert_ns="once")``) the members of the replicate group split each
batch's whole experts between them by the same walk (the dedicated loads weigh there, where
NS runs) and one all-gather over that group, in NS's output dtype, gives every replica all the
results: each expert is orthogonalised once per job, for the bytes of an all-gather, which
runs under the next batch's all-to-all and Newton–Schulz (one batch's all-gather in flight).

NorMuon (``Muon(normuon=True)``, ``normuon.py``) needs each whole expert and its rows' second
moments ``v``: ``v`` (fp32, the stack's rows, :func:`moment_placements`) goes to whole
experts by the same walk — by its own all-to-all where the cut is along the rows (a member's rows
of ``v`` are its rows of the stack), taken locally where it cuts the input dim (every member
holds all rows' ``v``) — and :func:`normuon.normalize` runs right after Newton–Schulz, on whole
experts (with ``split_replicas``: on every replica, after the all-gather of NS's results, so
each computes the same ``v′`` and no more bytes move). ``v′`` goes back by one more all-to-all
per cut: each member's rows, or every row to every member. Exact: the same ``(Ô, v′)`` per
expert as one process.

Every rank issues the same collectives in the same order (the parameter lists and their
placements are the same everywhere; the split sizes follow from the global shape and the mesh,
never from the data); a rank whose step already failed sends its placeholders, as the TP stage
does, so the collectives stay paired.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon_compile import functional as F
from dmuon_compile import normuon as _normuon
from dmuon_compile.distributed._owner.tensor import local_of
from dmuon_compile.distributed.stages import (
    READ,
    MuonJob,
    StageDirections,
    StepHalf,
    StepNS,
    no_halves,
)
from dmuon_compile.layouts import (  # noqa: F401 - the tests ask here
    Layout,
    needs_reshard,
    replicated_stack,
    whole_expert_shards,
)
from dmuon_compile.normuon import moment_shape
from dmuon_compile.step_phases import PHASE_EAGER, guarded
from dmuon_compile.trace_labels import NS, label


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
        >>> walk.shares("g", [0, 1, 2], local=2, cost=1)  # rank 0 is still the most loaded
        (0, 1, 1)
        >>> even = ExpertWalk()  # ties: round from where the last extra experts ended
        >>> [even.shares("h", [0, 1, 2], local=1, cost=1) for _ in range(2)]
        [(1, 0, 0), (0, 1, 0)]
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


def _direct_cuts(param: DTensor) -> tuple[_Cut, ...] | None:
    """:func:`_cuts_of` ``param``'s mesh, placements and shape, kept on the parameter (the step
    asks every step, and each answer asks the process group for every member's global rank)
    while they stay the same."""
    key = (id(param.device_mesh), tuple(param.placements), tuple(param.shape))
    kept = getattr(param, "_dmuon_expert_cuts", None)
    if kept is None or kept[0] != key:
        kept = (key, _cuts_of(param.device_mesh, key[1], key[2]))
        param._dmuon_expert_cuts = kept  # the mesh lives as long as the parameter: ids hold
    return kept[1]


@dataclass(frozen=True)
class _Replicas:
    """The mesh dim over which a stack's local shards are copies (HSDP's replicate dim): its
    process group, this rank's index there and the members' global ranks."""

    group: dist.ProcessGroup
    member: int
    ranks: tuple[int, ...]


def replicas_of(param: DTensor) -> _Replicas | None:
    """The largest mesh dim ``param`` is ``Replicate()`` over (size > 1), kept on the parameter
    like its cuts; ``None`` without one, or where the mesh's group ranks along it are not its
    coordinates (the replicas then each orthogonalise their copy)."""
    key = (id(param.device_mesh), tuple(param.placements))
    kept = getattr(param, "_dmuon_expert_replicas", None)
    if kept is None or kept[0] != key:
        kept = (key, _replicas_from(param.device_mesh, key[1]))
        param._dmuon_expert_replicas = kept
    return kept[1]


def _replicas_from(mesh, placements: tuple) -> _Replicas | None:
    coord = mesh.get_coordinate()
    dims = [i for i, pl in enumerate(placements) if isinstance(pl, Replicate) and mesh.size(i) > 1]
    if coord is None or not dims:
        return None
    i = max(dims, key=mesh.size)
    group = mesh.get_group(i)
    ranks = [dist.get_global_rank(group, j) for j in range(mesh.size(i))]
    along = [slice(None) if k == i else c for k, c in enumerate(coord)]
    if mesh.mesh[tuple(along)].tolist() != ranks:
        return None
    return _Replicas(group, coord[i], tuple(ranks))


def _cuts_of(mesh, placements: tuple, shape: tuple) -> tuple[_Cut, ...] | None:
    """The in-expert mesh dims of a stack in the order the direct path undoes them (the
    last mesh dim first: where two mesh dims cut the same tensor dim, the later one cuts the
    earlier one's piece, so only after it is undone is a member's piece contiguous), or
    ``None`` for a layout the direct path does not cut, which takes the reference path:

    - a ``_StridedShard`` inside the experts (dim ≥ 1): its rows interleave with another mesh
      dim's, so a member's rows are not one contiguous piece;
    - a mesh whose group ranks along a dim are not its coordinates (a ``DeviceMesh`` built
      from a permuted rank tensor): the all-to-all's splits go by group rank.

    Members of one in-expert group share every other coordinate, so they hold the same
    experts and the same piece sizes of every other dim: whole experts need no other rank."""
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
        size = shape[pl.dim]  # what mesh dim i cuts: dim d after the earlier dims' cuts
        for k in range(i):
            before = placements[k]
            if isinstance(before, Shard) and not _strided(before) and before.dim == pl.dim:
                size = chunk_size(size, mesh.size(k), coord[k])
        pieces = tuple(chunk_size(size, n, j) for j in range(n))
        cuts.append(_Cut(group, pl.dim, pieces, coord[i], tuple(ranks)))
    return tuple(cuts[::-1])


def _all_to_all(out: Tensor, inp: Tensor, out_splits, in_splits, group) -> None:
    """One all-to-all of flat buffers (element counts per member, by group rank). A module
    function so that tests can record what goes out."""
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group)


def _all_gather(out: Tensor, inp: Tensor, group):
    """One all-gather of equal flat buffers, issued asynchronously: its work, to wait for
    before ``out`` is read (a module function: tests record it)."""
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=True)


def _piece_shape(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _to_whole(xs: list[Tensor], cuts: list[_Cut], shares: list[tuple[int, ...]]) -> list[Tensor]:
    """Members' pieces of dim ``cut.dim`` of their common local experts → whole ``cut.dim`` for
    a contiguous run of those experts, ``shares[k][j]`` of stack ``k``'s to member ``j``: one
    all-to-all for all the stacks (one process group; to member ``j`` go its runs of every
    stack, one after the other)."""
    group, c, n = cuts[0].group, cuts[0].member, len(cuts[0].pieces)
    received: list[list[list[int]]] = []  # [stack][member j]: j's piece of each of my experts
    runs: list[list[Tensor]] = []  # [stack][member j]: my piece of j's run of experts
    for x, cut, share in zip(xs, cuts, shares):
        d = cut.dim
        assert x.shape[d] == cut.pieces[c], (tuple(x.shape), cut.pieces, c)
        assert sum(share) == x.shape[0] and len(share) == n, (share, x.shape[0], n)
        piece = [[share[c], *_piece_shape(x.shape[1:], d - 1, cut.pieces[j])] for j in range(n)]
        received.append(piece)
        runs.append(list(x.split(list(share))))
    numel = [[torch.Size(r[j]).numel() for j in range(n)] for r in received]
    if len(xs) == 1:  # the runs are consecutive in member order: no copy
        send = xs[0].contiguous().reshape(-1)
    else:
        send = torch.cat([run[j].reshape(-1) for j in range(n) for run in runs])
    out = xs[0].new_empty(sum(map(sum, numel)))
    _all_to_all(
        out,
        send,
        [sum(sizes[j] for sizes in numel) for j in range(n)],
        [sum(run[j].numel() for run in runs) for j in range(n)],
        group,
    )
    parts = iter(out.split([sizes[j] for j in range(n) for sizes in numel]))
    by_member = [[next(parts) for _ in xs] for _ in range(n)]  # [j][stack]
    return [
        torch.cat([by_member[j][k].view(received[k][j]) for j in range(n)], dim=cut.dim)
        for k, cut in enumerate(cuts)
    ]


def _to_pieces(ys: list[Tensor], cuts: list[_Cut], shares: list[tuple[int, ...]]) -> list[Tensor]:
    """The inverse of :func:`_to_whole`: each member's piece of dim ``cut.dim`` of my share of
    every stack's experts goes back to it, in one all-to-all; I get my piece of every local
    expert, in expert order."""
    group, c, n = cuts[0].group, cuts[0].member, len(cuts[0].pieces)
    sends: list[list[Tensor]] = []  # [stack][member j]
    mine: list[list[int]] = []  # [stack]: the shape of my pieces of the whole stack
    for y, cut in zip(ys, cuts):
        offsets = [sum(cut.pieces[:j]) for j in range(n)]
        sends.append(
            [y.narrow(cut.dim, o, size).reshape(-1) for o, size in zip(offsets, cut.pieces)]
        )
        mine.append(_piece_shape(y.shape, cut.dim, cut.pieces[c]))
    per_expert = [torch.Size(m[1:]).numel() for m in mine]
    sizes = [[share[j] * per for share, per in zip(shares, per_expert)] for j in range(n)]
    out = ys[0].new_empty(sum(map(sum, sizes)))
    _all_to_all(
        out,
        torch.cat([send[j] for j in range(n) for send in sends]),
        [sum(sz) for sz in sizes],
        [sum(send[j].numel() for send in sends) for j in range(n)],
        group,
    )
    parts = iter(out.split([size for sz in sizes for size in sz]))
    by_member = [[next(parts) for _ in ys] for _ in range(n)]  # [j][stack]
    return [
        torch.cat([by_member[j][k].view(shares[k][j], *mine[k][1:]) for j in range(n)])
        for k in range(len(ys))
    ]


@torch.no_grad()
def orthogonalize_resharded(
    params: list[DTensor],
    updates: list[Tensor],
    layouts: list[Layout],
    orthogonalize,
    walk: ExpertWalk | None = None,
    batch_bytes: int | None = None,
    split_replicas: bool = False,
    gather_dtype: torch.dtype | None = None,
    moments: list[Tensor] | None = None,
    normalize: Callable | None = None,
) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
    """``orthogonalize(mats, layouts)`` of each stack's whole experts, returned as this rank's
    local shards in the stacks' own placements. ``updates``: the local Nesterov inputs (or
    placeholders of their shapes). ``walk``: who gets which experts (:class:`ExpertWalk`, one
    per step, given to every call of it in the same order on every rank); a new one if
    ``None``.

    Stacks cut by one mesh dim (torchtitan's layout) go in batches, per process group and
    dtype: one all-to-all there, one ``orthogonalize`` call for all their whole experts
    (batched by shape) and one all-to-all back, instead of two all-to-alls and a call per
    stack. ``batch_bytes`` bounds what a member can get in one batch (the most it could get of
    each stack, from the shapes alone: the same batches on every rank); ``None``: one batch per
    group. Then the stacks cut by several mesh dims, one by one, then the layouts the direct
    path does not cut (the reference path).

    ``split_replicas``: a stack replicated over a mesh dim (:func:`replicas_of`) has its whole
    experts split between that dim's members, each orthogonalising its share, and gathered
    back by one all-gather per batch in ``gather_dtype`` (default: the stacks' dtype; NS's
    output dtype loses nothing), issued asynchronously and waited for after the next batch's
    all-to-all and Newton–Schulz (one batch in flight: its bytes run under that work). Stacks
    with no in-expert cut then batch too.

    ``moments`` (NorMuon): each stack's local second moment ``v`` (fp32, in
    :func:`local_moment_shape`); ``normalize(mats, vs, layouts) -> (mats, vs)``
    normalises whole experts right after ``orthogonalize``. Returns ``(directions, v′)``, ``v′``
    in the local shapes of ``moments``."""
    walk = ExpertWalk() if walk is None else walk
    batches: dict[tuple, list[list[int]]] = {}  # (group, replicas, dtype) -> stack batches
    filled: dict[tuple, int] = {}
    alone, reference = [], []
    for i, p in enumerate(params):
        cuts = _direct_cuts(p)
        reps = replicas_of(p) if split_replicas else None
        if cuts is None:  # a layout the direct path does not cut (see _direct_cuts)
            reference.append(i)
        elif len(cuts) > 1:
            alone.append([i])
        else:
            members = len(cuts[0].pieces) if cuts else 1
            key = (cuts[0].group if cuts else None, reps and reps.group, p.dtype)
            most = -(-updates[i].shape[0] // members) * math.prod(p.shape[1:]) * p.element_size()
            chunks = batches.setdefault(key, [[]])
            if chunks[-1] and batch_bytes is not None and filled[key] + most > batch_bytes:
                chunks.append([])
                filled[key] = 0
            chunks[-1].append(i)
            filled[key] = filled.get(key, 0) + most
    out: list[Tensor | None] = [None] * len(params)
    new: list[Tensor | None] = [None] * len(params)
    norm = None if moments is None else _Normalize(moments, normalize)
    # A batch split over replicas leaves its all-gather in flight under the next batch's
    # all-to-all and Newton–Schulz, then comes back (the same collectives in the same order on
    # every rank); any other batch comes back at once.
    flight = None
    for idx in [b for chunks in batches.values() for b in chunks] + alone:
        reps = replicas_of(params[idx[0]]) if split_replicas else None
        started = _start(
            idx, params, updates, layouts, orthogonalize, walk, reps, gather_dtype, norm
        )
        if flight is not None:
            _land(flight, params, norm, out, new)
        flight = started
        if not started.in_flight:
            _land(started, params, norm, out, new)
            flight = None
    if flight is not None:
        _land(flight, params, norm, out, new)
    for i in reference:
        out[i], new[i] = _reference_one(params[i], updates[i], layouts[i], orthogonalize, norm, i)
    if moments is None:
        return out  # type: ignore[return-value]
    return out, new  # type: ignore[return-value]


# ---------------------------------------------------------------------- NorMuon's moments
def _input_dim(p: Tensor, layout: Layout) -> int:
    """The tensor dim of ``p`` that holds its matrices' input (the one ``moment_shape`` cuts)."""
    return p.ndim - (2 if layout.transposed else 1)


def _cuts(placement, dim: int) -> bool:
    strided = type(placement).__name__ == "_StridedShard"  # not a Shard on torch 2.13
    return (isinstance(placement, Shard) or strided) and getattr(placement, "dim", None) == dim


def moment_placements(p: DTensor, layout: Layout) -> tuple:
    """The placements of the second moment of expert stack ``p``: ``p``'s, except that a mesh
    dim cutting the matrices' input dim (FSDP2's ``Shard(2)`` of an ``(E, m, n)`` stack)
    replicates the moment: its input dim is one column (``moment_shape``), and each member of
    that mesh dim needs every row of its experts. ``Shard(0)`` (the experts) and a cut of the
    output dim (``Shard(1)``) stay: the moment's rows are the stack's rows.

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> class P:  # what is read of a DTensor here
    ...     ndim, placements = 3, (Shard(0), Shard(2))
    >>> moment_placements(P(), Layout.experts())
    (Shard(dim=0), Replicate())
    >>> moment_placements(P(), Layout.experts(transposed=True))  # (E, in, out): rows on dim 2
    (Shard(dim=0), Shard(dim=2))
    """
    if layout.kind != "experts":
        return tuple(p.placements)
    dim = _input_dim(p, layout)
    return tuple(Replicate() if _cuts(pl, dim) else pl for pl in p.placements)


def local_moment_shape(p: Tensor, layout: Layout) -> tuple[int, ...]:
    """The shape of this rank's piece of the second moment of ``p`` (a DTensor expert stack, or
    a plain tensor): ``p``'s local shape, its input dim that of :func:`moment_shape` (never cut:
    :func:`moment_placements`)."""
    local = local_of(p)
    if not isinstance(p, DTensor) or layout.kind != "experts":
        return moment_shape(layout, local.shape)
    whole = moment_shape(layout, p.shape)
    dim = _input_dim(p, layout)
    return tuple(whole[d] if d == dim else int(s) for d, s in enumerate(local.shape))


@dataclass(frozen=True)
class _Normalize:
    """NorMuon through :func:`orthogonalize_resharded`: every stack's local second moment and
    ``normalize(mats, vs, layouts) -> (mats, vs)`` of whole experts."""

    moments: list[Tensor]
    normalize: Callable


def _out_dim(ndim: int, lay: Layout) -> int:
    """The tensor dim of a stack's rows (its matrices' output dim)."""
    return ndim - (1 if lay.transposed else 2)


def _moments_to_whole(vs, cuts, shares, lays) -> list[Tensor]:
    """:func:`_to_whole` of the second moments: where the cut is along the rows, ``v`` moves
    like the stack (one all-to-all for those stacks); elsewhere each member holds every row's
    ``v`` and takes its run of experts."""
    out = list(vs)
    rows = [
        j for j, (v, cut, lay) in enumerate(zip(vs, cuts, lays)) if cut.dim == _out_dim(v.ndim, lay)
    ]
    if rows:
        got = _to_whole([vs[j] for j in rows], [cuts[j] for j in rows], [shares[j] for j in rows])
        for j, v in zip(rows, got):
            out[j] = v
    for j, (v, cut, share) in enumerate(zip(vs, cuts, shares)):
        if j not in rows:
            out[j] = v.narrow(0, sum(share[: cut.member]), share[cut.member])
    return out


def _moments_to_pieces(vs, cuts, shares, lays) -> list[Tensor]:
    """The inverse of :func:`_moments_to_whole`, in one all-to-all: each member gets its rows of
    ``v′`` of every local expert (a cut of the input dim: every row, as the member's piece of a
    ``v′`` repeated once per member along that dim)."""
    ys, sent = [], []
    for v, cut, lay in zip(vs, cuts, lays):
        if cut.dim == _out_dim(v.ndim, lay):
            ys.append(v)
            sent.append(cut)
            continue
        n, width = len(cut.pieces), v.shape[cut.dim]
        ys.append(v.repeat(*[n if d == cut.dim else 1 for d in range(v.ndim)]))
        sent.append(_Cut(cut.group, cut.dim, (width,) * n, cut.member, cut.ranks))
    return _to_pieces(ys, sent, shares)


@dataclass
class _Flight:
    """A batch of stacks between :func:`_start` and :func:`_finish`: its Newton–Schulz has run
    and, split over replicas, the all-gather of the results is in flight (``gather`` waits
    for it), so the next batch's all-to-all and Newton–Schulz run under it."""

    idx: list[int]
    xs: list[Tensor] | None  # the whole experts' results (None: ``gather`` gives them)
    vs: list[Tensor] | None
    lays: list[Layout]
    undo: list  # (cuts, shares) per cut depth, to go back through in reverse
    gather: Callable[[], list[Tensor]] | None = None  # waits for the all-gather, returns them

    @property
    def in_flight(self) -> bool:
        """Whether its all-gather over the replicas may still be running."""
        return self.gather is not None


def _start(
    idx, params, updates, layouts, orthogonalize, walk, reps=None, gather_dtype=None, norm=None
) -> _Flight:
    """Stacks ``idx`` (at each cut depth, one process group for all) to whole experts and
    through one ``orthogonalize`` call (``reps``: split over the replicas, :func:`_over_replicas`,
    whose all-gather stays in flight). ``norm`` (NorMuon): their second moments go along."""
    xs = [updates[i].to(params[i].dtype) for i in idx]
    vs = None if norm is None else [norm.moments[i] for i in idx]
    lays = [layouts[i] for i in idx]
    all_cuts = [_direct_cuts(params[i]) for i in idx]
    costs = [  # per expert
        ns_cost(layouts[i].matrix_shape(params[i].shape))
        * layouts[i].count((1, *params[i].shape[1:]))
        for i in idx
    ]
    depth, undo = len(all_cuts[0]), []
    for k in range(depth):
        cuts = [c[k] for c in all_cuts]
        last = k == depth - 1 and reps is None  # the dedicated loads weigh where NS runs
        shares = [
            walk.shares(cut.group, cut.ranks, x.shape[0], cost, last=last)
            for cut, x, cost in zip(cuts, xs, costs)
        ]
        xs = _to_whole(xs, cuts, shares)
        if vs is not None:
            vs = _moments_to_whole(vs, cuts, shares, lays)
        undo.append((cuts, shares))
    if reps is None:
        return _Flight(list(idx), _orthogonalize_some(xs, lays, orthogonalize), vs, lays, undo)
    gathered = _over_replicas(xs, lays, costs, reps, walk, orthogonalize, gather_dtype)
    return _Flight(list(idx), None, vs, lays, undo, gather=gathered)


def _finish(flight: _Flight, params, norm=None) -> tuple[list[Tensor], list[Tensor] | None]:
    """A batch's results back in the local shards: the gathered results waited for, NorMuon's
    normalisation (``norm``) of the whole experts, and the all-to-alls back. Returns the
    directions and ``v′`` (``None`` without ``norm``)."""
    vs, lays, undo = flight.vs, flight.lays, flight.undo
    xs = flight.gather() if flight.in_flight else flight.xs
    if vs is not None:  # every replica normalises all the whole experts: the same v′ on each
        xs, vs = _normalize_some(xs, vs, lays, norm.normalize)
    if not undo:  # whole experts stay in NS's output dtype until the commit (less memory)
        return xs, vs
    xs = [x.to(params[i].dtype) for x, i in zip(xs, flight.idx)]
    for cuts, shares in reversed(undo):
        xs = _to_pieces(xs, cuts, shares)
        if vs is not None:
            vs = _moments_to_pieces(vs, cuts, shares, lays)
    return xs, vs


def _land(flight: _Flight, params, norm, out: list, new: list) -> None:
    """:func:`_finish` a batch into each stack's place in ``out`` (directions) and ``new``
    (``v′``)."""
    got, vs = _finish(flight, params, norm)
    for k, i in enumerate(flight.idx):
        out[i], new[i] = got[k], None if vs is None else vs[k]


def _orthogonalize_some(xs: list[Tensor], lays: list[Layout], orthogonalize) -> list[Tensor]:
    """``orthogonalize`` of the stacks that hold experts (with fewer experts than members some
    hold none); the empty ones pass through."""
    xs = list(xs)
    full = [j for j, x in enumerate(xs) if x.numel()]
    if full:
        done = orthogonalize([xs[j] for j in full], [lays[j] for j in full])
        for j, y in zip(full, done):
            xs[j] = y
    return xs


def _normalize_some(xs, vs, lays, normalize) -> tuple[list[Tensor], list[Tensor]]:
    """NorMuon's ``normalize`` of the stacks that hold whole experts; the empty ones pass."""
    xs, vs = list(xs), list(vs)
    full = [j for j, x in enumerate(xs) if x.numel()]
    if full:
        done, new = normalize([xs[j] for j in full], [vs[j] for j in full], [lays[j] for j in full])
        for j, y, v in zip(full, done, new):
            xs[j], vs[j] = y, v
    return xs, vs


def _over_replicas(xs, lays, costs, reps: _Replicas, walk, orthogonalize, gather_dtype):
    """The whole experts ``xs`` (the same on every member of ``reps``: copies) split between
    the replicas by the walk, each orthogonalising its share, then one all-gather of every
    member's results (padded to the largest share) in ``gather_dtype``, left in flight: returns
    the function that waits for it and gives every stack's results (:class:`_Flight`)."""
    n, me = len(reps.ranks), reps.member
    shares = [walk.shares(reps.group, reps.ranks, x.shape[0], c) for x, c in zip(xs, costs)]
    starts = [sum(share[:me]) for share in shares]
    mine = [x.narrow(0, o, share[me]) for x, o, share in zip(xs, starts, shares)]
    done = _orthogonalize_some(mine, lays, orthogonalize)
    dtype = gather_dtype or xs[0].dtype
    per_expert = [math.prod(x.shape[1:]) for x in xs]
    shapes = [x.shape[1:] for x in xs]
    sizes = [[share[j] * per for share, per in zip(shares, per_expert)] for j in range(n)]
    most = max(map(sum, sizes))
    send = xs[0].new_zeros(most, dtype=dtype)
    torch.cat([y.reshape(-1).to(dtype) for y in done], out=send[: sum(sizes[me])])
    del xs, mine, done  # the inputs are not needed while the all-gather is in flight
    got = send.new_empty(n * most)
    work = _all_gather(got, send, reps.group)

    def gathered() -> list[Tensor]:
        work.wait()
        by_member = [got[j * most : j * most + sum(sizes[j])].split(sizes[j]) for j in range(n)]
        return [
            torch.cat([by_member[j][k].view(shares[k][j], *shape) for j in range(n)])
            for k, shape in enumerate(shapes)
        ]

    return gathered


def _as_dtensor(local: Tensor, like: DTensor, placements=None) -> DTensor:
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements if placements is None else placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _reference_one(
    p: DTensor, u: Tensor, lay: Layout, orthogonalize, norm: _Normalize | None = None, i: int = 0
):
    """One stack through ``DTensor.redistribute`` to :func:`whole_expert_placements` and back:
    the same per-expert result, over the collectives DTensor plans. ``norm`` (NorMuon): its
    second moment ``norm.moments[i]`` goes the same way (in its own placements,
    :func:`moment_placements`) and ``(direction, v′)`` comes back; else the
    direction and ``None``."""
    whole = whole_expert_placements(p.placements)
    experts = _as_dtensor(u.to(p.dtype), p).redistribute(p.device_mesh, whole)
    local = experts.to_local()
    if norm is not None:
        shape = moment_shape(lay, p.shape)
        stride = torch.empty(shape, device="meta").stride()
        placed = moment_placements(p, lay)

        def moment(v, placements):
            return DTensor.from_local(
                v, p.device_mesh, placements, run_check=False, shape=shape, stride=stride
            )

        v = moment(norm.moments[i], placed).redistribute(p.device_mesh, whole).to_local()
    if local.numel():  # fewer experts than ranks: some hold none
        local = orthogonalize([local], [lay])[0]
        if norm is not None:
            (local,), (v,) = norm.normalize([local], [v], [lay])
        local = local.to(p.dtype)
    back = _as_dtensor(local, p, whole).redistribute(p.device_mesh, p.placements)
    if norm is None:
        return back.to_local(), None
    return back.to_local(), moment(v, whole).redistribute(p.device_mesh, placed).to_local()


def _finite(grads: list[Tensor], bufs: list[Tensor], moments: list[Tensor]) -> Tensor:
    """Per matrix: its local gradient, momentum and ``v′`` all finite (1-D bool), by one
    ``foreach`` norm (what ``StepAgreement.check_finite`` reads, and ``v′``)."""
    k = len(grads)
    if not k:
        return torch.zeros(0, dtype=torch.bool)
    tensors = [t.float() if t.dtype != torch.float32 else t for t in [*grads, *bufs, *moments]]
    norms = torch.stack([n.to(grads[0].device) for n in torch._foreach_norm(tensors)])
    return torch.isfinite(norms).reshape(3, k).all(0)


@torch.no_grad()
def _orthogonalize_resharded_reference(
    params: list[DTensor], updates: list[Tensor], layouts: list[Layout], orthogonalize
) -> list[Tensor]:
    """:func:`orthogonalize_resharded` through ``DTensor.redistribute`` for every stack (the
    path before the direct all-to-alls; the tests' reference)."""
    return [
        _reference_one(p, u, lay, orthogonalize)[0] for p, u, lay in zip(params, updates, layouts)
    ]


@dataclass(eq=False)
class ExpertReshardStage:
    """The expert stacks sharded inside their experts (and, with ``split_replicas``, those
    replicated over HSDP's replicate dim) as a stage of ``Muon.step`` (``stages.StepStage``),
    added to the plan by ``step_plan.expert_stage``.

    ``stacks``: ``id`` of those stacks; ``matrices``: every Muon matrix with its layout (the
    dedicated weights among them weigh on the walk: :meth:`dedicated_loads`);
    ``split_replicas``: each expert orthogonalised once per job (``Muon(expert_ns="once")``).
    """

    stacks: frozenset[int]
    matrices: tuple = field(default=(), repr=False)
    split_replicas: bool = False
    what: ClassVar[str] = (
        "expert stacks sharded inside their experts (Shard(1)/Shard(2)) or split over "
        "replicas (expert_ns='once')"
    )
    defers: ClassVar[bool] = True  # its halves commit elementwise, like any other
    queues: ClassVar[bool] = False
    normuon_ok: ClassVar[bool] = True  # NorMuon on whole experts (``normuon.refuse_unsupported``)
    whole_experts: ClassVar[bool] = True
    _loads: dict[int, int] | None = field(default=None, repr=False)

    def dedicated_loads(self) -> dict[int, int]:
        """Global rank → ``ns_cost`` of the dedicated weights it orthogonalises (owner
        DTensors: one-rank meshes), for the walk; the same on every rank."""
        if self._loads is None:
            loads: dict[int, int] = {}
            for p, lay in self.matrices:
                if isinstance(p, DTensor) and p.device_mesh.size() == 1:
                    rank = int(p.device_mesh.mesh.reshape(-1)[0])
                    cost = ns_cost(lay.matrix_shape(p.shape)) * lay.count(p.shape)
                    loads[rank] = loads.get(rank, 0) + cost
            self._loads = loads
        return self._loads

    def directions(self, jobs: list[list[MuonJob]], ns: StepNS, failure: list) -> StageDirections:
        """Per job, its stacks taken out and a half of their own: the Nesterov inputs of the
        local shards, gathered to whole experts by an all-to-all over each in-expert mesh dim,
        orthogonalised, sent back by the inverse all-to-all (one :class:`ExpertWalk` for the
        step). The all-to-alls go out on every rank whatever happened here (placeholders after a
        failure); the commit applies the local shards with each expert's whole shape."""
        walk = ExpertWalk(self.dedicated_loads)  # who orthogonalises which experts
        halves = no_halves(jobs)
        kept_jobs = []
        for part_jobs, part_halves in zip(jobs, halves):
            kept = []
            for job in part_jobs:
                inside, rest = job.split([id(p) in self.stacks for p in job.params])
                kept.append(rest)
                if inside.params:
                    part_halves.append(self._directions(inside, ns, failure, walk))
            kept_jobs.append(kept)
        return StageDirections(kept_jobs, halves)

    def _directions(self, job: MuonJob, ns: StepNS, failure: list, walk: ExpertWalk) -> StepHalf:
        group, params, grads, bufs, layouts, moments = job[1:7]
        shapes = [lay.matrix_shape(p.shape) for p, lay in zip(params, layouts)]
        lp, lg, lb = ([local_of(x) for x in xs] for xs in (params, grads, bufs))
        config = ns.normuon
        lm = normalize = None
        if config is not None:  # NorMuon: v goes with u (placeholders after a failure here)
            lm = [
                torch.zeros(local_moment_shape(p, lay), dtype=torch.float32, device=g.device)
                if m is None
                else local_of(m)
                for p, g, lay, m in zip(params, lg, layouts, moments)
            ]

            def normalize(mats, vs, lays):
                if failure:
                    return mats, vs
                compute = lambda: _normuon.normalize_all(mats, vs, lays, config)  # noqa: E731
                return guarded(failure, PHASE_EAGER, compute, (mats, vs))

        updates = lg  # placeholders (never committed) when this rank has failed
        if not failure:
            updates = guarded(
                failure,
                PHASE_EAGER,
                lambda: F.nesterov_input(lg, lb, F.hyper(group["momentum"]), group["nesterov"]),
                lg,
            )

        def orthogonalize(mats, lays):
            if failure:
                return mats
            return guarded(
                failure, PHASE_EAGER, lambda: F.orthogonalize(mats, ns.ns, layouts=lays), mats
            )

        gather_dtype = None
        if self.split_replicas and lg:  # NS's results, gathered in its output dtype
            gather_dtype = ns.ns.work_dtype_for(lg[0].device)
        with label(NS):
            ortho = orthogonalize_resharded(
                params,
                updates,
                layouts,
                orthogonalize,
                walk,
                batch_bytes=ns.ns.stack_bytes,
                split_replicas=self.split_replicas,
                gather_dtype=gather_dtype,
                moments=lm,
                normalize=normalize,
            )
        half = StepHalf(group, lp, lg, lb, ortho, layouts=layouts, matrix_shapes=shapes)
        if lm is not None:  # committed with the momentum, under the same verdict
            half.ortho, half.new_moments = ortho
            half.moments = lm
            if not failure:  # the agreement's read, with v′ (a loaded non-finite v) too
                half.finite = guarded(
                    failure, PHASE_EAGER, lambda: _finite(lg, lb, half.new_moments), None
                )
                half.path = READ
        return half

    def commit(self, half, defer: bool) -> None:  # noqa: ARG002 - the halves are Muon's
        """Nothing: the halves are committed by the optimizer like any other."""

    def abort(self, half) -> None:  # noqa: ARG002 - every all-to-all was waited for
        """Nothing: every all-to-all was waited for in :meth:`directions`."""
