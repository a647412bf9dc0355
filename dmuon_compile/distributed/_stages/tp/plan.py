"""Owners of a TP model's dedicated weights over the DP × TP slots: LPT on whole-matrix
Newton–Schulz costs (:func:`plan_tp_owners`), and the balance of the result (:class:`TPOwners`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dmuon_compile.distributed.owner_plan import (
    MatrixSpec,
    OwnerPlan,
    PlanEntry,
    default_layer_key,
    improve_some,
    ns_cost_fn,
)
from dmuon_compile.layouts import block_shard_layouts


@dataclass
class TPOwners:
    """Owners over the DP × TP slots: ``slot = dp_index * tp_size + tp_rank``."""

    dp_size: int
    tp_size: int
    tp_owner: dict[str, int] = field(default_factory=dict)  # TP matrices only: t*
    slot_flops: list[float] = field(default_factory=list)
    matrix_flops: list[float] = field(default_factory=list)  # gathered TP matrices (one slot)
    # TP matrices whose shards hold whole blocks (heads): each member of the owner column runs
    # its own blocks, so they load every slot of the column (``TPStage``'s local path).
    local: set[str] = field(default_factory=set)

    def lower_bound(self) -> float:
        """A lower bound on the most loaded slot of *any* plan with whole matrices.

        ``max(mean, largest)``, and for two matrix costs ``a ≥ b``: below ``a + b`` a slot holds
        at most one matrix of cost ≥ a and then none ≥ b besides, and any other slot at most
        ``ceil((a+b)/b) − 1`` matrices of cost ≥ b; more matrices ≥ b than that allows force
        ``a + b`` (70B on 256 ranks: 240 MLP matrices each fill a slot, the 160 q/o cannot
        all pair up on the other 16, so the best plan puts one beside an MLP matrix).
        """
        loads, costs = self.slot_flops, sorted(self.matrix_flops, reverse=True)
        slots = len(loads)
        bound = max(sum(loads) / slots if slots else 0.0, costs[0] if costs else 0.0)
        distinct = sorted(set(costs), reverse=True)
        for i, a in enumerate(distinct):
            n_a = sum(1 for c in costs if c >= a)
            if n_a > slots:
                continue
            for b in distinct[i:]:
                if b <= 0 or a + b <= bound:
                    continue
                per_slot = -(-(a + b) // b) - 1
                if sum(1 for c in costs if c >= b) > n_a + (slots - n_a) * per_slot:
                    bound = a + b
        return bound

    def balance(self) -> dict[str, float]:
        loads = self.slot_flops
        mean = sum(loads) / len(loads) if loads else 0.0
        bound = self.lower_bound()
        return {
            "ns_max_over_mean": max(loads) / mean if mean else 1.0,
            "ns_max_over_lower_bound": max(loads) / bound if bound else 1.0,
            "best_possible_max_over_mean": bound / mean if mean else 1.0,
        }

    def digest_text(self) -> str:
        return repr(sorted(self.tp_owner.items())) + f"|{self.dp_size}x{self.tp_size}"


def plan_tp_owners(
    specs: list[MatrixSpec],
    dp_size: int,
    tp_size: int,
    tp_fqns: set[str],
    *,
    tp_shard_dims: dict[str, int] | None = None,
    ns=None,
    layer_id_fn=None,
    improve_rounds: int = 2000,
) -> tuple[OwnerPlan, TPOwners]:
    """LPT over the ``dp_size × tp_size`` slots; deterministic (a function of the specs).

    ``specs`` carry *global* shapes (the NS cost is that of all the matrix's blocks: heads,
    experts). A matrix in ``tp_fqns`` takes one slot ``(d, t*)`` (its owner gathers it); one
    whose TP shards hold whole blocks (its layout cut along its shard dim in
    ``tp_shard_dims``: ``layouts.block_shard_layouts``) loads each slot ``(d, t)`` of one DP
    column with the blocks of shard ``t``; any other matrix takes its cost on all ``tp_size``
    slots of one DP column ``d``. Returns the DP plan (owner = ``d``, what the DP machinery
    uses) and the TP plan (``t*`` per TP matrix, the slot loads).

    >>> from dmuon_compile.distributed.owner_plan import llama_matrix_specs
    >>> specs = llama_matrix_specs(4, 64, 256, 64)
    >>> dp, tp = plan_tp_owners(specs, 2, 2, {s.fqn for s in specs})
    >>> round(tp.balance()["ns_max_over_lower_bound"], 2) <= 1.05
    True
    """
    flops_of = ns_cost_fn(ns)
    specs = sorted(specs, key=lambda s: s.fqn)
    layer_of = layer_id_fn or default_layer_key
    layers = [str(layer_of(s.fqn) or default_layer_key(s.fqn)) for s in specs]
    flops = [float(s.matrix_count * flops_of(*s.matrix_shape)) for s in specs]
    sizes = [s.numel * s.itemsize for s in specs]
    # Per slot of its column, the NS of the blocks a TP shard holds (where every shard holds
    # whole blocks, each member of the owner column runs its own: no gather).
    local: dict[int, list[float]] = {}
    for i, s in enumerate(specs):
        dim = (tp_shard_dims or {}).get(s.fqn)
        if s.fqn not in tp_fqns or dim is None:
            continue
        pieces = local_shard_layouts(s, dim, tp_size)
        if pieces is not None:
            local[i] = [
                float(lay.count(sh) * flops_of(*lay.stacked_shape(sh))) for lay, sh in pieces
            ]
    total = (
        sum(
            sum(local[i]) if i in local else f * (1 if s.fqn in tp_fqns else tp_size)
            for i, (f, s) in enumerate(zip(flops, specs))
        )
        or 1.0
    )
    cost = [f / total for f in flops]
    slots = dp_size * tp_size
    loads = [0.0] * slots
    column_bytes = [0] * dp_size
    layer_bytes: dict[str, list[int]] = defaultdict(lambda: [0] * dp_size)
    slot_of = [0] * len(specs)
    order = sorted(range(len(specs)), key=lambda i: (-cost[i], layers[i], specs[i].fqn))
    for i in order:
        lb = layer_bytes[layers[i]]
        if specs[i].fqn in tp_fqns and i not in local:
            low = min(loads)
            k = min(
                range(slots),
                key=lambda k: (
                    loads[k] > low * (1 + 1e-9) + 1e-15,
                    lb[k // tp_size],
                    column_bytes[k // tp_size],
                    k,
                ),
            )
            loads[k] += cost[i]
        else:  # every TP rank of column d runs NS: on its own copy, or on its shard's blocks
            share = [c / total for c in local[i]] if i in local else [cost[i]] * tp_size
            col = [
                max(x + c for x, c in zip(loads[d * tp_size : (d + 1) * tp_size], share))
                for d in range(dp_size)
            ]
            low = min(col)
            d = min(
                range(dp_size),
                key=lambda d: (col[d] > low * (1 + 1e-9) + 1e-15, lb[d], column_bytes[d], d),
            )
            k = d * tp_size
            for t in range(tp_size):
                loads[k + t] += share[t]
        slot_of[i] = k
        lb[k // tp_size] += sizes[i]
        column_bytes[k // tp_size] += sizes[i]
    # keep the plain matrices' columns fixed; move the TP ones only
    movable = [i for i, s in enumerate(specs) if s.fqn in tp_fqns and i not in local]
    improve_some(slot_of, cost, loads, improve_rounds, movable)
    entries = [
        PlanEntry(
            s.fqn,
            tuple(int(x) for x in s.shape),
            slot_of[i] // tp_size,
            layers[i],
            flops[i],
            sizes[i] // (tp_size if s.fqn in tp_fqns else 1),
        )
        for i, s in enumerate(specs)
    ]
    tp_owners = TPOwners(
        dp_size,
        tp_size,
        {s.fqn: slot_of[i] % tp_size for i, s in enumerate(specs) if s.fqn in tp_fqns},
        [x * total for x in loads],
        [f for i, (f, s) in enumerate(zip(flops, specs)) if s.fqn in tp_fqns and i not in local],
        {specs[i].fqn for i in local},
    )
    return OwnerPlan(world_size=dp_size, entries=entries), tp_owners


def local_shard_layouts(spec: MatrixSpec, dim: int, size: int):
    """Per TP shard of ``spec``'s matrix cut into ``size`` along ``dim``, ``(layout of its
    blocks, shard shape)`` when every shard holds whole blocks of its layout, else ``None``."""
    if spec.layout is None or len(spec.shape) != 2:
        return None
    layouts = block_shard_layouts(spec.layout, tuple(spec.shape), dim, size)
    if layouts is None:
        return None
    piece = list(spec.shape)
    piece[dim] //= size
    return [(lay, tuple(piece)) for lay in layouts]
