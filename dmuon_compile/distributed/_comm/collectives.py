"""The collectives of the dedicated-parameter runtime, and the one place that knows their names.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (the old names warn); 2.11 has only the old
ones. Every call is ``async_op=True``: the returned ``Work`` is the event the consumer waits
on (on CUDA ``Work.wait()`` makes the *current stream* wait for the communication stream, it
does not block the host; on gloo it blocks until the data is there).

Gloo has no ``ReduceOp.AVG``: gradients are summed and divided by the group size afterwards,
on every backend, so CPU and GPU runs do the same arithmetic.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed._compat.c10d import backend_timeout, default_group

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: Tensor, input: Tensor, group) -> dist.Work:
    """``output`` (world·k) ← concatenation of every rank's ``input`` (k); async."""
    return _all_gather(output, input, group=group, async_op=True)


def reduce_scatter_sum(output: Tensor, input: Tensor, group) -> dist.Work:
    """``output`` (k) ← sum over ranks of this rank's k-slice of ``input`` (world·k); async."""
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_v(chunks: list[Tensor], group) -> dist.Work | _CopyOutWork:
    """``chunks[r]`` on every rank ← group rank ``r``'s ``chunks[r]``; the chunks may differ in
    size (zero included); one collective launch; async.

    NCCL runs an all-gather of uneven sizes as one group of broadcasts, one per rank, inside
    ``ncclGroupStart/End``: one launch, and each rank receives exactly the others' bytes. Gloo
    (and backends not known to do that) take equal sizes only: there the chunks travel padded
    to the largest through one all-gather and are copied into place by ``wait()``.
    """
    rank = dist.get_rank(group)
    mine = chunks[rank]
    if _backend(group, mine.device) == "nccl":
        return dist.all_gather(chunks, mine, group=group, async_op=True)
    widest = max(c.numel() for c in chunks)
    send = mine.new_zeros(widest)
    send[: mine.numel()].copy_(mine)
    out = mine.new_empty(widest * len(chunks))
    work = _all_gather(out, send, group=group, async_op=True)
    return _CopyOutWork(
        work, [(c, out[r * widest : r * widest + c.numel()]) for r, c in enumerate(chunks)]
    )


def reduce_scatter_v_sum(output: Tensor, chunks: list[Tensor], group) -> dist.Work:
    """``output`` ← sum over ranks of their ``chunks[rank]`` (this rank's chunk); the chunks may
    differ in size (zero included); one collective launch; async. The other chunks' contents are
    undefined afterwards (NCCL reduces into them in place).

    NCCL runs it as one group of reduces, one per rank (one launch; each rank sends each chunk
    once). Other backends go padded to the largest chunk through one ``reduce_scatter_tensor``
    (gloo's list reduce-scatter runs its CPU algorithm: on CUDA tensors it crashes the process),
    and ``wait()`` copies this rank's sums into ``output``.
    """
    if _backend(group, output.device) == "nccl":
        return dist.reduce_scatter(output, chunks, op=dist.ReduceOp.SUM, group=group, async_op=True)
    widest = max(c.numel() for c in chunks)
    send = output.new_zeros(widest * len(chunks))
    for r, c in enumerate(chunks):
        send[r * widest : r * widest + c.numel()].copy_(c.reshape(-1))
    out = output.new_empty(widest)
    work = _reduce_scatter(out, send, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _CopyOutWork(work, [(output, out[: output.numel()].view_as(output))])


class _CopyOutWork:
    """A padded all-gather standing in for an uneven one: ``wait()`` waits, then copies each
    rank's piece of the padded buffer into its chunk (the buffers live as long as the work)."""

    def __init__(self, work, copies: list[tuple[Tensor, Tensor]]) -> None:
        self.work, self.copies = work, copies

    def wait(self) -> bool:
        self.work.wait()
        for dst, src in self.copies:
            dst.copy_(src)
        self.copies = []
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _backend(group, device: torch.device) -> str:
    """The backend name serving ``device`` in ``group`` (``"cpu:gloo,cuda:nccl"`` → per device)."""
    name = str(dist.get_backend(group))
    if ":" in name:
        name = dict(part.split(":", 1) for part in name.split(",")).get(device.type, name)
    return name


def broadcast(tensor: Tensor, src_group_rank: int, group) -> dist.Work:
    """``tensor`` ← the copy held by group rank ``src_group_rank``; async."""
    src = dist.get_global_rank(group, src_group_rank)
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def reduce_sum(tensor: Tensor, dst_group_rank: int, group) -> dist.Work:
    """``tensor`` on group rank ``dst_group_rank`` ← sum over ranks; async (others: undefined)."""
    dst = dist.get_global_rank(group, dst_group_rank)
    return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)


def scatter(output: Tensor, inputs: list[Tensor] | None, src_group_rank: int, group) -> dist.Work:
    """``output`` ← ``inputs[this group rank]`` of group rank ``src_group_rank`` (equal sizes;
    ``inputs`` only there); async."""
    src = dist.get_global_rank(group, src_group_rank)
    return dist.scatter(output, inputs, src=src, group=group, async_op=True)


def gather(input: Tensor, outputs: list[Tensor] | None, dst_group_rank: int, group) -> dist.Work:
    """``outputs[r]`` on group rank ``dst_group_rank`` ← group rank ``r``'s ``input`` (equal
    sizes; ``outputs`` only there); async."""
    dst = dist.get_global_rank(group, dst_group_rank)
    return dist.gather(input, outputs, dst=dst, group=group, async_op=True)


