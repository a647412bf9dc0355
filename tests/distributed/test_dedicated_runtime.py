"""Runtime behaviour: gradient accumulation, ModelOutput-like outputs, no-reshard mode, eval,
FSDP compatibility."""

from __future__ import annotations

import pytest
import torch

from dmuon_compile.distributed._runtime.group import GroupState
from dmuon_compile.distributed._runtime.runtime import RuntimeState

from . import models
from .harness import full_state, local_device, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

HYPER = {"lr": 0.02, "adamw_lr": 1e-2}
STEPS, MICRO = 3, 2


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _accum_reference(world, device="cpu"):
    import dmuon_compile as dmuon

    model = models.build_llama().to(device)
    opt = dmuon.Muon(model, predicate=models.proj_predicate, ns_backend=_ns(), **HYPER)
    data = models.batches(STEPS * MICRO, world)
    first = None
    for s in range(STEPS):
        for m in range(MICRO):
            (model(data[s * MICRO + m].to(device)).square().mean() / MICRO).backward()
        if first is None:
            first = {n: p.grad.cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, first


def _accum_distributed(rank, world, device="cpu", keep=False):
    """``keep``: FSDP2's ``set_reshard_after_backward(False)`` on every micro-batch but the
    last (as torch's pipeline schedules set it): the dedicated groups stay unsharded, so the
    next micro-batch's forward gathers nothing."""
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._compat import fsdp as _fsdp_compat
    from dmuon_compile.distributed._compat.autograd import in_backward
    from dmuon_compile.distributed._runtime.group import DedicatedGroup

    model, _ = models.build_dedicated(world, device=device)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    data = models.batches(STEPS * MICRO, world)
    runtime = dedicated_runtime(model)
    flags, first, reduces, gathers, sharded = [], None, [], [], []
    original = DedicatedGroup.unshard

    def counting(group, prefetch=False):
        if group.state == GroupState.SHARDED and not in_backward():  # the forward's gathers
            gathers[-1] += 1
        original(group, prefetch)

    DedicatedGroup.unshard = counting
    for s in range(STEPS):
        for m in range(MICRO):
            sync = m == MICRO - 1
            model.set_requires_gradient_sync(sync)
            model.set_reshard_after_backward(sync or not keep)
            flags.append(_fsdp_compat.grad_reduction(model).sync)
            gathers.append(0)
            x = data[s * MICRO + m].to(local_device(device))
            per = x.shape[0] // world
            (model(x[rank * per : (rank + 1) * per]).square().mean() / MICRO).backward()
            # between micro-steps no owner holds a gradient yet: nothing was reduced
            reduces.append(sum(1 for dp in runtime.params if dp.owns and dp.param.grad is not None))
            sharded.append(all(g.state == GroupState.SHARDED for g in runtime.groups))
        if first is None:
            first = {n: g.clone() for n, g in models.owned_grads(model).items()}
        opt.step()
        opt.zero_grad()
    DedicatedGroup.unshard = original
    return {
        "flags": flags,
        "first": first,
        "reduces": reduces,
        "state": full_state(model),
        "owned": len(models.owned_masters(model)),
        "gathers": gathers,
        "sharded": sharded,
        "groups": len(runtime.groups),
    }


@pytest.mark.parametrize("keep", [False, True], ids=["reshard", "keep_after_backward"])
def test_gradient_accumulation_with_set_requires_gradient_sync(keep):
    check_gradient_accumulation("cpu", keep)


def check_gradient_accumulation(device: str, keep: bool = False) -> None:
    ref_state, ref_first = _accum_reference(2, device)
    results = run_ranks(_accum_distributed, 2, device, keep, timeout=120, device=device)
    r0 = results[0]
    assert r0["flags"] == [False, True] * STEPS
    # After a syncing backward every group is resharded; after one without sync only where
    # FSDP2's set_reshard_after_backward(False) says to keep them (the control: reshard).
    assert r0["sharded"] == [not keep, True] * STEPS
    groups = r0["groups"]
    for r in results:  # forward all-gathers per micro-batch: kept groups gather nothing
        first_micro, second_micro = r["gathers"][0::2], r["gathers"][1::2]
        assert all(n >= groups for n in first_micro), r["gathers"]
        if keep:
            assert all(n == 0 for n in second_micro), r["gathers"]
        else:  # the control: every micro-batch gathers every group again
            assert all(n >= groups for n in second_micro), r["gathers"]
    for r in results:
        assert r["reduces"] == [0, r["owned"]] * STEPS
        for name, g in r["first"].items():
            torch.testing.assert_close(g, ref_first[name], rtol=1e-4, atol=1e-6)
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            r0["state"][name], ref, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def _step_after_kept_backward(rank, world):
    """A step right after a backward without sync that kept the groups unsharded (the user did
    not sync the last micro-batch): the step drops the kept weights, which it is about to
    change, so the next forward gathers the new ones."""
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    model, _ = models.build_dedicated(world)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    runtime = dedicated_runtime(model)
    x = models.batches(1, world)[0]
    per = x.shape[0] // world
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    model(x[rank * per : (rank + 1) * per]).square().mean().backward()
    kept = [g.state == GroupState.UNSHARDED for g in runtime.groups]
    opt.step()
    return {"kept": kept, "after_step": [g.state == GroupState.SHARDED for g in runtime.groups]}


def test_a_step_drops_the_weights_a_backward_kept_unsharded():
    for r in run_ranks(_step_after_kept_backward, 2, timeout=120):
        assert any(r["kept"]) and all(r["after_step"]), r


def _outputs_and_modes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(7))
    out = {}
    # ModelOutput-like dataclass returned by the hook-boundary module keeps type and attributes
    torch.manual_seed(3)
    plain = models.OutputModel()
    torch.manual_seed(3)
    model = models.OutputModel()
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    got, want = model(x), plain(x)
    out["types"] = [type(o).__name__ for o in got]
    out["max_diff"] = max(float((a.hidden - b.hidden).abs().max()) for a, b in zip(got, want))
    out["aux_is_tuple"] = all(isinstance(o.aux, tuple) for o in got)
    got[-1].hidden.square().mean().backward()
    with torch.no_grad():  # eval forward: unshard, reshard, no backward state left behind
        again = model(x)
    out["eval_diff"] = float((again[-1].hidden - want[-1].hidden).abs().max())
    out["states"] = [g.state for g in dmuon.distributed.dedicated_runtime(model).groups]
    # reshard_after_forward=False keeps the weights until the end of backward; same gradients
    torch.manual_seed(0)
    a = models.build_llama()
    torch.manual_seed(0)
    b = models.build_llama()
    dmuon.dedicate_params(a, mesh, predicate=models.proj_predicate, reshard_after_forward=False)
    dmuon.dedicate_params(b, mesh, predicate=models.proj_predicate, reshard_after_forward=True)
    grads = []
    for m in (a, b):
        m(x).square().mean().backward()
        grads.append(models.owned_grads(m))
        grads[-1]["states"] = [g.state for g in dmuon.distributed.dedicated_runtime(m).groups]
    out["no_reshard_grads"] = grads
    runtime_states = [dmuon.distributed.dedicated_runtime(b).state]  # backward done
    # a forward without backward leaves the last group unsharded; new master values must still
    # reach the next forward (zeroed projections: every block becomes the identity)
    b(x)
    runtime_states.append(dmuon.distributed.dedicated_runtime(b).state)
    with torch.no_grad():
        for _, p in models.owned_masters(b):
            p.zero_()
    y = b(x)
    out["stale_diff"] = float((y - b.lm_head(b.norm(x))).abs().max())
    out["runtime_states"] = runtime_states
    # hook_boundary_predicate: one group per attention / MLP module instead of per block
    c = models.build_llama()
    dmuon.dedicate_params(
        c,
        mesh,
        predicate=models.proj_predicate,
        hook_boundary_predicate=lambda name, m: isinstance(m, (models.Attention, models.MLP)),
    )
    c(x).square().mean().backward()
    out["boundary_groups"] = [g.name for g in dmuon.distributed.dedicated_runtime(c).forward_order]
    out["boundary_grads"] = models.owned_grads(c)
    # activation checkpointing: the recomputation inside backward finds its weights
    d = models.build_llama()
    d.checkpoint = True
    dmuon.dedicate_params(d, mesh, predicate=models.proj_predicate)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole blocks
        d(x).square().mean().backward()
    out["ckpt_grads"] = models.owned_grads(d)
    out["ckpt_states"] = sorted(
        {g.state for g in dmuon.distributed.dedicated_runtime(d).groups}, key=str
    )
    return out


