"""The communicators ``dedicate_params`` creates, per layout, and the timeout each one gets.

The README's Communicators table, checked: ``dist.new_group`` is counted while each layout is
built and trained one step (the groups this rank is a member of: each is one NCCL communicator
on a GPU). The runtime has a group of its own for each mesh dim FSDP2 issues collectives on
(shard, replicate) and uses the TP mesh's group for the TP stage (FSDP2 issues nothing there).
Every group it creates has the default group's timeout, or ``dedicate_params(timeout=...)``;
the mesh's sub-groups keep torch's default unless the mesh is built with ``backend_override``
options (what the README's timeout table says). One 4-rank run covers every layout.
"""

from __future__ import annotations

import datetime

import pytest

from . import models
from .harness import run_ranks_with_victim
from .test_tp import build_tp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(480)]

PG_TIMEOUT_S = 177.0  # the user's init_process_group(timeout=...): unlike torch's defaults
OWN_TIMEOUT_S = 163.0  # dedicate_params(timeout=...)

# The README table: (size of each group a rank creates), 4 ranks.
EXPECTED = {
    "1-D 4": [4],  # a second world-size group beside the mesh's (the default group)
    "HSDP 2x2": [2, 2],  # shard, replicate
    "dp 2 x tp 2": [2],  # DP; the TP stage runs on the TP mesh's group
    "HSDP x TP 2x1x2": [1, 2],  # shard (one rank), replicate
    "1-D 4, timeout=": [4],
}


def _build(layout: str, rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    if layout.startswith("dp") or layout.startswith("HSDP x TP"):
        replicas = 2 if layout.startswith("HSDP") else 1
        model, dp_rank = build_tp(rank, world, 2, 2, replicas)
        return model, 2, dp_rank
    model = models.build_llama()
    kwargs = {"predicate": models.proj_predicate}
    if layout.startswith("HSDP"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh["shard"], replicate_mesh=mesh["replicate"], **kwargs)
    else:
        mesh = init_device_mesh("cpu", (world,))
        if "timeout=" in layout:
            kwargs["timeout"] = datetime.timedelta(seconds=OWN_TIMEOUT_S)
        dmuon.dedicate_params(model, mesh, **kwargs)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, world, rank


def _count_groups(rank, world):
    import torch.distributed as dist

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._comm import collectives as C

    from .test_tp import _muon

    created: list = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        group = new_group(*args, **kwargs)
        ranks = kwargs.get("ranks", args[0] if args else None)
        if ranks is not None and rank in ranks:
            created.append(group)
        return group

    out = {}
    for layout in EXPECTED:
        C._PRIVATE_GROUPS[:] = [None, {}]  # each layout as a fresh job would build it
        created.clear()
        dist.new_group = counting
        try:
            model, dp, dp_rank = _build(layout, rank, world)
            opt = _muon(model)
            x = models.batches(1, dp)[0]
            per = x.shape[0] // dp
            model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
            opt.step()
        finally:
            dist.new_group = new_group
        runtime = dedicated_runtime(model)
        tp = runtime.tp
        out[layout] = {
            "sizes": sorted(dist.get_world_size(g) for g in created),
            "timeouts": [C.group_timeout(g).total_seconds() for g in created],
            "runtime_uses_created": runtime.groups[0].pg in created,
            "tp_on_mesh_group": tp is None or tp.pg is tp.info.mesh.get_group(),
        }
        dmuon.wait_all_replicate_broadcasts(model)
        dist.barrier()
    out["mesh"] = _mesh_timeouts()
    return out


def _mesh_timeouts() -> dict:
    """A 2-D mesh's sub-groups: torch's default timeout; the user's with ``backend_override``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon_compile.distributed._comm import collectives as C

    names = ("replicate", "shard")
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = C.default_timeout()
    timed = init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=names, backend_override={n: options for n in names}
    )
    return {
        "plain": [C.group_timeout(plain[n].get_group()).total_seconds() for n in names],
        "backend_override": [C.group_timeout(timed[n].get_group()).total_seconds() for n in names],
    }


def test_communicators_per_layout_and_their_timeouts():
    out = run_ranks_with_victim(_count_groups, 4, -1, timeout=400, pg_timeout_s=PG_TIMEOUT_S)
    for rank, res in out.items():
        for layout, sizes in EXPECTED.items():
            got = res[layout]
            assert got["sizes"] == sorted(sizes), (rank, layout, got)
            assert got["runtime_uses_created"], (rank, layout)
            assert got["tp_on_mesh_group"], (rank, layout)
            want = OWN_TIMEOUT_S if "timeout=" in layout else PG_TIMEOUT_S
            assert got["timeouts"] == [want] * len(sizes), (rank, layout, got)
        # The control: a torch mesh sub-group does not take the user's timeout by itself.
        assert all(t != PG_TIMEOUT_S for t in res["mesh"]["plain"]), res["mesh"]
        assert res["mesh"]["backend_override"] == [PG_TIMEOUT_S] * 2, res["mesh"]
