"""Owner plan: which rank owns each dedicated matrix, and which hook group it travels in.

The plan is a pure function of the parameter list (names, shapes, dtypes), the world size and
the Newton–Schulz configuration, so every rank computes the same plan without talking to the
others; :func:`dmuon_compile.distributed.dedicate.dedicate_params` then all-gathers
:meth:`OwnerPlan.digest` once and fails loudly on a mismatch instead of hanging later in a
collective whose shapes differ across ranks.

Owners are chosen by LPT (longest processing time first): matrices sorted by estimated cost,
each given to the least-loaded rank. The cost is the NS FLOPs (``NewtonSchulz.flops``,
what the owner computes in ``step()``), optionally mixed with bytes (master weight + momentum +
gradient the owner holds), both normalised to their totals. Ties among equally loaded ranks go
to the rank that holds the fewest bytes of the same *layer*, then the fewest bytes overall
(``layers.N`` / ``blocks.N`` / ``h.N`` /
``layer.N``): that spreads each hook group's bytes, which keeps the owner-packed collectives
of a group even. A short improvement pass then moves or swaps matrices off the most loaded
rank while that lowers the maximum (LPT alone can be up to 4/3 off).

LPT keeps its tied ranks in heaps and the improvement finds a round's best move from the least
loaded rank (swaps: one vectorised pass), so 4096 ranks × 50k matrices plan in about a second;
``_plan_owners_reference`` / ``_improve_balance_reference`` keep the eager O(matrices × ranks)
algorithm, and a property test holds the two equal owner for owner.

A matrix too large for one rank's share can optionally run its Newton–Schulz across an aligned
group of ranks (``plan_owners(..., split_size=8)``; :attr:`PlanEntry.split_ranks`).

Several models planned over the same ranks (the pipeline stages one rank holds) are balanced
together by passing the NS loads of the plans made before as ``base_loads``: LPT and the
improvement start from them, so equal parts do not all put their larger share on the same ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from heapq import heapify, heappop, heappush

from dmuon_compile.layouts import Layout

_ONE_MATRIX = Layout.conv()  # (shape[0], prod(rest)): a 2-D shape as it is

# Container names whose next path component is a layer index: Llama/Mistral ``layers.N``,
# ViT/timm ``blocks.N`` (without it a ViT's blocks would collapse into one layer),
# GPT-2 ``h.N``, BERT ``layer.N``, and a few common spellings.
LAYER_CONTAINER_NAMES = (
    "layers",
    "blocks",
    "h",
    "layer",
    "block",
    "decoder_layers",
    "encoder_layers",
)
_INDEX = re.compile(r"^\d+$")


def extract_layer_id(fqn: str) -> str | None:
    """The layer prefix of a parameter FQN, or ``None`` when it has none.

    The *last* ``<container>.<index>`` pair wins, so nested stacks group by their innermost
    layer.

    >>> extract_layer_id("model.layers.3.self_attn.q_proj.weight")
    'model.layers.3'
    >>> extract_layer_id("blocks.11.attn.qkv.weight")
    'blocks.11'
    >>> extract_layer_id("transformer.h.0.mlp.c_fc.weight")
    'transformer.h.0'
    >>> extract_layer_id("encoder.layer.2.attention.self.query.weight")
    'encoder.layer.2'
    >>> extract_layer_id("lm_head.weight") is None
    True
    """
    parts = fqn.split(".")
    found = None
    for i in range(len(parts) - 1):
        if parts[i] in LAYER_CONTAINER_NAMES and _INDEX.match(parts[i + 1]):
            found = i + 2
    return ".".join(parts[:found]) if found is not None else None


def default_layer_key(fqn: str) -> str:
    """Layer id, or the parameter's grand-parent module path when the FQN has no layer index."""
    layer = extract_layer_id(fqn)
    if layer is not None:
        return layer
    parts = fqn.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else ""


