"""Split Newton–Schulz: one matrix orthogonalised by a group of p ranks.

For the largest matrices one owner's NS is the step's floor while its peers idle. Here the p
ranks of a group (a node, a TP group) each hold one contiguous piece of the matrix and run
the same iteration as :class:`~dmuon_compile.newton_schulz.NewtonSchulz` on it.

The math, for X = U (or Uᵀ when U is tall, as NewtonSchulz orients it) of shape (m, n), m ≤ n,
cut into column blocks X = [X_1 … X_p] (m × n_i; uneven and empty blocks allowed):

- ‖X‖_F² = Σ‖X_i‖²: one all-reduce of a small fp64 header (which also checks the pieces).
- R = X·Xᵀ = Σ X_i·X_iᵀ: an all-reduce of an m×m matrix (in the work dtype).
- The m×m chain (Gram NS: Z = bR + cR², Q ← QZ + aQ, RZ = R·Z + aR, R ← RZ·Z + aRZ; direct NS:
  B + aI = cA² + bA + aI) is cut by rows: rank r computes rows r·k:(r+1)·k (k = ⌈m/p⌉) of each
  product, and the full matrix is all-gathered only where a later product needs it.
- Restart and the final step are local: X_i ← Q·X_i, then R is all-reduced again.

Column blocks of X are rows of U when U is tall and columns of U when it is wide: the long
dimension, which is also the one TP shards (column-parallel layers shard the output dim of a
tall weight, row-parallel ones the input dim of a wide one). A tall weight's piece is a
contiguous slice of its memory.

Per rank: the X-sized work (a Gram and an apply per segment) drops by p, and so does the m×m
chain (~60% of Gram NS at n/m ≈ 3), though its row blocks are plain products where one rank
uses symmetric (one-triangle) kernels. The price is O(steps) m×m collectives: see
:func:`split_flops`. Every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed._comm import collectives as _collectives
from dmuon_compile.newton_schulz import NewtonSchulz, frobenius_norm, normalize

Bounds = list[tuple[int, int]]
_SLOT = 5  # header slot per rank: sum of squares, local problem flag, rows, cols, config hash


# ----------------------------------------------------------------------------- layout helpers
def _check_shape(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(
            f"split Newton–Schulz takes one 2-D matrix of positive size, got shape {shape} "
            "(view conv kernels with dmuon_compile.matrix_view first)"
        )
    return shape  # type: ignore[return-value]


def split_dim(shape) -> int:
    """The dimension of a (out, in) matrix that is cut into the p pieces: the long one (0 for a
    tall matrix, whose pieces are then contiguous rows; 1 otherwise, as NewtonSchulz keeps a
    square matrix unoriented).

    >>> split_dim((53248, 16384)), split_dim((16384, 53248))
    (0, 1)
    """
    out, inp = _check_shape(shape)
    return 0 if out > inp else 1


def split_bounds(shape, p: int) -> Bounds:
    """``p`` contiguous ``(start, stop)`` ranges along :func:`split_dim` (as even as possible,
    the first ``n % p`` one longer); each is a column block of the oriented X.

    >>> split_bounds((10, 4), 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    if int(p) < 1:
        raise ValueError(f"split_bounds: p must be >= 1, got {p}")
    shape = _check_shape(shape)
    n, p = shape[split_dim(shape)], int(p)
    base, extra = divmod(n, p)
    starts = [r * base + min(r, extra) for r in range(p + 1)]
    return list(zip(starts[:-1], starts[1:]))


def _check_bounds(bounds, shape, p: int) -> Bounds:
    bounds = [(int(a), int(b)) for a, b in bounds]
    n = shape[split_dim(shape)]
    if len(bounds) != p:
        raise ValueError(
            f"split Newton–Schulz: {len(bounds)} piece bounds for a group of {p} ranks "
            "(one (start, stop) per group rank)"
        )
    stops = [0] + [b for _, b in bounds]
    if any(a != s or b < a for (a, b), s in zip(bounds, stops)) or stops[-1] != n:
        raise ValueError(
            f"split Newton–Schulz: bounds {bounds} must be contiguous ranges covering 0..{n} of "
            f"dim {split_dim(shape)} of the {shape} matrix, in group-rank order"
        )
    return bounds


def _row_chunk(m: int, p: int) -> int:
    """Rows of each m×m product a rank computes: ⌈m/p⌉, so that the padded all-gather of the
    p row blocks holds the matrix in its first m rows (no copy out)."""
    return -(-m // p)


def _piece_shape(shape, start: int, stop: int) -> tuple[int, int]:
    dim = split_dim(shape)
    return (stop - start, shape[1]) if dim == 0 else (shape[0], stop - start)


# ----------------------------------------------------------------------------- the algorithm
class _SimulatedComm:
    """All p ranks in this process: the collectives sum in rank order and concatenate."""

    def __init__(self, p: int) -> None:
        self.p, self.ranks = p, list(range(p))
        self.log: list[tuple[str, int]] = []  # (collective, elements of its result), for tests

    def all_reduce(self, parts: list[Tensor]) -> Tensor:
        total = parts[0].clone()
        for t in parts[1:]:
            total += t
        self.log.append(("all_reduce", total.numel()))
        return total

    def all_gather_rows(self, parts: list[Tensor], m: int) -> Tensor:
        k = _row_chunk(m, self.p)
        self.log.append(("all_gather", self.p * k * m))
        return torch.cat(parts)


class _GroupComm:
    """This rank of a process group: one part each, real collectives. ``issued`` counts the
    collectives this rank has issued in the call (the header's all-reduce included): a rank
    whose local work fails issues the rest of them (:func:`_finish_collectives`)."""

    def __init__(self, group, rank: int, p: int) -> None:
        self.group, self.p, self.ranks = group, p, [rank]
        self.issued = 0

    def all_reduce(self, parts: list[Tensor], what: str = "Gram all-reduce") -> Tensor:
        (part,) = parts
        work = dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.issued += 1
        _collectives.wait(work, f"split Newton–Schulz: {what}", self.group)
        return part

    def all_gather_rows(self, parts: list[Tensor], m: int) -> Tensor:
        (part,) = parts
        k = _row_chunk(m, self.p)
        if part.shape[0] != k or not part.is_contiguous():  # short last blocks travel padded
            send = part.new_zeros(k, m)
            send[: part.shape[0]] = part
            part = send
        out = part.new_empty(self.p * k, m)
        work = _collectives.all_gather(out, part, self.group)
        self.issued += 1
        _collectives.wait(work, "split Newton–Schulz: row all-gather", self.group)
        return out[:m]


class _ScheduleComm:
    """Records the collectives of :func:`_blocked_ns` run on meta tensors (no memory, no
    math): ``(kind, shape of what this rank sends, dtype)`` in the order they are issued."""

    def __init__(self, rank: int, p: int) -> None:
        self.p, self.ranks = p, [rank]
        self.calls: list[tuple[str, tuple[int, int], torch.dtype]] = []

    def all_reduce(self, parts: list[Tensor]) -> Tensor:
        (part,) = parts
        self.calls.append(("all_reduce", tuple(part.shape), part.dtype))
        return part

    def all_gather_rows(self, parts: list[Tensor], m: int) -> Tensor:
        (part,) = parts
        k = _row_chunk(m, self.p)
        self.calls.append(("all_gather", (k, m), part.dtype))
        return part.new_empty(self.p * k, m)[:m]


def _add_identity_rows(rows: Tensor, start: int, gamma: float) -> Tensor:
    """``rows + gamma·I[start:start+len(rows)]`` in place, gamma added in fp32 and rounded once
    (as ``TorchPrimitives.add_identity`` does for the whole matrix)."""
    k = rows.shape[0]
    diagonal = rows[:, start : start + k].diagonal()
    wide = torch.promote_types(rows.dtype, torch.float32)
    diagonal.copy_(diagonal.to(wide) + gamma)
    return rows


def _gram(ops, x: Tensor) -> Tensor:
    if x.shape[-1] == 0:  # an empty piece adds nothing (and kernels may not take K = 0)
        return x.new_zeros(x.shape[0], x.shape[0])
    return ops.gram(x)


def _blocked_ns(xs: list[Tensor], ns: NewtonSchulz, comm, n: int) -> list[Tensor]:
    """NS of X = [X_1 … X_p] on this process's column blocks ``xs`` (normalised, m × n_i)."""
    m, p = xs[0].shape[0], comm.p
    k = _row_chunk(m, p)
    rows = [(min(r * k, m), min((r + 1) * k, m)) for r in comm.ranks]
    ops = ns.primitives_for(m, 1, xs[0].device.type, xs[0].dtype)  # local Gram, apply: free
    table = ns.coefficients

    def apply(q: Tensor) -> list[Tensor]:
        return [q @ x if x.shape[-1] else x for x in xs]

    if not ns.uses_gram(m, n):  # direct NS, as NewtonSchulz runs near-square matrices
        for a, b, c in table:
            gram = comm.all_reduce([_gram(ops, x) for x in xs])  # A = Σ X_i·X_iᵀ
            poly = [  # rows of c·A² + b·A + a·I
                _add_identity_rows(torch.addmm(gram[s:e], gram[s:e], gram, beta=b, alpha=c), s, a)
                for s, e in rows
            ]
            del gram
            xs = apply(comm.all_gather_rows(poly, m))  # X_i ← (B + a·I)·X_i
        return xs

    restarts = set(ns.restart_iterations)
    r_full = comm.all_reduce([_gram(ops, x) for x in xs])
    q_rows: list[Tensor] | None = None  # Q stays cut by rows until a segment ends
    for i, (a, b, c) in enumerate(table):
        if i in restarts and q_rows is not None:
            xs = apply(comm.all_gather_rows(q_rows, m))  # X_i ← Q·X_i
            r_full = comm.all_reduce([_gram(ops, x) for x in xs])
            q_rows = None
        last_of_segment = i + 1 == len(table) or (i + 1) in restarts
        z_rows = [torch.addmm(r_full[s:e], r_full[s:e], r_full, beta=b, alpha=c) for s, e in rows]
        # Full Z only where a product needs it: Q·Z (not on a segment's first step), R·Z.
        z = comm.all_gather_rows(z_rows, m) if q_rows is not None or not last_of_segment else None
        if q_rows is None:
            q_rows = [_add_identity_rows(zr, s, a) for zr, (s, _) in zip(z_rows, rows)]
        else:
            q_rows = [torch.addmm(qr, qr, z, beta=a) for qr in q_rows]
        if not last_of_segment:
            rz = [torch.addmm(r_full[s:e], r_full[s:e], z, beta=a) for s, e in rows]
            # Z·RZ computed as RZ·Z (polynomials of R commute): rows of RZ and a full Z suffice,
            # one all-gather a step fewer than gathering RZ.
            r_full = comm.all_gather_rows([torch.addmm(t, t, z, beta=a) for t in rz], m)
        del z_rows, z
    return apply(comm.all_gather_rows(q_rows, m))  # X_i ← Q·X_i


def _oriented(piece: Tensor, shape, work_dtype, eps: float, norm: Tensor) -> Tensor:
    """The normalised column block X_i (m × n_i) of this piece of U."""
    return normalize(piece, work_dtype, eps, transpose=split_dim(shape) == 0, norm=norm)


def _norm_dtype(work_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if work_dtype == torch.float64 else torch.float32


def _piece_sumsq(piece: Tensor, work_dtype: torch.dtype) -> Tensor:
    """‖piece‖_F² in fp64 (a 0-d tensor), from the norm NewtonSchulz takes (same dtype, same
    reduction), left on the device: no host sync before the all-reduce."""
    if piece.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=piece.device)
    return frobenius_norm(piece, work_dtype).double().square().reshape(())


def _total_norm(sumsqs: Tensor, work_dtype) -> Tensor:
    """‖X‖_F from the p pieces' squares, summed in rank order (here and in the reference)."""
    return sumsqs.sum().sqrt().to(_norm_dtype(work_dtype)).reshape(1, 1)


# ----------------------------------------------------------------------------- public API
def split_newton_schulz_reference(
    u: Tensor, ns: NewtonSchulz, p: int, *, bounds: Sequence[tuple[int, int]] | None = None
) -> Tensor:
    """The split algorithm with its p ranks simulated in this process (same blocking, Grams
    summed in rank order); returns the whole NS(U) (work dtype), to compare with ``ns(u)``."""
    shape = _check_shape(u.shape)
    bounds = _check_bounds(split_bounds(shape, p) if bounds is None else bounds, shape, int(p))
    dim = split_dim(shape)
    pieces = [u.narrow(dim, a, b - a) for a, b in bounds]
    work_dtype = ns.work_dtype_for(u.device)
    norm = _total_norm(torch.stack([_piece_sumsq(t, work_dtype) for t in pieces]), work_dtype)
    xs = [_oriented(t, shape, work_dtype, ns.eps, norm) for t in pieces]
    xs = _blocked_ns(xs, ns, _SimulatedComm(int(p)), max(shape))
    return torch.cat([x.mT if dim == 0 else x for x in xs], dim=dim)


def split_newton_schulz(
    block: Tensor,
    ns: NewtonSchulz,
    group=None,
    *,
    full_shape: Sequence[int],
    bounds: Sequence[tuple[int, int]] | None = None,
    finish_on_error: bool = False,
) -> Tensor:
    """This rank's piece of ``ns(U)``, computed by the ranks of ``group`` together.

    Args:
        block: this rank's contiguous piece of U (``full_shape``): ``U[start:stop]`` for a tall
            U, ``U[:, start:stop]`` otherwise (:func:`split_dim`), ``(start, stop) =
            bounds[group rank]``.
        ns: the configuration (coefficients, restarts, work dtype, gram/direct choice) that
            one rank's ``ns(U)`` would use; every rank passes the same one.
        group: the process group (default: the world).
        full_shape: U's shape (out, in).
        bounds: the pieces along :func:`split_dim` (default :func:`split_bounds`), e.g. a DTensor
            shard layout; empty pieces are allowed.
        finish_on_error: when this rank's local work raises (an OOM, a kernel error), first
            issue the rest of the call's collectives (zeros), then raise: the peers are never
            left waiting, but their results are then meaningless, so the caller must make
            every rank learn of the failure (``Muon.step`` does, through its agreement).
            ``False`` (default): raise at once (the peers then wait for the group's timeout).

    Returns the piece in U's layout, the work dtype (a transposed view for a tall U, as
    ``ns(U)`` returns). Collective: every rank of ``group`` calls it with the same arguments
    but ``block``; a wrong piece or disagreeing arguments raise ``ValueError`` on every rank.
    """
    if not isinstance(ns, NewtonSchulz):
        raise TypeError(f"split_newton_schulz takes a NewtonSchulz, got {type(ns).__name__}")
    shape = _check_shape(full_shape)
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("split_newton_schulz: this rank is not a member of the group")
    bounds = _check_bounds(split_bounds(shape, p) if bounds is None else bounds, shape, p)
    comm = _GroupComm(group, rank, p)
    try:
        work_dtype = ns.work_dtype_for(block.device)
        key = _config_hash(shape, bounds, ns, work_dtype)

        # One small all-reduce carries every rank's ‖piece‖², shape and config hash: the norm,
        # and a check that fails on every rank together (a one-rank raise would hang the others).
        header = torch.zeros(p, _SLOT, dtype=torch.float64, device=block.device)
        local_ok = block.dim() == 2 and block.is_floating_point()
        rows, cols = tuple(block.shape) if local_ok else (-1, -1)
        flags = [0.0 if local_ok else 1.0, rows, cols, key]
        header[rank, 1:] = torch.tensor(flags, dtype=torch.float64)  # 52-bit key: exact in fp64
        if local_ok:
            header[rank, 0] = _piece_sumsq(block, work_dtype)
        comm.all_reduce([header], "norm and piece check")
        seen = header.cpu().tolist()  # the one host sync
    except Exception:
        if finish_on_error:
            _finish_collectives(comm, shape, bounds, ns, block.device)
        raise
    _raise_on_bad_pieces(seen, shape, bounds, block, rank)  # on every rank alike: no finishing
    try:
        norm = _total_norm(header[:, 0], work_dtype)  # each slot had one non-zero term: exact
        x = _oriented(block, shape, work_dtype, ns.eps, norm)
        (x,) = _blocked_ns([x], ns, comm, max(shape))
        return x.mT if split_dim(shape) == 0 else x
    except Exception:
        if finish_on_error:
            _finish_collectives(comm, shape, bounds, ns, block.device)
        raise


def _collective_schedule(shape, bounds, ns: NewtonSchulz, rank: int, work_dtype) -> list[tuple]:
    """The collectives :func:`split_newton_schulz` issues on group rank ``rank``, in order:
    the header's all-reduce, then :func:`_blocked_ns`'s (found by running it on meta tensors:
    its exact sequence, at no memory and no math)."""
    p, (m, n), (a, b) = len(bounds), (min(shape), max(shape)), bounds[rank]
    comm = _ScheduleComm(rank, p)
    _blocked_ns([torch.empty(m, b - a, dtype=work_dtype, device="meta")], ns, comm, n)
    return [("header", (p, _SLOT), torch.float64), *comm.calls]


def _finish_collectives(comm: _GroupComm, shape, bounds, ns: NewtonSchulz, device) -> None:
    """After this rank's local work raised inside :func:`split_newton_schulz`: issue the rest
    of the call's collectives (zeros), so its peers never wait on a collective it skipped. A
    header it had not sent yet goes out well-formed (its piece's shape, the configuration's
    hash, a zero norm term), so the peers' piece check passes and they go on to the end; if
    that check finds another rank's problem, every rank stops there, this one too. The peers'
    results are then meaningless: the caller raises (``Muon.step``'s agreement makes every
    rank raise)."""
    rank = comm.ranks[0]
    work_dtype = ns.work_dtype_for(device)
    schedule = _collective_schedule(shape, bounds, ns, rank, work_dtype)
    for kind, size, dtype in schedule[comm.issued :]:
        buf = torch.zeros(size, dtype=dtype, device=device)
        if kind == "header":
            key = _config_hash(shape, bounds, ns, work_dtype)
            rows, cols = _piece_shape(shape, *bounds[rank])
            buf[rank, 1:] = torch.tensor([0.0, rows, cols, key], dtype=torch.float64)
            comm.all_reduce([buf], "norm and piece check")
            if _pieces_rejected(buf.cpu().tolist(), shape, bounds):
                return  # every peer raises at its piece check and issues nothing more
        elif kind == "all_reduce":
            comm.all_reduce([buf])
        else:
            comm.all_gather_rows([buf], size[1])


def _pieces_rejected(header, shape, bounds) -> bool:
    """Whether :func:`_raise_on_bad_pieces` raises for this header (on every rank alike)."""
    for r, (_, bad, rows, cols, _) in enumerate(header):
        if bad or (int(rows), int(cols)) != _piece_shape(shape, *bounds[r]):
            return True
    return len({int(slot[4]) for slot in header}) > 1


def _config_hash(shape, bounds, ns: NewtonSchulz, work_dtype) -> int:
    config = (
        shape,
        bounds,
        ns.coefficients,
        ns.restart_iterations,
        ns.uses_gram(*shape),
        str(work_dtype),
        ns.eps,
    )
    digest = hashlib.blake2b(repr(config).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 12  # 52 bits: exact in the fp64 header


def _raise_on_bad_pieces(header, shape, bounds, block, rank) -> None:
    problems = []
    for r, (_, bad, rows, cols, _) in enumerate(header):
        expected = _piece_shape(shape, *bounds[r])
        if bad:
            got = "a piece that is not a 2-D float tensor"
            if r == rank:
                got += f" ({block.dim()}-D, {block.dtype})"
        elif (int(rows), int(cols)) != expected:
            got = f"shape {(int(rows), int(cols))}"
        else:
            continue
        problems.append(
            f"group rank {r} passed {got}, expected {expected} (its piece {bounds[r][0]}:"
            f"{bounds[r][1]} of dim {split_dim(shape)} of the {shape} matrix)"
        )
    keys = [int(slot[4]) for slot in header]
    if len(set(keys)) > 1:
        agree = sorted([r for r, k in enumerate(keys) if k == one] for one in set(keys))
        problems.append(
            "the ranks called it with different full_shape, bounds or NewtonSchulz "
            f"configurations (ranks that agree: {agree}; this rank: {shape}, bounds {bounds})"
        )
    if problems:
        raise ValueError("split_newton_schulz: " + "; ".join(problems))


# ----------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class SplitCost:
    """Per-call cost of :func:`split_newton_schulz` on one matrix.

    ``flops``: per group rank (plain products: the row blocks are not symmetric; the local
    Grams at half cost where ``ns``'s kernel computes one triangle). ``*_bytes``: the result
    size of each collective summed (all-gathers padded to p·⌈m/p⌉ rows), work dtype; the fp64
    header all-reduce is counted in ``all_reduces`` and ``all_reduce_bytes``."""

    flops: tuple[float, ...]
    one_rank_flops: float
    all_reduces: int
    all_reduce_bytes: int
    all_gathers: int
    all_gather_bytes: int


def split_flops(shape, p: int, ns: NewtonSchulz, device: str | torch.device = "cuda") -> SplitCost:
    """The cost of splitting an (out, in) matrix's NS over p ranks (:func:`split_bounds`
    pieces), for the planner / a dry-run cost model; ``device`` picks the work dtype."""
    shape = _check_shape(shape)
    bounds = split_bounds(shape, p)
    m, n = min(shape), max(shape)
    k = _row_chunk(m, p)
    row_counts = [max(0, min((r + 1) * k, m) - r * k) for r in range(p)]
    elt = torch.empty((), dtype=ns.work_dtype_for(torch.device(device))).element_size()
    sym = 0.5 if ns.kernel in ("triton", "quack") else 1.0
    steps = len(ns.coefficients)
    if ns.uses_gram(m, n):
        segments = len(ns.restart_iterations) + 1
        small = steps + 3 * (steps - segments)  # Z every step, Q but first, R·Z and R but last
        grams = applies = segments
        single = sum(  # one-step segments need no full Z
            1 for s, e in _segments(steps, ns.restart_iterations) if e - s == 1
        )
        gathers = (steps - single) + (steps - segments) + segments  # Z, R, Q
        reduces = segments
    else:
        small, grams, applies, gathers, reduces = steps, steps, steps, steps, steps
    flops = tuple(
        grams * sym * 2 * m * m * (b - a) + applies * 2 * m * m * (b - a) + small * 2 * rows * m * m
        for (a, b), rows in zip(bounds, row_counts)
    )
    return SplitCost(
        flops=flops,
        one_rank_flops=ns.flops(m, n),
        all_reduces=reduces + 1,
        all_reduce_bytes=reduces * m * m * elt + p * _SLOT * 8,
        all_gathers=gathers,
        all_gather_bytes=gathers * p * k * m * elt,
    )


def _segments(steps: int, restarts: Sequence[int]) -> list[tuple[int, int]]:
    edges = [0, *sorted(restarts), steps]
    return list(zip(edges[:-1], edges[1:]))
