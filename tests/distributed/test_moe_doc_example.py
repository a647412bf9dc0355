"""docs/moe.md's plain-PyTorch expert-parallel example runs as given: its code block, extracted
from the page, launched by ``torchrun`` on 4 CPU ranks (gloo), trains 3 steps.

Control: the example as the page had it before (``ep``, ``build_moe`` and ``nn`` undefined, no
process group) fails under the same launcher.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from native_crash import run_torchrun  # tests/ is on sys.path

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Example: plain PyTorch, FSDP2 + expert parallelism"
OLD_PAGE = "6308a27"  # a commit whose docs/moe.md has the example that did not run


def example(page: str) -> str:
    """The first ``python`` code block after :data:`HEADING` in ``page``."""
    section = page[page.index(HEADING) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def launch(code: str, folder: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 4`` of ``code`` saved as a script."""
    script = folder / "moe_ep.py"
    script.write_text(code)
    env = {"CUDA_VISIBLE_DEVICES": ""}
    return run_torchrun([str(script)], 4, timeout=timeout, env=env, cwd=folder)


def test_moe_page_expert_parallel_example_runs_as_given(tmp_path):
    done = launch(example((ROOT / "docs" / "moe.md").read_text()), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3, done.stdout
    assert losses[-1] < losses[0]  # it trains


def test_control_the_old_example_fails_under_the_same_launcher(tmp_path):
    try:
        page = subprocess.run(
            ["git", "show", f"{OLD_PAGE}:docs/moe.md"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history with the old page")
    done = launch(example(page), tmp_path, timeout=90)
    assert done.returncode != 0
    assert "NameError" in done.stderr or "init_process_group" in done.stderr, done.stderr[-3000:]