@dataclass(frozen=True)
class MatrixSpec:
    """What the planner needs to know about one dedicated matrix (no tensor)."""

    fqn: str
    shape: tuple[int, ...]
    itemsize: int = 4  # bytes per element of the master weight
    # What its matrices are (an expert stack: E of them); None: one matrix, a ≥3-D shape
    # viewed as (shape[0], prod(rest)) (a conv kernel).
    layout: Layout | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The shape of each of its matrices, as Newton–Schulz sees it."""
        return (self.layout or _ONE_MATRIX).stacked_shape(self.shape)

    @property
    def matrix_count(self) -> int:
        return 1 if self.layout is None else self.layout.count(self.shape)


@dataclass
class PlanEntry:
    fqn: str
    shape: tuple[int, ...]
    owner: int
    layer: str
    ns_flops: float
    bytes: int
    # A split matrix (``plan_owners(split_size=...)``): the aligned block of ranks that run its
    # Newton–Schulz together, ``owner`` first; empty for a matrix one rank orthogonalises.
    split_ranks: tuple[int, ...] = ()


@dataclass
class OwnerPlan:
    """Owners of the dedicated matrices of one model over ``world_size`` ranks: one shard group,
    or with HSDP all ``replicate_size × shard_size`` ranks (owner = replica · shard_size + shard).

    Example::

        specs = [MatrixSpec(f"layers.{i}.w", (64, 256)) for i in range(8)]
        plan = plan_owners(specs, world_size=4)
        plan.owners()        # {'layers.0.w': 0, ...}
        plan.balance()       # {'ns_max_over_mean': 1.0, ...}
    """

    world_size: int
    entries: list[PlanEntry] = field(default_factory=list)
    # HSDP: owners are global indices ``replica * shard_size + shard`` over all
    # ``replicate_size × shard_size`` ranks (``world_size`` is their product).
    replicate_size: int = 1

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicate_size

    def placement(self, fqn: str) -> tuple[int, int]:
        """``(replicate rank, shard rank)`` of the owner of ``fqn`` (HSDP; ``(0, owner)`` in 1-D).

        >>> plan = plan_owners([MatrixSpec(f"layers.{i}.w", (8, 8)) for i in range(4)], 4)
        >>> plan.replicate_size = 2
        >>> sorted(plan.placement(f"layers.{i}.w") for i in range(4))
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        """
        owner = self.entry(fqn).owner
        return owner // self.shard_size, owner % self.shard_size

    def owners(self) -> dict[str, int]:
        return {e.fqn: e.owner for e in self.entries}

    def param_names(self) -> list[str]:
        return [e.fqn for e in self.entries]

    def entry(self, fqn: str) -> PlanEntry:
        for e in self.entries:
            if e.fqn == fqn:
                return e
        raise KeyError(fqn)

    def split_entries(self) -> list[PlanEntry]:
        """The entries whose Newton–Schulz runs across a group of ranks."""
        return [e for e in self.entries if e.split_ranks]

    def ns_loads(self) -> list[float]:
        """NS FLOPs per rank; a split matrix counts ``ns_flops / len(split_ranks)`` on each."""
        loads = [0.0] * self.world_size
        for e in self.entries:
            if e.split_ranks:
                for k in e.split_ranks:
                    loads[k] += e.ns_flops / len(e.split_ranks)
            else:
                loads[e.owner] += e.ns_flops
        return loads

    def idle_ranks(self) -> list[int]:
        """Ranks with no NS work (more ranks than matrices, or matrices too few to go round)."""
        return [k for k, load in enumerate(self.ns_loads()) if load == 0]

    def byte_loads(self) -> list[int]:
        loads = [0] * self.world_size
        for e in self.entries:
            loads[e.owner] += e.bytes
        return loads

    def balance(self) -> dict[str, float]:
        """Max/mean of NS FLOPs and bytes per owner, and max over the LPT lower bound."""
        ns, by = self.ns_loads(), self.byte_loads()
        ns_mean = sum(ns) / self.world_size if ns else 0.0
        by_mean = sum(by) / self.world_size if by else 0.0
        # A rank's largest indivisible piece: a split matrix's share of its group.
        biggest = max((e.ns_flops / max(1, len(e.split_ranks)) for e in self.entries), default=0.0)
        bound = max(ns_mean, biggest)
        return {
            "ns_max_over_mean": max(ns) / ns_mean if ns_mean else 1.0,
            "ns_max_over_lower_bound": max(ns) / bound if bound else 1.0,
            "bytes_max_over_mean": max(by) / by_mean if by_mean else 1.0,
        }

    def canonical(self) -> str:
        """A canonical JSON text of the plan (what :meth:`digest` hashes)."""
        rows = [
            [e.fqn, list(e.shape), e.owner, e.layer, round(float(e.ns_flops), 3), e.bytes]
            + ([list(e.split_ranks)] if e.split_ranks else [])  # unsplit rows keep their digest
            for e in self.entries
        ]
        head = {"world_size": self.world_size, "entries": rows}
        if self.replicate_size != 1:  # 1-D plans keep their digest
            head["replicate_size"] = self.replicate_size
        return json.dumps(head, sort_keys=True)

    def digest(self) -> str:
        """SHA-256 of :meth:`canonical`; equal on every rank iff the plans are equal."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "entries": [asdict(e) for e in self.entries],
        }


