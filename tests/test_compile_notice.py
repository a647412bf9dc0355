"""The compiled step's "compiling the Muon step" / "ready" notices are ``logging`` records of
``dmuon_compile.compiled_step`` (INFO on rank 0, DEBUG on the other ranks, none with
``DMUON_COMPILE_LOG=0``), never a print: nothing reaches stdout or stderr by themselves.

The notices are driven through ``CompiledMuonStep._first_call`` (what every compiled call
enters; compiling a step on CPU would take tens of seconds). Control: the old notice,
``log.progress``, writes to stderr, and the same stderr check sees it.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from dmuon_compile import compiled_step, log

NAME = "dmuon_compile.compiled_step"


def _first_call(calls: int = 0):
    fake = types.SimpleNamespace(calls=calls, first_call_s=None)
    mats = [torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(8, 8)]
    with compiled_step.CompiledMuonStep._first_call(fake, "Muon step", mats):
        pass
    return fake


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for key in ("DMUON_COMPILE_LOG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def test_notice_is_an_info_record_on_rank_0_and_no_print(caplog, capfd):
    with caplog.at_level(logging.DEBUG, logger="dmuon_compile"):
        fake = _first_call()
    assert fake.calls == 1 and fake.first_call_s is not None
    records = [r for r in caplog.records if r.name == NAME]
    messages = [r.getMessage() for r in records]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO], messages
    assert messages[0].startswith("[DMuon][rank=0/1] compiling the Muon step (3 matrices, 2 ")
    assert "compiled Muon step ready: first call (trace + compile + run) took" in messages[1]
    out, err = capfd.readouterr()
    assert "compiling the" not in out + err and "ready" not in out + err


def test_other_ranks_log_at_debug(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.DEBUG, logger="dmuon_compile"):
        _first_call()
    records = [r for r in caplog.records if r.name == NAME]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]
    assert records[0].getMessage().startswith("[DMuon][rank=3/4] compiling the Muon step")
    with caplog.at_level(logging.INFO, logger="dmuon_compile"):
        caplog.clear()
        _first_call()
    assert not [r for r in caplog.records if r.name == NAME]  # INFO shows rank 0's only


def test_switch_silences_and_later_calls_are_quiet(caplog, monkeypatch):
    with caplog.at_level(logging.DEBUG, logger="dmuon_compile"):
        _first_call(calls=1)  # not the first call: no notice
        monkeypatch.setenv("DMUON_COMPILE_LOG", "0")
        _first_call()
    assert not [r for r in caplog.records if r.name == NAME]


def test_control_a_progress_print_reaches_stderr(capfd):
    log.progress("compiling the Muon step (control)")
    assert "compiling the Muon step (control)" in capfd.readouterr().err
