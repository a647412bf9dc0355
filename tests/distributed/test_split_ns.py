"""Split Newton–Schulz (one matrix's NS over p ranks) equals one rank's NS.

Single process: the blocked algorithm with its ranks simulated (the code the ranks run, with
in-process collectives) against ``NewtonSchulz`` in fp32 and in float64, every coefficient
table, gram and direct, wide and tall, uneven and empty pieces. Control: NS of each piece on
its own (the wrong math) is far off. Distributed (gloo, 2 and 4 ranks, one spawn each): each
rank's piece, gathered, equals one rank's NS; wrong pieces and disagreeing configs raise on
every rank, after which the group still pairs its collectives.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_compile.distributed import split_ns
from dmuon_compile.distributed.split_ns import (
    split_bounds,
    split_dim,
    split_flops,
    split_newton_schulz,
    split_newton_schulz_reference,
)
from dmuon_compile.newton_schulz import NewtonSchulz

from .harness import local_device, run_ranks

# Relative Frobenius error against the float64 run of the same iteration (test_newton_schulz's).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.04, torch.bfloat16: 0.12}
TABLES = ["keller_jordan", "you", "polar_express"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@st.composite
def _bounds(draw, shape, p):
    """Even pieces (split_bounds), or p random contiguous ones (uneven, some maybe empty)."""
    if draw(st.booleans()):
        return split_bounds(shape, p)
    n = shape[split_dim(shape)]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=p - 1, max_size=p - 1)))
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


@st.composite
def _cases(draw, max_m=40, max_n=140):
    m, n = draw(st.integers(1, max_m)), draw(st.integers(1, max_n))
    shape = (m, n) if draw(st.booleans()) else (n, m)  # wide and tall
    p = draw(st.integers(1, 4))
    return shape, p, draw(_bounds(shape, p))


# ----------------------------------------------------------------------------- single process
@given(
    case=_cases(),
    table=st.sampled_from(TABLES),
    backend=st.sampled_from(["gram", "direct"]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_one_rank_ns(case, table, backend, seed):
    shape, p, bounds = case
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    ns = NewtonSchulz(backend=backend, coefficients=table)
    out = split_newton_schulz_reference(u, ns, p, bounds=bounds)
    assert out.shape == u.shape and out.dtype == torch.float32
    ref64 = NewtonSchulz(backend=backend, coefficients=table, work_dtype=torch.float64)(u.double())
    assert _rel(out, ref64) < TOLERANCE[torch.float32]
    assert _rel(out, ns(u)) < 2 * TOLERANCE[torch.float32]


@given(case=_cases(), table=st.sampled_from(TABLES), seed=st.integers(0, 2**16))
def test_float64_split_is_exactly_the_iteration(case, table, seed):
    # No rounding to hide behind: the blocked algorithm is the same polynomial of X.
    shape, p, bounds = case
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ns = NewtonSchulz(coefficients=table, work_dtype=torch.float64)
    assert _rel(split_newton_schulz_reference(u, ns, p, bounds=bounds), ns(u)) < 1e-10


@settings(max_examples=10)
@given(
    case=_cases(max_m=24, max_n=80),
    table=st.sampled_from(TABLES),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_half_work_dtype_within_ns_tolerance(case, table, dtype, seed):
    shape, p, bounds = case
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    ns = NewtonSchulz(coefficients=table, work_dtype=dtype)
    out = split_newton_schulz_reference(u, ns, p, bounds=bounds)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref64 = NewtonSchulz(coefficients=table, work_dtype=torch.float64)(u.double())
    assert _rel(out, ref64) < TOLERANCE[dtype]


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (30, 33), (33, 30)])
@pytest.mark.parametrize("p", [2, 4])
def test_control_blockwise_ns_is_the_wrong_math(shape, p):
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(p))
    ns = NewtonSchulz()
    one = ns(u)
    split = split_newton_schulz_reference(u, ns, p)
    dim = split_dim(shape)
    wrong = torch.cat([ns(t) for t in u.tensor_split(p, dim=dim)], dim=dim)
    assert _rel(split, one) < 1e-4 and _cos(split, one) > 1 - 1e-8
    assert _rel(wrong, one) > 0.4 and _cos(wrong, one) < 0.97


def test_split_bounds_and_orientation():
    assert split_dim((53248, 16384)) == 0 and split_dim((16384, 53248)) == 1
    assert split_dim((8, 8)) == 1  # square: NewtonSchulz does not transpose it
    assert split_bounds((10, 4), 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_bounds((4, 10), 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_bounds((2, 3), 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]  # p > n: empty pieces
    u = torch.randn(53, 11)
    for a, b in split_bounds(u.shape, 4):  # a tall matrix's pieces are contiguous memory
        assert u[a:b].is_contiguous()
    for bad in [(4,), (2, 3, 4), (0, 5)]:
        with pytest.raises(ValueError, match="2-D matrix"):
            split_bounds(bad, 2)
    with pytest.raises(ValueError, match="p must be"):
        split_bounds((4, 4), 0)
    ns = NewtonSchulz()
    with pytest.raises(ValueError, match="2 piece bounds for a group of 3"):
        split_newton_schulz_reference(u, ns, 3, bounds=[(0, 20), (20, 53)])
    with pytest.raises(ValueError, match="contiguous ranges covering 0..53"):
        split_newton_schulz_reference(u, ns, 2, bounds=[(0, 20), (21, 53)])


class _RecordingComm(split_ns._SimulatedComm):
    last: _RecordingComm | None = None

    def __init__(self, p):
        super().__init__(p)
        _RecordingComm.last = self


@pytest.mark.parametrize(
    "shape,ns_kwargs",
    [
        ((24, 80), {}),
        ((80, 24), {"restart_iterations": (1, 3)}),  # one-step segment: no Z gather
        ((30, 33), {}),  # direct NS
        ((20, 70), {"backend": "direct"}),
        ((5, 40), {"restart_iterations": ()}),
    ],
)
@pytest.mark.parametrize("p", [1, 3, 8])
def test_split_flops_counts_what_runs(shape, ns_kwargs, p, monkeypatch):
    ns = NewtonSchulz(kernel="cublas", **ns_kwargs)  # plain products: one-rank FLOPs comparable
    monkeypatch.setattr(split_ns, "_SimulatedComm", _RecordingComm)
    split_newton_schulz_reference(torch.randn(*shape), ns, p)
    log = _RecordingComm.last.log
    cost = split_flops(shape, p, ns, device="cpu")  # fp32 on the CPU
    header = p * split_ns._SLOT * 8
    reduces = [n for kind, n in log if kind == "all_reduce"]
    gathers = [n for kind, n in log if kind == "all_gather"]
    assert cost.all_reduces == len(reduces) + 1
    assert cost.all_reduce_bytes == 4 * sum(reduces) + header
    assert (cost.all_gathers, cost.all_gather_bytes) == (len(gathers), 4 * sum(gathers))
    assert len(cost.flops) == p
    if p == 1:  # one rank does what NewtonSchulz does (plain products on the CPU)
        assert cost.flops[0] == pytest.approx(cost.one_rank_flops)
    else:
        assert max(cost.flops) < cost.one_rank_flops


def test_split_flops_of_the_largest_matrix():
    # Llama-3 405B's MLP weight over a node: each rank's work drops ~p-fold.
    ns = NewtonSchulz(kernel="cublas")
    cost = split_flops((53248, 16384), 8, ns)
    assert max(cost.flops) == pytest.approx(min(cost.flops))
    assert cost.one_rank_flops / max(cost.flops) == pytest.approx(8.0)
    assert cost.all_gather_bytes == cost.all_gathers * 16384 * 16384 * 2  # fp16 on a GPU
    assert cost.all_reduces == 3  # R per segment, and the header


# ----------------------------------------------------------------------------- distributed
def _cases_for(world):
    """(name, shape, NewtonSchulz kwargs, bounds or None): every rank builds the same U."""
    n = 60  # pieces of the empty-pieces case: empty, 25, 35, then empty
    uneven = [(0, 0), (0, 25), (25, n)][:world] + [(n, n)] * (world - 3)
    uneven[-1] = (uneven[-1][0], n)
    cases = [
        ("wide-gram", (24, 72), {}, None),
        ("tall-gram", (72, 24), {"coefficients": "you"}, None),
        ("near-square-direct", (30, 33), {}, None),
        ("direct-backend-tall", (45, 20), {"backend": "direct"}, None),
        ("m-below-p", (3, 50), {}, None),
        ("uneven", (57, 13), {"restart_iterations": (1, 3)}, None),
        ("fp16", (16, 48), {"work_dtype": torch.float16}, None),
        ("fp64", (20, 64), {"work_dtype": torch.float64}, None),
        ("empty-pieces", (20, n), {}, uneven),
    ]
    return cases


def _u(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _piece(u, bounds, rank):
    a, b = bounds[rank]
    return u.narrow(split_dim(u.shape), a, b - a)


def _portable(t):
    # bf16 does not cross the harness (numpy): sent as fp32, exactly
    return str(t.dtype), (t.float() if t.dtype == torch.bfloat16 else t).cpu()


def _split_worker(rank, world, device="cpu"):
    dev = local_device(device)
    out = {}
    for name, shape, kwargs, bounds in _cases_for(world):
        u = _u(shape).to(dev)
        ns = NewtonSchulz(**kwargs)
        b = split_bounds(shape, world) if bounds is None else bounds
        got = split_newton_schulz(_piece(u, b, rank), ns, full_shape=shape, bounds=bounds)
        out[name] = _portable(got)
    errors = {}
    shape, ns = (40, 12), NewtonSchulz()
    u, b = _u(shape).to(dev), split_bounds(shape, world)
    piece = _piece(u, b, rank)
    try:  # rank 1's piece has a row too many
        split_newton_schulz(u[: piece.shape[0] + 1] if rank == 1 else piece, ns, full_shape=shape)
    except ValueError as exc:
        errors["wrong-piece"] = str(exc)
    try:  # rank 0 runs another configuration
        other = NewtonSchulz(steps=6) if rank == 0 else ns
        split_newton_schulz(piece, other, full_shape=shape)
    except ValueError as exc:
        errors["config"] = str(exc)
    # the group still pairs its collectives after the errors
    out["after-errors"] = _portable(split_newton_schulz(piece, ns, full_shape=shape))
    return out, errors


def _check_world(world, device="cpu"):
    results = run_ranks(_split_worker, world, device, timeout=60)
    cases = _cases_for(world) + [("after-errors", (40, 12), {}, None)]
    for name, shape, kwargs, bounds in cases:
        u, ns = _u(shape).to(device), NewtonSchulz(**kwargs)
        dtype = ns.work_dtype_for(u.device)
        assert {r[0][name][0] for r in results} == {str(dtype)}, name
        whole = torch.cat([r[0][name][1] for r in results], dim=split_dim(shape)).to(device)
        assert whole.shape == u.shape, name
        ref = split_newton_schulz_reference(u, ns, world, bounds=bounds)
        if dtype == torch.float64:
            assert _rel(whole, ns(u.double())) < 1e-10, name
        else:
            ref64 = NewtonSchulz(**{**kwargs, "work_dtype": torch.float64})(u.double())
            assert _rel(whole, ref64) < TOLERANCE[dtype], name
            assert _rel(whole, ns(u)) < 2 * TOLERANCE[dtype], name
            # gloo's all-reduce sums in another order than the reference: rounding only
            assert _rel(whole, ref) < (1e-5 if dtype == torch.float32 else 1e-2), name
    for rank, (_, errors) in enumerate(results):
        assert "group rank 1 passed shape" in errors.get("wrong-piece", ""), rank
        assert "ranks that agree: [[0], [1" in errors.get("config", ""), rank


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_split_newton_schulz_on_gloo_ranks(world):
    _check_world(world)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_split_newton_schulz_on_gpu_ranks_sharing_one_gpu():
    _check_world(2, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reference_with_gpu_kernels():
    # The default GPU config: fp16 Gram NS, Triton SYRK for the local Grams at m >= 4096.
    ns = NewtonSchulz()
    u = torch.randn(12288, 4096, device="cuda")  # tall: pieces are contiguous row blocks
    out = split_newton_schulz_reference(u, ns, 4)
    ref64 = NewtonSchulz(work_dtype=torch.float64)(u.double())
    assert out.dtype == torch.float16
    assert _rel(out, ref64) < TOLERANCE[torch.float16]
    assert _rel(out, ns(u)) < 2 * TOLERANCE[torch.float16]
