"""get_model_state_dict / set_model_state_dict round-trip the dedicated parameters."""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _build(rank, world, seed, hsdp=False):
    return models.build_dedicated(world, seed=seed, hsdp=hsdp)[0]


def _save_then_load(rank, world, hsdp=False):
    import dmuon_compile as dmuon

    model = _build(rank, world, seed=0, hsdp=hsdp)
    opt = dmuon.Muon(model, compile=False)
    for x in models.batches(2, world):
        per = x.shape[0] // world
        model(x[rank * per : (rank + 1) * per]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    plain = model.state_dict()  # registered parameters: every dedicated weight is in it
    plain_keys = sorted(plain)
    full = dmuon.get_model_state_dict(model, cpu_offload=False)  # every rank gets it
    rank0_only = dmuon.get_model_state_dict(model)  # cpu_offload: rank 0 only

    # Load into a differently initialised model, then read it back.
    other = _build(rank, world, seed=7, hsdp=hsdp)
    before = dmuon.get_model_state_dict(other, cpu_offload=False)
    dmuon.set_model_state_dict(other, full)
    after = dmuon.get_model_state_dict(other, cpu_offload=False)
    x = next(iter(models.batches(1, world)))
    same_output = torch.equal(model(x), other(x))
    missing_error = None
    try:
        dmuon.set_model_state_dict(other, {k: v for k, v in full.items() if "q_proj" not in k})
    except KeyError as exc:
        missing_error = str(exc)
    return {
        "full": full,
        "rank0_len": len(rank0_only),
        "after": after,
        "before_differs": any(not torch.equal(before[k], full[k]) for k in full),
        "same_output": same_output,
        "plain_keys": plain_keys,
        "missing_error": missing_error,
    }


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp_2x1"])
def test_round_trip_and_single_process_load(hsdp):
    results = run_ranks(_save_then_load, 2, hsdp, timeout=100)
    r0, r1 = results
    reference = models.build_llama(seed=0)
    # the full dict has exactly the single-process model's keys and shapes
    assert set(r0["full"]) == set(reference.state_dict())
    for k, v in reference.state_dict().items():
        assert r0["full"][k].shape == v.shape
    # every rank got the same full dict; rank 0 alone gets the cpu_offload dict
    for k in r0["full"]:
        assert torch.equal(r0["full"][k], r1["full"][k])
    assert r0["rank0_len"] == len(r0["full"]) and r1["rank0_len"] == 0
    # loading restored every tensor exactly, and the models then compute the same thing
    assert r0["before_differs"]
    for k in r0["full"]:
        assert torch.equal(r0["after"][k], r0["full"][k]), k
    assert r0["same_output"] and r1["same_output"]
    assert r0["plain_keys"] == sorted(reference.state_dict()) == r1["plain_keys"]
    assert "q_proj" in r0["missing_error"]
    # a single-process model loads the distributed checkpoint (topology change)
    reference.load_state_dict(r0["full"])
