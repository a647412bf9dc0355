"""``Muon(normuon=...)``: each matrix's orthogonalised update normalised per output neuron by a
second moment of its rows, its Frobenius norm kept (``dmuon_compile/normuon.py``).

The reference is the step written out here in float64, matrix by matrix: each matrix taken in
its ``(out, in)`` orientation (a transposed layout's matrix transposed back), one second moment
per row, ``O / (√v + ε)`` rescaled to ``‖O‖_F``, then the usual scaled update. Newton–Schulz is
the package's eager one (``functional.orthogonalize``, float32), as in the other reference
loops. The stored second moment is checked by what it means: broadcast back over its rows (and
blocks along the input dim), it equals the reference's per-row values.

Controls: plain Muon (``normuon=False``) leaves the reference by more than the tolerance, and
a reference that normalised the stored rows of a transposed matrix (its input neurons) would
not match the transposed layouts drawn here.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.distributed.step_plan import StepPlan
from dmuon_compile.layouts import Layout
from dmuon_compile.newton_schulz import NewtonSchulz
from dmuon_compile.normuon import SECOND_MOMENT, NorMuon, moment_shape, refuse_unsupported

MU, LR = 0.9, 0.02
NS = NewtonSchulz(backend="direct", work_dtype=torch.float32)


def _layout_case(kind: str, a: int, b: int, e: int, h: int) -> tuple[Layout, tuple[int, ...]]:
    """A layout of each family and a shape it fits (``a``, ``b``: sizes; ``e``: experts;
    ``h``: a head size)."""
    if kind == "matrix":
        return Layout(), (a, b)
    if kind == "transposed":
        return Layout(transposed=True), (a, b)
    if kind == "experts":
        return Layout.experts(), (e, a, b)
    if kind == "heads_rows":
        return Layout.heads(h), (h * a, b)
    if kind == "heads_columns":  # an output projection: heads along the input dim
        return Layout.heads(h, dim=1), (b, h * a)
    if kind == "expert_heads_columns":
        return Layout.heads(h, dim=1, experts=True), (e, b, h * a)
    if kind == "transposed_heads_rows":  # stored (in, out): heads along the input dim
        return Layout.heads(h, transposed=True), (h * a, b)
    if kind == "fused_unequal":  # parts of two sizes along the rows: piece by piece
        return Layout.fused((a + 1, a)), (2 * a + 1, b)
    if kind == "gate_up_interleaved":
        return Layout.gate_up(interleaved=True), (2 * a, b)
    raise AssertionError(kind)


KINDS = (
    "matrix",
    "transposed",
    "experts",
    "heads_rows",
    "heads_columns",
    "expert_heads_columns",
    "transposed_heads_rows",
    "fused_unequal",
    "gate_up_interleaved",
)


def _normalized(a: torch.Tensor, v: torch.Tensor, config: NorMuon) -> tuple:
    """One ``(out, in)`` matrix, float64: NorMuon's row normalisation and Frobenius rescale."""
    v = config.beta2 * v + (1 - config.beta2) * (a * a).mean(1)
    hat = a / (v.sqrt() + config.eps)[:, None]
    return hat * (a.norm() / (hat.norm() + config.eps)), v


