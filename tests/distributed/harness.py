"""One small multi-process harness for the distributed tests: gloo on CPU, spawned processes.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each runs
``fn(rank, world_size, *args)`` inside an initialised gloo process group, and returns the
per-rank results (tensors come back as CPU tensors). A rank that raises makes the call raise
with that rank's traceback; a run that outlives ``timeout`` kills every process and fails —
a distributed test never hangs.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _portable(obj):
    if isinstance(obj, torch.Tensor):
        return ("__tensor__", obj.detach().cpu().clone().numpy())
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _restore(obj):
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore(v) for v in obj)
    return obj


def _worker(fn, rank, world_size, port, args, env, results, backend="gloo", pg_timeout_s=None):
    import datetime

    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        kwargs = {}
        if pg_timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _portable(out)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - teardown must not mask the result
                pass


def _start(fn, world_size: int, args, env: dict, backend: str, pg_timeout_s=None):
    """Spawn the ``world_size`` worker processes; return them and their result queue."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, env, results, backend, pg_timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, results


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    backend: str = "gloo",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo; ``backend="nccl"``
    puts rank r on cuda:r); return their results."""
    procs, results = _start(fn, world_size, args, dict(env or {}), backend)
    import time

    deadline = time.monotonic() + timeout
    got: dict[int, tuple] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"distributed test did not finish within {timeout:.0f}s "
                    f"(ranks done: {sorted(got)}); killed all ranks"
                )
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
                got[rank] = (status, payload)
                if status == "error":
                    break  # other ranks may now wait forever on a collective: stop them
            except queue.Empty as empty:
                dead = [
                    i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got
                ]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                    ) from empty
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if len(got) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: msg for r, (st, msg) in got.items() if st == "error"}
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [_restore(got[r][1]) for r in range(world_size)]


def run_ranks_with_victim(
    fn, world_size: int, victim: int, *args, timeout: float, pg_timeout_s: float
) -> dict:
    """Run ``fn`` where rank ``victim`` is expected to die or freeze (it kills or stops itself):
    ``{rank: result}`` of every other rank, each of which must report within ``timeout``.
    The process group gets ``pg_timeout_s``; every process is killed at the end."""
    import time

    procs, results = _start(fn, world_size, args, {}, "gloo", pg_timeout_s)
    deadline = time.monotonic() + timeout
    got: dict[int, tuple] = {}
    survivors = set(range(world_size)) - {victim}
    try:
        while not survivors <= set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"survivors {sorted(survivors - set(got))} did not finish within "
                    f"{timeout:.0f}s after rank {victim} died or froze: a hang"
                )
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
                got[rank] = (status, payload)
            except queue.Empty:
                continue
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a SIGSTOPped process
                p.join(timeout=5)
    errors = {r: msg for r, (st, msg) in got.items() if st == "error" and r in survivors}
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return {r: _restore(got[r][1]) for r in survivors}


def run_ranks_expect_errors(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Like :func:`run_ranks` but returns ``{rank: error text or None}`` (every rank must end)."""
    out = run_ranks(_catching, world_size, fn, *args, timeout=timeout)
    return dict(enumerate(out))


def _catching(rank, world_size, fn, *args):
    try:
        fn(rank, world_size, *args)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def full_state(model) -> dict:
    """Every parameter whole: FSDP2 DTensors via full_tensor(), dedicated ones from their owner
    (HSDP: from this shard group's member of the owner column, after draining the publish)."""
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime

    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    runtime = dedicated_runtime(model)
    runtime.wait_all()
    for dp in runtime.params:
        device = runtime.groups[0].device
        buf = (
            dp.source.detach().clone()
            if dp.source is not None
            else torch.empty(dp.shape, device=device)
        )
        dist.broadcast(
            buf,
            src=dist.get_global_rank(runtime.mesh.get_group(), dp.owner),
            group=runtime.mesh.get_group(),
        )
        state[dp.fqn] = buf
    return state
