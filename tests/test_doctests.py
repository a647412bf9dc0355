"""The package's docstring examples (``>>>``) run and print what they show: every module of
``dmuon_compile`` (``kernels`` and ``passes`` included) through :mod:`doctest`.

Control: a planted wrong example fails the same runner."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import dmuon_compile
from dmuon_compile import kernels, passes

# kernels/ and passes/ live beside the package folder (pyproject's package-dir): walked apart.
PACKAGES = (dmuon_compile, kernels, passes)
MODULES = sorted(  # a __main__ module runs its program when imported
    {p.__name__ for p in PACKAGES[1:]}
    | {
        m.name
        for p in PACKAGES
        for m in pkgutil.walk_packages(p.__path__, prefix=f"{p.__name__}.")
        if not m.name.endswith(".__main__")
    }
)


def run_examples(module) -> doctest.TestResults:
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(verbose=False)
    for test in finder.find(module, module.__name__):
        runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional dependency (an extra) this machine lacks
        pytest.skip(f"{name}: {e}")
    results = run_examples(module)
    assert results.failed == 0, f"{name}: {results.failed} of {results.attempted} examples failed"


def test_control_a_wrong_example_fails():
    import types

    module = types.ModuleType("planted")
    module.__doc__ = ">>> 1 + 1\n3\n"
    results = run_examples(module)
    assert (results.failed, results.attempted) == (1, 1)
