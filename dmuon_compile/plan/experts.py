"""Expert parallelism in the dry run: torchtitan's EP layout of the expert stacks (``Shard(0)``
or ``Shard(1)`` inside experts), their bytes, NS and reshard traffic per rank."""

from __future__ import annotations

from dmuon_compile.distributed._stages.expert_shards import ExpertWalk, chunk_size, ns_cost
from dmuon_compile.plan.momentum import MomentumCost
from dmuon_compile.plan.report import NS_WORK_ITEMSIZE, WORKING_SET_FACTOR


def _merge_expert_layout(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    out = dict(a)
    for key in ("experts", "local_experts", "shard_dims"):
        out[key] = sorted(set(a[key]) | set(b[key]))
    for key in ("stacks", "resharded_stacks"):
        out[key] = a[key] + b[key]
    return out


def _check_ep(ep, shard_dim, shard: int, replicate: int, tp: int) -> None:
    if ep is None:
        if shard_dim is not None:
            raise ValueError("dry_run: expert_shard_dim needs ep (pass ep=1 for no EP)")
        return
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"dry_run: ep must be an integer >= 1, got {ep!r}")
    if shard_dim not in (None, 0, 1):
        raise ValueError(
            f"dry_run: expert_shard_dim must be 0, 1 or None (torchtitan's rule), got {shard_dim!r}"
        )
    if tp > 1:
        raise ValueError(
            f"dry_run: ep={ep} with tp_size={tp} is not modelled (torchtitan's EP borrows TP "
            "ranks and shards experts over them too): plan expert parallelism with tp_size=1 "
            "(--tp 1)"
        )
    if shard % ep:
        below = max(d for d in range(1, ep) if shard % d == 0)
        above = [d for d in range(ep + 1, shard + 1) if shard % d == 0][:1]
        fits = [below, *above]
        raise ValueError(
            f"dry_run: ep={ep} must divide the data-parallel shard size {shard} (world_size / "
            f"replicate_size {replicate}; EP groups are ep consecutive shard ranks, expert FSDP "
            f"the other shard/ep): pass an ep that divides {shard} (e.g. "
            f"{' or '.join(map(str, fits))}) or change the GPU count / --hsdp"
        )


class _EPContext:
    """What :func:`_ep_stack` reads and writes of the dry run in progress."""

    def __init__(self, ep, shards, replicas, rows, per_shard, gpu, add_ns, rates, cap, ns, walk):
        self.ep, self.shards, self.replicas = ep, shards, replicas
        self.rows, self.per_shard, self.gpu, self.add_ns = rows, per_shard, gpu, add_ns
        self.rates, self.stack_cap, self.ns = rates, cap, ns
        self.padding: list[str] = []  # stacks whose expert-FSDP chunks are mostly padding
        self.walk: ExpertWalk = walk  # who orthogonalises which experts, as the step's
        self.batch, self.batch_fill = 0, 0  # the reshard's batches, cut as the step cuts them
        # The Muon momentum's storage (Muon(momentum_dtype=..., offload=...)).
        self.momentum = MomentumCost()
        # Muon(expert_ns="once") under HSDP: the replicas split each stack's whole experts.
        self.once = False
        self.whole_batches: dict = {}  # replicate group -> [batch, bytes, stacks] (whole stacks)
        self.gathers: dict = {}  # (replicate group, batch) -> [members, shares' elements, whole]


