"""The Muon momentum's storage in the dry run: ``Muon(momentum_dtype=..., offload=...)`` as
bytes per rank (on the GPU, in host memory, over the host link) and the copy-in's time.

The storage itself is :mod:`dmuon_compile.momentum_storage`; this module prices it. In place
(``None``, ``torch.float32``, ``torch.bfloat16`` without offload) the momentum is one tensor of
the storage dtype per parameter. Stored (8-bit or offloaded) each step materialises a working
buffer per Muon matrix the rank steps (the weights' dtype; bf16 offloaded: bf16). Streamed
(``Muon(momentum_in_flight=N)``, the default N = 2): N of the step's Newton–Schulz shape
buckets at a time, each next one's copy-in under the previous one's NS, the new momentum kept
in a shadow of the stored form until the commit (8-bit on the GPU: new codes beside the old;
offloaded: a second host copy). All at once (``None``, or a step with stages: TP, split NS,
the expert reshard): every buffer before the first NS call, the copy-in waited for.
``offload="state"`` adds the owned masters: streamed, brought in by the commit after the
verdict in the same buckets, as many at a time (their copy-in exposed); all at once, copied in
under Newton–Schulz and all on the GPU for the step.

Kept (``Muon(keep_new_momentum=True)``, the in-place momentum only): each matrix the rank steps
itself (not one a stage steps) holds its new momentum buf′ in the storage dtype from its
Newton–Schulz to the commit, one more momentum in the step's peak; the commit then reads the
momentum and the gradient and writes the momentum no more, buf′ written once where NS's input
is computed (8 B fewer per fp32 value per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dmuon_compile.functional import cut_by_bytes
from dmuon_compile.momentum_storage import (
    BLOCK,
    IN_FLIGHT,
    check_in_flight,
    check_kept_momentum,
    check_offload,
    resolve_momentum_dtype,
)

# Pinned host-to-device copies over PCIe 5.0 x16 (64 GB/s per direction), a planning figure: one
# H100 copying alone moved 55 GB/s (1 and 4 GiB, torch 2.11), but a host's 8 GPUs copy at once
# through switches they share with the NICs, which carry FSDP2's traffic. PCIe 4.0: half.
# ``--host-link-gbps`` / ``dry_run(host_link_gbps=...)``: what your machine moves.
HOST_LINK_GBPS = 25.0
SCALE_BYTES = 4  # the 8-bit format's fp32 absolute maximum per block of BLOCK values
# The bytes per matrix element that ``NSRates.elementwise_ps`` stands for (ns_rates: the
# momentum, Nesterov input, norms, casts and commit move ~44 B per element at HBM speed): a
# kept buf′ takes its saved bytes off the step's elementwise time in this proportion.
ELEMENTWISE_BYTES = 44
# An offloaded step whose copy-in NS does not cover is more than this share of its 'step ms'
# gets a note saying so (the host link, not Newton-Schulz, sets its pace).
LINK_BOUND_SHARE = 0.1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MomentumCost:
    """What one momentum setting costs per tensor. ``dtype``: the storage dtype as
    :func:`~dmuon_compile.momentum_storage.resolve_momentum_dtype` gives it (``None``: the
    weight's); ``offload``: ``None``, ``"momentum"`` or ``"state"`` (the owned masters too:
    ``charge_master``); ``host_link_gbps``: the pinned
    host-to-device rate (GB/s, 1e9 bytes) the copy-in is timed at; ``in_flight``: the shape
    buckets a streamed step materialises at once (``None``: all at once); ``keep_new``:
    ``Muon(keep_new_momentum=True)``, buf′ kept from the directions to the commit.

    Example::

        cost = MomentumCost(torch.int8)
        cost.stored_bytes(1000, 4)  # 1000 codes + 4 blocks' scales: 1016
    """

    dtype: torch.dtype | None = None
    offload: str | None = None
    host_link_gbps: float = HOST_LINK_GBPS
    in_flight: int | None = IN_FLIGHT
    keep_new: bool = False

    @property
    def stored(self) -> bool:
        """Whether the step works on a materialised working buffer (8-bit or offloaded)."""
        return self.dtype == torch.int8 or self.offload is not None

    def stored_bytes(self, numel: int, item: int) -> int:
        """Bytes of one tensor's momentum as kept between steps (``item``: the weight's bytes
        per value): 8-bit ``numel`` codes and an fp32 scale per started block of
        :data:`~dmuon_compile.momentum_storage.BLOCK`, else ``numel`` of the storage dtype."""
        if self.dtype == torch.int8:
            return numel + SCALE_BYTES * -(-numel // BLOCK)
        return numel * (item if self.dtype is None else _itemsize(self.dtype))

    @property
    def streaming(self) -> bool:
        """Whether a step without stages materialises the stored momentum bucket by bucket."""
        return self.stored and self.in_flight is not None

    def working_bytes(self, numel: int, item: int) -> int:
        """Bytes of one tensor's working buffer during the step (0 in place), in the dtype the
        step computes the momentum in: the weight's for 8-bit (codes are no arithmetic type)
        and for the default, else the storage dtype (bf16 offloaded)."""
        if not self.stored:
            return 0
        return numel * (item if self.dtype in (None, torch.int8) else _itemsize(self.dtype))

    def charge(self, add, column: str, numel: int, item: int) -> None:
        """Add one tensor's momentum through ``add(field, bytes)``: its stored bytes to
        ``column`` (the GPU state it belongs to) or, offloaded, to ``host_bytes``; its working
        buffer to ``step_extra_bytes``; both to the private fields the storage note reads."""
        stored = self.stored_bytes(numel, item)
        add("host_bytes" if self.offload else column, stored)
        add("_momentum_gpu_bytes", 0 if self.offload else stored)
        working = self.working_bytes(numel, item)
        add("step_extra_bytes", working)
        add("_momentum_working_bytes", working)

    def charge_master(
        self, add, numel: int, item: int, compute_item: int, column: bool = False
    ) -> None:
        """Add one owned dedicated master through ``add(field, bytes)``: on the GPU between
        steps (``dedicated_bytes``), itself, or with ``offload="state"`` its compute copy, the
        master then in ``host_bytes`` and, copied in for the step, in ``step_extra_bytes``
        (a streamed step holds fewer: ``finish_rows``). ``column``: an HSDP global owner whose
        column buffer (counted as a replica) is then its compute copy."""
        if self.offload != "state":
            add("dedicated_bytes", numel * item)
            return
        if not column:
            add("dedicated_bytes", numel * compute_item)
        add("host_bytes", numel * item)
        add("_master_host_bytes", numel * item)
        add("step_extra_bytes", numel * item)

    def charge_kept(self, add, numel: int, item: int) -> None:
        """Add the buf′ of one tensor the rank steps itself (not in a stage) through
        ``add(field, bytes)``: its bytes in the storage dtype to ``step_extra_bytes`` (held from
        its Newton–Schulz to the commit) and ``_kept_bytes``; the elementwise bytes it saves per
        step to ``_kept_saved_bytes``: the commit's reads of the momentum and the gradient (the
        weight's dtype) and its write of the momentum, less buf′ written once where NS's input
        is computed. Nothing without ``keep_new``."""
        if not self.keep_new:
            return
        kept = self.stored_bytes(numel, item)
        add("step_extra_bytes", kept)
        add("_kept_bytes", kept)
        add("_kept_saved_bytes", kept + numel * item)

    def copy_in_ms(self, host_bytes: int) -> float:
        """The copy-in of ``host_bytes`` at :attr:`host_link_gbps`, in ms (the step waits for
        all of it before its first kernel; the write-back overlaps the next forward)."""
        return host_bytes / (self.host_link_gbps * 1e9) * 1e3

    def settings(self) -> dict:
        """The report header's words for this setting (none for the default, so its report
        stays as it was)."""
        out = {}
        if self.dtype == torch.int8:
            out["momentum"] = f"int8 (8-bit, an fp32 scale per {BLOCK} values)"
        elif self.dtype is not None:
            out["momentum"] = str(self.dtype).replace("torch.", "")
        if self.offload:
            out["offload"] = f"{self.offload} (pinned host memory, {self.host_link_gbps:g} GB/s)"
        if self.stored:
            out["momentum in flight"] = "all" if self.in_flight is None else self.in_flight
        if self.keep_new:
            out["keep new momentum"] = True
        return out


def momentum_cost(
    momentum_dtype,
    offload,
    host_link_gbps,
    in_flight: int | None = IN_FLIGHT,
    keep_new: bool = False,
) -> MomentumCost:
    """:class:`MomentumCost` of ``dry_run``'s arguments, checked as ``Muon`` checks them; a bad
    value raises ``ValueError`` naming the choices."""
    try:
        dtype = resolve_momentum_dtype(momentum_dtype)
        check_offload(offload)
        check_in_flight(in_flight)
        check_kept_momentum(keep_new, dtype, offload)
    except ValueError as e:
        raise ValueError(f"dry_run: {e}") from None
    if host_link_gbps is None:
        return MomentumCost(dtype, offload, in_flight=in_flight, keep_new=keep_new)
    if offload is None:
        raise ValueError(
            f"dry_run: host_link_gbps={host_link_gbps!r} needs offload='momentum' or 'state' "
            "(--offload momentum|state): without offload nothing crosses the host link"
        )
    if (
        isinstance(host_link_gbps, bool)
        or not isinstance(host_link_gbps, (int, float))
        or not 0 < host_link_gbps < math.inf
    ):
        raise ValueError(
            f"dry_run: host_link_gbps={host_link_gbps!r}: give the pinned host-to-device rate "
            f"in GB/s, a number > 0 (default {HOST_LINK_GBPS:g}, PCIe 5.0 x16)"
        )
    return MomentumCost(dtype, offload, float(host_link_gbps), in_flight, keep_new)


def finish_rows(rows, cost: MomentumCost, streams: bool = False, stack_cap: int = 0) -> None:
    """Per rank: the momentum the step materialises, the host link's bytes per step (copied in,
    written back) and the copy-in's ms in the step's (the write-back overlaps the next
    forward, not added). ``streams``: the step has no stages, so a streamed setting
    materialises ``cost.in_flight`` of its shape buckets (``stack_cap`` bytes at most each,
    the rank's ``_buckets``) at a time, the first one's copy-in waited for and the others' under
    the NS before them; else all at once, the whole copy-in waited for."""
    for row in rows:
        total = row._momentum_working_bytes
        row._momentum_step_bytes = total
        exposed = row.host_bytes
        masters = row._master_host_bytes  # offload="state"
        momentum_host = row.host_bytes - masters
        if streams and cost.streaming and total:
            largest = _bucket_bytes(row, total, stack_cap)[: cost.in_flight]
            held = min(total, sum(largest))
            # the shadows until the commit: 8-bit codes on the GPU beside the old ones
            shadow = 0 if cost.offload else row._momentum_gpu_bytes
            row.step_extra_bytes += held + shadow - total
            row._momentum_step_bytes = held + shadow
            first = momentum_host * largest[0] // total if largest else 0
            rest = momentum_host - first
            exposed = first + max(0.0, rest - _hidden_bytes(row, cost))
            # offload="state": the masters come in after the verdict, the buckets' own
            # ``in_flight`` at a time (their copies out overlap the next ones' in): on the GPU
            # only those, and their copy-in under no Newton-Schulz
            row.step_extra_bytes -= masters - masters * held // total
            exposed += masters
        elif masters:  # all at once: their copy-in on a side stream under NS (the commit waits)
            exposed = momentum_host + max(0.0, masters - _hidden_bytes(row, cost))
        if cost.offload:
            row.host_link_bytes = 2 * row.host_bytes
            row._copy_in_ms = cost.copy_in_ms(exposed)
            row.step_ms += row._copy_in_ms


def finish_kept(rows, rates) -> None:
    """Per rank that keeps buf′: the elementwise time its saved bytes took, off ``step_ms`` (at
    the rate ``rates.elementwise_ps`` prices :data:`ELEMENTWISE_BYTES` per element)."""
    for row in rows:
        if row._kept_saved_bytes and row.step_ms:
            row._kept_saved_ms = rates.elementwise_ms(row._kept_saved_bytes / ELEMENTWISE_BYTES)
            row.step_ms -= row._kept_saved_ms


def _bucket_bytes(row, total: int, stack_cap: int) -> list[int]:
    """The working momentum of each of the rank's NS shape buckets (matrices of one shape, at
    most ``stack_cap`` bytes of them, as ``functional.shape_buckets`` cuts them), largest first;
    ``total`` spread over the matrices' elements."""
    elements = sum(count * shape[0] * shape[1] for shape, count in row._buckets.items())
    if not elements:
        return [total]
    per_element = total / elements
    sizes = []
    for shape, count in row._buckets.items():
        one = shape[0] * shape[1] * per_element
        runs = cut_by_bytes([one] * count, stack_cap) if stack_cap else [range(count)]
        sizes += [int(len(run) * one) for run in runs]
    return sorted(sizes, reverse=True)


