"""The tests' one policy for a process killed by the C runtime, and ``torchrun`` launches under it.

A rank that dies of SIGABRT, SIGSEGV or SIGBUS died in native code (a heap corruption inside
gloo, a C++ thread torn down at interpreter exit: "terminate called without an active
exception"), which Python code cannot cause. Such a run is repeated once, with a warning that
names the signal; a second crash fails the test. Exceptions, assertion failures, non-zero exits
and timeouts are never retried. ``tests/distributed/harness.py`` applies the same policy to its
spawned ranks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings

NATIVE_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
NATIVE_CRASH_RETRIES = 1
# torchrun's failure report names each failed local rank's exit code ("exitcode : -6 (pid: 7)").
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def native_crash_signals(output: str) -> list[str]:
    """Names of the native-crash signals that killed ranks, read from torchrun's failure report."""
    codes = {int(c) for c in _EXITCODE.findall(output)}
    return sorted(signal.Signals(-c).name for c in codes if c < 0 and -c in NATIVE_CRASH_SIGNALS)


def run_torchrun(
    argv: list[str],
    nproc: int,
    *,
    timeout: float,
    env: dict | None = None,
    cwd=None,
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc *argv``, its output
    captured; run once more (with a RuntimeWarning) if a rank died of a native crash."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(nproc), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(NATIVE_CRASH_RETRIES + 1):
        done = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        crashed = native_crash_signals(done.stderr) if done.returncode != 0 else []
        if not crashed or attempt == NATIVE_CRASH_RETRIES:
            return done
        warnings.warn(
            f"torchrun {' '.join(argv)}: ranks died of {crashed}; running it again",
            RuntimeWarning,
            stacklevel=2,
        )
    raise AssertionError("unreachable")
