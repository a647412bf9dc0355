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


class Notices(logging.Handler):
    """The records of the notices' logger, collected by a handler on that logger itself: once
    ``TORCH_LOGS`` names ``dmuon`` (another test may have), torch's logging stops the package's
    records from propagating to the root logger, where ``caplog`` listens."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def notices():
    logger = logging.getLogger(NAME)
    handler, old_level = Notices(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_notice_is_an_info_record_on_rank_0_and_no_print(notices, capfd):
    fake = _first_call()
    assert fake.calls == 1 and fake.first_call_s is not None
    records = notices.records
    messages = [r.getMessage() for r in records]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO], messages
    assert messages[0].startswith("[DMuon][rank=0/1] compiling the Muon step (3 matrices, 2 ")
    assert "compiled Muon step ready: first call (trace + compile + run) took" in messages[1]
    out, err = capfd.readouterr()
    assert "compiling the" not in out + err and "ready" not in out + err


def test_other_ranks_log_at_debug(notices, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    _first_call()
    records = list(notices.records)
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]
    assert records[0].getMessage().startswith("[DMuon][rank=3/4] compiling the Muon step")
    notices.records.clear()
    logging.getLogger(NAME).setLevel(logging.INFO)
    _first_call()
    assert notices.records == []  # INFO shows rank 0's only


def test_switch_silences_and_later_calls_are_quiet(notices, monkeypatch):
    _first_call(calls=1)  # not the first call: no notice
    monkeypatch.setenv("DMUON_COMPILE_LOG", "0")
    _first_call()
    assert notices.records == []
    monkeypatch.delenv("DMUON_COMPILE_LOG")
    _first_call()  # the control: the same collector sees a first call's notices
    assert len(notices.records) == 2


def test_notices_reach_the_collector_after_torch_logs_names_dmuon(notices, monkeypatch):
    """The order that broke ``caplog``: ``TORCH_LOGS="+dmuon"`` applied first."""
    monkeypatch.setenv("TORCH_LOGS", "+dmuon")
    try:
        log.register_torch_logs()
        _first_call()
    finally:
        monkeypatch.delenv("TORCH_LOGS")
        log.register_torch_logs()
    assert [r.levelno for r in notices.records] == [logging.INFO, logging.INFO]


def test_control_a_progress_print_reaches_stderr(capfd):
    log.progress("compiling the Muon step (control)")
    assert "compiling the Muon step (control)" in capfd.readouterr().err