def ns_cost_fn(ns=None) -> Callable[[int, int], float]:
    """FLOPs of one orthogonalisation of an (m, n) matrix under ``ns`` (default NewtonSchulz())."""
    if ns is None:
        from dmuon_compile.newton_schulz import NewtonSchulz

        ns = NewtonSchulz()
    return ns.flops


# What a split matrix costs each rank of its group in the planner's accounting, over an even
# 1/split_size share of its NS: the group all-reduces an m×m Gram (or all-gathers m×m pieces)
# per iteration and waits for its slowest rank. An assumed 5%, not a measurement; the plan's
# ns_loads() report the FLOPs only (ns_flops / split_size on each rank).
SPLIT_NS_OVERHEAD = 0.05


def plan_owners(
    specs: Sequence[MatrixSpec],
    world_size: int,
    *,
    ns=None,
    layer_id_fn: Callable[[str], str | None] | None = None,
    bytes_weight: float = 0.0,
    improve_rounds: int = 2000,
    split_size: int = 1,
    base_loads: Sequence[float] | None = None,
) -> OwnerPlan:
    """Assign every matrix to one of ``world_size`` owners (LPT + improvement); deterministic.

    Runs in O(matrices · log ranks) (heaps; 4096 ranks × 50k matrices in about a second);
    :func:`_plan_owners_reference` is the eager O(matrices × ranks) algorithm it is tested equal
    to, owner for owner.

    Args:
        specs: the dedicated matrices (order does not matter: the plan is sorted by name).
        world_size: number of ranks of the shard group.
        ns: the ``NewtonSchulz`` whose ``flops`` estimate the owner's compute.
        layer_id_fn: ``fqn -> layer id`` (``None`` → :func:`default_layer_key`); a user
            override for models whose layer stacks are named differently.
        bytes_weight: weight of bytes next to FLOPs in the LPT cost (both normalised; default 0:
            FLOPs decide, bytes break ties — NS FLOPs and bytes of Llama matrices correlate).
        improve_rounds: moves/swaps tried off the most loaded rank after LPT.
        split_size: ranks per NS split group (default 1: never split, the plan is unchanged).
            With ``split_size > 1`` a single matrix (no ``layout``) whose NS FLOPs exceed the
            balanced share ``total / world_size`` runs its Newton–Schulz across the aligned
            block ``[g·split_size, (g+1)·split_size)`` (a node or TP group) with the least
            load: its entry's ``split_ranks`` lists the block, its ``owner`` is the block's
            first rank (which holds the weight and receives the gradient), and each rank of
            the block carries its NS cost ``/ split_size · (1 + SPLIT_NS_OVERHEAD)`` (its
            bytes stay on the owner). Split matrices stay in place in the improvement pass.
            ``world_size`` must be divisible by it.
        base_loads: NS FLOPs each rank already runs for matrices planned before over the
            same ranks (e.g. the sum of other parts' :meth:`OwnerPlan.ns_loads`), one finite
            value >= 0 per rank. The ranks start LPT and the improvement pass with these loads,
            so the plan balances the carried and the new work together (the maximum of their
            sum). Only FLOPs are carried: a ``bytes_weight`` term weighs this plan's bytes
            alone. The split threshold is the fair share of the sum. The plan holds ``specs``
            only (its ``ns_loads()`` and ``balance()`` leave the carried loads out). ``None``
            or all zeros: planned alone, the same plan as without it.

    Example::

        >>> plan = plan_owners([MatrixSpec("blocks.0.fc1.weight", (128, 512)),
        ...                     MatrixSpec("blocks.1.fc1.weight", (128, 512))], world_size=2)
        >>> sorted(plan.owners().values())
        [0, 1]
    """
    return _plan(
        specs,
        world_size,
        ns,
        layer_id_fn,
        bytes_weight,
        improve_rounds,
        split_size,
        base_loads,
        _assign_fast,
        improve_balance,
    )


