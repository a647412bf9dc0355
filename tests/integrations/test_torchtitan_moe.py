"""torchtitan's DeepSeek-V3 debug model (a dense block and a MoE block of 8 experts) through
``dmuon_compile.integrations.torchtitan`` on 4 gloo ranks, with torchtitan's own pieces: its
``ParallelDims`` (EP 2 × expert FSDP 2, HSDP 2 × 2 with EP 2, and 1-D FSDP),
``parallelize_deepseekv3`` wrapped by
``dedicating``, ``MuonOptimizers`` and its DCP ``CheckpointManager``.

- The dense matrices are dedicated; the expert stacks stay sharded along the expert dim (EP and
  FSDP2's ``Shard(0)``), each rank orthogonalising its own whole experts; the router gets AdamW.
- The losses equal one process training the same weights on the global batch with
  ``dmuon.Muon`` (per-expert Newton–Schulz there too).
- A checkpoint saved at EP 2 resumes at EP 1 (another expert layout) and repeats the step
  after the save.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import full_state, run_ranks
from torch.distributed.tensor import DTensor

from integrations.test_torchtitan import checkpoint_manager, loss_of, parallelize_on_cpu, tokens

pytestmark = [pytest.mark.timeout(300), pytest.mark.distributed]

SEQ, PER_RANK, STEPS, LAYERS = 16, 2, 3, 2


def build_dsv3(ep: bool, layers: int = LAYERS):
    """The DeepSeek-V3 debug model's first ``layers`` layers (the first dense, the others MoE)
    on the meta device. Workaround for CPU: its FlexAttention has no backward there, so the
    inner attention is torchtitan's SDPA module (same layout, no parameters)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_deepseek_v3_sharding_config(spec.model, enable_sp=False, enable_ep=ep)
    with torch.device("meta"):
        model = spec.model.build()
    return spec, model


def _full(model) -> dict:
    """Every parameter whole (expert stacks: DTensors on the EP × expert-FSDP mesh)."""
    state = full_state(model)
    for name, p in model.named_parameters():
        if p.ndim == 3:
            state[name] = p.full_tensor().detach().clone()
    return state


