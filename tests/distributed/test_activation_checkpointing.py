"""Activation checkpointing with dedicated weights: recomputation unshards nothing twice.

Recomputing a checkpointed block inside backward runs its forward hooks again. The group is
unsharded at that point already (its pre-backward hook, or the prefetch of the group after it,
did it), and the groups after it in forward order have finished their backward: the hook must
not prefetch them again. So a step issues exactly as many unshards as without checkpointing,
2·G − 1 for G hook groups from the second step on (one per group in forward and in backward,
the last group kept over the forward/backward turn; 2·G in the first step, before the order is
known), no unshard touches a group whose reduce went out, and when backward ends every group
is sharded with its buffer freed before the end-of-backward drain. Shown for
``torch.utils.checkpoint`` inside the model, torch's ``checkpoint_wrapper`` applied after
``dedicate_params`` (the hook group is recomputed) and before it (torchtitan's order: the hook
group is the wrapper, outside the recomputation), and two hook groups per checkpointed block.
Training equals the run without checkpointing. The control puts back the old rule (the forward
pre-hook prefetched the next group in recomputation too) and must fail the count and
emptiness checks. Reentrant checkpointing (its first forward runs without gradients, so the
dedicated weights would get none) raises on every rank, naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from dmuon_compile.distributed._runtime.group import GroupState

from . import models
from .harness import local_device, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

LAYERS, STEPS = 4, 3
HYPER = {"lr": 0.02, "adamw_lr": 1e-2, "compile": False}
SUB_BLOCKS = "sub_blocks"  # attention and MLP are hook groups inside each checkpointed block
CONFIGS = ["none", "checkpoint", "wrapper", "wrapper_first", SUB_BLOCKS]
CONTROLS = ["checkpoint", "wrapper", SUB_BLOCKS]  # those whose hook groups are recomputed


def _groups(config: str) -> int:
    return 2 * LAYERS if config == SUB_BLOCKS else LAYERS


def expected_unshards(config: str) -> list[int]:
    """Per step, the same as without checkpointing: 2·G, then 2·G − 1."""
    g = _groups(config)
    return [2 * g] + [2 * g - 1] * (STEPS - 1)


def old_recompute_rule(runtime, group) -> None:
    """The rule before: recomputation prefetched the next group like a forward does."""
    group.wait_unshard()
    nxt = runtime._neighbour(group, +1)
    if nxt is not None and nxt.state == GroupState.SHARDED:
        nxt.unshard(prefetch=True)


def _wrap(model) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):  # as torchtitan applies it (non-reentrant)
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def _train(rank: int, world: int, config: str, device: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._runtime.group import DedicatedGroup

    dev = local_device(device)
    mesh = init_device_mesh(device, (world,))
    model = models.build_llama(layers=LAYERS).to(dev)
    if config == "wrapper_first":
        _wrap(model)
    boundary = None
    if config == SUB_BLOCKS:
        model.checkpoint = True
        boundary = lambda _name, m: isinstance(m, (models.Attention, models.MLP))  # noqa: E731
    dmuon.dedicate_params(
        model, mesh, predicate=models.proj_predicate, hook_boundary_predicate=boundary
    )
    if config == "checkpoint":
        model.checkpoint = True  # torch.utils.checkpoint(block, use_reentrant=False)
    elif config == "wrapper":
        _wrap(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=dmuon.NewtonSchulz(work_dtype=torch.float32), **HYPER)
    runtime = dedicated_runtime(model)

    unshards, finished = [], []  # per step; unshards of groups whose reduce already went out
    issue = DedicatedGroup._issue_unshard

    def counting(group, prefetch):
        unshards[-1] += 1
        if group.reduced:
            finished.append(group.name)
        return issue(group, prefetch)

    at_end = []  # each group's (state, buffer bytes) when backward ends, before the drain
    end_of_backward = runtime._end_of_backward

    def probe():
        at_end.append(
            sorted({(g.state, g.flat.untyped_storage().size()) for g in runtime.groups}, key=str)
        )
        end_of_backward()

    runtime._end_of_backward = probe
    DedicatedGroup._issue_unshard = counting

    def counted_loss(model, x):
        unshards.append(0)  # this step's count
        return model(x).square().mean()

    try:
        batches = models.batches(STEPS, world)
        losses = train_steps(model, opt, batches, rank, world, device=dev, loss_fn=counted_loss)
    finally:
        DedicatedGroup._issue_unshard = issue
    state = {
        n.replace("._checkpoint_wrapped_module", ""): p.detach().clone()
        for n, p in models.owned_masters(model)
    }
    return {
        "groups": len(runtime.groups),
        "unshards": unshards,
        "finished": finished,
        "at_end": at_end,
        "losses": losses,
        "state": state,
    }


def _reentrant(rank: int, world: int, device: str = "cpu") -> str:
    """Reentrant checkpointing runs the first forward without gradients: it must raise."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    dev = local_device(device)
    model = models.build_llama(layers=2).to(dev)
    mesh = init_device_mesh(device, (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    x = models.batches(1, 1)[0].to(dev).requires_grad_()
    for block in model.layers:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    try:
        model.lm_head(model.norm(x)).square().mean().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _all(rank: int, world: int, device: str = "cpu"):
    """Every configuration, the reentrant error and the controls; on CUDA also each
    configuration's peak of allocated device memory on this rank (``peak_bytes``)."""
    from dmuon_compile.distributed._runtime.runtime import DedicatedRuntime

    out, peaks = {}, {}
    for config in CONFIGS:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out[config] = _train(rank, world, config, device)
        if device == "cuda":
            peaks[config] = torch.cuda.max_memory_allocated()
    out["peak_bytes"] = peaks
    out["reentrant"] = _reentrant(rank, world, device)
    fixed = DedicatedRuntime._pre_recompute
    DedicatedRuntime._pre_recompute = old_recompute_rule
    try:
        out["control"] = {config: _train(rank, world, config, device) for config in CONTROLS}
    finally:
        DedicatedRuntime._pre_recompute = fixed
    return out


def _recompute_clean(r: dict, config: str) -> list[str]:
    """What is wrong with a run: [] when it unshards like no checkpointing and ends empty."""
    problems = []
    if r["unshards"] != expected_unshards(config):
        problems.append(f"unshards {r['unshards']} != {expected_unshards(config)}")
    if r["finished"]:
        problems.append(f"unshards of groups whose backward was done: {r['finished']}")
    if r["at_end"] != [[(GroupState.SHARDED, 0)]] * STEPS:
        problems.append(f"groups at the end of backward: {r['at_end']}")
    return problems


def test_activation_checkpointing_unshards_once_and_trains_the_same():
    check_checkpointing(run_ranks(_all, 2, timeout=120))


def check_checkpointing(results: list[dict]) -> None:
    """Every configuration unshards as without checkpointing, ends empty and trains the same;
    reentrant checkpointing raises; the controls fail the count and the emptiness."""
    for r in results:
        base = r["none"]
        assert base["losses"][-1] < base["losses"][0]  # it trained
        for config in CONFIGS:
            got = r[config]
            assert got["groups"] == _groups(config), config
            assert _recompute_clean(got, config) == [], config
            torch.testing.assert_close(got["losses"], base["losses"], rtol=1e-6, atol=0)
            assert got["state"].keys() == base["state"].keys() and got["state"], config
            for name, ref in base["state"].items():
                torch.testing.assert_close(got["state"][name], ref, rtol=1e-6, atol=1e-7)
        assert "reentrant activation checkpointing is not supported" in r["reentrant"]
        assert "use_reentrant=False" in r["reentrant"]
        for config in CONTROLS:  # the old rule fails both the count and the emptiness
            problems = _recompute_clean(r["control"][config], config)
            assert len(problems) == 3, (config, problems)
