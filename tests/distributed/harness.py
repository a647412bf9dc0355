"""One small multi-process harness for the distributed tests: spawned processes, gloo on CPU.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each runs
``fn(rank, world_size, *args)`` inside an initialised gloo process group, and returns the
per-rank results (tensors come back as CPU tensors). A rank that raises makes the call raise
with that rank's traceback; a run that outlives ``timeout`` kills every process and fails —
a distributed test never hangs.

A rank killed by the C runtime (SIGABRT, SIGSEGV or SIGBUS: a heap corruption or fault inside
torch's or gloo's native code, which Python code cannot cause) makes :func:`run_ranks` run the
whole call again, once, with a warning that names the signal; a second crash fails the test.
Exceptions, assertion failures and timeouts are never retried.

``device="cuda"`` runs every rank on ``cuda:0`` (still gloo, on CUDA tensors): several ranks
share one GPU, which exercises CUDA streams, events and the allocator with several ranks on a
one-GPU machine. ``backend="nccl"`` puts rank r on ``cuda:r`` instead (one GPU per rank).
Inside a worker, :func:`local_device` is the device this rank computes on.

:func:`train_steps` is the training loop the distributed tests share (and their one-process
references): each global batch's slice for this rank, forward, backward, step, zero_grad, the
loss averaged over the ranks.

Rendezvous: the launcher (this process) binds a ``TCPStore`` on port 0 and keeps it for the
whole run; the workers connect to it as clients. No port is ever chosen, released and bound
again, so two runs (or another program) cannot take each other's port.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp
from native_crash import NATIVE_CRASH_RETRIES, NATIVE_CRASH_SIGNALS  # tests/ is on sys.path

DEFAULT_TIMEOUT_S = 90.0
# Set by tests/conftest.py while a test without the ``distributed`` marker runs (tests/tiers.py).
NOT_DISTRIBUTED_ENV = "DMUON_TEST_NOT_DISTRIBUTED"
DEVICES = ("cpu", "cuda")


def local_device(device: str) -> torch.device:
    """The device this rank computes on, inside a worker: the CPU, or the CUDA device the harness
    made current (``cuda:0`` for every rank with ``device="cuda"``, ``cuda:rank`` with NCCL)."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


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


def _worker(fn, rank, world_size, store_port, args, env, results, backend, pg_timeout_s, device):
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    faulthandler.enable(all_threads=True)  # a crashed rank prints where (the parent says "died")
    # a hung rank prints where when the launcher gives up on it (_dump_stacks)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    shared_gpu = device == "cuda" and backend != "nccl"
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        # DeviceMesh sets the current CUDA device from LOCAL_RANK when CUDA is not initialised
        LOCAL_RANK="0" if shared_gpu else str(rank),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif shared_gpu:
            torch.cuda.set_device(0)
            torch.cuda.init()  # initialised: DeviceMesh keeps cuda:0 instead of choosing one
        timeout = (
            datetime.timedelta(seconds=pg_timeout_s)
            if pg_timeout_s is not None
            else default_pg_timeout
        )
        # a client of the launcher's store (the rendezvous env:// would use, with its timeout)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, False, timeout=timeout)
        kwargs = {"timeout": timeout} if pg_timeout_s is not None else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
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


class _Launch:
    """The spawned workers, their result queue and the rendezvous store they connect to.

    The store is bound to port 0 here, in the launcher, and lives until :meth:`stop`: the port
    is never released while the workers may still connect to it.
    """

    def __init__(self, fn, world_size, args, env, backend, pg_timeout_s, device):
        import torch.distributed as dist

        if device not in DEVICES:
            raise ValueError(f"device={device!r}: the harness runs ranks on one of {DEVICES}")
        unmarked = os.environ.get(NOT_DISTRIBUTED_ENV)
        if unmarked:
            raise RuntimeError(
                f"{unmarked} spawns ranks but is not marked @pytest.mark.distributed "
                '(the fast tier, -m "not distributed and not slow", would run it)'
            )
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' needs a CUDA GPU (DMUON_TIER_DEVICE=cpu runs on CPU)")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise RuntimeError(
                f"backend='nccl' puts rank r on cuda:r: {world_size} ranks need {world_size} GPUs, "
                f"this machine has {torch.cuda.device_count()}; device='cuda' with gloo shares one"
            )
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    self.store.port,
                    args,
                    env,
                    self.results,
                    backend,
                    pg_timeout_s,
                    device,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def stop(self, grace_s: float) -> None:
        """Join each worker for ``grace_s``, kill the rest (SIGKILL also ends a SIGSTOPped
        process), then close the store."""
        for p in self.procs:
            if p.is_alive():
                p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.store = None