def all_gather_digests(digest: str, group, device: torch.device) -> list[str]:
    """Every rank's hex digest (64 hex chars), gathered as a uint8 tensor: no pickling."""
    raw = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=device)
    out = torch.empty(dist.get_world_size(group) * raw.numel(), dtype=torch.uint8, device=device)
    _all_gather(out, raw, group=group, async_op=False)
    chunks = out.view(-1, raw.numel()).cpu().tolist()
    return [bytes(c).hex() for c in chunks]


def scalar_device(fallback: torch.device | None = None) -> torch.device:
    """Where a small flag/norm tensor can be all-reduced: CUDA for NCCL, the CPU for gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if dist.is_initialized() or fallback is None else fallback


# (default process group, {rank lists of every peer group: the groups created for them}):
# dedicate_params on a second model over the same mesh reuses the communicators instead of
# creating a new NCCL communicator per call. Reset when the default group changes.
_PRIVATE_GROUPS: list = [None, {}]


def default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (the user's ``init_process_group(timeout=...)``).

    ``new_group`` would otherwise give the runtime's groups torch's own default (30 minutes on
    gloo, 10 on NCCL), and a frozen peer would hold every survivor in a dedicated collective
    for that long while FSDP2's collectives give up at the user's timeout.
    """
    if not dist.is_initialized():
        return None
    return backend_timeout(default_group())


def group_timeout(group) -> datetime.timedelta | None:
    """``group``'s timeout where the backend exposes it (gloo, NCCL), else ``None``."""
    return backend_timeout(group)


def is_done(work) -> bool:
    """Whether an async collective has finished (profiling counters only: ``False`` where the
    backend does not implement ``is_completed``)."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return False


def wait(work, what: str, group) -> None:
    """``work.wait()``; a failure (a peer died, froze or skipped the collective) is re-raised
    naming the collective, the group and its timeout, on every rank that waits."""
    try:
        work.wait()
    except Exception as err:  # noqa: BLE001 - re-raised with what failed and what to do
        raise RuntimeError(
            f"dmuon_compile: {what} over ranks {_ranks(group)} failed (group timeout "
            f"{group_timeout(group)}): {err}. A peer rank died, froze or did not issue the same "
            "collective: see the other ranks' logs. The dedicated runtime's groups use the "
            "default process group's timeout (init_process_group(timeout=...)), or the one "
            "passed to dmuon.dedicate_params(timeout=...)."
        ) from err


def wait_finished(work, what: str, group, poll_s: float = 1e-3) -> None:
    """Block the host until ``work`` has really finished on this rank, or raise by the group's
    timeout naming it (``work.wait()`` alone only orders the current CUDA stream after it).

    For a collective whose result is dropped (``Muon.zero_grad`` after an exception): returning
    while it is still pending would let this rank issue its next collective on the group while
    a peer that never issued this one pairs that next collective with it (a hang or garbage).
    """
    wait(work, what, group)
    if _host_blocking(group) or _finished(work):
        return  # gloo's wait() returned: the collective completed (its works may not say so)
    timeout = group_timeout(group)
    deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 1800.0)
    while not _finished(work):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"dmuon_compile: {what} over ranks {_ranks(group)} did not finish within the group "
                f"timeout {timeout}: a peer rank did not issue it (an exception on some ranks "
                "only in forward or backward, not caught on every rank). The ranks' collectives "
                "no longer pair: restart from a checkpoint; catch such exceptions on every rank."
            )
        time.sleep(poll_s)


def _ranks(group):
    """The group's global ranks, for an error message (``"?"`` without a group)."""
    return dist.get_process_group_ranks(group) if group is not None else "?"


def _host_blocking(group) -> bool:
    """Whether ``Work.wait()`` blocks the host until the collective completed (gloo)."""
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def _finished(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a backend without it: wait() was a real wait there
        return True


def private_group(mesh, timeout: datetime.timedelta | None = None):
    """A process group of ``mesh``'s ranks that only the dedicated runtime uses.

    FSDP2 issues its own collectives on the mesh's group from its own streams. Sharing one
    NCCL communicator serialises the two runtimes' collectives against each other (FSDP2's small
    all-gathers wait behind ours), so the dedicated parameters get a communicator of their own
    over the same ranks. Collective over the
    default group: every rank calls it, in the same order (``dedicate_params`` does). A mesh
    whose peer groups do not partition the world keeps the mesh's group.
    """
    if not dist.is_initialized():
        return mesh.get_group()
    order = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    world = dist.get_world_size()
    if len(order) == world:  # one mesh over every rank: every rank sees the same order
        groups = [order]
    else:  # each rank knows its own group only: gather all of them, decide together
        gathered: list = [None] * world
        dist.all_gather_object(gathered, order)
        groups = sorted(set(gathered))
    partition = sorted(r for g in groups for r in g) == list(range(world))
    # new_group numbers ranks in ascending order; the runtime uses the mesh's local ranks.
    if not partition or any(list(g) != sorted(g) for g in groups):
        return mesh.get_group()
    default = default_group()
    if _PRIVATE_GROUPS[0] is not default:
        _PRIVATE_GROUPS[:] = [default, {}]
    timeout = timeout if timeout is not None else default_timeout()
    key = (tuple(groups), timeout)
    created = _PRIVATE_GROUPS[1].get(key)
    if created is None:  # every rank creates every group, in the same order (the key is shared)
        created = _PRIVATE_GROUPS[1][key] = {
            ranks: dist.new_group(ranks=list(ranks), timeout=timeout) for ranks in groups
        }
    return created[order]