def _hidden_bytes(row, cost: MomentumCost) -> float:
    """The host-link bytes that fit under the rank's Newton–Schulz."""
    return row.ns_ms / 1e3 * cost.host_link_gbps * 1e9


def storage_note(report, cost: MomentumCost) -> str | None:
    """The note on a stored momentum (8-bit or offloaded), on the rank with the most of it:
    what the GPU holds of it between steps against the same momentum in place, the working
    buffers the step adds back, the copy-in's time. ``None`` in place."""
    if not cost.stored or not report.rows:
        return None
    gib = 1 << 30
    top = max(report.rows, key=lambda r: (r._momentum_working_bytes, -r.rank))
    if not top._momentum_working_bytes:
        return None
    kept, in_place = top._momentum_gpu_bytes, top._momentum_working_bytes
    step = top._momentum_step_bytes
    form = "8-bit codes and scales" if cost.dtype == torch.int8 else "the momentum"
    where = "pinned host memory" if cost.offload else "GPU memory"
    lower = in_place - kept - step
    streamed = cost.streaming and step != in_place
    what = (
        f"{cost.in_flight} shape buckets' momentum at a time in {_working_dtype(cost)}"
        + (", and the new 8-bit codes beside the old until the commit" if not cost.offload else "")
        if streamed
        else f"the momentum of every Muon matrix it steps in {_working_dtype(cost)}"
    )
    text = (
        f"momentum storage: {form} in {where} between steps; rank {top.rank} keeps "
        f"{kept / gib:.2f} GiB of momentum on the GPU through the forward and backward instead "
        f"of {in_place / gib:.2f} GiB in place, and its step materialises {what} "
        f"({step / gib:.2f} GiB in 'step extra'), so " + _peak_words(lower)
    )
    if cost.offload and streamed:
        text += (
            f"; its {top.host_bytes / gib:.2f} GiB cross the host link at "
            f"{cost.host_link_gbps:g} GB/s ({cost.copy_in_ms(top.host_bytes):.2f} ms) bucket by "
            "bucket, under the Newton-Schulz of the bucket before (the first bucket's copy and "
            "what NS does not cover are in 'step ms'); the write-back overlaps the next forward"
        )
        slow = max(report.rows, key=lambda r: (r._copy_in_ms, -r.rank))
        if slow.step_ms and slow._copy_in_ms > LINK_BOUND_SHARE * slow.step_ms:
            text += (
                f"; the host link sets this step's pace: on rank {slow.rank} the copy-in adds "
                f"{slow._copy_in_ms:.2f} ms, {slow._copy_in_ms / slow.step_ms:.0%} of its "
                "'step ms' (Newton-Schulz covers "
                f"{max(0.0, 1 - slow._copy_in_ms / cost.copy_in_ms(slow.host_bytes)):.0%} of "
                "the copy); --momentum-dtype int8 or bf16 on the GPU saves memory without it"
            )
    elif cost.offload:
        text += (
            f"; the step first copies its {top.host_bytes / gib:.2f} GiB in from host memory at "
            f"{cost.host_link_gbps:g} GB/s ({cost.copy_in_ms(top.host_bytes):.2f} ms, in 'step "
            "ms'); the write-back, as much again, overlaps the next forward (not in 'step ms')"
        )
    masters = top._master_host_bytes
    if masters and streamed:
        text += (
            f"; offload='state': rank {top.rank} also keeps its {masters / gib:.2f} GiB of owned "
            "masters in host memory between steps (their compute-dtype copies on the GPU instead, "
            "in 'dedicated'; an HSDP global owner's is its column buffer, in 'replica'); "
            "after the step's verdict the commit brings them in the same "
            "buckets, the same number at a time (in 'step extra'), their copy-in under no "
            "Newton-Schulz (in 'step ms') and their write-back beside the next bucket's copy-in; "
            "the host link figures above count the masters too"
        )
    elif masters:
        text += (
            f"; offload='state': rank {top.rank} also keeps its {masters / gib:.2f} GiB of owned "
            "masters in host memory between steps (their compute-dtype copies on the GPU instead, "
            "in 'dedicated'; an HSDP global owner's is its column buffer, in 'replica') "
            "and copies them in for the step under its Newton-Schulz, all at "
            f"once (in 'step extra'), so the step's peak is higher than with offload='momentum' "
            "by the compute copies while the forward and backward hold that much less; the host "
            "link figures above count the masters too"
        )
    return text


