"""One training run (one optimizer) and the comparison driver.

Each run builds the model from the same seed (identical initial weights on every rank and for
every optimizer), wraps it (:func:`runtime.parallelize`), and trains on the same sequence of
global batches. Per step: forward → backward → gradient sync of whole matrices (fallback
mode only) → optimizer step, each phase timed. Validation runs before the first step, every
``eval_every`` steps and after the last one, on a fixed set of held-out windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import dmuon_compile as dmuon
from dmuon_compile.train import checkpointing, runtime
from dmuon_compile.train.data import Corpus, WindowSampler
from dmuon_compile.train.metrics import CsvLog, PhaseTimer, Progress, breakdown_table
from dmuon_compile.train.model import GPT, GPTConfig, is_matrix_param

OPTIMIZERS = ("dmuon", "adamw")
VAL_SEED_OFFSET = 7919
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1


@dataclass
class TrainConfig:
    """Everything a run needs besides the corpus and the process environment.

    The defaults are sized for a few minutes on 2 CPU cores. The learning rates come from a
    sweep on this model: at this size Muon does best at 0.005, below the package's general
    starting point of 0.02.
    """

    steps: int = 600
    batch_size: int = 16  # global, split across ranks
    seq_len: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 0.005
    adamw_lr: float = 3e-3
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    precision: str = "fp32"  # bf16: FSDP2 MixedPrecisionPolicy + dmuon.ParamPolicy (runtime)
    compile_model: bool = False  # per-block torch.compile
    momentum_dtype: str = "fp32"  # the Muon momentum's storage: fp32, bf16 or int8 (Muon's)
    offload: str | None = None  # "momentum": kept in host memory between steps (Muon's)
    keep_new_momentum: bool = False  # buf′ kept to the commit and swapped in (Muon's)


def model_sizes(cfg) -> dict:
    """The sizes a checkpoint records and a resume must match (``checkpointing.MODEL_FLAGS``):
    from a ``TrainConfig`` or the command line's namespace."""
    return {key: getattr(cfg, key) for key in checkpointing.MODEL_FLAGS}


@dataclass
class RunResult:
    """What one run reports to the driver and the tests."""

    optimizer: str
    mode: str
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    timed_steps: int = 0
    phase_ms: dict[str, float] = field(default_factory=dict)
    timed_wall_ms: float = 0.0
    comm_kind: str = "n/a"
    comm_note: str = ""
    comm_profile: dict | None = None  # runtime.runtime_comm_profile's
    train_time_s: float = 0.0  # training steps only (no validation, no checkpoints), whole run
    tokens_per_step: int = 0
    mfu: float | None = None  # set by the driver, which knows the peak
    compute_dtype: str = ""  # the logits' dtype: what the model computed in

    @property
    def tokens_per_s(self) -> float:
        """Steady-state rate: the timed steps (first interval after a start excluded)."""
        return self.timed_steps * self.tokens_per_step / max(self.timed_wall_ms / 1e3, 1e-9)

    @property
    def first_val(self) -> float:
        return self.val_losses[0][1] if self.val_losses else float("nan")

    @property
    def final_val(self) -> float:
        return self.val_losses[-1][1] if self.val_losses else float("nan")

    def breakdown(self) -> str:
        return breakdown_table(
            f"{self.optimizer}, {self.mode}",
            self.phase_ms,
            self.timed_steps,
            self.timed_wall_ms,
            self.comm_kind,
            self.comm_note,
        )


def lr_lambda(total_steps: int):
    """Linear warmup over 5% of the steps, then cosine decay to 10% of the base LR."""
    warmup = max(1, int(WARMUP_FRACTION * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, progress))
        )

    return factor


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    """The model with the run's seed: identical weights on every rank and for every optimizer."""
    torch.manual_seed(cfg.seed)
    model = GPT(
        GPTConfig(seq_len=cfg.seq_len, d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads)
    )
    return model.to(device)


