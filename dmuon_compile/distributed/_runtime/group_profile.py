"""The counters of one dedicated hook group (a leaf: the group and its replicate stage both
record into it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GroupProfile:
    """What a dedicated hook group did since the counters were reset: unshards, waits, reduces,
    and with HSDP its replicate reduces and publishes (recorded when the runtime's
    ``record_profile`` is on; ``diagnostics.collect_forward_unshard_profile`` reads them)."""

    unshards: int = 0
    prefetched: int = 0  # unshards issued ahead by a prefetch
    waits: int = 0
    found_ready: int = 0  # waits whose collective had already finished (gloo/CPU: is_completed)
    wait_s: float = 0.0
    stream_stall_s: float = 0.0  # CUDA: time the compute stream waited for the unshard
    bytes_received: int = 0
    reduces: int = 0
    bytes_reduced: int = 0
    # HSDP replicate stage
    replicate_reduces: int = 0  # reduces to global owners (one per replica owner and backward)
    replicate_bytes_reduced: int = 0
    publishes: int = 0  # post-step publishes of this group (each = one broadcast per root)
    publish_broadcasts: int = 0
    publish_bytes: int = 0
    publish_waits: int = 0  # forwards that waited for this group's publish
    publish_not_ready: int = 0  # ... and found it not finished yet (the wait was exposed)
    publish_wait_s: float = 0.0  # host time in those waits (blocking on gloo; ~0 on CUDA)
    # CUDA: how long the unshard side stream waited there (events). The compute stream only
    # waits for the unshard itself: that wait is in ``stream_stall_s``.
    publish_stall_s: float = 0.0