def _train(rank, world, folder, ep, load_from=None, save=False, plain=None, replicate=1):
    """``plain`` (initial weights): torchtitan's own FSDP2 path (no dmuon) from those
    weights: only the first step's gradients."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's Trainer does
    dims = ParallelDims(
        dp_replicate=replicate, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    spec, model = build_dsv3(ep > 1)
    parallelize = (
        spec.parallelize_fn if plain is not None else dmuon_tt.dedicating(spec.parallelize_fn)
    )
    model = parallelize_on_cpu(parallelize, model, dims, parallelism, folder)
    if plain is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        # A copy: torch's loader replaces the dict's values with DTensors.
        whole = {k: v.clone() for k, v in plain.items()}
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
        batch = tokens(0, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss_of(model, batch, world * PER_RANK * SEQ).backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    dedicated_runtime(model).publish(wait=True)
    initial = _full(model)
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=[model])
    experts = model.layers["1"].moe.routed_experts.inner_experts.w1_EFD

    grads = {}

    def step(i):
        batch = tokens(i, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = loss_of(model, batch, world * PER_RANK * SEQ)
        loss.backward()
        if i == 0:  # every gradient, whole (dedicated ones from their owners)
            for name, p in model.named_parameters():
                grad = dmuon.full_tensor(p.grad)
                grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
                grads[name] = grad.detach().clone()
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()

    checkpointer = checkpoint_manager([model], optimizers, load_from or folder)
    out = {
        "initial": initial,
        "local_experts": experts.to_local().shape[0],
        "placements": str(experts.placements),
        "groups": [(g["use_muon"], g["param_names"]) for o in optimizers for g in o.param_groups],
    }
    if load_from is not None:
        assert checkpointer.load(step=STEPS)
        out["resumed"] = step(STEPS)
        out["resumed_state"] = _full(model)  # equal only if the momentum came back too
        return out
    out["losses"] = [step(i) for i in range(STEPS)]
    out["grads"] = grads
    if save:
        checkpointer.save(curr_step=STEPS)
        out["after_save"] = step(STEPS)
        out["after_save_state"] = _full(model)
    return out


def _scenarios(rank, world, folder):
    ep2 = _train(rank, world, f"{folder}/ep2", ep=2, save=True)
    ep1 = _train(rank, world, f"{folder}/ep1", ep=1, load_from=f"{folder}/ep2")
    plain = _train(rank, world, f"{folder}/plain", ep=2, plain=ep2["initial"])
    hsdp = _train(rank, world, f"{folder}/hsdp", ep=2, replicate=2)
    return {"ep2": ep2, "ep1_resumed": ep1, "fsdp2_grads": plain, "hsdp_ep2": hsdp}


def _reference(initial, world):
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    _, model = build_dsv3(False)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers; the weights come from `initial`
    model.load_state_dict(initial, strict=False)
    opt = dmuon.Muon(
        model, lr=0.02, adamw_lr=3e-3, predicate=dmuon_tt.muon_predicate, compile=False
    )
    losses, grads = [], {}
    for i in range(STEPS):
        loss = loss_of(model, tokens(i, world), world * PER_RANK * SEQ)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt, grads


def test_deepseek_v3_with_expert_parallelism_trains_like_one_process_and_resumes_at_ep1(
    tmp_path,
):
    pytest.importorskip("torchtitan")
    world = 4
    results = run_ranks(_scenarios, world, str(tmp_path), timeout=280)
    r0 = results[0]["ep2"]
    assert r0["local_experts"] == 2  # 8 experts over EP 2 × expert FSDP 2: whole experts
    muon = {name for use_muon, names in r0["groups"] if use_muon for name in names}
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in muon
    assert "layers.1.moe.router.gate.weight" not in muon
    ref, ref_opt, ref_grads = _reference(r0["initial"], world)
    ref_muon = {
        ref_opt.param_name(p) for g in ref_opt.param_groups if g["use_muon"] for p in g["params"]
    }
    assert ref_muon == muon
    # The same gradients as torchtitan's own FSDP2 + EP path (AdamW's): every parameter.
    plain = results[0]["fsdp2_grads"]
    assert plain.keys() == r0["grads"].keys()
    for name, grad in r0["grads"].items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-8, msg=name)
    # And one process's, to the accuracy torchtitan's own path reaches (its routed experts'
    # gradients differ from one process's by ~2e-3 relative, with or without dmuon).
    for name, grad in r0["grads"].items():
        err = (grad - ref_grads[name]).norm() / ref_grads[name].norm()
        assert err < (5e-3 if "routed_experts" in name else 1e-4), (name, err)
    hsdp_ref = _reference(results[0]["hsdp_ep2"]["initial"], world)[0]
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["ep2"]["losses"]), torch.tensor(ref), rtol=1e-4, atol=0
        )
        # HSDP (dp_replicate 2 × fsdp 2) with EP 2: one process's losses from its weights
        torch.testing.assert_close(
            torch.tensor(r["hsdp_ep2"]["losses"]), torch.tensor(hsdp_ref), rtol=1e-4, atol=0
        )
        # EP 1 after the EP 2 save: the expert stacks resharded (FSDP2 Shard(0) over 4 ranks)
        assert r["ep1_resumed"]["resumed"] == pytest.approx(r["ep2"]["after_save"], rel=1e-5)
        for name, want in r["ep2"]["after_save_state"].items():  # the optimizer state too
            got = r["ep1_resumed"]["resumed_state"][name]
            if ".routed_experts." not in name:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
                continue
            # EP 1 groups each expert's tokens otherwise than EP 2: torchtitan's bf16 expert
            # products round differently and NS carries that into the update (seen: 0.6-1.1%;
            # with the experts' momentum lost on resume: 14-23%)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 3e-2, (name, err)
