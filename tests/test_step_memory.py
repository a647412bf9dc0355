"""The Muon step's extra memory: every direction plus about one shape bucket's working set.

The step's first half (``functional.muon_directions``) goes one shape bucket at a time: a
bucket's Nesterov inputs, their stack and Newton–Schulz's work copies are freed before the next
bucket's are made; only the Newton–Schulz outputs (the directions, NS's work dtype: fp32 on the
CPU) stay until the commit. Measured on the CPU allocator (``torch.profiler`` allocation events,
``benchmarks/step_memory.py``'s ``peak_extra_bytes``) for a model of many equal-size buckets: the
peak extra memory of ``Muon.step`` stays under the directions' bytes plus ``BUCKET_FACTOR`` ×
the largest bucket's fp32 bytes. Control: every Nesterov input computed before the first
bucket's Newton–Schulz (the schedule this replaces) exceeds it. The bucketed step equals a
per-matrix float64 reference of the math (hypothesis).
"""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.newton_schulz import NewtonSchulz

step_memory = load_benchmark("step_memory")

# One bucket's fp32 working set in the eager step on the CPU (fp32 NS) above the directions:
# the Nesterov inputs and their stack (the inputs freed once stacked), NS's iterate, its next
# value and a product of the same size (direct NS on square matrices; Gram NS's m×m products
# are smaller): measured 3.4. The control (every Nesterov input at once): 11.3.
BUCKET_FACTOR = 5
# Eight buckets of about the same size, two matrices each (square ones run direct NS, the
# others Gram NS).
SHAPES = [(32, 32), (16, 64), (64, 16), (24, 40), (40, 24), (8, 128), (128, 8), (20, 48)] * 2


def _params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
        p.grad = torch.randn(shape, generator=g, dtype=dtype)
        params.append(p)
    return params


def _step_peak(schedule) -> tuple[int, int, int]:
    """(peak extra bytes of one eager ``Muon.step``, the directions' bytes, the largest bucket's
    fp32 bytes)."""
    params = _params(SHAPES)
    opt = dmuon.Muon(params, lr=0.02, weight_decay=0.01, compile=False)
    with schedule():
        opt.step()  # state created: the measured step allocates only temporaries
        peak = step_memory.peak_extra_bytes(opt.step, torch.device("cpu"))
    work = torch.empty((), dtype=opt.ns.work_dtype_for(torch.device("cpu"))).element_size()
    directions = sum(p.numel() for p in params) * work
    return peak, directions, step_memory.largest_bucket_fp32_bytes(SHAPES)


def _bucketed():
    return step_memory._nothing()


@pytest.mark.parametrize(
    "schedule, bounded",
    [(_bucketed, True), (step_memory.all_at_once_schedule, False)],
    ids=["bucket_by_bucket", "control_all_at_once"],
)
def test_step_extra_memory_is_directions_plus_one_bucket(schedule, bounded):
    peak, directions, bucket = _step_peak(schedule)
    total = sum(4 * torch.Size(s).numel() for s in SHAPES)
    assert bucket * 7 < total  # many buckets: "all at once" and "one bucket" differ
    assert peak > directions + bucket  # the measurement sees the step's temporaries at all
    over = (peak - directions) / bucket
    assert (peak <= directions + BUCKET_FACTOR * bucket) is bounded, f"directions + {over:.2f}"


# One shape bucket of many equal matrices: the stack budget, not the bucket, bounds the peak.
ONE_BUCKET = [(48, 192)] * 16
BUDGET_MATRICES = 2  # the budget in the test: two fp32 matrices of ONE_BUCKET's shape


@pytest.mark.parametrize("budgeted", [True, False], ids=["stack_budget", "control_default"])
def test_stack_budget_bounds_the_step_peak(budgeted):
    """``NewtonSchulz(stack_bytes=...)`` cuts a bucket into stacks of at most that many bytes:
    the step's peak above the directions is a few budgets, not a few buckets. Control: the
    default budget (4 GiB) stacks the whole bucket and exceeds the bound."""
    budget = BUDGET_MATRICES * 4 * torch.Size(ONE_BUCKET[0]).numel()
    ns = NewtonSchulz(stack_bytes=budget) if budgeted else NewtonSchulz()
    params = _params(ONE_BUCKET)
    opt = dmuon.Muon(params, lr=0.02, compile=False, ns_backend=ns)
    opt.step()
    peak = step_memory.peak_extra_bytes(opt.step, torch.device("cpu"))
    directions = sum(p.numel() for p in params) * 4
    bucket = step_memory.largest_bucket_fp32_bytes(ONE_BUCKET)
    assert bucket >= 8 * budget
    assert peak > directions  # the measurement sees the step's temporaries at all
    assert (peak <= directions + BUCKET_FACTOR * budget) is budgeted, (peak - directions) / budget


