"""The TMA kernel compiles for SM90 on a machine without a GPU (Triton's bundled ptxas), and
reading C by TMA (``c_load="prologue"`` or ``"tma"``) keeps the 128-row tiles free of register
spills where the epilogue's pointer loads of C spill them (``benchmarks/kernel_resources.py``)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from bench_scripts import load_benchmark  # tests/ is on sys.path

triton = pytest.importorskip("triton")
_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (_TOOLS / "ptxas").exists() or not (_TOOLS / "cuobjdump").exists():
    pytest.skip("this Triton has no bundled ptxas/cuobjdump", allow_module_level=True)

from dmuon_compile.kernels.syrk import DEFAULT_TMA_CONFIG, SHORTLIST  # noqa: E402
from dmuon_compile.kernels.syrk_tma import _triton_has_descriptors  # noqa: E402

if not _triton_has_descriptors():
    pytest.skip("this Triton has no host-side TMA descriptors", allow_module_level=True)

resources = load_benchmark("kernel_resources")

STRIPS = next(c for c in SHORTLIST if c.cols == 2 * c.block)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, not interprets")
@pytest.mark.parametrize("config", [DEFAULT_TMA_CONFIG, STRIPS], ids=lambda c: c.name)
def test_c_by_tma_spills_less(config):
    """Both shortlist tiles compile for SM90 with C read by TMA, inside the shared memory of an
    H100/H200 (227 KB): into the accumulator's start with no spill stack, and in the epilogue
    of the tiles below the diagonal with less than the pointer loads' (the diagonal tiles
    still load C by pointers); the tiles with C loaded by pointers spill (the control: the
    measurement sees a spill when there is one)."""
    by_pointers = resources.compile_sm90(replace(config, c_load="pointer"), has_c=True)
    assert by_pointers["spill"] > 0, by_pointers
    prologue = resources.compile_sm90(replace(config, c_load="prologue"), has_c=True)
    assert prologue["spill"] == 0 and prologue["shared"] <= 227 * 1024, prologue
    epilogue = resources.compile_sm90(replace(config, c_load="tma"), has_c=True)
    assert epilogue["spill"] < by_pointers["spill"], (epilogue, by_pointers)
    assert epilogue["shared"] <= 227 * 1024, epilogue