def kept_note(report, cost: MomentumCost) -> str | None:
    """The note on ``keep_new_momentum``: what buf′ adds to the largest peak and to any rank's,
    and the elementwise traffic and time it saves there. ``None`` without it."""
    if not cost.keep_new or not report.rows:
        return None
    gib = 1 << 30
    top = max(report.rows, key=lambda r: (r.peak_bytes, -r.rank))
    most = max(report.rows, key=lambda r: (r._kept_bytes, -r.rank))
    staged = (
        report.tp_size > 1
        or bool(report.split)
        or report.expert_ns is not None
        or bool((report.expert_layout or {}).get("resharded_stacks"))
    )
    text = (
        "keep_new_momentum: each rank keeps buf′, the new momentum of every Muon matrix it "
        "steps itself"
        + (" (none of those a stage steps: TP, split NS, the expert reshard)" if staged else "")
        + f", from its Newton-Schulz to the commit ('step extra'): the largest peak, rank "
        f"{top.rank}'s, grows by {top._kept_bytes / gib:.2f} GiB"
    )
    if most._kept_bytes > top._kept_bytes:
        text += f" (rank {most.rank}'s by {most._kept_bytes / gib:.2f} GiB)"
    return text + (
        "; the commit no longer reads the momentum and the gradient nor writes the momentum: "
        "~8 B per fp32 value less elementwise traffic per step (6 B with a bf16 momentum), "
        f"{top._kept_saved_bytes / 1e9:.2f} GB and {top._kept_saved_ms:.2f} ms of 'step ms' on "
        f"rank {top.rank}"
    )


def _working_dtype(cost: MomentumCost) -> str:
    if cost.dtype in (None, torch.int8):
        return "the weights' dtype"
    return str(cost.dtype).replace("torch.", "")


def _peak_words(lower: int) -> str:
    gib = 1 << 30
    if lower > 0:
        return f"its step's peak is {lower / gib:.2f} GiB lower than in place"
    same = "the same as" if lower == 0 else f"{-lower / gib:.2f} GiB above"
    return f"its step's peak is {same} in place (what it saves is in the forward and backward)"


__all__ = [
    "HOST_LINK_GBPS",
    "MomentumCost",
    "finish_kept",
    "finish_rows",
    "kept_note",
    "momentum_cost",
    "storage_note",
]
