"""``kernel_choice.choose_kernel`` is the one place that picks Triton or cuBLAS, and it picks
what the four rules it replaced picked.

The old rules are copied below verbatim in meaning (eager NS's ``primitives_for``, the compiled
step's ``pass_enabled``, the pass's ``below_size_gate``, autotune's ``heuristic_choice``);
hypothesis compares them with the new function and with the callers that now ask it, over
random sizes, stacks, dtypes, devices and kernel settings, with the thresholds' edges sampled
often. The one deliberate change since: stacks of ≥ 8 pass the gate from 1536 rows, not
2048, and stacks of ≥ 32 from 768 rows (expert stacks; benchmarks/RESULTS.md §22, §27, §29).
Control: the same comparison over a grid of those edges catches a rule set whose row
threshold is off by one.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from dmuon_compile.kernels import autotune
from dmuon_compile.passes.ns_rewrite import below_size_gate
from hypothesis import assume, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph

from dmuon_compile.compiled_step import pass_enabled
from dmuon_compile.kernel_choice import choose_kernel
from dmuon_compile.newton_schulz import CustomOpPrimitives, NewtonSchulz, TorchPrimitives

HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
EDGES_M = (1, 511, 512, 767, 768, 769, 1023, 1024, 1448, 1535, 1536, 2047, 2048, 4095, 4096)
EDGES_BATCH = (1, 2, 3, 4, 7, 8, 9, 31, 32, 33, 63, 64, 65, 128)
DEVICES = ("cuda", "cpu", "meta")
REQUESTED = ("auto", "triton", "cublas")
RESOLVED = ("triton", "cublas")


# ----------------------------------------------------------------------------- the old rules
def old_triton_worthwhile(m, batch, min_rows=4096):
    return m >= min_rows or (m >= 1536 and batch >= 8) or (m >= 768 and batch >= 32)


def old_eager_uses_op(resolved, m, batch, min_rows=4096):
    """``NewtonSchulz.primitives_for``: the custom ops iff kernel == "triton" and worthwhile."""
    return resolved == "triton" and old_triton_worthwhile(m, batch, min_rows)


def old_pass_enabled(requested, resolved, cuda_machine):
    """``compiled_step.pass_enabled``: ``device_tag() == "CPU"`` means no CUDA on the machine."""
    if requested == "cublas":
        return False
    return resolved == "triton" or not cuda_machine


def old_graph_gated(device, m, batch, min_rows=4096):
    """``below_size_gate`` on a square static mm output: gated only on CUDA."""
    return device == "cuda" and not old_triton_worthwhile(m, batch, min_rows)


def old_heuristic_triton(m, batch, dtype):
    return dtype in HALF and m * max(batch, 1) ** 0.5 >= 1024


# ----------------------------------------------------------------------------- the comparison
def disagreements(m, batch, dtype, device, requested, resolved, cuda_machine, min_rows=4096):
    """Where ``choose_kernel`` and the old rules (``min_rows``: their row threshold) differ."""
    found = []
    eager = choose_kernel("eager", m=m, batch=batch, requested=requested, resolved=resolved)
    if eager.uses_op != old_eager_uses_op(resolved, m, batch, min_rows):
        found.append("eager")
    step = choose_kernel("step", requested=requested, resolved=resolved, cuda_machine=cuda_machine)
    if step.uses_op != old_pass_enabled(requested, resolved, cuda_machine):
        found.append("step")
    graph = choose_kernel("graph", m=m, batch=batch, device=device)
    if (not graph.uses_op) != old_graph_gated(device, m, batch, min_rows):
        found.append("graph")
    op = choose_kernel("op", m=m, batch=batch, dtype=dtype, device="cuda")
    if op.uses_op != old_heuristic_triton(m, batch, dtype):
        found.append("op")
    return found


def consistent(requested, resolved):
    """Settings a ``NewtonSchulz`` can have: ``requested="cublas"`` (or deterministic) always
    resolves to cuBLAS, and ``requested="triton"`` to Triton (it raises where unavailable)."""
    return not (requested == "cublas" and resolved == "triton") and not (
        requested == "triton" and resolved == "cublas"
    )


sizes = st.one_of(st.sampled_from(EDGES_M), st.integers(1, 9000))
batches = st.one_of(st.sampled_from(EDGES_BATCH), st.integers(1, 64))
settings_ = dict(
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(DEVICES),
    requested=st.sampled_from(REQUESTED),
    resolved=st.sampled_from(RESOLVED),
    cuda_machine=st.booleans(),
)


@given(m=sizes, batch=batches, **settings_)
def test_choose_kernel_agrees_with_the_old_rules(
    m, batch, dtype, device, requested, resolved, cuda_machine
):
    assume(consistent(requested, resolved))
    assert disagreements(m, batch, dtype, device, requested, resolved, cuda_machine) == []


def test_choose_kernel_agrees_with_the_old_rules_on_every_edge():
    """Every combination of the thresholds' edges and the settings (random draws rarely land
    on, say, a stack of 7 with 2048 rows)."""
    found = {}
    for key in itertools.product(
        EDGES_M, EDGES_BATCH, DTYPES, DEVICES, REQUESTED, RESOLVED, (True, False)
    ):
        if consistent(key[4], key[5]):
            bad = disagreements(*key)
            if bad:
                found[key] = bad
    assert found == {}


def test_comparison_has_teeth():
    """A rule set whose row threshold is 4095 instead of 4096 is caught on the edge grid."""
    caught = set()
    for m in EDGES_M:
        for batch in EDGES_BATCH:
            for device in ("cuda", "cpu"):
                found = disagreements(m, batch, torch.float16, device, "auto", "triton", True, 4095)
                caught.update(found)
    assert caught == {"eager", "graph"}


# ----------------------------------------------------------------------------- the callers
def _ns(requested, resolved):
    ns = NewtonSchulz(kernel="cublas")
    ns.requested_kernel, ns.kernel = requested, resolved  # the ladder's outcome on a GPU
    return ns


def _mm_node(m, batch, dtype, device):
    with FakeTensorMode():
        out = torch.empty(((batch,) if batch > 1 else ()) + (m, m), dtype=dtype, device=device)
    graph = Graph()
    a = graph.placeholder("a")
    node = graph.call_function(
        torch.ops.aten.bmm.default if batch > 1 else torch.ops.aten.mm.default, (a, a)
    )
    node.meta["val"] = out
    return node


@given(m=sizes, batch=batches, **settings_)
def test_the_callers_decide_as_before(m, batch, dtype, device, requested, resolved, cuda_machine):
    assume(consistent(requested, resolved))
    ns = _ns(requested, resolved)
    ops = ns.primitives_for(m, batch)
    assert ops is (CustomOpPrimitives if old_eager_uses_op(resolved, m, batch) else TorchPrimitives)
    with mock.patch.object(torch.cuda, "is_available", lambda: cuda_machine):
        assert pass_enabled(ns) == old_pass_enabled(requested, resolved, cuda_machine)
    gated = below_size_gate(_mm_node(m, batch, dtype, device))  # fake: nothing allocated
    assert (gated is not None) == old_graph_gated(device, m, batch)
    default = object()
    picked = autotune.heuristic_choice(m, batch, dtype, default)
    assert (picked is default) == old_heuristic_triton(m, batch, dtype)
    assert picked is default or picked == autotune.CUBLAS


@pytest.mark.parametrize(("m", "batch"), [(4096, 1), (2048, 8), (2048, 7), (4095, 1)])
def test_the_pass_gate_on_stacks(m, batch):
    """The pass's gate on real-size (fake) CUDA stacks, and its reason names the gate."""
    gated = below_size_gate(_mm_node(m, batch, torch.float16, "cuda"))
    assert (gated is None) == old_triton_worthwhile(m, batch)
    assert gated is None or "size gate" in gated


def test_bad_questions_get_clear_errors():
    with pytest.raises(ValueError, match="choose one of"):
        choose_kernel("compiled")
    with pytest.raises(ValueError, match="needs m"):
        choose_kernel("eager", resolved="triton")
