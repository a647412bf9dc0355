"""Each attention head's max pre-softmax logit ``q·kᵀ·scale``, from the ``q`` and ``k`` that
reach an attention kernel: what QK-clip (``qk_clip.py``) bounds.

:func:`max_logits` takes what ``scaled_dot_product_attention`` takes (causal, ``attn_mask``);
:func:`max_logits_flex` what FlexAttention takes (a ``BlockMask``, a ``score_mod``). Two ways,
one result (per q head, float32):

- on CUDA: FlexAttention's fused kernel with ``return_aux=AuxRequest(max_scores=True)`` (torch
  2.11 and 2.13; CUDA only there) and a 16-wide zero ``v``, under the same block mask: one pass
  over the scores, none of them in memory (SDPA calls with an ``attn_mask`` take the other way);
- otherwise (the CPU, an SDPA ``attn_mask``, or where FlexAttention fails — past Dynamo's
  recompile limit too, where the compiled kernel would run eagerly: it warns once):
  query blocks of ``q @ kᵀ`` accumulated in fp32 (the matmul's fp32 output for half inputs on
  CUDA), at most ``block_elements`` scores at a time; under a causal mask the keys every row of
  a block attends are taken without a mask, the diagonal part with one; under a block mask its
  ``mask_mod`` is evaluated on each block's indices (vmapped, as ``create_mask`` does) and its
  block sparsity applied, as the kernel does. Every ``q·k`` pair is computed (blocks the mask
  skips are not skipped here).

The logit is the raw ``q·kᵀ·scale``: a ``score_mod`` (softcap, ALiBi, ...) does not change it,
only the positions it sends to ``-inf`` are left out (they take no part in the softmax). That
is the logit the clip's ``W_q``/``W_k`` scaling moves linearly (MuonClip's definition).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_compile._compat import no_eager_after_recompile_limit

# Query-block size of the blockwise way: at most this many fp32 scores per block (64 MiB).
BLOCK_ELEMENTS = 1 << 24
_FLEX: dict = {"fn": None, "masks": {}, "failed": False}
_OUT_DTYPE = [True]  # bmm(out_dtype=) works here (turned off at its first failure)
# The flex_attention higher-order op's arguments, in its order (torch 2.11 and 2.13).
FLEX_HOP_ARGS = (
    "query",
    "key",
    "value",
    "score_mod",
    "block_mask",
    "scale",
    "kernel_options",
    "score_mod_other_buffers",
    "mask_mod_other_buffers",
)


def max_logits(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
    block_elements: int = BLOCK_ELEMENTS,
    flex: bool = True,
) -> Tensor:
    """Per q head, the max over batch, queries and the keys it attends of ``q·kᵀ·scale``:
    float32 ``(Hq,)`` (``-inf`` for a head that attends nothing).

    ``q``: ``(..., Hq, L, E)``, ``k``: ``(..., Hkv, S, E)`` as
    ``scaled_dot_product_attention`` takes them; ``Hkv`` divides ``Hq`` (q head ``h`` reads kv
    head ``h // (Hq / Hkv)``, as ``enable_gqa`` and transformers' ``repeat_kv``). ``scale``:
    default ``1/√E``. ``is_causal``: query ``i`` attends keys ``j ≤ i`` (top-left, as SDPA).
    ``attn_mask``: a bool mask (True: attends) or a float one, broadcastable to
    ``(..., Hq, L, S)``; a float mask's values are not added (QK-clip bounds ``q·kᵀ·scale``),
    positions it masks out (``-inf`` or the dtype's minimum) are left out. Under ``no_grad``;
    accumulated in fp32 (float64 inputs: in float64). ``flex=False``: the blockwise way only.

    >>> q, k = torch.ones(1, 2, 3, 4), torch.ones(1, 1, 3, 4)
    >>> max_logits(q, k)
    tensor([2., 2.])
    """
    hq, e, hkv = q.shape[-3], q.shape[-1], k.shape[-3]
    if hq % hkv:
        raise ValueError(f"max_logits: {hkv} kv heads do not divide {hq} q heads")
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    with torch.no_grad():
        if flex and attn_mask is None and q.is_cuda and not _FLEX["failed"]:
            length = q.shape[-2]
            q4, k4 = q.reshape(-1, hq, length, e), k.reshape(-1, hkv, k.shape[-2], e)
            mask = _causal_block_mask(length, k.shape[-2], q.device) if is_causal else None
            out = _flex_max(q4, k4, scale, mask, None)
            if out is not None:
                return out
        return _blockwise_max(q, k, scale, is_causal, attn_mask, block_elements)


def max_logits_flex(
    q: Tensor,
    k: Tensor,
    *,
    block_mask=None,
    score_mod: Callable | None = None,
    scale: float | None = None,
    block_elements: int = BLOCK_ELEMENTS,
    flex: bool = True,
) -> Tensor:
    """Per q head, the max of ``q·kᵀ·scale`` over the positions ``flex_attention(q, k, v,
    score_mod=score_mod, block_mask=block_mask, scale=scale)`` attends: float32 ``(Hq,)``
    (``-inf`` for a head that attends nothing).

    ``q``: ``(B, Hq, L, E)``, ``k``: ``(B or 1, Hkv, S, E)``, ``Hkv`` dividing ``Hq`` (as
    ``enable_gqa``). ``block_mask``: a ``BlockMask`` for ``(L, S)``, honoured as the kernel
    honours it: its ``mask_mod`` on the blocks it lists as partial, none on its full blocks,
    nothing on the blocks it leaves out. ``score_mod``: the logit is the raw ``q·kᵀ·scale``
    (what scaling ``W_q``/``W_k`` moves linearly; a softcap or a bias does not change it),
    positions the ``score_mod`` sends to ``-inf`` are left out. Never the whole score matrix:
    on CUDA FlexAttention's fused max scores under the same block mask, else query blocks of at
    most ``block_elements`` scores (the module docstring). ``flex=False``: the blockwise way.

    >>> from torch.nn.attention.flex_attention import create_block_mask
    >>> first_two = create_block_mask(lambda b, h, i, j: j < 2, None, None, 3, 3, device="cpu")
    >>> q, k = torch.ones(1, 2, 3, 4), torch.arange(3.0).view(1, 1, 3, 1).expand(1, 1, 3, 4)
    >>> max_logits_flex(q, k, block_mask=first_two)  # q·k_j = 4j, scale 1/2
    tensor([2., 2.])
    >>> max_logits_flex(q, k)
    tensor([4., 4.])
    """
    blocks = None if block_mask is None else _Blocks.of(block_mask)
    return _flex_logits(q, k, scale, blocks, score_mod, (), block_mask, block_elements, flex)


def max_logits_of_flex_call(args: tuple, kwargs: dict, **options) -> Tensor:
    """:func:`max_logits_flex` of one call of FlexAttention's higher-order op
    (``torch.ops.higher_order.flex_attention``, what ``flex_attention`` calls, compiled or not):
    its ``q``, ``k``, ``score_mod``, block mask (as its ``as_tuple()``), ``scale`` and the
    buffers its ``score_mod``/``mask_mod`` take. ``options``: ``block_elements``, ``flex``."""
    call = dict(zip(FLEX_HOP_ARGS, args), **kwargs)
    blocks = _Blocks.of_tuple(call["block_mask"], tuple(call.get("mask_mod_other_buffers", ())))
    score_buffers = tuple(call.get("score_mod_other_buffers", ()))
    return _flex_logits(
        call["query"],
        call["key"],
        call.get("scale"),
        blocks,
        call.get("score_mod"),
        score_buffers,
        None,
        options.get("block_elements", BLOCK_ELEMENTS),
        options.get("flex", True),
    )


class _Blocks(NamedTuple):
    """What a ``BlockMask`` tells the kernel: per q block, the kv blocks computed with the
    ``mask_mod`` (partial) and without it (full); every other block is skipped."""

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor | None
    full_kv_indices: Tensor | None
    block_size: tuple  # (q, kv)
    seq_lengths: tuple  # (L, S)
    mask_mod: Callable
    mask_buffers: tuple = ()

    @classmethod
    def of(cls, bm) -> _Blocks:
        return cls(
            bm.kv_num_blocks,
            bm.kv_indices,
            bm.full_kv_num_blocks,
            bm.full_kv_indices,
            tuple(bm.BLOCK_SIZE),
            tuple(bm.seq_lengths),
            bm.mask_mod,
        )

    @classmethod
    def of_tuple(cls, t: tuple, buffers: tuple = ()) -> _Blocks:
        """From ``BlockMask.as_tuple()``: ``(L, S, kv_num_blocks, kv_indices, full_kv_num_blocks,
        full_kv_indices, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)`` on torch 2.11 and 2.13
        (2.13 adds entries in the middle only)."""
        if not (isinstance(t, tuple) and len(t) >= 9 and callable(t[-1])):
            raise ValueError(
                "QK-clip: this torch's flex_attention op takes its block mask as "
                f"{type(t).__name__} of {len(t) if isinstance(t, tuple) else '?'} entries, not "
                "BlockMask.as_tuple()'s layout of torch 2.11-2.13: compute the maxima with "
                "max_logits_flex(q, k, block_mask=...) and hand them over with clip.observe"
            )
        return cls(t[2], t[3], t[4], t[5], (t[-3], t[-2]), (t[0], t[1]), t[-1], buffers)

    def block_mask(self):
        """A ``BlockMask`` of these blocks (for the fused kernel)."""
        from torch.nn.attention.flex_attention import BlockMask

        mask_mod, buffers = self.mask_mod, self.mask_buffers
        if buffers:

            def mask_mod(b, h, q_idx, kv_idx):
                return self.mask_mod(b, h, q_idx, kv_idx, *buffers)

        return BlockMask.from_kv_blocks(
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            BLOCK_SIZE=self.block_size,
            mask_mod=mask_mod,
            seq_lengths=self.seq_lengths,
        )


def _is_identity_score(score_mod) -> bool:
    """No score_mod, or FlexAttention's own identity (what it passes for none)."""
    return score_mod is None or (
        getattr(score_mod, "__name__", None) == "_identity"
        and getattr(score_mod, "__module__", None) == "torch.nn.attention.flex_attention"
    )


def _flex_logits(q, k, scale, blocks, score_mod, score_buffers, block_mask, block_elements, flex):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"max_logits_flex: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, H, L, E) "
            "as flex_attention takes them"
        )
    (batch, hq, length, e), (kb, hkv, keys) = q.shape, k.shape[:3]
    if hq % hkv or kb not in (1, batch):
        raise ValueError(
            f"max_logits_flex: k {tuple(k.shape)} does not fit q {tuple(q.shape)}: its heads "
            "must divide q's and its batch be q's or 1"
        )
    if blocks is not None and tuple(blocks.seq_lengths) != (length, keys):
        raise ValueError(
            f"max_logits_flex: the block mask is for (L, S) = {tuple(blocks.seq_lengths)}, "
            f"q and k have ({length}, {keys}): build it for these lengths"
        )
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    identity = _is_identity_score(score_mod)
    with torch.no_grad():
        if flex and q.is_cuda and not _FLEX["failed"]:
            if blocks is not None and block_mask is None:
                block_mask = blocks.block_mask()
            raw = None if identity else _raw_scores(score_mod, score_buffers)
            out = _flex_max(q, k, scale, block_mask, raw)
            if out is not None:
                return out
        if identity:
            score_mod = None
        return _masked_blockwise_max(q, k, scale, blocks, score_mod, score_buffers, block_elements)


def _raw_scores(score_mod, buffers):
    """A score_mod giving the raw score wherever ``score_mod`` does not give ``-inf``: the
    fused kernel's max scores are then the raw logits' max over the attended positions."""

    def raw(score, b, h, q_idx, kv_idx):
        hidden = torch.isneginf(score_mod(score, b, h, q_idx, kv_idx, *buffers))
        return torch.where(hidden, -math.inf, score)

    return raw


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _causal_block_mask(length: int, keys: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (length, keys, device)
    mask = _FLEX["masks"].get(key)
    if mask is None:
        mask = create_block_mask(_causal, None, None, length, keys, device=device)
        _FLEX["masks"][key] = mask
    return mask


def _flex_max(q: Tensor, k: Tensor, scale: float, block_mask, score_mod) -> Tensor | None:
    """The max logits from FlexAttention's ``max_scores`` (``q``, ``k``: 4-D), or ``None``
    where it cannot run (then the blockwise way; a failure warns once and turns this way
    off)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        if "max_scores" not in getattr(AuxRequest, "_fields", ()):
            _FLEX["failed"] = True
            return None
        if torch.compiler.is_compiling():
            fn = flex_attention  # traced into the caller's graph
            context = contextlib.nullcontext()
        else:
            fn = _FLEX["fn"] = _FLEX["fn"] or torch.compile(flex_attention, dynamic=False)
            # Past Dynamo's recompile limit (new shapes, masks, score_mods) the kernel would run
            # eagerly, materialising every score: raise instead, and the blockwise way follows.
            context = no_eager_after_recompile_limit()
        hq, hkv = q.shape[1], k.shape[1]
        v = q.new_zeros(k.shape[0], hkv, k.shape[2], 16)  # the kernel's P·V, as narrow as it goes
        with context:
            _, aux = fn(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=hq != hkv,
                return_aux=AuxRequest(max_scores=True),
            )
        return aux.max_scores.amax(dim=(0, 2)).float()
    except Exception as exc:  # noqa: BLE001 - any failure: the blockwise way is exact too
        _FLEX["failed"] = True
        warnings.warn(
            f"QK-clip: FlexAttention's max scores failed ({type(exc).__name__}: {exc}); the "
            "max logits are computed blockwise from now on (slower, same result)",
            stacklevel=3,
        )
        return None


def _masked_blockwise_max(q, k, scale, blocks, score_mod, score_buffers, block_elements):
    """Query blocks of ``q·kᵀ·scale`` (fp32), the block mask and the score_mod's ``-inf``
    positions applied per block."""
    batch, hq, length, e = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    rep = hq // hkv
    work = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(batch, hkv, rep, length, e)
    k3 = k.expand(batch, hkv, keys, e).reshape(batch * hkv, keys, e)
    dense = None if blocks is None else _dense_blocks(blocks, keys)
    block = max(1, min(length, block_elements // max(1, batch * hq * keys)))
    best = torch.full((hq,), -math.inf, dtype=work, device=q.device)
    for i0 in range(0, length, block):
        i1 = min(length, i0 + block)
        qb = q5[:, :, :, i0:i1].reshape(batch * hkv, rep * (i1 - i0), e)
        s = _scores(qb, k3, work).view(batch, hq, i1 - i0, keys).mul_(scale)
        keep = None
        if blocks is not None:
            keep = _block_keep(blocks, dense, batch, hq, i0, i1, keys, q.device)
        if score_mod is not None:
            kept = _score_keep(score_mod, score_buffers, s, i0)
            keep = kept if keep is None else keep & kept
        if keep is not None:
            s.masked_fill_(~keep, -math.inf)
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best.float()


def _ordered_dense(num: Tensor, indices: Tensor, cols: int) -> Tensor:
    """Block level ``(..., q blocks, cols)`` bool: the first ``num`` of each row's
    ``indices`` (``BlockMask.to_dense``'s, for any ``cols``)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    idx = indices.long()
    idx = torch.where(listed & (idx < cols), idx, cols)  # the rest to a column cut off below
    dense = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool, device=idx.device)
    return dense.scatter_(-1, idx, True)[..., :cols]


def _dense_blocks(blocks: _Blocks, keys: int) -> tuple[Tensor, Tensor | None]:
    cols = max(blocks.kv_indices.shape[-1], -(-keys // int(blocks.block_size[1])))
    partial = _ordered_dense(blocks.kv_num_blocks, blocks.kv_indices, cols)
    full = None
    if blocks.full_kv_num_blocks is not None and blocks.full_kv_indices is not None:
        full = _ordered_dense(blocks.full_kv_num_blocks, blocks.full_kv_indices, cols)
    return partial, full


def _block_keep(blocks, dense, batch, heads, i0, i1, keys, device) -> Tensor:
    """Which of rows ``i0:i1`` × all keys the kernel attends: a partial block where the
    ``mask_mod`` holds, a full block everywhere; broadcastable to ``(B, H, rows, S)``."""
    from torch.nn.attention.flex_attention import create_mask, noop_mask

    partial, full = dense
    bq, bk = int(blocks.block_size[0]), int(blocks.block_size[1])
    rows = (torch.arange(i0, i1, device=device) // bq).clamp_(max=partial.shape[-2] - 1)
    cols = torch.arange(keys, device=device) // bk
    keep = partial.to(device)[:, :, rows][..., cols]
    if blocks.mask_mod is not noop_mask:
        mask_mod, buffers = blocks.mask_mod, blocks.mask_buffers

        def shifted(b, h, q_idx, kv_idx):  # this block's rows
            return mask_mod(b, h, q_idx + i0, kv_idx, *buffers)

        keep = keep & create_mask(shifted, batch, heads, i1 - i0, keys, device=device)
    if full is not None:
        keep = keep | full.to(device)[:, :, rows][..., cols]
    return keep


def _score_keep(score_mod, buffers, s: Tensor, i0: int) -> Tensor:
    """Where ``score_mod`` leaves this block's scores ``s`` (``(B, H, rows, S)``) finite or
    ``+inf``: the positions it does not mask out."""
    from torch.nn.attention.flex_attention import create_mask

    def kept(b, h, q_idx, kv_idx):
        out = score_mod(s[b, h, q_idx, kv_idx], b, h, q_idx + i0, kv_idx, *buffers)
        return torch.logical_not(torch.isneginf(out))

    return create_mask(kept, *s.shape, device=s.device)


def _blockwise_max(q, k, scale, is_causal, attn_mask, block_elements) -> Tensor:
    *lead, hq, length, e = q.shape
    hkv, keys = k.shape[-3], k.shape[-2]
    rep, batch = hq // hkv, math.prod(lead)
    work = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(batch, hkv, rep, length, e)
    k3 = k.reshape(batch * hkv, keys, e)
    mask = None
    if attn_mask is not None:
        keep = attn_mask
        if keep.dtype != torch.bool:
            keep = keep > torch.finfo(keep.dtype).min / 2
        mask = keep.expand(*lead, hq, length, keys).reshape(batch, hkv, rep, length, keys)
    block = max(1, min(length, block_elements // max(1, batch * hq * keys)))
    best = torch.full((hkv, rep), -math.inf, dtype=work, device=q.device)

    def block_max(qb, start, stop, hide=None):
        n = qb.shape[1] // rep
        scores = _scores(qb, k3[:, start:stop], work).view(batch, hkv, rep, n, stop - start)
        if hide is not None:
            scores.masked_fill_(hide, -math.inf)
        return scores.amax(dim=(0, 3, 4))

    for i0 in range(0, length, block):
        i1 = min(length, i0 + block)
        qb = q5[:, :, :, i0:i1].reshape(batch * hkv, rep * (i1 - i0), e)
        if not is_causal:
            hide = None if mask is None else ~mask[..., i0:i1, :]
            best = torch.maximum(best, block_max(qb, 0, keys, hide))
            continue
        seen = min(i0, keys)  # keys every row of the block attends: no mask
        if seen:
            best = torch.maximum(best, block_max(qb, 0, seen))
        stop = min(keys, i1)  # the diagonal: key j is hidden from rows i < j
        if stop > seen:
            rows = torch.arange(i0, i1, device=q.device)[:, None]
            hide = torch.arange(seen, stop, device=q.device) > rows
            best = torch.maximum(best, block_max(qb, seen, stop, hide))
    return (best * scale).reshape(hq).float()


def _scores(qb: Tensor, kb: Tensor, work: torch.dtype) -> Tensor:
    """``qb @ kbᵀ`` accumulated in ``work`` (fp32): half inputs on CUDA through the matmul's
    fp32 output (``out_dtype``) where this torch has it, else cast first."""
    if qb.is_cuda and qb.dtype in (torch.float16, torch.bfloat16) and _OUT_DTYPE[0]:
        try:
            return torch.bmm(qb, kb.transpose(1, 2), out_dtype=work)
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[0] = False
    return torch.bmm(qb.to(work), kb.to(work).transpose(1, 2))
