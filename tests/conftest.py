"""Shared test settings: hypothesis profiles and the GPU marker."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty autotune verdict directory (``DMUON_CACHE_DIR``), in-memory verdicts cleared."""
    from dmuon_compile.kernels import autotune

    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    autotune.clear_memory_caches()
    yield tmp_path
    autotune.clear_memory_caches()