def test_outputs_untouched_and_reshard_modes():
    for r in run_ranks(_outputs_and_modes, 2, timeout=90):
        assert r["types"] == ["BlockOutput", "BlockOutput"]
        assert r["aux_is_tuple"]
        assert r["max_diff"] < 1e-5 and r["eval_diff"] < 1e-5
        assert set(r["states"]) == {GroupState.SHARDED}
        a, b = r["no_reshard_grads"]
        assert set(a.pop("states")) == set(b.pop("states")) == {GroupState.SHARDED}
        assert a.keys() == b.keys() == r["boundary_grads"].keys() and a
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["boundary_grads"][n], b[n], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["ckpt_grads"][n], b[n], rtol=1e-5, atol=1e-7)
        assert r["ckpt_states"] == [GroupState.SHARDED]
        assert r["stale_diff"] < 1e-6
        assert r["runtime_states"] == [RuntimeState.IDLE, RuntimeState.FORWARD_DONE]
        assert r["boundary_groups"] == [
            f"layers.{i}.{m}" for i in range(models.LAYERS) for m in ("self_attn", "mlp")
        ]


def _hf_model(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import dmuon_compile as dmuon

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    owners = dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    want = plain(input_ids=ids, labels=ids)
    return {
        "type": type(out).__name__,
        "logits": tuple(out.logits.shape),
        "has_loss": out.loss is not None,
        "loss_diff": abs(float(out.loss) - float(want.loss)),
        "dedicated": len(owners),
        "groups": [g.name for g in dmuon.distributed.dedicated_runtime(model).groups],
    }


def test_huggingface_model_output_keeps_attribute_access():
    pytest.importorskip("transformers")
    for r in run_ranks(_hf_model, 2, timeout=120):
        assert r["type"] == "CausalLMOutputWithPast"
        assert r["logits"] == (2, 8, 64) and r["has_loss"] and r["loss_diff"] < 1e-5
        assert r["dedicated"] == 2 * 7 and r["groups"] == ["model.layers.0", "model.layers.1"]


def _precision_and_recovery(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(5))
    out = {}
    # param_policy: bf16 compute copies, fp32 masters and fp32 owner gradients
    model = models.build_llama()
    policy = dmuon.ParamPolicy(
        dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate, param_policy=policy)
    seen = []
    model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: seen.append(m.weight.dtype)
    )
    model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: (a[0].to(torch.bfloat16),)
    )
    for block in model.layers:  # the blocks run in bf16 like FSDP2's param_dtype would make them
        for module in block.modules():  # (the dedicated weights' dtype is param_policy's business)
            if isinstance(module, models.RMSNorm):
                module.to(torch.bfloat16)
    model.norm.to(torch.bfloat16)
    model.lm_head.to(torch.bfloat16)
    loss = model(x.to(torch.bfloat16)).float().square().mean()
    loss.backward()
    owned = dmuon.dedicated_registry.dedicated_parameters(model)
    out["compute_dtype"] = str(seen[0])
    out["master_dtypes"] = sorted({str(p.dtype) for _, p in owned})
    out["grad_dtypes"] = sorted({str(p.grad.dtype) for _, p in owned})
    out["comm_dtypes"] = sorted(
        {
            (g["compute_dtype"], g["reduce_dtype"])
            for g in dmuon.summarize_comm_plan(model)["groups"]
        }
    )
    legacy = models.build_llama()
    dmuon.dedicate_params(
        legacy, mesh, predicate=models.proj_predicate, compute_dtype=torch.bfloat16
    )
    out["legacy_dtypes"] = sorted(
        {g["compute_dtype"] for g in dmuon.summarize_comm_plan(legacy)["groups"]}
    )
    try:
        dmuon.dedicate_params(
            models.build_llama(),
            mesh,
            predicate=models.proj_predicate,
            compute_dtype=torch.float16,
            param_policy=policy,
        )
        out["conflict"] = None
    except ValueError as exc:
        out["conflict"] = str(exc)
    # an exception mid-forward, then wait_all_replicate_broadcasts: nothing pending, training
    # resumes
    model = models.build_llama()
    fresh = models.build_llama()
    for m in (model, fresh):
        dmuon.dedicate_params(m, mesh, predicate=models.proj_predicate)
    model(x).square().mean().backward()  # records the forward order (prefetch active next time)
    for _, p in dmuon.dedicated_registry.dedicated_parameters(model):
        p.grad = None

    models.interrupt_forward(model, x, layer=1)
    dmuon.wait_all_replicate_broadcasts(model)
    runtime = dedicated_runtime(model)
    out["after_interrupt"] = sorted(
        {(g.state, len(g.works), len(g.pending_reduce)) for g in runtime.groups}, key=str
    )
    grads = []
    for m in (model, fresh):
        m(x).square().mean().backward()
        grads.append(models.owned_grads(m))
    out["resume_grads"] = grads
    return out


