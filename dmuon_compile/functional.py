"""Functional core of the optimizer step: the one implementation of the update math.

``muon_update`` and ``adamw_update`` work on lists of tensors and know nothing about models,
meshes or owners; ``Muon`` (``optimizer.py``) gathers the lists and calls them. As in
``torch.optim``'s functional core (``torch/optim/adam.py``: one public function, a per-tensor
and a ``foreach`` body), the Muon step is written once: the eager step calls
:func:`muon_update` with float hyper-parameters, a user-compiled ``opt.step`` traces it, and
the compiled step (``compiled_step.CompiledMuonStep``) is ``torch.compile`` of it with 0-d
tensor hyper-parameters (one graph). Both run ``foreach`` ops, so a traced step costs Dynamo a
few calls per matrix, not one per operation; the bodies differ only where ``foreach`` ops take
no tensor ``alpha``, and each says so where it branches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim.adamw import adamw as torch_adamw

from dmuon_compile import normuon as _normuon
from dmuon_compile.layouts import Layout
from dmuon_compile.newton_schulz import DEFAULT_STACK_BYTES, NewtonSchulz, frobenius_norm  # noqa: F401
from dmuon_compile.normuon import NorMuon

ADJUST_LR_FNS = ("match_rms_adamw", "original", "none")
MATRIX = Layout()  # a 2-D weight: one matrix


def layouts_of(tensors: Sequence[Tensor], layouts: Sequence[Layout] | None) -> list[Layout]:
    """Each tensor's :class:`~dmuon_compile.layouts.Layout`: as given, else one matrix per 2-D
    tensor; a tensor of more dims needs its layout given (no silent flattening).

    >>> layouts_of([torch.zeros(2, 3)], None)
    [Layout(kind='matrix', split=None, split_dim=0, transposed=False, parts=(), head_dims=())]
    """
    if layouts is not None:
        if len(layouts) != len(tensors):
            raise ValueError(f"{len(layouts)} layouts for {len(tensors)} tensors")
        return list(layouts)
    for t in tensors:
        if t.dim() != 2:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} is not one matrix: pass layouts= "
                "(dmuon_compile.layouts.Layout: experts(), conv(), ...) saying what its "
                "matrices are"
            )
    return [MATRIX] * len(tensors)


def hyper(value):
    """A hyper-parameter as the step uses it: a Python float in eager (a 0-d tensor, as
    ``Muon``'s param groups keep ``lr`` and ``weight_decay``, is read once: exactly the float
    arithmetic of a float group), the tensor itself while ``torch.compile`` traces (a value
    change then refills an input instead of failing a guard: no recompile)."""
    if isinstance(value, Tensor):
        return value if torch.compiler.is_compiling() else float(value)
    return value


def _traced(*values) -> bool:
    return any(isinstance(v, Tensor) for v in values)


def lr_scale(shape: Sequence[int], adjust_lr_fn: str | None) -> float:
    """Per-matrix learning-rate multiplier.

    - ``"match_rms_adamw"`` (default; DMuon's "internal scaling"): 0.2·√max(m, n), so the
      update's RMS matches AdamW's and AdamW-tuned learning rates carry over;
    - ``"original"`` (Keller Jordan's, torch.optim.Muon's default): √max(1, m/n);
    - ``"none"``: 1.

    ``m, n`` are the first two dims, as torch.optim.Muon uses them.

    >>> lr_scale((1024, 4096), "match_rms_adamw")
    12.8
    """
    m, n = shape[0], shape[1]
    if adjust_lr_fn in (None, "match_rms_adamw"):
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr_fn == "none":
        return 1.0
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {ADJUST_LR_FNS}")


def shape_buckets(
    tensors: Sequence[Tensor],
    layouts: Sequence[Layout] | None = None,
    max_bytes: int | None = None,
) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (matrix shape, dtype, device), in first-seen order:
    the stacks Newton–Schulz orthogonalises in one batched call (an expert stack's matrices
    join the 2-D weights of their shape). ``max_bytes`` (``NewtonSchulz.stack_bytes``) cuts a
    group into consecutive stacks of at most that many bytes (a tensor alone past it is a
    stack of its own, which NS then runs in pieces). The step's only bucketing; traceable (the
    keys are static under ``dynamic=False``).

    >>> shape_buckets([torch.zeros(2, 3), torch.zeros(4, 4), torch.zeros(2, 3)])
    [[0, 2], [1]]
    >>> shape_buckets([torch.zeros(2, 3)] * 3, max_bytes=48)
    [[0, 1], [2]]
    """
    lays = layouts_of(tensors, layouts)
    groups: dict[tuple, list[int]] = {}
    for i, (t, lay) in enumerate(zip(tensors, lays)):
        groups.setdefault((_bucket_shape(lay, t.shape), t.dtype, t.device), []).append(i)
    if max_bytes is None:
        return list(groups.values())
    buckets: list[list[int]] = []
    for idx in groups.values():
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in idx]
        buckets += [[idx[j] for j in run] for run in cut_by_bytes(sizes, max_bytes)]
    return buckets