def _raise_first_error(got: dict, ranks) -> None:
    errors = {r: msg for r, (st, msg) in got.items() if st == "error" and r in ranks}
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")


class NativeCrash(RuntimeError):
    """A worker died of a signal raised in native code (see :data:`NATIVE_CRASH_SIGNALS`)."""


def _native_crashes(launch, wait_s: float) -> dict[int, str]:
    """``{rank: signal name}`` of the workers that died of a native crash; waits up to
    ``wait_s`` for a crashing worker to finish dying (faulthandler is still printing)."""
    deadline = time.monotonic() + wait_s
    crashed: dict[int, str] = {}
    for rank, p in enumerate(launch.procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if p.is_alive() else 0)
        code = p.exitcode
        if code is not None and code < 0 and -code in NATIVE_CRASH_SIGNALS:
            crashed[rank] = signal.Signals(-code).name
    return crashed


def _dump_stacks(launch, wait_s: float = 3.0) -> None:
    """Ask every live worker to print its threads' Python stacks to stderr (faulthandler's
    SIGUSR1), so a timed-out test shows where each rank waited."""
    for p in launch.procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(wait_s)


def _run_once(fn, world_size, args, env, backend, device, timeout) -> dict[int, tuple]:
    launch = _Launch(fn, world_size, args, env, backend, None, device)
    deadline = time.monotonic() + timeout
    got: dict[int, tuple] = {}
    failed = False
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks(launch)
                raise TimeoutError(
                    f"distributed test did not finish within {timeout:.0f}s "
                    f"(ranks done: {sorted(got)}); killed all ranks (their stacks: stderr)"
                )
            try:
                rank, status, payload = launch.results.get(timeout=min(left, 1.0))
                got[rank] = (status, payload)
                if status == "error":
                    failed = True
                    break  # other ranks may now wait forever on a collective: stop them
            except queue.Empty as empty:
                procs = launch.procs
                dead = [
                    i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got
                ]
                if dead:
                    failed = True
                    crashed = _native_crashes(launch, wait_s=0)
                    if crashed:
                        raise NativeCrash(f"ranks died of {crashed}") from empty
                    raise RuntimeError(
                        f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                    ) from empty
        if failed:
            # a peer's native crash shows on the other ranks as a lost connection
            crashed = _native_crashes(launch, wait_s=2.0)
            if crashed:
                errors = {r: msg.splitlines()[0] for r, (st, msg) in got.items() if st == "error"}
                raise NativeCrash(f"ranks died of {crashed}; the others reported {errors}")
    finally:
        launch.stop(grace_s=0.5 if len(got) == world_size else 0)
    return got


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    backend: str = "gloo",
    device: str = "cpu",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    gloo on the CPU by default; ``device="cuda"``: gloo with every rank on ``cuda:0``;
    ``backend="nccl"``: rank r on ``cuda:r``. ``env`` is set in each worker before anything
    else (e.g. ``CUDA_LAUNCH_BLOCKING``). A native crash of a rank reruns the call once."""
    if backend == "nccl":
        device = "cuda"
    for attempt in range(NATIVE_CRASH_RETRIES + 1):
        try:
            got = _run_once(fn, world_size, args, dict(env or {}), backend, device, timeout)
            break
        except NativeCrash as crash:
            if attempt == NATIVE_CRASH_RETRIES:
                raise
            warnings.warn(
                f"{getattr(fn, '__name__', fn)}: {crash}; running the call again",
                RuntimeWarning,
                stacklevel=2,
            )
    _raise_first_error(got, range(world_size))
    return [_restore(got[r][1]) for r in range(world_size)]


def run_ranks_with_victim(
    fn,
    world_size: int,
    victim: int,
    *args,
    timeout: float,
    pg_timeout_s: float,
    env: dict | None = None,
    device: str = "cpu",
) -> dict:
    """Run ``fn`` where rank ``victim`` is expected to die or freeze (it kills or stops itself):
    ``{rank: result}`` of every other rank, each of which must report within ``timeout``.
    The process group gets ``pg_timeout_s``; every process is killed at the end."""
    launch = _Launch(fn, world_size, args, dict(env or {}), "gloo", pg_timeout_s, device)
    deadline = time.monotonic() + timeout
    got: dict[int, tuple] = {}
    survivors = set(range(world_size)) - {victim}
    try:
        while not survivors <= set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks(launch)
                raise TimeoutError(
                    f"survivors {sorted(survivors - set(got))} did not finish within "
                    f"{timeout:.0f}s after rank {victim} died or froze: a hang"
                )
            try:
                rank, status, payload = launch.results.get(timeout=min(left, 1.0))
                got[rank] = (status, payload)
            except queue.Empty:
                continue
    finally:
        launch.stop(grace_s=0)
    _raise_first_error(got, survivors)
    return {r: _restore(got[r][1]) for r in survivors}


def run_ranks_expect_errors(
    fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs
) -> dict:
    """Like :func:`run_ranks` (``env``, ``device`` too) but returns ``{rank: error text or
    None}`` (every rank must end)."""
    out = run_ranks(_catching, world_size, fn, *args, timeout=timeout, **kwargs)
    return dict(enumerate(out))


def _catching(rank, world_size, fn, *args):
    try:
        fn(rank, world_size, *args)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def whole_tensor(p, plain_collectives: bool | None = None):
    """``p.full_tensor()``, also on gloo ranks that share a GPU: DTensor gathers with functional
    collectives, which crash the process on CUDA tensors over gloo (torch 2.11), so there every
    rank's piece goes, as a CPU tensor with its global offset, through one ``all_gather_object``
    and is placed by offset. Dedicated weights gather themselves (broadcasts).
    ``plain_collectives`` forces (``True``) or forbids (``False``) that path (tests of it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from dmuon_compile.distributed._owner.tensor import OwnerTensor

    if not isinstance(p, DTensor) or isinstance(p, OwnerTensor):
        return p.full_tensor()
    if plain_collectives is None:
        plain_collectives = p.device.type != "cpu" and dist.get_backend() == "gloo"
    if not plain_collectives:
        return p.full_tensor()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local().detach().cpu()
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(offset), tuple(shape), local))
    whole = torch.zeros(p.shape, dtype=p.dtype)
    for off, shp, piece in pieces:
        if piece is None or piece.numel() == 0:
            continue
        index = tuple(slice(o, o + n) for o, n in zip(off, shp))
        whole[index] = piece.reshape(shp)
    return whole.to(p.device)


