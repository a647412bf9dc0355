"""QK-clip over 2 gloo ranks (one launch): dedicated weights (``dmuon.dedicate_params`` +
``Muon(model)``, also HSDP), FSDP2 ``Shard(0)`` shards and tensor-parallel q/k/v (AdamW) train
as one process with the clip firing (control: the one-process run without the clip ends
elsewhere); a batch where only one rank's max logit exceeds tau clips on both ranks (one
all_reduce(MAX) of all layers' maxima); a placement it cannot scale raises."""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import full_state, run_ranks, train_steps, whole_tensor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS, TAU, LR = 3, 0.9, 0.05


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _reference(world: int, tau: float | None, adamw: bool = False):
    import dmuon_compile as dmuon

    model = models.build_llama()
    if adamw:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        opt = dmuon.Muon(
            model, lr=LR, predicate=models.proj_predicate, ns_backend=_ns(), compile=False
        )
    clip = dmuon.QKClip(model, tau).attach(opt) if tau is not None else None
    train_steps(model, opt, models.batches(STEPS, world))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state, (clip.clipped.clone() if clip is not None else None)


def _local_max(clip) -> float:
    return max(float(a.running.max()) for a in clip.attentions if a.running is not None)


def _dedicated(rank: int, world: int, one_rank_tau: float):
    import dmuon_compile as dmuon

    model, _ = models.build_dedicated(world)
    opt = dmuon.Muon(model, lr=LR, ns_backend=_ns(), compile=False)
    clip = dmuon.QKClip(model, TAU).attach(opt)
    train_steps(model, opt, models.batches(STEPS, world), rank, world)
    out = {"state": full_state(model), "clipped": clip.clipped.clone()}

    # A batch whose max logit exceeds tau on one rank only: both ranks clip the same heads.
    fresh, _ = models.build_dedicated(world, seed=1)
    opt = dmuon.Muon(fresh, lr=LR, ns_backend=_ns(), compile=False)
    clip = dmuon.QKClip(fresh, one_rank_tau).attach(opt)
    local = []
    train_steps(
        fresh,
        opt,
        models.batches(1, world, seed=7),
        rank,
        world,
        on_first_grads=lambda: local.append(_local_max(clip)),
    )
    out.update(local_max=local[0], one_rank_clipped=clip.clipped.clone(), last=clip.last_max)

    # HSDP (2 replicas of one shard): the global owner scales its masters; the next forward
    # publishes them to the other replica.
    model, _ = models.build_dedicated(world, hsdp=True)
    opt = dmuon.Muon(model, lr=LR, ns_backend=_ns(), compile=False)
    clip = dmuon.QKClip(model, TAU).attach(opt)
    train_steps(model, opt, models.batches(STEPS, world), rank, world)
    with torch.no_grad():  # the forward that publishes the last step's clip (as any write)
        model(models.batches(1, world)[0][:1])
    model.reshard()  # FSDP2's root keeps its parameters unsharded after a forward
    out.update(hsdp_state=full_state(model), hsdp_clipped=clip.clipped.clone())
    return out


def _all(rank: int, world: int, one_rank_tau: float):
    return {
        "dedicated": _dedicated(rank, world, one_rank_tau),
        "fsdp": _fsdp(rank, world),
        "tp": _tp(rank, world),
    }


