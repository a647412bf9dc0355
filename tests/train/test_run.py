"""Short CPU training runs: one process in-process, two processes under torchrun (gloo)."""

import json
import math
import os

import pytest
from native_crash import run_torchrun  # tests/ is on sys.path

from dmuon_compile.train import cli
from dmuon_compile.train.metrics import read_csv

TINY = [
    "--steps",
    "16",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--d-model",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--log-every",
    "4",
    "--eval-every",
    "8",
    "--eval-batches",
    "2",
    "--corpus-mb",
    "0.5",
    "--no-progress",
    "--seed",
    "1",
    "--device",
    "cpu",
]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _check_log(out_dir, optimizers):
    rows = read_csv(out_dir / "log.csv")
    assert {r["optimizer"] for r in rows} == set(optimizers)
    for name in optimizers:
        mine = [r for r in rows if r["optimizer"] == name]
        train = [float(r["train_loss"]) for r in mine if r["train_loss"]]
        val = [float(r["val_loss"]) for r in mine if r["val_loss"]]
        assert len(train) == 4 and len(val) == 3  # steps 4/8/12/16; validation at 0/8/16
        assert all(math.isfinite(v) for v in train + val)
        assert val[-1] < val[0] - 1.0, f"{name}: validation loss did not fall: {val}"
        assert train[-1] < train[0], f"{name}: training loss did not fall: {train}"
        for r in mine[1:]:
            assert (
                float(r["tokens_per_s"]) > 0
                and float(r["forward_ms"]) > 0
                and float(r["step_ms"]) > 0
            )
    return rows


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        summary = cli.main([*TINY, "--optimizer", "both", "--out-dir", str(out)])
    finally:
        os.environ.update(saved)
    return out, summary


def test_single_process_run_writes_log_and_learns(single_run, capsys):
    out, summary = single_run
    rows = _check_log(out, ["dmuon", "adamw"])
    # Same seed: both optimizers start from identical weights, so the step-0 validation matches.
    starts = [float(r["val_loss"]) for r in rows if r["step"] == "0"]
    assert len(starts) == 2 and starts[0] == starts[1]
    saved = json.loads((out / "summary.json").read_text())
    assert [r["optimizer"] for r in saved["runs"]] == ["dmuon", "adamw"]
    assert saved["runs"][0]["mode"] == "single process"
    assert summary["world_size"] == 1


def test_single_process_prints_the_breakdown(tmp_path, capsys):
    cli.main([*TINY, "--steps", "8", "--optimizer", "adamw", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "step-time breakdown (adamw" in out
    for label in ("forward", "backward", "optimizer step", "exposed communication"):
        assert label in out
    assert "log: " in out and ("plot: " in out or "plot skipped" in out)


def _torchrun(args, timeout=150):
    proc = run_torchrun(["-m", "dmuon_compile.train", *args], 2, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.distributed
def test_two_processes_match_one(tmp_path, single_run):
    stdout = _torchrun([*TINY, "--optimizer", "both", "--out-dir", str(tmp_path)])
    assert "2 processes (gloo)" in stdout
    _check_log(tmp_path, ["dmuon", "adamw"])
    runs = {r["optimizer"]: r for r in json.loads((tmp_path / "summary.json").read_text())["runs"]}
    single = {r["optimizer"]: r for r in single_run[1]["runs"]}
    # The global batch of a step does not depend on the world size: 2 ranks see the same data
    # as 1 and must end at (nearly) the same loss.
    for name in ("dmuon", "adamw"):
        assert runs[name]["first_val_loss"] == pytest.approx(
            single[name]["first_val_loss"], rel=1e-5
        )
        assert runs[name]["final_val_loss"] == pytest.approx(
            single[name]["final_val_loss"], rel=1e-2
        )
    assert "exposed communication" in stdout


@pytest.mark.distributed
def test_two_processes_replicated_matrices_baseline(tmp_path, single_run):
    stdout = _torchrun([*TINY, "--optimizer", "dmuon", "--no-dedicate", "--out-dir", str(tmp_path)])
    _check_log(tmp_path, ["dmuon"])
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert run["mode"].startswith("FSDP2 + whole matrices replicated")
    assert run["exposed_comm"] == "explicit"
    single = single_run[1]["runs"][0]
    assert run["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=1e-2)
    assert "synchronous all-reduce" in stdout


def test_save_every_and_resume_continue_the_run(tmp_path):
    """--save-every writes DCP checkpoints; --resume from the middle one continues the loss curve
    and the CSV log exactly as the uninterrupted run (one process: bit-identical)."""
    args = [*TINY, "--optimizer", "dmuon", "--save-every", "8"]
    whole = tmp_path / "whole"
    cli.main([*args, "--out-dir", str(whole)])
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step-16", "step-8"]
    uninterrupted = read_csv(whole / "log.csv")
    # Resume from step 8 into the same run directory: rows after step 8 are written again.
    cli.main([*TINY, "--optimizer", "dmuon", "--resume", str(whole / "checkpoints" / "step-8")])
    resumed = read_csv(whole / "log.csv")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted]
    for a, b in zip(uninterrupted, resumed):
        assert (a["train_loss"], a["val_loss"]) == (b["train_loss"], b["val_loss"]), (a, b)
    # Bad input: named errors, no run.
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--optimizer", "both", "--resume", str(whole)])  # one optimizer only
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--optimizer", "dmuon", "--resume", str(tmp_path / "nothing")])
