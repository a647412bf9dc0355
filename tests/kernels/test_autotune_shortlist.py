"""The autotune shortlist: where TMA can read the operands only the shortlist is timed, unless
``DMUON_SYRK_AUTOTUNE=all``; layouts TMA cannot read keep every pointer candidate."""

import dataclasses

import pytest
import torch
from dmuon_compile.kernels import syrk


def _tma_readable(monkeypatch):
    # CPU tensors have no TMA descriptors; pretend they do to exercise the selection rule.
    monkeypatch.setattr(syrk, "tma_descriptors", lambda a, b, config: object())


def test_tma_operands_time_the_shortlist_only(monkeypatch):
    _tma_readable(monkeypatch)
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE", raising=False)
    a = torch.empty(512, 1024)
    assert set(syrk.candidates_for(512, a, None)) == set(syrk.SHORTLIST)
    assert len(syrk.SHORTLIST) < len(syrk.CANDIDATES)


def test_all_times_every_fitting_candidate(monkeypatch):
    _tma_readable(monkeypatch)
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE", "all")
    a = torch.empty(512, 1024)
    assert syrk.candidates_for(512, a, None) == syrk.CANDIDATES


def test_without_tma_every_pointer_candidate_is_timed(monkeypatch):
    monkeypatch.setattr(syrk, "tma_descriptors", lambda a, b, config: None)
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE", raising=False)
    a = torch.empty(512, 1024)
    got = syrk.candidates_for(512, a, None)
    assert got == tuple(c for c in syrk.CANDIDATES if not c.tma)
    assert not set(got) & set(syrk.SHORTLIST)


def test_small_outputs_drop_wide_tiles_from_the_shortlist(monkeypatch):
    _tma_readable(monkeypatch)
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE", raising=False)
    a = torch.empty(64, 1024)
    got = syrk.candidates_for(64, a, None)
    assert got and all(c.cols <= 128 for c in got)


def test_products_with_c_also_time_c_in_the_prologue(monkeypatch):
    """With a beta·C term every timed TMA candidate is also timed with C loaded by TMA into the
    accumulator (``c_load="prologue"``) and, with TMA stores, by TMA in the epilogue
    (``"tma"``); without C that switch changes nothing, so it is not timed."""
    _tma_readable(monkeypatch)
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE", raising=False)
    a = torch.empty(512, 1024)
    with_c = syrk.candidates_for(512, a, None, has_c=True)
    assert set(with_c) == set(syrk.SHORTLIST) | {
        dataclasses.replace(c, c_load=load) for c in syrk.SHORTLIST for load in ("prologue", "tma")
    }
    assert all(c.c_load == "pointer" for c in syrk.candidates_for(512, a, None))
    monkeypatch.setattr(syrk, "tma_descriptors", lambda a, b, config: None)
    assert all(c.c_load == "pointer" for c in syrk.candidates_for(512, a, None, has_c=True))


def test_gram_products_and_products_with_c_on_sm90_also_time_the_gluon_kernel(monkeypatch):
    """Where the Gluon kernel can read the operands (SM90, row-major) its shortlist is timed
    beside the Triton candidates for a Gram-space product (``b`` given) with or without C and
    for a SYRK with C; a plain SYRK times its own shortlist (the 4-warp ping-pong, whose 4-deep
    ring fits only without C); none where it cannot read them; a verdict naming it
    round-trips through the cache's dict and is accepted."""
    pytest.importorskip("triton.experimental.gluon")
    from dmuon_compile.kernels import syrk_gluon

    a, c = (torch.empty(2, 256, 256, dtype=torch.bfloat16) for _ in range(2))
    assert syrk.gluon_candidates(a, a, c) == ()  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(syrk_gluon, "gluon_supported", lambda a, b, c=None: True)
    got = syrk.gluon_candidates(a, a, c)
    assert got and all(isinstance(g, syrk_gluon.GluonConfig) for g in got)
    assert syrk.gluon_candidates(a, a, None) == got  # a sym_mm without C
    assert syrk.gluon_candidates(a, None, c) == got  # a SYRK with C
    pingpong = syrk.gluon_candidates(a, None, None)  # a plain X·Xᵀ: its own shortlist
    assert [(g.consumers, g.num_warps, g.stages) for g in pingpong] == [(2, 4, 4)]
    assert pingpong[0] not in got
    monkeypatch.setattr(syrk, "GLUON_SYRK_SHORTLIST_FIELDS", ({"split": 2, "stages": 2},))
    plain = syrk.gluon_candidates(a, None, None)
    assert [g.name for g in plain] == ["g128x256_k64_s2_c1w8_cs2"]
    assert syrk.gluon_candidates(a, a, c) == got  # the other products keep theirs
    monkeypatch.setattr(syrk, "GLUON_SYRK_SHORTLIST_FIELDS", ())
    assert syrk.gluon_candidates(a, None, None) == ()
    monkeypatch.setattr(syrk_gluon, "gluon_supported", lambda a, b, c=None: False)
    assert syrk.gluon_candidates(a, a, c) == ()
    for config in got + pingpong + (syrk.DEFAULT_TMA_CONFIG,):
        assert syrk.config_from_dict(config.to_dict()) == config
        verdict = {"choice": config.name, "config": config.to_dict()}
        assert syrk._valid_verdict("key", verdict, "path")


