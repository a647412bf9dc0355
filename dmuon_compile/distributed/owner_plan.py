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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

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

    def ns_loads(self) -> list[float]:
        loads = [0.0] * self.world_size
        for e in self.entries:
            loads[e.owner] += e.ns_flops
        return loads

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
        biggest = max((e.ns_flops for e in self.entries), default=0.0)
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


def plan_owners(
    specs: Sequence[MatrixSpec],
    world_size: int,
    *,
    ns=None,
    layer_id_fn: Callable[[str], str | None] | None = None,
    bytes_weight: float = 0.0,
    improve_rounds: int = 2000,
) -> OwnerPlan:
    """Assign every matrix to one of ``world_size`` owners (LPT + improvement); deterministic.

    Args:
        specs: the dedicated matrices (order does not matter: the plan is sorted by name).
        world_size: number of ranks of the shard group.
        ns: the ``NewtonSchulz`` whose ``flops`` estimate the owner's compute.
        layer_id_fn: ``fqn -> layer id`` (``None`` → :func:`default_layer_key`); a user
            override for models whose layer stacks are named differently.
        bytes_weight: weight of bytes next to FLOPs in the LPT cost (both normalised; default 0:
            FLOPs decide, bytes break ties — NS FLOPs and bytes of Llama matrices correlate).
        improve_rounds: moves/swaps tried off the most loaded rank after LPT.

    Example::

        >>> plan = plan_owners([MatrixSpec("blocks.0.fc1.weight", (128, 512)),
        ...                     MatrixSpec("blocks.1.fc1.weight", (128, 512))], world_size=2)
        >>> sorted(plan.owners().values())
        [0, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
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
    flops = [float(s.matrix_count * flops_of(*s.matrix_shape)) for s in specs]
    sizes = [s.numel * s.itemsize for s in specs]
    total_f = sum(flops) or 1.0
    total_b = sum(sizes) or 1
    cost = [f / total_f + bytes_weight * b / total_b for f, b in zip(flops, sizes)]

    owner = [0] * len(specs)
    loads = [0.0] * world_size
    byte_loads = [0] * world_size
    layer_bytes: dict[str, list[int]] = defaultdict(lambda: [0] * world_size)
    order = sorted(range(len(specs)), key=lambda i: (-cost[i], layers[i], specs[i].fqn))
    for i in order:
        lb = layer_bytes[layers[i]]
        # Equal loads (within float noise) are ties: the layer's bytes decide, then the rank.
        low = min(loads)
        r = min(
            range(world_size),
            key=lambda k: (loads[k] > low * (1 + 1e-9) + 1e-15, lb[k], byte_loads[k], loads[k], k),
        )
        owner[i] = r
        loads[r] += cost[i]
        byte_loads[r] += sizes[i]
        lb[r] += sizes[i]
    improve_balance(owner, cost, loads, improve_rounds)

    entries = [
        PlanEntry(s.fqn, tuple(int(d) for d in s.shape), owner[i], layers[i], flops[i], sizes[i])
        for i, s in enumerate(specs)
    ]
    return OwnerPlan(world_size=world_size, entries=entries)


def improve_balance(owner: list[int], cost: list[float], loads: list[float], rounds: int) -> None:
    """Move or swap matrices off the most loaded rank while that lowers the maximum load."""
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
        members[hi].remove(i)
        members[dst].append(i)
        owner[i] = dst
        loads[hi] -= cost[i]
        loads[dst] += cost[i]
        if kind == "swap":
            members[dst].remove(j)
            members[hi].append(j)
            owner[j] = hi
            loads[dst] -= cost[j]
            loads[hi] += cost[j]


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
