"""Split Newton–Schulz in training: ``dedicate_params(..., split_size=2)`` on 4 gloo ranks.

A one-layer model whose three FFN matrices each cost more Newton–Schulz than a rank's balanced
share: the planner splits each over an aligned pair of ranks (its owner the pair's first), the
step scatters the owner's Nesterov input to the pair, orthogonalises it together and gathers
the result back. Trained 4 steps, 1-D over 4 and HSDP 2 × 2, it equals one process with the
reference Muon (fp32 NS, the tolerances of test_dedicated_training). Control: the same run with
each rank orthogonalising its piece alone (the wrong, block-wise math) ends far from the
reference, so the comparison sees the split path's math.
"""

from __future__ import annotations

import json

import pytest
import torch

from . import models
from .harness import full_state, run_ranks
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 4
SHAPE = {"layers": 1, "ffn": 1024}  # FFN matrices 1024×32: each ~40% of the NS FLOPs
FFN = [f"layers.0.mlp.{m}_proj.weight" for m in ("down", "gate", "up")]


def reference(world: int):
    import dmuon_compile as dmuon

    model = models.build_llama(**SHAPE)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False, **HYPER
    )
    losses = []
    for x in models.batches(STEPS, world):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, blockwise: bool, hsdp: bool = False):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import split_step as _split_step

    calls = []
    real = _split_step.split_newton_schulz

    def counted(block, ns, group, **kw):
        calls.append(tuple(block.shape))
        if blockwise:  # control: each rank's piece orthogonalised alone
            return ns(block)
        return real(block, ns, group, **kw)

    _split_step.split_newton_schulz = counted
    model = models.build_llama(**SHAPE)
    if hsdp:  # 2 × 2: the split pairs are slots of the whole job (replica 0's pair, replica 1's)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        owners = dmuon.dedicate_params(
            model,
            mesh["shard"],
            predicate=models.proj_predicate,
            replicate_mesh=mesh["replicate"],
            split_size=2,
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
        owners = dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate, split_size=2)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False, **HYPER)
    losses = []
    for x in models.batches(STEPS, world):
        per = x.shape[0] // world
        loss = model(x[rank * per : (rank + 1) * per]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    _split_step.split_newton_schulz = real
    return {
        "owners": owners,
        "losses": losses,
        "calls": calls,
        "comm": json.dumps(dmuon.summarize_comm_plan(model)),
        "state": full_state(model),
    }


def _runs(rank, world):
    return {
        "split": _train(rank, world, False),
        "hsdp": _train(rank, world, False, hsdp=True),
        "blockwise": _train(rank, world, True),
    }


def test_split_newton_schulz_trains_like_one_process():
    ref_losses, ref_state = reference(4)
    results = run_ranks(_runs, 4, timeout=150)
    for key in ("split", "hsdp"):
        _check(ref_losses, ref_state, [r[key] for r in results])
    # control: block-wise NS of the pieces is other math, and the comparison sees it
    wrong = results[0]["blockwise"]["state"]
    worst = max((wrong[name] - ref_state[name]).abs().max().item() for name in FFN)
    assert worst > 1e-2, worst


def _check(ref_losses, ref_state, runs) -> None:
    split = json.loads(runs[0]["comm"])["split"]
    assert sorted(s["param"] for s in split) == FFN, split
    for s in split:  # an aligned pair, its owner the pair's first rank
        assert len(s["ranks"]) == 2 and s["ranks"][0] % 2 == 0 and s["owner"] == s["ranks"][0]
        assert runs[0]["owners"][s["param"]] == s["owner"]
    for rank, r in enumerate(runs):  # every rank takes part in its pair's matrices, each step
        mine = [s for s in split if rank in s["ranks"]]
        assert len(r["calls"]) == STEPS * len(mine)
    torch.testing.assert_close(
        torch.tensor(runs[0]["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
    )
    assert ref_losses[-1] < ref_losses[0]
    for name, want in ref_state.items():
        for r in runs:
            torch.testing.assert_close(
                r["state"][name], want, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_split_size_must_be_a_positive_int(bad):
    import dmuon_compile as dmuon

    with pytest.raises(ValueError, match="split_size must be a positive int"):
        dmuon.dedicate_params(models.build_llama(), None, split_size=bad)