def _plan_owners_reference(
    specs: Sequence[MatrixSpec],
    world_size: int,
    *,
    ns=None,
    layer_id_fn: Callable[[str], str | None] | None = None,
    bytes_weight: float = 0.0,
    improve_rounds: int = 2000,
    split_size: int = 1,
    base_loads: Sequence[float] | None = None,
) -> OwnerPlan:
    """The eager reference of :func:`plan_owners` (same arguments, same plan): every LPT step
    scans all ranks, every improvement round all (matrix, rank) pairs. O(matrices × ranks):
    minutes at 4096 ranks × 50k matrices; kept as the specification the fast planner is tested
    against (``tests/test_owner_plan_scale.py``)."""
    return _plan(
        specs,
        world_size,
        ns,
        layer_id_fn,
        bytes_weight,
        improve_rounds,
        split_size,
        base_loads,
        _assign_reference,
        _improve_balance_reference,
    )


def _plan(
    specs,
    world_size,
    ns,
    layer_id_fn,
    bytes_weight,
    improve_rounds,
    split_size,
    base_loads,
    assign,
    improve,
) -> OwnerPlan:
    """Costs, LPT order and entries (shared); ``assign`` (LPT) and ``improve`` do the placing."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if split_size < 1 or world_size % split_size:
        raise ValueError(
            f"plan_owners: split_size={split_size} must be >= 1 and divide world_size="
            f"{world_size} (a split group is an aligned block of ranks): pass a divisor of "
            "the world size (the ranks of a node or TP group), or split_size=1 to never split"
        )
    base = _check_base_loads(base_loads, world_size)
    flops_of = ns_cost_fn(ns)
    names = [s.fqn for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("plan_owners: duplicate parameter names in specs")
    specs = sorted(specs, key=lambda s: s.fqn)
    layer_of = layer_id_fn or default_layer_key
    layers = []
    for s in specs:
        layer = layer_of(s.fqn)
        layers.append(default_layer_key(s.fqn) if layer is None else str(layer))
    flops_by_shape: dict[tuple[int, int], float] = {}  # 50k experts are a handful of shapes
    flops = []
    for s in specs:
        shape = s.matrix_shape
        if shape not in flops_by_shape:
            flops_by_shape[shape] = flops_of(*shape)
        flops.append(float(s.matrix_count * flops_by_shape[shape]))
    sizes = [s.numel * s.itemsize for s in specs]
    total_f = sum(flops) or 1.0
    total_b = sum(sizes) or 1
    cost = [f / total_f + bytes_weight * b / total_b for f, b in zip(flops, sizes)]
    start = [b / total_f for b in base]  # the carried FLOPs in the units of ``cost``

    # Split matrices: (per-rank NS share on each rank of the group, bytes share on the owner).
    split: list[tuple[float, float] | None] = [None] * len(specs)
    if split_size > 1:
        fair = (total_f + sum(base)) / world_size
        for i, s in enumerate(specs):
            if s.layout is None and flops[i] > fair:
                ns_share = flops[i] / total_f * (1 + SPLIT_NS_OVERHEAD) / split_size
                split[i] = (ns_share, bytes_weight * sizes[i] / total_b)

    order = sorted(range(len(specs)), key=lambda i: (-cost[i], layers[i], specs[i].fqn))
    owner, loads = assign(order, cost, sizes, layers, split, start, split_size)
    # split matrices stay on their group; the others move around them
    movable = [i for i in range(len(specs)) if split[i] is None]
    improve_some(owner, cost, loads, improve_rounds, movable, improve)

    entries = [
        PlanEntry(
            s.fqn,
            tuple(int(d) for d in s.shape),
            owner[i],
            layers[i],
            flops[i],
            sizes[i],
            () if split[i] is None else tuple(range(owner[i], owner[i] + split_size)),
        )
        for i, s in enumerate(specs)
    ]
    return OwnerPlan(world_size=world_size, entries=entries)


def _check_base_loads(base_loads, world_size: int) -> list[float]:
    """``base_loads`` as floats, one per rank (zeros for ``None``); bad values raise."""
    if base_loads is None:
        return [0.0] * world_size
    base = [float(b) for b in base_loads]
    if len(base) != world_size:
        raise ValueError(
            f"plan_owners: base_loads has {len(base)} values for world_size={world_size}: pass "
            "one NS load per rank of this plan (e.g. another plan's ns_loads() over the same "
            "ranks), or None"
        )
    if not all(math.isfinite(b) and b >= 0 for b in base):
        raise ValueError(f"plan_owners: base_loads must be finite and >= 0, got {base}")
    return base


def _place_split(loads, layer_bytes_of, byte_loads, split_size, share) -> int:
    """Put a split matrix on the least-loaded aligned group; returns the group's first rank.

    Same tie rule as a single rank: groups whose peak load is within float noise of the lowest
    peak tie, and the first rank's bytes of the layer, then its bytes overall, decide.
    """
    ns_share, bytes_share = share
    starts = range(0, len(loads), split_size)
    peak = {g: max(loads[g : g + split_size]) for g in starts}
    low = min(peak.values())
    r = min(
        starts,
        key=lambda g: (
            peak[g] > low * (1 + 1e-9) + 1e-15,
            layer_bytes_of(g),
            byte_loads[g],
            peak[g],
            g,
        ),
    )
    for k in range(r, r + split_size):
        loads[k] += ns_share
    loads[r] += bytes_share  # the owner holds the bytes
    return r


def _assign_reference(order, cost, sizes, layers, split, start, split_size):
    """LPT, eager: each matrix to the rank with the least ``(tie, layer bytes, bytes, load,
    index)``, where ``tie`` is False for every rank within float noise of the lowest load.
    The ranks' loads start at ``start`` (carried loads; zeros when planned alone)."""
    world_size = len(start)
    owner = [0] * len(cost)
    loads = list(start)
    byte_loads = [0] * world_size
    layer_bytes: dict[str, list[int]] = defaultdict(lambda: [0] * world_size)
    for i in order:
        lb = layer_bytes[layers[i]]
        if split[i] is not None:
            r = _place_split(loads, lb.__getitem__, byte_loads, split_size, split[i])
        else:
            # Equal loads (within float noise) are ties: the layer's bytes decide, then the rank.
            low = min(loads)
            r = min(
                range(world_size),
                key=lambda k: (
                    loads[k] > low * (1 + 1e-9) + 1e-15,
                    lb[k],
                    byte_loads[k],
                    loads[k],
                    k,
                ),
            )
            loads[r] += cost[i]
        owner[i] = r
        byte_loads[r] += sizes[i]
        lb[r] += sizes[i]
    return owner, loads


