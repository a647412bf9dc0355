"""QK-clip's automatic max logits under FlexAttention (``dmuon_compile/qk_clip.py``,
``qk_logits.max_logits_flex``), on the CPU.

- ``max_logits_flex`` (query blocks, the block mask's ``mask_mod`` vmapped per block, its
  block sparsity, a ``score_mod``'s ``-inf`` positions) against a float64 dense reference over
  shapes, GQA ratios, causal / sliding-window / document / head-dependent masks, block sizes
  and score_mods; the op's own arguments (``as_tuple()``) give the same.
- A model calling ``flex_attention`` directly: every layer's maxima collected from the op's
  call, equal to the dense reference of that forward's q and k; the clip brings the batch to
  ``tau``.
- torchtitan's Llama-3 debug model with its ``FlexAttention`` (block-causal document mask from
  packed positions, fused ``wqkv``): forward, backward and a Muon step collect every layer's
  maxima through the wrapper's pre-hook; the clip fires and brings the same batch's clipped
  heads to ``tau``. CPU workaround: FlexAttention has no backward on the CPU, so the training
  test runs the kernel as a dense masked softmax (same wrapper, q, k and BlockMask); the
  forward-only test runs the real kernel (eager ``flex_attention``, no Inductor build).
- Control: with the FlexAttention interception taken away, the same model records nothing and
  warns.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention.flex_attention import (
    create_block_mask,
    create_mask,
    flex_attention,
)

import dmuon_compile as dmuon
from dmuon_compile import qk_clip as qk_clip_module
from dmuon_compile import qk_logits
from dmuon_compile.qk_clip import QKClip
from dmuon_compile.qk_logits import max_logits_flex, max_logits_of_flex_call

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


# ---------------------------------------------------------------------- the reference
def dense_max(q, k, *, mask_mod=None, score_mod=None, scale=None):
    """Per q head, the max of q·kᵀ·scale where ``mask_mod`` holds and ``score_mod`` is not
    ``-inf``: the whole score matrix in float64."""
    q, k = q.double(), k.double()
    b, h, length, e = q.shape
    keys = k.shape[2]
    k = k.expand(b, -1, -1, -1).repeat_interleave(h // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (e**-0.5 if scale is None else scale)
    keep = torch.ones(s.shape, dtype=torch.bool)
    if mask_mod is not None:
        keep &= create_mask(mask_mod, b, h, length, keys, device="cpu")
    if score_mod is not None:
        idx = torch.meshgrid(*(torch.arange(n) for n in s.shape), indexing="ij")
        keep &= ~torch.isneginf(score_mod(s, *idx))
    return s.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3))


def _mask_mod(kind, window, docs):
    if kind == "causal":
        return lambda b, h, i, j: j <= i
    if kind == "window":
        return lambda b, h, i, j: (j <= i) & (i - j < window)
    if kind == "document":  # block-causal within each batch row's documents
        return lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (j <= i)
    if kind == "heads":  # even heads see everything, odd heads are causal
        return lambda b, h, i, j: (h % 2 == 0) | (j <= i)
    return None


SCORE_MODS = {
    "none": None,
    "softcap": lambda s, b, h, i, j: 4.0 * torch.tanh(s / 4.0),  # changes scores, hides none
    "hide_every_third_key": lambda s, b, h, i, j: torch.where(j % 3 == 0, -math.inf, s),
}


@given(
    batch=st.integers(1, 2),
    n_kv=st.integers(1, 3),
    rep=st.integers(1, 3),
    length=st.integers(1, 24),
    other_keys=st.one_of(st.none(), st.integers(1, 24)),
    e=st.sampled_from([2, 5, 8]),
    kind=st.sampled_from(["none", "causal", "window", "document", "heads"]),
    window=st.integers(1, 6),
    block_size=st.sampled_from([2, 4, 128]),
    score=st.sampled_from(sorted(SCORE_MODS)),
    rows=st.sampled_from([3, 7, 1000]),  # query rows per block of the blockwise way
    seed=st.integers(0, 2**16),
)
def test_the_blockwise_masked_max_equals_the_dense_float64_reference(
    batch, n_kv, rep, length, other_keys, e, kind, window, block_size, score, rows, seed
):
    g = torch.Generator().manual_seed(seed)
    keys = length if other_keys is None or kind != "none" else other_keys
    q = torch.randn(batch, n_kv * rep, length, e, generator=g) * 3
    k = torch.randn(batch, n_kv, keys, e, generator=g) * 3
    docs = torch.cumsum(torch.rand(batch, length, generator=g) < 0.25, dim=1)
    mask_mod = _mask_mod(kind, window, docs)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(
            mask_mod,
            batch if kind == "document" else None,
            n_kv * rep if kind == "heads" else None,
            length,
            keys,
            device="cpu",
            BLOCK_SIZE=block_size,
        )
    score_mod, scale = SCORE_MODS[score], 0.7 if e == 5 else None
    block_elements = rows * batch * n_kv * rep * keys
    got = max_logits_flex(
        q, k, block_mask=block_mask, score_mod=score_mod, scale=scale, block_elements=block_elements
    )
    want = dense_max(q, k, mask_mod=mask_mod, score_mod=score_mod, scale=scale)
    assert got.dtype == torch.float32 and got.shape == (n_kv * rep,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", ["none", "hide_every_third_key"])
def test_the_ops_own_arguments_give_the_same_maxima(score):
    """What the mode sees, ``flex_attention``'s op call (the block mask as its
    ``as_tuple()``, the score_mod's captured buffers), gives what ``max_logits_flex`` gives."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 4, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    mask_mod = _mask_mod("document", 0, docs)
    block_mask = create_block_mask(mask_mod, 2, None, 12, 12, device="cpu", BLOCK_SIZE=4)
    score_mod = SCORE_MODS[score]
    want = max_logits_flex(q, k, block_mask=block_mask, score_mod=score_mod, scale=0.3)
    args = (q, k, torch.zeros(2, 2, 12, 1), score_mod, block_mask.as_tuple(), 0.3, {}, (), ())
    assert torch.equal(max_logits_of_flex_call(args, {}), want)
    # buffers handed to the mods as extra arguments (as a traced op call passes them)
    offset = torch.tensor(1)
    args = (
        q,
        k,
        args[2],
        lambda s, b, h, i, j, off: score_mod(s, b, h, i, j) if score_mod else s + 0 * off,
        (*block_mask.as_tuple()[:-1], lambda b, h, i, j, d: d[b, i] == d[b, j]),
        0.3,
        {},
        (offset,),
        (docs,),
    )
    got = max_logits_of_flex_call(args, {})
    causal_free = max_logits_flex(
        q,
        k,
        block_mask=create_block_mask(
            lambda b, h, i, j: docs[b, i] == docs[b, j], 2, None, 12, 12, "cpu", BLOCK_SIZE=4
        ),
        score_mod=score_mod,
        scale=0.3,
    )
    torch.testing.assert_close(got, causal_free, rtol=0, atol=0)


