"""Loss parity of two training-demo runs: the same steps, data and seed on different world sizes.

The demo (``python -m dmuon_compile.train``) splits one global batch over the ranks, so a run on
N GPUs (dedicated parameters, FSDP2) and the 1-GPU reference see the same tokens per step and
should follow the same loss curve up to the numerics of the NS kernels and reductions.

    python -m dmuon_compile.train --steps 20 --log-every 1 --out-dir ref                # 1 GPU
    torchrun --nproc_per_node 8 -m dmuon_compile.train --steps 20 --log-every 1 --out-dir run8
    python benchmarks/loss_parity.py ref/log.csv run8/log.csv --rtol 2e-2
    torchrun --nproc_per_node 2 -m dmuon_compile.train --tp 2 --steps 20 --log-every 1 --out-dir tp2
    python benchmarks/loss_parity.py ref/log.csv tp2/log.csv --rtol 2e-2     # tensor parallel

A log of ``--optimizer both`` holds two curves: pick one with ``--optimizer``.

Prints one line per step and the largest relative difference; exits 1 if it exceeds
``--rtol`` or the two logs do not cover the same steps, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path


def train_losses(path: Path, optimizer: str | None = None) -> dict[int, float]:
    """``{step: train_loss}`` from a demo ``log.csv`` (rows without a train loss are skipped),
    of ``optimizer``'s rows; without one the log must hold a single optimizer's curve."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or "train_loss" not in rows[0] or "step" not in rows[0]:
        raise ValueError(
            f"{path}: not a training-demo log.csv (needs 'step' and 'train_loss' columns)"
        )
    names = sorted({r.get("optimizer") or "" for r in rows})
    if optimizer is not None:
        rows = [r for r in rows if r.get("optimizer") == optimizer]
        if not rows:
            raise ValueError(f"{path}: no rows of optimizer {optimizer!r} (it holds {names})")
    elif len(names) > 1:  # two curves on the same steps: one would silently replace the other
        raise ValueError(f"{path}: holds the runs of {names}; pick one with --optimizer")
    return {int(r["step"]): float(r["train_loss"]) for r in rows if r["train_loss"]}


def compare(
    reference: dict[int, float], other: dict[int, float]
) -> tuple[list[tuple[int, float, float, float]], list[int]]:
    """Per common step ``(step, reference, other, relative difference)``; steps in one log only."""
    common = sorted(set(reference) & set(other))
    rows = []
    for step in common:
        ref, val = reference[step], other[step]
        rel = abs(val - ref) / max(abs(ref), 1e-12) if math.isfinite(val) else math.inf
        rows.append((step, ref, val, rel))
    return rows, sorted(set(reference) ^ set(other))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reference", type=Path, help="log.csv of the reference run (e.g. 1 GPU)")
    parser.add_argument("other", type=Path, help="log.csv of the run to check (e.g. 8 GPUs)")
    parser.add_argument(
        "--rtol", type=float, default=2e-2, help="largest allowed relative loss difference"
    )
    parser.add_argument(
        "--optimizer", default=None, help="compare this optimizer's rows (logs of --optimizer both)"
    )
    args = parser.parse_args(argv)
    try:
        reference = train_losses(args.reference, args.optimizer)
        other = train_losses(args.other, args.optimizer)
    except (OSError, ValueError) as exc:
        print(f"loss_parity: {exc}", file=sys.stderr)
        return 2
    rows, unmatched = compare(reference, other)
    if not rows:
        print(
            "loss_parity: the two logs share no step with a train loss; "
            "run both with --log-every 1",
            file=sys.stderr,
        )
        return 1
    print("| step | reference loss | other loss | rel. diff |\n|---|---|---|---|")
    for step, ref, val, rel in rows:
        print(f"| {step} | {ref:.5f} | {val:.5f} | {rel:.2e} |")
    worst = max(rel for *_, rel in rows)
    ok = worst <= args.rtol and not unmatched
    print(
        f"PARITY {'ok' if ok else 'FAILED'}: {len(rows)} steps, max relative loss difference "
        f"{worst:.2e} (rtol {args.rtol:g})"
        + (f"; steps in one log only: {unmatched}" if unmatched else "")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
