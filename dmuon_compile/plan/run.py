"""The dry run itself: :func:`dry_run` plans a job's dedicated weights over its ranks with
``plan_dedicated`` and fills one row per rank (bytes, step memory, NS and step ms, traffic)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from dmuon_compile.distributed._stages.expert_shards import ExpertWalk, ns_cost
from dmuon_compile.distributed._stages.tp.plan import local_shard_layouts
from dmuon_compile.momentum_storage import stream_bucket_bytes
from dmuon_compile.ns_rates import NSRates, TargetFlops, default_stack_bytes, useful_flops
from dmuon_compile.plan.experts import (
    _check_ep,
    _ep_stack,
    _EPContext,
    finish_replica_gathers,
    finish_reshard_ns,
    whole_experts_once,
)
from dmuon_compile.plan.models import build_model
from dmuon_compile.plan.momentum import MomentumCost, finish_kept, finish_rows
from dmuon_compile.plan.report import (
    NS_WORK_ITEMSIZE,
    WORKING_SET_FACTOR,
    DryRunReport,
    GiB,
    RankRow,
)

# ----------------------------------------------------------------------------- the dry run
# The weights' compute and reduce dtypes by name (the momentum's: momentum_storage's table).
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_sizes(world_size, replicate_size, tp_size, split_size) -> int:
    for name, v in (
        ("world_size", world_size),
        ("replicate_size", replicate_size),
        ("tp_size", tp_size),
        ("split_size", split_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"dry_run: {name} must be an integer >= 1, got {v!r}")
    per = replicate_size * tp_size
    if world_size % per:
        lo = world_size // per * per
        near = f"{lo} or {lo + per}" if lo else f"{per}"
        raise ValueError(
            f"dry_run: {world_size} GPUs are not divisible by replicate_size {replicate_size} × "
            f"tp_size {tp_size} = {per}: pass a world size that is a multiple of {per} (e.g. "
            f"{near}) or change --hsdp/--tp"
        )
    shard = world_size // per
    if split_size > 1 and (replicate_size * shard) % split_size:
        raise ValueError(
            f"dry_run: split_size={split_size} must divide the {replicate_size * shard} "
            "data-parallel ranks (split groups are aligned blocks of them): pass a divisor, "
            "e.g. the GPUs per node"
        )
    return shard


def _run_group(
    model_or_config,
    world_size: int,
    *,
    replicate_size: int,
    tp_size: int,
    split_size: int,
    predicate: Callable | None,
    layer_id_fn: Callable | None,
    hook_boundary_predicate: Callable | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    momentum: MomentumCost | None = None,
    compiled: bool,
    rates: NSRates,
    stack_bytes: int | None,
    ns,
    ep: int | None,
    expert_shard_dim: int | None,
    keep: set[str] | None = None,
    base_loads: list[float] | None = None,
    expert_ns: str = "per_replica",
    per_head: bool = False,
):
    """:func:`dry_run` of one data-parallel group (``world_size`` ranks): ``(report, the
    plan_dedicated result)``. ``momentum``: the Muon momentum's storage (default: in place, the
    weight's dtype). ``keep``: plan only these parameters (a pipeline stage's; the others are
    not on these ranks). ``base_loads``: as ``plan_dedicated``'s. ``expert_ns``: as
    ``Muon(expert_ns=...)``; ``per_head``: ``dmuon.set_head_layouts`` first."""
    from dmuon_compile.distributed.dedicate import plan_dedicated
    from dmuon_compile.distributed.policy import MixedPrecision, ParamPolicy, resolve_dtypes
    from dmuon_compile.layouts import get_layout, infer_layout
    from dmuon_compile.routing import default_muon_predicate, routing_module

    momentum = MomentumCost() if momentum is None else momentum
    t_start = time.perf_counter()
    shard = _check_sizes(world_size, replicate_size, tp_size, split_size)
    _check_ep(ep, expert_shard_dim, shard, replicate_size, tp_size)
    name, model = build_model(model_or_config)
    if per_head:
        from dmuon_compile.layouts import set_head_layouts

        set_head_layouts(model)  # raises naming what to declare when it finds no attention
    stack_cap = default_stack_bytes() if stack_bytes is None else int(stack_bytes)
    plan_ns = TargetFlops() if ns is None else ns
    rate_ns = getattr(plan_ns, "ns", plan_ns)  # the NS configuration the rates price
    t_plan = time.perf_counter()
    if keep is not None:
        predicate = _only(model, keep, predicate)
    planned = plan_dedicated(
        model,
        world_size=shard,
        replicate_size=replicate_size,
        predicate=predicate,
        hook_boundary_predicate=hook_boundary_predicate,
        layer_id_fn=layer_id_fn,
        tp_size=tp_size,
        tp_shard_dims=_tp_shard_dims(model) if tp_size > 1 else None,
        split_size=split_size,
        ns=plan_ns,
        base_loads=base_loads,
    )
    plan_s = time.perf_counter() - t_plan
    if ep is not None and ep > 1:
        stacks = [
            x.fqn for x in planned.specs if x.layout is not None and x.layout.kind == "experts"
        ]
        if stacks:  # dedicate_params refuses an expert-parallel (DTensor) stack the same way
            raise ValueError(
                f"dry_run: ep={ep}: the predicate dedicates expert stacks ({stacks[0]}"
                + (f" and {len(stacks) - 1} more" if len(stacks) > 1 else "")
                + "), but an expert-parallel stack cannot be dedicated: leave expert stacks out "
                "of the predicate (the default does) or drop ep"
            )
    R, S, T = replicate_size, shard, tp_size
    rows = [RankRow(g) for g in range(world_size)]
    policy = ParamPolicy(MixedPrecision(param_dtype, reduce_dtype))
    unshards = 2 if reshard_after_forward else 1
    notes: list[str] = []
    per_shard = _PerShard(S)  # what depends on a rank's shard coordinate only

    def gpu(d: int, t: int) -> int:  # data-parallel index d = r · S + s, TP rank t
        return d * T + t

    def add_ns(g: int, shape, count: int, expert: bool = False) -> None:
        b = rows[g]._buckets
        b[shape] = b.get(shape, 0) + count
        if expert:
            rows[g].expert_matrices += count
            b = rows[g]._expert_buckets
            b[shape] = b.get(shape, 0) + count

    if momentum.offload == "state":  # as Muon refuses it (distributed/_owner/host_masters.py)
        _check_state_offload(planned, policy)

    # -- dedicated weights: owned state, NS and the hook groups' collectives
    specs = {s.fqn: s for s in planned.specs}
    params = dict(planned.selected)
    split_rows = []
    plan = planned.plan
    entries = plan.entries if plan is not None else []
    tp_owner = planned.tp_owners.tp_owner if planned.tp_owners is not None else {}
    tp_local = planned.tp_owners.local if planned.tp_owners is not None else set()
    shard_dims = _tp_shard_dims(model) if T > 1 else {}
    groups: dict[tuple, list[tuple[str, int, int]]] = {}  # key -> [(fqn, shard owner, numel)]
    column_numel: dict[tuple, dict[tuple[int, int], int]] = {}  # per group: (shard, rep) -> n
    ns_loads: dict[int, int] = {}  # rank -> ns_cost of its dedicated weights (the expert walk's)
    for e in entries:
        spec, p = specs[e.fqn], params[e.fqn]
        item = spec.itemsize
        tp = e.fqn in planned.tp_fqns
        local = spec.numel // T if tp else spec.numel
        rep_owner, s_owner = divmod(e.owner, S)
        cdt, rdt = resolve_dtypes(p.dtype, policy, None)
        citem, ritem = _itemsize(cdt), _itemsize(rdt or cdt)
        key = (planned.boundaries[e.fqn][0], cdt, rdt)
        groups.setdefault(key, []).append((e.fqn, s_owner, local))
        col = column_numel.setdefault((key, citem, ritem), {})
        col[(s_owner, rep_owner)] = col.get((s_owner, rep_owner), 0) + local
        for t in range(T):  # TP: every rank of the owner's TP group holds its shard (or copy)
            g = gpu(e.owner, t)
            column = R > 1 and cdt != p.dtype  # the owner's column buffer, beside its master
            momentum.charge_master(_adder(rows[g]), local, item, citem, column)
            momentum.charge(_adder(rows[g]), "dedicated_bytes", local, item)
            rows[g].grad_bytes += local * item
            if R > 1:  # the owner column's copies: one per other replica
                for r in range(R):
                    if r != rep_owner:
                        rows[gpu(r * S + s_owner, t)].replica_bytes += local * citem
                if column:  # (offload="state": it is the compute copy)
                    rows[g].replica_bytes += local * citem
        shape, count = spec.matrix_shape, spec.matrix_count
        if T == 1:  # the owner DTensor's one-rank mesh, as the expert stage reads it
            ns_loads[e.owner] = ns_loads.get(e.owner, 0) + ns_cost(shape) * count
        split = tuple(e.split_ranks)
        if not split and not tp:  # stepped by the optimizer itself: the owner (TP: TP rank 0)
            momentum.charge_kept(_adder(rows[gpu(e.owner, 0)]), local, item)
        if split:  # NS over the aligned block of data-parallel ranks, owner first
            share = (
                rates.call_ms
                + useful_flops(*shape, rate_ns) / len(split) / (rates.rate(min(shape)) * 1e12) * 1e3
            )
            for d in split:
                g = gpu(d, 0)
                rows[g].ns_ms += share
                rows[g].matrices += 1
                rows[g]._elements += spec.numel // len(split)
                rows[g].step_extra_bytes += spec.numel // len(split) * NS_WORK_ITEMSIZE
            split_rows.append(
                {
                    "fqn": e.fqn,
                    "shape": list(spec.shape),
                    "ranks": [gpu(d, 0) for d in split],
                    "ns_ms_per_rank": share,
                    "ns_ms_one_rank": rates.call_ms_of(shape, count, rate_ns),
                }
            )
            _split_comm(rows, split, spec, rate_ns, gpu)
        elif e.fqn in tp_local:  # each TP rank of the column runs its shard's whole heads
            pieces = local_shard_layouts(spec, shard_dims[e.fqn], T)
            for t, (lay, piece) in enumerate(pieces):
                add_ns(gpu(e.owner, t), lay.stacked_shape(piece), lay.count(piece))
                rows[gpu(e.owner, t)].matrices += 1
        else:
            # TP matrix: whole-matrix NS on its TP owner; a plain matrix of a TP model: TP rank
            # 0 of the column runs it and broadcasts weight and momentum to the others.
            t_ns = tp_owner.get(e.fqn, 0)
            add_ns(gpu(e.owner, t_ns), shape, count)
            rows[gpu(e.owner, t_ns)].matrices += 1
            if T > 1:
                for t in range(T):
                    if t == t_ns:
                        continue
                    g = gpu(e.owner, t)
                    if tp:  # gather u_t shard (fp32) to the TP owner, update shard back
                        rows[g].tp_comm_bytes += local * 4 + local * item
                        rows[gpu(e.owner, t_ns)].tp_comm_bytes += local * 4 + local * item
                    else:
                        rows[g].tp_comm_bytes += 2 * spec.numel * item
    _dedicated_comm(per_shard, groups, column_numel, R, S, unshards)

    # -- everything else stays on FSDP2: AdamW, and Muon on expert stacks (per expert)
    dedicated = set(params)
    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)
    adamw_params = sharded_muon_params = 0
    padding: list[str] = []
    ep_stacks: list[tuple[str, int, int]] = []  # (fqn, experts, expert FSDP shard dim)
    walk = ExpertWalk(ns_loads)
    ctx = _EPContext(ep, S, R, rows, per_shard, gpu, add_ns, rates, stack_cap, rate_ns, walk)
    ctx.momentum = momentum
    ctx.once = expert_ns == "once" and R > 1  # one replica: nothing to split
    citem_default = _itemsize(param_dtype) if param_dtype is not None else None
    for pname, p in model.named_parameters():
        if pname in dedicated or not p.requires_grad or (keep is not None and pname not in keep):
            continue
        module = routing_module(module_of.get(id(p), []))
        layout = (get_layout(p) or infer_layout(pname, p, module)) if p.ndim >= 2 else None
        muon = (
            layout is not None
            and layout.kind == "experts"
            and default_muon_predicate(pname, p, module)
        )
        item = p.element_size()
        citem = citem_default or item
        ritem = _itemsize(reduce_dtype) if reduce_dtype is not None else citem
        dim0 = int(p.shape[0]) if p.ndim else 1
        rest = p.numel() // dim0 if dim0 else 0
        chunk = -(-dim0 // S)  # FSDP2 Shard(0): torch.chunk's rows per rank, last ones fewer
        if muon:
            sharded_muon_params += p.numel()
        else:
            adamw_params += p.numel()
        if muon and ep is not None:
            dim = _ep_stack(ctx, pname, p, layout, expert_shard_dim, unshards, citem, ritem)
            ep_stacks.append((pname, int(p.shape[0]), dim))
            continue
        # Per shard coordinate: ranks [0, full) hold ``chunk`` rows, rank ``full`` the rest.
        full, last = divmod(dim0, chunk) if chunk else (0, 0)
        padded = chunk * rest
        per_shard.add_all(
            "fsdp_comm_bytes",
            (S - 1) * padded * (unshards * citem + ritem)
            + 2 * (R - 1) * padded * ritem // R,  # HSDP: all-reduce over the replicas
        )
        state = "sharded_muon_bytes" if muon else "adamw_bytes"
        for lo, hi, n_rows in ((0, full, chunk), (full, full + 1 if last else full, last)):
            per_shard.add_range("grad_bytes", lo, hi, n_rows * rest * item)
            # weight + momentum (the rank's shard is one tensor); weight + exp_avg + exp_avg_sq
            per_shard.add_range(state, lo, hi, n_rows * rest * (item if muon else 3 * item))
            if muon and lo < hi:
                momentum.charge(per_shard.adder(lo, hi), state, n_rows * rest, item)
                if not ctx.once:  # whole experts stepped where they lie, not in the stage
                    momentum.charge_kept(per_shard.adder(lo, hi), n_rows * rest, item)
                matrices = layout.count((n_rows, *p.shape[1:]))
                shape = layout.stacked_shape(p.shape)
                for s in range(lo, min(hi, S)):
                    if ctx.once:  # the replicas split the shard's whole experts
                        a, b = int(p.shape[1]), rest // int(p.shape[1])
                        for t in range(T):
                            members = [gpu(r * S + s, t) for r in range(R)]
                            whole_experts_once(ctx, members, n_rows, a, b, item, layout, shape)
                        continue
                    for r in range(R):
                        for t in range(T):
                            add_ns(gpu(r * S + s, t), shape, matrices, True)
        if muon and padded * S > 1.25 * p.numel():
            padding.append(pname)
    per_shard.apply(rows, S, T)
    expert_layout = None
    if ep is not None:
        if not ep_stacks and keep is None:  # a pipeline stage may have none: checked whole
            raise ValueError(
                f"dry_run: ep={ep}, but the model has no expert stacks left to FSDP2/EP (3-D "
                "parameters of an *Experts module such as torchtitan's GroupedExperts, or "
                "declared with dmuon.set_layout(p, dmuon.Layout.experts())): drop ep/--ep for a "
                "dense model"
            )
        resharded = sum(1 for _, _, d in ep_stacks if d)
        expert_layout = {
            "ep": ep,
            "efsdp": S // ep,
            "experts": sorted({e for _, e, _ in ep_stacks}),
            "local_experts": sorted({e // ep for _, e, _ in ep_stacks}),
            "shard_dims": sorted({d for _, _, d in ep_stacks}),
            "stacks": len(ep_stacks),
            "resharded_stacks": resharded,
            "ranks_with_experts": sum(1 for r in rows if r.expert_matrices),
        }
        if ctx.once and ep_stacks:
            expert_layout["expert_ns"] = "once"
        if ctx.padding:
            notes.append(
                f"{len(ctx.padding)} expert stacks are cut unevenly over the {S // ep} expert-"
                f"FSDP ranks (e.g. {ctx.padding[0]}): FSDP2 pads each rank's chunk, so its "
                "collectives move padding too"
            )
        if resharded:
            notes.append(
                f"{resharded} expert stacks are sharded inside their experts (efsdp · ep > "
                "experts, as torchtitan picks): each step all-to-alls them over efsdp to "
                "whole experts (each rank a share of its EP rank's experts; the stacks in "
                "batches of at most the stack cap, one all-to-all each way per batch), runs "
                "their NS (one eager call per batch and shape) and all-to-alls the result "
                "back ('reshard' column)"
            )
    if padding:
        notes.append(
            f"{len(padding)} FSDP2 weights have fewer dim-0 rows than is even over {S} shard "
            f"ranks (e.g. {padding[0]}): FSDP2 pads each rank's chunk, so its collectives move "
            "padding too"
        )
    once = ctx.once and bool(sharded_muon_params)
    if once:
        notes.append(
            f"FSDP2-sharded expert stacks, expert_ns='once': the {R} replicas split each "
            "stack's whole experts (each expert orthogonalised once in the job, in the step's "
            "expert stage: one NS call per batch and shape) and one all-gather per batch over "
            "the replicate dim, in NS's 2-byte output dtype, gives every replica all the "
            "results ('replica gather' column, part of the HSDP traffic; each batch's under "
            "the next batch's NS, the last one's waited for in the step, not overlapped with "
            "the next forward)"
        )
    elif sharded_muon_params and R > 1:
        notes.append(
            "FSDP2-sharded expert stacks: every replica orthogonalises its own copy (R times "
            "the NS of one shard group)"
        )
    if T > 1:
        notes.append(
            "TP: the non-dedicated weights are counted TP-replicated (sharded over the shard "
            "dim only); a TP-sharded embedding or head holds 1/tp of that"
        )

    # -- NS ms, step ms and the step's working set from each rank's shape buckets
    finish_replica_gathers(ctx)
    finish_reshard_ns(rows, rates, stack_cap, rate_ns)
    # A plan with stages (TP, split NS, the expert reshard) materialises the momentum at once;
    # otherwise a stored momentum streams, an offloaded stream in buckets cut at the offload cap.
    staged = T > 1 or bool(split_rows) or ctx.once or any(d for _, _, d in ep_stacks)
    streamed = not staged and momentum.streaming
    ns_cap = stream_bucket_bytes(stack_cap, momentum.offload) if streamed else stack_cap
    factor = WORKING_SET_FACTOR["compiled" if compiled else "eager"]
    for row in rows:
        widest = 0
        for shape, count in row._buckets.items():
            row.ns_ms += rates.bucket_ms(shape, count, ns_cap, rate_ns)
            row._elements += count * shape[0] * shape[1]
            one = 4 * shape[0] * shape[1]
            per_stack = max(one, ns_cap // one * one)
            widest = max(widest, min(count * one, per_stack))
            row.step_extra_bytes += count * shape[0] * shape[1] * NS_WORK_ITEMSIZE
        row.step_extra_bytes += max(int(factor * widest), row._reshard_peak)
        for shape, count in row._expert_buckets.items():  # the experts' NS alone
            row.expert_ns_ms += rates.bucket_ms(shape, count, ns_cap, rate_ns)
        if row.ns_ms:
            row.step_ms = row.ns_ms + rates.elementwise_ms(row._elements) + rates.start_ms
    finish_kept(rows, rates)
    finish_rows(rows, momentum, streams=not staged, stack_cap=ns_cap)
    if plan is None and keep is None:
        notes.append("nothing matched the predicate: every parameter stays on FSDP2")
    report = DryRunReport(
        model=name,
        world_size=world_size,
        replicate_size=R,
        shard_size=S,
        tp_size=T,
        split_size=split_size,
        rows=rows,
        owners=planned.owners(),
        dedicated_matrices=len(entries),
        dedicated_params=sum(s.numel for s in planned.specs),
        adamw_params=adamw_params,
        sharded_muon_params=sharded_muon_params,
        split=split_rows,
        rates=rates.device,
        settings={
            "param_dtype": _dtype_name(param_dtype),
            "reduce_dtype": _dtype_name(reduce_dtype),
            **momentum.settings(),
            "step": "compiled" if compiled else "eager",
            "stack cap GiB": round(stack_cap / GiB, 2),
            "NS flops": "as a Triton GPU" if ns is None else type(ns).__name__,
            **({"expert NS": "once"} if once else {}),
        },
        plan_s=plan_s,
        notes=notes,
        ep=ep,
        expert_layout=expert_layout,
        offload=momentum.offload,
        expert_ns="once" if once else None,
    )
    report.total_s = time.perf_counter() - t_start
    return report, planned


def _dtype_name(dt) -> str:
    return "as stored" if dt is None else str(dt).replace("torch.", "")


# Row-parallel projections of torchtitan's and transformers' TP plans (Shard(1)); the other
# projections are column-parallel (Shard(0)).
_ROW_PARALLEL = ("o_proj", "down_proj", "wo", "w2")


def _tp_shard_dims(model: nn.Module) -> dict[str, int]:
    """Each 2-D weight's TP shard dim in the dry run's TP plan."""
    dims = {}
    for name, p in model.named_parameters():
        if p.ndim == 2:
            module = name.split(".")[-2] if "." in name else ""
            dims[name] = 1 if module in _ROW_PARALLEL else 0
    return dims


def _check_state_offload(planned, policy) -> None:
    """``offload="state"`` where ``Muon`` takes it (``state_offload_obstacles``: the same
    rules); else ``ValueError``."""
    from dmuon_compile.distributed._owner.host_masters import state_offload_obstacles
    from dmuon_compile.distributed.policy import resolve_dtypes

    same = [
        fqn
        for fqn, p in planned.selected
        if _itemsize(resolve_dtypes(p.dtype, policy, None)[0]) >= _itemsize(p.dtype)
    ]
    reasons = state_offload_obstacles(qk_clip=False, same_dtype=same)
    if reasons:
        raise ValueError(
            "dry_run: offload='state' is not available with "
            + "; ".join(reasons)
            + " (a bf16 --param-dtype): Muon refuses it there; use "
            "offload='momentum'"
        )


def _adder(row: RankRow):
    """``add(field, bytes)`` onto one rank's row (``MomentumCost.charge``'s way in)."""

    def add(name: str, value: int) -> None:
        setattr(row, name, getattr(row, name) + value)

    return add


class _PerShard:
    """Per-rank values that depend only on the rank's shard coordinate (the same in every
    replica and TP rank): a constant plus range additions, summed once at the end."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.const: dict[str, int] = {}
        self.diff: dict[str, list[int]] = {}

    def add_all(self, name: str, value: int) -> None:
        self.const[name] = self.const.get(name, 0) + value

    def add_range(self, name: str, lo: int, hi: int, value: int) -> None:
        hi = min(hi, self.shards)
        if lo < hi and value:
            d = self.diff.setdefault(name, [0] * (self.shards + 1))
            d[lo] += value
            d[hi] -= value

    def adder(self, lo: int, hi: int):
        """``add(field, bytes)`` onto the shard coordinates ``[lo, hi)``."""
        return lambda name, value: self.add_range(name, lo, hi, value)

    def apply(self, rows: list[RankRow], shards: int, tp: int) -> None:
        names = set(self.const) | set(self.diff)
        values = {}
        for name in names:
            acc, out = self.const.get(name, 0), []
            for d in self.diff.get(name, [0] * (shards + 1))[:shards]:
                acc += d
                out.append(acc)
            values[name] = out
        for row in rows:
            s = (row.rank // tp) % shards
            for name in names:
                setattr(row, name, getattr(row, name) + values[name][s])


def _dedicated_comm(per_shard: _PerShard, groups, column_numel, R, S, unshards) -> None:
    """Each hook group: one unshard all-gather (twice with ``reshard_after_forward``) and one
    gradient reduce-scatter over the shard group, owner-packed as ``DedicatedGroup.build``
    packs them (each rank receives the buffer less its own chunk); HSDP adds per group one
    reduce and one broadcast of this rank's column chunk over the replicate group."""
    from dmuon_compile.distributed._runtime.group import MAX_GATHER_PADDING

    for (key, citem, ritem), col in column_numel.items():
        chunk: dict[int, int] = {}
        for _fqn, s_owner, n in groups[key]:
            chunk[s_owner] = chunk.get(s_owner, 0) + n
        total, widest = sum(chunk.values()), max(chunk.values())
        per_byte = unshards * citem + ritem
        if S == 1:
            pass
        elif widest * S <= (1 + MAX_GATHER_PADDING) * total:  # padded all-gather
            per_shard.add_all("dedicated_comm_bytes", (S - 1) * widest * per_byte)
        else:  # uneven chunks: everything but its own
            per_shard.add_all("dedicated_comm_bytes", total * per_byte)
            for s, n in chunk.items():
                per_shard.add_range("dedicated_comm_bytes", s, s + 1, -n * per_byte)
        if R > 1:
            for (s_owner, _rep), n in col.items():
                per_shard.add_range(
                    "replicate_comm_bytes", s_owner, s_owner + 1, n * (ritem + citem)
                )


def _split_comm(rows, split, spec, ns, gpu) -> None:
    """A split matrix's collectives inside its group (``split_ns.split_flops``: the m×m
    all-reduces and row all-gathers), and its pieces' scatter/gather from the owner (fp32)."""
    from dmuon_compile.distributed import split_ns
    from dmuon_compile.newton_schulz import NewtonSchulz

    cost = split_ns.split_flops(spec.shape, len(split), ns or NewtonSchulz(), "cuda")
    inside = cost.all_reduce_bytes + cost.all_gather_bytes
    piece = spec.numel * 4 // len(split)
    for d in split:
        rows[gpu(d, 0)].split_comm_bytes += inside + (2 * piece if d != split[0] else 0)


def _only(model: nn.Module, keep: set[str], predicate):
    """``predicate`` (``None``: ``dedicate_params``' default) restricted to ``keep``."""
    from dmuon_compile.distributed.dedicate import _call_predicate

    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)

    def in_stage(name, param):
        if name not in keep:
            return False
        return _call_predicate(predicate, name, param, module_of.get(id(param), []))

    return in_stage
