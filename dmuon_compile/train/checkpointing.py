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
# The model sizes a checkpoint is written with (meta.json's "model") and the flags that set
# them: a resume with other sizes is refused naming the flag, not by DCP's traceback.
MODEL_FLAGS = {
    "d_model": "--d-model",
    "layers": "--layers",
    "heads": "--heads",
    "seq_len": "--seq-len",
}
SIZES_FIX = "pass the --d-model, --layers, --heads and --seq-len it was written with"


class ResumeMismatch(ValueError):
    """The checkpoint holds a model of other sizes than this run's."""


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
    sizes: dict | None = None,
) -> Path:
    """Collective: every rank writes its part of the DCP checkpoint; rank 0 adds ``meta.json``
    (with ``history``: the run's curves so far, see :func:`read_history`; ``sizes``: the
    model's, by :data:`MODEL_FLAGS` key, checked by :func:`check_sizes` on resume)."""
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
            "model": dict(sizes or {}),
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


def check_sizes(directory: Path, sizes: dict, saved: dict | None = None) -> None:
    """Raise :class:`ResumeMismatch` naming each flag whose value in ``sizes`` (this run's)
    differs from the checkpoint's: ``saved``, default its ``meta.json``'s (checkpoints written
    without them are checked by their tensors' shapes in :func:`load`)."""
    if saved is None:
        saved = read_meta(directory).get("model") or {}
    differ = [
        (flag, saved[key], sizes[key])
        for key, flag in MODEL_FLAGS.items()
        if key in saved and key in sizes and saved[key] != sizes[key]
    ]
    if differ:
        theirs = ", ".join(f"{flag} {old}" for flag, old, _ in differ)
        mine = ", ".join(f"{flag} {new}" for flag, _, new in differ)
        raise ResumeMismatch(
            f"--resume {directory}: that checkpoint was written with {theirs}, this run has "
            f"{mine}; pass {theirs} to resume it, or start a new run without --resume"
        )


def _sizes_of(stored: dict) -> dict:
    """The demo model's sizes read off a checkpoint's tensor shapes (all but ``heads``)."""
    sizes = {}
    embed, pos = (
        getattr(stored.get(k), "size", None) for k in ("embed.weight", "pos_embed.weight")
    )
    if embed is not None and len(embed) == 2:
        sizes["d_model"] = embed[1]
    if pos is not None and len(pos) == 2:
        sizes["seq_len"] = pos[0]
    blocks = [int(m.group(1)) for k in stored if (m := re.match(r"blocks\.(\d+)\.", k))]
    if blocks:
        sizes["layers"] = max(blocks) + 1
    return sizes


def _check_shapes(directory: Path, model_sd: dict, sizes: dict | None) -> None:
    """Before DCP loads: the checkpoint's model tensors are this run's, shape for shape (DCP
    raises a traceback on a shape and silently skips a tensor this run lacks). The sizes read
    off the shapes name the flag; any other difference names the tensor."""
    try:
        saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except Exception:  # an unreadable checkpoint: DCP's own error says why
        return
    stored = {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}
    if sizes:
        check_sizes(directory, sizes, _sizes_of(stored))
    problem = None
    for name, tensor in model_sd.items():
        size = getattr(stored.get(name), "size", None)
        if name not in stored:
            problem = f"has no {name}, which this run's model has"
        elif size is not None and tuple(size) != tuple(tensor.shape):
            problem = f"holds {name} of shape {tuple(size)}, this run's is {tuple(tensor.shape)}"
        if problem:
            break
    extra = sorted(set(stored) - set(model_sd))
    if problem is None and extra:
        problem = f"holds {extra[0]}, which this run's model lacks"
    if problem:
        raise ResumeMismatch(
            f"--resume {directory}: that checkpoint {problem}: the model sizes differ; {SIZES_FIX}"
        )


def load(directory: Path, model, opt, sched, optimizer: str, sizes: dict | None = None) -> int:
    """Collective: load model, optimizer and scheduler state; returns the step to continue from.
    ``sizes``: this run's model sizes (:data:`MODEL_FLAGS` keys), checked against the
    checkpoint's shapes before anything loads."""
    meta = read_meta(directory)
    if meta.get("optimizer") != optimizer:
        raise ValueError(
            f"--resume {directory}: that checkpoint was written by "
            f"--optimizer {meta.get('optimizer')}, "
            f"this run uses --optimizer {optimizer}; pass the same --optimizer"
        )
    model_sd, optim_sd = get_state_dict(model, opt)
    _check_shapes(directory, model_sd, sizes)
    state = {"model": model_sd, "optim": optim_sd}
    with _dcp_mode() as no_dist:
        dcp.load(state, checkpoint_id=str(directory), no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(meta["scheduler"])
    return int(meta["step"])
