"""benchmarks/comm_memory.py: a clear "needs CUDA" exit on CPU; one line per group on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_memory.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_needs_cuda_exit_on_cpu():
    out = _run()
    assert out.returncode == 2, out
    assert "needs CUDA" in out.stderr and not out.stdout, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_line_per_group_on_a_gpu():
    out = _run("--groups", "2")
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [line[1] for line in lines] == [
        "what=default_group",
        "what=new_group_1",
        "what=new_group_2",
    ]
    for line in lines:
        fields = dict(f.split("=", 1) for f in line[1:] if "=" in f)
        assert float(fields["mib"]) >= 0.0 and float(fields["seconds"]) > 0.0, line
