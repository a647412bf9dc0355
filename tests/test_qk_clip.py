"""QK-clip (``dmuon_compile/qk_clip.py``): the fallback's per-head max logits against a dense
float64 reference; the per-head rescale (MHA, GQA, fused wqkv, MLA) against a reference written
head by head, with every head's max ≤ tau after and untouched heads bit-equal; a training run
whose logits grow, with the clip against the control without it; the state dict's round trip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

import dmuon_compile as dmuon
from dmuon_compile.qk_clip import QKClip
from dmuon_compile.qk_logits import max_logits


# ---------------------------------------------------------------------- references
def dense_max(q, k, *, scale=None, is_causal=False, attn_mask=None):
    """Per q head, the max of q·kᵀ·scale over what it attends: the whole score matrix, float64."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    keep = torch.ones(s.shape[-2:], dtype=torch.bool)
    if is_causal:
        keep = keep.tril()
    if attn_mask is not None:
        m = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -1e38
        keep = keep & m
    s = s.masked_fill(~keep.expand_as(s), -math.inf)
    return s.movedim(-3, 0).reshape(s.shape[-3], -1).amax(1)


class CaptureSDPA(TorchFunctionMode):
    """Keeps every SDPA call's q, k and options (the reference sees what the kernel sees)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args))
            call.update(kwargs)
            self.calls.append(call)
        return func(*args, **kwargs)


def reference_max(model, x):
    """Per SDPA call of ``model(x)``: the dense float64 per-head max."""
    with CaptureSDPA() as cap, torch.no_grad():
        model(x)
    return [
        dense_max(
            c["query"],
            c["key"],
            scale=c.get("scale"),
            is_causal=c.get("is_causal", False),
            attn_mask=c.get("attn_mask"),
        )
        for c in cap.calls
    ]


def rope(x):
    """Rotary embedding over the last dim's pairs (a rotation within each head)."""
    t, half = x.shape[-2], x.shape[-1] // 2
    angle = torch.arange(t, dtype=x.dtype)[:, None] * 0.3 ** torch.arange(half, dtype=x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


# ---------------------------------------------------------------------- tiny attentions
class Attention(nn.Module):
    """Llama-like: q/k/v/o (or torchtitan's ``qkv_linear.wqkv`` + ``wo``), RoPE, SDPA."""

    def __init__(self, dim=16, n_heads=4, n_kv=2, head_dim=4, fused=False, bias=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.fused = n_heads, n_kv, head_dim, fused
        q, kv = n_heads * head_dim, n_kv * head_dim
        if fused:
            self.qkv_linear = nn.Module()
            self.qkv_linear.wqkv = nn.Linear(dim, q + 2 * kv, bias=bias)
            self.wo = nn.Linear(q, dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, q, bias=bias)
            self.k_proj = nn.Linear(dim, kv, bias=bias)
            self.v_proj = nn.Linear(dim, kv, bias=bias)
            self.o_proj = nn.Linear(q, dim, bias=False)
        self.mask = None  # an explicit attn_mask instead of is_causal

    def forward(self, x):
        b, t, _ = x.shape
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        if self.fused:
            q, k, v = self.qkv_linear.wqkv(x).split([h * d, hk * d, hk * d], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (y.view(b, t, -1, d).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(
            rope(q),
            rope(k),
            v,
            attn_mask=self.mask,
            is_causal=self.mask is None,
            enable_gqa=hk != h,
        )
        out = self.wo if self.fused else self.o_proj
        return out(y.transpose(1, 2).reshape(b, t, -1))


class MLA(nn.Module):
    """DeepSeek-V3-like multi-head latent attention (transformers' names, no q LoRA)."""

    def __init__(self, dim=16, n_heads=3, nope=4, rope_dim=2, v_dim=5, kv_lora=6):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim = n_heads, nope
        self.qk_rope_head_dim, self.v_head_dim, self.kv_lora = rope_dim, v_dim, kv_lora
        self.q_proj = nn.Linear(dim, n_heads * (nope + rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora + rope_dim, bias=False)
        self.kv_b_proj = nn.Linear(kv_lora, n_heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h, n, r, v = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self.q_proj(x).view(b, t, h, n + r).transpose(1, 2)
        q_nope, q_rope = q.split([n, r], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, r], -1)
        kv = self.kv_b_proj(latent).view(b, t, h, n + v).transpose(1, 2)
        k_nope, value = kv.split([n, v], -1)
        k_rope = rope(k_rope[:, None]).expand(b, h, t, r)
        q = torch.cat([q_nope, rope(q_rope)], -1)
        k = torch.cat([k_nope, k_rope], -1)
        y = F.scaled_dot_product_attention(q, k, value, is_causal=True, scale=(n + r) ** -0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h * v))


def _grown(model, seed=0):
    """Random weights large enough for logits of several units (float64)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.6)
    return model


# ---------------------------------------------------------------------- the fallback
@given(
    batch=st.integers(1, 2),
    n_kv=st.integers(1, 3),
    rep=st.integers(1, 3),
    length=st.integers(1, 19),
    keys=st.integers(1, 19),
    e=st.sampled_from([2, 5, 8]),
    mask=st.sampled_from(["none", "causal", "bool", "float"]),
    block=st.integers(1, 400),
    seed=st.integers(0, 2**16),
)
def test_max_logits_equal_the_dense_float64_reference(
    batch, n_kv, rep, length, keys, e, mask, block, seed
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_kv * rep, length, e, generator=g) * 3
    k = torch.randn(batch, n_kv, keys, e, generator=g) * 3
    attn_mask = None
    if mask in ("bool", "float"):
        keep = torch.rand(batch, 1, length, keys, generator=g) > 0.4
        low = torch.finfo(torch.float32).min  # transformers' masked value (or -inf)
        attn_mask = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, low)
    kwargs = dict(is_causal=mask == "causal", attn_mask=attn_mask, scale=0.7 if e == 5 else None)
    got = max_logits(q, k, block_elements=block, **kwargs)
    want = dense_max(q, k, **kwargs)
    assert got.dtype == torch.float32 and got.shape == (n_kv * rep,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["mha", "gqa", "fused", "mla", "explicit_mask"])
def test_the_collected_maxima_are_the_dense_maxima_of_what_reaches_sdpa(kind):
    model = _model(kind)
    clip = QKClip(model, tau=1e6)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    model(x)
    (want,) = reference_max(model, x)
    torch.testing.assert_close(clip.attentions[0].running.double(), want, rtol=1e-6, atol=1e-6)
    model.eval()  # eval forwards are not collected
    model(x * 5)
    torch.testing.assert_close(clip.attentions[0].running.double(), want, rtol=1e-6, atol=1e-6)


def _model(kind):
    if kind == "mla":
        return _grown(MLA().double())
    if kind == "explicit_mask":
        att = _grown(Attention(n_kv=2).double())
        att.mask = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.3
        return att
    n_kv = {"mha": 4, "gqa": 2, "fused": 2}[kind]
    return _grown(Attention(n_kv=n_kv, fused=kind == "fused", bias=kind == "mha").double())


# ---------------------------------------------------------------------- the rescale
def _expected(model, kind, gamma):
    """The weights after the clip, head by head (the documented rules), float64."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for h, g in enumerate(gamma.tolist()):
        if kind == "mla":
            n, r, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
            q0, kv0 = h * (n + r), h * (n + v)
            out["q_proj.weight"][q0 : q0 + n] *= math.sqrt(g)
            out["q_proj.weight"][q0 + n : q0 + n + r] *= g
            out["kv_b_proj.weight"][kv0 : kv0 + n] *= math.sqrt(g)
            continue
        d, mha = model.head_dim, model.n_kv_heads == model.n_heads
        rows = slice(h * d, (h + 1) * d)
        k_rows = slice(model.n_heads * d + h * d, model.n_heads * d + (h + 1) * d)
        for suffix in ("weight", "bias"):
            q_name = f"qkv_linear.wqkv.{suffix}" if model.fused else f"q_proj.{suffix}"
            k_name = f"qkv_linear.wqkv.{suffix}" if model.fused else f"k_proj.{suffix}"
            if q_name not in out:
                continue
            out[q_name][rows] *= math.sqrt(g) if mha else g
            if mha:
                out[k_name][k_rows if model.fused else rows] *= math.sqrt(g)
    return out


@pytest.mark.parametrize("kind", ["mha", "gqa", "fused", "mla", "fused_mha"])
def test_the_rescale_brings_every_clipped_head_to_tau_and_leaves_the_others(kind):
    if kind == "fused_mha":
        model, kind = _grown(Attention(n_kv=4, fused=True).double()), "fused"
    else:
        model = _model(kind)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    clip = QKClip(model, tau=1e6)
    model(x)
    (before,) = reference_max(model, x)
    tau = float(before.median())  # about half the heads above it
    clip.tau = tau
    fire = before > tau
    assert 0 < int(fire.sum()) < len(before)
    gamma = torch.where(fire, tau / before, torch.ones_like(before))
    expected = _expected(model, kind, gamma)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert clip.apply() == int(fire.sum())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-6, atol=0, msg=name)
        untouched = expected[name] == old[name]  # rows the rule leaves alone: bit-equal
        assert torch.equal(p.detach()[untouched], old[name][untouched]), name
    (after,) = reference_max(model, x)
    assert (after <= tau * (1 + 1e-6)).all()
    torch.testing.assert_close(after[fire], torch.full_like(after[fire], tau), rtol=1e-6, atol=0)
    assert torch.equal(after[~fire], before[~fire])  # their q and k did not change
    assert clip.clipped.tolist() == fire.long().tolist()


def test_a_compiled_forward_collects_the_same_maxima_without_recompiling():
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    model = _model("gqa")
    clip = QKClip(model, tau=1e6)
    compiled = torch.compile(model, backend="eager")  # Dynamo's tracing and guards only
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for step in range(5):
        if step == 2:  # compiled before and after the maxima's tensor exists: no more after
            counters.clear()
        compiled(x * (1 + step))
        got = clip.attentions[0].running.clone()
        (want,) = reference_max(model, x * (1 + step))
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        clip.apply()
    assert counters["stats"]["unique_graphs"] == 0
    torch.compiler.reset()


def test_nothing_above_tau_is_a_no_op():
    model = _model("gqa")
    clip = QKClip(model, tau=1e6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(2, 7, 16, dtype=torch.float64))
    assert clip.apply() == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert clip.steps == 1 and clip.clipped.sum() == 0 and (clip.last_max < 1e6).all()


def test_what_it_cannot_clip_raises_naming_the_fix():
    with pytest.raises(ValueError, match="no attention module recognised"):
        QKClip(nn.Linear(4, 4), tau=10.0)
    with pytest.raises(ValueError, match="tau"):
        QKClip(_model("gqa"), tau=0)
    qk_norm = _model("gqa")
    qk_norm.q_norm, qk_norm.k_norm = nn.RMSNorm(4), nn.RMSNorm(4)
    with pytest.raises(ValueError, match="QK-norm"):
        QKClip(qk_norm, tau=10.0)
    clip = QKClip(_model("gqa"), tau=10.0)
    with pytest.raises(ValueError, match="not one of"):
        clip.observe(nn.Linear(2, 2), torch.zeros(4))


def test_kernel_reported_maxima_are_observed_like_the_fallbacks():
    """FlexAttention's ``aux.max_scores`` is ``(B, H, L)``: per head its max over B and L."""
    model = _model("gqa")
    clip = QKClip(model, tau=2.0)
    scores = torch.tensor([[[1.0, 3.0], [0.5, 1.0], [2.5, -1.0], [1.0, 1.0]]])  # (1, 4, 2)
    clip.observe(model, scores)
    clip.observe("", torch.tensor([0.0, 2.0, 1.0, 4.0]))  # by name ("" for the root)
    assert clip.apply() == 3
    assert clip.last_max.tolist() == [3.0, 2.0, 2.5, 4.0]


# ---------------------------------------------------------------------- training
class Tiny(nn.Module):
    def __init__(self, dim=16, layers=1):
        super().__init__()
        self.layers = nn.ModuleList(Attention(dim, n_kv=2) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x):
        for attention, mlp in zip(self.layers, self.mlp):
            x = x + attention(F.rms_norm(x, x.shape[-1:]))
            x = x + mlp(F.rms_norm(x, x.shape[-1:]))
        return x


def _train(tau, steps=8, lr=0.12):
    torch.manual_seed(0)
    model = Tiny()
    opt = dmuon.Muon(model, lr=lr, compile=False)
    clip = QKClip(model, tau if tau is not None else 1e30).attach(opt)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    maxima = []
    for _ in range(steps):
        model(x).square().mean().neg().backward()  # pushes the activations (and logits) up
        opt.step()
        opt.zero_grad()
        maxima.append(float(clip.last_max.max()))
    return model, opt, clip, maxima, x


def test_a_run_whose_logits_grow_stays_near_tau_with_the_clip():
    control, _, _, grown, x = _train(None)
    tau = 1.5 * grown[0]
    model, _, clip, clipped, _ = _train(tau)
    assert grown[-1] > 2 * tau  # the control's logits run away
    first = next(i for i, m in enumerate(clipped) if m > tau)
    # after a clip, a step's own update moves the logits by little: within a small margin
    assert max(clipped[first + 1 :]) <= 1.35 * tau
    assert clip.clipped.sum() > 0
    diff = max((p - q).abs().max() for p, q in zip(model.parameters(), control.parameters()))
    assert diff > 1e-2
    # and the clip itself: the logits of the last batch come back to tau (of the first layer
    # of a stack: a clipped layer changes the inputs of the layers after it)
    model(x)
    clip.apply()
    assert float(reference_max(model, x)[0].max()) <= tau * (1 + 1e-5)


def test_the_state_rides_in_the_optimizer_state_dict():
    _, opt, clip, _, _ = _train(tau=1.0, steps=3)
    sd = opt.state_dict()
    assert sd["qk_clip"]["steps"] == 3 and sd["qk_clip"]["clipped"].sum() > 0
    model = Tiny()
    fresh_opt = dmuon.Muon(model, lr=0.05, compile=False)
    fresh = QKClip(model, tau=7.0).attach(fresh_opt)
    fresh_opt.load_state_dict(sd)
    assert "qk_clip" in sd  # the caller's dict keeps it
    assert fresh.tau == 1.0 and fresh.steps == 3
    assert torch.equal(fresh.clipped, clip.clipped) and torch.equal(fresh.last_max, clip.last_max)
    assert "qk_clip" not in fresh_opt.param_groups[0]
    with pytest.raises(ValueError, match="attention heads"):
        QKClip(Tiny(layers=2), tau=1.0).load_state_dict(sd["qk_clip"])


def test_muon_qk_clip_option_is_the_attached_clip():
    """``Muon(model, qk_clip=τ)`` runs the same clip as ``QKClip(model, τ).attach(opt)``."""
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    runs = []
    for by_option in (True, False):
        torch.manual_seed(0)
        model = Tiny()
        opt = dmuon.Muon(model, lr=0.12, compile=False, qk_clip=0.5 if by_option else None)
        clip = opt.qk_clip if by_option else QKClip(model, 0.5).attach(opt)
        for _ in range(3):
            model(x).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
        assert clip.clipped.sum() > 0 and "qk_clip" in opt.state_dict()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs the model"):
        dmuon.Muon(list(Tiny().parameters()), qk_clip=1.0)
