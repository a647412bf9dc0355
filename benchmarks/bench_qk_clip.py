"""QK-clip's fallback collection: the forward time of one SDPA attention layer with and without
it (``dmuon_compile/qk_clip.py``: the per-head max of q·kᵀ·scale in query blocks, inside the
layer's forward).

    python benchmarks/bench_qk_clip.py                   # Llama-3-8B layer: 32×128 heads, 8 kv,
                                                         # seq 4096, bf16, causal, on CUDA
    python benchmarks/bench_qk_clip.py --seq 8192 --compile
    python benchmarks/bench_qk_clip.py --smoke           # tiny shapes on the CPU

The layer (q/k/v/o projections, SDPA with ``enable_gqa``) runs its forward in training mode
with autograd on (a training forward; no backward). Times: median of ``--repeats`` runs after
``--warmup`` runs (CUDA events on CUDA, ``perf_counter`` on the CPU); also ``max_logits`` alone
on the layer's q and k (its default way, and blockwise), and ``apply()`` (one process: no
all_reduce) with nothing above tau and with every head clipped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """A Llama attention layer without RoPE (which does not change the cost measured)."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            y.view(b, t, -1, self.head_dim).transpose(1, 2)
            for y in (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _time(fn, repeats: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.dim, args.heads, args.kv_heads, args.head_dim = (
            2,
            64,
            64,
            4,
            2,
            16,
        )
        args.repeats, args.warmup, args.dtype = 3, 1, "fp32"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (--smoke runs tiny shapes on the CPU)")
    else:
        device = torch.device("cuda")
    from dmuon_compile.qk_clip import QKClip, max_logits

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    layer = Attention(args.dim, args.heads, args.kv_heads, args.head_dim).to(device, dtype)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    run = torch.compile(layer) if args.compile else layer

    def forward():
        run(x)

    plain = _time(forward, args.repeats, args.warmup, cuda)
    clip = QKClip(layer, tau=100.0)
    if args.compile:
        torch._dynamo.reset()  # the hooks are new: compile the layer with them
        run = torch.compile(layer)
    collected = _time(forward, args.repeats, args.warmup, cuda)
    b, t = args.batch, args.seq
    with torch.no_grad():
        q = layer.q_proj(x).view(b, t, -1, args.head_dim).transpose(1, 2)
        k = layer.k_proj(x).view(b, t, -1, args.head_dim).transpose(1, 2)
    alone = _time(lambda: max_logits(q, k, is_causal=True), args.repeats, args.warmup, cuda)
    blockwise = _time(
        lambda: max_logits(q, k, is_causal=True, flex=False), args.repeats, args.warmup, cuda
    )
    # apply() per step: nothing above tau (the usual step), and once with every head clipped
    noop = _time(clip.apply, args.repeats, args.warmup, cuda)
    run(x)
    clip.tau = float(clip.attentions[0].running.min()) / 2
    clip_all = _time(clip.apply, 1, 0, cuda)
    print(
        f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
        f"{args.dtype}, batch {b} seq {t} dim {args.dim} heads {args.heads}×{args.head_dim} "
        f"(kv {args.kv_heads}), causal, compile={args.compile}"
    )
    print(f"  attention forward              {plain:9.3f} ms")
    print(
        f"  with QK-clip collection        {collected:9.3f} ms  "
        f"(+{collected - plain:.3f} ms, +{100 * (collected / plain - 1):.1f}%)"
    )
    print(f"  max_logits alone               {alone:9.3f} ms  (FlexAttention where it runs)")
    print(f"  max_logits blockwise           {blockwise:9.3f} ms")
    print(f"  apply(), nothing above tau     {noop:9.3f} ms")
    print(f"  apply(), every head clipped    {clip_all:9.3f} ms  (one cold run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
