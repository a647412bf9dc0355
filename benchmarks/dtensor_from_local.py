"""Host time of one ``DTensor.from_local`` with a ``Partial`` gradient placement on a 2-D mesh:
what torchtitan's ``full_dtensor`` backend costs per dedicated weight per forward
(``integrations/torchtitan.py``: the compute copy's stand-in). One process, gloo, CPU.

    python benchmarks/dtensor_from_local.py [--calls 2000] [--size 256]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    x = torch.randn(args.size, args.size, requires_grad=True)
    start = time.perf_counter()
    for _ in range(args.calls):
        DTensor.from_local(
            x,
            mesh,
            [Replicate(), Replicate()],
            shape=x.shape,
            stride=x.stride(),
            grad_placements=[Partial(), Replicate()],
        )
    us = (time.perf_counter() - start) / args.calls * 1e6
    print(f"DTensor.from_local: {us:.1f} us per call ({args.calls} calls)")
    print(f"torch {torch.__version__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