def test_gluon_configs_that_would_not_fit_the_operands_are_not_timed(monkeypatch):
    """A shortlist entry whose shared memory exceeds 227 KiB for these dtypes (an fp32 C in a
    wide tile's 128×256 C block) is left out rather than failing at launch."""
    pytest.importorskip("triton.experimental.gluon")
    from dmuon_compile.kernels import syrk_gluon

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(syrk_gluon, "gluon_supported", lambda a, b, c=None: True)
    small = {"split": 1, "stages": 3, "c_slots": 1}
    wide = {"split": 2, "block_k": 32, "stages": 4, "c_slots": 1, "wide": True}
    monkeypatch.setattr(syrk, "GLUON_SHORTLIST_FIELDS", (small, wide))
    monkeypatch.setattr(syrk, "GLUON_WIDE_MIN_ROWS", 0)
    a = torch.empty(2, 256, 256, dtype=torch.bfloat16)
    both = syrk.gluon_candidates(a, a, a.clone())
    assert [c.wide for c in both] == [False, True]
    fp32_c = syrk.gluon_candidates(a, a, torch.empty(2, 256, 256))
    assert [c.wide for c in fp32_c] == [False]


def test_the_wide_gluon_tiles_are_timed_on_large_matrices_only(monkeypatch):
    """The default shortlist's wide 128×256 tiles are candidates from ``GLUON_WIDE_MIN_ROWS``
    rows (the 4096-row Gram products where they won); smaller matrices time the narrow tile
    only. Control: with the threshold lowered the small matrix gets them too."""
    pytest.importorskip("triton.experimental.gluon")
    from dmuon_compile.kernels import syrk_gluon

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(syrk_gluon, "gluon_supported", lambda a, b, c=None: True)
    big = torch.empty(1, syrk.GLUON_WIDE_MIN_ROWS, 8, dtype=torch.bfloat16).expand(1, -1, -1)
    small = torch.empty(4, syrk.GLUON_WIDE_MIN_ROWS // 2, 8, dtype=torch.bfloat16)
    wide_big = [g.wide for g in syrk.gluon_candidates(big, big, None)]
    assert wide_big.count(True) == 2 and wide_big.count(False) == 1
    assert [g.wide for g in syrk.gluon_candidates(small, small, None)] == [False]
    monkeypatch.setattr(syrk, "GLUON_WIDE_MIN_ROWS", small.shape[-2])
    assert [g.wide for g in syrk.gluon_candidates(small, small, None)].count(True) == 2


def test_a_gluon_verdict_checks_the_layout_once_per_key(monkeypatch):
    """A Gluon verdict holds for the layouts the Gluon kernel reads: ``tuned_choice`` checks the
    operands once per (shape, strides) key, falls back to the default Triton tile where the
    kernel cannot read them, and memoises that answer (no per-call check on the hot path)."""
    pytest.importorskip("triton.experimental.gluon")
    from dmuon_compile.kernels import autotune, syrk_gluon

    gluon = syrk_gluon.GluonConfig(split=1, stages=4)
    monkeypatch.setattr(syrk, "_tuned_choice_slow", lambda op, a, b, c: (gluon, True))
    checks = []
    readable = {True: (gluon,), False: ()}
    layout_ok = {"value": True}

    def fake_candidates(a, b, c):
        checks.append(tuple(a.stride()))
        return readable[layout_ok["value"]]

    monkeypatch.setattr(syrk, "gluon_candidates", fake_candidates)
    monkeypatch.setattr(autotune, "RESOLVED", {})
    a, c = torch.empty(2, 64, 64), torch.empty(2, 64, 64)
    for _ in range(3):
        assert syrk.tuned_choice("sym_mm", a, a, c, 0.5) == gluon
    assert len(checks) == 1  # memoised under the key
    layout_ok["value"] = False
    a_t = torch.empty(2, 64, 64).mT  # another layout: another key, checked once, falls back
    for _ in range(3):
        assert syrk.tuned_choice("sym_mm", a_t, a, c, 0.5) == syrk.default_config_for(a_t, a)
    assert len(checks) == 2
