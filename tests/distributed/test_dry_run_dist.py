"""The dry run equals the real run: owners, per-rank owned bytes, HSDP copies, FSDP2 shards and
the dedicated collectives' bytes of ``dedicate_params`` on 4 gloo ranks, 1-D over 4 and HSDP
2 × 2 (one spawn), against ``dmuon_compile.plan.dry_run`` of the same model in this process;
and ``dry_run(ep=...)`` against expert-parallel runs in torchtitan's layout (another spawn)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

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


# ----------------------------------------------------------------------------- expert parallelism
# (experts, ep) on 4 ranks, torchtitan's expert FSDP rule: 6 experts, ep 2 -> Shard(0) of 3 local
# experts over 2 (uneven: 2 and 1); 2 experts, ep 2 -> Shard(1) (2 · 2 > 2): whole experts only
# after the reshard; 2 experts, no EP -> Shard(1) over the 4 ranks.
EP_CASES = ((6, 2), (2, 2), (2, 1))
EP_HIDDEN = 12  # FSDP2 refuses an uneven Shard(1): the rows divide over 2 and 4


class _EPBlock(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        from . import moe_models

        self.router = nn.Linear(moe_models.D, experts, bias=False)
        self.experts = moe_models.GroupedExperts(moe_models.D, EP_HIDDEN, experts)
        self.proj = nn.Linear(moe_models.D, moe_models.D, bias=False)

    def forward(self, x):
        return x + self.proj(self.experts(x, self.router(x).softmax(-1)))


class _EPModel(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EPBlock(experts) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _build_ep_model(experts: int) -> nn.Module:
    torch.manual_seed(0)
    return _EPModel(experts)


def _placement_kind(pl) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(pl, Shard):
        return ("S", pl.dim)
    if isinstance(pl, Replicate):
        return ("R", None)
    return (repr(pl), None)


def _transforms(p) -> dict:
    """DTensor's own plan for the step's reshard of ``p`` to whole experts and back."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from dmuon_compile.distributed._stages.expert_shards import whole_expert_placements

    src = p._spec
    dst = DTensorSpec(src.mesh, whole_expert_placements(p.placements), tensor_meta=src.tensor_meta)

    def steps(infos):
        return [
            (t.mesh_dim, *map(_placement_kind, t.src_dst_placements), list(t.logical_shape))
            for t in infos
        ]

    return {
        "there": steps(_gen_transform_infos(src, dst)),
        "back": steps(_gen_transform_infos(dst, src)),
        "mesh": list(src.mesh.shape),
        "coord": list(src.mesh.get_coordinate()),
        "item": p.element_size(),
    }


def _real_ep(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es
    from dmuon_compile.distributed.step_plan import PLAIN_STEP

    from . import moe_models
    from .harness import train_steps

    out = {}
    for experts, ep in EP_CASES:
        model = _build_ep_model(experts)
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fsdp_mesh = dp
        if ep > 1:
            mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
            moe_models.make_expert_parallel(model, mesh["ep"])
            fsdp_mesh = mesh["efsdp"]
        dmuon.dedicate_params(model, dp)
        # torchtitan's rule (torchtitan/distributed/fsdp.py): Shard(1) when efsdp · ep > E
        dim = 1 if world > experts else 0
        for block in model.layers:
            fully_shard(block.experts, mesh=fsdp_mesh, shard_placement_fn=lambda _, d=dim: Shard(d))
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
        ns = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)
        opt = dmuon.Muon(model, ns_backend=ns, lr=0.02, compile=False)
        x = torch.randn(world * 4, moe_models.D, generator=torch.Generator().manual_seed(1))
        train_steps(model, opt, [x], rank, world)  # one real step: the momentum buffers exist
        stacks = [p for n, p in model.named_parameters() if ".experts." in n]
        lay = dmuon.Layout.experts()
        got = {"weights": 0, "momentum": 0, "whole": 0, "reshards": [], "dims": set()}
        got["sent"] = got["received"] = 0
        stages = opt._with_stages(PLAIN_STEP).stages  # the step's ExpertReshardStage, if any
        loads = stages[-1].dedicated_loads() if stages else {}
        walk = es.ExpertWalk(loads)  # one walk over the stacks, as a step's
        for p in stacks:
            got["weights"] += p.to_local().numel() * p.element_size()
            m = opt.state[p]["momentum_buffer"]
            got["momentum"] += m.to_local().numel() * m.element_size()
            got["dims"].add(str(p.placements))
            if not es.needs_reshard(p, lay):
                got["whole"] += p.to_local().shape[0]
                continue
            seen = []  # the experts the step's own reshard hands this rank's Newton–Schulz

            def record(mats, lays, seen=seen):
                seen.append(mats[0].shape[0])
                return mats

            def all_to_all(out, inp, out_splits, in_splits, group, got=got):
                me, item = torch.distributed.get_rank(group), inp.element_size()
                got["sent"] += (sum(in_splits) - in_splits[me]) * item
                got["received"] += (sum(out_splits) - out_splits[me]) * item
                original(out, inp, out_splits, in_splits, group)

            original, es._all_to_all = es._all_to_all, all_to_all
            try:  # what the step's own reshard sends
                es.orthogonalize_resharded([p], [p.to_local().detach()], [lay], record, walk)
            finally:
                es._all_to_all = original
            got["whole"] += sum(seen)
            got["reshards"].append(_transforms(p))  # the control: DTensor's own plan
        got["dims"] = sorted(got["dims"])
        out[(experts, ep)] = got
    return out


