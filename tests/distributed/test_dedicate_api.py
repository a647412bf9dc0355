"""dedicate_params' contract: keyword errors, the no-match warning, mesh checks, plan mismatch."""

from __future__ import annotations

import warnings

import pytest
import torch

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def test_unknown_keyword_is_python_type_error():
    import dmuon_compile as dmuon

    with pytest.raises(
        TypeError, match="dedicate_params\\(\\) got an unexpected keyword argument 'bogus'"
    ):
        dmuon.dedicate_params(models.build_llama(), None, bogus=1)


def _api_checks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import mesh_checks

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    # no match: a warning naming 2-D parameters, nothing dedicated, model untouched
    model = models.build_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        owners = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "linear" in n)
    out["no_match"] = [str(w.message) for w in caught]
    out["no_match_owners"] = owners
    out["params_after"] = len(list(model.named_parameters()))
    # HSDP mesh validation: 1-D, non-mesh (any two named dims of one mesh are accepted)
    hsdp = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    errors = {}
    for label, (m, rep) in {
        "one_d_unnamed": (mesh, mesh),
        "not_a_mesh": (hsdp["shard"], "replicate"),
    }.items():
        try:
            dmuon.dedicate_params(
                models.build_llama(), m, predicate=models.proj_predicate, replicate_mesh=rep
            )
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    out["mesh_errors"] = errors
    # the right HSDP mesh (replicate size 1) is accepted
    ok = dmuon.dedicate_params(
        models.build_llama(),
        hsdp["shard"],
        predicate=models.proj_predicate,
        replicate_mesh=hsdp["replicate"],
    )
    out["hsdp_ok"] = len(ok)
    # TP detection needs named meshes
    unnamed = init_device_mesh("cpu", (world,))
    tp_model = models.build_llama()
    w = tp_model.layers[0].mlp.up_proj.weight
    tp_model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        distribute_tensor(w.detach(), unnamed, [Replicate()])
    )
    try:
        dmuon.dedicate_params(tp_model, mesh, predicate=models.proj_predicate)
        out["tp_error"] = None
    except ValueError as exc:
        out["tp_error"] = str(exc)
    out["snippet"] = mesh_checks.HSDP_SNIPPET
    # wrong order: fully_shard first
    from torch.distributed.fsdp import fully_shard

    late = models.build_llama()
    fully_shard(late, mesh=mesh)
    try:
        dmuon.dedicate_params(late, mesh, predicate=models.proj_predicate)
        out["order_error"] = None
    except RuntimeError as exc:
        out["order_error"] = str(exc)
    # the process-wide mesh registry holds each mesh once, however many models are dedicated
    from dmuon_compile.distributed._owner.meshes import MESHES

    held = []
    for _ in range(3):
        dmuon.dedicate_params(models.build_llama(), mesh, predicate=models.proj_predicate)
        held.append(len(MESHES.keep))
    out["held"] = held
    # FSDP2 CPU offload over Muon matrices (expert stacks left to FSDP2): Muon refuses them,
    # their NS would run on the CPU; the control: the same model without the offload policy
    from torch.distributed.fsdp import CPUOffloadPolicy

    from . import moe_models

    for label, policy in (("offload", CPUOffloadPolicy(pin_memory=False)), ("kept", None)):
        moe = moe_models.build_moe()
        dmuon.dedicate_params(moe, mesh)
        kw = {} if policy is None else {"offload_policy": policy}
        for block in moe.layers:
            fully_shard(block.experts, mesh=mesh, **kw)
            fully_shard(block, mesh=mesh)
        try:
            out[label] = len(dmuon.Muon(moe).param_groups)
        except ValueError as exc:
            out[label] = str(exc)
    return out


def test_api_checks_two_ranks():
    r = run_ranks(_api_checks, 2, timeout=90)[0]
    assert len(r["no_match"]) == 1
    msg = r["no_match"][0]
    assert msg.startswith("dedicate_params: no parameters matched the predicate")
    assert "layers.0.self_attn.q_proj.weight (32, 32)" in msg  # the hint lists 2-D names
    assert r["no_match_owners"] == {} and r["params_after"] == len(
        list(models.build_llama().parameters())
    )
    for label, err in r["mesh_errors"].items():
        assert err is not None, label
        assert "HSDP mesh must be 2D with names ('replicate', 'shard')" in err, (label, err)
        assert "init_device_mesh(" in err and 'mesh_dim_names=("replicate", "shard")' in err
    assert r["hsdp_ok"] == 7 * models.LAYERS
    assert r["order_error"] is not None and "must run before fully_shard" in r["order_error"]
    assert r["held"][0] == r["held"][-1], r["held"]  # not one more entry per model
    err = r["offload"]
    assert isinstance(err, str) and "FSDP2 CPU offload" in err, err
    assert "keeps 6 Muon matrices in host memory (layers.0.experts.w1" in err, err
    assert "Muon(offload='momentum')" in err and "and 3 more" in err, err
    # the fully_shard modules whose policy to turn off, by path
    assert "holding them (layers.0.experts, layers.1.experts)" in err, err
    assert r["kept"] == 2, r["kept"]  # the control: Muon and AdamW groups
    assert r["tp_error"] is not None and r["tp_error"].startswith(
        "DMuon requires named DeviceMesh for TP detection"
    )


def _mismatch(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    mesh = init_device_mesh("cpu", (world,))
    # A rank-dependent predicate: rank 1 dedicates fewer matrices → different plans.
    pred = models.proj_predicate if rank == 0 else (lambda n, p: n.endswith("q_proj.weight"))
    try:
        dmuon.dedicate_params(models.build_llama(), mesh, predicate=pred)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_plan_mismatch_raises_on_every_rank_instead_of_hanging():
    errors = run_ranks(_mismatch, 2, timeout=60)
    for err in errors:
        assert err is not None and "owner plan differs across ranks" in err
        assert "same predicate" in err
