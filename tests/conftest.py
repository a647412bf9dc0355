"""Shared test settings: hypothesis profiles, the GPU and slow markers, the CUDA tier's device."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from tiers import NOT_DISTRIBUTED_ENV, is_slow

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("DMUON_HYPOTHESIS_EXAMPLES", 25)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile(
    "dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _tier_device() -> str:
    """Where the multi-rank CUDA tier (``tier`` marker) runs: ``DMUON_TIER_DEVICE``, default
    ``cuda``; ``cpu`` runs the same tests over gloo on the CPU (to check the tier itself)."""
    device = os.environ.get("DMUON_TIER_DEVICE", "cuda")
    if device not in ("cuda", "cpu"):
        raise pytest.UsageError(f"DMUON_TIER_DEVICE={device!r}: use cuda (default) or cpu")
    return device


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    unmarked = item.get_closest_marker("distributed") is None
    if unmarked:
        os.environ[NOT_DISTRIBUTED_ENV] = item.nodeid
    try:
        yield
    finally:
        if unmarked:
            os.environ.pop(NOT_DISTRIBUTED_ENV, None)


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    tier_on_cpu = _tier_device() == "cpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_tier = pytest.mark.skip(reason="needs a CUDA GPU (DMUON_TIER_DEVICE=cpu: on the CPU)")
    for item in items:  # markers, not keywords: those also hold the names of the directories
        if item.get_closest_marker("tier") is not None:
            if not tier_on_cpu:
                item.add_marker(skip_tier)
        elif item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def tier_device() -> str:
    """The multi-rank CUDA tier's device, ``"cuda"`` or (``DMUON_TIER_DEVICE=cpu``) ``"cpu"``."""
    return _tier_device()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty autotune verdict directory (``DMUON_CACHE_DIR``), in-memory verdicts cleared."""
    from dmuon_compile.kernels import autotune

    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    autotune.clear_memory_caches()
    yield tmp_path
    autotune.clear_memory_caches()
