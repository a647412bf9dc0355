"""``check_ns_backend_consistent``: every rank must resolve the same NS kernel.

``dmuon.check_ns_backend_consistent`` lives in ``newton_schulz.py``; the gather and the
comparison are the kernel package's (``kernels.consistency.agree_across_ranks``), which imports
nothing above it, so its own ``check_ns_backend_consistent`` takes the orthogonaliser
explicitly."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dmuon_compile.kernels import consistency

from dmuon_compile import NewtonSchulz, check_ns_backend_consistent, get_ns_backend


def test_without_process_group_returns_local_backend():
    ns = NewtonSchulz(kernel="cublas")
    assert check_ns_backend_consistent(ns) == ns.describe()
    assert consistency.check_ns_backend_consistent(ns) == ns.describe()
    assert consistency.agree_across_ranks("x") == "x"


def test_without_an_argument_the_active_backend():
    assert check_ns_backend_consistent() == get_ns_backend()
    with pytest.raises(TypeError, match="NewtonSchulz or a Muon"):
        consistency.check_ns_backend_consistent(None)


def test_a_muon_is_read_through_its_ns():
    class Holder:  # what Muon offers: its orthogonaliser as .ns
        ns = NewtonSchulz(kernel="cublas")

    assert consistency.check_ns_backend_consistent(Holder()) == Holder.ns.describe()
    assert check_ns_backend_consistent(Holder()) == Holder.ns.describe()


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