def test_mixed_precision_policy_and_recovery_after_interrupt():
    for r in run_ranks(_precision_and_recovery, 2, timeout=90):
        assert r["compute_dtype"] == "torch.bfloat16"
        assert r["master_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"]
        assert r["comm_dtypes"] == [("bfloat16", "float32")]
        assert r["legacy_dtypes"] == ["bfloat16"]
        assert (
            r["conflict"] is not None
            and "compute_dtype" in r["conflict"]
            and "param_dtype" in r["conflict"]
        )
        assert r["after_interrupt"] == [(GroupState.SHARDED, 0, 0)]
        a, b = r["resume_grads"]
        assert a.keys() == b.keys() and a
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)


def _private_groups(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from dmuon_compile.distributed._comm import collectives as C

    flat = init_device_mesh("cpu", (world,))
    own = C.private_group(flat)
    out = {
        "own_is_new": own is not flat.get_group(),
        "own_ranks": dist.get_process_group_ranks(own),
    }
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard, rep = C.private_group(hsdp["shard"]), C.private_group(hsdp["replicate"])
    out["shard_ranks"] = dist.get_process_group_ranks(shard)
    out["rep_ranks"] = dist.get_process_group_ranks(rep)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=shard)  # the new groups work
    out["shard_sum"] = float(t)
    # Group ranks of a new group are ascending; a mesh listing its ranks in another order
    # keeps the mesh's own group, so the runtime's local ranks stay the mesh's.
    reversed_mesh = DeviceMesh("cpu", torch.arange(world).flip(0))
    out["reversed_keeps_mesh_group"] = C.private_group(reversed_mesh) is reversed_mesh.get_group()
    # A second call over the same ranks (another model, another mesh object) reuses the group.
    again = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["reused"] = C.private_group(again["shard"]) is shard and C.private_group(flat) is own
    return out


def test_private_groups_mirror_the_mesh_and_fall_back_for_unsorted_meshes():
    results = run_ranks(_private_groups, 4, timeout=90)
    for rank, r in enumerate(results):
        assert r["own_is_new"] and r["own_ranks"] == [0, 1, 2, 3]
        replica = rank // 2
        assert r["shard_ranks"] == [2 * replica, 2 * replica + 1]
        assert r["rep_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["shard_sum"] == float(4 * replica + 1)
        assert r["reversed_keeps_mesh_group"]
        assert r["reused"], "a second dedicate_params over the same ranks created new communicators"
