"""Process setup and model wrapping for the training demo.

:func:`setup` reads the ``torchrun`` environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), picks
the device (CUDA when available, else CPU) and the matching backend (NCCL / gloo), and starts
the process group when there is more than one process.

:func:`parallelize` wraps a freshly built model for one optimizer run:

- one process: the plain model;
- ``dmuon`` (default): ``dmuon.dedicate_params`` gives every ``*_proj.weight`` an owner rank,
  then ``fully_shard`` wraps each block and the root — the documented order (after TP, before
  ``fully_shard``);
- ``dmuon`` with ``--no-dedicate`` (the naive baseline): ``fully_shard`` with the ``*_proj``
  matrices as ``ignored_params`` (kept whole on every rank) and their gradients averaged by
  one flat all-reduce after backward (:meth:`Wrapped.sync_grads`), so ``Muon`` still sees
  whole matrices;
- ``adamw``: plain FSDP2 on every parameter (the standard baseline).

With ``--tp T`` the processes form the mesh ``(world / T, T)`` named ``("dp", "tp")``; every
block's attention and MLP projections are made column-parallel in (q/k/v, gate/up) and
row-parallel out (o, down) by ``parallelize_module`` on ``mesh["tp"]`` (:func:`tp_owners`) before
anything else, then ``dedicate_params`` and ``fully_shard`` run over ``mesh["dp"]``. The ranks
of one TP group read the same rows of the global batch (:attr:`DistEnv.dp_rank`).

Precision (:func:`resolve_precision`): ``bf16`` (the default on CUDA) gives every
``fully_shard`` call ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and
``dedicate_params`` ``ParamPolicy(defaults=MixedPrecision(param_dtype=bf16))``, so the dedicated
weights compute in bf16 and reduce in fp32 like FSDP2's; masters and optimizer state stay fp32.
Weights outside FSDP2 (one process, the ``--no-dedicate`` matrices) compute under
``torch.autocast`` instead (:meth:`Wrapped.autocast`). ``fp32`` (the default on CPU) casts
nothing.

:func:`compile_blocks` compiles each block (``block.compile()``, torchtitan's per-block
compile) after wrapping: FSDP2's and ``dedicate_params``' hooks run eagerly around the
compiled blocks.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import dmuon_compile as dmuon
from dmuon_compile.train.model import is_matrix_param

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")
DEDICATED = "dedicate_params + FSDP2"
REPLICATED = "FSDP2 + whole matrices replicated, gradients all-reduced"


@dataclass
class DistEnv:
    """Where this process runs: rank, world size, device and collective backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    mesh: DeviceMesh | None = None  # the data-parallel mesh (FSDP2 and dedicate_params)
    tp: int = 1
    tp_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own slice of the global batch."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's slice of the batch: the same on every rank of one TP group."""
        return self.mesh.get_local_rank() if self.tp > 1 else self.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        if not self.distributed:
            return f"1 process on {self.device}"
        tp = f", dp {self.dp_size} × tp {self.tp}" if self.tp > 1 else ""
        return f"{self.world_size} processes ({self.backend}) on {self.device.type}{tp}"