def _assign_fast(order, cost, sizes, layers, split, start, split_size):
    """:func:`_assign_reference` with heaps: O(log ranks) per matrix instead of O(ranks).

    The tie set ``T`` (ranks with ``load <= low·(1+1e-9) + 1e-15``) only grows as ``low``
    rises, except for the rank just chosen, so it is kept incrementally: ``outside`` holds the
    other ranks by load and feeds ``T`` when the threshold passes them. Inside ``T``, a rank
    holding none of the current layer's bytes beats every rank holding some (layer bytes are
    >= 0), so ``free`` orders ``T`` by ``(bytes, load, index)`` and ``parked`` holds the members
    of ``T`` found to hold bytes of the current layer, by the full key; they go back to ``free``
    when the layer changes. Keys inside ``T`` only change for the chosen rank, which is popped,
    so the heaps need no deletion. A split matrix touches several ranks: it is placed eagerly
    and the heaps are rebuilt (there are fewer of them than ranks).
    """
    if not all(math.isfinite(c) and c >= 0 for c in cost) or any(b < 0 for b in sizes):
        # The incremental tie set needs loads that only grow.
        return _assign_reference(order, cost, sizes, layers, split, start, split_size)
    world_size = len(start)
    owner = [0] * len(cost)
    loads = list(start)
    byte_loads = [0] * world_size
    layer_bytes: dict[str, dict[int, int]] = {}  # sparse: 7k layers × 4096 ranks otherwise
    lowest = [(load, k) for k, load in enumerate(loads)]  # every rank's load, stale lazily
    heapify(lowest)
    outside = list(lowest)  # ranks not in T, by load
    free: list[tuple] = []  # T without the current layer: (bytes, load, rank)
    parked: list[tuple] = []  # T holding the current layer: (layer bytes, bytes, load, rank)
    layer = None
    lb: dict[int, int] = {}
    for i in order:
        if layers[i] != layer:
            layer = layers[i]
            lb = layer_bytes.setdefault(layer, {})
            for entry in parked:
                heappush(free, entry[1:])
            parked = []
        if split[i] is not None:
            r = _place_split(loads, lambda k: lb.get(k, 0), byte_loads, split_size, split[i])
            owner[i] = r
            byte_loads[r] += sizes[i]
            lb[r] = lb.get(r, 0) + sizes[i]
            outside = [(load, k) for k, load in enumerate(loads)]
            heapify(outside)
            lowest, free, parked = list(outside), [], []
            continue
        while lowest[0][0] != loads[lowest[0][1]]:
            heappop(lowest)
        threshold = lowest[0][0] * (1 + 1e-9) + 1e-15
        while outside and outside[0][0] <= threshold:
            load, k = heappop(outside)
            held = lb.get(k, 0)
            if held > 0:
                heappush(parked, (held, byte_loads[k], load, k))
            else:
                heappush(free, (byte_loads[k], load, k))
        while free and lb.get(free[0][2], 0) > 0:
            entry = heappop(free)
            heappush(parked, (lb[entry[2]], *entry))
        r = heappop(free)[2] if free else heappop(parked)[3]
        owner[i] = r
        loads[r] += cost[i]
        byte_loads[r] += sizes[i]
        held = lb[r] = lb.get(r, 0) + sizes[i]
        load = loads[r]
        heappush(lowest, (load, r))
        if load > threshold:
            heappush(outside, (load, r))
        elif held > 0:
            heappush(parked, (held, byte_loads[r], load, r))
        else:
            heappush(free, (byte_loads[r], load, r))
    return owner, loads


