"""Parameters of more than two dims: expert stacks orthogonalised per expert, fused gate/up
halves on their own, conv kernels as ``(out, in·kh·kw)``, unknown layouts refused.

References are the 2-D Newton–Schulz of each matrix in a loop (float64 where it matters); the
control is the flattened ``(E, m·n)`` form a 3-D weight got before layouts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile.layouts import Layout, infer_layout

NS64 = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float64)

LAYOUTS = [
    Layout.experts(),
    Layout.experts(split="chunk"),
    Layout.experts(split="interleave"),
    Layout.experts(split="chunk", split_dim=1),
    Layout.experts(split="interleave", split_dim=1, transposed=True),
]


def _halves(w: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The matrices of one expert ``w`` (2-D) by plain indexing: the reference of the views."""
    if layout.split is None:
        return [w]
    x = w if layout.split_dim == 0 else w.T
    h = x.shape[0] // 2
    parts = [x[:h], x[h:]] if layout.split == "chunk" else [x[0::2], x[1::2]]
    return parts if layout.split_dim == 0 else [p.T for p in parts]


def _reference(u: torch.Tensor, layout: Layout, ns) -> torch.Tensor:
    """Each expert's (each half's) 2-D Newton–Schulz, put back where the half came from."""
    out = torch.empty_like(u)
    for e in range(u.shape[0]):
        target = out[e] if layout.split_dim == 0 else out[e].T
        x = u[e] if layout.split_dim == 0 else u[e].T
        if layout.split is None:
            out[e] = ns(u[e])
            continue
        h = x.shape[0] // 2
        chunks = (slice(0, h), slice(h, None))
        rows = chunks if layout.split == "chunk" else (slice(0, None, 2), slice(1, None, 2))
        for r in rows:
            target[r] = ns(x[r].T).T if layout.split_dim == 1 else ns(x[r])
    return out


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 5),
    m=st.integers(1, 6).map(lambda k: 2 * k),
    n=st.integers(1, 6).map(lambda k: 2 * k),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_expert_stack_is_orthogonalised_per_expert(experts, m, n, layout, seed):
    torch.manual_seed(seed)
    u = torch.randn(experts, m, n, dtype=torch.float64)
    got = F.orthogonalize([u.clone()], NS64, layouts=[layout])[0]
    assert got.shape == u.shape
    torch.testing.assert_close(got, _reference(u, layout, NS64), atol=1e-9, rtol=0)
    # With a 2-D weight of an expert's matrix shape in the same call: one batch, same result.
    mats = layout.matrices(u)
    w = torch.randn(mats.shape[-2], mats.shape[-1], dtype=torch.float64)
    both = F.orthogonalize([w.clone(), u.clone()], NS64, layouts=[F.MATRIX, layout])
    assert len(F.shape_buckets([w, u], [F.MATRIX, layout])) == 1
    torch.testing.assert_close(both[0], NS64(w), atol=1e-9, rtol=0)
    torch.testing.assert_close(both[1], got, atol=1e-9, rtol=0)


@settings(max_examples=15, deadline=None)
@given(experts=st.integers(2, 5), m=st.integers(3, 8), n=st.integers(3, 8), seed=st.integers(0, 99))
def test_flattened_form_is_not_per_expert(experts, m, n, seed):
    """The control: NS of the (E, m·n) view is a different update (cosine well below 1)."""
    torch.manual_seed(seed)
    u = torch.randn(experts, m, n, dtype=torch.float64)
    per_expert = F.orthogonalize([u], NS64, layouts=[Layout.experts()])[0]
    flat = F.orthogonalize([u], NS64, layouts=[Layout.conv()])[0]
    cos = torch.nn.functional.cosine_similarity(per_expert.flatten(), flat.flatten(), dim=0)
    assert cos < 0.99


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS + [Layout.matrix(split="interleave")]),
    seed=st.integers(0, 99),
)
def test_views_round_trip_and_match_indexing(layout, seed):
    torch.manual_seed(seed)
    shape = (3, 6, 4) if layout.kind == "experts" else (6, 4)
    t = torch.randn(shape)
    mats = layout.matrices(t)
    assert torch.equal(layout.unmatrices(mats.clone(), shape), t)
    experts = t if t.dim() == 3 else t.unsqueeze(0)
    expected = [h for w in experts for h in _halves(w, layout)]
    assert torch.equal(mats.reshape(-1, *mats.shape[-2:]), torch.stack(expected))
    assert layout.count(shape) == len(expected)


