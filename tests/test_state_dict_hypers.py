"""``opt.state_dict()["param_groups"]`` holds plain floats for ``lr``, ``weight_decay`` and
``momentum`` (as torch's optimizers save them), though the groups keep 0-d tensors inside.

A ``json`` and a ``torch.save(weights_only)`` round trip of the state dict load back (also
into a fresh optimizer), the loaded run steps exactly as the original one, and a
user-compiled ``opt.step`` (``torch.compile(opt.step)``, Dynamo's ``CompileCounter``) does not
compile again after the load nor when the LR scheduler changes ``lr`` afterwards.

Control: torch's own ``Optimizer.state_dict`` on the same optimizer (what ``Muon.state_dict``
returned before) gives float64 tensors, which ``json.dumps`` refuses.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import dmuon_compile as dmuon

HYPERS = ("lr", "weight_decay", "momentum")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8))
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-2, weight_decay=0.01, compile=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _train(model, opt, sched, xs, step=None):
    for x in xs:
        model(x).square().mean().backward()
        (step or opt.step)()
        opt.zero_grad()
        sched.step()


def _round_trip_json(sd: dict) -> dict:
    """The state dict through JSON (groups) and torch.save (tensors), as a checkpoint would."""
    groups = json.loads(json.dumps(sd["param_groups"]))
    buf = io.BytesIO()
    torch.save(sd["state"], buf)
    buf.seek(0)
    return {"state": torch.load(buf, weights_only=True), "param_groups": groups}


def test_state_dict_groups_are_plain_floats_and_round_trip():
    model, opt, sched = _setup()
    xs = _batches(4)
    _train(model, opt, sched, xs[:2])
    sd = opt.state_dict()
    for group, live in zip(sd["param_groups"], opt.param_groups):
        for key in HYPERS:
            assert type(group[key]) is float, (key, group[key])
            assert group[key] == float(live[key])
            assert isinstance(live[key], torch.Tensor) and live[key].dim() == 0  # kept inside
        assert type(group["initial_lr"]) is float  # the scheduler's copy of lr
    loaded = _round_trip_json(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)  # the whole state dict, loadable with weights_only
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["param_groups"] == sd["param_groups"]

    # A fresh run loads it and steps exactly as the original run goes on.
    model2, opt2, sched2 = _setup(seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(loaded)
    sched2.load_state_dict(sched.state_dict())
    for group in opt2.param_groups:
        for key in HYPERS:
            assert isinstance(group[key], torch.Tensor) and group[key].dtype == torch.float64
    _train(model, opt, sched, xs[2:])
    _train(model2, opt2, sched2, xs[2:])
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert float(opt2.param_groups[0]["lr"]) == float(opt.param_groups[0]["lr"])


def test_user_compiled_step_does_not_recompile_across_load_and_lr_changes():
    torch._dynamo.reset()
    model, opt, sched = _setup()
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    xs = _batches(6)
    _train(model, opt, sched, xs[:2], step)
    frames = counter.frame_count
    assert frames >= 1
    lr_tensor = opt.param_groups[0]["lr"]
    opt.load_state_dict(_round_trip_json(opt.state_dict()))
    assert opt.param_groups[0]["lr"] is lr_tensor  # the same tensor, refilled
    _train(model, opt, sched, xs[2:], step)  # the scheduler changes lr every step
    assert counter.frame_count == frames, (frames, counter.frame_count)
    lrs = {float(opt.param_groups[0]["lr"])}
    assert lrs == {0.02 / 7}


def test_control_torch_state_dict_holds_float64_tensors():
    model, opt, sched = _setup()
    _train(model, opt, sched, _batches(1))
    raw = torch.optim.Optimizer.state_dict(opt)
    assert all(isinstance(g["lr"], torch.Tensor) for g in raw["param_groups"])
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(raw["param_groups"])


def test_an_older_checkpoint_with_float64_tensors_loads_into_the_groups_own_tensors():
    """What ``Muon.state_dict`` saved before (float64 tensors) loads like floats: the groups
    keep their own tensors, and the next ``state_dict`` holds floats."""
    model, opt, sched = _setup()
    _train(model, opt, sched, _batches(1))
    old = torch.optim.Optimizer.state_dict(opt)  # the old format: float64 tensors
    held = [g["lr"] for g in opt.param_groups]
    opt.load_state_dict(old)
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, held))  # the same tensors
    assert all(type(g["lr"]) is float for g in opt.state_dict()["param_groups"])
    json.dumps(opt.state_dict()["param_groups"])