def cut_by_bytes(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Positions of ``sizes`` cut into consecutive runs of at most ``max_bytes`` (a size alone
    past it is a run of its own): how :func:`shape_buckets` cuts a group, and how the dry run
    predicts it.

    >>> cut_by_bytes([4, 4, 4, 9], 8)
    [[0, 1], [2], [3]]
    """
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for j, nbytes in enumerate(sizes):
        if current and total + nbytes > max_bytes:
            runs.append(current)
            current, total = [], 0
        current.append(j)
        total += nbytes
    if current:
        runs.append(current)
    return runs


def _bucket_shape(lay: Layout, shape) -> tuple:
    """A tensor's bucket key: its matrices' shape, or, for a blocked layout whose blocks
    differ in shape, the tuple of its pieces' shapes (``orthogonalize`` re-buckets the pieces:
    each joins the matrices of its own shape)."""
    pieces = lay.pieces(shape)
    if len(pieces) == 1:
        return lay.stacked_shape(shape)
    dim = lay.block_dim(shape)
    return tuple(
        sub.stacked_shape(_narrowed(shape, dim, stop - start)) for start, stop, sub in pieces
    )


def _narrowed(shape, dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else int(s) for d, s in enumerate(shape))


def _split_pieces(tensors: Sequence[Tensor], lays: Sequence[Layout]):
    """Each tensor whose blocked layout has blocks of several shapes as its pieces (views
    along its block dim, :meth:`Layout.pieces`), the others as they are. Returns ``(pieces,
    their layouts, per tensor: its pieces' count)``, or ``None`` when no tensor has pieces."""
    cut = [lay.pieces(t.shape) for t, lay in zip(tensors, lays)]
    if all(len(c) == 1 for c in cut):
        return None
    pieces: list[Tensor] = []
    piece_lays: list[Layout] = []
    for t, lay, parts in zip(tensors, lays, cut):
        if len(parts) == 1:
            pieces.append(t)
            piece_lays.append(lay)
            continue
        dim = lay.block_dim(t.shape)
        for start, stop, sub in parts:
            pieces.append(t.narrow(dim, start, stop - start))
            piece_lays.append(sub)
    return pieces, piece_lays, [len(c) for c in cut]


def _orthogonalize_pieces(updates, ns, batch_same_shape, release, finite, lays, split):
    """``orthogonalize`` of updates some of which are pieces (``_split_pieces``): the pieces
    bucketed by their own shapes, each update put back together along its block dim; one
    ``finite`` entry for all the updates (an update is finite when all its pieces are)."""
    pieces, piece_lays, counts = split
    if release:
        for i in range(len(updates)):
            updates[i] = None
    inner: list | None = [] if finite is not None else None
    results = orthogonalize(
        pieces, ns, batch_same_shape, release=release, finite=inner, layouts=piece_lays
    )
    out, k = [], 0
    for lay, count in zip(lays, counts):
        mine = results[k : k + count]
        k += count
        if count == 1:
            out.append(mine[0])
        else:
            dim = mine[0].dim() - 2 + lay.split_dim
            out.append(torch.cat(mine, dim))
    if inner:  # the flags of the pieces' buckets (none when batch_same_shape=False)
        order = [j for idx, _ in inner for j in idx]
        where = [0] * len(order)
        for position, j in enumerate(order):
            where[j] = position
        flags = torch.cat([f for _, f in inner])[where]  # in the pieces' order
        flags = torch.stack([f.all() for f in flags.split(counts)])
        finite.append((list(range(len(counts))), flags))
    return out


def orthogonalize(
    updates: list[Tensor],
    ns: NewtonSchulz,
    batch_same_shape: bool = True,
    *,
    release: bool = False,
    finite: list | None = None,
    layouts: Sequence[Layout] | None = None,
) -> list[Tensor]:
    """NS(u) for every update, by its layout (an expert stack: each expert's matrix on its
    own; a blocked layout: each head or part); matrices of one shape are stacked into one
    batched call (a tensor whose blocks differ in shape is cut into its pieces first, each
    joining the matrices of its shape).

    ``release=True`` drops each bucket's entries of ``updates`` (set to ``None``) once they are
    stacked: inputs the caller holds nowhere else (``muon_directions``' Nesterov inputs) are
    then freed before Newton–Schulz allocates its work copies. ``finite`` (a list, stacked
    matrices only): receives, per shape bucket, ``(indices of its updates, flags)``, the flags
    a 1-D bool tensor saying whether each update's Frobenius norms — the ones NS normalises
    by — are finite.
    """
    lays = layouts_of(updates, layouts)
    split = _split_pieces(updates, lays)
    if split is not None:  # blocked layouts with blocks of several shapes: piece by piece
        return _orthogonalize_pieces(updates, ns, batch_same_shape, release, finite, lays, split)
    if not batch_same_shape:
        return [lay.unmatrices(ns(lay.matrices(u)), u.shape) for u, lay in zip(updates, lays)]
    out: list[Tensor | None] = [None] * len(updates)
    for idx in shape_buckets(updates, lays, ns.stack_bytes):
        bucket = [updates[i] for i in idx]
        if release:
            for i in idx:
                updates[i] = None
        bucket_flags: list | None = [] if finite is not None else None
        results = _orthogonalize_bucket(bucket, ns, bucket_flags, [lays[i] for i in idx])
        for i, r in zip(idx, results):
            out[i] = r
        if finite is not None:
            finite.append((idx, bucket_flags[0]))
    return out  # type: ignore[return-value]


def _orthogonalize_bucket(
    bucket: list[Tensor], ns: NewtonSchulz, finite: list | None, layouts: list[Layout]
) -> list[Tensor]:
    """NS of one shape bucket, one batched call for all its matrices; empties ``bucket`` once
    it is stacked (see ``orthogonalize``'s ``release``). ``finite``: receives the bucket's
    finite flags (1-D, one per update), from the norms NS normalises by (taken once, handed
    to NS)."""
    shapes = [u.shape for u in bucket]
    mats = [lay.matrices(u) for u, lay in zip(bucket, layouts)]
    counts = [1 if m.dim() == 2 else m.shape[0] for m in mats]
    if _normalize_each(mats, ns):
        bucket.clear()
        x, norms, transposed = ns.normalize_each(mats)
        del mats
        if finite is not None:
            finite.append(_finite_flags(norms, counts))
        ortho = ns.orthogonalize_normalized(x, transposed)
        return _bucket_results(ortho, counts, shapes, layouts)
    if len(mats) == 1:
        stack = mats[0]
    elif all(m.dim() == 2 for m in mats):
        stack = torch.stack(mats)
    else:  # expert stacks (and 2-D weights of the same matrix shape): one batch
        stack = torch.cat([m.unsqueeze(0) if m.dim() == 2 else m for m in mats])
    bucket.clear()
    del mats
    norms = None
    if finite is not None:  # NS normalises by the same norms: one reduction, not two
        norms = frobenius_norm(stack, ns.work_dtype_for(stack.device))
        finite.append(_finite_flags(norms, counts))
    return _bucket_results(ns(stack, norms), counts, shapes, layouts)


# A traced step computes the Nesterov inputs of tensors this large (an expert stack, a 70B-scale
# matrix) where they are read, and stacks their buckets normalised: a full fp32 write and two
# reads fewer per value, for one norm reduction per tensor instead of one per bucket. Smaller
# tensors keep the foreach ops and the stacked norm: there the per-tensor reductions cost more
# than the bytes save (benchmarks/RESULTS.md §20, §27), and each tensor costs ~15 traced calls
# instead of a few (compile time).
COMPUTED_WHERE_READ_MIN_VALUES = 1 << 26


def _computed_where_read(tensors: Sequence[Tensor]) -> bool:
    return torch.compiler.is_compiling() and all(
        t.numel() >= COMPUTED_WHERE_READ_MIN_VALUES for t in tensors
    )


def _normalize_each(mats: list[Tensor], ns: NewtonSchulz) -> bool:
    """Whether a traced bucket stacks its matrices normalised (``NewtonSchulz.normalize_each``)
    rather than as they are: several large matrices (one is not copied into a stack), all in
    one Newton–Schulz call (a stack past ``stack_bytes`` goes in pieces, each normalised
    apart)."""
    if len(mats) < 2 or not _computed_where_read(mats):
        return False
    total = sum(1 if m.dim() == 2 else m.shape[0] for m in mats)
    return total <= ns.matrices_per_call(mats[0].shape[-2:], mats[0].element_size())


def _finite_flags(norms: Tensor, counts: list[int]) -> Tensor:
    """One flag per update from its matrices' norms: finite when all of them are."""
    flags = torch.isfinite(norms).reshape(-1)
    if any(c != 1 for c in counts):
        flags = torch.stack([f.all() for f in flags.split(counts)])
    return flags


def _bucket_results(ortho: Tensor, counts: list[int], shapes, layouts) -> list[Tensor]:
    """A bucket's Newton–Schulz output cut back into its updates, in their shapes."""
    if ortho.dim() == 2 or len(counts) == 1:
        results = [ortho]
    elif all(c == 1 for c in counts):
        results = list(ortho.unbind(0))
    else:
        results = list(ortho.split(counts))
    # 2-D weights need no reshape (and a traced step skips a call per matrix).
    return [
        r if r.shape == shape else lay.unmatrices(r, shape)
        for r, shape, lay in zip(results, shapes, layouts)
    ]


def apply_muon_update(
    params: list[Tensor],
    ortho: list[Tensor],
    lr: float | Tensor,
    weight_decay: float | Tensor,
    adjust_lr_fn: str | None,
    matrix_shapes: Sequence[Sequence[int]] | None = None,
    layouts: Sequence[Layout] | None = None,
) -> None:
    """W ← (1 − lr·wd)·W − lr·scale(W)·O, in place (``lr``, ``weight_decay``: floats or 0-d
    tensors).

    Floats (eager) skip a zero decay and fold the step into ``add_``'s ``alpha``; tensors (the
    compiled step: no value may pick a branch, and ``alpha`` takes no tensor) always decay and
    scale by a 0-d factor. The same math. ``matrix_shapes``: the whole matrices' shapes when
    ``params`` are shards of them (TP: the scale is the whole matrix's), else each param's own
    matrices' (``layouts``: an expert's, a fused half's, a block's; a tensor whose blocks
    differ in shape is updated piece by piece, each piece, a view, with its blocks' scale).
    """
    if matrix_shapes is None:
        lays = layouts_of(params, layouts)
        split = _split_pieces(params, lays)
        if split is not None:  # blocks of several shapes: each piece with its own scale
            ortho = _split_pieces(ortho, lays)[0]
            params, lays = split[0], split[1]
        matrix_shapes = [lay.matrix_shape(p.shape) for p, lay in zip(params, lays)]
    scales = [lr_scale(shape, adjust_lr_fn) for shape in matrix_shapes]
    if _traced(lr, weight_decay):
        _apply_traced(params, ortho, lr, weight_decay, scales)
        return
    for p, o, scale in zip(params, ortho, scales):
        if weight_decay != 0.0:
            p.mul_(1.0 - lr * weight_decay)
        p.add_(o.to(p.dtype), alpha=-lr * scale)


def scale_blocks_as_whole(
    ortho: Tensor, layout: Layout, adjust_lr_fn: str | None, whole_shape=None
) -> Tensor:
    """``ortho``, one whole 2-D matrix orthogonalised by ``layout``'s blocks, with each block
    times its own learning-rate scale over the whole matrix's: shards of it applied with the
    whole matrix's scale (the TP stage's commit) then move each block by its own scale, as
    :func:`apply_muon_update` with ``layouts`` does. ``whole_shape``: the whole matrix's shape
    when ``ortho`` is a shard of it holding whole blocks (``layout`` then its shard's). Not
    blocked: ``ortho`` itself."""
    if not layout.blocked:
        return ortho
    whole = lr_scale(ortho.shape if whole_shape is None else whole_shape, adjust_lr_fn)
    split = _split_pieces([ortho], [layout])
    if split is None:  # blocks of one shape: one factor
        return ortho * (lr_scale(layout.matrix_shape(ortho.shape), adjust_lr_fn) / whole)
    out = ortho.clone()
    for piece, lay in zip(*_split_pieces([out], [layout])[:2]):
        piece.mul_(lr_scale(lay.matrix_shape(piece.shape), adjust_lr_fn) / whole)
    return out


def _apply_traced(params, ortho, lr: Tensor, weight_decay: Tensor, scales: list[float]) -> None:
    """``apply_muon_update`` while traced: ``foreach`` ops, one traced call per list or per
    distinct scale (same-shape matrices share one), not several per matrix.

    ``addcmul_`` computes W + O·(−lr·scale) in W's dtype: a half-precision O times a 0-d
    factor would round the product to O's dtype first (0-d tensors do not promote).
    """
    if not params:
        return
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    by_scale: dict[float, list[int]] = {}
    for i, scale in enumerate(scales):
        by_scale.setdefault(scale, []).append(i)
    for scale, idx in by_scale.items():
        factor = -(lr * scale)
        mine, theirs = [params[i] for i in idx], [ortho[i] for i in idx]
        if isinstance(factor, Tensor):
            torch._foreach_addcmul_(mine, theirs, [factor] * len(idx))
        else:  # a float lr with a tensor weight decay
            torch._foreach_add_(mine, theirs, alpha=factor)


def muon_directions(
    grads: list[Tensor],
    bufs: list[Tensor],
    *,
    momentum: float | Tensor,
    nesterov: bool,
    ns: NewtonSchulz,
    finite_flags: bool = False,
    layouts: Sequence[Layout] | None = None,
    second_moments: list[Tensor] | None = None,
    normuon: NorMuon | None = None,
    keep_momentum: bool = False,
) -> list[Tensor] | tuple:
    """The first half of a Muon step: NS(u) for every matrix, writing nothing.

    ``finite_flags=True`` also returns, per matrix, whether ``u`` is finite (a 1-D bool tensor
    in ``grads``' order): taken from the norm Newton–Schulz normalises by, so the compiled step
    checks its gradients (and momentum) without another read of them. A NaN or Inf in ``g`` or
    ``buf`` makes ``u``'s norm NaN or Inf; so does a norm past the float32 range.

    ``u`` is the Nesterov input of the momentum buffer the step will store (buf' = μ·buf + g;
    u = g + μ·buf', or buf'), computed out of place: every allocation and every kernel that can
    fail (the Newton–Schulz chain, its compile and autotune) runs here, before any state
    changes. :func:`commit_muon_step` stores buf' and applies the result. ``Muon.step`` agrees
    across ranks between the two, so a failure on one rank changes nothing anywhere.

    One shape bucket at a time: a bucket's ``u`` (fp32), its stack and Newton–Schulz's work
    copies live only while that bucket is orthogonalised; only the results (NS's work dtype:
    bf16/fp16 on GPU) are kept for the commit. The extra memory of a step is therefore every
    direction plus one bucket's working set, never every matrix's ``u`` at once.

    ``second_moments`` (NorMuon, ``dmuon_compile/normuon.py``; ``normuon``: its β₂ and ε,
    default ``NorMuon()``): each matrix's per-row second moment ``v``; every direction is then
    normalised row by row, bucket by bucket, and the result gets one more element last, the
    new moments ``v′`` (out of place: :func:`commit_muon_step` stores them), whose finiteness
    joins the flags. ``keep_momentum=True``: each matrix's buf′ as well, in its buffer's dtype
    (:func:`nesterov_input` with ``keep``), last. Returns ``directions``, then after it, each
    where asked for and in this order: the flags, ``v′``, buf′ (a tuple when any is).
    """
    momentum = hyper(momentum)
    lays = layouts_of(grads, layouts)
    out: list[Tensor | None] = [None] * len(grads)
    moments: list | None = None if second_moments is None else [None] * len(grads)
    kept: list | None = [None] * len(grads) if keep_momentum else None
    order: list[int] = []  # the matrices in bucket order: the order of the flags' pieces
    pieces: list[Tensor] = []
    for idx in shape_buckets(grads, lays, ns.stack_bytes):
        mine_g, mine_b = [grads[i] for i in idx], [bufs[i] for i in idx]
        if kept is None:
            bucket = nesterov_input(mine_g, mine_b, momentum, nesterov)
        else:
            bucket, new_bufs = nesterov_input(mine_g, mine_b, momentum, nesterov, keep=True)
            for i, b in zip(idx, new_bufs):
                kept[i] = b
        finite: list | None = [] if finite_flags else None
        bucket_lays = [lays[i] for i in idx]
        results = orthogonalize(bucket, ns, release=True, finite=finite, layouts=bucket_lays)
        if moments is not None:  # NorMuon: per row, while the bucket's results are fresh
            mine = [second_moments[i] for i in idx]
            results, new = _normuon.normalize_all(results, mine, bucket_lays, normuon)
            for i, v in zip(idx, new):
                moments[i] = v
        for i, r in zip(idx, results):  # orthogonalize freed u
            out[i] = r
        for piece_idx, piece in finite or ():
            order += [idx[j] for j in piece_idx]
            pieces.append(piece)
    extra = (() if moments is None else (moments,)) + (() if kept is None else (kept,))
    if not finite_flags:
        return (out, *extra) if extra else out  # type: ignore[return-value]
    if not grads:
        return ([], torch.zeros(0, dtype=torch.bool), *extra)
    # One small kernel per bucket and one gather back to ``grads``' order (not one per matrix).
    where = [0] * len(order)
    for position, i in enumerate(order):
        where[i] = position
    flags = torch.cat(pieces)[where]
    if moments is not None:  # a loaded non-finite v makes v′ (and the direction) non-finite
        flags = flags & _normuon.moments_finite(moments).to(flags.device)
    return (out, flags, *extra)


def new_momentum(grads: list[Tensor], bufs: list[Tensor], momentum: float | Tensor) -> list[Tensor]:
    """buf' = μ·buf + g, out of place, in the gradients' dtype (a momentum stored in a lower
    precision, ``Muon(momentum_dtype=torch.bfloat16)``, is rounded once where it is stored)."""
    out = [b.to(g.dtype, copy=True) for g, b in zip(grads, bufs)]
    torch._foreach_mul_(out, momentum)
    torch._foreach_add_(out, grads)
    return out


def store_momentum(grads: list[Tensor], bufs: list[Tensor], momentum: float | Tensor) -> None:
    """buf ← μ·buf + g in place: by two ``foreach`` operations where the momentum has the
    gradients' dtype; else computed in theirs and rounded once into the stored dtype."""
    if all(b.dtype == g.dtype for g, b in zip(grads, bufs)):
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)
        return
    for b, new in zip(bufs, new_momentum(grads, bufs, momentum)):
        b.copy_(new)


