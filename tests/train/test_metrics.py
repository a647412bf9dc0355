"""Timers, progress output, CSV log, plot fallback and the breakdown table."""

import io
import sys

import pytest
import torch

from dmuon_compile.train import metrics


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_phase_timer_accumulates_and_resets():
    timer = metrics.PhaseTimer(torch.device("cpu"))
    with timer.phase("forward"):
        sum(range(20000))
    with timer.phase("forward"):
        pass
    out = timer.take()
    assert set(out) == set(metrics.PHASES)
    assert out["forward"] > 0 and out["backward"] == 0
    assert timer.take()["forward"] == 0


def test_progress_rewrites_one_line_on_a_tty_and_prints_lines_otherwise():
    tty = _Tty()
    bar = metrics.Progress("dmuon", 10, stream=tty)
    bar.update(5, 2.5, None, 1234.0)
    bar.update(10, 2.0, 1.9, 2000.0)
    bar.close()
    text = tty.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "loss 2.0000" in text and "val 1.9000" in text and "tok/s" in text

    plain = io.StringIO()
    bar = metrics.Progress("adamw", 10, stream=plain)
    bar.update(5, 2.5, None, 1234.0)
    bar.update(10, 2.0, None, 2000.0)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in plain.getvalue() and "5/10" in lines[0]

    silent = io.StringIO()
    metrics.Progress("x", 10, enabled=False, stream=silent).update(1, 1.0, None, 1.0)
    assert silent.getvalue() == ""


def test_csv_log_round_trip_and_unknown_field(tmp_path):
    log = metrics.CsvLog(tmp_path / "sub" / "log.csv")
    log.write(step=0, optimizer="dmuon", val_loss=5.5)
    log.write(step=10, optimizer="dmuon", train_loss=3.25, tokens_per_s=100.0, forward_ms=1.5)
    rows = metrics.read_csv(tmp_path / "sub" / "log.csv")
    assert [r["step"] for r in rows] == ["0", "10"]
    assert rows[0]["train_loss"] == "" and float(rows[0]["val_loss"]) == 5.5
    assert float(rows[1]["train_loss"]) == 3.25
    assert list(rows[0]) == list(metrics.CSV_FIELDS)
    with pytest.raises(KeyError, match="unknown CSV fields"):
        log.write(step=1, bogus=1)


def _small_log(tmp_path):
    log = metrics.CsvLog(tmp_path / "log.csv")
    for name in ("dmuon", "adamw"):
        log.write(step=0, optimizer=name, val_loss=5.5)
        log.write(step=5, optimizer=name, train_loss=3.0, val_loss=2.9)
    return tmp_path / "log.csv"


def test_plot_without_matplotlib_is_a_note_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    note = metrics.plot_losses(_small_log(tmp_path), tmp_path / "loss.png")
    assert "matplotlib is not installed" in note and "\n" not in note
    assert not (tmp_path / "loss.png").exists()


def test_plot_with_matplotlib_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    note = metrics.plot_losses(_small_log(tmp_path), tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG", note


def _ms(text: str, label: str) -> float:
    line = next(row for row in text.splitlines() if row.strip().startswith(label))
    return float(line[len(label) + 2 :].split("ms")[0])


def test_breakdown_adds_explicit_comm_but_not_profile_waits():
    totals = {"forward": 100.0, "backward": 200.0, "step": 50.0, "comm": 30.0}  # 10 steps, 400 ms
    explicit = metrics.breakdown_table("x", totals, 10, 400.0, "explicit", "all-reduce")
    assert _ms(explicit, "exposed communication") == 3.0
    assert _ms(explicit, "other (data, logging)") == 2.0  # 40 - 10 - 20 - 5 - 3
    profile = metrics.breakdown_table("x", totals, 10, 400.0, "profile", "waits")
    assert _ms(profile, "exposed communication") == 3.0
    assert _ms(profile, "other (data, logging)") == 5.0  # waits are inside forward/backward
    none = metrics.breakdown_table("x", {**totals, "comm": 0.0}, 10, 400.0, "none", "one process")
    assert _ms(none, "exposed communication") == 0.0
    na = metrics.breakdown_table("x", totals, 10, 400.0, "n/a", "n/a: no profile")
    assert "n/a" in na and "no profile" in na
    for text in (explicit, profile, na):
        assert _ms(text, "forward") == 10.0 and _ms(text, "backward") == 20.0
        assert _ms(text, "optimizer step") == 5.0
    assert "no timed steps" in metrics.breakdown_table("x", totals, 0, 0.0, "none", "")


def test_progress_without_tty_prints_about_every_five_percent():
    plain = io.StringIO()
    bar = metrics.Progress("dmuon", 200, stream=plain)
    for step in range(1, 201):
        bar.update(step, 2.0, 1.5 if step == 33 else None, 100.0)
    lines = plain.getvalue().splitlines()
    assert 20 <= len(lines) <= 23  # every 10 steps, plus the validation at step 33
    assert any("33/200" in line and "val 1.5000" in line for line in lines)
    assert "200/200" in lines[-1]


def test_progress_shows_rate_and_eta_only_once_measured():
    """Before the first step nothing is measured: no "0.0k tok/s", no "eta 0s"."""
    out = io.StringIO()
    bar = metrics.Progress("dmuon", 10, stream=out)
    bar.update(0, None, 5.5, None)
    first = out.getvalue()
    assert "val 5.5000" in first and "tok/s" not in first and "eta" not in first, first
    bar.update(5, 4.0, None, 2500.0)
    later = out.getvalue().splitlines()[-1]
    assert "2.5k tok/s" in later and "eta" in later, later


def test_progress_eta_counts_from_the_resumed_step():
    """Resumed at step 8 of 10, one step done: the ETA is for 1 more step, not 9 steps' worth
    (the run's own 1 step of 2 means half done)."""
    out = io.StringIO()
    bar = metrics.Progress("dmuon", 10, stream=out, start=8)
    bar.start -= 10.0  # 10 s for the first step after the resume
    bar.update(9, 4.0, 4.1, 100.0)
    line = out.getvalue()
    assert "eta 10s" in line, line  # not 10/0.9 - 10 = 1s (the ETA of a run counted from 0)


def test_training_time_axis_takes_out_the_first_interval_warmup():
    rows = [
        {"step": "0", "time_s": "0", "train_loss": ""},  # validation before the first step
        {"step": "10", "time_s": "31", "train_loss": "5"},  # 30 s compiling + 10 steps of 0.1 s
        {"step": "20", "time_s": "32", "train_loss": "4"},
        {"step": "30", "time_s": "33", "train_loss": "3"},
    ]
    axis = metrics.training_time_axis(rows)
    assert axis == pytest.approx({10: 1.0, 20: 2.0, 30: 3.0})
    assert metrics.training_time_axis([{"step": "4", "time_s": ""}]) == {}  # older logs


def test_mfu_against_the_stated_peak():
    # 100k tokens/s x 1 GFLOP/token on 2 devices of 100 TFLOP/s: 1e14 / 2e14
    assert metrics.mfu(1e5, 1e9, 2, 100e12) == pytest.approx(0.5)
    assert metrics.mfu(1e5, 1e9, 2, None) is None
    assert metrics.peak_flops(torch.device("cpu"), "bf16") == (None, "n/a on CPU")
    assert metrics.PEAK_FLOPS["H200"]["bf16"] == 989e12
