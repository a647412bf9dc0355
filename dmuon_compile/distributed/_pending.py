"""The runtime's one queue of pending weight updates, and the writes that make a publish due.

A step can leave a dedicated weight's new value *in flight*: the HSDP publish (the global owner's
broadcast to its replicate peers, ``_replicate.py``) and the deferred TP scatter (the TP owner's
update shards, applied to each member's master, ``_tp/stage.py``). Both are entries of one
:class:`PendingUpdates` per runtime, keyed by hook group, applied in the order they were queued:

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
import weakref

# The watched queues of live runtimes (HSDP or TP: :meth:`PendingUpdates.watch`). Empty for a
# 1-D model, whose steps leave nothing in flight and whose writes need no publish.
_QUEUES: weakref.WeakSet = weakref.WeakSet()
# Whether ``_QUEUES`` may hold a queue: owner-tensor ops read this one flag (every op, so a
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

    def watch(self) -> None:
        """Reads and writes of dedicated weights consult this queue (:func:`before_access`): a
        runtime whose steps leave updates in flight (HSDP publish, deferred TP scatter) or whose
        replicas must learn of a write (HSDP) calls it."""
        global watched
        _QUEUES.add(self)
        watched = True

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


def before_access(write: bool) -> None:
    """An op on an owner tensor is about to run: every pending update lands first; a write
    (in place) makes a publish due."""
    global watched
    write = write and not _GRADIENT_WRITES[0]
    queues = list(_QUEUES)
    watched = bool(queues)  # their runtimes may have gone since
    for queue in queues:
        if queue._entries:
            queue.drain()
        if write:
            queue.note_write()


@contextlib.contextmanager
def gradient_writes():
    """In-place ops inside write gradients only (``Muon.zero_grad(set_to_none=False)``): no
    publish becomes due."""
    _GRADIENT_WRITES[0] = True
    try:
        yield
    finally:
        _GRADIENT_WRITES[0] = False