def _reference(weights, layouts, grads, config: NorMuon | None):
    """Per matrix in float64 (``config=None``: plain Muon). Returns the weights and, per
    tensor, its second moments broadcast over the tensor's shape."""
    ws = [w.double().clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in ws]
    moments: dict = {}  # (tensor, piece, matrix) -> v
    broadcast = [torch.zeros_like(w) for w in ws]
    for step in grads:
        for i, (w, lay) in enumerate(zip(ws, layouts)):
            g = step[i].double()
            bufs[i] = MU * bufs[i] + g
            u = g + MU * bufs[i]
            o = F.orthogonalize([u.float()], NS, layouts=[lay])[0].double()
            dim = lay.block_dim(w.shape) if lay.kind != "conv" else 0
            updates, spread = [], []
            for p_index, (start, stop, sub) in enumerate(lay.pieces(w.shape)):
                piece = o.narrow(dim, start, stop - start) if stop else o
                mats = sub.matrices(piece)
                mats = mats.reshape(-1, mats.shape[-2], mats.shape[-1])
                outs, vs = [], []
                for j, m in enumerate(mats):
                    a = m.T if sub.transposed else m  # (out, in)
                    if config is not None:
                        key = (i, p_index, j)
                        a, moments[key] = _normalized(a, moments.get(key, 0.0), config)
                        vs.append(moments[key])
                    outs.append(a.T if sub.transposed else a)
                scale = F.lr_scale(sub.matrix_shape(piece.shape), "match_rms_adamw")
                updates.append(sub.unmatrices(torch.stack(outs), piece.shape) * scale)
                if config is not None:  # each row's v over its row (stored orientation)
                    rows = [
                        v[None, :].expand(m.shape) if sub.transposed else v[:, None].expand(m.shape)
                        for v, m in zip(vs, mats)
                    ]
                    spread.append(sub.unmatrices(torch.stack(rows), piece.shape))
            w.sub_(LR * torch.cat(updates, dim))
            if config is not None:
                broadcast[i] = torch.cat(spread, dim)
    return ws, broadcast


def _spread(v: torch.Tensor, lay: Layout, shape) -> torch.Tensor:
    """The stored second moment over the parameter's shape: along the input dim, each entry
    covers its block (one entry: the whole dim)."""
    in_dim = len(shape) - (2 if lay.transposed else 1)
    if v.shape[in_dim] == 1:
        return v.expand(shape)
    sizes = torch.tensor(lay.block_sizes(shape))
    return torch.repeat_interleave(v, sizes, dim=in_dim)


def _muon(weights, layouts, grads, **kwargs):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, lay in zip(params, layouts):
        dmuon.set_layout(p, lay)
    opt = dmuon.Muon(params, lr=LR, momentum=MU, ns_backend=NS, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return params, opt


def _case(kind, a, b, e, h, steps, seed):
    """Two tensors of the drawn layout (one shape bucket) and a plain 2-D one."""
    lay, shape = _layout_case(kind, a, b, e, h)
    layouts = [lay, lay, Layout()]
    shapes = [shape, shape, (5, 7)]
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return weights, layouts, grads


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    a=st.integers(1, 5),
    b=st.integers(2, 7),
    e=st.integers(1, 3),
    h=st.integers(1, 3),
    steps=st.integers(1, 3),
    beta2=st.sampled_from([0.0, 0.5, 0.95]),
    seed=st.integers(0, 2**16),
)
def test_the_step_matches_the_float64_reference(kind, a, b, e, h, steps, beta2, seed):
    weights, layouts, grads = _case(kind, a, b, e, h, steps, seed)
    config = NorMuon(beta2=beta2)
    params, opt = _muon(weights, layouts, grads, compile=False, normuon=config)
    ref_w, ref_v = _reference(weights, layouts, grads, config)
    for p, lay, w, v in zip(params, layouts, ref_w, ref_v):
        stored = opt.state[p][SECOND_MOMENT]
        assert stored.dtype == torch.float32
        assert tuple(stored.shape) == moment_shape(lay, p.shape)
        torch.testing.assert_close(_spread(stored, lay, p.shape).double(), v, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-4, atol=1e-5)


def test_muon_update_is_the_optimizer_step():
    """``functional.muon_update`` (both halves in one call) with second moments: the moments
    updated in place, the weights as ``Muon`` steps them."""
    weights, layouts, grads = _case("expert_heads_columns", 2, 4, 2, 2, 2, 3)
    params, opt = _muon(weights, layouts, grads, compile=False, normuon=True)
    ws = [w.clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in ws]
    moments = [torch.zeros(moment_shape(lay, w.shape)) for w, lay in zip(ws, layouts)]
    for step in grads:
        F.muon_update(
            ws,
            step,
            bufs,
            lr=LR,
            weight_decay=0.0,
            momentum=MU,
            nesterov=True,
            ns=NS,
            layouts=layouts,
            second_moments=moments,
            normuon=NorMuon(),
        )
    for p, w, v in zip(params, ws, moments):
        assert torch.equal(p.detach(), w)
        assert torch.equal(opt.state[p][SECOND_MOMENT], v)


