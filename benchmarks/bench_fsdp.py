"""benchmarks/README.md §B: one training iteration of a Llama-like stack on FSDP2, four optimizers.

Launch with torchrun, one process per GPU (or CPU processes with gloo for a smoke run):

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --out results_S.json
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --quick --device cpu
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --replicate 2   # HSDP 2×1
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --replicate 1 --hsdp  # 1×2
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --replicate 2 \
        --with-1d ours_compiled
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --tp 2 \
        --with-1d adamw,ours_compiled                                   # TP 2 and 1-D, one run
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --quick --device cpu --tp 2
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --model S --profile prof/  # + traces
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --quick --device cpu --profile /tmp/prof
    torchrun --nproc_per_node 1 benchmarks/bench_fsdp.py --model E --out results_E.json  # MoE
    torchrun --nproc_per_node 1 benchmarks/bench_fsdp.py --quick --device cpu --model E \
        --moe-impl grouped_mm                                           # tiny MoE on CPU

Model E (mixture of experts, ``MOE``): DeepSeek-V3's MoE layer at dim 2048, 4 layers: attention
q/k/v/o 2048×2048, a router Linear(2048, 64) (sigmoid scores, top-6 normalised), 64 routed
SwiGLU experts of hidden 768 as torchtitan's ``GroupedExperts`` stacks (w1, w3 (64, 768, 2048),
w2 (64, 2048, 768)) and one shared SwiGLU expert of hidden 1536 (``*_proj``). The ours
configurations dedicate the ``*_proj`` weights as for S; the expert stacks stay with FSDP2
(``Shard(0)``: whole experts per rank) and ``dmuon.Muon`` orthogonalises each rank's experts one
by one; the router gets AdamW. ``naive_muon`` gathers the stacks whole and runs NS per expert.
The experts run ``torch._grouped_mm`` over each token's top-k experts (``--moe-impl
grouped_mm``: bf16 on CUDA, the GEMMs' size fixed whatever the routing), or, where a probe of it
fails (``auto``) or with ``--moe-impl dense``, every expert on every token weighted by the
routing (E/k = 10.7× the expert FLOPs). The report names the choice (``moe_impl``) and counts
``iter_tflop_per_rank`` (forward + backward matmul FLOPs of the top-k model: ~11.2 TFLOP for
8×1024 tokens) and each configuration's ``model_tflop_per_s``.

Configurations (all built up front, then run interleaved iteration by iteration):

- ``adamw``: FSDP2 + ``torch.optim.AdamW(fused=True)`` (fused on CUDA only) — the floor;
- ``naive_muon``: FSDP2; each rank all-gathers every *_proj update (momentum kept on the
  shard), runs NS on the whole matrix and keeps its rows; AdamW for the rest;
- ``ours_eager``: ``dmuon.dedicate_params`` (all *_proj weights) + FSDP2 + ``dmuon.Muon``;
- ``ours_compiled``: the same with ``Muon(compile=True)`` (CUDA only, when Muon has it);
  ``ours_compiled_kept``: and ``keep_new_momentum=True``; ``ours_compiled_offload``: and
  ``offload="momentum"``; ``ours_compiled_state``: and ``offload="state"`` (the owned masters in
  host memory too: the 1-D mesh; the peaks of forward+backward and of the step are printed
  apart); ``ours_compiled_state8``: and the momentum 8-bit (``momentum_dtype="int8"``);
  ``ours_compiled_state_all``: ``offload="state"`` all at once (``momentum_in_flight=None``);
- ``ours_eager_sync``: ``ours_eager`` with ``Muon(replicate_async=False)`` (HSDP runs only);
- peers that step expert stacks whole (the 1-D mesh only, named ``dp``; their wheels carried as
  benchmarks/README.md §B1 says): ``dion_muon``, microsoft/dion's ``Muon`` with
  ``distributed_mesh`` = FSDP2's mesh, ``flatten=False``, Polar Express, its AdamW for the rest;
  ``titan_distmuon``, torchtitan's ``DistMuon`` (2-D matrices ``Owned``, stacks ``Shard(0)``)
  plus ``torch.optim.AdamW``. Both at bench_step.py's settings (Nesterov, μ = 0.95, lr 0.02 at
  the AdamW-matched rule).

``--replicate R`` (or ``--hsdp``) runs every configuration on the HSDP mesh
``init_device_mesh(dev, (R, world // R), mesh_dim_names=("replicate", "shard"))``:
``fully_shard(..., mesh=hsdp)``, ``dedicate_params(model, hsdp["shard"],
replicate_mesh=hsdp["replicate"])``, the naive baseline gathers over the shard group. HSDP
runs also report the replicate-stage profile when ``DMUON_RECORD_FORWARD_PROFILE=1`` is set.

``--tp T`` runs every configuration on the mesh ``init_device_mesh(dev, (world // T, T),
mesh_dim_names=("dp", "tp"))``: the attention and MLP projections column-parallel in
(q/k/v, gate/up) and row-parallel out (o, down) by ``parallelize_module`` on ``mesh["tp"]``, as
torchtitan's Llama; ``adamw`` is then FSDP2 over ``mesh["dp"]`` + AdamW on every weight, the
``ours_*`` configurations dedicate the (TP-sharded) projections over ``mesh["dp"]`` first
(Newton–Schulz once per whole matrix, on its TP owner). The ranks of a TP group read the same
batch; ``naive_muon`` has no TP version. ``ours_eager_sync`` (the TP scatter applied inside
``step()``) is added next to ``ours_eager``. With ``DMUON_RECORD_FORWARD_PROFILE=1`` the ours
configurations report the TP stage's forward waits (``not_ready``: scatters the previous
compute did not finish); ``--profile`` adds the TP scatter's hidden share under the next
forward. ``--with-1d`` works with ``--tp`` too; each mesh's Muon tax is against its own AdamW
(``1d_adamw`` for the ``1d_*`` configurations when it runs).

Every run also reports ``back_to_back_ms``: blocks of iterations run back to back with one
device sync per block and the inputs already on the device — how a training loop runs, and
the only timing in which the async replicate broadcast can overlap the next forward (the
interleaved timing syncs after backward and after every step). Two rounds, the faster block
counts; ``b2b_muon_tax`` and ``b2b_over_floor`` are the tax and floor ratio on this timing.

Per configuration: median iteration time (forward + backward + step) and step-only time,
peak memory (CUDA), and the Muon tax = iteration / AdamW iteration − 1; plus the NS FLOP
floor of §B and (iteration − AdamW iteration) / floor. Owner-load balance: ``step_balance`` =
max / mean over ranks of each rank's own median step time (measured; it includes any wait
inside the step), next to the owner plan's ``planned_balance`` (NS cost max / mean).

``--profile DIR`` then runs, per configuration (``--profile-configs``, default all that ran),
one warm iteration and ``--profile-iters`` back-to-back iterations (one device sync before and
after) under ``torch.profiler``, and reads each rank's chrome trace with
``benchmarks/trace_analysis.py``: exposed communication (NCCL kernel time with no compute
kernel running, as a fraction of the GPU window; ``exposed comm %`` = the max over ranks), the
hidden share of the (replicate) broadcast kernels, and GPU time per kernel category. Rank 0
keeps its trace, gzipped, for the ``--save-traces`` configurations:
``DIR/trace_<model>_<mesh>_<config>_rank0.json.gz``. On CPU the traces hold no GPU events (the
summary is zeros/None).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.newton_schulz import direct_ns_products, gram_ns_products

# benchmarks/ is not a package: sibling modules import by name from this folder.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MODELS = {  # D, F, layers (a MoE model: F is its shared expert's hidden width)
    "S": (2048, 5632, 8),
    "M": (4096, 14336, 4),
    # One Llama-3 70B layer (64 query heads of 128, 8 k/v heads): the memory rows of the
    # offload configurations at that width.
    "L70": (8192, 28672, 1),
    "G": (2048, 7168, 8),  # Llama-3 8B's layout at S's width: F = 3.5·D, grouped-query k/v
    "E": (2048, 1536, 4),  # mixture of experts: MOE["E"]
    "quick": (64, 128, 2),
    "quick_E": (64, 96, 2),  # --quick --model E
}
# Mixture-of-experts models: routed experts, each expert's hidden width, top-k. E is
# DeepSeek-V3's MoE layer (256 routed experts of hidden 2048 at dim 7168, top-8, one shared
# expert, sigmoid router scores normalised over the chosen) scaled to dim 2048: 64 experts of
# hidden 768 (DeepSeek-V2-Lite / Moonlight's dim and expert count), top-6, one shared expert of
# hidden 2·768 = 1536; attention q/k/v/o dense 2048×2048 (MHA, 16 heads of 128: MLA's low-rank
# projections left out), 4 layers, so one iteration of 8×1024 tokens is ~11 TFLOP (tens of ms
# on an H200) and four configurations' states fit one GPU. The expert stacks are torchtitan's
# GroupedExperts (w1, w3 (E, hidden, D); w2 (E, D, hidden)); the same shapes as
# bench_step.py's model E.
MOE = {
    "E": (64, 768, 6),
    "quick_E": (8, 32, 2),
}
MOE_IMPLS = ("auto", "grouped_mm", "dense")
# Rows of each expert's token group in the grouped GEMM: a multiple of this, and at least this
# (torchtitan pads bf16 groups to 8 rows for torch._grouped_mm; 16 keeps every group start
# 32-byte aligned too).
GROUP_ALIGN = 16
# Query heads per k/v head (grouped-query attention: k/v have D / this rows); 1 elsewhere.
KV_GROUPS = {"G": 4, "L70": 8}
HEAD_DIM = 128
PEAK_FLOPS = 700e12  # ~H200 dense bf16/fp16 as in §B
# HBM bytes per second of the products' roofline (``ns_roofline_ms``): an H100's, as its
# elementwise kernels reached (benchmarks/RESULTS.md §30); an H200's HBM is ~1.4× faster.
HBM_BYTES_PER_S = 3.1e12


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (
            x
            * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
            * self.weight
        )


def grouped_experts(x, idx, weights, w1, w2, w3):
    """SwiGLU experts over each token's chosen experts with ``torch._grouped_mm`` (bf16, CUDA
    SM90+; torchtitan's GroupedExperts path). ``x`` (T, D); ``idx``/``weights`` (T, k): the
    chosen experts and their weights. The T·k (token, expert) rows are sorted by expert into a
    zero-padded buffer of a fixed size, T·k + E·GROUP_ALIGN rows (no device-to-host sync), each
    expert's group a multiple of GROUP_ALIGN rows (at least one), the last group running to the
    buffer's end; so the GEMMs' cost is the same every iteration whatever the routing."""
    tokens, k = idx.shape
    experts, n = w1.shape[0], tokens * k
    cap = -(-(n + experts * GROUP_ALIGN) // GROUP_ALIGN) * GROUP_ALIGN
    flat = idx.reshape(-1)  # row a = token·k + slot: its expert
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    padded = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).clamp_min(GROUP_ALIGN)
    ends = padded.cumsum(0)
    chosen = flat[order]
    within = torch.arange(n, device=x.device) - (counts.cumsum(0) - counts)[chosen]
    row = torch.empty_like(order).scatter_(0, order, (ends - padded)[chosen] + within)
    offs = torch.cat([ends[:-1], ends.new_tensor([cap])]).to(torch.int32)
    buf = x.new_zeros(cap, x.shape[1]).index_copy(0, row, x.repeat_interleave(k, 0))
    h = F.silu(torch._grouped_mm(buf, w1.mT, offs=offs)) * torch._grouped_mm(buf, w3.mT, offs=offs)
    out = torch._grouped_mm(h, w2.mT, offs=offs).index_select(0, row).view(tokens, k, -1)
    return (out * weights.unsqueeze(-1)).sum(1)


def dense_experts(x, idx, weights, w1, w2, w3):
    """The same SwiGLU experts computed for every token and expert (batched einsums), weighted
    by the routing weights (zero where an expert was not chosen): E / k times the expert FLOPs
    of ``grouped_experts``, on any device and dtype. The fallback (and the CPU smoke run)."""
    dense = torch.zeros(x.shape[0], w1.shape[0], dtype=x.dtype, device=x.device)
    dense = dense.scatter(-1, idx, weights)
    h = F.silu(torch.einsum("td,ehd->teh", x, w1)) * torch.einsum("td,ehd->teh", x, w3)
    return torch.einsum("ted,te->td", torch.einsum("teh,edh->ted", h, w2), dense)


def grouped_mm_problem(device) -> str | None:
    """``None`` when ``torch._grouped_mm`` runs ``grouped_experts`` forward and backward in
    bf16 on ``device`` and matches ``dense_experts``; otherwise why not (``--moe-impl auto``
    then uses the dense experts)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x, w1, w2, w3 = (
            torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            for shape in ((40, 64), (4, 32, 64), (4, 64, 32), (4, 32, 64))
        )
        idx = torch.randn(40, 4, generator=gen).topk(2, dim=-1).indices
        weights = torch.rand(40, 2, generator=gen)
        ref = dense_experts(x, idx, weights, w1, w2, w3)
        xs = [t.to(device, torch.bfloat16).requires_grad_() for t in (x, w1, w2, w3)]
        out = grouped_experts(xs[0], idx.to(device), weights.to(device, torch.bfloat16), *xs[1:])
        out.float().square().sum().backward()
        err = float((out.detach().float().cpu() - ref).norm() / ref.norm())
        if not (err < 2e-2 and all(bool(torch.isfinite(t.grad).all()) for t in xs)):
            return f"torch._grouped_mm gave a relative error of {err:.3g} on {device}"
    except Exception as exc:  # noqa: BLE001 - any failure means: use the dense experts
        return f"torch._grouped_mm failed on {device}: {type(exc).__name__}: {exc}"
    return None


