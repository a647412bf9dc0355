"""dedicate_params + FSDP2 + Muon over 2 and 4 gloo ranks equals one process with the reference
Muon.

Tolerance: everything runs in fp32 (NewtonSchulz(work_dtype=float32)); the only differences
are summation orders in the gradient reductions (FSDP2's reduce-scatter, our owner reduce),
so losses agree to rtol 1e-4 and final weights to atol 2e-4 after 10 steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from . import models
from .harness import full_state, local_device, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 10
HYPER = {
    "lr": 0.02,
    "momentum": 0.95,
    "adamw_lr": 1e-2,
    "weight_decay": 0.01,
    "adamw_weight_decay": 0.01,
}


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _muon_kwargs(device: str) -> dict:
    import inspect

    import dmuon_compile as dmuon

    # The runtime is under test here, not the compiled step: eager everywhere.
    extra = {"compile": False} if "compile" in inspect.signature(dmuon.Muon).parameters else {}
    return {**HYPER, **extra}


def reference(world: int, steps: int = STEPS, device: str = "cpu"):
    """Single process: the same model, the whole global batch, the reference Muon."""
    import dmuon_compile as dmuon

    model = models.build_llama().to(device)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), **_muon_kwargs(device)
    )
    first_grads = {}

    def keep_first_grads():
        first_grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    losses = train_steps(
        model, opt, models.batches(steps, world), device=device, on_first_grads=keep_first_grads
    )
    state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return losses, state, {n: g.cpu() for n, g in first_grads.items()}


def train_distributed(rank: int, world: int, steps: int, profile: bool, device: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    dev = local_device(device)
    mesh = init_device_mesh(device, (world,))
    model = models.build_llama().to(dev)
    owners = dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), **_muon_kwargs(device))

    routes = {}
    for group in opt.param_groups:
        for p in group["params"]:
            routes[opt.param_name(p)] = (
                "muon" if group["use_muon"] else "adamw",
                hasattr(p, "to_local"),
            )
    first_grads = {}

    def keep_first_grads():  # the owner holds the full gradient averaged over ranks
        first_grads.update({n: g.clone() for n, g in models.owned_grads(model).items()})

    losses = train_steps(
        model,
        opt,
        models.batches(steps, world),
        rank,
        world,
        device=dev,
        on_first_grads=keep_first_grads,
    )
    out = {
        "owners": owners,
        "losses": losses,
        "first_grads": first_grads,
        "routes": routes,
        "groups": json.dumps(dmuon.summarize_param_groups(model, opt)),
        "comm": json.dumps(dmuon.summarize_comm_plan(model)),
        "profile": dmuon.collect_forward_unshard_profile(model, synchronize=True),
        "state": full_state(model),
    }
    dmuon.wait_all_replicate_broadcasts(model)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_dedicated_matches_single_process(world):
    check_against_reference(world, "cpu")


def check_against_reference(world: int, device: str, backend: str = "gloo") -> None:
    """Train both ways and compare (shared by the CPU/gloo tests, the one-GPU tier's gloo ranks
    on ``cuda:0`` and the NCCL test with one GPU per rank)."""
    ref_losses, ref_state, ref_grads = reference(world, device=device)
    results = run_ranks(
        train_distributed,
        world,
        STEPS,
        True,
        device,
        env={"DMUON_RECORD_FORWARD_PROFILE": "1"},
        timeout=120,
        backend=backend,
        device=device,
    )
    r0 = results[0]
    # every rank agrees on the owner plan and on the losses
    assert all(r["owners"] == r0["owners"] for r in results)
    assert sorted(set(r0["owners"].values())) == list(range(world))
    assert len(r0["owners"]) == 7 * models.LAYERS
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
    )
    assert ref_losses[-1] < ref_losses[0]  # it trained (the comparison is not on a flat line)
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            r0["state"][name], ref, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    # Muon is invariant to the gradient's scale, so check the averaged owner gradients directly
    seen = set()
    for r in results:
        for name, g in r["first_grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6)
            seen.add(name)
    assert seen == set(r0["owners"])
    # every rank's Muon holds every dedicated weight (the same param_groups on every rank, as
    # DCP needs; each rank does the math for the ones it owns); the rest are FSDP2 shards on AdamW
    for r in results:
        assert {n for n, (route, _) in r["routes"].items() if route == "muon"} == set(r0["owners"])
        adamw = {n: sharded for n, (route, sharded) in r["routes"].items() if route == "adamw"}
        assert set(adamw) == {n for n in ref_state if n not in r0["owners"]}
        assert all(adamw.values())
    groups = json.loads(r0["groups"])
    assert groups["counts_by_route"]["dedicated/muon"] == len(r0["owners"])
    comm = json.loads(r0["comm"])
    assert [g["group"] for g in comm["groups"]] == [f"layers.{i}" for i in range(models.LAYERS)]
    assert comm["forward_order"] == [f"layers.{i}" for i in range(models.LAYERS)]
    prof = r0["profile"]
    assert prof["enabled"]
    # per step: one forward unshard and one backward unshard per group, except the last group
    # (kept through the forward/backward turn from the second step on); prefetches happen
    assert prof["total"]["unshards"] == 2 * STEPS * models.LAYERS - (STEPS - 1)
    assert prof["total"]["prefetched"] > 0
    assert prof["total"]["reduces"] == STEPS * models.LAYERS
