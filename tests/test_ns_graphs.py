"""Eager NS's CUDA-graph replay (``dmuon_compile.ns_graphs``): bitwise the eager call on the GPU;
the call sequence (eager, capture, replay; a failed capture stays eager) on any device."""

import copy
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_compile import NewtonSchulz, ns_graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeCapture:
    """Stands in for a CUDA graph on the CPU: records captures and replays."""

    captures = 0
    replays = 0

    def __init__(self, fn, example):
        FakeCapture.captures += 1
        self.fn = fn

    def __call__(self, g):
        FakeCapture.replays += 1
        return self.fn(g)


def test_first_call_eager_second_captures_then_replays(monkeypatch):
    FakeCapture.captures = FakeCapture.replays = 0
    monkeypatch.setattr(ns_graphs, "_Captured", FakeCapture)
    calls = ns_graphs.GraphedCalls()
    eager_calls = []

    def fn(g):
        eager_calls.append(1)
        return g * 2

    g = torch.ones(3, 4)
    for _ in range(4):
        assert torch.equal(calls(("k",), fn, g), g * 2)
    assert FakeCapture.captures == 1 and FakeCapture.replays == 3 and len(calls) == 1
    calls(("k",), fn, torch.ones(4, 3))  # another layout: eager first again
    assert FakeCapture.captures == 1
    calls(("other config",), fn, g)  # another config key never shares the graph
    assert FakeCapture.captures == 1


def test_a_failed_capture_warns_once_and_stays_eager(monkeypatch):
    def broken(fn, example):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ns_graphs, "_Captured", broken)
    calls = ns_graphs.GraphedCalls()
    g = torch.ones(2, 2)
    calls(("k",), lambda x: x + 1, g)
    with pytest.warns(RuntimeWarning, match="DMUON_NS_GRAPHS=0"):
        assert torch.equal(calls(("k",), lambda x: x + 1, g), g + 1)
    assert torch.equal(calls(("k",), lambda x: x + 1, g), g + 1)  # no second warning needed
    assert len(calls) == 0


def test_rules_keep_cpu_grad_and_large_calls_eager(monkeypatch):
    assert not ns_graphs.wanted(torch.randn(8, 16))
    ns = NewtonSchulz()
    other = copy.copy(ns)
    other.kernel = "cublas" if ns.kernel == "triton" else "triton"
    assert ns._config_key(torch.device("cpu")) != other._config_key(torch.device("cpu"))
    # copies and pickles start without graphs (they belong to one process)
    assert len(copy.deepcopy(ns)._graphed) == 0
    assert isinstance(pickle.loads(pickle.dumps(ns))._graphed, ns_graphs.GraphedCalls)


@cuda
def test_switch_and_size_gate_on_cuda(monkeypatch):
    g = torch.randn(64, 256, device="cuda")
    assert ns_graphs.wanted(g)
    monkeypatch.setenv(ns_graphs.SWITCH, "0")
    assert not ns_graphs.wanted(g)
    monkeypatch.delenv(ns_graphs.SWITCH)
    assert not ns_graphs.wanted(g.requires_grad_())
    big = torch.empty(ns_graphs.MAX_ELEMENTS + 1, device="cuda").view(1, -1)
    assert not ns_graphs.wanted(big)


@cuda
@pytest.mark.gpu
@settings(max_examples=12, deadline=None)
@given(
    m=st.sampled_from([64, 256, 1024]),
    n=st.sampled_from([64, 512, 4096]),
    batch=st.sampled_from([0, 3]),
    backend=st.sampled_from(["gram", "direct"]),
)
def test_replay_is_bitwise_the_eager_call(m, n, batch, backend):
    ns = NewtonSchulz(backend=backend)
    shape = (batch, m, n) if batch else (m, n)
    gen = torch.Generator(device="cuda").manual_seed(m * n + batch)
    inputs = [torch.randn(shape, device="cuda", generator=gen) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns: fail here instead
        outs = [ns(g) for g in inputs]  # eager, capture, replay, replay
    assert len(ns._graphed) == int(ns_graphs.wanted(inputs[0]))  # 0 above the size gate
    for g, out in zip(inputs, outs):
        assert torch.equal(out, ns._orthogonalize(g))
    assert not any(o.data_ptr() == outs[-1].data_ptr() for o in outs[:-1])  # fresh outputs
