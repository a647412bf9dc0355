"""The dry run's advice: when many ranks idle, what ``--split-size`` would do; when the peak does
not fit the card, what would make it fit. Each number comes from another dry run of the same
job with one setting changed (``rerun``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_compile.plan.momentum import MomentumCost
from dmuon_compile.plan.report import DryRunReport, GiB

IDLE_SHARE = 0.25  # at least this share of the ranks idle: the report points to --split-size
MAX_GPUS = 32768  # the most GPUs the "fits from N GPUs" search plans (one row per rank)
MAX_GROWTH = 16  # ... and at most this many times the job's own


def advise(
    report: DryRunReport,
    rerun: Callable[..., DryRunReport],
    split_size: int,
    momentum: MomentumCost | None = None,
) -> None:
    """Append the notes to ``report.notes``. ``rerun(**changes)``: the same ``dry_run`` with
    ``changes`` (``world_size``, ``split_size``, ``stack_bytes``, ``momentum_dtype``,
    ``offload``) and no advice of its own. ``momentum``: the job's momentum storage (default:
    in place, the weights' dtype)."""
    world = report.world_size
    idle = len(report.idle_ranks)
    if split_size == 1 and world > 1 and idle >= IDLE_SHARE * world:
        report.notes.append(_split_note(report, rerun, idle))
    if report.gpu_memory_bytes is not None:
        peak = max((r.peak_bytes for r in report.rows), default=0)
        if peak > report.gpu_memory_bytes:
            note = _memory_note(report, rerun, peak, split_size, momentum or MomentumCost())
            report.notes.append(note)


def _try(rerun, **changes) -> DryRunReport | None:
    try:
        return rerun(**changes)
    except (ValueError, NotImplementedError):  # a size the layout does not allow
        return None


def _lower_peak(other: DryRunReport | None, peak: int) -> int | None:
    """``other``'s peak when it is at least 1% below ``peak`` (else not worth a line)."""
    if other is None:
        return None
    other_peak = max(r.peak_bytes for r in other.rows)
    return other_peak if other_peak < 0.99 * peak else None


