"""Timers, the progress line, the CSV log, the loss plot and the step-time breakdown.

Only rank 0 prints and writes files; every rank times its own phases.
"""

from __future__ import annotations

import csv
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

PHASES = ("forward", "backward", "comm", "step")
# Dense bf16 / fp32 peak of one GPU (FLOP/s) by name, from NVIDIA's data sheets (SXM parts):
# the MFU denominator. H100 and H200 share the GH100 compute (989 TFLOP/s bf16 tensor cores,
# 67 TFLOP/s fp32 without TF32). Other GPUs: --peak-tflops.
PEAK_FLOPS = {"H200": {"bf16": 989e12, "fp32": 67e12}, "H100": {"bf16": 989e12, "fp32": 67e12}}


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """``(peak FLOP/s of one device, its name)`` for MFU; ``(None, why)`` when unknown (CPUs,
    GPUs not in :data:`PEAK_FLOPS`)."""
    if device.type != "cuda":
        return None, "n/a on CPU"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name and "PCIe" not in name and "NVL" not in name:  # those peak lower
            return peaks[precision], f"{key} {precision}"
    return None, f"n/a: peak of {name} unknown, pass --peak-tflops"


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, peak: float | None):
    """Model FLOPs utilisation: achieved model FLOP/s over ``devices`` × ``peak`` (or None)."""
    if peak is None or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (devices * peak)


CSV_FIELDS = (
    "step",
    "optimizer",
    "train_loss",
    "val_loss",
    "tokens_per_s",
    "time_s",
    "forward_ms",
    "backward_ms",
    "comm_ms",
    "step_ms",
)


class PhaseTimer:
    """Accumulates milliseconds per phase.

    On CUDA each phase is bracketed by CUDA events (no host sync inside the step); their
    times are read in :meth:`flush`, which waits for the last event. On CPU it uses
    ``time.perf_counter``, which is exact there because CPU ops run synchronously.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.totals[name] += (time.perf_counter() - t0) * 1e3
                self.counts[name] += 1

    def flush(self) -> None:
        """Resolve pending CUDA events into totals."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for name, start, end in self.pending:
                self.totals[name] += start.elapsed_time(end)
                self.counts[name] += 1
            self.pending.clear()

    def take(self) -> dict[str, float]:
        """Totals since the last ``take`` (ms per phase), then reset."""
        self.flush()
        out = {name: self.totals.get(name, 0.0) for name in PHASES}
        self.totals.clear()
        self.counts.clear()
        return out


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """A plain-text progress bar on rank 0.

    On a TTY one line is rewritten in place (``\\r``) at every update; otherwise (logs, CI,
    pipes) a full line is printed about every 5% of the run, at every validation and at the end.
    """

    def __init__(
        self,
        label: str,
        total: int,
        enabled: bool = True,
        stream=None,
        width: int = 24,
        start: int = 0,
    ):
        """``start``: the step a resumed run continues from (the ETA counts from there)."""
        self.label = label
        self.total = total
        self.first = start
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.start = time.perf_counter()
        self._last_len = 0
        self._last_printed = -1

    def update(
        self,
        step: int,
        train_loss: float | None,
        val_loss: float | None,
        tokens_per_s: float | None,
    ) -> None:
        """``tokens_per_s`` None: not measured yet (before the first step); then the line shows
        neither a rate nor an ETA."""
        if not self.enabled:
            return
        if (
            not self.tty
            and val_loss is None
            and step < self.total
            and step - self._last_printed < self.total / 20
        ):
            return
        self._last_printed = step
        frac = step / self.total if self.total else 1.0
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        parts = [f"[{self.label}] |{bar}| {step}/{self.total}"]
        if train_loss is not None:
            parts.append(f"loss {train_loss:.4f}")
        if val_loss is not None:
            parts.append(f"val {val_loss:.4f}")
        timing = f"{format_duration(elapsed)} elapsed"
        if tokens_per_s is not None and step > self.first:
            parts.append(f"{tokens_per_s / 1e3:.1f}k tok/s")
            done = (step - self.first) / max(1, self.total - self.first)
            timing += f", eta {format_duration(elapsed / done - elapsed)}"
        parts.append(timing)
        line = " | ".join(parts)
        if self.tty:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class CsvLog:
    """Appends rows of :data:`CSV_FIELDS` to ``path`` (rank 0 only; others pass ``path=None``)."""

    def __init__(self, path: Path | None, keep_until: int | None = None):
        """``keep_until``: continue an existing log (a resumed run): its rows up to that step
        stay, later ones (written after the checkpoint) are dropped."""
        self.path = path
        self.rows: list[dict] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if keep_until is not None and path.is_file():
                kept = [
                    r
                    for r in read_csv(path)
                    if r.get("step", "") != "" and int(r["step"]) <= keep_until
                ]
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, CSV_FIELDS)
                writer.writeheader()
                for row in kept:
                    writer.writerow({k: row.get(k, "") for k in CSV_FIELDS})

    def write(self, **row) -> None:
        unknown = set(row) - set(CSV_FIELDS)
        if unknown:
            raise KeyError(f"unknown CSV fields {sorted(unknown)}")
        row = {k: row.get(k, "") for k in CSV_FIELDS}
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = f"{v:.6g}"
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, CSV_FIELDS).writerow(row)


