"""The dedicated runtime's memory passes per iteration: what its unshard and gradient reduce
write, op by op (the gradients themselves are checked against one process elsewhere).

Each element of a group's weights is written once per unshard (the cast into the gathered
buffer) and once per reduce (the copy into the send buffer), plus, over several ranks, the
collective's output and the division of this rank's own sums. No zero-filled buffer, no
extra cast or copy of the reduced gradient, and over one rank no collective at all.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import models
from .harness import run_ranks

# Ops that move no data (views, allocations) or only scalars.
_FREE = {
    "aten.empty.memory_format",
    "aten.slice.Tensor",
    "aten.view.default",
    "aten._reshape_alias.default",
    "aten.reshape.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.as_strided.default",
    "aten.t.default",
    "aten.lift_fresh.default",
    "aten._local_scalar_dense.default",
    "aten.split.Tensor",
}


class _Writes(TorchDispatchMode):
    """Every op that writes data while ``inside`` names a runtime phase: ``{phase: {op: n}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.ops: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.phase is not None and name not in _FREE:
            seen = self.ops.setdefault(self.phase, {})
            seen[name] = seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _one_backward(rank: int, world: int, hsdp: bool = False) -> dict:
    from dmuon_compile.dedicated_registry import runtime_of
    from dmuon_compile.distributed._comm import collectives as C
    from dmuon_compile.distributed._runtime.group import DedicatedGroup
    from dmuon_compile.distributed._runtime.replicate import ReplicateStage

    model, _ = models.build_dedicated(world, hsdp=hsdp)
    x = models.batches(1, world)[0][rank * 2 : rank * 2 + 2]
    model(x).square().mean().backward()  # the first iteration records the hook order

    mode = _Writes()
    calls = {"all_gather": 0, "reduce_scatter_sum": 0}
    patched = {
        "_issue_unshard": "unshard",
        "_reduce_grads": "reduce",
        "_finish_reduce": "finish",
    }
    originals = {m: getattr(DedicatedGroup, m) for m in patched}
    replicate_finish = ReplicateStage._finish_reduce
    collectives = {c: getattr(C, c) for c in calls}
    wait = C.wait

    def unrecorded_wait(*a, **k):  # what a backend does to finish a collective is not ours
        phase, mode.phase = mode.phase, None
        try:
            return wait(*a, **k)
        finally:
            mode.phase = phase

    def phased(method, phase):
        def run(self, *a, **k):
            mode.phase = phase
            try:
                return method(self, *a, **k)
            finally:
                mode.phase = None

        return run

    def counted(fn, name):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return run

    try:
        for m, phase in patched.items():
            setattr(DedicatedGroup, m, phased(originals[m], phase))
        ReplicateStage._finish_reduce = phased(replicate_finish, "replicate_finish")
        for c in calls:
            setattr(C, c, counted(collectives[c], c))
        C.wait = unrecorded_wait
        for p in model.parameters():
            p.grad = None
        with mode:
            model(x).square().mean().backward()
    finally:
        for m in patched:
            setattr(DedicatedGroup, m, originals[m])
        ReplicateStage._finish_reduce = replicate_finish
        for c in calls:
            setattr(C, c, collectives[c])
        C.wait = wait
    groups = runtime_of(model).groups
    return {
        "ops": mode.ops,
        "calls": calls,
        "groups": len(groups),
        "weights": sum(len(g.params) for g in groups),
        "owned": sum(len(g.params_of(g.rank)) for g in groups),
        "global_owned": sum(
            sum(p.owns for p in g.replicate.params) for g in groups if g.replicate is not None
        ),
        "modes": sorted({g.mode for g in groups}),
    }


@pytest.mark.distributed  # spawns 1 and 2 gloo ranks
@pytest.mark.parametrize("world", [1, 2])
def test_the_runtime_writes_each_weight_once_per_unshard_and_per_reduce(world):
    for got in run_ranks(_one_backward, world, timeout=120):
        ops, calls = got["ops"], got["calls"]
        assert got["modes"] == ["all_gather"]  # the in-place gather is the path under test
        # Unshard (forward, and again before backward): one cast-copy per weight of this
        # rank's own chunk; the gather fills the rest in place (nothing over one rank).
        unshard = ops.get("unshard", {})
        assert set(unshard) <= {"aten.copy_.default", "c10d._allgather_base_.default"}, unshard
        reduce = ops.get("reduce", {})
        finish = ops.get("finish", {})
        # Reduce: one copy per weight into the send buffer, no zero-filled buffer.
        assert reduce.get("aten.copy_.default") == got["weights"], reduce
        assert set(reduce) <= {"aten.copy_.default", "c10d._reduce_scatter_base_.default"}, reduce
        if world == 1:
            # The sum over one rank is its gradient: no collective, no division, no copy.
            assert calls == {"all_gather": 0, "reduce_scatter_sum": 0}
            assert "c10d._reduce_scatter_base_.default" not in reduce
            assert finish == {}, finish
        else:
            assert calls["all_gather"] > 0 and calls["reduce_scatter_sum"] == got["groups"]
            # The mean over the ranks: one division per owned weight, writing its gradient.
            assert finish == ({"aten.div.Tensor": got["owned"]} if got["owned"] else {}), finish


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_hsdp_global_owners_divide_once_and_one_rank_shards_gather_nothing():
    """HSDP 2×1: the shard groups have one rank (no shard collective); the replicate reduce's
    global owner divides its sum once, into the gradient (no copy of it first)."""
    owned = 0
    for got in run_ranks(_one_backward, 2, True, timeout=120):
        ops, calls = got["ops"], got["calls"]
        assert calls == {"all_gather": 0, "reduce_scatter_sum": 0}
        # The shard stage's finish only sends the column's sums on to the global owners.
        assert set(ops.get("finish", {})) == {"c10d.reduce_.default"}, ops.get("finish")
        expected = {"aten.div.Tensor": got["global_owned"]} if got["global_owned"] else {}
        assert ops.get("replicate_finish", {}) == expected, ops.get("replicate_finish")
        owned += got["global_owned"]
    assert owned > 0  # each weight has one global owner, on one of the two replicas


def test_the_op_record_sees_a_zero_filled_buffer():
    """Control: the recorder catches the passes this test forbids."""
    mode = _Writes()
    with mode:
        mode.phase = "reduce"
        buf = torch.zeros(8)
        buf[:4].copy_(torch.ones(4))
        with contextlib.suppress(Exception):
            buf.to(torch.float64, copy=True)
    assert {"aten.zeros.default", "aten._to_copy.default"} <= set(mode.ops["reduce"])
