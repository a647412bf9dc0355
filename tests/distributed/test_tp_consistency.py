"""Plain dedicated weights of a TP model: one master per TP column, bitwise equal on its TP ranks.

A plain (not TP-sharded) dedicated weight is held by every TP rank of its owner's DP column.
The TP ranks get different numerics (GPU reduces sum in each column's own order, kernel choices
differ per rank); here TP rank 1's gradients of the plain weights are perturbed before every
step, which stands for any such difference. The masters and momentum buffers must still be
bitwise equal across the TP ranks after every step (TP rank 0 updates, the TP group receives),
for dp 1 × tp 2, HSDP × TP (2 × 1 × 2) and ``compile=True``. Control: every TP rank updating
its own copy (the behaviour before) makes the copies differ.
"""

from __future__ import annotations

import os

import pytest
import torch

from . import models
from .harness import run_ranks
from .test_tp import _muon, build_tp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 2
PERTURB = 1e-3  # added to TP rank 1's plain gradients: a different reduce order, magnified


def _own_updates(stage) -> None:
    """The control: every TP rank updates its own copy of the plain weights, nothing syncs."""
    stage.updates_plain = lambda: True
    stage.broadcast_plain = lambda masters, bufs: None


def _attention_only(name, param) -> bool:
    return "self_attn" in name and models.proj_predicate(name, param)


def _train_perturbed(rank, world, dp, tp, replicas, control, compile_cache, only_plain=False):
    """``only_plain``: the TP-sharded MLP stays on FSDP2; every dedicated weight is plain."""
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._owner.tensor import local_of
    from dmuon_compile.distributed._stages import tp as _tp

    predicate = _attention_only if only_plain else models.proj_predicate
    model, dp_rank = build_tp(rank, world, dp, tp, replicas, attention=False, predicate=predicate)
    runtime = dedicated_runtime(model)
    stage = runtime.tp
    if control:
        _own_updates(stage)
    if compile_cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(compile_cache, f"inductor-{rank}")
    opt = _muon(model, compile=compile_cache is not None)
    plain = [p for p in runtime.params if not isinstance(p, _tp.TPDedicatedParam)]
    owned = [p for p in plain if local_of(p.param).numel() > 0]
    differing = set()
    for x in models.batches(STEPS, dp):
        per = x.shape[0] // dp
        model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
        if stage.info.rank == 1:
            for p in owned:
                local_of(p.param.grad).add_(PERTURB)
        opt.step()
        opt.zero_grad()
        # Every TP rank of this group owns the same plain weights: compare them with TP rank 0's.
        for p in owned:
            momentum = local_of(opt.state[p.param]["momentum_buffer"])
            for what, t in (("weight", local_of(p.param)), ("momentum", momentum)):
                copies = [torch.empty_like(t) for _ in range(stage.info.size)]
                dist.all_gather(copies, t.contiguous(), group=stage.pg)
                if not all(torch.equal(c, copies[0]) for c in copies):
                    differing.add(f"{p.fqn} {what}")
    return {
        "owned": len(owned),
        "differing": sorted(differing),
        "plain": len(plain),
        "tp_stage": stage is not None,
    }


# (name, only plain weights dedicated, control, compile=True): one 2-rank run trains each.
VARIANTS = [
    ("mixed", False, False, False),
    ("only-plain", True, False, False),
    ("only-plain-compiled", True, False, True),
    ("control-own-copies", False, True, False),
]


def _variants(rank, world, compile_cache):
    return {
        name: _train_perturbed(
            rank, world, 1, 2, 1, control, compile_cache if compiled else None, only_plain
        )
        for name, only_plain, control, compiled in VARIANTS
    }


def _check(results, control: bool) -> None:
    assert sum(r["owned"] for r in results) > 0, results  # some rank held plain weights
    assert results[0]["plain"] == 4 * models.LAYERS  # q/k/v/o stay plain: the MLP is TP
    assert all(r["tp_stage"] for r in results)
    differing = [d for r in results for d in r["differing"]]
    if control:
        assert differing, "the control kept the copies equal: the perturbation has no teeth"
    else:
        assert not differing, differing


def test_plain_weights_bitwise_equal_across_tp_ranks(tmp_path, cache_dir):  # noqa: ARG001
    """dp 1 × tp 2: TP-sharded MLP dedicated too, or left on FSDP2 (then no dedicated weight
    is TP-sharded: the model's TP mesh is found all the same), eager and ``compile=True``
    (TP rank 0's plain step is then one graph); the control differs."""
    out = run_ranks(_variants, 2, str(tmp_path), timeout=400)
    for name, _only_plain, control, _compiled in VARIANTS:
        _check([r[name] for r in out], control)


def test_plain_weights_bitwise_equal_hsdp_x_tp():
    """HSDP (2 replicas of 1 shard) × TP 2: the source's update is published to the replica."""
    _check(run_ranks(_train_perturbed, 4, 2, 2, 2, False, None, timeout=300), False)
