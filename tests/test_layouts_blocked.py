"""Blocked layouts: per-head and fused-part Newton–Schulz (``Layout.heads``, ``Layout.fused``,
``Layout.qkv``), alone and per expert.

The reference cuts each matrix into its blocks by plain slicing, from the spec the test draws
(not from the layout's own arithmetic), and runs the 2-D Newton–Schulz on each block in float64.
The control: the whole weight as one matrix is a different update.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.layouts import Layout, resolve_layout

NS64 = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float64)

# A part: (head size, heads, per_head). Its size is head·heads; per_head=False keeps it whole.
PART = st.tuples(st.integers(1, 4), st.integers(1, 3), st.booleans())


@st.composite
def blocked(draw):
    """A blocked layout, a shape it fits, and its blocks' (start, size) along the block dim."""
    parts = draw(st.lists(PART, min_size=1, max_size=3))
    dim = draw(st.integers(0, 1))
    experts = draw(st.booleans())
    transposed = draw(st.booleans())
    other = draw(st.integers(1, 6))
    sizes = tuple(h * k for h, k, _ in parts)
    if len(parts) == 1 and parts[0][2] and draw(st.booleans()):
        layout = Layout.heads(parts[0][0], dim, experts=experts, transposed=transposed)
    else:
        heads = tuple(h if per_head else 0 for h, _, per_head in parts)
        layout = Layout.fused(sizes, dim, heads=heads, experts=experts, transposed=transposed)
    blocks, start = [], 0
    for h, k, per_head in parts:
        for _ in range(k if per_head else 1):
            size = h if per_head else h * k
            blocks.append((start, size))
            start += size
    matrix = (start, other) if dim == 0 else (other, start)
    shape = ((draw(st.integers(1, 3)),) if experts else ()) + matrix
    return layout, shape, blocks