def test_lr_scale_uses_each_experts_shape():
    """W ← W − lr·scale·O with scale = 0.2·√max(m, n) of one expert (a half, with a split),
    and the "original" rule reads a transposed stack as (out, in)."""
    w = torch.zeros(4, 8, 2)
    o = torch.ones(4, 8, 2)
    F.apply_muon_update([w], [o], 1.0, 0.0, "match_rms_adamw", layouts=[Layout.experts()])
    assert torch.allclose(w, torch.full_like(w, -0.2 * 8**0.5))
    w = torch.zeros(4, 8, 2)
    lay = Layout.experts(split="chunk")  # halves of (4, 2)
    F.apply_muon_update([w], [o], 1.0, 0.0, "match_rms_adamw", layouts=[lay])
    assert torch.allclose(w, torch.full_like(w, -0.2 * 4**0.5))
    w = torch.zeros(4, 2, 8)  # stored (in, out): out/in = 4
    lay = Layout.experts(transposed=True)
    F.apply_muon_update([w], [o.mT], 1.0, 0.0, "original", layouts=[lay])
    assert torch.allclose(w, torch.full_like(w, -2.0))


def test_unknown_layout_raises_naming_the_parameter():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(2, 3, 4))
            self.lin = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"'table' has shape \(2, 3, 4\).*set_layout"):
        dmuon.Muon(Odd())
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        dmuon.Muon([torch.nn.Parameter(torch.randn(2, 3, 4))])
    with pytest.raises(ValueError, match="layouts="):
        F.orthogonalize([torch.randn(2, 3, 4)], NS64)
    # Declared: accepted, per expert.
    model = Odd()
    dmuon.set_layout(model.table, Layout.experts())
    opt = dmuon.Muon(model, compile=False)
    assert opt._layout(model.table) == Layout.experts()

    # Returned by the predicate: accepted too.
    def predicate(name, p):
        return Layout.experts() if p.ndim == 3 else p.ndim == 2

    opt = dmuon.Muon(Odd(), compile=False, predicate=predicate)
    assert any(lay.kind == "experts" for lay in opt._layouts.values())


def test_bad_declarations_raise():
    with pytest.raises(ValueError, match="split_dim"):
        Layout.experts(split="chunk", split_dim=2)
    with pytest.raises(ValueError, match="even"):
        dmuon.set_layout(torch.zeros(2, 5, 4), Layout.experts(split="chunk"))
    with pytest.raises(ValueError, match="3 dims"):
        dmuon.set_layout(torch.zeros(5, 4), Layout.experts())


def test_conv_keeps_its_matrix_view():
    conv = nn.Conv2d(3, 8, 3)
    assert infer_layout("weight", conv.weight, conv) == Layout.conv()
    u = torch.randn(8, 3, 3, 3, dtype=torch.float64)
    got = F.orthogonalize([u], NS64, layouts=[Layout.conv()])[0]
    torch.testing.assert_close(got, NS64(u.reshape(8, -1)).reshape(u.shape), atol=1e-12, rtol=0)


def test_muon_steps_an_expert_stack_per_expert():
    """Muon(model) on a module named like torchtitan's GroupedExperts: the first step's update
    is −lr·scale·NS of each expert's Nesterov input."""

    class GroupedExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(4, 12, 8, dtype=torch.float64))

        def forward(self, x):
            return torch.einsum("td,ehd->teh", x, self.w1)

    model = nn.Sequential(GroupedExperts())
    opt = dmuon.Muon(model, lr=0.02, ns_backend=NS64, compile=False)
    before = model[0].w1.detach().clone()
    model(torch.randn(5, 8, dtype=torch.float64)).sin().sum().backward()
    u = model[0].w1.grad * 1.95  # the first Nesterov input: g + μ·g
    opt.step()
    ref = torch.stack([NS64(u[e]) for e in range(4)])
    step = (before - model[0].w1.detach()) / (0.02 * 0.2 * 12**0.5)
    torch.testing.assert_close(step, ref, atol=1e-9, rtol=0)


