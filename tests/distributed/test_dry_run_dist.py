"""The dry run equals the real run: owners, per-rank owned bytes, HSDP copies, FSDP2 shards and
the dedicated collectives' bytes of ``dedicate_params`` on 4 gloo ranks, 1-D over 4 and HSDP
2 × 2 (one spawn), against ``dmuon_compile.plan.dry_run`` of the same model in this process."""

from __future__ import annotations

import pytest

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD = 4


def _received(op: dict, world: int, shard_rank: int) -> int:
    """Bytes a rank receives (all-gather) or hands on (reduce-scatter) in one collective."""
    if "bytes_per_rank" in op:  # uneven chunks: everything but its own
        return op["bytes"] - op["bytes_per_rank"][shard_rank]
    return op["bytes"] - op["bytes"] // world  # padded chunks: world - 1 of them


def _real(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    out = {}
    for layout, shape in (("1d", (world,)), ("hsdp", (2, world // 2))):
        model = models.build_llama()
        if layout == "1d":
            mesh = init_device_mesh("cpu", shape)
            owners = dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
        else:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            owners = dmuon.dedicate_params(
                model,
                mesh["shard"],
                predicate=models.proj_predicate,
                replicate_mesh=mesh["replicate"],
            )
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = dmuon.summarize_param_groups(model)["params"]
        comm = dmuon.summarize_comm_plan(model)
        shard_world, shard_rank = comm["world_size"], comm["rank"]
        dedicated_comm = replicate_comm = 0
        for g in comm["groups"]:
            unshards = 2 if g["reshard_after_forward"] else 1
            (gather,), (reduce,) = g["unshard"], g["reduce"]
            if shard_world > 1:
                dedicated_comm += unshards * _received(gather, shard_world, shard_rank)
                dedicated_comm += _received(reduce, shard_world, shard_rank)
            rep = g.get("replicate")
            if rep is not None:
                replicate_comm += sum(op["bytes"] for op in rep["reduce"] + rep["publish"])
        out[layout] = {
            "owners": owners,
            "owned": sum(r["bytes"] for r in rows if r.get("owned_here")),
            "replica": sum(r["bytes"] for r in rows if r.get("replica_here")),
            "fsdp_local": sum(r["local_bytes"] for r in rows if r["owner"] is None),
            "dedicated_comm": dedicated_comm,
            "replicate_comm": replicate_comm,
        }
    return out


def test_dry_run_equals_the_real_run_1d_and_hsdp():
    from dmuon_compile.newton_schulz import NewtonSchulz
    from dmuon_compile.plan import dry_run

    results = run_ranks(_real, WORLD, timeout=90)
    for layout, replicas in (("1d", 1), ("hsdp", 2)):
        # This machine's NewtonSchulz prices the plan, as dedicate_params does on it; no
        # mixed-precision policy, as the real run has none.
        report = dry_run(
            models.build_llama(),
            WORLD,
            replicate_size=replicas,
            predicate=models.proj_predicate,
            param_dtype=None,
            reduce_dtype=None,
            ns=NewtonSchulz(),
        )
        for rank, got in enumerate(results):
            real, row = got[layout], report.rows[rank]
            assert report.owners == real["owners"], (layout, rank)
            assert row.dedicated_bytes == 2 * real["owned"], (layout, rank)  # master + momentum
            assert row.replica_bytes == real["replica"], (layout, rank)
            assert row.adamw_bytes == 3 * real["fsdp_local"], (layout, rank)
            assert row.dedicated_comm_bytes == real["dedicated_comm"], (layout, rank)
            assert row.replicate_comm_bytes == real["replicate_comm"], (layout, rank)
        owned = [got[layout]["owned"] for got in results]
        assert sum(owned) > 0 and sum(r.ns_ms > 0 for r in report.rows) == sum(map(bool, owned))
    assert results[0]["hsdp"]["replica"] > 0  # the 2 × 2 run has column copies to compare