def _improve_balance_reference(
    owner: list[int], cost: list[float], loads: list[float], rounds: int
) -> None:
    """The eager reference of :func:`improve_balance`: each round scans every move (matrix of the
    most loaded rank ``hi`` × destination) and, if none lowers the maximum, every swap; the first
    best found (strict ``<``, ``members[hi]`` order, then destination, then its members) wins."""
    world = len(loads)
    if world < 2:
        return
    members: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(owner):
        members[r].append(i)
    for _ in range(rounds):
        hi = max(range(world), key=lambda k: (loads[k], -k))
        best = None  # (new max of the pair, kind, i, j, dst)
        for i in members[hi]:
            for dst in range(world):
                if dst == hi:
                    continue
                # move i: hi → dst
                new_pair = max(loads[hi] - cost[i], loads[dst] + cost[i])
                if new_pair < loads[hi] - 1e-12 and (best is None or new_pair < best[0]):
                    best = (new_pair, "move", i, None, dst)
        if best is None:
            for i in members[hi]:
                for dst in range(world):
                    if dst == hi:
                        continue
                    for j in members[dst]:
                        delta = cost[i] - cost[j]
                        if delta <= 0:
                            continue
                        new_pair = max(loads[hi] - delta, loads[dst] + delta)
                        if new_pair < loads[hi] - 1e-12 and (best is None or new_pair < best[0]):
                            best = (new_pair, "swap", i, j, dst)
        if best is None:
            return
        _, kind, i, j, dst = best
        _apply(members, owner, cost, loads, hi, i, dst, j if kind == "swap" else None)


def _apply(members, owner, cost, loads, hi, i, dst, j) -> None:
    """Move ``i`` from ``hi`` to ``dst`` and, for a swap, ``j`` back (the reference's order)."""
    members[hi].remove(i)
    members[dst].append(i)
    owner[i] = dst
    loads[hi] -= cost[i]
    loads[dst] += cost[i]
    if j is not None:
        members[dst].remove(j)
        members[hi].append(j)
        owner[j] = hi
        loads[dst] -= cost[j]
        loads[hi] += cost[j]


def improve_some(owner, cost, loads, rounds: int, movable: list[int], improve=None) -> None:
    """``improve`` (default :func:`improve_balance`) moving only the matrices ``movable``; the
    others keep their owners (their costs stay in ``loads``)."""
    improve = improve or improve_balance
    if not movable:
        return
    if len(movable) == len(owner):
        improve(owner, cost, loads, rounds)
        return
    sub_owner = [owner[i] for i in movable]
    improve(sub_owner, [cost[i] for i in movable], loads, rounds)
    for i, r in zip(movable, sub_owner):
        owner[i] = r