def test_compiled_step_equals_eager_on_expert_stacks():
    """The compiled directions (one graph, CPU) of a group with an expert stack, a fused stack
    and a 2-D weight of an expert's shape equal the eager reference."""
    from dmuon_compile.compiled_step import CompiledMuonStep

    torch.manual_seed(0)
    ns = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)
    lays = [Layout.experts(), Layout.experts(split="interleave"), F.MATRIX]
    grads = [torch.randn(3, 8, 6), torch.randn(2, 16, 6), torch.randn(8, 6)]
    bufs = [torch.randn_like(g) for g in grads]
    eager = F.muon_directions(grads, bufs, momentum=0.9, nesterov=True, ns=ns, layouts=lays)
    step = CompiledMuonStep(ns)
    got, finite = step.directions(
        grads, bufs, momentum=0.9, nesterov=True, finite_flags=True, layouts=lays
    )
    assert finite.tolist() == [True, True, True]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_transformers_fused_experts_are_recognised():
    """transformers 5.x experts: a concatenated gate_up_proj (Qwen3-MoE) splits in chunks along
    its rows; GPT-OSS's transposed, interleaved one along its columns."""
    pytest.importorskip("transformers")

    class QwenLikeExperts(nn.Module):  # what use_experts_implementation marks
        is_transposed, is_concatenated, has_gate = False, True, True

    class GptOssLikeExperts(nn.Module):
        is_transposed, is_concatenated, has_gate = True, False, True

    p = torch.zeros(4, 12, 8)
    assert infer_layout("mlp.experts.gate_up_proj", p, QwenLikeExperts()) == Layout.experts(
        split="chunk"
    )
    assert infer_layout("mlp.experts.down_proj", p, QwenLikeExperts()) == Layout.experts()
    assert infer_layout("mlp.experts.gate_up_proj", p, GptOssLikeExperts()) == Layout.experts(
        split="interleave", split_dim=1, transposed=True
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_expert_stacks_on_the_gpu_equal_eager_kernels():
    """The compiled step's NS-chain rewrite (Triton/Gluon kernels where autotune picks them) on
    expert stacks next to 2-D weights of an expert's shape: equal to the eager NS with the same
    orthogonaliser, and near the float64 per-expert reference."""
    from dmuon_compile.compiled_step import CompiledMuonStep

    torch.manual_seed(0)
    ns = dmuon.NewtonSchulz()  # the GPU default: Gram NS, fp16 work dtype, kernel="auto"
    lays = [Layout.experts(), Layout.experts(split="chunk"), F.MATRIX]
    grads = [
        torch.randn(8, 1024, 2048, device="cuda"),
        torch.randn(4, 2048, 2048, device="cuda"),
        torch.randn(1024, 2048, device="cuda"),
    ]
    bufs = [torch.zeros_like(g) for g in grads]
    step = CompiledMuonStep(ns)
    got, finite = step.directions(
        grads, bufs, momentum=0.9, nesterov=True, finite_flags=True, layouts=lays
    )
    assert bool(finite.all())
    eager = F.muon_directions(grads, bufs, momentum=0.9, nesterov=True, ns=ns, layouts=lays)
    for g, a, b, lay in zip(grads, got, eager, lays):
        ref = (
            _reference(g.double().cpu().reshape(-1, *g.shape[-2:]) * 1.9, lay, NS64)
            if lay.kind == "experts"
            else NS64(g.double().cpu() * 1.9)
        )
        ref = ref.reshape(g.shape)
        rel = lambda x: float((x.double().cpu() - ref).norm() / ref.norm())  # noqa: E731
        assert rel(a) < 2e-2 and rel(b) < 2e-2, (rel(a), rel(b))
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