def test_moment_shapes_keep_the_expert_and_output_dims():
    assert moment_shape(Layout(), (8, 4)) == (8, 1)
    assert moment_shape(Layout.experts(), (3, 8, 4)) == (3, 8, 1)
    assert moment_shape(Layout(transposed=True), (8, 4)) == (1, 4)
    assert moment_shape(Layout.heads(2, dim=1), (8, 6)) == (8, 3)
    assert moment_shape(Layout.heads(2), (8, 6)) == (8, 1)
    assert moment_shape(Layout.conv(), (4, 3, 2, 2)) == (4, 1, 1, 1)


@pytest.mark.parametrize("kind", ["matrix", "transposed", "heads_columns"])
def test_control_plain_muon_leaves_the_reference(kind):
    weights, layouts, grads = _case(kind, 4, 6, 2, 2, 3, 11)
    plain, _ = _muon(weights, layouts, grads, compile=False)
    ref_w, _ = _reference(weights, layouts, grads, NorMuon())
    moved = (ref_w[0] - weights[0].double()).norm()
    gap = (plain[0].detach().double() - ref_w[0]).norm()
    assert gap > 1e-2 * moved, (gap, moved)  # far beyond the 1e-4 the comparison allows


def test_control_a_reference_of_the_stored_rows_differs_on_a_transposed_layout():
    """What the orientation is worth: normalising a transposed weight's stored rows (its input
    neurons) is another step."""
    gen = torch.Generator().manual_seed(3)
    o = F.orthogonalize([torch.randn(6, 9, generator=gen)], NS)[0].double()
    out_rows, _ = _normalized(o.T, torch.zeros(9, dtype=torch.float64), NorMuon(beta2=0.0))
    in_rows, _ = _normalized(o, torch.zeros(6, dtype=torch.float64), NorMuon(beta2=0.0))
    assert (out_rows.T - in_rows).abs().max() > 1e-2


def test_a_skipped_step_leaves_the_second_moment_unchanged():
    weights, layouts, grads = _case("experts", 4, 6, 2, 2, 1, 5)
    params, opt = _muon(
        weights, layouts, grads, compile=False, normuon=True, nonfinite_grads="skip"
    )
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    weights_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[0, 0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skip"):
        opt.step()
    for p, w in zip(params, weights_before):
        assert torch.equal(p.detach(), w)
        for key, value in before[id(p)].items():
            assert torch.equal(opt.state[p][key], value), key
    assert all(before[id(p)][SECOND_MOMENT].abs().sum() > 0 for p in params)  # not all zeros


@pytest.mark.parametrize("verdict", [True, False])
def test_the_commit_under_a_device_verdict_stores_the_new_moments_or_nothing(verdict):
    """``commit_muon_step(commit_if=...)`` (the compiled step's deferred verdict): the same
    second moment as the plain commit, or untouched."""
    gen = torch.Generator().manual_seed(9)
    w, g, buf, o = (torch.randn(6, 10, generator=gen) for _ in range(4))
    v, new_v = torch.rand(6, 1, generator=gen), torch.rand(6, 1, generator=gen)
    hypers = dict(lr=LR, weight_decay=0.0, momentum=MU)
    plain = [w.clone()], [buf.clone()], [v.clone()]
    F.commit_muon_step(
        plain[0], [g], plain[1], [o], **hypers, second_moments=plain[2], new_second_moments=[new_v]
    )
    chosen = [w.clone()], [buf.clone()], [v.clone()]
    F.commit_muon_step(
        chosen[0],
        [g],
        chosen[1],
        [o],
        **hypers,
        second_moments=chosen[2],
        new_second_moments=[new_v],
        commit_if=torch.tensor(verdict),
    )
    want = plain if verdict else ([w], [buf], [v])
    assert torch.equal(plain[2][0], new_v)
    for got, expected in zip(chosen, want):
        assert torch.equal(got[0], expected[0])


def test_the_compiled_step_equals_the_eager_one():
    lays = [Layout(), Layout(), Layout.experts(), Layout.heads(2, dim=1)]
    shapes = [(8, 12), (8, 12), (3, 6, 4), (6, 8)]
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    eager, eager_opt = _muon(weights, lays, grads, compile=False, normuon=True)
    compiled, compiled_opt = _muon(weights, lays, grads, compile=True, normuon=True)
    assert len(compiled_opt.compiled_steps) == 1
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        va, vb = eager_opt.state[a][SECOND_MOMENT], compiled_opt.state[b][SECOND_MOMENT]
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-8)


