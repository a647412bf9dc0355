"""A bf16 momentum on dedicated owners (``Muon(momentum_dtype=torch.bfloat16)``): stored in bf16
on the owners, checkpointed with DCP, and resumed into an optimizer with an fp32 momentum (and
back) exactly as one run that switched its setting at that step.

Control: the same resumed run against one that kept fp32 momentum from the start differs, so
the comparison sees what the loaded momentum held.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

BEFORE, AFTER = 2, 2


def _steps(model, opt, xs, rank, world):
    for x in xs:
        per = x.shape[0] // world
        model(x[rank * per : (rank + 1) * per]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _weights(model) -> dict:
    from .harness import full_state

    return {k: v.detach().cpu().clone() for k, v in full_state(model).items()}


def _run(rank, world, path, first, second, resume):
    """``first`` momentum dtype for BEFORE steps, then ``second`` for AFTER steps: in one run
    (the setting changed in place), or (``resume``) through a DCP checkpoint into a new model and
    optimizer built with ``second``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dmuon_compile as dmuon

    xs = models.batches(BEFORE + AFTER, world)
    model = models.build_dedicated(world, seed=0)[0]
    opt = dmuon.Muon(model, compile=False, momentum_dtype=first)
    _steps(model, opt, xs[:BEFORE], rank, world)
    owned = [
        b.to_local().dtype
        for b in (s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s)
        if hasattr(b, "to_local") and b.to_local().numel()
    ]
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        model = models.build_dedicated(world, seed=5)[0]
        opt = dmuon.Muon(model, compile=False, momentum_dtype=second)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        opt.momentum_dtype = second
    _steps(model, opt, xs[BEFORE:], rank, world)
    after = sorted(
        {str(s["momentum_buffer"].dtype) for s in opt.state.values() if "momentum_buffer" in s}
    )
    return {
        "weights": _weights(model),
        "owned_dtypes": sorted(set(map(str, owned))),
        "after": after,
    }


@pytest.mark.parametrize(
    "first,second", [(torch.bfloat16, None), (None, torch.bfloat16)], ids=["bf16_fp32", "fp32_bf16"]
)
def test_dcp_resume_across_momentum_dtypes_equals_one_run(tmp_path, first, second):
    world = 2
    resumed = run_ranks(_run, world, str(tmp_path / "ckpt"), first, second, True)
    straight = run_ranks(_run, world, str(tmp_path / "unused"), first, second, False)
    stored = "torch.bfloat16" if first is torch.bfloat16 else "torch.float32"
    for r, s in zip(resumed, straight):
        assert r["owned_dtypes"] == [stored]  # the owners held the momentum in that dtype
        assert r["after"] == ["torch.bfloat16" if second is torch.bfloat16 else "torch.float32"]
        for name in s["weights"]:
            torch.testing.assert_close(r["weights"][name], s["weights"][name], rtol=0, atol=0)
    if first is torch.bfloat16:  # control: a run that never held a bf16 momentum ends elsewhere
        fp32 = run_ranks(_run, world, str(tmp_path / "unused2"), None, None, False)[0]
        assert any(
            not torch.equal(fp32["weights"][k], resumed[0]["weights"][k]) for k in fp32["weights"]
        )
