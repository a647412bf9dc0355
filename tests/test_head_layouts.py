"""``dmuon.set_head_layouts(model)``: the attention projections of transformers' and
torchtitan's modules (and any module naming them alike with a head size or count) get per-head
layouts; Muon then orthogonalises each head on its own. Control: without the layouts the same
step differs (a whole-matrix Newton–Schulz).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.layouts import Layout, head_layouts


class HFStyle(nn.Module):
    """transformers' attention: q/k/v/o_proj, ``head_dim`` and a config with the head count."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.config = type("Config", (), {"num_attention_heads": heads})()
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        return self.o_proj(self.q_proj(x)) + self.k_proj(x).sum() + self.v_proj(x).sum()


class TitanFused(nn.Module):
    """torchtitan's attention with a fused projection: ``qkv_linear.wqkv``, ``wo``, counts."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, head_dim=8):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qkv_linear = nn.Module()
        rows = (n_heads + 2 * n_kv_heads) * head_dim
        self.qkv_linear.wqkv = nn.Linear(dim, rows, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x):
        q = self.qkv_linear.wqkv(x)[..., : self.n_heads * self.head_dim]
        return self.wo(q)


class Heads(nn.Module):
    """A plain module with ``heads`` only: the head size follows from q's rows."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.wo(self.wq(x) * self.wk(x) + self.wv(x))