def _cut(w: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """One block of a 2-D ``w``: ``size`` rows (dim 0) or columns (dim 1) from ``start``."""
    return w[start : start + size] if dim == 0 else w[:, start : start + size]


def _reference(u: torch.Tensor, layout: Layout, blocks) -> torch.Tensor:
    """Each block's 2-D Newton–Schulz, put back where the block came from."""
    out = torch.full_like(u, float("nan"))
    for w, o in zip(u.reshape(-1, *u.shape[-2:]), out.reshape(-1, *u.shape[-2:])):
        for start, size in blocks:
            block = _cut(w, layout.split_dim, start, size)
            _cut(o, layout.split_dim, start, size).copy_(NS64(block))
    return out


@settings(max_examples=30, deadline=None)
@given(case=blocked(), seed=st.integers(0, 2**16))
def test_blocked_ns_is_each_blocks_ns(case, seed):
    layout, shape, blocks = case
    torch.manual_seed(seed)
    u = torch.randn(shape, dtype=torch.float64)
    ref = _reference(u, layout, blocks)
    got = F.orthogonalize([u.clone()], NS64, layouts=[layout])[0]
    assert got.shape == u.shape
    torch.testing.assert_close(got, ref, atol=1e-9, rtol=0)
    # Mixed in one call with a plain matrix of a block's shape (it joins that block's bucket)
    # and a second weight of the same layout: each is still its own.
    start, size = blocks[-1]
    w = _cut(torch.randn(shape[-2:], dtype=torch.float64), layout.split_dim, start, size)
    v = torch.randn(shape, dtype=torch.float64)
    both = F.orthogonalize(
        [w.clone(), u.clone(), v.clone()], NS64, layouts=[F.MATRIX, layout, layout]
    )
    torch.testing.assert_close(both[0], NS64(w), atol=1e-9, rtol=0)
    torch.testing.assert_close(both[1], ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(both[2], _reference(v, layout, blocks), atol=1e-9, rtol=0)
    # The eager step's first half (with finite flags) takes the same path.
    out, finite = F.muon_directions(
        [u.clone(), w.clone()],
        [torch.zeros_like(u), torch.zeros_like(w)],
        momentum=0.0,
        nesterov=False,
        ns=NS64,
        finite_flags=True,
        layouts=[layout, F.MATRIX],
    )
    assert finite.tolist() == [True, True]
    torch.testing.assert_close(out[0], ref, atol=1e-9, rtol=0)


@settings(max_examples=40, deadline=None)
@given(case=blocked(), seed=st.integers(0, 99))
def test_views_round_trip_and_match_slicing(case, seed):
    layout, shape, blocks = case
    torch.manual_seed(seed)
    t = torch.randn(shape)
    assert layout.count(shape) == math.prod(shape[:-2]) * len(blocks)
    assert layout.block_sizes(shape) == [size for _, size in blocks]
    stack = t.reshape(-1, *shape[-2:])
    got, expected, dim = [], [], layout.block_dim(shape)
    for start, stop, sub in layout.pieces(shape):  # one piece unless block sizes differ
        piece = t.narrow(dim, start, stop - start)
        mats = sub.matrices(piece)
        assert torch.equal(sub.unmatrices(mats.clone(), piece.shape), piece)
        got += list(mats.reshape(-1, *mats.shape[-2:]))
        mine = [(s, n) for s, n in blocks if start <= s < stop]
        expected += [_cut(w, layout.split_dim, s, n) for w in stack for s, n in mine]
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@settings(max_examples=30, deadline=None)
@given(case=blocked(), rule=st.sampled_from(["original", "match_rms_adamw"]))
def test_each_block_gets_its_own_lr_scale(case, rule):
    """W ← W − lr·scale·O with each block's scale by its own (out, in) shape."""
    layout, shape, blocks = case
    w, o = torch.zeros(shape, dtype=torch.float64), torch.ones(shape, dtype=torch.float64)
    F.apply_muon_update([w], [o], 1.0, 0.0, rule, layouts=[layout])
    other = shape[-1] if layout.split_dim == 0 else shape[-2]
    for e in w.reshape(-1, *shape[-2:]):
        for start, size in blocks:
            stored = (size, other) if layout.split_dim == 0 else (other, size)
            out_in = stored[::-1] if layout.transposed else stored
            want = -F.lr_scale(out_in, rule)
            assert torch.all(_cut(e, layout.split_dim, start, size) == want), (out_in, want)


def test_blocks_of_different_shapes_scale_differently():
    """A fused weight of parts 8 and 2 rows: the "original" rule gives √(8/3) and 1, not the
    whole (10, 3)'s √(10/3) (the control); the compiled form (0-d tensors) agrees."""
    lay = Layout.fused((8, 2))
    w, o = torch.zeros(10, 3), torch.ones(10, 3)
    F.apply_muon_update([w], [o], 1.0, 0.0, "original", layouts=[lay])
    assert torch.allclose(w[:8], torch.full((8, 3), -math.sqrt(8 / 3)))
    assert torch.allclose(w[8:], torch.full((2, 3), -1.0))
    whole = torch.zeros(10, 3)
    F.apply_muon_update([whole], [o], 1.0, 0.0, "original", layouts=[F.MATRIX])
    assert not torch.allclose(whole, w)
    traced = torch.zeros(10, 3)
    lr, wd = torch.tensor(1.0), torch.tensor(0.0)
    F.apply_muon_update([traced], [o], lr, wd, "original", layouts=[lay])
    torch.testing.assert_close(traced, w)


@settings(max_examples=10, deadline=None)
@given(heads=st.integers(2, 4), head_dim=st.integers(2, 4), seed=st.integers(0, 99))
def test_whole_matrix_is_a_different_update(heads, head_dim, seed):
    """The control: NS of the whole (heads·head_dim, n) matrix is not per-head NS."""
    torch.manual_seed(seed)
    u = torch.randn(heads * head_dim, 2 * head_dim + 1, dtype=torch.float64)
    per_head = F.orthogonalize([u], NS64, layouts=[Layout.heads(head_dim)])[0]
    whole = F.orthogonalize([u], NS64, layouts=[F.MATRIX])[0]
    cos = torch.nn.functional.cosine_similarity(per_head.flatten(), whole.flatten(), dim=0)
    assert cos < 0.99


def test_presets():
    """Llama/Qwen shapes: q, k, v per head (rows), o per head (columns), fused qkv, gate_up."""
    assert Layout.heads(64).matrix_shape((512, 256)) == (64, 256)
    assert Layout.heads(64, dim=1).matrix_shape((256, 512)) == (256, 64)
    qkv = Layout.qkv(8, 2, 16)
    assert qkv == Layout.fused((128, 32, 32), heads=16)
    assert qkv.count((192, 64)) == 12 and qkv.matrix_shape((192, 64)) == (16, 64)
    whole = Layout.qkv(8, 2, 16, per_head=False)
    assert whole.count((192, 64)) == 3 and len(whole.pieces((192, 64))) == 2 + 1
    # Stored (in, out): the parts lie along the columns, the lr rule reads (out, in).
    t = Layout.qkv(8, 2, 16, transposed=True)
    assert t.split_dim == 1 and t.matrix_shape((64, 192)) == (16, 64)
    assert Layout.gate_up() == Layout.matrix(split="chunk")
    assert Layout.gate_up(interleaved=True, experts=True, transposed=True) == Layout.experts(
        split="interleave", split_dim=1, transposed=True
    )
    assert Layout.heads(4, experts=True).count((3, 8, 5)) == 6


@pytest.mark.parametrize(
    ("make", "shape", "match"),
    [
        (lambda: Layout.fused((4, 4)), (10, 3), r"sum to 8, not to the 10.*sum to 10"),
        (lambda: Layout.fused((4, 4), dim=1), (8, 6), r"sum to 8, not to the 6"),
        (lambda: Layout.heads(4), (10, 3), r"head_dim 4 does not divide the 10.*dim="),
        (lambda: Layout.heads(3, experts=True), (2, 6, 4), None),  # fits: no error
        (lambda: Layout.fused((6, 4), heads=4), (10, 3), r"head_dim 4 does not divide.*size 6"),
        (lambda: Layout.fused((6, 4), heads=(3, 2, 1)), (10, 3), r"one head size per part"),
        (lambda: Layout.heads(0), (4, 4), r"must be positive"),
        (lambda: Layout.fused(()), (4, 4), r"parts' sizes"),
        (lambda: Layout("matrix", "chunk", 0, False, (), (2,)).checked(), (4, 4), "gate_up"),
        (lambda: Layout("conv", parts=(2, 2)).checked(), (4, 1, 1), "no blocks"),
        (lambda: Layout.heads(2), (4, 4, 4), r"needs 2 dims"),
    ],
)
def test_bad_blocked_layouts_raise_naming_the_fix(make, shape, match):
    if match is None:
        dmuon.set_layout(torch.zeros(shape), make())
        return
    with pytest.raises(ValueError, match=match):
        dmuon.set_layout(torch.zeros(shape), make())


def test_mixed_block_shapes_have_no_one_matrix_shape():
    """What the planners that read one shape per weight (dedicate_params' owner plan, the dry
    run) hit with parts of different sizes: an error naming the fix, not a wrong shape."""
    with pytest.raises(ValueError, match=r"2 sizes \[32, 128\].*heads=\.\.\."):
        Layout.qkv(8, 2, 16, per_head=False).stacked_shape((192, 64))
    assert Layout.qkv(8, 2, 16).stacked_shape((192, 64)) == (16, 64)


def test_bad_layout_from_the_predicate_names_the_parameter():
    model = nn.Sequential(nn.Linear(3, 10, bias=False))
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(10, 3\).*sum to 10"):
        dmuon.Muon(model, compile=False, predicate=lambda name, p: Layout.fused((4, 4)))


def test_sharded_dtensor_with_blocks_is_refused():
    """A TP-like Shard of a 2-D weight (its local piece is no whole matrix) is refused at
    setup; an expert stack sharded along the expert dim (whole experts) is accepted."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        w = DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
        with pytest.raises(NotImplementedError, match="whole matrices.*dedicate"):
            dmuon.set_layout(w, Layout.heads(4))
        with pytest.raises(NotImplementedError, match="'wq'"):
            resolve_layout("wq", w, None, Layout.heads(4))
        dmuon.set_layout(w, Layout.matrix())  # no blocks: not this check's business
        e = DTensor.from_local(torch.randn(2, 8, 4), mesh, [Shard(0)], run_check=False)
        dmuon.set_layout(e, Layout.heads(4, experts=True))
    finally:
        dist.destroy_process_group()


def _attention(layouts: dict[str, Layout] | None):
    """Llama-like q, k, v, o and a fused qkv (GQA: 4 query heads, 2 kv heads of 4), with
    the given layouts declared (float64)."""
    torch.manual_seed(0)
    m = nn.ModuleDict(
        {
            "wq": nn.Linear(16, 16, bias=False),
            "wk": nn.Linear(16, 8, bias=False),
            "wo": nn.Linear(16, 16, bias=False),
            "wqkv": nn.Linear(16, 32, bias=False),
        }
    ).double()
    for name, lay in (layouts or {}).items():
        dmuon.set_layout(m[name].weight, lay)
    return m


LLAMA = {
    "wq": Layout.heads(4),
    "wk": Layout.heads(4),
    "wo": Layout.heads(4, dim=1),
    "wqkv": Layout.qkv(4, 2, 4, per_head=False),  # q, k, v parts of 16, 8, 8 rows
}


def _loss(m, x):
    q = m["wq"](x) + m["wqkv"](x)[:, :16]
    return (m["wo"](q).square().sum() + m["wk"](x).sin().sum()).sum()


def _train(layouts, compile: bool, steps: int = 2, ns=NS64):
    m = _attention(layouts)
    opt = dmuon.Muon(m, lr=0.02, weight_decay=0.1, ns_backend=ns, compile=compile)
    for s in range(steps):
        torch.manual_seed(100 + s)
        _loss(m, torch.randn(5, 16, dtype=torch.float64)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_muon_first_step_is_per_block():
    """Muon(model) with declared blocked layouts: the first step's update of each weight is
    −lr·scale·NS of each block of its Nesterov input (the block's own scale)."""
    m = _attention(LLAMA)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    opt = dmuon.Muon(m, lr=0.02, ns_backend=NS64, compile=False)
    torch.manual_seed(1)
    _loss(m, torch.randn(5, 16, dtype=torch.float64)).backward()
    u = {k: m[k.split(".")[0]].weight.grad * 1.95 for k in before}  # g + μ·g
    opt.step()
    blocks = {
        "wq.weight": [(s, 4) for s in range(0, 16, 4)],
        "wk.weight": [(0, 4), (4, 4)],
        "wo.weight": [(s, 4) for s in range(0, 16, 4)],
        "wqkv.weight": [(0, 16), (16, 8), (24, 8)],
    }
    for k, bl in blocks.items():
        lay = LLAMA[k.split(".")[0]]
        step = (before[k] - m.state_dict()[k]) / 0.02
        for start, size in bl:
            block = _cut(u[k], lay.split_dim, start, size)
            want = NS64(block) * F.lr_scale(tuple(block.shape), "match_rms_adamw")
            torch.testing.assert_close(
                _cut(step, lay.split_dim, start, size), want, atol=1e-9, rtol=0
            )


def test_compiled_step_equals_eager_with_blocked_layouts():
    """Muon(..., compile=True) on CPU (one compiled graph of the torch reference ops) steps as
    the eager Muon does with per-head and fused layouts (to Inductor's reordering of float64
    sums: ~1e-8 after two steps); the whole-matrix run is the control (~1e-2 away)."""
    ns = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float64)
    eager = _train(LLAMA, compile=False, ns=ns)
    compiled = _train(LLAMA, compile=True, ns=ns)
    whole = _train(None, compile=False, ns=ns)
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], atol=1e-6, rtol=0)
        assert (whole[k] - eager[k]).abs().max() > 1e-4, k


