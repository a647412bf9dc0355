"""The harness itself: the rendezvous port cannot be taken from under a run; a native crash
reruns a call (or a torchrun launch) once, nothing else does.

The race a bind-to-0-then-release launcher loses: between the launcher closing its probe socket
and rank 0 binding the port, another process takes it, and rank 0 fails with ``EADDRINUSE``.
The test makes that race certain: every socket the launcher opens from Python has its port taken
by a listening socket the moment it is closed.
"""

from __future__ import annotations

import socket

import pytest
import torch
from native_crash import native_crash_signals, run_torchrun  # tests/ is on sys.path

from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _rank_sum(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def test_run_survives_a_port_thief(monkeypatch):
    real = socket.socket
    stolen = []

    class PortThief(real):
        def close(self):
            try:
                port = self.getsockname()[1]
            except OSError:
                port = 0
            super().close()
            if port:  # another program binds the port the moment it is free
                thief = real()
                thief.bind(("127.0.0.1", port))
                thief.listen()
                stolen.append(thief)

    monkeypatch.setattr(socket, "socket", PortThief)
    try:
        assert run_ranks(_rank_sum, 2, timeout=60) == [3.0, 3.0]
    finally:
        for s in stolen:
            s.close()


def _both_gathers(rank, world):
    from torch.distributed.tensor import DTensor

    from . import models
    from .harness import whole_tensor

    model, _ = models.build_dedicated(world)
    out = {}
    for name, p in model.named_parameters():
        if type(p) is DTensor:  # FSDP2's Shard(0) parameters (dedicated ones are OwnerTensor)
            out[name] = (whole_tensor(p, plain_collectives=True), p.full_tensor())
    return out


def test_whole_tensor_without_functional_collectives_equals_full_tensor():
    """The gather the one-GPU tier uses (gloo ranks sharing a GPU, where DTensor's functional
    collectives crash) equals ``full_tensor()`` for every FSDP2 parameter."""
    (res, *_) = run_ranks(_both_gathers, 2, timeout=90)
    assert len(res) > 5
    for name, (plain, full) in res.items():
        assert torch.equal(plain, full), name


def _abort_first_time(rank, world, marker):
    import os
    from pathlib import Path

    import torch.distributed as dist

    dist.barrier()
    if rank == 1 and not Path(marker).exists():
        try:
            Path(marker).touch()
        except OSError:
            pass  # no marker: the rerun crashes too
        os.abort()  # a native crash: SIGABRT, as glibc's heap checks raise it
    return _rank_sum(rank, world)


def _count_and_fail(rank, world, log):
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("an ordinary failure")


def test_native_crash_reruns_the_call_once(tmp_path):
    marker = tmp_path / "crashed"
    with pytest.warns(RuntimeWarning, match="SIGABRT.*running the call again"):
        assert run_ranks(_abort_first_time, 2, str(marker), timeout=60) == [3.0, 3.0]
    assert marker.exists()  # control: the first run did crash


def test_native_crash_twice_fails():
    from .harness import NativeCrash

    # the marker cannot be written in a missing directory: every attempt crashes
    with pytest.warns(RuntimeWarning), pytest.raises(NativeCrash, match="SIGABRT"):
        run_ranks(_abort_first_time, 2, "/nonexistent-dir/marker", timeout=60)


def test_an_exception_is_not_rerun(tmp_path):
    log = tmp_path / "log"
    with pytest.raises(AssertionError, match="an ordinary failure"):
        run_ranks(_count_and_fail, 2, str(log), timeout=60)
    assert len(log.read_text().split()) <= 2  # one run: each rank at most once


# torchrun launches (tests/native_crash.py): one rank, a script that counts its runs.
_SCRIPT = """
import os, sys
runs = os.path.join(sys.argv[1], "runs")
with open(runs, "a") as f:
    f.write("x")
n = len(open(runs).read())
if sys.argv[2] == "abort" and n <= int(sys.argv[3]):
    os.abort()
if sys.argv[2] == "raise":
    raise ValueError("an ordinary error")
print("done")
"""


def _torchrun(tmp_path, mode, aborts=0):
    script = tmp_path / "count.py"
    script.write_text(_SCRIPT)
    done = run_torchrun([str(script), str(tmp_path), mode, str(aborts)], 1, timeout=60)
    return done, len((tmp_path / "runs").read_text())


def test_torchrun_native_crash_reruns_once(tmp_path):
    with pytest.warns(RuntimeWarning, match="SIGABRT"):
        done, runs = _torchrun(tmp_path, "abort", aborts=1)
    assert done.returncode == 0 and "done" in done.stdout and runs == 2


def test_torchrun_native_crash_twice_fails(tmp_path):
    with pytest.warns(RuntimeWarning, match="SIGABRT"):
        done, runs = _torchrun(tmp_path, "abort", aborts=2)
    assert done.returncode != 0 and runs == 2
    assert native_crash_signals(done.stderr) == ["SIGABRT"]


def test_torchrun_exception_is_not_rerun(tmp_path):
    done, runs = _torchrun(tmp_path, "raise")
    assert done.returncode != 0 and runs == 1
    assert "ValueError" in done.stderr and native_crash_signals(done.stderr) == []


def _rank0_stays_in_here(rank, world):
    import time

    import torch.distributed as dist

    if rank == 0:
        time.sleep(60)
    dist.barrier()


def test_a_timeout_prints_where_each_rank_waited(capfd):
    with pytest.raises(TimeoutError, match="their stacks: stderr"):
        run_ranks(_rank0_stays_in_here, 2, timeout=8)
    err = capfd.readouterr().err
    # both ranks' stacks (rank 0 in its sleep, rank 1 in the barrier rank 0 never reached):
    # nothing else prints the function's name
    assert err.count("_rank0_stays_in_here") >= 2, err
