"""GPU memory of an NCCL communicator: what each process group the runtime creates costs.

    python benchmarks/comm_memory.py                                   # one GPU, world size 1
    torchrun --standalone --nproc_per_node 2 benchmarks/comm_memory.py # peers: buffers per peer

For the default group and then ``--groups`` new groups over every rank (what
``dedicate_params`` creates per mesh dim: README, Communicators), each measured alone: the
device's used memory (``torch.cuda.mem_get_info``: it sees NCCL's own allocations, which
PyTorch's allocator does not) before, and after creating the group and warming it with an
``all_reduce`` and a ``broadcast`` (NCCL connects lazily, at the first collective). The
allocator's reserved bytes are subtracted, so the line is the communicator's own cost. One line
per measurement (rank 0), ``key=value`` fields. On one process a communicator has no peers:
the per-peer buffers appear only with torchrun on several GPUs. Needs CUDA; on a machine
without it the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

MIB = 2**20


def used_bytes() -> tuple[int, int]:
    """(device memory in use by anything, bytes PyTorch's allocator has reserved)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free, torch.cuda.memory_reserved()


def warm(group, device) -> None:
    """The first collectives on ``group``: NCCL creates and connects the communicator here."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1024, device=device)
    dist.all_reduce(x, group=group)
    dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    torch.cuda.synchronize()


def measure(label: str, make, device) -> dict:
    before, reserved_before = used_bytes()
    t0 = time.perf_counter()
    group = make()
    warm(group, device)
    seconds = time.perf_counter() - t0
    after, reserved_after = used_bytes()
    own = (after - before) - (reserved_after - reserved_before)
    return {"what": label, "mib": own / MIB, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3, help="new groups to create (default 3)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "comm_memory.py needs CUDA (an NCCL communicator lives on a GPU); "
            "run it on a GPU machine: python benchmarks/comm_memory.py",
            file=sys.stderr,
        )
        return 2
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.ones(1, device=device)  # the CUDA context exists before the first measurement

    def default_group():
        # No device_id: NCCL connects at the first collective. Plain python: a one-process
        # job on an in-memory store (no port); torchrun: its environment.
        if "RANK" in os.environ:
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD

    rows = [measure("default_group", default_group, device)]
    ranks = list(range(dist.get_world_size()))
    for i in range(args.groups):
        rows.append(measure(f"new_group_{i + 1}", lambda: dist.new_group(ranks), device))
    if dist.get_rank() == 0:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        for row in rows:
            print(
                f"comm_memory what={row['what']} world={len(ranks)} mib={row['mib']:.1f} "
                f"seconds={row['seconds']:.2f} gpu={torch.cuda.get_device_name(device)!r} "
                f"nccl={nccl} torch={torch.__version__}"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
