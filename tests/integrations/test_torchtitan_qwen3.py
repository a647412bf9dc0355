"""torchtitan's Qwen3-MoE (its ``debugmodel_moe`` flavor: grouped-query attention with a fused
``wqkv`` and QK-norm, top-k softmax routing, no shared experts) through torchtitan's own
``Trainer.train_step`` (``titan_trainer``: its loss, gradient clipping, LR scheduler and MoE
load-balancing hook), switched to dmuon as docs/moe.md says: ``dedicating(parallelize_fn)`` and
``MuonOptimizers`` (per-head NS on).

- 2 gloo ranks, one spawn: 1-D FSDP2 and expert parallelism 2 with the flavor's 64 experts
  (top 8); 4 ranks, one spawn: HSDP 2 × 2 and fsdp 2 × TP 2 (sequence parallel, torchtitan's
  default with TP), the flavor with 8 experts (top 2: the same model but for the expert count,
  so that the 4 ranks on a 2-core CI machine stay within its time budget). Each trains like one
  process running the same config on the global batch: the first step's gradients (every
  parameter), each step's loss and gradient norm, and every weight at the end, routed experts
  included, within ``TOL``. The expert-bias of the load-balancing hook is equal (the same
  routing counts).
- The optimizer sees what the model is: the three routed expert stacks are ``"experts"``
  layouts (per expert), each rank holding whole experts (FSDP2's ``Shard(0)``, EP's) or TP's
  slices of them; the fused ``wqkv`` and ``wo`` are per head; the router gets AdamW.
- Controls, one process from the same initial weights: with the 64 expert stacks flattened into
  one matrix each (the wrong math per-expert NS avoids; one step, against one process's first
  step: the 64 experts' NS is most of the test's time), and with per-head NS off (8 experts,
  against the runs' end): each lands thousands of times ``TOL`` away.

Two things the model does that are not dmuon's, set aside so that the comparison is tight:

- torchtitan's ``GroupedExperts.forward`` computes the experts in bf16 (it casts the tokens and
  the expert weights), so their fp32 gradients carry bf16 rounding, which differs with the
  token grouping (one process vs data-parallel ranks: ~2e-3 relative). With few tokens per
  expert an expert's gradient is near rank-deficient, and Newton–Schulz lifts that rounding in
  its near-null directions to ~4e-1 of the update (measured at step 1; the old tolerances here
  were 0.2 for the routed experts, 2e-2 for the rest). The experts here compute in fp32
  (:func:`_fp32_experts`: the same forward without the casts); then one process with its batch
  split in two differs from itself by ~1e-5 after 3 steps, experts included, and so do the
  parallel runs.
- torchtitan's ``init_weights`` on CPU gloo ranks gives every shard of a sharded non-dedicated
  weight the same values (DTensor's RNG tracker is not set up on the CPU): the expert stacks'
  halves, the router's rows, the embedding's. A run would start from copies (experts 0-31 equal
  to 32-63), blind to a bug that swaps or duplicates shards. Every run here loads one
  process's initial state instead (``dmuon.set_model_state_dict``), checked not to repeat.

Model: the flavor's first layer (its 8 layers are alike), its FlexAttention replaced by
torchtitan's SDPA module on the CPU (no FlexAttention backward there; same layout, no
parameters), as the other torchtitan tests do.
"""

from __future__ import annotations

import types

import pytest
import torch
from distributed.harness import full_state, run_ranks
from distributed.test_tp import _whole_state

from integrations.test_torchtitan import PER_RANK, SEQ, loss_of, parallelize_on_cpu, tokens
from integrations.test_torchtitan_train_step_ep import (
    batches,
    constant_lr,
    disabled_checkpointer,
    titan_trainer,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.distributed]

LAYERS, STEPS = 1, 2
LR, ADAMW_LR, MAX_NORM = 0.02, 3e-3, 1.0
EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")
STACKS = {f"layers.0.moe.routed_experts.inner_experts.{n}" for n in EXPERTS}
# The largest relative difference from one process (``_distances``: per weight, in its norm).
# Seen (2 steps), attention / experts / the rest: FSDP2 5.5e-6 / 6.7e-6 / 5e-6 to 2.1e-5 (from
# run to run); EP 2 5.3e-6 / 6.4e-6 / 8e-6 to 1.4e-5; HSDP 3.0e-6 / 6.4e-6 / 3.0e-6; dp × TP
# 3.3e-6 / 6.9e-6 / 3.3e-6. Controls: the stacks flattened 5.4e-1 (experts, one step), per-head
# NS off 5.7e-1 (attention, two steps).
TOL = 1e-4
# The first step's gradients before the clip, every parameter (seen up to 6.2e-7; after it they
# differ by the clip's factor too, up to 6.9e-6: torchtitan's norm is summed from fp32 norms of
# shards), each step's gradient norm against one process's in float64 (seen up to 8e-6) and
# each step's loss (seen 6.2e-8).
GRAD_TOL, NORM_RTOL, LOSS_RTOL = 1e-5, 5e-5, 1e-6
# Direct NS: the Gram backend's fp32 Gram matrix squares a near-rank-deficient gradient's
# conditioning (one process with its batch split in two differs from itself by ~1e-4 on the
# attention after 2 steps with it, ~5e-6 direct).
NS = "direct"
FLAVOR = {"experts": 64, "top_k": 8}
SMALL = {"experts": 8, "top_k": 2}


