"""Collective bandwidth between the GPUs of this machine (context for the §B iteration times).

    torchrun --standalone --nproc_per_node 2 benchmarks/nccl_probe.py

Times all_gather / reduce_scatter / all_reduce / broadcast / reduce on bf16 and fp32 buffers
(median of CUDA-event-timed repeats after warm-up) and prints algorithm bandwidth (bytes of
the full buffer / time) and NCCL's "bus bandwidth" convention (all_gather, reduce_scatter:
×(n−1)/n; all_reduce: ×2(n−1)/n; broadcast, reduce: ×1), so a reader can tell an NVLink
machine (hundreds of GB/s) from a PCIe one (tens) before reading the FSDP numbers.
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
