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
results: each expert is orthogonalised once per job, for the bytes of an all-gather.

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
from dmuon_compile.distributed._owned import local_of
from dmuon_compile.distributed.stages import (
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


def _all_gather(out: Tensor, inp: Tensor, group) -> None:
    """One all-gather of equal flat buffers (a module function: tests record it)."""
    dist.all_gather_into_tensor(out, inp, group=group)


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
) -> list[Tensor]:
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
    output dtype loses nothing). Stacks with no in-expert cut then batch too."""
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
    for idx in [b for chunks in batches.values() for b in chunks] + alone:
        reps = replicas_of(params[idx[0]]) if split_replicas else None
        got = _resharded(idx, params, updates, layouts, orthogonalize, walk, reps, gather_dtype)
        for i, y in zip(idx, got):
            out[i] = y
    for i in reference:
        out[i] = _reference_one(params[i], updates[i], layouts[i], orthogonalize)
    return out  # type: ignore[return-value]


def _resharded(
    idx, params, updates, layouts, orthogonalize, walk, reps=None, gather_dtype=None
) -> list[Tensor]:
    """Stacks ``idx`` (at each cut depth, one process group for all) to whole experts, through
    one ``orthogonalize`` call (``reps``: split over the replicas, :func:`_over_replicas`), and
    back."""
    xs = [updates[i].to(params[i].dtype) for i in idx]
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
        undo.append((cuts, shares))
    lays = [layouts[i] for i in idx]
    if reps is None:
        xs = _orthogonalize_some(xs, lays, orthogonalize)
    else:
        xs = _over_replicas(xs, lays, costs, reps, walk, orthogonalize, gather_dtype)
    if not undo:  # whole experts stay in NS's output dtype until the commit (less memory)
        return xs
    xs = [x.to(params[i].dtype) for x, i in zip(xs, idx)]
    for cuts, shares in reversed(undo):
        xs = _to_pieces(xs, cuts, shares)
    return xs


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


def _over_replicas(xs, lays, costs, reps: _Replicas, walk, orthogonalize, gather_dtype):
    """The whole experts ``xs`` (the same on every member of ``reps``: copies) split between
    the replicas by the walk, each orthogonalising its share, then one all-gather of every
    member's results (padded to the largest share) in ``gather_dtype``."""
    n, me = len(reps.ranks), reps.member
    shares = [walk.shares(reps.group, reps.ranks, x.shape[0], c) for x, c in zip(xs, costs)]
    starts = [sum(share[:me]) for share in shares]
    mine = [x.narrow(0, o, share[me]) for x, o, share in zip(xs, starts, shares)]
    done = _orthogonalize_some(mine, lays, orthogonalize)
    dtype = gather_dtype or xs[0].dtype
    per_expert = [math.prod(x.shape[1:]) for x in xs]
    sizes = [[share[j] * per for share, per in zip(shares, per_expert)] for j in range(n)]
    most = max(map(sum, sizes))
    send = xs[0].new_zeros(most, dtype=dtype)
    torch.cat([y.reshape(-1).to(dtype) for y in done], out=send[: sum(sizes[me])])
    got = send.new_empty(n * most)
    _all_gather(got, send, reps.group)
    by_member = [got[j * most : j * most + sum(sizes[j])].split(sizes[j]) for j in range(n)]
    return [
        torch.cat([by_member[j][k].view(shares[k][j], *x.shape[1:]) for j in range(n)])
        for k, x in enumerate(xs)
    ]


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
        group, params, grads, bufs, layouts = job[1:6]
        shapes = [lay.matrix_shape(p.shape) for p, lay in zip(params, layouts)]
        lp, lg, lb = ([local_of(x) for x in xs] for xs in (params, grads, bufs))
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
            )
        return StepHalf(group, lp, lg, lb, ortho, layouts=layouts, matrix_shapes=shapes)

    def commit(self, half, defer: bool) -> None:  # noqa: ARG002 - the halves are Muon's
        """Nothing: the halves are committed by the optimizer like any other."""

    def abort(self, half) -> None:  # noqa: ARG002 - every all-to-all was waited for
        """Nothing: every all-to-all was waited for in :meth:`directions`."""
