"""A runtime's comm context, its one queue of pending weight updates, and the writes that make
a publish due.

Each runtime owns one :class:`CommContext` (FSDP2 keeps one ``FSDPCommContext`` per state): the
unshard side streams, the pending-update queue and the groups' forward order; its groups get it
from the runtime. A step can leave a dedicated weight's new value *in flight*: the HSDP publish
(the global owner's broadcast to its replicate peers, ``_replicate.py``) and the deferred TP
scatter (the TP owner's update shards, applied to each member's master, ``_tp/stage.py``). Both
are entries of the context's :class:`PendingUpdates` (``pending``), keyed by hook group, applied
in the order they were queued:

- before the group's next unshard reads its masters (``DedicatedGroup.unshard``; on CUDA on the
  unshard side stream, so the compute stream and the previous group's forward do not wait);
- before anything else reads or writes a dedicated weight through its registered parameter
  (``OwnerTensor`` ops, ``p.to_local()``, ``p.full_tensor()``, ``dmuon.full_tensor(p)``,
  ``model.state_dict()`` and so DCP): :func:`before_access`, called from ``_owned.py``;
- at the start of the next ``Muon.step`` and in ``wait_all``.

Applying an entry only waits for collectives every rank already issued, so it is local and may
happen on one rank alone. Publishing is collective: an in-place write through a registered
parameter between steps (``p.data.mul_``, ``p.mul_``, ``p.copy_``, ``nn.init``, a DCP load) marks
a publish due (:meth:`PendingUpdates.note_write`) on every rank — the user runs the same code
everywhere, and ranks that hold nothing see the op on their empty local tensor — and the next
forward publishes before its first unshard. Which tensor was written cannot be told apart on a
rank that holds nothing (a weight's empty local tensor and its gradient's look alike), so any
in-place op on an owner tensor outside a step counts; the step's own publish clears it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

# The comm contexts of live runtimes whose queues owner-tensor ops must consult (HSDP or TP:
# :meth:`CommContext.watch`); empty for a 1-D model, whose steps leave nothing in flight and whose
# writes need no publish. Process-wide only because DTensor dispatch forces it: an op on an
# owner tensor (``OwnerTensor.__torch_function__``, ``to_local``, ``dmuon.full_tensor``, an
# ``nn.init`` write) runs with no reference to the runtime that owns the weight, so it finds the
# queues here. Everything else reaches a runtime's queue through its context.
_WATCHED: weakref.WeakSet = weakref.WeakSet()
# Whether ``_WATCHED`` may hold a context: owner-tensor ops read this one flag (every op, so a
# module attribute, not the set's length) before calling :func:`before_access`.
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
    """One runtime's communication state, as FSDP2 keeps one ``FSDPCommContext`` per state: the
    one queue of pending updates, the groups' forward order and the unshard side streams. The
    runtime owns it and hands it to its groups (``DedicatedGroup.comm``)."""

    pending: PendingUpdates = dataclasses.field(default_factory=PendingUpdates)
    forward_order: list = dataclasses.field(default_factory=list)  # groups by forward start
    # One side stream per CUDA device for unshards that must first wait for a pending update.
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
