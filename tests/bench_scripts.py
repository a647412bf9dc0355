"""The benchmark scripts (``benchmarks/*.py``, not a package) as modules, for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_LOADED: dict[str, ModuleType] = {}


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed once per test session (as ``_dmuon_bench_<name>``)."""
    if name not in _LOADED:
        if str(BENCHMARKS) not in sys.path:
            sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings
        spec = importlib.util.spec_from_file_location(
            f"_dmuon_bench_{name}", BENCHMARKS / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[name] = module
    return _LOADED[name]