class GroupedExperts(nn.Module):
    """torchtitan's expert stacks: w1, w3 (E, hidden, D), w2 (E, D, hidden). The class name
    ends in ``Experts``: ``dmuon.Muon`` orthogonalises each expert on its own
    (``dmuon.Layout.experts()``), and ``dedicate_params(predicate=is_proj)`` leaves the stacks
    to FSDP2 (``Shard(0)``: each rank holds, and orthogonalises, whole experts)."""

    def __init__(self, dim, hidden, experts, impl="dense"):
        super().__init__()
        self.impl = impl

        def init(*shape):  # nn.Linear's default: uniform(±1/√fan_in)
            return nn.Parameter(torch.empty(shape).uniform_(-1, 1) / shape[-1] ** 0.5)

        self.w1, self.w2, self.w3 = (
            init(experts, hidden, dim),
            init(experts, dim, hidden),
            init(experts, hidden, dim),
        )

    def forward(self, x, idx, weights):
        fn = grouped_experts if self.impl == "grouped_mm" else dense_experts
        return fn(x, idx, weights, self.w1, self.w2, self.w3)


class SharedMLP(nn.Module):
    """The shared expert: a dense SwiGLU MLP (its weights are ``*_proj``: dedicated)."""

    def __init__(self, dim, ffn):
        super().__init__()
        self.gate_proj, self.up_proj = (
            nn.Linear(dim, ffn, bias=False),
            nn.Linear(dim, ffn, bias=False),
        )
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class MoE(nn.Module):
    """DeepSeek-V3's MoE layer: sigmoid router scores, the top-k experts per token weighted by
    their scores normalised to sum 1, plus one shared expert every token goes through. The
    router (``router``: AdamW under ``dmuon.Muon``) is a plain Linear."""

    def __init__(self, dim, ffn, experts, hidden, top_k, impl="dense"):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, experts, impl)
        self.shared = SharedMLP(dim, ffn)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        top = torch.sigmoid(self.router(x).float()).topk(self.top_k, dim=-1)
        weights = (top.values / top.values.sum(-1, keepdim=True)).to(x.dtype)
        return (self.experts(x, top.indices, weights) + self.shared(x)).view_as(h)