@given(
    count=st.integers(1, 9),
    per_call=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(["gram", "direct"]),
)
def test_stack_in_pieces_equals_one_call(count, per_call, seed, backend):
    """A stack past ``stack_bytes`` runs as several calls: the same result as one call (each
    matrix's NS is independent), and the same as a float64 reference within NS tolerance."""
    g = torch.randn(count, 12, 20, generator=torch.Generator().manual_seed(seed))
    whole = NewtonSchulz(backend=backend)
    pieces = NewtonSchulz(backend=backend, stack_bytes=per_call * 12 * 20 * 4)
    assert pieces.matrices_per_call((12, 20)) == per_call
    torch.testing.assert_close(pieces(g), whole(g), rtol=1e-5, atol=1e-5)
    exact = NewtonSchulz(backend=backend, work_dtype=torch.float64)(g.double()).float()
    torch.testing.assert_close(pieces(g), exact, rtol=1e-4, atol=1e-4)


def test_stack_bytes_must_be_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stack_bytes"):
            NewtonSchulz(stack_bytes=bad)


@given(
    sizes=st.lists(st.sampled_from([(2, 3), (3, 3), (4, 2)]), min_size=0, max_size=12),
    max_bytes=st.integers(1, 200),
)
def test_shape_buckets_cut_to_the_budget(sizes, max_bytes):
    """Every index once, buckets of one shape, first-seen order kept, and each bucket within
    the budget unless it is a single tensor."""
    tensors = [torch.zeros(s) for s in sizes]
    buckets = F.shape_buckets(tensors, max_bytes=max_bytes)
    assert sorted(i for b in buckets for i in b) == list(range(len(tensors)))
    for b in buckets:
        assert len({tensors[i].shape for i in b}) == 1 and b == sorted(b)
        assert len(b) == 1 or sum(tensors[i].numel() * 4 for i in b) <= max_bytes
    whole = F.shape_buckets(tensors)
    assert [i for b in buckets for i in b] == [i for b in whole for i in b]


def _reference_step(w, g, buf, *, lr, wd, mu, nesterov, ns, adjust_lr_fn):
    """One matrix, one Muon step, written out (float64): the math the bucketed step keeps."""
    buf = mu * buf + g
    u = g + mu * buf if nesterov else buf
    o = ns(u)
    scale = F.lr_scale(w.shape, adjust_lr_fn)
    return (1 - lr * wd) * w - lr * scale * o, buf


@given(
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=7),
    nesterov=st.booleans(),
    wd=st.sampled_from([0.0, 0.1]),
    adjust_lr_fn=st.sampled_from(["match_rms_adamw", "original"]),
    backend=st.sampled_from(["gram", "direct"]),
    seed=st.integers(0, 2**16),
    stack_matrices=st.sampled_from([None, 1, 2]),
)
def test_bucketed_step_equals_per_matrix_reference(
    picks, nesterov, wd, adjust_lr_fn, backend, seed, stack_matrices
):
    """Any mix of shapes, in any order (so buckets interleave), whole buckets or cut to a stack
    budget: each matrix gets exactly the per-matrix math, and the momentum buffers too (float64
    NS, tight tolerance)."""
    shapes = [[(6, 10), (10, 6), (8, 8), (4, 12)][i] for i in picks]
    budget = {} if stack_matrices is None else {"stack_bytes": stack_matrices * 60 * 8}
    ns = NewtonSchulz(backend=backend, work_dtype=torch.float64, **budget)
    params = [p.detach() for p in _params(shapes, torch.float64, seed)]
    grads = [p.grad for p in _params(shapes, torch.float64, seed + 1)]
    bufs = [torch.randn_like(p) for p in params]
    hypers = dict(lr=0.03, weight_decay=wd, momentum=0.9, nesterov=nesterov)
    expected = [
        _reference_step(
            w.clone(),
            g,
            b.clone(),
            lr=0.03,
            wd=wd,
            mu=0.9,
            nesterov=nesterov,
            ns=ns,
            adjust_lr_fn=adjust_lr_fn,
        )
        for w, g, b in zip(params, grads, bufs)
    ]
    F.muon_update(params, grads, bufs, ns=ns, adjust_lr_fn=adjust_lr_fn, **hypers)
    for w, b, (w_ref, b_ref) in zip(params, bufs, expected):
        torch.testing.assert_close(b, b_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(w, w_ref, rtol=1e-10, atol=1e-10)


def test_compiled_step_cuts_buckets_like_the_eager_step():
    """The compiled step traces the same cut (a bucket of five matrices in stacks of two, an
    expert stack of three in pieces of two): its weights equal the eager step's."""
    from dmuon_compile.layouts import Layout, set_layout

    shapes = [(8, 16)] * 5 + [(3, 8, 16)]
    runs = []
    for compile in (False, True):
        params = _params(shapes, seed=3)
        set_layout(params[-1], Layout.experts())
        ns = NewtonSchulz(stack_bytes=2 * 8 * 16 * 4)
        opt = dmuon.Muon(params, lr=0.02, momentum=0.9, compile=compile, ns_backend=ns)
        for _ in range(2):
            opt.step()
        runs.append([p.detach().clone() for p in params])
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