@settings(max_examples=20, deadline=None)
@given(
    layout=st.sampled_from(
        [
            Layout.heads(4),
            Layout.heads(4, dim=1),
            Layout.fused((8, 4, 4)),
            Layout.fused((4, 12), heads=(4, 0)),
            Layout.gate_up(),
            Layout.matrix(),
        ]
    ),
    fn=st.sampled_from(list(F.ADJUST_LR_FNS)),
    seed=st.integers(0, 2**16),
)
def test_blocks_scaled_as_whole_then_applied_with_the_whole_scale_move_by_their_own(
    layout, fn, seed
):
    """The TP stage applies shards of a blocked matrix's update with the whole matrix's
    learning-rate scale: ``scale_blocks_as_whole`` first makes that each block's own scale,
    the update ``apply_muon_update`` makes with the layout (the one-process step). Control:
    without it, a layout whose blocks' scale differs from the whole's moves elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    w, o = (
        torch.randn(16, 16, generator=gen, dtype=torch.float64),
        torch.randn(16, 16, generator=gen, dtype=torch.float64),
    )
    want, got, plain = w.clone(), w.clone(), w.clone()
    F.apply_muon_update([want], [o], 0.1, 0.0, fn, layouts=[layout])
    F.apply_muon_update([got], [F.scale_blocks_as_whole(o, layout, fn)], 0.1, 0.0, fn, [(16, 16)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    F.apply_muon_update([plain], [o], 0.1, 0.0, fn, [(16, 16)])
    if layout == Layout.heads(4, dim=1) and fn == "original":  # 16×4 blocks: √4 vs 1
        assert not torch.allclose(plain, want)


def test_control_blocks_applied_with_the_whole_scale_alone_move_elsewhere():
    o, w = torch.ones(16, 16, dtype=torch.float64), torch.zeros(16, 16, dtype=torch.float64)
    want, plain = w.clone(), w.clone()
    F.apply_muon_update([want], [o], 0.1, 0.0, "original", layouts=[Layout.heads(4, dim=1)])
    F.apply_muon_update([plain], [o], 0.1, 0.0, "original", [(16, 16)])
    assert not torch.allclose(plain, want)  # 16×4 heads: scale √4, the whole matrix: 1


# ---------------------------------------------------------------- TP shards of whole blocks


@pytest.mark.parametrize(
    ("layout", "shape", "dim", "tp", "whole"),
    [
        (Layout.heads(8), (64, 32), 0, 2, True),  # 8 heads over TP 2: 4 whole heads each
        (Layout.heads(8), (48, 32), 0, 4, False),  # 6 heads over TP 4: heads straddle
        (Layout.heads(8), (48, 32), 0, 3, True),
        (Layout.heads(8), (64, 32), 0, 8, True),  # a head per rank
        (Layout.heads(8), (64, 32), 0, 16, False),  # half a head per rank
        (Layout.heads(8), (64, 32), 1, 2, False),  # sharded across the heads' columns
        (Layout.heads(8, dim=1), (32, 64), 1, 2, True),  # o row-parallel
        (Layout.heads(8, dim=1), (32, 64), 0, 2, False),
        (Layout.heads(8), (60, 32), 0, 8, False),  # uneven shards: the gathered path
        (Layout.qkv(8, 2, 4), (48, 32), 0, 2, True),  # 12 blocks of 4 rows
        (Layout.qkv(3, 1, 4), (20, 32), 0, 2, False),  # 5 blocks over 2
        (Layout.qkv(8, 2, 4, per_head=False), (48, 32), 0, 2, False),  # q straddles
        (Layout.fused((16, 8, 8)), (32, 32), 0, 2, True),  # q | k, v
        (Layout.fused((16, 48)), (64, 32), 0, 2, False),
        (Layout.matrix(), (64, 32), 0, 2, False),  # not blocked: one matrix, gathered
        (Layout.heads(8, experts=True), (2, 64, 32), 1, 2, False),  # expert stacks: gathered
    ],
)
def test_block_shard_decision(layout, shape, dim, tp, whole):
    from dmuon_compile.layouts import block_shard_layouts

    got = block_shard_layouts(layout, shape, dim, tp)
    assert (got is not None) == whole
    if whole:
        assert len(got) == tp
        chunk = shape[dim] // tp
        assert [sum(lay.block_sizes((chunk, 32) if dim == 0 else (32, chunk))) for lay in got] == [
            chunk
        ] * tp


def test_block_shard_layouts_of_blocks_of_different_sizes():
    from dmuon_compile.layouts import block_shard_layouts

    first, second = block_shard_layouts(Layout.fused((16, 8, 8)), (32, 32), 0, 2)
    assert first.block_sizes((16, 32)) == [16] and second.block_sizes((16, 32)) == [8, 8]
    a, b = block_shard_layouts(Layout.fused((8, 4, 4), heads=(0, 4, 0)), (16, 8), 0, 2)
    assert a.block_sizes((8, 8)) == [8] and b.block_sizes((8, 8)) == [4, 4]
    assert b.parts == () and b.head_dims == (4,)
    c, d = block_shard_layouts(Layout.fused((4, 8, 4), heads=4), (16, 8), 0, 2)
    assert c.block_sizes((8, 8)) == [4, 4] and d.block_sizes((8, 8)) == [4, 4]
    assert c.head_dims == (4,)  # blocks of two parts: the shard's own cut
    assert block_shard_layouts(Layout.fused((4, 8, 4)), (16, 8), 0, 2) is None  # 8 straddles


@st.composite
def sharded(draw):
    """A blocked 2-D layout and its shape, its blocks' starts, a TP size and a shard dim: half
    the time one segment of blocks per shard (whole blocks by construction), else blocks drawn
    freely (mostly straddling); now and then sharded across the blocks."""
    tp = draw(st.integers(2, 4))
    dim = draw(st.integers(0, 1))
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)) * tp
    else:
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
    transposed = draw(st.booleans())
    if len(set(sizes)) == 1:
        layout = Layout.heads(sizes[0], dim, transposed=transposed)
    else:
        layout = Layout.fused(tuple(sizes), dim, transposed=transposed)
    other = draw(st.integers(1, 5))
    shape = (sum(sizes), other) if dim == 0 else (other, sum(sizes))
    starts = {sum(sizes[:i]) for i in range(len(sizes))}
    shard_dim = 1 - dim if draw(st.integers(0, 4)) == 0 else dim
    return layout, shape, starts, tp, shard_dim


@settings(max_examples=60, deadline=None)
@given(
    case=sharded(),
    fn=st.sampled_from(["original", "match_rms_adamw"]),
    seed=st.integers(0, 2**16),
)
def test_shards_of_whole_blocks_orthogonalise_as_the_whole(case, fn, seed):
    """Each shard orthogonalised by its own blocks and scaled over the whole matrix's shape
    is the shard of the whole matrix's per-block update (what the TP owner scatters); a shard
    is whole-blocked exactly when every shard boundary starts a block (the drawn blocks, not
    the layout's arithmetic)."""
    from dmuon_compile.layouts import block_shard_layouts

    layout, shape, starts, tp, dim = case
    got = block_shard_layouts(layout, shape, dim, tp)
    chunk = shape[dim] // tp
    whole = (
        dim == layout.split_dim
        and shape[dim] % tp == 0
        and all(k * chunk in starts for k in range(1, tp))
    )
    assert (got is not None) == whole
    if not whole:
        return
    torch.manual_seed(seed)
    u = torch.randn(shape, dtype=torch.float64)
    ortho = F.orthogonalize([u], NS64, layouts=[layout])[0]
    want = F.scale_blocks_as_whole(ortho, layout, fn)
    pieces = []
    for shard, lay in zip(u.chunk(tp, dim), got):
        o = F.orthogonalize([shard.clone()], NS64, layouts=[lay])[0]
        pieces.append(F.scale_blocks_as_whole(o, lay, fn, shape))
    torch.testing.assert_close(torch.cat(pieces, dim), want, atol=1e-12, rtol=0)