class Block(nn.Module):
    def __init__(self, dim, ffn, head_dim, kv_groups=1, moe=None, moe_impl="dense"):
        super().__init__()
        self.heads, self.kv_groups = dim // head_dim, kv_groups
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(dim, rows, bias=False)
            for rows in (dim, dim // kv_groups, dim // kv_groups, dim)
        )
        self.moe = None
        if moe is not None:  # (experts, hidden, top_k): the MLP is a MoE layer
            self.moe = MoE(dim, ffn, *moe, impl=moe_impl)
            return
        self.gate_proj, self.up_proj = (
            nn.Linear(dim, ffn, bias=False),
            nn.Linear(dim, ffn, bias=False),
        )
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)

        def split(y):  # -1: the local heads when q/k/v are column-parallel (--tp)
            return y.view(b, t, -1, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            split(self.q_proj(h)),
            split(self.k_proj(h)),
            split(self.v_proj(h)),
            is_causal=True,
            enable_gqa=self.kv_groups > 1,
        )
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        if self.moe is not None:
            return x + self.moe(h)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Stack(nn.Module):
    def __init__(self, dim, ffn, layers, head_dim, kv_groups=1, moe=None, moe_impl="dense"):
        super().__init__()
        self.layers = nn.ModuleList(
            Block(dim, ffn, head_dim, kv_groups, moe, moe_impl) for _ in range(layers)
        )

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def is_proj(name, p):
    return name.endswith("_proj.weight")


def is_expert_stack(name, p):
    """A MoE model's expert stack (``...experts.w1``; 3-D): Muon per expert, never dedicated."""
    return p.ndim == 3 and name.rsplit(".", 2)[-2] == "experts"


def iteration_flops(model, batch, seq):
    """Matmul FLOPs of one training iteration (forward + backward = 3 × forward) on one rank:
    the projections, the causal attention (q·kᵀ and p·v over the half the mask keeps), the MLP
    (a MoE model: the top-k experts per token, the shared expert and the router)."""
    dim, ffn, layers = MODELS[model]
    kv = dim // KV_GROUPS.get(model, 1)
    per_token = 2 * dim * (2 * dim + 2 * kv) + 2 * seq * dim  # projections + causal attention
    if model in MOE:
        experts, hidden, top_k = MOE[model]
        per_token += 6 * dim * (top_k * hidden + ffn) + 2 * dim * experts
    else:
        per_token += 6 * dim * ffn
    return 3 * per_token * layers * batch * seq


