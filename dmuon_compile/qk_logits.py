"""Each attention head's max pre-softmax logit ``q·kᵀ·scale``, from the ``q`` and ``k`` that
reach an attention kernel: what QK-clip (``qk_clip.py``) bounds.

Two ways, one result (per q head, float32):

- on CUDA without an ``attn_mask``: FlexAttention's fused kernel with
  ``return_aux=AuxRequest(max_scores=True)`` (torch 2.11 and 2.13; CUDA only there), run with a
  16-wide zero ``v``: one pass over the scores, none of them in memory;
- otherwise (the CPU, an explicit mask, or where FlexAttention fails: it warns once): query
  blocks of ``q @ kᵀ`` accumulated in fp32 (the matmul's fp32 output for half inputs on CUDA),
  at most ``block_elements`` scores at a time; under a causal mask the keys every row of a block
  attends are taken without a mask, the diagonal part with one.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

# Query-block size of the blockwise way: at most this many fp32 scores per block (64 MiB).
BLOCK_ELEMENTS = 1 << 24
_FLEX: dict = {"fn": None, "masks": {}, "failed": False}
_OUT_DTYPE = [True]  # bmm(out_dtype=) works here (turned off at its first failure)


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
            out = _flex_max(q, k, scale, is_causal)
            if out is not None:
                return out
        return _blockwise_max(q, k, scale, is_causal, attn_mask, block_elements)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _flex_max(q: Tensor, k: Tensor, scale: float, is_causal: bool) -> Tensor | None:
    """The max logits from FlexAttention's ``max_scores``, or ``None`` where it cannot run
    (then the blockwise way; a failure warns once and turns this way off)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

        if "max_scores" not in getattr(AuxRequest, "_fields", ()):
            _FLEX["failed"] = True
            return None
        if torch.compiler.is_compiling():
            fn = flex_attention  # traced into the caller's graph
        else:
            fn = _FLEX["fn"] = _FLEX["fn"] or torch.compile(flex_attention, dynamic=False)
        *lead, hq, length, e = q.shape
        hkv, keys = k.shape[-3], k.shape[-2]
        q4, k4 = q.reshape(-1, hq, length, e), k.reshape(-1, hkv, keys, e)
        mask = None
        if is_causal:
            key = (length, keys, q.device)
            mask = _FLEX["masks"].get(key)
            if mask is None:
                mask = create_block_mask(_causal, None, None, length, keys, device=q.device)
                _FLEX["masks"][key] = mask
        v = q.new_zeros(k4.shape[0], hkv, keys, 16)  # the kernel's P·V, as narrow as it goes
        _, aux = fn(
            q4,
            k4,
            v,
            block_mask=mask,
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