def build_optimizer(
    name: str, model: torch.nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.Optimizer:
    """``dmuon``: Muon on every ``*_proj`` matrix and AdamW (``adamw_lr``) on the rest;
    ``adamw``: AdamW on everything.

    On CPU Newton–Schulz iterates in fp32: CPUs have no fast half-precision matmul. On GPU the
    package default (fp16 Gram NS) is used.
    """
    if name == "dmuon":
        ns = dmuon.NewtonSchulz(work_dtype=torch.float32) if device.type == "cpu" else "gram"
        return dmuon.Muon(
            model,
            lr=cfg.lr,
            adamw_lr=cfg.adamw_lr,
            predicate=is_matrix_param,
            ns_backend=ns,
            momentum_dtype=cfg.momentum_dtype,
            offload=cfg.offload,
            keep_new_momentum=cfg.keep_new_momentum,
        )
    if name == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.adamw_lr, betas=(0.9, 0.95), weight_decay=0.0
        )
    raise ValueError(f"unknown optimizer {name!r}: choose one of {OPTIMIZERS}")


@torch.no_grad()
def evaluate(wrapped, sampler: WindowSampler, batches: int, env: runtime.DistEnv) -> float:
    """Mean validation loss over ``batches`` fixed global batches (every rank runs its slice)."""
    model = wrapped.model
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=env.device)
    for i in range(batches):
        x, y = sampler.batch(i, env.device)
        with wrapped.autocast():
            logits = model(x)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    model.train(was_training)
    return float(runtime.all_reduce_mean(total / batches, env))


def train_one(
    name: str,
    cfg: TrainConfig,
    corpus: Corpus,
    env: runtime.DistEnv,
    log: CsvLog,
    show_progress: bool = True,
    dedicate: bool = True,
    save_every: int = 0,
    out_dir=None,
    resume=None,
) -> RunResult:
    """Train a fresh model with optimizer ``name``; write rows to ``log``; return the result.

    ``save_every`` > 0 writes a DCP checkpoint under ``out_dir/checkpoints`` every that many steps
    and after the last one; ``resume`` (a checkpoint directory) loads model, optimizer and LR
    schedule from it and continues from its step (validation at that step is not repeated).
    """
    model = build_model(cfg, env.device)
    wrapped = runtime.parallelize(model, env, name, dedicate=dedicate, precision=cfg.precision)
    model = wrapped.model
    if cfg.compile_model:
        runtime.compile_blocks(model)
    opt = build_optimizer(name, model, cfg, env.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps))
    train = WindowSampler(
        corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed, env.dp_rank, env.dp_size
    )
    val = WindowSampler(
        corpus.val,
        cfg.seq_len,
        cfg.batch_size,
        cfg.seed + VAL_SEED_OFFSET,
        env.dp_rank,
        env.dp_size,
    )
    comm_kind, comm_note = runtime.comm_source(wrapped)
    result = RunResult(
        name,
        wrapped.mode,
        comm_kind=comm_kind,
        comm_note=comm_note,
        tokens_per_step=cfg.batch_size * cfg.seq_len,
    )
    timer = PhaseTimer(env.device)

    start = 0
    if resume is not None:
        start = checkpointing.load(resume, model, opt, sched, name, sizes=model_sizes(cfg))
        history = checkpointing.read_history(resume)  # the curves before the checkpoint
        result.val_losses = [tuple(v) for v in history.get("val_losses", [])]
        result.train_losses = [tuple(v) for v in history.get("train_losses", [])]
        result.train_time_s = history.get("train_time_s", 0.0)
        progress = Progress(name, cfg.steps, enabled=env.is_main and show_progress, start=start)
        if env.is_main and show_progress:
            print(f"{name}: resumed from {resume} at step {start}")
    else:
        progress = Progress(name, cfg.steps, enabled=env.is_main and show_progress)
        val_loss = evaluate(wrapped, val, cfg.eval_batches, env)
        result.val_losses.append((0, val_loss))
        log.write(step=0, optimizer=name, val_loss=val_loss, time_s=0.0)
        progress.update(0, None, val_loss, None)

    def save(step: int) -> None:
        directory = checkpointing.step_dir(out_dir, step) if out_dir is not None else None
        directory = runtime.broadcast_path(directory, env)
        t0 = time.perf_counter()
        history = {
            "val_losses": result.val_losses,
            "train_losses": result.train_losses,
            "train_time_s": result.train_time_s,
        }
        checkpointing.save(
            directory, model, opt, sched, step, name, env.is_main, history, model_sizes(cfg)
        )
        if env.is_main and show_progress:
            print(f"{name}: checkpoint {directory} ({time.perf_counter() - t0:.1f}s)")

    try:
        _train_steps(
            name,
            cfg,
            env,
            wrapped,
            opt,
            sched,
            train,
            val,
            result,
            progress,
            timer,
            log,
            start=start,
            save_every=save_every,
            save=save,
        )
    except KeyboardInterrupt:
        if wrapped.dedicated:
            dmuon.wait_all_replicate_broadcasts(model)  # drain in-flight collectives, then stop
        raise
    result.comm_profile = runtime.runtime_comm_profile(wrapped)
    if wrapped.dedicated:
        dmuon.wait_all_replicate_broadcasts(model)  # nothing left in flight before teardown
    return result