def test_the_state_dict_round_trip_continues_the_run():
    weights, layouts, grads = _case("heads_columns", 3, 5, 2, 2, 4, 6)
    params, opt = _muon(weights, layouts, grads[:2], compile=False, normuon=True)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # a copy: a state dict holds the optimizer's tensors
    state = torch.load(io.BytesIO(saved.getvalue()))
    assert tuple(state["state"][0][SECOND_MOMENT].shape) == moment_shape(
        layouts[0], weights[0].shape
    )
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, lay in zip(resumed, layouts):
        dmuon.set_layout(p, lay)
    opt2 = dmuon.Muon(resumed, lr=LR, momentum=MU, ns_backend=NS, compile=False, normuon=True)
    opt2.load_state_dict(state)
    for step in grads[2:]:
        for a, b, g in zip(params, resumed, step):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(opt.state[a][SECOND_MOMENT], opt2.state[b][SECOND_MOMENT])


def test_a_second_moment_of_another_shape_is_refused_on_load():
    weights, layouts, grads = _case("matrix", 4, 6, 1, 1, 1, 8)
    params, opt = _muon(weights, layouts, grads, compile=False, normuon=True)
    state = opt.state_dict()
    state["state"][0][SECOND_MOMENT] = torch.zeros(weights[0].shape)
    with pytest.raises(ValueError, match=SECOND_MOMENT):
        opt.load_state_dict(state)


@pytest.mark.parametrize(
    "bad, match",
    [
        (0.9, "dmuon.NorMuon"),
        ("yes", "dmuon.NorMuon"),
        (NorMuon(beta2=1.0), r"\[0, 1\)"),
        (NorMuon(beta2=-0.1), r"\[0, 1\)"),
        (NorMuon(eps=0.0), "positive"),
        (NorMuon(eps=float("nan")), "positive"),
    ],
)
def test_invalid_values_are_refused_naming_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        dmuon.Muon([torch.nn.Parameter(torch.randn(4, 4))], normuon=bad)


class _Skipping:
    """A stage that orthogonalises without the normalisation (no ``normuon_ok``)."""

    what = "a stage of its own"


def test_a_stage_that_would_skip_the_normalisation_is_refused():
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards
    from dmuon_compile.distributed._stages import split_step as _split_step
    from dmuon_compile.distributed._stages.tp import stage as tp_stage

    expert = object.__new__(_expert_shards.ExpertReshardStage)
    tp = object.__new__(tp_stage.TPStage)
    split = object.__new__(_split_step.SplitStage)
    for stages in ((_Skipping(),), (expert, tp, split, _Skipping())):
        plan = StepPlan(stages=stages)  # what a stage is: its class's
        match = "normuon=True is not supported with a stage of its own"
        with pytest.raises(NotImplementedError, match=match):
            refuse_unsupported(plan, [])


@pytest.mark.parametrize("stage", ["TPStage", "SplitStage"])
def test_tp_and_split_ns_normalise_and_are_not_refused(stage):
    """The TP stage normalises each matrix where it is whole (``_stages/tp/stage.py``), split NS on
    the owner's gathered result (``_stages/split_step.py``); trained against one process in
    tests/distributed/test_normuon_tp.py: their plans pass."""
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards
    from dmuon_compile.distributed._stages import split_step as _split_step
    from dmuon_compile.distributed._stages.tp import stage as tp_stage

    cls = {"TPStage": tp_stage.TPStage, "SplitStage": _split_step.SplitStage}[stage]
    assert cls.normuon_ok
    mine, expert = object.__new__(cls), object.__new__(_expert_shards.ExpertReshardStage)
    refuse_unsupported(StepPlan(stages=(mine,)), [])
    refuse_unsupported(StepPlan(stages=(expert, mine)), [])