def env_world_size() -> int:
    """``WORLD_SIZE`` from the launcher (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """``RANK`` from the launcher (0 without one)."""
    return int(os.environ.get("RANK", "0"))


def available_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (a
    container limited to 2 CPUs still shows the host's cores to ``os.cpu_count()`` and to
    torch's default thread count)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def _cgroup_cpus() -> float | None:
    """The cgroup CPU quota in CPUs (v2 ``cpu.max``, v1 ``cfs_quota_us``), ``None`` if none."""
    for path, split in (
        ("/sys/fs/cgroup/cpu.max", lambda text: text.split()[:2]),
        (
            "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
            lambda text: [text, Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text()],
        ),
    ):
        try:
            quota, period = split(Path(path).read_text().strip())
            quota, period = int(quota), int(period)
        except (OSError, ValueError):  # no such file, "max", a malformed line
            continue
        if quota > 0 and period > 0:
            return quota / period
    return None


def choose_threads(environ=None, cores: int | None = None, current: int | None = None):
    """``(threads, why)``: the intra-op thread count the demo sets, or ``(None, "")`` to keep
    torch's. Only when ``OMP_NUM_THREADS`` is unset and torch would run more threads than the
    cores each local process has (``cores // LOCAL_WORLD_SIZE``): oversubscribed cores slow
    every process down."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, ""
    cores = available_cores() if cores is None else cores
    current = torch.get_num_threads() if current is None else current
    local = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    per_process = max(1, cores // local)
    if current <= per_process:
        return None, ""
    why = (
        f"OMP_NUM_THREADS is unset and torch would run {current} threads per process on "
        f"{cores} available core(s) for {local} process(es): using {per_process} "
        "(set OMP_NUM_THREADS to choose)"
    )
    return per_process, why


def set_default_threads(say=print) -> int | None:
    """Apply :func:`choose_threads` to this process; ``say`` gets the one log line."""
    threads, why = choose_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        say(f"threads: {why}")
    return threads


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` → ``cuda:<local_rank>`` when CUDA is available, else ``cpu``.

    Raises ``ValueError`` naming the fix when ``cuda`` is requested without a GPU.
    """
    if requested not in DEVICES:
        raise ValueError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda, but this machine has no usable CUDA GPU; use --device cpu or auto"
            )
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                "start at most that many processes per node (torchrun --nproc_per_node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` → ``bf16`` on CUDA, ``fp32`` elsewhere (CPUs have no fast bf16 matmul)."""
    if requested not in PRECISIONS:
        raise ValueError(f"--precision {requested!r}: choose one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return requested


def setup(requested_device: str = "auto", tp: int = 1) -> DistEnv:
    """Start the process group if launched with several processes; return the environment.

    ``tp`` > 1 (it must divide the world size) builds the ``("dp", "tp")`` mesh."""
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tp < 1 or world % tp:
        raise ValueError(
            f"--tp {tp} must divide the number of processes ({world}); "
            f"start a multiple of {tp} processes (torchrun --nproc_per_node)"
        )
    env = DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, tp=tp)
    if world > 1:
        env.backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(env.backend, **kwargs)
        from torch.distributed.device_mesh import init_device_mesh

        if tp > 1:
            mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
            env.mesh, env.tp_mesh = mesh["dp"], mesh["tp"]
        else:
            env.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return env


def teardown(env: DistEnv) -> None:
    """Destroy the process group this module started.

    Every rank first drops the run's objects and meets at a barrier: gloo's worker threads can
    otherwise still hold finished work (and tensors) when the group is destroyed, which aborted
    the process at exit ("terminate called without an active exception") about one run in five
    on CPU.
    """
    if env.distributed and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


@dataclass
class Wrapped:
    """A model ready for one optimizer run, plus what the loop needs to know about it."""

    model: nn.Module
    mode: str
    replicated: list[nn.Parameter] = field(default_factory=list)
    world_size: int = 1
    dedicated: bool = False  # dedicate_params ran (its runtime has profiles and broadcasts)
    # bf16 compute of weights FSDP2 does not cast (one process, --no-dedicate's matrices)
    autocast_dtype: torch.dtype | None = None

    def autocast(self):
        """The context every forward runs in: ``torch.autocast`` where FSDP2's
        ``MixedPrecisionPolicy`` does not cover all weights, else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    @property
    def has_explicit_comm(self) -> bool:
        """Whether :meth:`sync_grads` communicates (its time is exposed communication)."""
        return bool(self.replicated) and self.world_size > 1

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average the gradients of whole (replicated) matrices across ranks; no-op otherwise.

        One flat all-reduce after backward: synchronous, so all of its time is exposed.
        """
        if not self.has_explicit_comm:
            return
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if len(grads) != len(self.replicated):
            raise RuntimeError(
                "a replicated matrix got no gradient; every rank must run the same forward"
            )
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _fully_shard(
    model: nn.Module, mesh, ignored: set | None = None, precision: str = "fp32"
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if ignored:
        kwargs["ignored_params"] = ignored
    if precision == "bf16":  # compute in bf16, reduce gradients in fp32 (masters stay fp32)
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def tp_owners(model: nn.Module) -> dict:
    """The demo's TP plan (torchtitan's for Llama): q/k/v and gate/up column-parallel, o/down
    row-parallel; embeddings, norms and the head stay replicated over TP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def _dedicate(model: nn.Module, mesh, precision: str = "fp32") -> None:
    """The one call into the distributed runtime: dedicate every ``*_proj.weight``.

    ``bf16``: the dedicated weights compute in bf16 like FSDP2's; without a ``reduce_dtype`` of
    their own they reduce in FSDP2's (fp32), see :func:`_fully_shard`.

    ``DMUON_RECORD_FORWARD_PROFILE=1`` (unless the user set it) makes the runtime count the
    forward-unshard waits that the end-of-run breakdown reports as exposed communication.
    """
    os.environ.setdefault("DMUON_RECORD_FORWARD_PROFILE", "1")
    policy = None
    if precision == "bf16":
        policy = dmuon.ParamPolicy(defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16))
    dmuon.dedicate_params(model, mesh, predicate=is_matrix_param, param_policy=policy)


