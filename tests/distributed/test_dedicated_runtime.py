"""Runtime behaviour: gradient accumulation, ModelOutput-like outputs, no-reshard mode, eval, FSDP compat."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import models
from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

HYPER = dict(lr=0.02, adamw_lr=1e-2)
STEPS, MICRO = 3, 2


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _accum_reference(world):
    import dmuon_compile as dmuon

    model = models.build_llama()
    opt = dmuon.Muon(model, predicate=models.proj_predicate, ns_backend=_ns(), **HYPER)
    data = models.batches(STEPS * MICRO, world)
    first = None
    for s in range(STEPS):
        for m in range(MICRO):
            (model(data[s * MICRO + m]).square().mean() / MICRO).backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, first


def _accum_distributed(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import _fsdp_compat, dedicated_runtime
    from tests.distributed.test_dedicated_training import full_state

    mesh = init_device_mesh("cpu", (world,))
    model = models.build_llama()
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    data = models.batches(STEPS * MICRO, world)
    runtime = dedicated_runtime(model)
    flags, first, reduces = [], None, []
    for s in range(STEPS):
        for m in range(MICRO):
            sync = m == MICRO - 1
            model.set_requires_gradient_sync(sync)
            flags.append(_fsdp_compat.requires_gradient_sync(model))
            x = data[s * MICRO + m]
            per = x.shape[0] // world
            (model(x[rank * per:(rank + 1) * per]).square().mean() / MICRO).backward()
            # between micro-steps no owner holds a gradient yet: nothing was reduced
            reduces.append(sum(1 for dp in runtime.params if dp.master is not None and dp.master.grad is not None))
        if first is None:
            first = {n: p.grad.clone() for n, p in dmuon.dedicated_registry.dedicated_parameters(model)}
        opt.step()
        opt.zero_grad()
    return {"flags": flags, "first": first, "reduces": reduces, "state": full_state(model),
            "owned": len(dmuon.dedicated_registry.dedicated_parameters(model))}


def test_gradient_accumulation_with_set_requires_gradient_sync():
    ref_state, ref_first = _accum_reference(2)
    results = run_ranks(_accum_distributed, 2, timeout=120)
    r0 = results[0]
    assert r0["flags"] == [False, True] * STEPS
    for r in results:
        assert r["reduces"] == [0, r["owned"]] * STEPS
        for name, g in r["first"].items():
            torch.testing.assert_close(g, ref_first[name], rtol=1e-4, atol=1e-6)
    for name, ref in ref_state.items():
        torch.testing.assert_close(r0["state"][name], ref, rtol=0, atol=2e-4, msg=lambda m: f"{name}: {m}")


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
        grads.append({n: p.grad for n, p in dmuon.dedicated_registry.dedicated_parameters(m)})
        grads[-1]["states"] = [g.state for g in dmuon.distributed.dedicated_runtime(m).groups]
    out["no_reshard_grads"] = grads
    return out


def test_outputs_untouched_and_reshard_modes():
    for r in run_ranks(_outputs_and_modes, 2, timeout=90):
        assert r["types"] == ["BlockOutput", "BlockOutput"]
        assert r["aux_is_tuple"]
        assert r["max_diff"] < 1e-5 and r["eval_diff"] < 1e-5
        assert set(r["states"]) == {"sharded"}
        a, b = r["no_reshard_grads"]
        assert set(a.pop("states")) == {"sharded"} and set(b.pop("states")) == {"sharded"}
        assert a.keys() == b.keys() and a
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)


def _hf_model(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import dmuon_compile as dmuon

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {"type": type(out).__name__, "logits": tuple(out.logits.shape), "has_loss": out.loss is not None}


def test_huggingface_model_output_keeps_attribute_access():
    pytest.importorskip("transformers")
    for r in run_ranks(_hf_model, 2, timeout=120):
        assert r["type"] == "CausalLMOutputWithPast"
        assert r["logits"] == (2, 8, 64) and r["has_loss"]