def nesterov_input(
    grads: list[Tensor],
    bufs: list[Tensor],
    momentum: float | Tensor,
    nesterov: bool,
    keep: bool = False,
) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
    """The Newton–Schulz input ``u`` of a step, ``bufs`` left unchanged: buf' = μ·buf + g
    (what :func:`commit_muon_step` stores, by the same operations, in the gradients' dtype);
    u = g + μ·buf' (Nesterov) or buf'. One new tensor per matrix (eager: buf' becomes u in
    place, by ``foreach`` operations). ``keep=True`` (``Muon(keep_new_momentum=True)``):
    returns ``(u, buf')`` with buf' kept apart from u, in the buffers' dtype (rounded once, as
    :func:`store_momentum` stores it), for the commit to take instead of computing it again."""
    if not grads:
        return ([], []) if keep else []
    if _computed_where_read(grads):
        # Per tensor, not foreach: Inductor writes a foreach op's outputs whole on GPUs, and u is
        # best computed where its bucket's norm and scaled cast read it, never written (kept:
        # buf' written by the kernel that reads it).
        new = [b.to(g.dtype) * momentum + g for g, b in zip(grads, bufs)]
        u = [v * momentum + g for g, v in zip(grads, new)] if nesterov else list(new)
    else:
        new = new_momentum(grads, bufs, momentum)
        u = new
        if nesterov:
            if keep:  # out of place: buf' stays as it is
                u = torch._foreach_mul(new, momentum)
            else:
                torch._foreach_mul_(u, momentum)
            torch._foreach_add_(u, grads)
        u = list(u)  # a list (foreach ops may return a tuple): consumed bucket by bucket
    if not keep:
        return u
    return u, [v if v.dtype == b.dtype else v.to(b.dtype) for v, b in zip(new, bufs)]