def parallelize(
    model: nn.Module,
    env: DistEnv,
    optimizer: str,
    dedicate: bool = True,
    precision: str = "fp32",
) -> Wrapped:
    """Wrap ``model`` (already on ``env.device``) for ``optimizer`` (``dmuon`` or ``adamw``) in
    ``precision`` (``bf16`` or ``fp32``, see the module doc).

    ``dedicate=False`` (``--no-dedicate``) takes the replicated-matrices path: the naive
    baseline that ``dedicate_params`` replaces.
    """
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, got {precision!r}")
    uncast = torch.bfloat16 if precision == "bf16" else None  # autocast for weights FSDP2 skips
    if not env.distributed:
        return Wrapped(model, "single process", autocast_dtype=uncast)
    tp = ""
    if env.tp > 1:  # TP first, then dedicate_params and fully_shard over the dp mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if not dedicate and optimizer != "adamw":
            raise ValueError("--no-dedicate has no TP version: drop --tp or --no-dedicate")
        parallelize_module(model, env.tp_mesh, tp_owners(model))
        tp = f"TP {env.tp} + "
    if optimizer == "adamw":
        _fully_shard(model, env.mesh, precision=precision)
        return Wrapped(model, f"{tp}FSDP2", world_size=env.world_size)
    if dedicate:
        _dedicate(model, env.mesh, precision)
        _fully_shard(model, env.mesh, precision=precision)
        return Wrapped(model, tp + DEDICATED, world_size=env.world_size, dedicated=True)
    matrices = [p for name, p in model.named_parameters() if is_matrix_param(name, p)]
    _fully_shard(model, env.mesh, ignored=set(matrices), precision=precision)
    return Wrapped(
        model,
        REPLICATED,
        replicated=matrices,
        world_size=env.world_size,
        autocast_dtype=uncast,
    )


COMPILE_BACKEND = "inductor"  # torch.compile's backend for the blocks (tests use a faster one)


def compile_blocks(model: nn.Module) -> None:
    """``block.compile()`` on every block, after wrapping (the hooks stay eager around it)."""
    for block in model.blocks:
        block.compile(backend=COMPILE_BACKEND)


def broadcast_path(path, env: DistEnv):
    """Rank 0's ``path`` on every rank (the run directory is chosen on rank 0)."""
    if not env.distributed:
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else Path(box[0])


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of a tensor over ranks (identity with one process)."""
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= env.world_size
    return value


def runtime_comm_profile(wrapped: Wrapped):
    """The runtime's forward-unshard wait profile of a dedicated run (else ``None``)."""
    if not wrapped.dedicated:
        return None
    try:
        profile = dmuon.collect_forward_unshard_profile(wrapped.model, synchronize=True)
    except Exception as exc:  # noqa: BLE001 - a diagnostics failure must not end the run
        return {"enabled": False, "reason": f"{type(exc).__name__}: {exc}"}
    return (
        profile
        if isinstance(profile, dict)
        else {"enabled": False, "reason": f"unexpected {profile!r}"}
    )


def profile_wait_ms(wrapped: Wrapped) -> float | None:
    """Total time (ms) this rank waited in the runtime's unshard collectives so far, or ``None``."""
    profile = runtime_comm_profile(wrapped)
    if not profile or not profile.get("enabled"):
        return None
    try:
        return 1e3 * float(profile["total"]["wait_s"])
    except (KeyError, TypeError, ValueError):
        return None


def comm_source(wrapped: Wrapped) -> tuple[str, str]:
    """How exposed communication is measured for this run: ``(kind, explanation)``.

    kinds: ``"none"`` (one process), ``"explicit"`` (the synchronous gradient all-reduce of
    whole matrices, its own phase), ``"profile"`` (the runtime's unshard waits, which happen
    inside forward/backward) and ``"n/a"``.
    """
    if wrapped.world_size == 1:
        return "none", "one process: no communication"
    if wrapped.has_explicit_comm:
        return "explicit", (
            "synchronous all-reduce of the whole matrices' gradients; FSDP2's own collectives "
            "are inside forward/backward"
        )
    if wrapped.dedicated:
        if profile_wait_ms(wrapped) is not None:
            return "profile", (
                "waits for dedicated-weight unshards, from dmuon.collect_forward_unshard_profile; "
                "part of forward/backward above"
            )
        reason = (runtime_comm_profile(wrapped) or {}).get(
            "reason", "the runtime offers no profile"
        )
        return "n/a", f"n/a: {reason}"
    return "n/a", (
        "n/a: FSDP2's all-gathers/reduce-scatters run inside forward/backward and FSDP2 "
        "exposes no wait profile to separate them"
    )