def test_transformers_style_attention_gets_heads_per_projection():
    model = nn.Sequential(HFStyle(), HFStyle())
    got = dmuon.set_head_layouts(model)
    assert got == {
        f"{i}.{name}.weight": Layout.heads(8, dim=1 if name == "o_proj" else 0)
        for i in range(2)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    assert dmuon.get_layout(model[0].k_proj.weight).count(model[0].k_proj.weight.shape) == 2


def test_torchtitan_fused_qkv_and_plain_head_counts():
    fused = head_layouts(TitanFused())
    assert fused == {"qkv_linear.wqkv.weight": Layout.qkv(4, 2, 8), "wo.weight": Layout.heads(8, 1)}
    plain = head_layouts(Heads())
    assert plain["wq.weight"] == Layout.heads(8) and plain["wo.weight"] == Layout.heads(8, dim=1)


def test_the_real_transformers_llama_attention_is_recognised():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    got = dmuon.set_head_layouts(model)
    names = {n for n in got if n.endswith(("q_proj.weight", "o_proj.weight"))}
    assert len(got) == 8 and len(names) == 4
    assert got["model.layers.0.self_attn.k_proj.weight"] == Layout.heads(8)


def test_the_real_transformers_gpt_oss_is_recognised():
    """GPT-OSS: attention per head (transformers' names), and its expert stacks as the preset
    table says: ``gate_up_proj`` (E, dim, 2·I) with gate and up interleaved along its columns,
    ``down_proj`` (E, I, dim), both stored (in, out)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no GPT-OSS")
    config = transformers.GptOssConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    model = transformers.GptOssForCausalLM(config)
    opt = dmuon.Muon(model, compile=False, per_head=True)
    names = {n: p for n, p in model.named_parameters()}
    layout = opt._layouts
    prefix = "model.layers.0."
    assert layout[id(names[prefix + "self_attn.q_proj.weight"])] == Layout.heads(8)
    assert layout[id(names[prefix + "self_attn.o_proj.weight"])] == Layout.heads(8, dim=1)
    gate_up = Layout.gate_up(interleaved=True, experts=True, transposed=True)
    assert layout[id(names[prefix + "mlp.experts.gate_up_proj"])] == gate_up
    down = layout[id(names[prefix + "mlp.experts.down_proj"])]
    assert (down.kind, down.transposed, down.split, down.blocked) == ("experts", True, None, False)
    # the halves the layout cuts are the model's gate and up: columns ::2 and 1::2
    w = names[prefix + "mlp.experts.gate_up_proj"].detach()
    halves = gate_up.matrices(w)
    assert halves.shape[0] == 2 * w.shape[0]
    wanted = [w[e][..., k::2] for e in range(4) for k in (0, 1)]  # (dim, I): in, out

    def found(h):
        return any(torch.equal(h, x) or torch.equal(h, x.T) for x in wanted)

    assert all(found(h) for h in halves)


def test_muon_per_head_needs_the_model():
    with pytest.raises(ValueError, match="needs the model"):
        dmuon.Muon([torch.nn.Parameter(torch.randn(4, 4))], per_head=True)


def _step(model, x):
    opt = dmuon.Muon(model, lr=0.02, compile=False, adamw_lr=0.0)
    model(x).square().mean().backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_muon_steps_each_head_as_its_own_matrix():
    torch.manual_seed(0)
    base = HFStyle()
    x = torch.randn(5, 32)
    per_head = HFStyle()
    per_head.load_state_dict(base.state_dict())
    dmuon.set_head_layouts(per_head)
    by_hand = HFStyle()
    by_hand.load_state_dict(base.state_dict())
    for name in ("q_proj", "k_proj", "v_proj"):
        dmuon.set_layout(getattr(by_hand, name).weight, Layout.heads(8))
    dmuon.set_layout(by_hand.o_proj.weight, Layout.heads(8, dim=1))
    whole = HFStyle()
    whole.load_state_dict(base.state_dict())
    a, b, c = _step(per_head, x), _step(by_hand, x), _step(whole, x)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.allclose(a["q_proj.weight"], c["q_proj.weight"])  # control: whole matrices


def test_nothing_recognised_names_the_manual_way():
    with pytest.raises(ValueError, match=r"set_layout\(p, dmuon.Layout.heads"):
        dmuon.set_head_layouts(nn.Sequential(nn.Linear(4, 4)))


class MLA(nn.Module):
    """torchtitan's multi-head latent attention: low-rank wq_a/wkv_a, up-projections wq_b and
    wkv_b (per head: k_nope then v), wo."""

    def __init__(self, dim=32, n_heads=4, nope=8, rope=4, v_dim=8, rank=16):
        super().__init__()
        self.n_heads, self.qk_nope_head_dim = n_heads, nope
        self.qk_rope_head_dim, self.v_head_dim = rope, v_dim
        self.wq_a = nn.Linear(dim, rank, bias=False)
        self.wq_b = nn.Linear(rank, n_heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, rank + rope, bias=False)
        self.wkv_b = nn.Linear(rank, n_heads * (nope + v_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_dim, dim, bias=False)


def test_latent_attention_heads_and_kv_parts():
    equal = head_layouts(MLA())
    assert equal == {
        "wq_b.weight": Layout.heads(12),
        "wkv_b.weight": Layout.heads(8),  # k_nope and v of each head, 8 rows each
        "wo.weight": Layout.heads(8, dim=1),
    }
    unequal = head_layouts(MLA(v_dim=6))
    assert unequal["wkv_b.weight"] == Layout.fused((8, 6) * 4)
    assert unequal["wkv_b.weight"].count((4 * 14, 16)) == 8


def test_the_real_transformers_deepseek_v3_attention_is_recognised():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    got = dmuon.set_head_layouts(model)
    attn = "model.layers.0.self_attn."
    assert got == {
        f"{attn}q_b_proj.weight": Layout.heads(12),
        f"{attn}kv_b_proj.weight": Layout.heads(8),
        f"{attn}o_proj.weight": Layout.heads(8, dim=1),
    }


def test_muon_steps_the_latent_attention_blocks():
    torch.manual_seed(1)
    model = MLA(v_dim=6)
    dmuon.set_head_layouts(model)
    opt = dmuon.Muon(model, lr=0.02, compile=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    # wkv_b: 8 blocks (k_nope 8 rows, v 6 rows per head), each moved by its own NS: the rows
    # of every block changed
    delta = (model.wkv_b.weight - before["wkv_b.weight"]).detach()
    pieces = dmuon.get_layout(model.wkv_b.weight).pieces(delta.shape)
    assert [stop - start for start, stop, _ in pieces] == [8, 6] * 4
    assert all(torch.linalg.matrix_norm(delta[start:stop]) > 0 for start, stop, _ in pieces)