def _fp32_experts_forward(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's ``GroupedExperts.forward`` without its casts to bf16 (see the docstring)."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (
        w.to_local() if isinstance(w, DTensor) else w
        for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
    )
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x_RD)


def _fp32_experts(model) -> None:
    """Each block's experts compute in fp32 (set before ``parallelize``, which wraps the
    module's ``forward`` in its local-map region)."""
    for layer in model.layers.values():
        experts = layer.moe.routed_experts.inner_experts
        experts.forward = types.MethodType(_fp32_experts_forward, experts)


def build_qwen3_moe(ep: bool = False, sp: bool = False, experts: int = 64, top_k: int = 8):
    """torchtitan's Qwen3 ``debugmodel_moe`` (first ``LAYERS`` layers; ``experts`` routed
    experts, ``top_k`` per token) on the meta device, with the sharding config its trainer sets
    (``update_from_config``), the experts in fp32."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    spec = model_registry("debugmodel_moe")
    spec.model.layers = spec.model.layers[:LAYERS]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        old = layer.moe
        if (experts, top_k) != (old.num_experts, old.router.top_k):
            inner = old.routed_experts.inner_experts
            layer.moe = make_moe_config(
                num_experts=experts,
                router=make_router_config(
                    dim=inner.dim,
                    num_experts=experts,
                    gate_param_init=old.router.gate.param_init,
                    top_k=top_k,
                    score_func=old.router.score_func,
                    route_norm=old.router.route_norm,
                ),
                routed_experts=make_routed_experts_config(
                    dim=inner.dim,
                    hidden_dim=inner.hidden_dim,
                    num_experts=experts,
                    top_k=top_k,
                    param_init=inner.param_init,
                    comm_backend="standard",
                ),
                load_balance_coeff=old.load_balance_coeff,
            )
    set_qwen3_sharding_config(spec.model, enable_sp=sp, enable_ep=ep)
    with torch.device("meta"):
        model = spec.model.build()
    _fp32_experts(model)
    return spec, model


def _one_process_model(experts: int, top_k: int):
    """The model on the CPU, its buffers (rope) and weights from ``init_weights`` under seed 0."""
    spec, model = build_qwen3_moe(experts=experts, top_k=top_k)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return spec, model


def _config(per_head: bool = True):
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    return dmuon_tt.MuonOptimizers.Config(
        lr=LR, adamw_lr=ADAMW_LR, per_head=per_head, compile=False, ns_backend=NS
    )


def _train(rank, world, folder, ep=1, tp=1, replicate=1, experts=64, top_k=8, per_rank=PER_RANK):
    """``STEPS`` torchtitan train steps through ``dedicating`` and ``MuonOptimizers`` from one
    process's initial weights, ``per_rank`` sequences per data-parallel rank."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        expert_parallel_degree=ep,
        tensor_parallel_degree=tp,
        data_parallel_replicate_degree=replicate,
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    sp = tp > 1 and parallelism.enable_sequence_parallel  # torchtitan's default with TP
    spec, model = build_qwen3_moe(ep > 1, sp, experts, top_k)
    model = parallelize_on_cpu(dmuon_tt.dedicating(spec.parallelize_fn), model, dims, parallelism,
                               folder)  # fmt: skip
    # One process's initial weights (init_weights repeats one shard's values on every shard).
    start = {n: p.detach() for n, p in _one_process_model(experts, top_k)[1].named_parameters()}
    dmuon.set_model_state_dict(model, start, strict=False)
    dedicated_runtime(model).publish(wait=True)
    whole = _whole_state if tp > 1 else full_state
    initial = whole(model)
    assert initial.keys() == start.keys()
    for name, want in start.items():  # every weight loaded, on every rank
        assert torch.equal(initial[name], want), name
    optimizers = _config().build(model_parts=[model])
    (opt,) = optimizers.optimizers
    grads = {}

    def first_gradients(*args, **kwargs):  # after train_step's clip (by its logged norm)
        if not grads:
            grads.update({n: _whole_grad(p) for n, p in model.named_parameters()})

    optimizers.register_step_pre_hook(first_gradients)
    checkpointer = disabled_checkpointer(model, optimizers, folder)
    trainer = titan_trainer(spec, dims, parallelism, [model], optimizers, checkpointer)
    constant_lr(trainer, optimizers, STEPS, MAX_NORM)
    batch_mesh = dims.get_mesh("batch")
    dp, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    for step in range(STEPS):
        trainer.step = step + 1
        trainer.train_step(batches(step, dp, dp_rank, per_rank))
    dedicated_runtime(model).publish(wait=True)  # HSDP: the last update on every replica
    muon = {p for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    stacks = model.layers["0"].moe.routed_experts.inner_experts
    logged = trainer.metrics_processor.logged
    final = whole(model)
    # The whole tensors are the same on every rank (gathered): rank 0 sends them (~150 MB of
    # expert stacks for 64 experts, a copy each through the harness's queue).
    return {
        "sequences": dp * per_rank,  # the global batch
        "initial": initial if rank == 0 else None,
        "grads": grads if rank == 0 else None,
        "final": final if rank == 0 else None,
        "losses": [m["loss"] for m in logged],
        "norms": [m["norm"] for m in logged],
        "bias": _whole(model.layers["0"].moe.expert_bias_E),
        "kinds": {opt.param_name(p): opt._layout(p).kind for p in muon},
        "per_head": {opt.param_name(p): opt._layout(p).head_dims for p in muon},
        "adamw": sorted(
            opt.param_name(p) for g in opt.param_groups if not g["use_muon"] for p in g["params"]
        ),  # fmt: skip
        "experts_local": {n: tuple(getattr(stacks, n).to_local().shape) for n in EXPERTS},
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _whole_grad(p) -> torch.Tensor:
    """``p``'s gradient whole on every rank (a dedicated one from its owner or TP owners)."""
    import dmuon_compile as dmuon

    return _whole(dmuon.full_tensor(p.grad))


def _scenarios(rank, world, folder, scenarios):
    """Several jobs in one set of rank processes (one start-up and torchtitan import)."""
    return {
        label: _train(rank, world, f"{folder}/{label}", **kw) for label, kw in scenarios.items()
    }


def _reference(
    initial: dict,
    sequences: int,
    experts: int,
    top_k: int,
    steps: int = STEPS,
    flatten_experts=False,
    per_head=True,
) -> dict:
    """One process: the same weights, the global batch (``sequences``), the same
    ``MuonOptimizers`` config, ``steps`` steps of ``train_step`` (gradient clipping, the MoE
    load-balancing hook, a constant learning rate). Controls: ``flatten_experts``, each expert
    stack orthogonalised as one ``(E, F·D)`` matrix; ``per_head=False``, whole-matrix NS."""
    import dmuon_compile as dmuon

    spec, model = _one_process_model(experts, top_k)
    model.load_state_dict(initial, strict=False)
    if flatten_experts:
        for name in EXPERTS:
            dmuon.set_layout(getattr(model.layers["0"].moe.routed_experts.inner_experts, name),
                             dmuon.Layout.conv())  # fmt: skip
    optimizers = _config(per_head).build(model_parts=[model])
    dims = types.SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
    spec.post_optimizer_build_fn(optimizers, [model], dims)  # one process: no mesh to reduce
    losses, norms, grads, first = [], [], None, None
    for step in range(steps):
        optimizers.zero_grad()
        loss = loss_of(model, tokens(step, sequences // PER_RANK), sequences * SEQ)
        loss.backward()
        # The norm the runs log, in float64 (torch's fp32 norms of large tensors are ~1e-5 off
        # on the CPU, differently for the whole tensor and its shards); the clip as torch's.
        norm = torch.stack([p.grad.double().norm() for p in model.parameters()]).norm()
        if grads is None:  # before the clip
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizers.step()
        losses.append(loss.item())
        norms.append(norm.item())
        if first is None:
            first = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "first": first,
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "final": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bias": model.layers["0"].moe.expert_bias_E.clone(),
    }


def _distances(a: dict, b: dict) -> dict[str, float]:
    """The largest relative difference (per weight, in its norm) between two runs' weights:
    the attention's, the routed experts', every other weight's (router, norms, embeddings,
    head)."""
    rel = {n: ((a[n] - w).norm() / w.norm()).item() for n, w in b.items()}
    kinds = {"attention": ".attention.", "experts": ".routed_experts."}
    out = {k: max(d for n, d in rel.items() if part in n) for k, part in kinds.items()}
    out["dense"] = max(d for n, d in rel.items() if ".routed_experts." not in n)
    return out


def _check(results, labels, experts: int, top_k: int, experts_local: dict, control: dict) -> None:
    """Every rank of the runs ``labels`` (the same initial weights and global batch) against one
    process (see the module docstring). ``control``: one process's option that must end
    outside the tolerance (``"steps": 1``: of one process's first step, not of the run's
    end)."""
    run = results[0][labels[0]]
    initial = run["initial"]
    for name in STACKS:  # one process's weights, not init_weights' repeated shards
        w = initial[name]
        assert not torch.equal(w[: len(w) // 2], w[len(w) // 2 :]), name
    ref = _reference(initial, run["sequences"], experts, top_k)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # it trained
    assert ref["bias"].abs().max() > 0  # the load-balancing hook moved the bias
    assert ref["norms"][0] > MAX_NORM  # the clip scaled the gradients
    for label in labels:
        r0 = results[0][label]
        for name, want in initial.items():  # every run from the same one-process weights
            torch.testing.assert_close(r0["initial"][name], want, rtol=0, atol=0, msg=label)
        assert r0["grads"].keys() == ref["grads"].keys(), label
        unclip = (r0["norms"][0] + 1e-6) / MAX_NORM  # torch's clip factor, by the run's norm
        for name, want in ref["grads"].items():
            err = ((r0["grads"][name] * unclip - want).norm() / want.norm()).item()
            assert err < GRAD_TOL, (label, name, err)
        assert r0["final"].keys() == ref["final"].keys(), label
        far = _distances(r0["final"], ref["final"])
        assert all(d < TOL for d in far.values()), (label, far)
        for rank, r in enumerate(result[label] for result in results):
            msg = f"{label}, rank {rank}"
            assert r["sequences"] == run["sequences"], msg
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0,
                msg=msg,
            )  # fmt: skip
            torch.testing.assert_close(
                torch.tensor(r["norms"]),
                torch.tensor(ref["norms"]),
                rtol=NORM_RTOL,
                atol=0,
                msg=msg,
            )
            torch.testing.assert_close(r["bias"], ref["bias"], rtol=0, atol=1e-7, msg=msg)
            # The layouts: per expert for the routed stacks, per head for the attention.
            assert {n for n, k in r["kinds"].items() if k == "experts"} == STACKS, msg
            assert r["per_head"]["layers.0.attention.qkv_linear.wqkv.weight"] == (128,) * 3
            assert r["per_head"]["layers.0.attention.wo.weight"] == (128,)
            assert "layers.0.moe.router.gate.weight" in r["adamw"], msg
            assert r["experts_local"]["w1_EFD"] == experts_local[label], msg
    # Control: one process with the option off ends outside the tolerance, from the same weights.
    other = _reference(initial, run["sequences"], experts, top_k, **control)["final"]
    far = _distances(other, ref["first"] if control.get("steps") == 1 else run["final"])
    assert max(far.values()) > 100 * TOL, (control, far)


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_qwen3_moe_trains_like_one_process_through_train_step_on_fsdp2_and_ep2(tmp_path):
    """FSDP2 and EP 2 on 2 ranks, the flavor's 64 experts: each rank holds 32 whole experts.
    Control: one step with the expert stacks flattened (one NS over all 64 experts) ends
    elsewhere than one process's first step (one step: the 64 experts' NS is most of this
    test's time)."""
    pytest.importorskip("torchtitan")
    scenarios = {"fsdp": FLAVOR, "ep": {**FLAVOR, "ep": 2}}
    results = run_ranks(_scenarios, 2, str(tmp_path), scenarios, timeout=220)
    local = {label: (32, 768, 256) for label in scenarios}
    _check(results, list(scenarios), **FLAVOR, experts_local=local,
           control={"flatten_experts": True, "steps": 1})  # fmt: skip


@pytest.mark.distributed  # spawns 4 gloo ranks
def test_qwen3_moe_trains_like_one_process_through_train_step_under_hsdp_and_tp(tmp_path):
    """HSDP (dp_replicate 2 × fsdp 2: each replica's ranks hold 4 whole experts) and fsdp 2 ×
    TP 2 with sequence parallel (the experts' hidden dim cut by TP, whole along the expert dim
    on FSDP2's ranks; the fused ``wqkv`` column-parallel by whole kv groups, per-head NS on the
    TP owners; QK-norm on TP's head shards), 8 experts, the same global batch of 8 sequences.
    Control: per-head NS off ends elsewhere."""
    pytest.importorskip("torchtitan")
    scenarios = {
        "hsdp": {**SMALL, "replicate": 2},
        "dp_tp": {**SMALL, "tp": 2, "per_rank": 2 * PER_RANK},
    }
    results = run_ranks(_scenarios, 4, str(tmp_path), scenarios, timeout=220)
    local = {"hsdp": (4, 768, 256), "dp_tp": (4, 384, 256)}
    _check(results, list(scenarios), **SMALL, experts_local=local, control={"per_head": False})