def test_unsupported_inputs_raise_naming_the_fix():
    q, k = torch.randn(1, 4, 8, 4), torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="heads must divide"):
        max_logits_flex(q, k)
    causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="build it for these lengths"):
        max_logits_flex(q, k[:, :2], block_mask=causal)
    with pytest.raises(ValueError, match="clip.observe"):
        max_logits_of_flex_call((q, k, k, None, ("not", "a", "block", "mask"), 0.5, {}), {})


# ---------------------------------------------------------------------- direct flex_attention
def _soft_window(s, b, h, i, j):  # a score_mod: a bias, and the first key hidden
    return torch.where(j == 0, -math.inf, s - 0.1 * (i - j))


def _window(b, h, i, j):
    return (j <= i) & (i - j < 5)


class FlexAttentionLayer(nn.Module):
    """q/k/v/o projections, grouped-query heads, ``flex_attention`` called directly."""

    def __init__(self, dim=16, n_heads=4, n_kv=2, head_dim=4):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.seen = []  # (q, k) of each forward: the reference's inputs

    def forward(self, x, block_mask):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        self.seen.append((q.detach(), k.detach()))
        y = flex_attention(q, k, v, score_mod=_soft_window, block_mask=block_mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class FlexStack(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(FlexAttentionLayer() for _ in range(layers))

    def forward(self, x, block_mask):
        for layer in self.layers:
            x = x + layer(x, block_mask)
        return x


def test_direct_flex_attention_calls_are_collected_and_clipped():
    """Each layer's maxima come from its ``flex_attention`` op call (block mask and score_mod
    honoured), equal to the dense reference of its q and k; a clip with ``tau`` between the
    first layer's maxima brings that layer's clipped heads to ``tau`` on the same batch."""
    torch.manual_seed(0)
    model = FlexStack()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # logits of several units
    clip = QKClip(model, tau=1e6)
    mask = create_block_mask(_window, None, None, 24, 24, device="cpu", BLOCK_SIZE=8)
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1))

    def forward():  # training mode; the CPU kernel has no backward: no autograd graph
        for layer in model.layers:
            layer.seen.clear()
        with torch.no_grad():
            model(x, mask)
        return [
            dense_max(q, k, mask_mod=_window, score_mod=_soft_window)
            for q, k in (layer.seen[0] for layer in model.layers)
        ]

    want = forward()
    ordered = want[0].sort().values
    clip.tau = float(ordered[1] + ordered[2]) / 2  # two heads of the first layer above
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="QKClip")  # no "ran forward without"
        assert clip.apply() >= 2
    got = clip.max_logits()
    for name, w in zip(("layers.0", "layers.1"), want):
        torch.testing.assert_close(got[name].double(), w, rtol=1e-5, atol=1e-5)
    fired = want[0] > clip.tau
    after = forward()
    torch.testing.assert_close(after[0][fired], torch.full_like(after[0][fired], clip.tau))
    assert torch.equal(after[0][~fired], want[0][~fired])  # their q and k did not change