def commit_muon_step(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    ortho: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float | Tensor,
    momentum: float | Tensor,
    adjust_lr_fn: str | None = "match_rms_adamw",
    commit_if: Tensor | None = None,
    layouts: Sequence[Layout] | None = None,
    matrix_shapes: Sequence[Sequence[int]] | None = None,
    second_moments: list[Tensor] | None = None,
    new_second_moments: list[Tensor] | None = None,
) -> None:
    """The second half of a Muon step, in place: buf ← μ·buf + g (the buf' that
    :func:`muon_directions` used), W ← (1 − lr·wd)·W − lr·scale(W)·O. Elementwise only.
    NorMuon: ``second_moments`` ← ``new_second_moments`` (the ``v′`` of the directions).

    ``commit_if`` (a 0-d bool tensor: the step's verdict, still on the device): every value is
    written as ``where(commit_if, new, old)``, so a step whose verdict turns out false changes
    nothing, NaN gradients included, and no host read has to come first. Compiled, the select
    fuses into the same kernels (the same bytes); eager, it costs a copy of each tensor.
    ``matrix_shapes``: each matrix's whole shape when ``params`` are shards of it (the
    learning-rate rule reads it); default: from the tensors and ``layouts``.
    """
    lr, weight_decay, momentum = hyper(lr), hyper(weight_decay), hyper(momentum)
    if not params:
        return
    moments, new_moments = list(second_moments or ()), list(new_second_moments or ())
    if len(moments) != len(new_moments):
        raise ValueError(
            f"commit_muon_step: {len(moments)} second moments for {len(new_moments)} new ones: "
            "pass both (NorMuon) or neither"
        )
    if commit_if is None:
        store_momentum(grads, bufs, momentum)
        if moments:
            torch._foreach_copy_(moments, new_moments)
        apply_muon_update(params, ortho, lr, weight_decay, adjust_lr_fn, matrix_shapes, layouts)
        return
    new_bufs = new_momentum(grads, bufs, momentum)
    new_params = [p.clone() for p in params]
    apply_muon_update(new_params, ortho, lr, weight_decay, adjust_lr_fn, matrix_shapes, layouts)
    olds, news = list(bufs) + list(params) + moments, list(new_bufs) + new_params + new_moments
    for old, new in zip(olds, news):
        old.copy_(torch.where(commit_if, new, old))