def improve_balance(owner: list[int], cost: list[float], loads: list[float], rounds: int) -> None:
    """Move or swap matrices off the most loaded rank while that lowers the maximum load.

    In place, exactly :func:`_improve_balance_reference` (same moves, same float sums), without
    its all-pairs scans. A move of ``i`` to ``dst`` gives ``max(L_hi − c_i, L_dst + c_i)``, which
    is monotone in ``L_dst``: matrix ``i``'s best is at the least-loaded other rank ``m``, and
    its first best destination is the first rank with ``L_dst + c_i <= best`` (the same float
    expression). Matrices of equal cost give equal candidates, so only the first of each cost
    is scanned. Swaps are tried, as in the reference, only when no move helps: one vectorised
    pass over all other matrices per distinct cost on ``hi``.
    """
    world = len(loads)
    if world < 2:
        return
    if not (
        all(math.isfinite(x) for x in loads)
        and all(math.isfinite(c) for c in cost)
        and all(0 <= r < world for r in owner)
    ):
        return _improve_balance_reference(owner, cost, loads, rounds)
    import torch  # here, not at the top: the plan's data types need none of it

    members: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(owner):
        members[r].append(i)
    load_arr = torch.tensor(loads, dtype=torch.float64)
    cost_arr = torch.tensor(cost, dtype=torch.float64)
    owner_arr = torch.tensor(owner, dtype=torch.int64)
    for _ in range(rounds):
        hi = int(torch.argmax(load_arr))  # the first of the most loaded: max of (load, -rank)
        top = loads[hi]
        limit = top - 1e-12
        others = load_arr.clone()
        others[hi] = math.inf  # never a destination
        least = float(others.min())
        best = None  # (new max of the pair, i)
        seen = set()
        for i in members[hi]:
            c = cost[i]
            if c in seen:
                continue
            seen.add(c)
            new_pair = max(top - c, least + c)
            if new_pair < limit and (best is None or new_pair < best[0]):
                best = (new_pair, i)
        if best is not None:
            new_pair, i = best
            dst = int(torch.nonzero(others + cost[i] <= new_pair)[0, 0])
            j = None
        else:
            best = _best_swap(members, cost, hi, top, limit, load_arr, cost_arr, owner_arr)
            if best is None:
                return
            i, j, dst = best
        _apply(members, owner, cost, loads, hi, i, dst, j)
        for k in (hi, dst):
            load_arr[k] = loads[k]
        owner_arr[i] = dst
        if j is not None:
            owner_arr[j] = hi


def _best_swap(members, cost, hi, top, limit, load_arr, cost_arr, owner_arr):
    """The reference's swap choice, ``(i, j, dst)`` or None: for each distinct cost on ``hi`` (in
    ``members[hi]`` order) all swaps at once, then the first of the best in the reference's
    order (destination ascending, then its members' order)."""
    import torch

    pair_load = load_arr[owner_arr]  # L_dst of every matrix j
    elsewhere = owner_arr != hi
    best = None  # (new max, i, mask of the j that reach it)
    seen = set()
    for i in members[hi]:
        c = cost[i]
        if c in seen:
            continue
        seen.add(c)
        delta = c - cost_arr
        new_pair = torch.maximum(top - delta, pair_load + delta)
        ok = elsewhere & (delta > 0) & (new_pair < limit)
        if not bool(ok.any()):
            continue
        value = float(new_pair[ok].min())
        if best is None or value < best[0]:
            best = (value, i, ok & (new_pair == value))
    if best is None:
        return None
    _, i, reach = best
    dst = int(owner_arr[reach].min())
    j = next(j for j in members[dst] if bool(reach[j]))
    return i, j, dst


def llama_matrix_specs(
    layers: int, dim: int, ffn: int, kv_dim: int, prefix: str = "model.layers"
) -> list[MatrixSpec]:
    """Synthetic Llama matrix list (q/k/v/o, gate/up/down per layer) for planning studies."""
    shapes = {
        "self_attn.q_proj.weight": (dim, dim),
        "self_attn.k_proj.weight": (kv_dim, dim),
        "self_attn.v_proj.weight": (kv_dim, dim),
        "self_attn.o_proj.weight": (dim, dim),
        "mlp.gate_proj.weight": (ffn, dim),
        "mlp.up_proj.weight": (ffn, dim),
        "mlp.down_proj.weight": (dim, ffn),
    }
    return [MatrixSpec(f"{prefix}.{i}.{k}", v) for i in range(layers) for k, v in shapes.items()]