# ---------------------------------------------------------------------- torchtitan
SEQ, BATCH = 16, 2


def _titan_model(monkeypatch, kernel, layers=2):
    """torchtitan's Llama-3 debug model (``layers`` of its layers) with its default inner
    attention, FlexAttention, built and initialised on the CPU. ``kernel`` replaces the
    wrapper's compiled ``flex_attention`` (no Inductor build on the CPU); its masks are built
    by its own code with ``create_block_mask`` uncompiled (the same BlockMask, 4 s sooner)."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common import decoder
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(kernel))
    monkeypatch.setattr(decoder, "create_attention_mask", create_block_mask)

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    assert all(
        isinstance(x.attention.inner_attention, FlexAttention.Config) for x in spec.model.layers
    )
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _titan_batch(step=0):
    """Tokens and packed positions (two documents per row: 6 and 10 tokens), the document
    block-causal ``BlockMask`` torchtitan's trainer builds from them."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    positions = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).repeat(BATCH, 1)
    return tokens, positions


def _titan_loss(model, tokens, positions):
    masks = model.get_attention_masks(positions=positions)
    logits = model(tokens[:, :-1], positions=positions, attention_masks=masks)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _dense_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's result as a dense masked softmax (the CPU kernel has no backward)."""
    assert score_mod is None
    keep = create_mask(block_mask.mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], "cpu")
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, -math.inf)
    return s.softmax(-1) @ v, None


def _capture_inner(model):
    """Each layer's q and k (``(B, N, L, H)``) and BlockMask as its FlexAttention gets them."""
    seen = {}

    def hook(name):
        def pre(module, args, kwargs):
            q, k = (t.detach().transpose(1, 2) for t in args[:2])
            seen[name] = (q, k, kwargs["attention_masks"], kwargs.get("scale"))

        return pre

    for name, layer in model.layers.items():
        layer.attention.inner_attention.register_forward_pre_hook(
            hook(f"layers.{name}.attention"), with_kwargs=True
        )
    return seen


def _dense_of(seen):
    return {
        name: dense_max(q, k, mask_mod=mask.mask_mod, scale=scale)
        for name, (q, k, mask, scale) in seen.items()
    }