def muon_update(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float | Tensor,
    momentum: float | Tensor,
    nesterov: bool,
    ns: NewtonSchulz,
    adjust_lr_fn: str | None = "match_rms_adamw",
    layouts: Sequence[Layout] | None = None,
    second_moments: list[Tensor] | None = None,
    normuon: NorMuon | None = None,
) -> None:
    """One Muon step on whole matrices, in place: momentum → Newton–Schulz → scaled update.

    buf ← μ·buf + g; u = g + μ·buf (Nesterov) or buf; W ← (1 − lr·wd)·W − lr·scale(W)·NS(u),
    with same-shape matrices orthogonalised as one stack. ``layouts``: what each tensor's
    matrices are (:class:`~dmuon_compile.layouts.Layout`; default: each 2-D tensor is one
    matrix, and a tensor of more dims raises). ``second_moments`` (``normuon``: its β₂ and ε):
    NorMuon's per-row normalisation (``dmuon_compile/normuon.py``), the moments updated in place.

    The only implementation of the Muon step, in two halves: :func:`muon_directions` (computes,
    writes nothing) and :func:`commit_muon_step` (elementwise, in place). ``Muon``'s step runs
    the first half for every matrix, agrees across ranks, then commits; eager
    (hyper-parameters read as floats, :func:`hyper`), traced by a user's
    ``torch.compile(opt.step)``, or with the first half compiled by ``CompiledMuonStep``
    (``fullgraph=True``, a 0-d tensor ``momentum``: a new value refills an input, never
    recompiles).

    Example::

        muon_update([w], [w.grad], [buf], lr=0.02, weight_decay=0.0, momentum=0.95,
                    nesterov=True, ns=NewtonSchulz())
    """
    ortho = muon_directions(
        grads,
        bufs,
        momentum=momentum,
        nesterov=nesterov,
        ns=ns,
        layouts=layouts,
        second_moments=second_moments,
        normuon=normuon,
    )
    new_moments = None
    if second_moments is not None:
        ortho, new_moments = ortho
    commit_muon_step(
        params,
        grads,
        bufs,
        ortho,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        adjust_lr_fn=adjust_lr_fn,
        layouts=layouts,
        second_moments=second_moments,
        new_second_moments=new_moments,
    )


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    commit_if: Tensor | None = None,
) -> None:
    """Decoupled-weight-decay Adam (torch.optim.AdamW's math), in place, by torch's fused
    AdamW kernel.

    ``steps``: 0-d float32 tensors on the parameters' device (the kernel reads them there).
    ``commit_if`` (a 0-d bool tensor: the step's verdict, still on the device): false leaves
    every parameter, moment and step count as it was, NaN gradients included, with no host
    read (the kernel skips its work; the counts take their increment back, as torch's own
    ``found_inf`` path does).
    """
    if not params:
        return
    lr, weight_decay = hyper(lr), hyper(weight_decay)
    beta1, beta2 = betas
    if torch.compiler.is_compiling():
        if commit_if is not None:
            raise ValueError("adamw_update: commit_if is not supported while torch.compile traces")
        _adamw_traced(
            params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay
        )
        return
    skipped = None if commit_if is None else (~commit_if).to(torch.float32)
    torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=True,
        found_inf=skipped,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


def _adamw_traced(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, wd) -> None:
    """``adamw_update`` while ``torch.compile`` traces: the step count stays a tensor (no
    ``.item()``, which would break the graph every step), the same math otherwise."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step.add_(1.0)
        bias1 = 1.0 - beta1**step
        bias2 = 1.0 - beta2**step
        p.mul_(1.0 - lr * wd)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / bias2.sqrt()).add_(eps)
        p.sub_((m / denom) * (lr / bias1))
