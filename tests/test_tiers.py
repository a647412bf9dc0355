"""The test tiers (docs/testing.md): the `slow` list names real tests, and a test that spawns
ranks without the `distributed` marker fails instead of slipping into the fast tier."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from distributed import harness
from distributed.harness import run_ranks
from tiers import NOT_DISTRIBUTED_ENV, SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]


def test_every_slow_entry_names_a_test_function():
    missing = []
    for path, names in SLOW.items():
        text = (ROOT / path).read_text(encoding="utf-8") if (ROOT / path).is_file() else ""
        missing += [
            f"{path}::{n}"
            for n in names
            if not (re.search(rf"^def {re.escape(n)}\(", text, re.M) or (n == "*" and text))
        ]
    assert not missing, f"tests/tiers.py SLOW names tests that do not exist: {missing}"


def test_slow_ids_match_by_name_or_whole_file():
    assert is_slow("tests/passes/test_ns_rewrite.py::test_gram_chain_fully_rewritten[norestart]")
    assert is_slow("tests/kernels/test_syrk_interpret.py::test_c_by_tma_property")
    assert not is_slow("tests/passes/test_ns_rewrite.py::test_gram_chain_fully_rewritten_x")
    assert not is_slow("tests/test_muon.py::test_compiled_step_equals_eager_step")


def test_the_markers_are_registered_and_the_tiers_documented():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for marker in ("gpu", "tier", "distributed", "slow"):
        assert f'    "{marker}: ' in pyproject, marker
    assert '-m "not distributed and not slow"' in (ROOT / "docs/testing.md").read_text("utf-8")


def _never_runs(rank, world):  # pragma: no cover - no rank is ever started here
    raise AssertionError("a rank started")


class _Reached(Exception):
    pass


def test_an_unmarked_test_cannot_spawn_ranks(monkeypatch):
    """This test has no `distributed` marker: conftest names it in the environment and the
    harness refuses to start ranks (before binding a store or spawning)."""
    with pytest.raises(RuntimeError, match="not marked @pytest.mark.distributed"):
        run_ranks(_never_runs, 2, timeout=5)
    # control: without the flag the launch goes on to spawning (stopped there: no process)
    # Not monkeypatch.delenv: its teardown would set the name back after conftest's hook has
    # removed it, and every later test would count as unmarked.
    os.environ.pop(NOT_DISTRIBUTED_ENV)

    def no_spawn(method):
        raise _Reached(method)

    monkeypatch.setattr(harness.mp, "get_context", no_spawn)
    with pytest.raises(_Reached):
        run_ranks(_never_runs, 2, timeout=5)