def _piece(n: int, k: int, i: int) -> int:
    size = -(-n // k)
    return max(0, min(size, n - i * size))


def _redistributed(steps: list, mesh: list, coord: list) -> int:
    """Elements a rank receives in DTensor's redistribution steps: an all-gather the other
    chunks (padded to the largest), an all-to-all its new chunk less what it held."""
    total = 0
    for mesh_dim, src, dst, shape in steps:
        n, c = mesh[mesh_dim], coord[mesh_dim]
        numel = math.prod(shape)
        if src[0] == "S" and dst[0] == "R":
            total += (n - 1) * -(-shape[src[1]] // n) * numel // shape[src[1]]
        elif src[0] == "S" and dst[0] == "S":
            d0, d1 = src[1], dst[1]
            others = numel // (shape[d0] * shape[d1])
            total += _piece(shape[d1], n, c) * (shape[d0] - _piece(shape[d0], n, c)) * others
        else:
            assert src[0] == "R" and dst[0] == "S", (src, dst)  # a local chunk
    return total


def test_dry_run_ep_equals_the_real_expert_parallel_run():
    """Per rank: the expert stacks' local weights and momentum, the whole experts the step's
    reshard gives Newton–Schulz, and the bytes its all-to-alls send equal ``dry_run(ep=...)``'s;
    the plain-FSDP2 dry run (no ep) misses them, and DTensor's redistribution (the reference
    path) would move more on the EP layout (the controls)."""
    from dmuon_compile.newton_schulz import NewtonSchulz
    from dmuon_compile.plan import dry_run

    results = run_ranks(_real_ep, WORLD, timeout=110)
    for experts, ep in EP_CASES:
        kw = dict(param_dtype=None, reduce_dtype=None, ns=NewtonSchulz())
        report = dry_run(_build_ep_model(experts), WORLD, ep=ep, **kw)
        plain = dry_run(_build_ep_model(experts), WORLD, **kw)
        case = (experts, ep)
        assert report.expert_layout["shard_dims"] == [1 if WORLD > experts else 0], case
        missed, totals = 0, [0, 0]
        for rank, got in enumerate(results):
            real, row = got[case], report.rows[rank]
            assert row.sharded_muon_bytes == real["weights"] + real["momentum"], (case, rank)
            assert row.expert_matrices == real["whole"], (case, rank, real["dims"])
            assert (row.expert_ns_ms > 0) == (real["whole"] > 0), (case, rank)
            assert real["sent"] == real["received"], (case, rank)  # a round trip
            assert row.expert_reshard_comm_bytes == real["received"], (case, rank)
            redistribute = sum(  # the reference path's bytes: DTensor's plan
                (
                    _redistributed(r["there"], r["mesh"], r["coord"])
                    + _redistributed(r["back"], r["mesh"], r["coord"])
                )
                * r["item"]
                for r in real["reshards"]
            )
            if not real["reshards"]:  # Shard(0): nothing to reshard either way
                assert redistribute == real["received"] == 0, (case, rank)
            elif ep > 1:  # the control: DTensor's plan all-gathers over ep first
                assert redistribute > real["received"], (case, rank, real["reshards"][:1])
            else:  # without EP: the same exchange, only who gets which experts differs
                totals[0] += redistribute
                totals[1] += real["received"]
            missed += plain.rows[rank].sharded_muon_bytes != row.sharded_muon_bytes
            missed += plain.rows[rank].expert_matrices != row.expert_matrices
        assert totals[0] == totals[1], (case, totals)
        assert missed, f"{case}: the plain-FSDP2 dry run should not match an EP run"
        assert sum(g[case]["whole"] for g in results) == 2 * 3 * experts  # each expert once
    assert any(g[(2, 2)]["reshards"] for g in results)  # the Shard(1) cases reshard