def test_torchtitan_flex_model_trains_with_the_maxima_collected_and_clipped(monkeypatch):
    """torchtitan's FlexAttention, forward/backward/Muon step with ``QKClip`` attached: every
    step collects every layer's maxima (the wrapper's pre-hook: its q, k and BlockMask), equal
    to the dense reference of that forward's q and k under the document mask; the clip fires;
    after one more clip, the first layer's clipped heads are at ``tau`` on the same batch, the
    others unchanged."""
    model = _titan_model(monkeypatch, _dense_flex)
    seen = _capture_inner(model)
    opt = dmuon.Muon(model, lr=0.02, compile=False)
    clip = QKClip(model, tau=1e9).attach(opt)
    tokens, positions = _titan_batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="QKClip")  # no "ran forward without"
        for step in range(2):
            _titan_loss(model, tokens, positions).backward()
            want = _dense_of(seen)
            opt.step()  # then the clip
            opt.zero_grad()
            got = clip.max_logits()
            assert got.keys() == want.keys() and len(want) == 2
            for name, w in want.items():
                torch.testing.assert_close(got[name].double(), w, rtol=1e-5, atol=1e-5)
            if step == 0:  # tau between the middle heads of the first layer
                ordered = want["layers.0.attention"].sort().values
                clip.tau = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    assert clip.clipped.sum() > 0
    # The clip alone (no step between): the same batch's clipped heads come to tau.
    with torch.no_grad():
        _titan_loss(model, tokens, positions)
    before = _dense_of(seen)["layers.0.attention"]
    fired = before > clip.tau
    assert 0 < int(fired.sum()) < len(before)
    clip.apply()
    with torch.no_grad():
        _titan_loss(model, tokens, positions)
    after = _dense_of(seen)["layers.0.attention"]
    assert (after <= clip.tau * (1 + 1e-5)).all()
    torch.testing.assert_close(after[fired], torch.full_like(after[fired], clip.tau))
    torch.testing.assert_close(after[~fired], before[~fired], rtol=0, atol=0)


def test_torchtitan_flex_kernel_forward_is_collected_once_per_layer(monkeypatch):
    """The real FlexAttention op inside torchtitan's wrapper (forward only: no CPU backward):
    the maxima equal the dense reference, recorded once per layer (the op's own call inside
    the hooked wrapper is not recomputed)."""
    model = _titan_model(monkeypatch, flex_attention)
    seen = _capture_inner(model)
    clip = QKClip(model, tau=1e9)
    calls = []
    real = qk_clip_module.max_logits_of_flex_call
    monkeypatch.setattr(
        qk_clip_module, "max_logits_of_flex_call", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    tokens, positions = _titan_batch()
    with torch.no_grad():
        _titan_loss(model, tokens, positions)
    assert [a.records for a in clip.attentions] == [1, 1] and calls == []
    want = _dense_of(seen)
    clip.apply()
    for name, w in want.items():
        torch.testing.assert_close(clip.max_logits()[name].double(), w, rtol=1e-5, atol=1e-5)
    # the document mask matters: causal alone lets some heads see a larger logit
    q, k, _, scale = seen["layers.0.attention"]
    causal = dense_max(q, k, mask_mod=lambda b, h, i, j: j <= i, scale=scale)
    assert (causal > want["layers.0.attention"] + 1e-6).any()


def test_control_without_the_flex_interception_nothing_is_collected(monkeypatch):
    """The same forward with the FlexAttention interception taken away (as before it existed):
    no maxima, no clip, and the "ran forward without" warning."""
    monkeypatch.setattr(qk_clip_module, "_flex_wrappers", lambda module: [])
    monkeypatch.setattr(qk_clip_module, "_flex_op", lambda: None)
    model = _titan_model(monkeypatch, flex_attention)
    clip = QKClip(model, tau=1e-3)  # every head would clip
    tokens, positions = _titan_batch()
    with torch.no_grad():
        _titan_loss(model, tokens, positions)
    with pytest.warns(UserWarning, match="ran forward without"):
        assert clip.apply() == 0
    assert torch.isneginf(clip.last_max).all()


def test_max_logits_flex_block_elements_bounds_each_block(monkeypatch):
    """Never the whole score matrix: each block of scores holds at most ``block_elements``."""
    sizes = []
    real = qk_logits._scores
    monkeypatch.setattr(
        qk_logits,
        "_scores",
        lambda qb, kb, w: sizes.append(qb.shape[1] * kb.shape[1] * qb.shape[0]) or real(qb, kb, w),
    )
    q, k = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8)
    causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, 32, 32, device="cpu")
    max_logits_flex(q, k, block_mask=causal, block_elements=2 * 4 * 32 * 5)
    assert len(sizes) == 7 and max(sizes) <= 2 * 4 * 32 * 5


