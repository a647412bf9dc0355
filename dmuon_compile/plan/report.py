"""The dry run's report: one :class:`RankRow` per rank and :class:`DryRunReport` (table, JSON)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

GiB = 1 << 30
# The compiled step holds about one stack's fp32 working set above the directions, eager about
# two (an upper bound of benchmarks/step_memory.py's ratio, for the peak estimate).
WORKING_SET_FACTOR = {"compiled": 1.0, "eager": 2.0}
NS_WORK_ITEMSIZE = 2  # the directions live in NS's fp16/bf16 work dtype until the commit


# ----------------------------------------------------------------------------- the report
@dataclass
class RankRow:
    """One GPU rank's prediction (bytes; ms per step). ``rank`` is the global rank in the
    ``(replicate, shard, tp)`` mesh order: ``(r · shard_size + s) · tp_size + t``."""

    rank: int
    matrices: int = 0  # dedicated matrices (or TP/split pieces) this rank runs NS on
    dedicated_bytes: int = 0  # owned dedicated masters + momentum (TP: its shards)
    replica_bytes: int = 0  # HSDP column copies (compute dtype), beyond its own masters
    sharded_muon_bytes: int = 0  # FSDP2-sharded Muon weights (expert stacks) + momentum
    adamw_bytes: int = 0  # FSDP2-sharded AdamW weights + exp_avg + exp_avg_sq
    grad_bytes: int = 0  # gradients of what this rank steps
    # directions + one stack's working set (+ the momentum's working buffers, 8-bit/offload;
    # + buf′ of the matrices it steps itself, keep_new_momentum)
    step_extra_bytes: int = 0
    ns_ms: float = 0.0
    step_ms: float = 0.0
    fsdp_comm_bytes: int = 0
    dedicated_comm_bytes: int = 0
    replicate_comm_bytes: int = 0  # over the replicate dim (HSDP's column reduce/broadcast, ...)
    tp_comm_bytes: int = 0
    split_comm_bytes: int = 0  # split NS: inside the group, and the pieces to/from the owner
    # Expert stacks left to FSDP2 / EP (part of the columns above): the per-expert matrices this
    # rank orthogonalises (whole experts, after the reshard of a stack sharded inside its
    # experts), their NS ms alone, and that reshard's traffic (also in ``comm_bytes``).
    expert_matrices: int = 0
    expert_ns_ms: float = 0.0
    expert_reshard_comm_bytes: int = 0
    # ``expert_ns="once"`` under HSDP: the all-gather of the replicas' shares of the whole
    # experts' NS results (part of ``replicate_comm_bytes``; JSON only with "once").
    expert_gather_comm_bytes: int = 0
    # offload: the Muon momentum this rank keeps in pinned host memory (out of the columns
    # above; "state": its owned masters too), and what crosses the host link per step (copied
    # in + written back).
    host_bytes: int = 0
    host_link_bytes: int = 0
    _elements: int = field(default=0, repr=False)
    _buckets: dict = field(default_factory=dict, repr=False)
    _expert_buckets: dict = field(default_factory=dict, repr=False)
    _reshard_peak: int = field(default=0, repr=False)  # largest reshard transient (bytes)
    # the expert reshard's batches: (batch, shape) -> whole experts; batch -> transient bytes
    _reshard_calls: dict = field(default_factory=dict, repr=False)
    _reshard_bytes: dict = field(default_factory=dict, repr=False)
    # expert_ns="once": batch -> its all-gather's buffers (in flight under the next batch's NS)
    _gather_in_flight: dict = field(default_factory=dict, repr=False)
    # The Muon momentum (8-bit, offload; the storage note's): its stored bytes on the GPU, its
    # working buffers (all the rank's; with PP the largest stage's at once: ``_step``)
    _momentum_gpu_bytes: int = field(default=0, repr=False)
    _momentum_working_bytes: int = field(default=0, repr=False)
    _momentum_step_bytes: int = field(default=0, repr=False)
    # offload: the copy-in's ms in ``step_ms`` (what the rank's NS does not cover)
    _copy_in_ms: float = field(default=0.0, repr=False)
    # offload="state": the owned masters in ``host_bytes`` (their compute copies stay in
    # ``dedicated_bytes``; the masters are on the GPU during the step, in ``step_extra_bytes``)
    _master_host_bytes: int = field(default=0, repr=False)
    # Muon(keep_new_momentum=True): the buf′ bytes in ``step_extra_bytes`` (with PP what they
    # add to the largest stage's), the elementwise bytes they save per step and that time
    _kept_bytes: int = field(default=0, repr=False)
    _kept_saved_bytes: int = field(default=0, repr=False)
    _kept_saved_ms: float = field(default=0.0, repr=False)

    @property
    def peak_bytes(self) -> int:
        return (
            self.dedicated_bytes
            + self.replica_bytes
            + self.sharded_muon_bytes
            + self.adamw_bytes
            + self.grad_bytes
            + self.step_extra_bytes
        )

    @property
    def gather_reduce_bytes(self) -> int:
        """The weights' all-gathers and gradient reduce-scatters (HSDP: and FSDP2's all-reduce
        over the replicas): FSDP2's own, and the dedicated groups' in FSDP2's place (the same
        bytes for even owners): what FSDP2 alone would move."""
        return self.fsdp_comm_bytes + self.dedicated_comm_bytes

    @property
    def muon_extra_bytes(self) -> int:
        """What owning whole matrices adds: HSDP's column reduce and broadcast (in place of
        FSDP2's all-reduce of those weights; with ``expert_ns="once"`` the experts' all-gather
        over the replicas), TP's gather to the TP owner, split NS, the expert reshard."""
        return (
            self.replicate_comm_bytes
            + self.tp_comm_bytes
            + self.split_comm_bytes
            + self.expert_reshard_comm_bytes
        )

    @property
    def comm_bytes(self) -> int:
        return self.gather_reduce_bytes + self.muon_extra_bytes

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["peak_bytes"] = self.peak_bytes
        out["comm_bytes"] = self.comm_bytes
        out["gather_reduce_bytes"] = self.gather_reduce_bytes
        out["muon_extra_bytes"] = self.muon_extra_bytes
        return out