def _ep_stack(ctx: _EPContext, fqn, p, layout, shard_dim, unshards, citem, ritem) -> int:
    """One expert stack ``(E, a, b)`` under torchtitan's EP: ``Shard(0)`` over the ``ep``
    consecutive shard ranks ``s = f · ep + e`` (``E/ep`` experts on EP rank ``e``), expert FSDP
    over ``f`` (``efsdp = shard/ep`` ranks): ``Shard(0)`` of the local experts, or ``Shard(1)``
    of every local expert's rows when ``efsdp · ep > E``. Returns the expert FSDP shard dim."""
    ep, S, R = ctx.ep, ctx.shards, ctx.replicas
    E, a = int(p.shape[0]), int(p.shape[1])
    b = p.numel() // (E * a) if E * a else 0
    if E % ep:
        fits = ", ".join(str(d) for d in range(1, E + 1) if E % d == 0 and S % d == 0)
        raise ValueError(
            f"dry_run: ep={ep} must divide the number of experts of {fqn} (shape "
            f"{tuple(p.shape)}: {E} experts): EP gives each EP rank E/ep whole experts; pass "
            f"an ep dividing both {E} and the shard size {S} (one of {fits})"
        )
    local, F = E // ep, S // ep
    dim = shard_dim if shard_dim is not None else (1 if F * ep > E else 0)
    if dim == 1 and a % F:  # FSDP2 raises NotImplementedError on an uneven Shard(1) too
        raise ValueError(
            f"dry_run: ep={ep}: {fqn} {tuple(p.shape)} would be sharded inside its experts "
            f"(Shard(1), efsdp · ep = {F * ep} > {E} experts) over efsdp = {F} ranks, but its "
            f"{a} rows are not divisible by {F}: FSDP2 refuses uneven sharding on dim 1. Pick "
            "an ep (or GPU count) whose efsdp = shard/ep divides the rows, or one with "
            "efsdp · ep <= experts (Shard(0))"
        )
    item = p.element_size()
    shape = layout.stacked_shape(p.shape)
    ps = ctx.per_shard
    # FSDP2's collectives over efsdp, padded to ceil-sized chunks; HSDP all-reduces the chunk
    padded = (-(-local // F)) * a * b if dim == 0 else local * (-(-a // F)) * b
    ps.add_all(
        "fsdp_comm_bytes",
        (F - 1) * padded * (unshards * citem + ritem) + 2 * (R - 1) * padded * ritem // R,
    )
    for f in range(F):
        lo, hi = f * ep, (f + 1) * ep  # the EP group of expert-FSDP rank f
        n = chunk_size(local, F, f) if dim == 0 else local
        rows_f = a if dim == 0 else chunk_size(a, F, f)  # its rows of each local expert
        ps.add_range("grad_bytes", lo, hi, n * rows_f * b * item)
        # weight + momentum (the rank's piece of the stack is one tensor)
        ps.add_range("sharded_muon_bytes", lo, hi, n * rows_f * b * item)
        if n * rows_f:
            ctx.momentum.charge(ps.adder(lo, hi), "sharded_muon_bytes", n * rows_f * b, item)
            if dim == 0 and not ctx.once:  # whole experts stepped where they lie
                ctx.momentum.charge_kept(ps.adder(lo, hi), n * rows_f * b, item)
        if dim == 0 and n:  # whole local experts: NS where they lie
            count = layout.count((n, *p.shape[1:]))
            for s in range(lo, hi):
                if ctx.once:
                    members = [ctx.gpu(r * S + s, 0) for r in range(R)]
                    whole_experts_once(ctx, members, n, a, b, item, layout, shape)
                    continue
                for r in range(R):
                    ctx.add_ns(ctx.gpu(r * S + s, 0), shape, count, True)
    if dim == 1:
        _ep_reshard(ctx, layout, shape, local, F, a, b, item)
    if padded * F > 1.25 * local * a * b:
        ctx.padding.append(fqn)
    return dim


def _ep_reshard(ctx: _EPContext, layout, shape, local: int, F: int, a: int, b: int, item) -> None:
    """A ``Shard(1)`` stack's step (``distributed/_stages/expert_shards.py``): per efsdp group (one
    per EP rank ``e`` and replica ``r``), an all-to-all among the ranks that hold rows of the
    same ``local`` experts gives member ``f`` ``m`` of them whole (``ExpertWalk``, as the step
    walks it: none for some when ``local < F``); after NS the inverse brings the result back to
    the rows. Received (= sent): there the other rows of its ``m`` experts, back its rows of
    the other local experts. The step exchanges and orthogonalises the stacks in batches (one
    all-to-all each way and one NS call per shape for a batch), cut where the most a member
    could get passes the stack cap: NS is priced per batch (:func:`finish_reshard_ns`). With
    ``ctx.once`` the replicas then split each member's ``m`` whole experts
    (:func:`split_over_replicas`); the dedicated loads weigh there, not on the efsdp walk."""
    ep, S = ctx.ep, ctx.shards
    most = -(-local // F) * a * b * item
    if ctx.batch_fill and ctx.batch_fill + most > ctx.stack_cap:
        ctx.batch, ctx.batch_fill = ctx.batch + 1, 0
    ctx.batch_fill += most
    cost = ns_cost(layout.matrix_shape((local, a, b))) * layout.count((1, a, b))
    whole: dict[int, tuple[int, ...]] = {}  # EP rank e -> whole experts per efsdp member
    for r in range(ctx.replicas):
        for e in range(ep):
            members = [ctx.gpu(r * S + f * ep + e, 0) for f in range(F)]
            shares = ctx.walk.shares((r, e), members, local, cost, last=not ctx.once)
            whole[e] = shares  # the same in every replica without the dedicated loads
            for f, g in enumerate(members):
                rows_f, m = chunk_size(a, F, f), shares[f]
                own = local * rows_f * b
                row = ctx.rows[g]
                row.expert_reshard_comm_bytes += (
                    (m * (a - rows_f) + (local - m) * rows_f) * b * item
                )
                row._elements += own  # momentum, Nesterov input and commit on the local rows
                row.step_extra_bytes += own * item  # the result back on the rows, until commit
                if m:  # the pieces received and the whole experts they form
                    old = row._reshard_bytes.get(ctx.batch, 0)
                    row._reshard_bytes[ctx.batch] = old + 2 * m * a * b * item
                    if not ctx.once:
                        count = layout.count((m, a, b))
                        key = (ctx.batch, shape)
                        row._reshard_calls[key] = row._reshard_calls.get(key, 0) + count
                        row.expert_matrices += count
    if ctx.once:  # member f's whole experts are copies over the replicas: they split them
        for e, shares in whole.items():
            for f, m in enumerate(shares):
                if m:
                    replicas = [ctx.gpu(r * S + f * ep + e, 0) for r in range(ctx.replicas)]
                    split_over_replicas(ctx, replicas, m, a, b, layout, shape, ctx.batch)


def whole_experts_once(ctx: _EPContext, members, n: int, a: int, b: int, item, layout, shape):
    """``n`` whole local experts ``(a, b)`` of a stack with no in-expert cut, the same on every
    rank of ``members`` (HSDP's replicate group), under ``expert_ns="once"``: the step's expert
    stage takes them (no longer the bucketed NS), in batches per replicate group cut as the
    step cuts them (``orthogonalize_resharded``: the rank's local experts' bytes, up to the
    stack cap), and the replicas split them (:func:`split_over_replicas`). Every member keeps
    momentum, Nesterov input and commit on its ``n`` experts, and their result in NS's output
    dtype until the commit (whole experts are not cast back: no in-expert cut to undo)."""
    key = ("replicas", tuple(members))
    most = n * a * b * item
    state = ctx.whole_batches.setdefault(key, [0, 0, 0])
    if state[2] and state[1] + most > ctx.stack_cap:
        state[0], state[1] = state[0] + 1, 0
    state[1] += most
    state[2] += 1
    for g in members:
        ctx.rows[g]._elements += n * a * b
        ctx.rows[g].step_extra_bytes += n * a * b * NS_WORK_ITEMSIZE
    split_over_replicas(ctx, members, n, a, b, layout, shape, ("whole", state[0]))


def split_over_replicas(ctx: _EPContext, members, whole: int, a: int, b: int, layout, shape, batch):
    """``whole`` experts ``(a, b)`` held alike by every rank of ``members`` (a replicate group)
    split between them by the walk, as the step's ``_over_replicas`` splits them (keyed by the
    group; the dedicated loads weigh here, where NS runs): each member's share joins its NS
    calls of ``batch``; the all-gather of the results is priced per batch
    (:func:`finish_replica_gathers`)."""
    key = ("replicas", tuple(members))
    cost = ns_cost(layout.matrix_shape((whole, a, b))) * layout.count((1, a, b))
    shares = ctx.walk.shares(key, members, whole, cost)
    gather = ctx.gathers.setdefault((key, batch), [members, [0] * len(members), 0])
    gather[2] += whole * a * b
    for j, (g, m) in enumerate(zip(members, shares)):
        gather[1][j] += m * a * b
        if m:
            count = layout.count((m, a, b))
            row = ctx.rows[g]
            row._reshard_calls[(batch, shape)] = row._reshard_calls.get((batch, shape), 0) + count
            row.expert_matrices += count


def finish_replica_gathers(ctx: _EPContext) -> None:
    """Per replicate group and batch, the step's one all-gather of the members' NS results in
    NS's output dtype (2 bytes on a GPU), each share padded to the largest: every member
    receives (and, in a ring, forwards) the ``R - 1`` other padded shares. Its transient: the
    send and receive buffers, ``R + 1`` padded shares, and the gathered whole experts; the
    buffers stay in flight under the next batch's NS (:func:`finish_reshard_ns` adds them)."""
    for (_key, batch), (members, sizes, whole) in ctx.gathers.items():
        n, most = len(members), max(sizes)
        moved = (n - 1) * most * NS_WORK_ITEMSIZE
        for g in members:
            row = ctx.rows[g]
            row.expert_gather_comm_bytes += moved
            row.replicate_comm_bytes += moved
            buffers = (n + 1) * most * NS_WORK_ITEMSIZE
            held = buffers + whole * NS_WORK_ITEMSIZE
            row._reshard_bytes[batch] = row._reshard_bytes.get(batch, 0) + held
            row._gather_in_flight[batch] = row._gather_in_flight.get(batch, 0) + buffers


def finish_reshard_ns(rows, rates, stack_cap: int, ns) -> None:
    """Each rank's NS of its resharded whole experts, one call per batch and shape (cut at the
    stack cap, as every NS call), and the largest batch's transient memory with its NS working
    set and, under ``expert_ns="once"``, another batch's all-gather buffers in flight (the
    largest other one: an upper bound, whatever order the step takes them in)."""
    for row in rows:
        work: dict[int, float] = {}
        for (batch, shape), count in row._reshard_calls.items():
            ms = rates.bucket_ms(shape, count, stack_cap, ns)
            row.ns_ms += ms
            row.expert_ns_ms += ms
            one = 4 * shape[0] * shape[1]
            ws = WORKING_SET_FACTOR["eager"] * min(count * one, max(one, stack_cap))
            work[batch] = max(work.get(batch, 0.0), ws)
        flights = row._gather_in_flight
        for batch, transient in row._reshard_bytes.items():
            other = max((b for k, b in flights.items() if k != batch), default=0)
            peak = transient + int(work.get(batch, 0.0)) + other
            row._reshard_peak = max(row._reshard_peak, peak)
