"""The compiled step with a streamed stored momentum (``Muon(compile=True)``): one directions
graph and one buf′ graph per kind of bucket (``StepKey(group, "all/momentum bucket n")``; buckets
alike — shapes, dtypes, layouts — share one, compiled once), the
commit's graph for the weights; equal bit for bit to the compiled step that materialises every
working buffer at once (``momentum_in_flight=None``: one graph), for 8-bit and offload; a NaN
in one bucket is named by the per-bucket flags, gathered back into the group's order, and
leaves the stored state as it was. Slow (Inductor compiles, ~15-60 s on a 2-core CPU)."""

from __future__ import annotations

import pytest
import torch

import dmuon_compile as dmuon
from dmuon_compile.compiled_step import StepKey

SHAPES = [(8, 12), (12, 6), (8, 12), (16, 8)]  # three shape buckets


def test_the_compiled_streamed_step_equals_the_compiled_all_at_once_step():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]

    def run(in_flight, **kwargs):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = dmuon.Muon(
            params,
            lr=0.02,
            compile=True,
            momentum_in_flight=in_flight,
            nonfinite_grads="skip",
            **kwargs,
        )
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return params, opt

    for kwargs in ({"offload": "momentum"}, {"momentum_dtype": torch.int8}):
        ref, ref_opt = run(None, **kwargs)
        got, got_opt = run(2, **kwargs)
        assert set(ref_opt.compiled_steps) == {StepKey(0, "all")}
        assert set(got_opt.compiled_steps) == {StepKey(0, "all")} | {
            StepKey(0, f"all/momentum bucket {k}") for k in range(3)
        }
        assert got_opt._storage.peak_working_bytes < ref_opt._storage.peak_working_bytes
        for a, b in zip(ref, got):
            assert torch.equal(a.detach(), b.detach())
        for a, b in zip(ref, got):
            sa, sb = ref_opt.state[a], got_opt.state[b]
            assert set(sa) == set(sb)
            for key, value in sa.items():
                same = torch.equal(value, sb[key]) if torch.is_tensor(value) else value == sb[key]
                assert same, (kwargs, key)
    # a NaN in the second matrix (bucket 1 of 3): the flags name it; nothing changes
    before = {k: v.clone() for k, v in got_opt.state[got[1]].items() if torch.is_tensor(v)}
    weight = got[1].detach().clone()
    for p, g in zip(got, grads[0]):
        p.grad = g.clone()
    got[1].grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\[1\] \(gradient\)"):
        got_opt.step()
    assert torch.equal(got[1].detach(), weight)
    for key, value in before.items():
        assert torch.equal(got_opt.state[got[1]][key], value)


def test_buckets_alike_share_one_compiled_graph():
    """Four buckets of one kind (a matrix each, cut by ``stack_bytes``) run one compiled
    directions graph, compiled once — as many as a single bucket compiles — and equal the
    all-at-once step bit for bit. Control: buckets of another shape get a graph of their own."""
    from torch._dynamo.utils import counters

    shapes = [(8, 12)] * 4 + [(12, 6)]
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    ns = dmuon.NewtonSchulz(work_dtype=torch.float32, stack_bytes=8 * 12 * 4)

    def run(in_flight, count):
        params = [torch.nn.Parameter(w.clone()) for w in weights[:count]]
        opt = dmuon.Muon(
            params, lr=0.02, compile=True, ns_backend=ns, offload="momentum",
            momentum_in_flight=in_flight,
        )  # fmt: skip
        before = counters["stats"]["unique_graphs"]
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return params, opt, counters["stats"]["unique_graphs"] - before

    _, one_opt, one_graphs = run(2, 1)
    got, got_opt, four_graphs = run(2, 4)
    assert four_graphs == one_graphs
    assert set(got_opt.compiled_steps) == {StepKey(0, "all"), StepKey(0, "all/momentum bucket 0")}
    assert got_opt.compiled_steps[StepKey(0, "all/momentum bucket 0")].calls == 4 * len(grads)
    ref, _, _ = run(None, 4)
    for a, b in zip(ref, got):
        assert torch.equal(a.detach(), b.detach())
    _, mixed_opt, _ = run(2, 5)  # control: the (12, 6) bucket is a kind of its own
    assert StepKey(0, "all/momentum bucket 1") in mixed_opt.compiled_steps
