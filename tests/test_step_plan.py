"""``Muon.step`` walks the step plan a runtime gives it (``distributed/step_plan.py``): the
plan's actions in order, each part committed before its ``after`` runs, ``finish`` last (also
when the step raises), and splitting the groups into parts changes no number."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile import optimizer
from dmuon_compile.distributed.step_plan import PLAIN_STEP, StepPart, StepPlan


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))


def _backward(model: nn.Module, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 8)).square().mean().backward()


def _recording_plan(model: nn.Module, events: list, snapshots: list) -> StepPlan:
    """Two parts (the first Linear's weight, then the rest), every action recorded with the
    weights as they are when it runs."""
    first = model[0].weight

    def note(name):
        def action(*args):
            events.append((name, *args))
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})

        return action

    return StepPlan(
        parts=(
            StepPart("early", frozenset({id(first)}), after=note("after early")),
            StepPart("rest"),
        ),
        before=note("before"),
        finish=note("finish"),
    )


def _install(monkeypatch, plan: StepPlan) -> None:
    monkeypatch.setattr(optimizer, "_step_plan", lambda _model: plan)


def test_step_walks_the_plan_in_order(monkeypatch):
    model = _model()
    events, snapshots = [], []
    _install(monkeypatch, _recording_plan(model, events, snapshots))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = dmuon.Muon(model, lr=0.05, replicate_async=False, compile=False)
    _backward(model)
    opt.step()
    assert [e[0] for e in events] == ["before", "after early", "finish"]
    assert events[-1] == ("finish", True)  # replicate_async=False: wait for the publish
    at_before, at_early, at_finish = snapshots
    assert all(torch.equal(at_before[n], before[n]) for n in before)
    # After the early part: its matrix is updated, the other Muon matrix is not yet.
    assert not torch.equal(at_early["0.weight"], before["0.weight"])
    assert torch.equal(at_early["2.weight"], before["2.weight"])
    assert not torch.equal(at_finish["2.weight"], before["2.weight"])


def test_finish_runs_when_the_step_raises(monkeypatch):
    model = _model()
    events, snapshots = [], []
    _install(monkeypatch, _recording_plan(model, events, snapshots))
    opt = dmuon.Muon(model, compile=False)
    _backward(model)
    model[2].weight.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        opt.step()
    assert [e[0] for e in events] == ["before", "finish"]
    assert events[-1] == ("finish", False)


@pytest.mark.parametrize("split", [True, False])
def test_parts_change_no_number(monkeypatch, split):
    """Two steps with the groups split into parts equal two steps of one part; the control (the
    early part's ``after`` skipped would not change numbers, so it compares against a step whose
    plan drops a matrix) shows the comparison sees a part that is not stepped."""
    reference = _model()
    opt = dmuon.Muon(reference, lr=0.05, compile=False)
    for seed in (1, 2):
        _backward(reference, seed)
        opt.step()
        opt.zero_grad()
    model = _model()
    plan = _recording_plan(model, [], [])
    if not split:  # the control: only the early part, the rest never stepped
        plan = StepPlan(parts=plan.parts[:1])
    _install(monkeypatch, plan)
    opt = dmuon.Muon(model, lr=0.05, compile=False)
    for seed in (1, 2):
        _backward(model, seed)
        opt.step()
        opt.zero_grad()
    same = all(
        torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert same is split


def test_a_model_without_runtime_gets_the_plain_plan():
    assert optimizer._step_plan(_model()) is PLAIN_STEP
    assert optimizer._step_plan(None) is PLAIN_STEP


class _Publish:
    collectives = 0

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def apply(self, forward: bool) -> None:
        self.log.append(("apply", self.name))


class _Replicate:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def publish(self, profile=None) -> _Publish:
        self.log.append(("publish", self.name))
        return _Publish(self.log, self.name)


class _Group:
    """What the step side reads of a hook group: its replicate stage and its parameters."""

    def __init__(self, log: list, name: str, owned: nn.Parameter | None = None) -> None:
        self.replicate = _Replicate(log, name)
        self.profile = None
        self.params = [] if owned is None else [type("P", (), {"param": owned, "owns": True})()]


def test_the_step_side_needs_only_the_groups_and_the_comm_context():
    """``StepSide`` (``distributed/_runtime/step.py``), held by the runtime: without HSDP and TP
    the plain plan; with two HSDP groups the first forward group's masters stepped first and
    published at once, the rest published last, each once."""
    from dmuon_compile.distributed._comm.pending import CommContext
    from dmuon_compile.distributed._runtime.step import StepSide

    assert StepSide([], CommContext(), record_profile=False).plan() is PLAIN_STEP
    log: list = []
    w = nn.Parameter(torch.zeros(2))
    first, second = _Group(log, "first", owned=w), _Group(log, "second")
    side = StepSide([first, second], CommContext(), record_profile=False)
    plan = side.plan()
    assert [p.name for p in plan.parts] == ["early", "rest"]
    assert plan.parts[0].params == frozenset({id(w)})
    plan.before()
    plan.parts[0].after()
    plan.finish(True)
    assert log == [
        ("publish", "first"),
        ("publish", "second"),
        ("apply", "first"),
        ("apply", "second"),
    ]


def _refuse(*_args, **_kwargs):
    raise AssertionError("a dense model's step reached a stage's code")


def test_a_dense_step_has_no_stages_and_runs_none_of_their_code(monkeypatch):
    """A dense model's plan has no stages, and its steps never reach the split, TP or expert
    reshard code (every entry point patched to raise); after the first step (which looks for
    expert stacks once) not even the question whether a matrix needs a reshard is asked."""
    from dmuon_compile import layouts
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards
    from dmuon_compile.distributed._stages import split_step as _split_step
    from dmuon_compile.distributed._stages.tp import stage as tp_stage

    for cls in (_split_step.SplitStage, tp_stage.TPStage, _expert_shards.ExpertReshardStage):
        for name in ("__init__", "directions", "commit", "abort"):
            monkeypatch.setattr(cls, name, _refuse)
    for module, name in (
        (_expert_shards, "ExpertWalk"),
        (_expert_shards, "orthogonalize_resharded"),
        (_split_step, "orthogonalize_split"),
    ):
        monkeypatch.setattr(module, name, _refuse)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = dmuon.Muon(model, lr=0.05, compile=False)
    _backward(model, 1)
    opt.step()
    opt.zero_grad()
    monkeypatch.setattr(layouts, "needs_reshard", _refuse)
    monkeypatch.setattr(optimizer, "needs_reshard", _refuse)
    _backward(model, 2)
    opt.step()
    plan = opt._with_stages(optimizer._step_plan(model))
    assert plan is PLAIN_STEP and plan.stages == ()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))  # it stepped


@pytest.fixture
def one_rank():
    """A one-rank gloo process group (DTensors on a one-rank mesh), destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_split_tp_and_expert_plans_get_their_stage(one_rank, monkeypatch):
    """The control: a runtime with split groups and a TP stage plans both, in that order (TP
    queues its scatters: the plan drains before the step); a Muon matrix that is an expert stack
    sharded inside its experts gets the expert reshard stage, and its step runs it (the same
    update as the stack stepped whole: one rank holds every piece)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon_compile.distributed._comm.pending import CommContext
    from dmuon_compile.distributed._runtime.runtime import DedicatedRuntime
    from dmuon_compile.distributed._runtime.step import StepSide
    from dmuon_compile.distributed._stages import expert_shards as _expert_shards
    from dmuon_compile.distributed._stages.split_step import SplitStage
    from dmuon_compile.distributed._stages.tp.stage import TPStage
    from dmuon_compile.layouts import Layout, set_layout

    tp = object.__new__(TPStage)
    runtime = SimpleNamespace(split=(object(),), tp=tp, _split_stage=None)
    stages = DedicatedRuntime.stages(runtime)
    assert [type(s) for s in stages] == [SplitStage, TPStage] and stages[1] is tp
    side = StepSide([], CommContext(), record_profile=False)
    assert side.plan(stages[:1]).stages == stages[:1] and not side.plan(stages[:1]).parts[0].after
    assert side.plan(stages).stages == stages and side.plan(stages).before == side.before_step

    torch.manual_seed(0)
    whole = torch.randn(2, 4, 6)
    grad = torch.randn(2, 4, 6)
    w = nn.Parameter(distribute_tensor(whole, one_rank, [Shard(1)]))
    ref = nn.Parameter(whole.clone())
    for p in (w, ref):
        set_layout(p, Layout.experts())
    calls = []
    real = _expert_shards.ExpertReshardStage.directions

    def recorded(self, jobs, ns, failure):
        calls.append(self)
        return real(self, jobs, ns, failure)

    monkeypatch.setattr(_expert_shards.ExpertReshardStage, "directions", recorded)
    opt = dmuon.Muon([w], lr=0.05, compile=False)
    plan = opt._with_stages(optimizer._step_plan(None))
    assert [type(s) for s in plan.stages] == [_expert_shards.ExpertReshardStage]
    w.grad = distribute_tensor(grad, one_rank, [Shard(1)])
    ref.grad = grad.clone()
    opt.step()
    dmuon.Muon([ref], lr=0.05, compile=False).step()
    assert calls == [plan.stages[0]]
    assert not torch.equal(ref, whole)
    torch.testing.assert_close(w.full_tensor(), ref.detach())
