"""The demo's checkpoints: DCP save every N steps, resume from a directory (torchtitan's way).

A checkpoint is ``<out_dir>/checkpoints/step-<k>/``: the DCP files of ``{"model", "optim"}`` from
``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` — dedicated weights, their
Muon momentum, FSDP2 shards and AdamW moments alike — and ``meta.json`` (step, LR scheduler,
optimizer name, and the run's loss curves and training time up to that step, so a resumed
run reports the whole run), written by rank 0 after the DCP files. Because DCP stores global
tensors, a checkpoint resumes on any number of processes.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step}"


@contextlib.contextmanager
def _dcp_mode():
    """``no_dist`` for DCP: True in one process (no process group), stated rather than guessed.

    torch's DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming
    the intent is to save/load in a single process" whenever it runs without a process group,
    even when the caller passes ``no_dist=True`` to say exactly that. Only that message is
    filtered, and only in one process: with a process group DCP never emits it.
    """
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings(
                "ignore",
                message="torch.distributed is disabled, unavailable or uninitialized, "
                "assuming the intent is to (save|load) in a single process",
                category=UserWarning,
            )
        yield no_dist


def save(
    directory: Path,
    model,
    opt,
    sched,
    step: int,
    optimizer: str,
    is_main: bool,
    history: dict | None = None,
) -> Path:
    """Collective: every rank writes its part of the DCP checkpoint; rank 0 adds ``meta.json``
    (with ``history``: the run's curves so far, see :func:`read_history`)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    with _dcp_mode() as no_dist:
        dcp.save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), no_dist=no_dist
        )
    if is_main:
        meta = {
            "step": step,
            "optimizer": optimizer,
            "scheduler": sched.state_dict(),
            "history": history or {},
        }
        (directory / META).write_text(json.dumps(meta, indent=2, default=_number))
    if dist.is_initialized():
        dist.barrier()  # meta.json exists on every rank's view before anyone goes on
    return directory


def _number(value):
    """JSON for the scheduler's 0-d tensors (Muon's groups keep ``lr`` as one): a float."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"meta.json: cannot store a {type(value).__name__}")


def find(path: Path) -> Path:
    """The checkpoint to resume from: ``path`` itself, or the newest ``step-*`` under it (or under
    ``path/checkpoints``). Raises ``FileNotFoundError`` naming what was looked for."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path, path / "checkpoints"):
        steps = (
            sorted(
                (int(m.group(1)), p)
                for p in root.glob("step-*")
                if (m := _STEP_DIR.match(p.name)) and (p / META).is_file()
            )
            if root.is_dir()
            else []
        )
        if steps:
            return steps[-1][1]
    raise FileNotFoundError(
        f"--resume {path}: no checkpoint there (looked for {META} in it, and for "
        f"step-*/{META} in it and in its checkpoints/ folder). "
        "Pass a directory written by --save-every."
    )


def run_dir(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to (``<run>/checkpoints/step-k`` → ``<run>``)."""
    return (
        checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    )


def read_meta(directory: Path) -> dict:
    return json.loads((Path(directory) / META).read_text())


def read_history(directory: Path) -> dict:
    """The run's curves up to the checkpoint: ``val_losses`` and ``train_losses`` as
    ``[step, loss]`` pairs, ``train_time_s``; ``{}`` for checkpoints written without them."""
    return read_meta(directory).get("history", {})


def load(directory: Path, model, opt, sched, optimizer: str) -> int:
    """Collective: load model, optimizer and scheduler state; returns the step to continue from."""
    meta = read_meta(directory)
    if meta.get("optimizer") != optimizer:
        raise ValueError(
            f"--resume {directory}: that checkpoint was written by "
            f"--optimizer {meta.get('optimizer')}, "
            f"this run uses --optimizer {optimizer}; pass the same --optimizer"
        )
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with _dcp_mode() as no_dist:
        dcp.load(state, checkpoint_id=str(directory), no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(meta["scheduler"])
    return int(meta["step"])