def _tp_model(world: int):
    """One block; over ``world`` ranks (0: one process) its attention tensor-parallel (q/k/v
    column-parallel: each rank computes 2 of the 4 heads; o row-parallel)."""
    import dmuon_compile as dmuon

    model = models.build_llama(layers=1)
    if world:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {n: ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan["o_proj"] = RowwiseParallel()
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model.layers[0].self_attn, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    clip = dmuon.QKClip(model, TAU).attach(opt)
    train_steps(model, opt, models.batches(STEPS, 1), mean=False)  # every rank the whole batch
    whole = {
        n: whole_tensor(p) if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()
    }
    return {n: p.detach().clone() for n, p in whole.items()}, clip


def _tp(rank: int, world: int):
    state, clip = _tp_model(world)
    return {"state": state, "clipped": clip.clipped.clone()}


def _fsdp(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import dmuon_compile as dmuon

    model = models.build_llama()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # any torch optimizer takes the clip
    clip = dmuon.QKClip(model, TAU).attach(opt)
    train_steps(model, opt, models.batches(STEPS, world), rank, world)
    state = {n: whole_tensor(p).detach().clone() for n, p in model.named_parameters()}

    # Columns of q sharded (Shard(1)): its rows cannot be scaled locally, so the clip raises.
    attn = models.build_llama(layers=1).layers[0].self_attn
    columns = dmuon.QKClip(attn, 1.0)
    weight = distribute_tensor(attn.q_proj.weight.detach(), mesh, [Shard(1)])
    attn.q_proj.weight = torch.nn.Parameter(weight)
    columns.observe(attn, torch.full((models.HEADS,), 2.0))
    try:
        columns.apply()
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"state": state, "clipped": clip.clipped.clone(), "error": error}


def _one_rank_tau(world: int) -> float:
    """A tau between the two ranks' max logits of the first step's batch (one process)."""
    import dmuon_compile as dmuon

    model = models.build_llama(seed=1)
    clip = dmuon.QKClip(model, 1e9)
    (x,) = models.batches(1, world, seed=7)
    per = x.shape[0] // world
    maxima = []
    for r in range(world):
        with torch.no_grad():
            model(x[r * per : (r + 1) * per])
        maxima.append(_local_max(clip))
        clip.apply()
    lo, hi = sorted(maxima)
    assert hi > lo * 1.01, maxima
    return (lo + hi) / 2


def test_two_ranks_clip_as_one_process_and_one_ranks_max_clips_on_both():
    world = 2
    tau = _one_rank_tau(world)
    results = run_ranks(_all, world, tau)
    dedicated = [r["dedicated"] for r in results]
    reference, clipped = _reference(world, TAU)
    control, _ = _reference(world, None)
    assert clipped.sum() > 0  # it fired
    attention = [n for n in reference if ".self_attn." in n]
    assert any(not torch.allclose(reference[n], control[n], atol=1e-3) for n in attention)
    for r in dedicated:
        assert torch.equal(r["clipped"], clipped)
        for name, value in reference.items():
            torch.testing.assert_close(
                r["state"][name], value, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
    # only one rank saw a max above tau; both clipped the same heads by the same maxima
    assert sorted(r["local_max"] > tau for r in dedicated) == [False, True]
    assert dedicated[0]["one_rank_clipped"].sum() > 0
    assert torch.equal(dedicated[0]["one_rank_clipped"], dedicated[1]["one_rank_clipped"])
    assert torch.equal(dedicated[0]["last"], dedicated[1]["last"])
    for r in dedicated:  # HSDP
        assert torch.equal(r["hsdp_clipped"], clipped)
        for name, value in reference.items():
            torch.testing.assert_close(
                r["hsdp_state"][name], value, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
    # FSDP2 Shard(0) shards (AdamW): each rank scales its own rows by their global index
    reference, clipped = _reference(world, TAU, adamw=True)
    control, _ = _reference(world, None, adamw=True)
    assert clipped.sum() > 0
    assert any(not torch.allclose(reference[n], control[n], atol=1e-3) for n in attention)
    for r in (r["fsdp"] for r in results):
        assert torch.equal(r["clipped"], clipped)
        for name, value in reference.items():
            torch.testing.assert_close(
                r["state"][name], value, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert r["error"] is not None and "Shard(0)" in r["error"]
    # tensor parallelism: each rank's SDPA sees its own heads, scales its own q/k rows
    reference, clip = _tp_model(0)
    assert clip.clipped.sum() > 0
    for r in (r["tp"] for r in results):
        assert torch.equal(r["clipped"], clip.clipped)
        for name, value in reference.items():
            torch.testing.assert_close(
                r["state"][name], value, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