def _train_steps(
    name,
    cfg,
    env,
    wrapped,
    opt,
    sched,
    train,
    val,
    result,
    progress,
    timer,
    log,
    start: int = 0,
    save_every: int = 0,
    save=None,
) -> None:
    """The step loop of :func:`train_one` from step ``start`` (fills ``result`` and ``log``)."""
    model = wrapped.model
    tokens_per_step = result.tokens_per_step
    run_start = time.perf_counter()
    interval_start, interval_steps = time.perf_counter(), 0
    wait_start = runtime.profile_wait_ms(wrapped) if result.comm_kind == "profile" else None
    loss_sum = torch.zeros((), device=env.device)
    model.train()
    for step in range(start, cfg.steps):
        x, y = train.batch(step, env.device)
        with timer.phase("forward"), wrapped.autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        if not result.compute_dtype:  # what the model computes in (bf16 under a policy)
            result.compute_dtype = str(logits.dtype).removeprefix("torch.")
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("comm"):
            wrapped.sync_grads()
        with timer.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        loss_sum += loss.detach()
        interval_steps += 1
        done = step + 1
        do_eval = done % cfg.eval_every == 0 or done == cfg.steps
        do_save = save_every and (done % save_every == 0 or done == cfg.steps)
        if done % cfg.log_every and not do_eval and not do_save:
            continue
        # Log point: the float() below syncs the device, so wall time and CUDA events are final.
        train_loss = float(runtime.all_reduce_mean(loss_sum / interval_steps, env))
        elapsed_ms = (time.perf_counter() - interval_start) * 1e3
        result.train_time_s += elapsed_ms / 1e3
        phases = timer.take()
        if wait_start is not None:  # runtime waits inside forward/backward: report, don't add
            wait_now = runtime.profile_wait_ms(wrapped) or wait_start
            phases["comm"] = wait_now - wait_start
        if not math.isfinite(train_loss):
            raise FloatingPointError(
                f"{name}: training loss is {train_loss} at step {done}; lower --lr/--adamw-lr"
            )
        # The first interval pays one-time costs (allocation, optimizer state): keep it out of
        # the breakdown unless it is the only one.
        if done > start + cfg.log_every or done == cfg.steps and result.timed_steps == 0:
            result.timed_steps += interval_steps
            result.timed_wall_ms += elapsed_ms
            for k, v in phases.items():
                result.phase_ms[k] = result.phase_ms.get(k, 0.0) + v
        tok_s = interval_steps * tokens_per_step / max(elapsed_ms / 1e3, 1e-9)
        result.train_losses.append((done, train_loss))
        val_loss = None
        if do_eval:
            val_loss = evaluate(wrapped, val, cfg.eval_batches, env)
            result.val_losses.append((done, val_loss))
        log.write(
            step=done,
            optimizer=name,
            train_loss=train_loss,
            val_loss="" if val_loss is None else val_loss,
            tokens_per_s=tok_s,
            time_s=result.train_time_s,
            **{f"{k}_ms": v / interval_steps for k, v in phases.items()},
        )
        progress.update(done, train_loss, val_loss, tok_s)
        if do_save:  # after this step's log point, so the checkpoint's history includes it
            save(done)
        loss_sum.zero_()
        interval_start, interval_steps = time.perf_counter(), 0
        if wait_start is not None:  # evaluation's unshard waits are not training-step time
            wait_start = runtime.profile_wait_ms(wrapped) or 0.0
    if isinstance(opt, dmuon.Muon):  # the compiled step's verdict is read one call later
        opt.last_step_committed()
    progress.close()
    result.wall_s = time.perf_counter() - run_start