COLUMNS = (  # (title, value of a RankRow, bytes, ms or count); "{unit}": the report's byte unit
    ("dedicated {unit}", lambda r: r.dedicated_bytes, "bytes"),
    ("replica {unit}", lambda r: r.replica_bytes, "bytes"),
    ("FSDP2 Muon {unit}", lambda r: r.sharded_muon_bytes, "bytes"),
    ("AdamW {unit}", lambda r: r.adamw_bytes, "bytes"),
    ("grads {unit}", lambda r: r.grad_bytes, "bytes"),
    ("step extra {unit}", lambda r: r.step_extra_bytes, "bytes"),
    ("peak {unit}", lambda r: r.peak_bytes, "bytes"),
    ("NS ms", lambda r: r.ns_ms, "ms"),
    ("step ms", lambda r: r.step_ms, "ms"),
    ("comm {unit}/step", lambda r: r.comm_bytes, "bytes"),
    ("  AG/RS {unit}/step", lambda r: r.gather_reduce_bytes, "bytes"),  # what FSDP2 moves
    ("  Muon extra {unit}/step", lambda r: r.muon_extra_bytes, "bytes"),  # what owning adds
)
_COMM_PARTS = ("  AG/RS {unit}/step", "  Muon extra {unit}/step")  # shown with any traffic
# Shown with expert parallelism (dry_run(ep=...)) only, so the other reports stay as they were.
EP_COLUMNS = (
    ("expert matrices", lambda r: r.expert_matrices, "count"),
    ("expert NS ms", lambda r: r.expert_ns_ms, "ms"),
    ("reshard {unit}/step", lambda r: r.expert_reshard_comm_bytes, "bytes"),
)
# Shown with offload="momentum" (dry_run(offload=...)) only, after the peak.
HOST_COLUMNS = (
    ("host {unit}", lambda r: r.host_bytes, "bytes"),
    ("host link {unit}/step", lambda r: r.host_link_bytes, "bytes"),
)
_HOST_FIELDS = ("host_bytes", "host_link_bytes")
# Shown with expert_ns="once" (dry_run(expert_ns=...)) in effect only, after the comm columns.
ONCE_COLUMNS = (("replica gather {unit}/step", lambda r: r.expert_gather_comm_bytes, "bytes"),)
UNITS = (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _count(n: float) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"


@dataclass
class DryRunReport:
    """What :func:`dry_run` predicts: per-rank rows, totals, idle ranks, split matrices."""

    model: str
    world_size: int
    replicate_size: int
    shard_size: int
    tp_size: int
    split_size: int
    rows: list[RankRow]
    owners: dict[str, int]  # fqn -> global data-parallel owner (replica · shard_size + shard)
    dedicated_matrices: int
    dedicated_params: int  # elements
    adamw_params: int
    sharded_muon_params: int
    split: list[dict]
    rates: str
    settings: dict
    plan_s: float = 0.0
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    ep: int | None = None  # expert parallelism modelled (dry_run(ep=...)); None: plain FSDP2
    expert_layout: dict | None = None  # with ep: the expert mesh and placements (see table())
    # Pipeline parallelism (dry_run(pp=...)); None without it, and left out of to_dict().
    pp: int | None = None
    stages_per_rank: int | None = None
    stage_less_layers: list[int] | None = None  # torchtitan's first/last_stage_less_layers
    stages: list[dict] | None = None  # per stage: layers, PP rank, owners (its DP ranks), loads
    pp_ranks: list[dict] | None = None  # per PP rank: its ranks, stages, layers, NS balance
    gpu_memory_bytes: int | None = None  # the card's memory (dry_run(gpu_memory_gib=...))
    card: str = ""  # where that memory comes from (the rates' device, or given)
    # The momentum in host memory (dry_run(offload="momentum")); None: on the GPU, and the
    # host columns and keys left out of table() and to_dict().
    offload: str | None = None
    # "once" where the HSDP replicas split the expert stacks' NS (dry_run(expert_ns="once")
    # with replicate_size > 1 and expert stacks); None otherwise, and left out of to_dict().
    expert_ns: str | None = None

    @property
    def idle_ranks(self) -> list[int]:
        return [r.rank for r in self.rows if r.ns_ms == 0]

    def totals(self) -> dict:
        def total(name):
            return sum(getattr(r, name) for r in self.rows)

        out = {
            "dedicated_bytes": total("dedicated_bytes"),
            "replica_bytes": total("replica_bytes"),
            "sharded_muon_bytes": total("sharded_muon_bytes"),
            "adamw_bytes": total("adamw_bytes"),
            "comm_bytes": total("comm_bytes"),
            "gather_reduce_bytes": total("gather_reduce_bytes"),
            "muon_extra_bytes": total("muon_extra_bytes"),
            "ns_ms_max": max((r.ns_ms for r in self.rows), default=0.0),
            "step_ms_max": max((r.step_ms for r in self.rows), default=0.0),
            "peak_bytes_max": max((r.peak_bytes for r in self.rows), default=0),
            "idle_ranks": len(self.idle_ranks),
        }
        if self.offload is not None:
            out["host_bytes"] = total("host_bytes")
            out["host_bytes_max"] = max((r.host_bytes for r in self.rows), default=0)
            out["host_link_bytes_max"] = max((r.host_link_bytes for r in self.rows), default=0)
        return out

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        if self.offload is None:  # the report without offload keeps its keys
            del out["offload"]
            for row in out["rows"]:
                for key in _HOST_FIELDS:
                    del row[key]
        if self.expert_ns is None:  # per-replica expert NS: the keys as before
            del out["expert_ns"]
            for row in out["rows"]:
                del row["expert_gather_comm_bytes"]
        if self.pp is None:  # the report without PP keeps its keys
            for key in ("pp", "stages_per_rank", "stage_less_layers", "stages", "pp_ranks"):
                del out[key]
        else:
            for row in out["rows"]:
                row["pp_rank"] = self.pp_rank(row["rank"])
        out["idle_ranks"] = self.idle_ranks
        out["totals"] = self.totals()
        return out

    def table(self, per_rank: bool | None = None, top: int = 5) -> str:
        """Text: a header, min/median/max per column, the ``top`` busiest ranks, idle ranks and
        split matrices; ``per_rank`` (default: 16 ranks or fewer) adds every rank's row."""
        dims = ["replicate", "shard"] + (["tp"] if self.tp_size > 1 else [])
        sizes = [self.replicate_size, self.shard_size] + (
            [self.tp_size] if self.tp_size > 1 else []
        )
        if self.pp is not None:
            dims, sizes = ["pp", *dims], [self.pp, *sizes]
        mesh = f"{' × '.join(dims)} = {' × '.join(map(str, sizes))}"
        lines = [
            f"{self.model} on {self.world_size} GPUs ({mesh}) — "
            f"{self.dedicated_matrices} dedicated weights ({_count(self.dedicated_params)} "
            f"params), {_count(self.sharded_muon_params)} FSDP2 Muon, "
            f"{_count(self.adamw_params)} AdamW; planned in {self.plan_s:.2f} s, "
            f"reported in {self.total_s:.2f} s",
            f"rates: {self.rates}; " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
        ]
        if self.expert_layout is not None:
            lines.append(_expert_layout_line(self.expert_layout, self.world_size))
        if self.pp is not None:
            lines += self._pipeline_lines()
        columns = self._columns()
        width = max(len(c[0]) for c in columns)
        lines.append(f"{'per rank':<{width}}  {'min':>10} {'median':>10} {'max':>10}")
        for title, get, fmt in columns:
            values = [get(r) for r in self.rows]
            lines.append(
                f"{title:<{width}}  "
                + " ".join(
                    f"{fmt.format(v):>10}"
                    for v in (min(values), statistics.median(values), max(values))
                )
            )
        comm = self._comm_line()
        if comm:
            lines.append(comm)
        memory = self.memory_line()
        if memory:
            lines.append(memory)
        idle = self.idle_ranks
        lines.append(f"idle ranks (no NS work): {len(idle)} of {self.world_size}{_ranges(idle)}")
        if self.split:
            lines.append(f"split matrices ({len(self.split)}, NS over split_size ranks each):")
            for s in self.split[:top]:
                lines.append(
                    f"  {s['fqn']} {tuple(s['shape'])} on ranks {s['ranks'][0]}.."
                    f"{s['ranks'][-1]}: {s['ns_ms_per_rank']:.2f} ms per rank"
                )
            if len(self.split) > top:
                lines.append(f"  ... and {len(self.split) - top} more")
        else:
            lines.append(
                "split matrices: none"
                + (" (split_size=1)" if self.split_size == 1 else " (none exceeds a fair share)")
            )
        if per_rank or (per_rank is None and self.world_size <= 16):
            lines.append("every rank:")
            lines += self._rows_text(self.rows)
        else:
            busiest = sorted(self.rows, key=lambda r: (-r.step_ms, r.rank))[:top]
            lines.append(f"busiest ranks (by step ms), top {len(busiest)}:")
            lines += self._rows_text(busiest)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _comm_line(self) -> str:
        """What the comm column is made of, over all ranks."""
        total = sum(r.comm_bytes for r in self.rows)
        if not total:
            return ""
        gather = sum(r.expert_gather_comm_bytes for r in self.rows)
        column = sum(r.replicate_comm_bytes for r in self.rows) - gather
        parts = [
            ("HSDP column reduce/broadcast", column),
            ("expert all-gather over replicas", gather),
        ] + [
            (name, sum(getattr(r, field) for r in self.rows))
            for name, field in (
                ("TP gather/scatter", "tp_comm_bytes"),
                ("split NS", "split_comm_bytes"),
                ("expert reshard", "expert_reshard_comm_bytes"),
            )
        ]
        extra = ", ".join(f"{name} {100 * v / total:.1f}%" for name, v in parts if v) or "none"
        agrs = sum(r.gather_reduce_bytes for r in self.rows)
        return (
            f"comm = AG/RS {100 * agrs / total:.1f}% (the weights' all-gathers and reduce-"
            f"scatters: what FSDP2 alone moves) + Muon extra {100 * (total - agrs) / total:.1f}% "
            f"(what owning adds: {extra})"
        )

    def memory_line(self) -> str:
        """The largest peak against the card's memory ("" when the memory is unknown)."""
        if self.gpu_memory_bytes is None or not self.rows:
            return ""
        top = max(self.rows, key=lambda r: (r.peak_bytes, -r.rank))
        peak, mem = top.peak_bytes / GiB, self.gpu_memory_bytes / GiB
        head = (
            f"memory: peak {peak:.2f} GiB (rank {top.rank}) of {mem:.1f} GiB per GPU ({self.card})"
        )
        if peak <= mem:
            return f"{head}: {mem - peak:.1f} GiB left for activations and unsharded weights"
        over = sum(1 for r in self.rows if r.peak_bytes > self.gpu_memory_bytes)
        return f"{head}: DOES NOT FIT on {over} of {self.world_size} ranks (see the note)"

    def _columns(self):
        """``(title, value, format)`` of the columns not zero on every rank (a dense model has
        no FSDP2 Muon), bytes in the largest unit that keeps the biggest value >= 1."""
        biggest = max((r.peak_bytes for r in self.rows), default=0)
        biggest = max(biggest, max((r.comm_bytes for r in self.rows), default=0))
        unit, scale = next(((u, s) for u, s in UNITS if biggest >= s), UNITS[-1])
        out = []
        any_comm = any(r.comm_bytes for r in self.rows)
        experts = self.ep is not None or self.expert_ns is not None
        columns = COLUMNS + (EP_COLUMNS if experts else ())
        if self.expert_ns is not None:
            columns += ONCE_COLUMNS
        if self.offload is not None:
            after_peak = [t for t, _, _ in columns].index("peak {unit}") + 1
            columns = columns[:after_peak] + HOST_COLUMNS + columns[after_peak:]
        for title, get, kind in columns:
            keep = title in ("NS ms", "step ms") or (title in _COMM_PARTS and any_comm)
            if not keep and not any(get(r) for r in self.rows):
                continue
            if kind == "bytes":
                out.append((title.format(unit=unit), lambda r, g=get: g(r) / scale, "{:.2f}"))
            else:
                out.append((title, get, "{:.0f}" if kind == "count" else "{:.2f}"))
        return out

    def pp_rank(self, rank: int) -> int:
        """The PP rank of global ``rank`` (0 without pipeline parallelism)."""
        return rank // (self.world_size // self.pp) if self.pp else 0

    def _pipeline_lines(self) -> list[str]:
        stages = len(self.stages)
        layers = sum(len(s["layers"]) for s in self.stages)
        first, last = self.stage_less_layers
        lines = [
            f"pipeline (torchtitan's split, looped): {stages} stage{'s' * (stages > 1)} of "
            f"{layers} layers, "
            f"{self.stages_per_rank} per PP rank (stage k on PP rank k mod {self.pp}; first/"
            f"last stage less layers {first}/{last}); each PP rank's {self.world_size // self.pp}"
            " data-parallel ranks own its stages' weights; activations and sends between stages"
            " are not modelled"
        ]
        for info in self.pp_ranks:
            parts = []
            for k in info["stages"]:
                s = self.stages[k]
                span = _span(s["layers"])
                ends = (("embeddings", s["embeddings"]), ("output", s["output"]))
                extra = [w for w, on in ends if on]
                parts.append(f"{k} ({' + '.join([span, *extra])})")
            lo, hi = info["ranks"]
            mean = info["ns_ms_mean"]
            word = "stages" if len(parts) > 1 else "stage"
            lines.append(
                f"  PP rank {info['pp_rank']} (ranks {lo}-{hi}): {word} {', '.join(parts)}; "
                f"{info['layers']} layers; NS ms max/mean {info['ns_ms_max']:.2f}/{mean:.2f}"
                + (f" ({info['ns_ms_max'] / mean:.3f})" if mean else "")
            )
        return lines

    def _rows_text(self, rows) -> list[str]:
        columns = self._columns()
        pp = self.pp is not None
        titles = ["rank", *(["pp"] if pp else []), "matrices"] + [c[0].strip() for c in columns]
        cells = [
            [str(r.rank), *([str(self.pp_rank(r.rank))] if pp else []), str(r.matrices)]
            + [f.format(g(r)) for _, g, f in columns]
            for r in rows
        ]
        widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
        out = ["  " + "  ".join(t.rjust(w) for t, w in zip(titles, widths))]
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        return out


def _expert_layout_line(info: dict, world: int) -> str:
    """The report's line on the expert mesh (``dry_run(ep=...)``)."""
    experts = "/".join(map(str, info["experts"]))
    local = "/".join(map(str, info["local_experts"]))
    line = (
        f"experts (torchtitan EP): ep × efsdp = {info['ep']} × {info['efsdp']} per replica, "
        f"{local} of {experts} experts per EP rank, {info['stacks']} stacks; expert FSDP "
    )
    dims = info["shard_dims"]
    if dims == [0]:
        line += "Shard(0): whole experts on each rank, NS where they live"
    else:
        line += (
            f"{' and '.join(f'Shard({d})' for d in dims)} "
            f"({info['resharded_stacks']} stacks sharded inside the experts: NS on whole "
            "experts after a reshard, an all-to-all over efsdp and back)"
        )
    line += f"; {info['ranks_with_experts']} of {world} ranks orthogonalise experts"
    if info.get("expert_ns") == "once":
        line += (
            "; expert NS once per job: the replicas split the whole experts and all-gather "
            "the results"
        )
    return line


def _span(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    if len(layers) == 1:
        return f"layer {layers[0]}"
    return f"layers {layers[0]}-{layers[-1]}"


def _ranges(ranks: list[int], limit: int = 12) -> str:
    if not ranks:
        return ""
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    shown = ", ".join(spans[:limit]) + (", ..." if len(spans) > limit else "")
    return f": {shown}"
