"""Collective bandwidth between the GPUs of this machine (context for the §B iteration times).

    torchrun --standalone --nproc_per_node 2 benchmarks/nccl_probe.py

Times all_gather / reduce_scatter / all_reduce / broadcast / reduce on bf16 and fp32 buffers
(median of CUDA-event-timed repeats after warm-up) and prints algorithm bandwidth (bytes of
the full buffer / time) and NCCL's "bus bandwidth" convention (all_gather, reduce_scatter:
×(n−1)/n; all_reduce: ×2(n−1)/n; broadcast, reduce: ×1), so a reader can tell an NVLink
machine (hundreds of GB/s) from a PCIe one (tens) before reading the FSDP numbers.

A second table times one hook group whose owners hold different byte counts: a Llama-3 8B layer
(d = 4096, grouped-query k/v, bf16) split by the owner plan over this many ranks, moved by each
alternative — padded all-gather / reduce-scatter, the uneven list all-gather / reduce-scatter
(what the runtime uses: NCCL runs them as one group of broadcasts / reduces), one broadcast /
reduce per owner (one launch each), and ``all_to_all_single`` with splits.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for mib in (16, 256):
            numel = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
            numel -= numel % world
            full = torch.randn(numel, device="cuda").to(dtype)
            part = torch.empty(numel // world, device="cuda", dtype=dtype)
            nbytes = full.numel() * full.element_size()
            cases = {
                "all_gather": (
                    lambda: dist.all_gather_into_tensor(full, part),
                    (world - 1) / world,
                ),
                "reduce_scatter": (
                    lambda: dist.reduce_scatter_tensor(part, full),
                    (world - 1) / world,
                ),
                "all_reduce": (lambda: dist.all_reduce(full), 2 * (world - 1) / world),
                "broadcast": (lambda: dist.broadcast(full, src=0), 1.0),
                "reduce": (lambda: dist.reduce(full, dst=0), 1.0),
            }
            for name, (fn, factor) in cases.items():
                t = timed(fn)
                rows.append(
                    (
                        name,
                        str(dtype).replace("torch.", ""),
                        mib,
                        t * 1e3,
                        nbytes / t / 1e9,
                        nbytes * factor / t / 1e9,
                    )
                )
    uneven = uneven_group_rows(rank, world)
    if rank == 0:
        print(
            f"NCCL probe: {world} ranks, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
        print("| collective | dtype | MiB | ms | algbw GB/s | busbw GB/s |")
        print("|---|---|---|---|---|---|")
        for name, dt, mib, ms, alg, bus in rows:
            print(f"| {name} | {dt} | {mib} | {ms:.3f} | {alg:.1f} | {bus:.1f} |")
        print()
        print("Uneven hook group: one Llama-3 8B layer (bf16), chunks per rank (MiB):", end=" ")
        print(", ".join(f"{n * 2 / 2**20:.0f}" for n in uneven["chunks"]))
        print("| alternative | launches | MiB received by rank 0 | ms |")
        print("|---|---|---|---|")
        for name, launches, mib, ms in uneven["rows"]:
            print(f"| {name} | {launches} | {mib:.0f} | {ms:.3f} |")
    dist.destroy_process_group()


def uneven_group_rows(rank: int, world: int) -> dict:
    """Time the alternatives for one group of uneven owner chunks (see the module docstring)."""
    from dmuon_compile.distributed.owner_plan import llama_matrix_specs, plan_owners

    d = 4096
    plan = plan_owners(llama_matrix_specs(1, d, 14336, d // 4), world)
    chunks = [0] * world
    for e in plan.entries:
        chunks[e.owner] += e.bytes // 4
    total, widest = sum(chunks), max(chunks)
    bases = [sum(chunks[:r]) for r in range(world)]
    dt = torch.bfloat16
    flat = torch.randn(total, device="cuda").to(dt)
    views = [flat[b : b + n] for b, n in zip(bases, chunks)]
    padded = torch.empty(widest * world, device="cuda", dtype=dt)
    send = torch.randn(widest, device="cuda").to(dt)
    a2a_in = torch.randn(chunks[rank] * world, device="cuda").to(dt)
    out = torch.empty(chunks[rank], device="cuda", dtype=dt)
    owners = [r for r in range(world) if chunks[r]]
    mib = 2 / 2**20
    got = (total - chunks[rank]) * mib  # what an exact (unpadded) collective delivers here
    cases = [
        ("padded all_gather_into_tensor", 1, (world - 1) * widest * mib,
         lambda: dist.all_gather_into_tensor(padded, send)),
        ("uneven all_gather (list)", 1, got, lambda: dist.all_gather(views, views[rank])),
        ("broadcast per owner", len(owners), got,
         lambda: [dist.broadcast(views[r], src=r) for r in owners]),
        ("all_to_all_single (splits)", 1, got,
         lambda: dist.all_to_all_single(flat, a2a_in, chunks, [chunks[rank]] * world)),
        ("padded reduce_scatter_tensor", 1, (world - 1) * widest * mib,
         lambda: dist.reduce_scatter_tensor(send, padded)),
        ("uneven reduce_scatter (list)", 1, got, lambda: dist.reduce_scatter(out, views)),
        ("reduce per owner", len(owners), got,
         lambda: [dist.reduce(views[r], dst=r) for r in owners]),
    ]  # fmt: skip
    rows = [(name, n, m, timed(fn) * 1e3) for name, n, m, fn in cases]
    return {"chunks": chunks, "rows": rows}


if __name__ == "__main__":
    main()