def tp_owners(layers):
    """Megatron/torchtitan's Llama plan: q/k/v and gate/up column-parallel, o/down row-parallel
    (one all-reduce after attention and one after the MLP); norms stay replicated over TP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("o_proj", "down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def check_tp(tp, world, model, replicate=None, hsdp=False):
    """``--tp`` against the world size and the model: the error names the fix (SystemExit)."""
    if tp is None:
        return
    if tp < 1 or world % tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise SystemExit(
            f"--tp {tp}: must divide the world size {world} (dp = world / tp); "
            f"use one of {divisors} or start a multiple of {tp} processes"
        )
    if replicate is not None or hsdp:
        raise SystemExit("--tp runs on a (dp, tp) mesh: drop --replicate/--hsdp")
    if model in MOE:
        raise SystemExit(f"--tp: model {model} (mixture of experts) has no TP plan; drop --tp")
    dim, ffn, _layers = MODELS[model]
    heads = dim // (HEAD_DIM if model != "quick" else 16)
    kv_heads = heads // KV_GROUPS.get(model, 1)
    for what, n in (("attention heads", heads), ("k/v heads", kv_heads), ("the MLP width", ffn)):
        if n % tp:
            raise SystemExit(f"--tp {tp}: {what} of model {model} ({n}) do not split over {tp}")


class NaiveMuon:
    """All-gather each full update, NS on every rank, keep the local rows (the usual FSDP2 port)."""

    def __init__(self, model, mesh, ns, lr=0.02, momentum=0.95, adamw_lr=3e-4, fused=False):
        # mesh: the 1-D shard mesh (FSDP2's HSDP has already averaged over the replicas)
        # A MoE model's expert stacks too: gathered whole, NS per expert (a 3-D batch).
        def muon(n, p):
            return is_proj(n, p) or is_expert_stack(n, p)

        self.mats = [p for n, p in model.named_parameters() if muon(n, p)]
        others = [p for n, p in model.named_parameters() if not muon(n, p)]
        self.adamw = torch.optim.AdamW(others, lr=adamw_lr, fused=fused or None)
        self.bufs = [torch.zeros_like(p.to_local()) for p in self.mats]
        self.ns, self.lr, self.mu, self.mesh = ns, lr, momentum, mesh

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import DTensor, Shard

        rank, world = self.mesh.get_local_rank(), self.mesh.size()
        for p, buf in zip(self.mats, self.bufs):
            g = p.grad.to_local()
            buf.mul_(self.mu).add_(g)
            u = g.add(buf, alpha=self.mu)
            full = DTensor.from_local(
                u, self.mesh, [Shard(0)], shape=p.shape, stride=p.stride()
            ).full_tensor()
            o = self.ns(full)
            rows = torch.chunk(o, world, dim=0)
            if rank < len(rows) and rows[rank].numel():
                scale = 0.2 * math.sqrt(max(p.shape[-2:]))  # each matrix's (expert's)
                p.to_local().add_(rows[rank].to(p.dtype), alpha=-self.lr * scale)
        self.adamw.step()

    def zero_grad(self):
        for p in self.mats:
            p.grad = None
        self.adamw.zero_grad()


def ns_products(dim, ffn, layers, kv_groups=1, moe=None) -> list:
    """Every NS product of one step over the model's Muon matrices (``NSProduct``s, in the
    job: Gram NS with one restart where α ≥ 2, direct symmetric otherwise). ``moe`` (experts,
    hidden, top_k): ``ffn`` is the shared expert's, and each layer adds its experts' matrices, E
    of (hidden, D) twice and E of (D, hidden) (Muon per expert)."""
    kv = (dim // kv_groups, dim)
    shapes = [(dim, dim), kv, kv, (dim, dim)] + [(ffn, dim)] * 2 + [(dim, ffn)]
    if moe is not None:
        experts, hidden, _top_k = moe
        shapes += [(hidden, dim)] * (2 * experts) + [(dim, hidden)] * experts
    products = []
    for m, n in shapes * layers:
        small, large = min(m, n), max(m, n)
        products += (
            gram_ns_products(small, large, 5, 1)
            if large >= 2 * small
            else direct_ns_products(small, large, 5)
        )
    return products


def ns_floor_ms(dim, ffn, layers, world, kv_groups=1, moe=None):
    """§B floor: the FLOPs of :func:`ns_products` at ``PEAK_FLOPS``, per rank.

    The same with ``--tp``: NS runs once per whole matrix in the job (on its TP owner), so the
    per-matrix work is divided over all ``world`` ranks, as on the 1-D mesh."""
    total = sum(p.count * p.flops for p in ns_products(dim, ffn, layers, kv_groups, moe))
    return total / world / PEAK_FLOPS * 1e3


def ns_roofline_ms(dim, ffn, layers, world, kv_groups=1, moe=None, bytes_per_s=HBM_BYTES_PER_S):
    """The products' roofline: each product at the slower of its FLOPs at ``PEAK_FLOPS`` and its
    fewest bytes at ``bytes_per_s``, per rank. Above :func:`ns_floor_ms` where products move
    more bytes per FLOP than the GPU's ratio (the Gram-space products of 768-row experts); the
    step's elementwise passes over its state come on top of both."""
    total = sum(
        p.count * max(p.flops / PEAK_FLOPS, p.bytes / bytes_per_s)
        for p in ns_products(dim, ffn, layers, kv_groups, moe)
    )
    return total / world * 1e3


def build(config, args, meshes, device):
    """``meshes = (fsdp_mesh, shard_mesh, replicate_mesh or None, tp_mesh or None)``: with a TP
    mesh the model is TP-parallelised first (``parallelize_module``), then dedicated over the
    data-parallel mesh, then FSDP2 over it (the documented order)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh, shard_mesh, replicate_mesh, tp_mesh = meshes
    config = config.removeprefix("1d_")  # the same configuration, built on the 1-D mesh given
    dim, ffn, layers = MODELS[args.model]
    head_dim = HEAD_DIM if not args.model.startswith("quick") else 16
    torch.manual_seed(0)
    with torch.device(device):
        model = Stack(
            dim,
            ffn,
            layers,
            head_dim,
            KV_GROUPS.get(args.model, 1),
            MOE.get(args.model),
            getattr(args, "moe_impl", "dense"),
        )
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, tp_owners(layers))
    cuda = device.type == "cuda"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cuda
        else MixedPrecisionPolicy()
    )
    if config.startswith("ours"):
        policy = (
            dmuon.ParamPolicy(dmuon.MixedPrecision(torch.bfloat16, torch.float32)) if cuda else None
        )
        dmuon.dedicate_params(
            model, shard_mesh, predicate=is_proj, param_policy=policy, replicate_mesh=replicate_mesh
        )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    ns = dmuon.NewtonSchulz()
    if config in PEERS:
        return model, build_peer(config, model, mesh, cuda)
    if config == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True if cuda else None)
    elif config == "naive_muon":
        opt = NaiveMuon(model, shard_mesh, ns, fused=cuda)
    else:
        kw = {}
        if "compile" in inspect.signature(dmuon.Muon).parameters:
            kw["compile"] = config.startswith("ours_compiled")
        if config == "ours_compiled_kept":
            kw["keep_new_momentum"] = True
        kw.update(OFFLOADED.get(config, {}))  # the momentum, or with "state" the masters too
        opt = dmuon.Muon(
            model, lr=0.02, ns_backend=ns, replicate_async=config != "ours_eager_sync", **kw
        )
    return model, opt


# Our compiled step with the Muon state in host memory between steps (Muon(offload=...)).
OFFLOADED = {
    "ours_compiled_offload": {"offload": "momentum"},
    "ours_compiled_state": {"offload": "state"},
    # and the momentum 8-bit: 5 B per owned value moved each way instead of 8
    "ours_compiled_state8": {"offload": "state", "momentum_dtype": "int8"},
    # every master and momentum on the GPU for the step (copied in under Newton-Schulz)
    "ours_compiled_state_all": {"offload": "state", "momentum_in_flight": None},
}

# Peers that step expert stacks whole, each through its own code on FSDP2's sharded DTensors
# (the 1-D mesh only; both are configured as in bench_step.py, whose helpers build them).
PEERS = ("dion_muon", "titan_distmuon")


def muon_params(model) -> tuple[list, list]:
    """(name, parameter) of what Muon steps (the projections and expert stacks), and the rest."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        (muon if is_proj(name, p) or is_expert_stack(name, p) else rest).append((name, p))
    return muon, rest


