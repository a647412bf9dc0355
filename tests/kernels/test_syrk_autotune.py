"""Autotune verdicts, their JSON cache and the CUDA dispatch of the ops, on CPU with mocks.

The GPU-only pieces (timing, device name, the Triton launch) are replaced: ``autotune.time_ms``
returns scripted times, the "Triton launch" is the torch reference (recording its configs),
and the dispatch functions ``syrk_cuda``/``sym_mm_cuda`` are called directly on CPU tensors.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from dmuon_compile.kernels import autotune, syrk
from dmuon_compile.kernels.lower_tiles import TileConfig
from dmuon_compile.kernels.ops import sym_mm_reference, syrk_reference


class FakeGPU:
    """Scripted timings per candidate name (``"cublas"`` for cuBLAS) and a reference 'kernel'."""

    def __init__(self, monkeypatch, timings: dict[str, float], broken: set[str] = frozenset()):
        self.timings = dict(timings)
        self.broken = set(broken)
        self.launches: list[str] = []
        self.timed: list[str] = []
        self._current = None
        # CPU tensors stand in for the GPU's: TMA cannot read them, whether or not pytest itself
        # runs under TRITON_INTERPRET=1 (which would make their descriptors buildable).
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(syrk, "_device_name", lambda index: "Fake GPU 80GB")
        monkeypatch.setattr(syrk, "triton_status", lambda index=None: (True, "SM90 (mocked)"))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(syrk, "launch_symmetric_product", self.launch)
        monkeypatch.setattr(syrk, "symmetric_product_cublas", self.cublas)
        monkeypatch.setattr(autotune, "time_ms", self.time_ms)

    def launch(self, a, b, c, alpha, beta, gamma, config, **_):
        self.launches.append(config.name)
        self._current = config.name
        if config.name in self.broken:
            return torch.full((a.shape[:-2]) + (a.shape[-2],) * 2, 1e4, dtype=a.dtype)
        if b is None:
            return syrk_reference(a, c, alpha, beta, gamma)
        return sym_mm_reference(a, b, c, alpha, beta, gamma)

    def cublas(self, a, b, c, alpha, beta, gamma, mirror=True):
        self._current = "cublas"
        if b is None:
            return syrk_reference(a, c, alpha, beta, gamma)
        return sym_mm_reference(a, b, c, alpha, beta, gamma)

    def time_ms(self, fn):
        fn()
        self.timed.append(self._current)
        return self.timings[self._current]


def _all_candidates(ms: float) -> dict[str, float]:
    return {config.name: ms for config in syrk.CANDIDATES}


def test_fastest_candidate_wins_and_is_used(cache_dir, monkeypatch, capsys):
    times = _all_candidates(2.0) | {"cublas": 1.5, "b128_k64_w8_s4_p1": 1.0}
    gpu = FakeGPU(monkeypatch, times)
    x = torch.randn(2, 300, 500, dtype=torch.bfloat16)
    before = torch.get_rng_state()
    out = syrk.syrk_cuda(x, None, 1.0, 0.0, 0.0)
    assert torch.equal(torch.get_rng_state(), before), "autotune touched the global RNG"
    assert gpu.launches[-1] == "b128_k64_w8_s4_p1"
    torch.testing.assert_close(out, syrk_reference(x, None, 1.0, 0.0, 0.0))
    err = capsys.readouterr().err
    assert "[DMuon][rank=0/1] SYRK autotune started" in err
    assert "SYRK autotune candidate started b128_k64_w8_s4_p1" in err
    assert "verdict" in err and "b128_k64_w8_s4_p1" in err
    # Second call: no tuning, no progress lines, same kernel.
    n_timed = len(gpu.timed)
    syrk.syrk_cuda(x, None, 1.0, 0.0, 0.0)
    assert len(gpu.timed) == n_timed
    assert capsys.readouterr().err == ""
    data = json.loads(next(cache_dir.glob("syrk_autotune_*.json")).read_text())
    key = autotune.make_key("syrk", x, False)
    assert data["verdicts"][key]["choice"] == "b128_k64_w8_s4_p1"
    assert data["version"] == autotune.CACHE_VERSION


def test_cublas_wins_when_no_candidate_beats_it_by_the_margin(cache_dir, monkeypatch):
    times = _all_candidates(1.0 - autotune.WIN_MARGIN / 2) | {"cublas": 1.0}
    gpu = FakeGPU(monkeypatch, times)
    a = torch.randn(64, 64, dtype=torch.float16)
    c = torch.randn(64, 64, dtype=torch.float16)
    out = syrk.sym_mm_cuda(a, a.mT, c, 2.0, 0.5, 1.0)
    assert gpu._current == "cublas"
    torch.testing.assert_close(out, sym_mm_reference(a, a.mT, c, 2.0, 0.5, 1.0))


def test_wrong_or_failing_candidates_are_rejected(cache_dir, monkeypatch, capsys):
    wrong, failing = syrk.CANDIDATES[0].name, syrk.CANDIDATES[1].name
    times = _all_candidates(3.0) | {"cublas": 2.0, wrong: 0.5, syrk.CANDIDATES[2].name: 1.0}
    gpu = FakeGPU(monkeypatch, times, broken={wrong})
    real_launch = gpu.launch

    def launch(a, b, c, alpha, beta, gamma, config, **kw):
        if config.name == failing:
            raise RuntimeError("out of shared memory (mocked)")
        return real_launch(a, b, c, alpha, beta, gamma, config, **kw)

    monkeypatch.setattr(syrk, "launch_symmetric_product", launch)
    syrk.syrk_cuda(torch.randn(256, 300, dtype=torch.bfloat16), None, 1.0, 0.0, 0.0)
    assert gpu.launches[-1] == syrk.CANDIDATES[2].name
    err = capsys.readouterr().err
    assert f"candidate {wrong} rejected" in err
    assert f"candidate {failing} failed" in err


def test_a_candidate_must_agree_below_the_diagonal_and_mirror_exactly():
    """The autotune's check of a candidate: a right lower triangle with a wrong or inexact
    mirror is refused too (the Gluon and Triton kernels compute one triangle and mirror it)."""
    a = torch.randn(3, 64, 96)
    product = a @ a.mT
    reference = torch.tril(product) + torch.tril(product, -1).mT  # exactly symmetric
    assert syrk.candidate_matches(reference.clone(), reference)
    wrong_mirror = reference.clone()
    wrong_mirror[:, 0, 5] += 1.0  # above the diagonal only: the lower triangle still agrees
    assert not syrk.candidate_matches(wrong_mirror, reference)
    inexact = torch.tril(reference) + torch.tril(reference, -1).mT * (1 + 1e-6)
    assert not syrk.candidate_matches(inexact, reference)
    wrong_lower = reference.clone()
    wrong_lower[:, 40:, :20] *= 2.0
    wrong_lower[:, :20, 40:] *= 2.0  # symmetric, but the products differ
    assert not syrk.candidate_matches(wrong_lower, reference)
    nan = reference.clone()
    nan[0, 1, 1] = float("nan")
    assert not syrk.candidate_matches(nan, reference)


def test_progress_lines_silenced_by_env(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "0")
    FakeGPU(monkeypatch, _all_candidates(1.0) | {"cublas": 2.0})
    syrk.syrk_cuda(torch.randn(128, 256, dtype=torch.float16), None, 1.0, 0.0, 0.0)
    assert "autotune" not in capsys.readouterr().err


def test_autotune_disabled_uses_heuristic(cache_dir, monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE", "0")
    gpu = FakeGPU(monkeypatch, {})
    syrk.syrk_cuda(torch.randn(1024, 64, dtype=torch.bfloat16), None, 1.0, 0.0, 0.0)
    assert gpu.timed == [] and gpu.launches == [syrk.DEFAULT_CONFIG.name]
    syrk.syrk_cuda(torch.randn(64, 64, dtype=torch.bfloat16), None, 1.0, 0.0, 0.0)
    assert gpu._current == "cublas"


def test_autotune_disabled_prefers_the_tma_default_where_descriptors_fit(cache_dir, monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE", "0")
    gpu = FakeGPU(monkeypatch, {})
    readable = []
    monkeypatch.setattr(
        syrk, "tma_descriptors", lambda a, b, config: readable[0] if readable else None
    )
    syrk.syrk_cuda(torch.randn(1024, 64, dtype=torch.bfloat16), None, 1.0, 0.0, 0.0)
    assert gpu.launches == [syrk.DEFAULT_CONFIG.name]  # descriptors cannot read it: pointers
    autotune.clear_memory_caches()
    readable.append(object())
    syrk.syrk_cuda(torch.randn(1024, 64, dtype=torch.bfloat16), None, 1.0, 0.0, 0.0)
    assert gpu.launches[-1] == syrk.DEFAULT_TMA_CONFIG.name and gpu.timed == []


def test_verdict_round_trip_through_a_new_process_cache(cache_dir):
    cache = autotune.verdict_cache("NVIDIA H200")
    verdict = {
        "choice": "b128_k64_w8_s3_p1",
        "config": TileConfig(128, 64, 8, 3).to_dict(),
        "cublas_ms": 1.0,
        "timings_ms": {"b128_k64_w8_s3_p1": 0.7},
    }
    cache.put("syrk|b1|m4096|k14336|bfloat16|c0|row", verdict)
    cache.put("sym_mm|b1|m512|k512|float16|c1|row", {"choice": "cublas", "config": None})
    autotune.clear_memory_caches()
    fresh = autotune.verdict_cache("NVIDIA H200")
    assert fresh is not cache
    assert fresh.get("syrk|b1|m4096|k14336|bfloat16|c0|row") == verdict
    assert TileConfig.from_dict(verdict["config"]) == TileConfig(128, 64, 8, 3)
    assert fresh.get("sym_mm|b1|m512|k512|float16|c1|row")["choice"] == "cublas"
    assert fresh.get("syrk|b1|m1|k1|float16|c0|row") is None


def test_corrupt_cache_file_warns_and_is_replaced(cache_dir):
    path = autotune.cache_path("NVIDIA H200")
    path.write_text("{not json")
    cache = autotune.verdict_cache("NVIDIA H200")
    with pytest.warns(RuntimeWarning, match="corrupt SYRK autotune cache"):
        assert cache.get("anything") is None
    cache.put("k", {"choice": "cublas", "config": None})
    assert json.loads(path.read_text())["verdicts"]["k"]["choice"] == "cublas"


@pytest.mark.parametrize(
    "field,value", [("version", autotune.CACHE_VERSION + 1), ("triton", "0.0.1")]
)
def test_stale_cache_file_is_ignored_with_a_warning(cache_dir, field, value):
    path = autotune.cache_path("NVIDIA H200")
    payload = {**autotune._versions(), "verdicts": {"k": {"choice": "b128_k64_w8_s3_p1"}}}
    payload[field] = value
    path.write_text(json.dumps(payload))
    with pytest.warns(RuntimeWarning, match="stale SYRK autotune cache"):
        assert autotune.verdict_cache("NVIDIA H200").get("k") is None


def test_valid_cache_file_loads_without_warning(cache_dir):
    path = autotune.cache_path("NVIDIA H200")
    path.write_text(json.dumps({**autotune._versions(), "verdicts": {"k": {"choice": "cublas"}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.verdict_cache("NVIDIA H200").get("k") == {"choice": "cublas"}


def test_default_cache_dir_is_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv("DMUON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotune.default_cache_dir() == tmp_path / "dmuon_compile"
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "x"))
    assert autotune.default_cache_dir() == tmp_path / "x"


def test_tuning_inputs_leave_global_rng_alone_and_keep_layouts():
    a = torch.randn(3, 40, 24).mT  # column-major stack
    b = torch.randn(3, 40, 24)
    state = torch.get_rng_state()
    a_t, b_t, c_t = syrk._tuning_inputs(a, b, None)
    assert torch.equal(torch.get_rng_state(), state)
    assert a_t.stride() == a.stride() and b_t.stride() == b.stride() and c_t is None
    torch.testing.assert_close(b_t, a_t.mT)  # sym_mm tuning product is symmetric
    assert a_t.abs().sum() > 0


def test_cublas_path_is_exactly_symmetric_and_matches_reference():
    x = torch.randn(2, 37, 50)
    c = torch.randn(2, 37, 37)
    out = syrk.symmetric_product_cublas(x, None, c, 0.5, 2.0, 1.5)
    assert torch.equal(out, out.mT)
    torch.testing.assert_close(out, syrk_reference(x, c, 0.5, 2.0, 1.5), rtol=1e-5, atol=1e-5)