def full_state(model) -> dict:
    """Every parameter whole: FSDP2 DTensors via full_tensor(), dedicated ones from their owner
    (HSDP: from this shard group's member of the owner column, after draining the publish)."""
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime

    state = {n: whole_tensor(p).detach().clone() for n, p in model.named_parameters()}
    runtime = dedicated_runtime(model)
    runtime.wait_all()
    for dp in runtime.params:
        device = runtime.groups[0].device
        # On the group's device (an offloaded master lives in host memory), in the master's
        # dtype on every rank (an HSDP replica is in the compute dtype).
        buf = (
            dp.source.detach().to(device, dp.orig_dtype, copy=True)
            if dp.source is not None
            else torch.empty(dp.shape, device=device, dtype=dp.orig_dtype)
        )
        dist.broadcast(
            buf,
            src=dist.get_global_rank(runtime.mesh.get_group(), dp.owner),
            group=runtime.mesh.get_group(),
        )
        state[dp.fqn] = buf
    return state


def _square_mean(model, x):
    return model(x).square().mean()


def train_steps(
    model,
    opt,
    batches,
    rank: int = 0,
    world: int = 1,
    *,
    device=None,
    loss_fn=None,
    on_first_grads=None,
    after_step=None,
    between=None,
    mean: bool = True,
) -> list[float]:
    """The distributed tests' training loop: per global batch ``x`` (step ``i``),

    1. this rank's slice ``x[rank * per : (rank + 1) * per]``, ``per = len(x) // world``
       (``world == 1``: the whole batch; ``rank``/``world`` are the data-parallel rank and size,
       so TP ranks of one DP rank get the same slice), moved to ``device`` if given;
    2. ``loss = loss_fn(model, slice)`` (default ``model(slice).square().mean()``), then
       ``loss.backward()``; after the first backward ``on_first_grads()``;
    3. ``opt.step()``, ``after_step(i)`` (e.g. a second ``opt.step()``), ``opt.zero_grad()``;
    4. the step's loss: with ``mean`` the mean over all ranks of the default group (all-reduced
       sum / group size; the local loss when no process group is up: a one-process reference),
       without it this rank's own loss; then ``between(i)`` (edits or checks between steps).

    Returns the losses as Python floats."""
    import torch.distributed as dist

    losses = []
    for i, x in enumerate(batches):
        if world > 1:
            per = x.shape[0] // world
            x = x[rank * per : (rank + 1) * per]
        if device is not None:
            x = x.to(device)
        loss = (loss_fn or _square_mean)(model, x)
        loss.backward()
        if i == 0 and on_first_grads is not None:
            on_first_grads()
        opt.step()
        if after_step is not None:
            after_step(i)
        opt.zero_grad()
        if mean and dist.is_available() and dist.is_initialized():
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        else:
            losses.append(loss.item())
        if between is not None:
            between(i)
    return losses