# ---------------------------------------------------------------------- CUDA: the fused path
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "causal", "window", "document", "heads"])
@pytest.mark.parametrize("score", ["none", "softcap", "hide_every_third_key"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_cuda_fused_max_scores_equal_the_float64_reference(kind, score, hkv):
    """FlexAttention's fused max scores (bf16 q, k on CUDA) give the raw ``q·kᵀ·scale`` maxima
    of the attended positions: the float64 reference within bf16's rounding, and the fused way
    really ran (no fallback warning, not turned off)."""
    # Each case brings new mask_mod / score_mod code: a fresh Dynamo cache keeps the compiled
    # kernel under its recompile limit (past it Dynamo would run flex_attention eagerly).
    torch._dynamo.reset()
    qk_logits._FLEX.update(failed=False, fn=None)
    gen = torch.Generator().manual_seed(7)
    b, hq, length, e = 2, 4, 256, 64
    q = torch.randn(b, hq, length, e, generator=gen).mul_(3.0)
    k = torch.randn(b, hkv, length, e, generator=gen)
    docs = torch.randint(0, 3, (b, length), generator=gen).sort(dim=1).values
    mask_mod = _mask_mod(kind, 48, docs.cuda())
    ref = dense_max(q, k, mask_mod=_mask_mod(kind, 48, docs), score_mod=SCORE_MODS[score])
    qc, kc = q.cuda().bfloat16(), k.cuda().bfloat16()
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, b, hq, length, length, device="cuda")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="QK-clip")  # our fallback's warning
        got = max_logits_flex(qc, kc, block_mask=bm, score_mod=SCORE_MODS[score])
    assert not qk_logits._FLEX["failed"], "the fused way fell back to the blockwise one"
    assert got.device.type == "cuda" and got.dtype == torch.float32
    # bf16 q, k: each score within ~2^-8 of its magnitude (|s| <~ 3·8)
    torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-2, atol=0.25)
    blockwise = max_logits_flex(qc, kc, block_mask=bm, score_mod=SCORE_MODS[score], flex=False)
    torch.testing.assert_close(got, blockwise, rtol=2e-2, atol=0.25)


@pytest.mark.gpu
def test_cuda_sdpa_causal_max_logits_through_flex_equal_the_blockwise_way():
    """``max_logits(is_causal=True)`` on CUDA (the SDPA path, through a causal BlockMask) equals
    the blockwise way and the float64 reference."""
    torch._dynamo.reset()
    qk_logits._FLEX.update(failed=False, fn=None)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 200, 64, generator=gen).mul_(2.0)
    k = torch.randn(2, 2, 200, 64, generator=gen)
    ref = dense_max(q, k, mask_mod=_mask_mod("causal", 0, None))
    qc, kc = q.cuda().bfloat16(), k.cuda().bfloat16()
    got = qk_logits.max_logits(qc, kc, is_causal=True)
    assert not qk_logits._FLEX["failed"], "the fused way fell back to the blockwise one"
    torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-2, atol=0.25)
    torch.testing.assert_close(got, qk_logits.max_logits(qc, kc, is_causal=True, flex=False))


def test_past_the_recompile_limit_the_fused_way_hands_over_instead_of_running_eagerly(
    monkeypatch,
):
    """``_flex_max`` calls its compiled kernel where Dynamo raises past its recompile limit
    (else the kernel would run eagerly, holding every score): the failure turns the fused way
    off with the warning, and the blockwise way answers. Control: outside that context the same
    compiled function runs eagerly past the limit, silently."""
    from dmuon_compile._compat import no_eager_after_recompile_limit

    def recompiles(context) -> bool:
        torch._dynamo.reset()
        double = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
        with torch._dynamo.config.patch(recompile_limit=2), context:
            try:
                for n in range(1, 5):  # a new shape each call
                    double(torch.ones(n))
            except Exception as exc:  # noqa: BLE001 - the type is Dynamo's
                return type(exc).__name__ == "FailOnRecompileLimitHit"
        return False

    assert recompiles(no_eager_after_recompile_limit())
    assert not recompiles(contextlib.nullcontext())  # control: eager past the limit

    seen = {}

    def limited(*args, **kwargs):  # the compiled kernel at its limit, under _flex_max's context
        seen["fail"] = torch._dynamo.config.fail_on_recompile_limit_hit
        raise RuntimeError("recompile limit")

    monkeypatch.setitem(qk_logits._FLEX, "fn", limited)
    monkeypatch.setitem(qk_logits._FLEX, "failed", False)
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    with pytest.warns(UserWarning, match="max scores failed"):
        assert qk_logits._flex_max(q, k, 0.5, None, None) is None
    assert seen["fail"] is True and qk_logits._FLEX["failed"]
    torch.testing.assert_close(
        max_logits_flex(q, k).double(), dense_max(q, k), rtol=1e-6, atol=1e-6
    )