def test_stacks_cut_inside_experts_need_the_reshard_whatever_other_stages_normalise(
    monkeypatch,
):
    """Expert stacks that need the reshard, in a plan without it (a TP stage that normalises
    does not stand in for it): refused; with the reshard in the plan: passed."""
    import dmuon_compile.layouts as layouts
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards
    from dmuon_compile.distributed._stages.tp import stage as tp_stage

    class Stack:  # a stack sharded inside its experts, as needs_reshard tells
        pass

    monkeypatch.setattr(layouts, "needs_reshard", lambda p, lay: isinstance(p, Stack))
    tp, expert = object.__new__(tp_stage.TPStage), object.__new__(_expert_shards.ExpertReshardStage)
    stacks = [(Stack(), Layout.experts())]
    with pytest.raises(NotImplementedError, match="expert stacks sharded inside"):
        refuse_unsupported(StepPlan(stages=(tp,)), stacks)
    refuse_unsupported(StepPlan(stages=(tp, expert)), stacks)


# ---------------------------------------------------------------------- tensor parallelism
TP_CASES = [  # (layout, global shape, TP shard dim, size): the TP stage's two paths' layouts
    (Layout(), (8, 6), 0, 2),  # column-parallel: v's rows cut like the weight's
    (Layout(), (8, 6), 1, 2),  # row-parallel: v one column, replicated
    (Layout.heads(2), (8, 6), 0, 2),  # q/k/v per head: whole heads on each shard
    (Layout.heads(2, dim=1), (6, 8), 1, 2),  # o per head: whole heads, v's head columns cut
    (Layout.heads(2, dim=1), (6, 8), 1, 4),
    (Layout.heads(2, dim=1), (6, 12), 1, 4),  # 6 heads over 4: straddling, v replicated
    (Layout.heads(2, dim=1), (8, 6), 0, 2),  # heads along the input dim, rows cut
    (Layout.fused((2, 6)), (8, 6), 0, 2),  # a part straddles: gathered, rows still cut
    (Layout.fused((2, 2, 4), dim=1), (6, 8), 1, 2),  # whole parts, 2 | 1 columns: replicated
    (Layout.heads(2, transposed=True), (8, 6), 0, 2),  # stored (in, out): heads along in
    (Layout.gate_up(interleaved=True), (8, 6), 0, 2),
    (Layout.matrix(split="chunk", split_dim=1), (6, 8), 1, 2),  # halves along in: replicated
]


@pytest.mark.parametrize("layout, shape, dim, size", TP_CASES)
def test_a_tp_weights_second_moment_is_cut_like_its_rows_or_replicated(layout, shape, dim, size):
    """``_stages/tp/moments.py``: ``v`` is cut along the TP shard dim where that is the output dim
    (its rows are the weight's) or where each shard holds whole blocks along the input dim,
    one moment column each and as many on every member; else every member holds all of it.
    The pieces tile ``moment_shape``."""
    from dmuon_compile.distributed._stages.tp.moments import member_moment_shape, moment_sharded

    whole = moment_shape(layout, shape)
    out_dim = 1 if layout.transposed else 0
    sharded = moment_sharded(layout, shape, dim, size)
    piece = member_moment_shape(layout, shape, dim, size)
    expect = {
        (Layout.heads(2, dim=1), (6, 8), 1, 2): True,
        (Layout.heads(2, dim=1), (6, 8), 1, 4): True,
        (Layout.heads(2, transposed=True), (8, 6), 0, 2): True,
    }.get((layout, shape, dim, size), dim == out_dim)
    assert sharded is expect
    if sharded:
        assert piece[dim] * size == whole[dim]
        assert piece[1 - dim] == whole[1 - dim]
    else:
        assert piece == whole


def _cut(t: torch.Tensor, dim: int, size: int) -> list[torch.Tensor]:
    return list(t.chunk(size, dim))