def read_csv(path: Path) -> list[dict]:
    """Rows of a log written by :class:`CsvLog`."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def training_time_axis(rows: list[dict]) -> dict[int, float]:
    """Seconds of training at each logged step of one optimizer's rows: the ``time_s`` column
    (training steps only; validation and checkpoints excluded), with the first interval's
    one-time costs (compilation, allocation) taken out by charging that interval at the mean
    time per step of the later ones. Rows without ``time_s`` (logs of older versions) give {}.
    """
    points = [
        (int(r["step"]), float(r["time_s"]))
        for r in rows
        if r.get("time_s") and r.get("train_loss")  # rows after training steps (not step 0's)
    ]
    if not points:
        return {}
    points.sort()
    (s0, t0), rest = points[0], points[1:]
    if rest and rest[-1][0] > s0:
        per_step = (rest[-1][1] - t0) / (rest[-1][0] - s0)
        warmup = max(0.0, t0 - per_step * s0)  # s0 steps, run from step 0 (or the history's)
    else:
        warmup = 0.0
    return {step: t - warmup for step, t in points}


def plot_losses(csv_path: Path, png_path: Path) -> str:
    """Plot train/validation loss per optimizer against steps and against training time
    (:func:`training_time_axis`); returns a one-line note on what happened.

    Needs matplotlib (the optional ``plot`` extra); without it, returns a note and writes nothing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'dmuon_compile[plot]')"
    rows = read_csv(csv_path)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == name]
        seconds = training_time_axis(mine)
        if seconds:
            seconds[0] = 0.0  # the validation before the first step
        train = [(int(r["step"]), float(r["train_loss"])) for r in mine if r["train_loss"]]
        val = [(int(r["step"]), float(r["val_loss"])) for r in mine if r["val_loss"]]
        color = None
        for ax, x_of in ((by_step, lambda s: s), (by_time, seconds.get)):
            if ax is by_time and not seconds:
                continue
            t = [(x_of(s), v) for s, v in train if x_of(s) is not None]
            w = [(x_of(s), v) for s, v in val if x_of(s) is not None]
            if t:
                line = ax.plot(*zip(*t), alpha=0.5, color=color, label=f"{name} train")[0]
                color = line.get_color()
            if w:
                line = ax.plot(*zip(*w), marker="o", color=color, label=f"{name} validation")[0]
                color = line.get_color()
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s; compile and validation excluded)")
    by_step.set_ylabel("cross-entropy (nats/byte)")
    fig.suptitle("byte-level GPT on the Python standard library")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return f"plot: {png_path}"


def breakdown_table(
    name: str, totals: dict[str, float], steps: int, wall_ms: float, comm_kind: str, comm_note: str
) -> str:
    """The end-of-run step-time breakdown: mean ms per step and share of the step's wall time.

    ``comm_kind`` says how the ``comm`` total was measured (see ``runtime.comm_source``):
    ``explicit`` is its own phase (added to the others), ``profile`` is waiting that happened
    inside forward/backward (shown, not added), ``none`` means one process, ``n/a`` unmeasured.
    """
    if steps <= 0:
        return f"step-time breakdown ({name}): no timed steps"
    per_step = wall_ms / steps
    lines = [f"step-time breakdown ({name}; mean over {steps} steps, {per_step:.1f} ms/step wall):"]

    def row(label: str, ms: float, note: str = "") -> str:
        return f"  {label:<24}{ms:9.2f} ms {100 * ms / per_step:5.1f}%" + (
            f"   ({note})" if note else ""
        )

    accounted = 0.0
    for key, label in (
        ("forward", "forward"),
        ("backward", "backward"),
        ("step", "optimizer step"),
    ):
        ms = totals.get(key, 0.0) / steps
        accounted += ms
        lines.append(row(label, ms))
    comm = totals.get("comm", 0.0) / steps
    if comm_kind == "explicit":
        accounted += comm
        lines.append(row("exposed communication", comm, comm_note))
    elif comm_kind == "profile":
        lines.append(row("exposed communication", comm, comm_note))
    elif comm_kind == "none":
        lines.append(row("exposed communication", 0.0, comm_note))
    else:
        lines.append(f"  {'exposed communication':<24}      n/a        ({comm_note})")
    lines.append(row("other (data, logging)", max(0.0, per_step - accounted)))
    return "\n".join(lines)