class WithAdamW:
    """A Muon that steps only the matrices, beside AdamW for the rest: one ``step``."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)


def build_peer(config, model, mesh, cuda):
    """``dion_muon``: microsoft/dion's ``Muon`` with ``distributed_mesh`` = FSDP2's mesh, its
    AdamW (``algorithm="adamw"`` group) for the rest; ``titan_distmuon``: torchtitan's
    ``DistMuon`` over the named ``dp`` mesh plus ``torch.optim.AdamW``. Their Muon options are
    bench_step.py's (Nesterov, μ = 0.95, lr 0.02 at the AdamW-matched rule, no decay)."""
    import bench_step

    if mesh.ndim != 1:
        raise ValueError(f"{config} runs on the 1-D mesh only (no --replicate/--hsdp/--tp)")
    muon, rest = muon_params(model)
    if config == "dion_muon":
        groups = [
            {"params": [p for _, p in muon]},
            {"params": [p for _, p in rest], "algorithm": "adamw", "lr": 3e-4},
        ]
        return bench_step.build_dion(groups, distributed_mesh=mesh)
    flex = bench_step.titan_modules()
    if mesh.mesh_dim_names != ("dp",):
        raise ValueError(f"titan_distmuon needs the FSDP2 mesh named ('dp',), got {mesh}")
    names, params = [n for n, _ in muon], [p for _, p in muon]
    kwargs = bench_step.titan_kwargs(flex, names, params)
    groups = [{"params": params, "param_names": names}]
    device = params[0].device
    adamw = torch.optim.AdamW([p for _, p in rest], lr=3e-4, fused=True if cuda else None)
    return WithAdamW(bench_step.titan_dist_muon(flex.dist_muon, groups, device, kwargs), adamw)


def routed(opt):
    """How many parameters ``dmuon.Muon`` gives Muon, by layout kind (``matrix``, ``experts``:
    one NS per expert), and how many AdamW (``adamw``)."""
    counts = {}
    for group in opt.param_groups:
        for p in group["params"]:
            kind = opt._layout(p).kind if group["use_muon"] else "adamw"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trace_analysis():
    """benchmarks/ is not a package: import the sibling module from this file's directory."""
    import trace_analysis as ta

    return ta


