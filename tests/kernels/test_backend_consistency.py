"""``check_ns_backend_consistent``: every rank must resolve the same NS kernel."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dmuon_compile.kernels.consistency import check_ns_backend_consistent

from dmuon_compile import NewtonSchulz


def test_without_process_group_returns_local_backend():
    ns = NewtonSchulz(kernel="cublas")
    assert check_ns_backend_consistent(ns) == ns.describe()


def test_disagreeing_ranks_are_listed(monkeypatch):
    backends = [
        "Gram NS · kernel=triton (SM90, x)",
        "Gram NS · kernel=cublas (SM90, y)",
        "Gram NS · kernel=triton (SM90, x)",
    ]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)

    def fake_all_gather_object(out, obj, group=None):
        out[:] = backends

    monkeypatch.setattr(dist, "all_gather_object", fake_all_gather_object)
    with pytest.raises(RuntimeError, match=r"ranks \[1\]: 'Gram NS · kernel=cublas") as err:
        check_ns_backend_consistent(NewtonSchulz(kernel="cublas"))
    assert "[0, 2]" in str(err.value) and "DMUON_NS_KERNEL" in str(err.value)


def test_agreeing_ranks_pass(monkeypatch):
    ns = NewtonSchulz(kernel="cublas")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(
        dist,
        "all_gather_object",
        lambda out, obj, group=None: out.__setitem__(slice(None), [obj, obj]),
    )
    assert check_ns_backend_consistent(ns) == ns.describe()


def _disagreeing_kernels(rank: int, world: int) -> None:
    ns = NewtonSchulz(backend="gram" if rank == 0 else "direct", kernel="cublas")
    check_ns_backend_consistent(ns)


@pytest.mark.distributed
def test_two_gloo_ranks_with_different_backends_both_raise():
    from tests.distributed.harness import run_ranks_expect_errors

    errors = run_ranks_expect_errors(_disagreeing_kernels, 2, timeout=60)
    for rank in (0, 1):
        assert "ranks resolved different Newton–Schulz kernels" in errors[rank]
        assert "Direct NS" in errors[rank] and "Gram NS" in errors[rank]
