"""Trainer steps of a torchtitan Llama-3 model with dmuon against torchtitan's AdamW.

The job a torchtitan user runs after the README's two config lines (torchtitan section):
torchtitan's model (meta-device build), ``ParallelDims`` meshes, ``parallelize_llama`` (FSDP2
with bf16 mixed precision, optional per-block compile) wrapped by ``dmuon_tt.dedicating``,
``to_empty`` + ``init_weights``, and ``MuonOptimizers``; the AdamW run uses torchtitan's own
``OptimizersContainer`` (``default_adamw``). Both train the same synthetic next-token data
(a fixed random bigram table: the loss can fall well below ln(vocab)) from the same seed.
Prints per-step losses and times, then a summary (median step time after warm-up, last loss).
``--momentum-dtype {fp32,bf16,int8}`` stores dmuon's Muon momentum in fp32 (the default), bf16
or blockwise 8-bit (``MuonOptimizers.Config.momentum_dtype``; AdamW's run is unchanged).

One process on one GPU::

    PYTHONPATH=. python benchmarks/torchtitan_steps.py --steps 50

One process on the CPU (gloo, one rank), dmuon only, bf16 momentum, a loss every step::

    PYTHONPATH=. python benchmarks/torchtitan_steps.py --device cpu --optimizers dmuon \
        --momentum-dtype bf16 --print-every 1 --steps 300

Several ranks (NCCL, one GPU each; or gloo ranks sharing cuda:0 with ``--backend gloo``)::

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/torchtitan_steps.py --steps 50

torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) at
module level; on an older torch this script installs a placeholder first (the class is only
used by torchtitan's ``full_dtensor``/``spmd_types`` backends, never by ``partial_dtensor``).
The model's FlexAttention is replaced by causal SDPA (``--attention flex`` keeps it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist


def _torchtitan_on_this_torch() -> None:
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):  # torch < 2.12: see the module docstring

        @dataclasses.dataclass
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims


class CausalSDPA(torch.nn.Module):
    """Causal SDPA on torchtitan's inner-attention layout (B, L, heads, head_dim)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


def bigram_batches(vocab: int, batch: int, seq: int, steps: int, device, seed: int = 0):
    """Sequences from a fixed random bigram table (each token has 4 likely successors)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            x[:, t + 1] = successors[x[:, t], pick]
        noise = torch.rand(batch, seq + 1, generator=g) < 0.1
        x[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
        out.append(x.to(device))
    return out


def build(args, use_dmuon: bool, dims, device):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    spec = model_registry(args.flavor)
    if args.layers:
        spec.model.layers = spec.model.layers[: args.layers]
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = spec.model.build()
    if args.attention == "sdpa":
        for block in model.layers.values():
            block.attention.inner_attention = CausalSDPA()
    parallelize = dmuon_tt.dedicating(spec.parallelize_fn) if use_dmuon else spec.parallelize_fn
    model = parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(
            mixed_precision_param=args.param_dtype, mixed_precision_reduce="float32"
        ),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=args.compile, components=["model"]),
        ac_config=None,
        dump_folder="/tmp/torchtitan_steps",
    )
    if device.type != "cuda":  # gloo has no PREMUL_SUM, FSDP2's reduce op
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if use_dmuon:
        config = dmuon_tt.MuonOptimizers.Config(
            lr=args.lr, adamw_lr=args.adamw_lr, momentum_dtype=args.momentum_dtype
        )
    else:
        config = default_adamw(lr=args.adamw_lr)
        config.implementation = "fused" if device.type == "cuda" else "for-loop"
    opts = config.build(model_parts=[model])
    assert isinstance(opts, OptimizersContainer)
    return model, opts


def run(args, use_dmuon: bool, dims, device, batches, rank: int, world: int):
    model, opts = build(args, use_dmuon, dims, device)
    per = args.batch // world
    global_tokens = args.batch * args.seq
    losses, times = [], []
    for i, batch in enumerate(batches):
        x = batch[rank * per : (rank + 1) * per]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum"
            )
            / global_tokens
        )  # torchtitan's loss: FSDP2 sums gradients (apply_fsdp_to_decoder)
        loss.backward()
        opts.step()
        opts.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(total.item())
        if rank == 0 and (i % args.print_every == 0 or i == len(batches) - 1):
            name = "dmuon" if use_dmuon else "adamw"
            print(
                f"[{name}] step {i:4d} loss {losses[-1]:.4f} {times[-1] * 1e3:8.1f} ms", flush=True
            )
    del model, opts
    return losses, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel", help="torchtitan llama3 flavor")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median time")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.02, help="Muon lr")
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument(
        "--momentum-dtype",
        default="fp32",
        choices=["fp32", "bf16", "int8"],
        help="dmuon's Muon momentum storage (int8: blockwise 8-bit)",
    )
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compile", action="store_true", help="torchtitan's per-block compile")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "flex"])
    p.add_argument("--backend", default=None, help="nccl (default on CUDA) or gloo")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--optimizers", default="adamw,dmuon")
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    _torchtitan_on_this_torch()
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        index = local if backend == "nccl" else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    parallel_dims_module.device_type = device.type  # torchtitan says "cuda" without a GPU
    dist.init_process_group(backend, rank=rank, world_size=world)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")

    from torchtitan.models.llama3 import model_registry

    vocab = model_registry(args.flavor).model.vocab_size
    batches = bigram_batches(vocab, args.batch, args.seq, args.steps, device)
    summary = {}
    for name in args.optimizers.split(","):
        losses, times = run(args, name == "dmuon", dims, device, batches, rank, world)
        steady = times[args.warmup :] or times
        summary[name] = (statistics.median(steady), losses[0], losses[-1], min(losses))
    if rank == 0:
        tokens = args.batch * args.seq
        print(
            f"\ntorch {torch.__version__}, {args.flavor} (layers {args.layers or 'all'}), world "
            f"{world} {backend} on {device.type}, batch {args.batch} x seq {args.seq}, "
            f"{args.param_dtype}, compile={args.compile}, {args.steps} steps, dmuon momentum "
            f"{args.momentum_dtype}"
        )
        head = ("optimizer", "median ms", "tok/s", "loss 0", "last", "min")
        print(" ".join(f"{h:>10}" for h in head))
        for name, (t, first, last, best) in summary.items():
            print(
                f"{name:>10} {t * 1e3:10.1f} {tokens / t:10.0f} {first:10.4f} {last:10.4f} "
                f"{best:10.4f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