def profile_iterations(model, opt, inputs, device, path):
    """One warm iteration on ``inputs[0]``, then one per remaining input back to back (no sync
    inside) under torch.profiler; the chrome trace goes to ``path``. The inputs are on the device
    already, so the trace holds the training iterations only (no host-to-device copies)."""
    from torch.profiler import ProfilerActivity, profile

    def one(x):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    one(inputs[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for x in inputs[1:]:
            one(x)
        sync(device)
    prof.export_chrome_trace(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["S", "M", "G", "E", "L70"], default="S")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, few iterations (smoke run; with --model E a tiny MoE)",
    )
    ap.add_argument(
        "--moe-impl",
        choices=MOE_IMPLS,
        default="auto",
        help="model E's experts: grouped_mm (torch._grouped_mm over each token's top-k experts, "
        "bf16 on CUDA), dense (every expert on every token, weighted by the routing: E/k times "
        "the expert FLOPs), auto (grouped_mm on CUDA when a probe of it passes, else dense)",
    )
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default 6; 3 with --quick)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default 3; 1 with --quick)"
    )
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank (default 8)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024)")
    ap.add_argument("--configs", default="adamw,naive_muon,ours_eager,ours_compiled")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    ap.add_argument(
        "--cpu-compile", action="store_true", help="also run ours_compiled on CPU (slow)"
    )
    ap.add_argument(
        "--replicate",
        type=int,
        default=None,
        help="HSDP: R replicas of world/R-rank shard groups (e.g. 2 on 2 GPUs = 2×1)",
    )
    ap.add_argument(
        "--hsdp",
        action="store_true",
        help="use the 2-D HSDP mesh even with --replicate 1 (1×world)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="tensor parallel: mesh (world/T, T) named (dp, tp); attention and MLP projections "
        "column/row-parallel, FSDP2 (and dedicate_params) over dp. T must divide the world",
    )
    ap.add_argument(
        "--with-1d",
        default="",
        help="HSDP and --tp runs: also build these configurations (comma list, e.g. "
        "adamw,ours_compiled) on the 1-D mesh over all ranks, as 1d_<config>, interleaved in the "
        "same run; reports vs_1d = back-to-back iteration / the 1-D one (1d_<config>'s Muon tax "
        "is against 1d_adamw when that runs too)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after timing, profile each configuration (torch.profiler) and report exposed comm",
    )
    ap.add_argument(
        "--profile-iters", type=int, default=3, help="back-to-back iterations profiled (default 3)"
    )
    ap.add_argument(
        "--profile-configs",
        default=None,
        help="comma list of configurations to profile (default: all that ran)",
    )
    ap.add_argument(
        "--save-traces",
        default="ours_compiled",
        help="comma list: rank 0 writes these configurations' traces (gzipped) to DIR",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.model = "quick_E" if args.model == "E" else "quick"
    if args.profile_iters < 1:
        ap.error("--profile-iters must be >= 1")
    iters = args.iters or (3 if args.quick else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    batch = args.batch or (2 if args.quick else 8)
    seq = args.seq or (16 if args.quick else 1024)

    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    moe_note = None  # why --moe-impl auto did not pick grouped_mm
    if args.model in MOE and args.moe_impl == "auto":
        moe_note = grouped_mm_problem(device) if device.type == "cuda" else "CPU run: dense experts"
        ok = torch.tensor([0.0 if moe_note else 1.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank runs the same experts
        args.moe_impl = "grouped_mm" if ok.item() == 1.0 else "dense"
        if args.moe_impl == "dense" and moe_note is None:
            moe_note = "grouped_mm failed on another rank"
        if rank == 0 and moe_note and device.type == "cuda":
            print(f"[bench_fsdp] dense experts: {moe_note}", file=sys.stderr, flush=True)
    hsdp = args.hsdp or args.replicate is not None
    replicas = args.replicate or 1
    if replicas < 1 or world % replicas:
        raise SystemExit(f"--replicate {replicas}: must divide the world size {world}")
    check_tp(args.tp, world, args.model, args.replicate, args.hsdp)  # same verdict on every rank
    tp = args.tp
    dp_rank = rank  # ranks of one TP group read the same batch
    if tp is not None:
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        meshes = (mesh["dp"], mesh["dp"], None, mesh["tp"])
        dp_rank = mesh["dp"].get_local_rank()
    elif hsdp:
        mesh = init_device_mesh(
            device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        meshes = (mesh, mesh["shard"], mesh["replicate"], None)
    else:
        # named: torchtitan's DistMuon (titan_distmuon) reads its layouts by mesh axis name
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        meshes = (mesh, mesh, None, None)
    configs = [c for c in args.configs.split(",") if c]
    if (
        (hsdp and replicas > 1 or tp is not None)
        and "ours_eager" in configs
        and "ours_eager_sync" not in configs
    ):  # the control of the async publish / TP scatter: the same step, applied inside step()
        configs.insert(configs.index("ours_eager") + 1, "ours_eager_sync")
    with_1d = [c for c in args.with_1d.split(",") if c]
    if with_1d and not (hsdp or tp is not None):
        raise SystemExit(
            "--with-1d compares an HSDP or TP mesh with the 1-D one: add --replicate R (or "
            "--hsdp) or --tp T"
        )
    mesh_1d = init_device_mesh(device.type, (world,)) if with_1d else None
    configs += [f"1d_{c}" for c in with_1d]
    skipped = {}
    if tp is not None and "naive_muon" in configs:  # it all-gathers FSDP2 shards: no TP version
        configs.remove("naive_muon")
        skipped["naive_muon"] = "no TP version (1-D and HSDP only; use --with-1d naive_muon)"
    cpu_skip = device.type != "cuda" and not args.cpu_compile
    for c in ("ours_compiled", "1d_ours_compiled"):
        if c in configs and (cpu_skip or "compile" not in inspect.signature(dmuon.Muon).parameters):
            configs.remove(c)
            skipped[c] = (
                "CPU run (compiled step is for CUDA)"
                if device.type != "cuda"
                else "Muon has no compile="
            )

    dim = MODELS[args.model][0]
    built, resident, errors = {}, {}, {}
    for c in configs:
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        try:
            built[c] = build(
                c, args, (mesh_1d, mesh_1d, None, None) if c.startswith("1d_") else meshes, device
            )
        except Exception as exc:  # noqa: BLE001 - one broken configuration must not sink the run
            built[c] = None
            errors[c] = f"build: {type(exc).__name__}: {exc}"
        resident[c] = before
    gen = torch.Generator(device="cpu").manual_seed(1234 + dp_rank)
    fields = ("iter", "step", "peak", "peak_fb", "peak_step")
    times = {c: {f: [] for f in fields} for c in configs}

    def run(c, timed):
        model, opt = built[c]
        x = torch.randn(batch, seq, dim, generator=gen).to(device)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        sync(device)
        t1 = time.perf_counter()
        if device.type == "cuda":  # forward and backward apart from the step
            peak_fb = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        opt.zero_grad()
        sync(device)
        t2 = time.perf_counter()
        if timed:
            times[c]["iter"].append(t2 - t0)
            times[c]["step"].append(t2 - t1)
            if device.type == "cuda":
                peak_step = torch.cuda.max_memory_allocated(device)
                times[c]["peak"].append(max(peak_fb, peak_step))
                times[c]["peak_fb"].append(peak_fb)
                times[c]["peak_step"].append(peak_step)

    for i in range(warmup + iters):
        for c in list(configs):  # interleaved: drift and thermals hit every configuration alike
            ok = built[c] is not None
            if ok:
                try:
                    run(c, timed=i >= warmup)
                except Exception as exc:  # noqa: BLE001
                    ok = False
                    errors.setdefault(c, f"iteration {i}: {type(exc).__name__}: {exc}")
            flag = torch.tensor([1.0 if ok else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank drops a failed config together
            if flag.item() < 1.0:
                configs.remove(c)
                errors.setdefault(c, "failed on another rank")
                if rank == 0:
                    print(f"[bench_fsdp] dropped {c}: {errors[c]}", file=sys.stderr, flush=True)
        if rank == 0:
            print(
                f"[bench_fsdp] iteration {i + 1}/{warmup + iters} done", file=sys.stderr, flush=True
            )

    # Back to back: blocks of `iters` iterations with no sync inside (inputs already on the
    # device), the way a training loop runs; the async publish may overlap the next forward
    # only here (the interleaved timing above syncs after every step). Two rounds, configs
    # alternating, the faster block counts (host noise only ever adds time).
    back_to_back = {}
    b2b_inputs = [torch.randn(batch, seq, dim, generator=gen).to(device) for _ in range(iters)]
    for _round in range(2):
        for c in configs:
            model, opt = built[c]
            sync(device)
            t0 = time.perf_counter()
            for x in b2b_inputs:
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            sync(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters * 1e3], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            back_to_back[c] = min(back_to_back.get(c, math.inf), elapsed.item())
    del b2b_inputs

    replicate_info = {}  # read before profiling, so the counters cover the timed runs only
    for c in configs:
        if c.startswith("ours") and tp is not None:
            plan = dmuon.summarize_comm_plan(built[c][0]).get("tp") or {}
            keep = {k: v for k, v in plan.items() if k not in ("matrices", "scatter_async")}
            # the configuration's choice: the scatter left in flight for the next forward or not
            keep["replicate_async"] = bool(built[c][1].replicate_async)
            replicate_info[c] = {"tp_owners": keep}
            prof = dmuon.collect_forward_unshard_profile(built[c][0], synchronize=True)
            if prof.get("enabled") and "tp" in prof:
                # forward waits that applied a pending update scatter, and how many of them
                # found it unfinished (the part the previous compute did not hide)
                replicate_info[c]["tp_profile"] = prof["tp"]
        if c.startswith("ours") and hsdp:
            plan = dmuon.summarize_comm_plan(built[c][0]).get("replicate")
            if plan and plan.get("active"):
                replicate_info[c] = {"replicate_plan": plan}
                prof = dmuon.collect_forward_unshard_profile(built[c][0], synchronize=True)
                if prof.get("enabled"):
                    replicate_info[c]["replicate_profile"] = {
                        k: v
                        for k, v in prof["total"].items()
                        if k.startswith(("publish", "replicate"))
                    }

    profiles = {}
    if args.profile:
        ta = trace_analysis()
        wanted = (
            [c for c in args.profile_configs.split(",") if c]
            if args.profile_configs
            else list(configs)
        )
        save = {c for c in args.save_traces.split(",") if c}
        mesh_tag = (
            f"dp{world // tp}tp{tp}"
            if tp is not None
            else f"hsdp{replicas}x{world // replicas}"
            if hsdp
            else f"fsdp{world}"
        )
        if rank == 0:
            os.makedirs(args.profile, exist_ok=True)
            for c in wanted:
                if c not in configs:
                    print(
                        f"[bench_fsdp] not profiled: {c} (did not run)", file=sys.stderr, flush=True
                    )
        for c in [c for c in configs if c in wanted]:
            model, opt = built[c]
            inputs = [
                torch.randn(batch, seq, dim, generator=gen).to(device)
                for _ in range(args.profile_iters + 1)
            ]
            fd, tmp = tempfile.mkstemp(prefix=f"dmuon_trace_{c}_rank{rank}_", suffix=".json")
            os.close(fd)
            summary = None
            try:
                profile_iterations(model, opt, inputs, device, tmp)
                summary = ta.summarize(tmp, args.profile_iters)
                if rank == 0 and c in save:
                    dest = os.path.join(
                        args.profile, f"trace_{args.model}_{mesh_tag}_{c}_rank0.json.gz"
                    )
                    with open(tmp, "rb") as fin, gzip.open(dest, "wb") as fout:
                        shutil.copyfileobj(fin, fout)
                    summary["trace_file"] = dest
            except Exception as exc:  # noqa: BLE001 - a failed profile must not sink the timings
                summary = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                os.remove(tmp)
            frac = summary.get("exposed_fraction")
            worst = torch.tensor([-1.0 if frac is None else frac], device=device)
            ok = torch.tensor([0.0 if "error" in summary else 1.0], device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            worst, ok = worst.item(), ok.item()
            summary["exposed_fraction_max_over_ranks"] = worst if worst >= 0 else None
            if ok < 1.0 and "error" not in summary:
                summary["error"] = "profiling failed on another rank"
            profiles[c] = summary
            del inputs

    dim_, ffn, layers = MODELS[args.model]
    shape_args = (dim_, ffn, layers, world, KV_GROUPS.get(args.model, 1), MOE.get(args.model))
    floor = ns_floor_ms(*shape_args)
    roofline = ns_roofline_ms(*shape_args)
    flops = iteration_flops(args.model, batch, seq)  # per rank (per TP group with --tp)
    results = {}
    for c in configs:
        # Owner-load balance: every rank's own median step time, gathered (before the MAX below).
        local_step = torch.tensor([statistics.median(times[c]["step"]) * 1e3], device=device)
        per_rank = [torch.zeros_like(local_step) for _ in range(world)]
        dist.all_gather(per_rank, local_step)
        per_rank_ms = [float(t.item()) for t in per_rank]
        # on the process group's device: NCCL has no CPU backend
        it = torch.tensor(times[c]["iter"], device=device) * 1e3
        st = torch.tensor(times[c]["step"], device=device) * 1e3
        dist.all_reduce(it, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        dist.all_reduce(st, op=dist.ReduceOp.MAX)
        results[c] = {
            "iter_ms": statistics.median(it.cpu().tolist()),
            "model_tflop_per_s": flops / statistics.median(it.cpu().tolist()) / 1e9,
            "step_ms": statistics.median(st.cpu().tolist()),
            "peak_mem_gib": max(times[c]["peak"]) / 2**30 if times[c]["peak"] else None,
            "peak_fwd_bwd_gib": max(times[c]["peak_fb"]) / 2**30 if times[c]["peak_fb"] else None,
            "peak_step_gib": max(times[c]["peak_step"]) / 2**30 if times[c]["peak_step"] else None,
            "step_ms_per_rank": per_rank_ms,
            "step_balance": max(per_rank_ms) / (sum(per_rank_ms) / len(per_rank_ms)),
        }
        if c.startswith(("ours", "1d_ours")) and built[c] is not None:
            plan = dmuon.summarize_comm_plan(built[c][0]).get("balance")
            if plan:
                results[c]["planned_balance"] = plan
            results[c]["routed"] = routed(built[c][1])
        if c in back_to_back:
            results[c]["back_to_back_ms"] = back_to_back[c]
        results[c].update(replicate_info.get(c, {}))
        if c in profiles:
            worst = profiles[c].get("exposed_fraction_max_over_ranks")
            results[c]["exposed_comm_pct"] = worst * 100 if worst is not None else None
            results[c]["profile"] = profiles[c]
    for c, r in results.items():
        # Each mesh's configurations against that mesh's AdamW (1d_adamw when it ran).
        ref = "1d_adamw" if c.startswith("1d_") and "1d_adamw" in results else "adamw"
        base = results.get(ref, {}).get("iter_ms")
        base_b2b = results.get(ref, {}).get("back_to_back_ms")
        r["tax_against"] = ref if base else None
        r["muon_tax"] = r["iter_ms"] / base - 1 if base else None
        r["over_floor"] = (r["iter_ms"] - base) / floor if base and c != ref else None
        b2b = r.get("back_to_back_ms")
        r["b2b_muon_tax"] = b2b / base_b2b - 1 if base_b2b and b2b else None
        r["b2b_over_floor"] = (b2b - base_b2b) / floor if base_b2b and b2b and c != ref else None
        one_d = results.get(f"1d_{c}", {}).get("back_to_back_ms")
        if one_d and b2b:
            r["vs_1d"] = b2b / one_d  # same model and tokens per GPU, HSDP/TP mesh / 1-D mesh
    report = {
        "model": args.model,
        "dims": MODELS[args.model],
        "kv_groups": KV_GROUPS.get(args.model, 1),
        "moe": dict(zip(("experts", "hidden", "top_k"), MOE[args.model]))
        if args.model in MOE
        else None,
        "moe_impl": (args.moe_impl if args.model in MOE else None),
        "moe_impl_note": moe_note,
        "iter_tflop_per_rank": flops / 1e12,
        "world_size": world,
        "device": str(device),
        "mesh": {"dp": world // tp, "tp": tp}
        if tp is not None
        else {"replicate": replicas, "shard": world // replicas}
        if hsdp
        else {"shard": world},
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_per_rank": batch * seq,  # with --tp: per TP group (its ranks share the batch)
        "iters": iters,
        "warmup": warmup,
        "ns_floor_ms": floor,
        "ns_roofline_ms": roofline,
        "results": results,
        "skipped": skipped,
        "errors": errors,
        "profile_iters": args.profile_iters if args.profile else None,
        "memory_note": "peak = max allocated during the configuration's iteration, including the "
        "resident state of the other (interleaved) configurations",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if rank == 0:
        shape = (
            f"dp {world // tp} × tp {tp}"
            if tp is not None
            else f"HSDP {replicas}×{world // replicas}"
            if hsdp
            else f"1-D FSDP over {world}"
        )
        print(f"mesh: {shape}" + (" (1d_*: 1-D FSDP over all ranks)" if with_1d else ""))
        experts = (
            f"; MoE {MOE[args.model][0]} experts, top-{MOE[args.model][2]}, {args.moe_impl}"
            + (f" ({moe_note})" if moe_note else "")
            if args.model in MOE
            else ""
        )
        print(
            f"model {args.model}: {flops / 1e12:.3g} TFLOP per iteration per rank "
            f"({batch}×{seq} tokens, forward + backward matmuls){experts}"
        )
        print(
            f"NS floor {floor:.3g} ms per rank (FLOPs at {PEAK_FLOPS / 1e12:.0f} TF/s); the "
            f"products' roofline {roofline:.3g} ms (and their fewest bytes at "
            f"{HBM_BYTES_PER_S / 1e12:.2g} TB/s)"
        )
        print(
            "| config | iter ms | step ms | back-to-back ms | exposed comm % | peak GiB "
            "| Muon tax | "
            f"(iter−AdamW)/floor | b2b Muon tax | b2b (iter−AdamW)/floor |  NS floor {floor:.3g} ms"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c, r in results.items():
            peak = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "-"
            tax = f"{r['muon_tax'] * 100:+.1f}%" if r["muon_tax"] is not None else "-"
            ratio = f"{r['over_floor']:.2f}" if r["over_floor"] is not None else "-"
            b2b = f"{r['back_to_back_ms']:.2f}" if "back_to_back_ms" in r else "-"
            exposed = (
                f"{r['exposed_comm_pct']:.1f}" if r.get("exposed_comm_pct") is not None else "-"
            )
            b2b_tax = (
                f"{r['b2b_muon_tax'] * 100:+.1f}%" if r.get("b2b_muon_tax") is not None else "-"
            )
            b2b_ratio = f"{r['b2b_over_floor']:.2f}" if r.get("b2b_over_floor") is not None else "-"
            print(
                f"| {c} | {r['iter_ms']:.2f} | {r['step_ms']:.2f} | {b2b} | {exposed} | {peak} "
                f"| {tax} | {ratio} | {b2b_tax} | {b2b_ratio} |"
            )
            if r.get("peak_fwd_bwd_gib") is not None:
                print(
                    f"  {c} peak GiB: forward+backward {r['peak_fwd_bwd_gib']:.2f}, step "
                    f"{r['peak_step_gib']:.2f}"
                )
            if "replicate_profile" in r:
                print(f"  {c} replicate stage: {json.dumps(r['replicate_profile'])}")
            if "tp_owners" in r:
                print(f"  {c} TP stage: {json.dumps(r['tp_owners'])}")
            if "tp_profile" in r:
                print(f"  {c} TP scatter waits at forward: {json.dumps(r['tp_profile'])}")
        print(
            "model TFLOP/s per rank (iteration): "
            + ", ".join(f"{c} {r['model_tflop_per_s']:.4g}" for c, r in results.items())
        )
        for c, prof in profiles.items():
            print(f"profile {c} (rank 0, {args.profile_iters} back-to-back iterations):")
            if "error" in prof:
                print(f"- FAILED: {prof['error']}")
            else:
                print("\n".join(trace_analysis().format_summary(prof)))
            if prof.get("trace_file"):
                print(f"- trace: {prof['trace_file']}")
        for c, r in results.items():
            if c not in ("adamw", "1d_adamw"):
                planned = r.get("planned_balance", {}).get("ns_max_over_mean")
                planned = f", planned NS max/mean {planned:.3f}" if planned is not None else ""
                print(
                    f"balance {c}: measured step time max/mean over ranks {r['step_balance']:.3f} "
                    f"(target <= 1.05){planned}; per rank "
                    + " ".join(f"{t:.1f}" for t in r["step_ms_per_rank"])
                    + " ms"
                )
        for c, r in results.items():
            if "vs_1d" in r:
                print(
                    f"{'TP' if tp is not None else 'HSDP'} vs 1-D, {c}: back-to-back "
                    f"{r['back_to_back_ms']:.2f} / {results['1d_' + c]['back_to_back_ms']:.2f} ms "
                    f"= {r['vs_1d']:.3f}x" + ("" if tp is not None else " (target <= 1.03x)")
                )
        if tp is not None:
            for c, r in results.items():
                if c.startswith("ours") and r.get("over_floor") is not None:
                    scatter = r.get("profile", {}).get("tp_scatter_hidden_fraction")
                    hidden = f"{scatter * 100:.1f}%" if scatter is not None else "-"
                    b2b = r.get("b2b_over_floor")
                    b2b = f"{b2b:.2f}" if b2b is not None else "-"
                    print(
                        f"TP {tp}, {c}: Muon tax / NS floor {r['over_floor']:.2f} (back to back "
                        f"{b2b}; target <= 1.3), TP scatter hidden under the next forward "
                        f"{hidden} (target >= 90% with replicate_async=True)"
                    )
        for c, why in skipped.items():
            print(f"skipped {c}: {why}")
        for c, why in errors.items():
            print(f"FAILED {c}: {why}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    for c in configs:
        if c.startswith("ours") and built[c] is not None:
            dmuon.wait_all_replicate_broadcasts(built[c][0])
    # Free the models (reference cycles) while the interpreter is alive: left to the collector at
    # exit, a gloo worker thread can take the GIL during finalization and abort the process.
    built.clear()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