def _split_candidates(report: DryRunReport, busy: int) -> list[int]:
    """Powers of two from the one that gives every rank a piece of some matrix
    (``world / busy`` ranks per busy rank) up, at most 64."""
    need = -(-report.world_size // max(busy, 1))
    k = 2
    while k < need and k < 64:
        k *= 2
    return [c for c in (k, 2 * k) if c <= 64]


def _ns_summary(r: DryRunReport) -> tuple[int, float, float]:
    return (
        len(r.idle_ranks),
        max((x.ns_ms for x in r.rows), default=0.0),
        max((x.step_ms for x in r.rows), default=0.0),
    )


def _split_note(report: DryRunReport, rerun, idle: int) -> str:
    world = report.world_size
    _, ns, step = _ns_summary(report)
    head = (
        f"{idle} of {world} ranks ({100 * idle / world:.0f}%) own no matrix and idle in the "
        f"step, while the busiest runs {ns:.2f} ms of NS ({step:.2f} ms step)"
    )
    tried, best = [], step
    for k in _split_candidates(report, world - idle):
        other = _try(rerun, split_size=k)
        if other is None:
            continue
        k_idle, k_ns, k_step = _ns_summary(other)
        best = min(best, k_step)
        tried.append(
            f"--split-size {k}: {k_idle} idle, NS ms max {k_ns:.2f}, step ms max {k_step:.2f}"
        )
    if not tried:
        return head + "; no power of two up to 64 divides the data-parallel ranks for --split-size"
    if best > 0.95 * step:
        return (
            f"{head}; --split-size would not shorten the step ({'; '.join(tried)}): the "
            "matrices are too small to gain from splitting"
        )
    return (
        f"{head}: --split-size k (dry_run(split_size=k)) runs each matrix above a fair share "
        f"over k ranks; {'; '.join(tried)}"
    )


# The momentum storages the memory note tries: (the one setting changed, the note's words).
_STORAGES = (
    ({"momentum_dtype": torch.bfloat16}, "momentum_dtype=torch.bfloat16 (--momentum-dtype bf16)"),
    ({"momentum_dtype": torch.int8}, "momentum_dtype=torch.int8 (--momentum-dtype int8, 8-bit)"),
    ({"offload": "momentum"}, 'offload="momentum" (--offload momentum, in host memory)'),
)


def _storage_tries(momentum: MomentumCost) -> list[tuple[dict, str]]:
    """The momentum storages one setting away from the job's: bf16 and 8-bit from the weights'
    dtype, offload from the GPU. 8-bit and offload hand every stepped matrix's momentum back
    to the step as working buffers, so they lower the *step's* peak only where a rank's
    matrices do not all step at once (pipeline stages step in turn). With a kept buf′
    (``keep_new_momentum``): first the job without it, then 8-bit and offload without it."""
    free = {
        "momentum_dtype": momentum.dtype in (None, torch.float32),
        "offload": momentum.offload is None,
    }
    tries = [(changes, words) for changes, words in _STORAGES if free[next(iter(changes))]]
    if not momentum.keep_new:
        return tries
    off = {"keep_new_momentum": False}
    out = [(off, "keep_new_momentum=False (drop --keep-new-momentum)")]
    for changes, words in tries:
        stored = changes.get("momentum_dtype") == torch.int8 or "offload" in changes
        if stored:  # Muon refuses a kept buf′ beside a stored momentum
            changes, words = {**changes, **off}, f"{words} without --keep-new-momentum"
        out.append((changes, words))
    return out


def _memory_note(report: DryRunReport, rerun, peak: int, split_size: int, momentum) -> str:
    mem = report.gpu_memory_bytes
    top = max(report.rows, key=lambda r: (r.peak_bytes, -r.rank))
    parts = [
        (name, getattr(top, field) / GiB)
        for name, field in (
            ("dedicated", "dedicated_bytes"),
            ("replica", "replica_bytes"),
            ("FSDP2 Muon", "sharded_muon_bytes"),
            ("AdamW", "adamw_bytes"),
            ("grads", "grad_bytes"),
            ("step extra", "step_extra_bytes"),
        )
    ]
    made_of = " + ".join(f"{name} {v:.2f}" for name, v in parts if v >= 0.005)
    lines = [
        f"the predicted peak, {peak / GiB:.2f} GiB on rank {top.rank} ({made_of} GiB), does "
        f"not fit the {mem / GiB:.1f} GiB of one GPU ({report.card}); to fit:"
    ]
    world = report.world_size
    fits = None
    factor = 2
    while factor <= MAX_GROWTH and world * factor <= MAX_GPUS:
        other = _try(rerun, world_size=world * factor)
        if other is not None:
            other_peak = max(r.peak_bytes for r in other.rows)
            if other_peak <= mem:
                fits = (world * factor, other_peak)
                break
        factor *= 2
    if fits:
        lines.append(
            f"more GPUs (the state shards over them): {fits[0]} fit, peak {fits[1] / GiB:.2f} GiB"
        )
    else:
        lines.append(f"more GPUs: not within {MAX_GROWTH}× the GPUs ({world * MAX_GROWTH})")
    tries = []  # (what to change, what it is): each another dry run of the same job
    if split_size == 1:
        for k in _split_candidates(report, world - len(report.idle_ranks))[:1]:
            tries.append(
                ({"split_size": k}, f"--split-size {k} (NS of the large matrices over {k} ranks)")
            )
    cap = report.settings.get("stack cap GiB")
    if isinstance(cap, (int, float)) and cap > 1:
        tries.append(
            ({"stack_bytes": GiB}, "--stack-gib 1 (a smaller NS stack budget; more calls)")
        )
    if report.settings.get("step") == "eager":
        tries.append(({"compiled": True}, "the compiled step (drop --eager)"))
    tries += _storage_tries(momentum)
    for changes, what in tries:
        other_peak = _lower_peak(_try(rerun, **changes), peak)
        if other_peak is not None:
            lines.append(f"{what}: peak {other_peak / GiB:.2f} GiB")
    return lines[0] + " " + "; ".join(lines[1:])
