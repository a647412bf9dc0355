"""benchmarks/gluon_probe.py's shortlist pick: which Gluon configurations one probe's timings
send to the autotune (no GPU: the timings are given)."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark  # tests/ is on sys.path

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon (3.5+ has)")

probe = load_benchmark("gluon_probe")


def rows(**times):
    """``gluon <name>`` rows: name=ms (correct) or name=(ms, False) (a wrong result)."""
    out = []
    for name, t in times.items():
        ms, ok = t if isinstance(t, tuple) else (t, True)
        out.append((f"gluon {name}", ms, 0.0, ok))
    return out + [("cublas", 0.5, 0.0, True), ("triton b128", 0.1, 0.0, True)]


def test_a_configuration_faster_somewhere_joins_the_base():
    cases = {"rr2048": rows(base=1.0, new=0.95), "rr4096": rows(base=2.0, new=2.1)}
    assert probe.pick_shortlist(cases, "base") == ["base", "new"]


def test_a_configuration_wrong_in_any_case_is_left_out_however_fast():
    cases = {"rr2048": rows(base=1.0, new=0.5), "rr4096": rows(base=2.0, new=(1.0, False))}
    assert probe.pick_shortlist(cases, "base") == ["base"]


def test_within_the_margin_is_not_faster():
    cases = {"rr2048": rows(base=1.0, new=0.99)}
    assert probe.pick_shortlist(cases, "base") == ["base"]
    # Without a margin it is faster in every case: it replaces the base.
    assert probe.pick_shortlist(cases, "base", margin=0.0) == ["new"]


def test_the_base_goes_when_a_kept_configuration_beats_it_everywhere():
    cases = {"rr2048": rows(base=1.0, new=0.9, mid=0.97), "rr4096": rows(base=2.0, new=1.8)}
    assert probe.pick_shortlist(cases, "base") == ["new", "mid"]


def test_triton_and_cublas_rows_are_not_candidates():
    """Only Gluon configurations are picked: the Triton shortlist and cuBLAS are timed anyway."""
    cases = {"rr2048": rows(base=1.0)}
    assert probe.pick_shortlist(cases, "base") == ["base"]


def test_the_spec_parses_back_to_the_same_configurations():
    spec = (
        "split=1,stages=4;split=2,block_k=32,stages=4,c_slots=1,wide=1;"
        "split=1,stages=3,consumers=2,num_warps=8"
    )
    configs = probe.parse_configs(spec)
    again = probe.parse_configs(probe.config_spec(configs))
    assert [c.name for c in again] == [c.name for c in configs]
    assert again == configs
