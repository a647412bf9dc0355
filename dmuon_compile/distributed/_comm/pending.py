"""A runtime's comm context, its one queue of pending weight updates, and the writes that make
a publish due.

A step can leave a dedicated weight's new value in flight: the HSDP publish (the global owner's
broadcast to its replicate peers, ``_runtime/replicate.py``) and the deferred TP scatter (the TP
owner's update shards, ``_stages/tp/stage.py``). Both are entries of the runtime's
:class:`PendingUpdates`, keyed by hook group and applied in issue order: before the group's next
unshard reads its masters (on CUDA from the unshard side stream, so the compute stream does not
wait); before any other read or write through a registered parameter (``OwnerTensor`` ops,
``to_local``, ``full_tensor``, ``state_dict`` and so DCP: :func:`before_access`); at the next
``Muon.step`` and in ``wait_all``. Applying only waits for collectives every rank issued, so one
rank may do it alone.

Publishing is collective. An in-place write through a registered parameter outside a step
(``p.mul_``, ``nn.init``, a DCP load) marks a publish due on every rank — the user runs the same
code everywhere, and ranks holding nothing see the op on their empty local tensor — and the next
forward publishes before its first unshard. A rank holding nothing cannot tell a weight's empty
tensor from its gradient's, so any in-place op on an owner tensor outside a step counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

# The comm contexts whose queues owner-tensor ops consult (HSDP or TP: :meth:`CommContext.watch`;
# empty for 1-D). Process-wide only because an op on an owner tensor (DTensor dispatch,
# ``to_local``, ``nn.init``) has no reference to the runtime that owns the weight.
_WATCHED: weakref.WeakSet = weakref.WeakSet()
# Whether ``_WATCHED`` may hold a context: the one flag every owner-tensor op reads first.
watched = False
_GRADIENT_WRITES = [False]  # inside gradient_writes(): in-place ops write no weight


class PendingUpdates:
    """Weight updates issued but not yet applied, per hook group, in issue order.

    An entry has ``apply(forward: bool)`` (wait for its collectives and apply them; ``forward``:
    the wait is a forward's, counted in the profile) and ``collectives`` (how many are in flight).
    """

    def __init__(self) -> None:
        self._entries: dict[int, list] = {}  # id(hook group) -> entries, oldest first
        self.publish_due = False  # a write outside a step: the next forward publishes first

    def add(self, group_key: int, entry) -> None:
        self._entries.setdefault(group_key, []).append(entry)

    def has(self, group_key: int) -> bool:
        return group_key in self._entries

    def wait_group(self, group_key: int) -> None:
        """Before the group's unshard reads its masters: apply its entries."""
        for entry in self._entries.pop(group_key, ()):
            entry.apply(forward=True)

    def drain(self) -> None:
        """Apply every entry (a read or write of a dedicated weight, a step, ``wait_all``)."""
        while self._entries:
            entries, self._entries = self._entries, {}
            for group_entries in entries.values():
                for entry in group_entries:
                    entry.apply(forward=False)

    def note_write(self) -> None:
        """A dedicated weight was written outside a step: publish before the next unshard."""
        self.publish_due = True

    def collectives(self) -> int:
        return sum(e.collectives for es in self._entries.values() for e in es)

    def __len__(self) -> int:
        return sum(len(es) for es in self._entries.values())


@dataclasses.dataclass(eq=False)
class CommContext:
    """One runtime's communication state (FSDP2's ``FSDPCommContext``): the pending-update
    queue, the groups' forward order and the unshard side streams. The runtime hands it to its
    groups (``DedicatedGroup.comm``) and its step side."""

    pending: PendingUpdates = dataclasses.field(default_factory=PendingUpdates)
    forward_order: list = dataclasses.field(default_factory=list)  # groups by forward start
    # Per CUDA device: the stream of unshards that must first wait for a pending update.
    unshard_streams: dict = dataclasses.field(default_factory=dict)

    def unshard_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self.unshard_streams.get(index)
        if stream is None:
            stream = self.unshard_streams[index] = torch.cuda.Stream(device=index)
        return stream

    def watch(self) -> None:
        """Reads and writes of dedicated weights consult this context's queue
        (:func:`before_access`): a runtime whose steps leave updates in flight (HSDP publish,
        deferred TP scatter) or whose replicas must learn of a write (HSDP) calls it."""
        global watched
        _WATCHED.add(self)
        watched = True


def before_access(write: bool) -> None:
    """An op on an owner tensor is about to run: every pending update lands first; a write
    (in place) makes a publish due."""
    global watched
    write = write and not _GRADIENT_WRITES[0]
    comms = list(_WATCHED)
    watched = bool(comms)  # their runtimes may have gone since
    for comm in comms:
        if comm.pending._entries:
            comm.pending.drain()
        if write:
            comm.pending.note_write()


@contextlib.contextmanager
def gradient_writes():
    """In-place ops inside write gradients only (``Muon.zero_grad(set_to_none=False)``): no
    publish becomes due."""
    _GRADIENT_WRITES[0] = True
    try:
        yield
    finally:
        _GRADIENT_WRITES[0] = False
