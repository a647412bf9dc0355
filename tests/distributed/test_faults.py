"""Faults end loudly and in time, or are exact: dead and frozen peers, exceptions, unused weights.

gloo on CPU, 2 processes, tiny models. A dead rank (SIGKILL) or a frozen one (SIGSTOP) must make
every survivor raise within 2x the process-group timeout, naming what it waited in; an exception
in the middle of backward followed by ``opt.zero_grad()`` must train exactly like the run that
skipped that batch; a dedicated weight used on one rank only gets the reference gradient.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

from tests.distributed import models
from tests.distributed.harness import local_device, run_ranks, run_ranks_with_victim

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 4.0
VICTIM = 1
KILL_AT = 2  # iteration at which the victim dies or freezes


def _on_output_grad(module: nn.Module, fn) -> None:
    """Call ``fn(grad)`` when backward reaches ``module``'s output (its result replaces grad)."""

    def hook(_m, _a, out):
        out.register_hook(fn)

    module.register_forward_hook(hook)


def _dedicated_only_model(rank, world):
    """Dedicated weights and no FSDP2: every collective the survivor can wait in is ours."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    torch.manual_seed(0)
    model = models.TinyLlama()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    return model, dmuon.Muon(model, lr=0.02)


def _victim_run(rank, world, where, how):
    model, opt = _dedicated_only_model(rank, world)
    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP

    def fault(*_):
        os.kill(os.getpid(), sig)

    if rank == VICTIM:
        if where == "forward":
            model.layers[1].register_forward_pre_hook(
                lambda *_: fault() if it[0] == KILL_AT else None
            )
        elif where == "backward":
            _on_output_grad(model.layers[1], lambda g: fault() if it[0] == KILL_AT else g)
    it = [0]
    x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(rank))
    start = None
    try:
        for i in range(6):
            it[0] = i
            if i == KILL_AT:
                start = time.monotonic()
            loss = model(x).square().mean()
            loss.backward()
            if rank == VICTIM and where == "step" and i == KILL_AT:
                fault()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the survivor's report
        return {"raised": True, "after_s": time.monotonic() - start, "msg": str(exc)}
    return {"raised": False, "after_s": None, "msg": ""}


@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_dead_or_frozen_peer_ends_every_survivor(where, how):
    out = run_ranks_with_victim(
        _victim_run, 2, VICTIM, where, how, timeout=60, pg_timeout_s=PG_TIMEOUT_S
    )
    survivor = out[0]
    assert survivor["raised"], "the survivor finished training with a dead peer"
    assert survivor["after_s"] <= 2 * PG_TIMEOUT_S, survivor
    assert "dmuon_compile:" in survivor["msg"] and "over ranks [0, 1]" in survivor["msg"], survivor


def _group_timeouts(rank, world):
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._comm import collectives as C

    model, _ = _dedicated_only_model(rank, world)
    plain = dist.new_group([0, 1])  # what the runtime's groups got before: torch's default
    # Both ranks finish connecting the new group before either returns: a rank that exits while
    # its peer is still in gloo's connectFullMesh fails the peer ("Connection closed by peer").
    dist.barrier(group=plain)
    return {
        "own": C.group_timeout(dedicated_runtime(model).groups[0].pg).total_seconds(),
        "new_group_default": C.group_timeout(plain).total_seconds(),
    }


def test_runtime_groups_inherit_the_default_timeout():
    out = run_ranks_with_victim(_group_timeouts, 2, -1, timeout=180, pg_timeout_s=PG_TIMEOUT_S)
    for r in out.values():
        assert r["own"] == PG_TIMEOUT_S
        assert r["new_group_default"] != PG_TIMEOUT_S  # the check can tell the two apart


# ---------------------------------------------------------------------- exception mid-backward
class SkipBatch(Exception):
    pass


def _train_with_exception(rank, world, raise_at, discard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from tests.distributed.harness import full_state

    torch.manual_seed(0)
    model = models.TinyLlama()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2)
    current = [None]

    # Raise in the middle of backward (after the last block's reduce went out) on every rank.
    def maybe_raise(grad):
        if current[0] == raise_at:
            raise SkipBatch
        return grad

    _on_output_grad(model.layers[0], maybe_raise)
    batches = [
        torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(100 * rank + i))
        for i in range(4)
    ]
    losses = []
    for i, x in enumerate(batches):
        current[0] = i
        if raise_at == "skip" and i == 1:
            continue
        try:
            loss = model(x).square().mean()
            loss.backward()
        except SkipBatch:
            if discard:
                opt.zero_grad()
            else:  # the control: torch's zero_grad alone leaves our in-flight reduces behind
                torch.optim.Optimizer.zero_grad(opt)
            continue
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "state": full_state(model)}


def test_exception_mid_backward_then_zero_grad_equals_skipping_the_batch():
    skipped = run_ranks(_train_with_exception, 2, "skip", True, timeout=120)
    raised = run_ranks(_train_with_exception, 2, 1, True, timeout=120)
    control = run_ranks(_train_with_exception, 2, 1, False, timeout=120)
    assert raised[0]["losses"] == skipped[0]["losses"]
    for name, ref in skipped[0]["state"].items():
        torch.testing.assert_close(raised[0]["state"][name], ref, rtol=0, atol=0, msg=name)
    # Teeth: without dropping the in-flight gradients the runs differ.
    diff = max(
        float((control[0]["state"][n] - ref).abs().max()) for n, ref in skipped[0]["state"].items()
    )
    assert diff > 1e-4, "the control matched: the test cannot see stale gradients"


# ---------------------------------------------------------------------- weight unused on one rank
class Routed(nn.Module):
    """A layer whose ``expert`` runs only on the inputs that choose it (a tiny MoE branch)."""

    def __init__(self, d: int = models.D) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.expert = nn.Linear(d, d, bias=False)

    def forward(self, x, use_expert: bool):
        h = x + self.down(torch.relu(self.up(x)))
        return h + self.expert(h) if use_expert else h


class RoutedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Routed() for _ in range(3))

    def forward(self, x, used: tuple[bool, ...]):
        for layer, use in zip(self.layers, used):
            x = layer(x, use)
        return x


# Per rank: which layers' experts run (rank 1 never reaches the experts of layers 0 and 2).
USED = {0: (True, True, True), 1: (False, True, False)}


def _batch(rank):
    return torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(10 + rank))


def _reference_grads(world, device="cpu"):
    torch.manual_seed(0)
    model = RoutedStack().to(device)
    for rank in range(world):
        (model(_batch(rank).to(device), USED[rank]).square().mean() / world).backward()
    return {n: p.grad.cpu().clone() for n, p in model.named_parameters()}


def _unused_on_one_rank(rank, world, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    torch.manual_seed(0)
    model = RoutedStack().to(local_device(device))
    mesh = init_device_mesh(device, (world,))
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2)
    grads = {}
    for _ in range(2):  # the second backward accumulates onto the first
        model(_batch(rank).to(local_device(device)), USED[rank]).square().mean().backward()
        grads[len(grads)] = {
            n: (p.grad.full_tensor() if p.grad is not None else None)
            for n, p in model.named_parameters()
        }
    return grads


def test_weight_unused_on_one_rank_gets_the_reference_gradient():
    check_unused_on_one_rank("cpu")


def check_unused_on_one_rank(device: str) -> None:
    ref = _reference_grads(2, device)
    out = run_ranks(_unused_on_one_rank, 2, device, timeout=90, device=device)
    for r in out:
        for k in (0, 1):
            for name, want in ref.items():
                got = r[k][name]
                assert got is not None, name
                torch.testing.assert_close(got, (k + 1) * want, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- dtype mismatch
def _mixed_dtypes(rank, world, fsdp_bf16, optimizer_first=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon_compile as dmuon

    torch.manual_seed(0)
    model = models.TinyLlama()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(
        model,
        mesh,
        predicate=models.proj_predicate,
        param_policy=dmuon.ParamPolicy(defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16)),
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if fsdp_bf16 else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if optimizer_first:
        dmuon.Muon(model)
    x = torch.randn(2, 8, models.D)
    try:
        model(x).float().square().mean().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_bf16_dedicated_weights_next_to_fp32_fsdp_fail_with_the_fix():
    out = run_ranks(_mixed_dtypes, 2, False, timeout=90)
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in out[0], out[0]
    assert run_ranks(_mixed_dtypes, 2, True, timeout=90) == [None, None]  # matching dtypes train


def test_dtype_mismatch_is_named_at_a_forward_before_the_optimizer():
    """A forward before ``Muon(model)`` exists gets the same error (not torch's raw "expected
    m1 and m2 to have the same dtype" from inside F.linear); matching dtypes still run."""
    for mixed, matching in run_ranks(_forward_before_optimizer, 2, timeout=90):
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in mixed, mixed
        assert matching is None


def _forward_before_optimizer(rank, world):
    return [_mixed_dtypes(rank, world, fsdp_bf16, False) for fsdp_bf16 in (False, True)]
