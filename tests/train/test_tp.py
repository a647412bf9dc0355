"""The demo with ``--tp 2`` on two gloo processes (dp 1 × tp 2) trains like one process.

Reference: the same tiny run in this process. The TP run's per-step training losses, read from
both ``log.csv`` files with ``benchmarks/loss_parity.py``, must match within ``RTOL``; the
control, one process with another learning rate, must miss by more than that, so the
comparison can fail.
"""

import json
import os
from pathlib import Path

import pytest
from bench_scripts import load_benchmark  # tests/ is on sys.path
from test_run import TINY, _torchrun  # tests/train is on sys.path (rootdir-less modules)

from dmuon_compile.train import cli

RTOL = 1e-4  # the CSV keeps 6 significant digits; fp32 NS on CPU agrees to about that
ARGS = [*TINY, "--steps", "6", "--log-every", "1", "--eval-every", "6"]  # 6 steps, each logged
_PARITY = Path(__file__).resolve().parents[2] / "benchmarks" / "loss_parity.py"
parity = load_benchmark("loss_parity")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _worst(ref_csv, other_csv, optimizer):
    rows, unmatched = parity.compare(
        parity.train_losses(ref_csv, optimizer), parity.train_losses(other_csv, optimizer)
    )
    assert rows and not unmatched, (rows, unmatched)
    return max(rel for *_, rel in rows)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, both optimizers (Muon, then AdamW), and the control with another lr."""
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        ref = tmp_path_factory.mktemp("one")
        cli.main([*ARGS, "--optimizer", "both", "--out-dir", str(ref)])
        control = tmp_path_factory.mktemp("control")
        cli.main([*ARGS, "--optimizer", "dmuon", "--lr", "0.008", "--out-dir", str(control)])
    finally:
        os.environ.update(saved)
    return ref / "log.csv", control / "log.csv"


@pytest.mark.distributed
def test_tp2_matches_one_process(tmp_path, reference):
    ref_csv, control_csv = reference
    stdout = _torchrun([*ARGS, "--optimizer", "both", "--tp", "2", "--out-dir", str(tmp_path)])
    assert "2 processes (gloo) on cpu, dp 1 × tp 2" in stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tp"] == 2
    modes = {r["optimizer"]: r["mode"] for r in summary["runs"]}
    assert modes == {"dmuon": "TP 2 + dedicate_params + FSDP2", "adamw": "TP 2 + FSDP2"}
    for name in ("dmuon", "adamw"):
        assert _worst(ref_csv, tmp_path / "log.csv", name) <= RTOL, name
    # The control: the comparison fails on a run that is not the same training.
    assert _worst(ref_csv, control_csv, "dmuon") > 10 * RTOL
    code = parity.main([str(ref_csv), str(control_csv), "--optimizer", "dmuon", "--rtol", "1e-4"])
    assert code == 1
    # The script itself on the TP log (the gpu_suite stage's check).
    code = parity.main([str(ref_csv), str(tmp_path / "log.csv"), "--optimizer", "dmuon"])
    assert code == 0