@pytest.mark.parametrize("layout, shape, dim, size", TP_CASES)
def test_the_tp_paths_normalise_as_one_process(layout, shape, dim, size):
    """What the TP stage computes from the members' pieces equals one process's ``(Ô, v′)``:
    the whole matrix on the owner (v's pieces put together, or a replicated v) with ``v′`` cut
    back the same way; and, where each member holds whole blocks (``local_blocks_layout``) and
    ``v`` is cut like them, each member's own blocks with its piece of ``v``."""
    from dmuon_compile.distributed._stages.tp.moments import moment_sharded
    from dmuon_compile.layouts import block_shard_layouts
    from dmuon_compile.normuon import normalize

    config = NorMuon(beta2=0.5)
    gen = torch.Generator().manual_seed(7)
    o = F.orthogonalize([torch.randn(shape, generator=gen)], NS, layouts=[layout])[0]
    v = torch.rand(moment_shape(layout, shape), generator=gen)
    want_o, want_v = normalize(o, v, layout, config)
    sharded = moment_sharded(layout, shape, dim, size)
    pieces = _cut(v, dim, size) if sharded else [v] * size
    # the gathered path: v whole on the owner, v′ back as the pieces
    whole_v = torch.cat(pieces, dim) if sharded else pieces[0]
    got_o, got_v = normalize(o, whole_v, layout, config)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=0)
    back = _cut(got_v, dim, size) if sharded else [got_v] * size
    torch.testing.assert_close(torch.cat(back, dim) if sharded else back[0], want_v)
    # the local path: each member's blocks and its piece of v
    shards = block_shard_layouts(layout, shape, dim, size)
    if shards is None or not sharded:
        return
    outs = [
        normalize(piece, vp, lay, config)
        for piece, vp, lay in zip(_cut(o, dim, size), pieces, shards)
    ]
    torch.testing.assert_close(torch.cat([a for a, _ in outs], dim), want_o)
    torch.testing.assert_close(torch.cat([b for _, b in outs], dim), want_v)


@pytest.mark.parametrize("fn", ["match_rms_adamw", "original"])
def test_the_tp_owner_normalises_before_the_blocks_scale(fn):
    """The TP owner's order, ``normalize`` then ``functional.scale_blocks_as_whole`` and the
    whole matrix's learning-rate scale, is one process's update (``apply_muon_update`` with the
    layout then scales each normalised block by its own rule). Control: scaling first would
    feed the scaled rows into the second moment (``v′`` off by each block's factor squared)."""
    from dmuon_compile.normuon import normalize

    layout, shape = Layout.fused((2, 6)), (8, 6)  # blocks of two shapes: two scales
    config = NorMuon()
    gen = torch.Generator().manual_seed(3)
    o = F.orthogonalize([torch.randn(shape, generator=gen)], NS, layouts=[layout])[0]
    v = torch.rand(moment_shape(layout, shape), generator=gen)
    w = torch.randn(shape, generator=gen)
    want = w.clone()
    F.apply_muon_update([want], [normalize(o, v, layout, config)[0]], LR, 0.0, fn, layouts=[layout])
    owner = F.scale_blocks_as_whole(normalize(o, v, layout, config)[0], layout, fn)
    got = w.clone()
    F.apply_muon_update([got], [owner], LR, 0.0, fn, matrix_shapes=[shape])
    torch.testing.assert_close(got, want)
    right_v = normalize(o, v, layout, config)[1]
    wrong_v = normalize(F.scale_blocks_as_whole(o, layout, fn), v, layout, config)[1]
    assert (wrong_v - right_v).abs().max() > 1e-3 * right_v.abs().max()


def test_the_expert_reshard_normalises_and_is_not_refused():
    """The expert reshard normalises whole experts (``_stages/expert_shards.py``; trained against
    one process in tests/distributed/test_normuon_experts.py): its plan passes."""
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards

    assert _expert_shards.ExpertReshardStage.normuon_ok
    refuse_unsupported(StepPlan(stages=(object.__new__(_expert_shards.ExpertReshardStage),)), [])
