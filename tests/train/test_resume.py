"""Resuming the demo: a finished run says so, the summary covers the whole run, no DCP noise."""

import warnings

import pytest
import torch
from test_run import TINY  # tests/train is on sys.path (rootdir-less modules)

from dmuon_compile.train import checkpointing, cli

DCP_NOISE = "torch.distributed is disabled, unavailable or uninitialized"


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An 8-step run with checkpoints at steps 4 and 8 (one process)."""
    out = tmp_path_factory.mktemp("run")
    argv = [*TINY, "--steps", "8", "--eval-every", "4", "--optimizer", "dmuon"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = cli.main([*argv, "--save-every", "4", "--out-dir", str(out)])
    return out, argv, summary, [str(w.message) for w in caught]


def test_resuming_a_finished_run_says_it_is_complete(finished, capsys):
    out, argv, _, _ = finished
    capsys.readouterr()
    summary = cli.main([*argv, "--resume", str(out)])  # same --steps: nothing left to train
    printed = capsys.readouterr().out
    assert summary == {"already_complete": True, "step": 8, "steps": 8}
    assert "already complete" in printed and "--steps larger than 8" in printed, printed
    assert "nan" not in printed


def test_resumed_summary_covers_the_whole_run(finished, tmp_path):
    out, argv, whole, _ = finished
    resumed = cli.main(
        [*argv, "--resume", str(out / "checkpoints" / "step-4"), "--out-dir", str(tmp_path)]
    )
    a, b = whole["runs"][0], resumed["runs"][0]
    assert b["first_val_loss"] == a["first_val_loss"]  # step 0's, from the checkpoint's history
    assert b["final_val_loss"] == pytest.approx(a["final_val_loss"], rel=1e-6)
    assert (
        b["train_time_s"]
        > checkpointing.read_history(out / "checkpoints" / "step-4")["train_time_s"]
    )


def test_one_process_checkpoints_without_dcp_warnings(finished, tmp_path):
    out, argv, _, save_warnings = finished
    assert not [m for m in save_warnings if DCP_NOISE in m], save_warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.main([*argv, "--steps", "12", "--resume", str(out), "--out-dir", str(tmp_path)])
    assert not [w for w in caught if DCP_NOISE in str(w.message)], [str(w.message) for w in caught]


def test_control_dcp_warns_in_one_process_even_when_told(tmp_path):
    """The control: torch's DCP warns without a process group even with ``no_dist=True`` (so
    the filter is needed), and the demo's filter matches exactly that message."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(2)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
        dcp.load(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    assert len([w for w in caught if DCP_NOISE in str(w.message)]) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with checkpointing._dcp_mode() as no_dist:
            dcp.save(state, checkpoint_id=str(tmp_path / "b"), no_dist=no_dist)
            dcp.load(state, checkpoint_id=str(tmp_path / "b"), no_dist=no_dist)
    assert no_dist and not [w for w in caught if DCP_NOISE in str(w.message)]
