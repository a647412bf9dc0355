"""The recipes switched on from torchtitan's job config,
``MuonOptimizers.Config(per_head=True, normuon=..., qk_clip=tau)``, through torchtitan's own
``Trainer.train_step`` on gloo ranks (``titan_trainer``: its gradient clipping, LR scheduler,
MoE load-balancing hook), with ``dedicating(parallelize_fn)``.

- Each layout trains like one process running the same config on the global batch: the losses,
  the attention weights at the end, each step's per-head max logits and the clip counts. 2
  ranks: torchtitan's Llama-3 debug model under 1-D FSDP2 (per-head NS and QK-clip, and with
  NorMuon too), TP 2 (a grouped-query variant, its fused ``wqkv`` column-parallel by whole kv
  groups; per-head NS on the TP owners, and QK-clip) and its DeepSeek-V3 debug model
  (multi-head latent attention; all three recipes, NorMuon on the expert stacks too) at expert
  parallelism 2. 4 ranks: HSDP 2 × 2.
- ``tau`` is below the logits these models reach: the clip fires on every rank, and heads that
  exceed it on one data-parallel rank only are clipped on all (every rank's maxima are the
  largest of the ranks' own).
- Controls: the job with the clip off ends elsewhere than one process with it; whole-matrix NS
  elsewhere than per-head.
- One process: after the clip, each clipped head's max on the same batch is ``tau`` and the
  other heads' maxima are unchanged, on torchtitan's fused ``wqkv`` (stored per kv head, not
  ``[q; k; v]``: the rows scaled as ``[q; k; v]`` missed heads) and on MLA.
"""

from __future__ import annotations

import types

import pytest
import torch
from distributed.harness import full_state, run_ranks
from distributed.test_tp import _whole_state

from integrations.test_torchtitan import (
    PER_RANK,
    SEQ,
    STEPS,
    build_debug_model,
    loss_of,
    parallelize_on_cpu,
    tokens,
)
from integrations.test_torchtitan_moe import _full, build_dsv3
from integrations.test_torchtitan_train_step_ep import (
    batches,
    constant_lr,
    disabled_checkpointer,
    titan_trainer,
)

pytestmark = [pytest.mark.timeout(240)]

LR, ADAMW_LR, MAX_NORM = 0.02, 3e-3, 1.0
# Below the max logits the debug models reach in 3 steps (Llama-3 ~0.3-1, DeepSeek-V3 ~0.5-2):
# some heads clip, others not (_check: no max so near tau that rounding could flip its clip).
TAU = {"llama": 0.35, "llama_gqa": 0.35, "dsv3": 0.8}
# Relative agreement with one process. Under torchtitan's EP path DeepSeek-V3's routed experts'
# gradients differ from one process's by ~2e-3, with or without dmuon (test_torchtitan_moe.py);
# its attention weights and maxima here by ~1e-4.
REL = {"llama": 1e-4, "llama_gqa": 1e-4, "dsv3": 1e-3}


def _config(arch: str, per_head=True, normuon=False, clip=True, expert_ns="per_replica"):
    """The job's optimizer config (one process's too): ``tau`` of ``arch`` unless ``clip`` is
    off."""
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    return dmuon_tt.MuonOptimizers.Config(
        lr=LR,
        adamw_lr=ADAMW_LR,
        per_head=per_head,
        normuon=normuon,
        qk_clip=TAU[arch] if clip else None,
        compile=False,
        expert_ns=expert_ns,
    )


def build_llama(kv_heads: int | None = None, sequence_parallel: bool = False):
    """torchtitan's Llama-3 debug model (``build_debug_model``: 2 layers, SDPA), with
    ``kv_heads`` kv heads (grouped-query attention; the debug model has 16 of 16): its fused
    ``wqkv`` then holds per kv head its 4 q heads, its k and its v."""
    from functools import partial

    from torch import nn
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    spec, model = build_debug_model(sequence_parallel)
    if kv_heads is None:
        return spec, model
    for layer in spec.model.layers:
        old = layer.attention
        layer.attention = make_gqa_config(
            dim=old.dim,
            n_heads=old.n_heads,
            n_kv_heads=kv_heads,
            wqkv_param_init={"weight": partial(nn.init.trunc_normal_, std=0.02),
                             "bias": nn.init.zeros_},
            wo_param_init=old.wo.param_init,
            inner_attention=ScaledDotProductAttention.Config(),
            rope=old.rope,
            fuse_qkv=True,
        )  # fmt: skip
    set_llama3_sharding_config(spec.model, enable_sp=sequence_parallel)
    with torch.device("meta"):
        model = spec.model.build()
    return spec, model


def _build(arch: str, ep: bool = False):
    if arch == "dsv3":
        return build_dsv3(ep)
    return build_llama(kv_heads=4 if arch == "llama_gqa" else None)


def _train(rank, world, folder, arch="llama", tp=1, ep=1, replicate=1, **config):
    """``STEPS`` torchtitan train steps through ``dedicating`` and ``MuonOptimizers``."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=ep)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims(
        dp_replicate=replicate, dp_shard=-1, cp=1, tp=tp, pp=1, ep=ep, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    spec, model = _build(arch, ep > 1)
    per_head = config.get("per_head", True)  # planned per head as the optimizer steps
    model = parallelize_on_cpu(dmuon_tt.dedicating(spec.parallelize_fn, per_head=per_head), model,
                               dims, parallelism, folder)  # fmt: skip
    dedicated_runtime(model).publish(wait=True)
    whole = _whole_state if tp > 1 else (_full if arch == "dsv3" else full_state)
    initial = whole(model)
    optimizers = _config(arch, **config).build(model_parts=[model])
    (opt,) = optimizers.optimizers
    checkpointer = disabled_checkpointer(model, optimizers, folder)
    trainer = titan_trainer(spec, dims, parallelism, [model], optimizers, checkpointer)
    constant_lr(trainer, optimizers, STEPS, MAX_NORM)
    local, reduced = [], []  # per step: this rank's per-head maxima, and all ranks' (the clip's)
    if opt.qk_clip is not None:
        clip = opt.qk_clip
        optimizers.register_step_pre_hook(  # before the step's clip reduces them
            lambda *a, **k: local.append(
                torch.cat([att.running.clone() for att in clip.attentions])
            )
        )
        optimizers.register_step_post_hook(lambda *a, **k: reduced.append(clip.last_max.clone()))
    batch_mesh = dims.get_optional_mesh("batch")
    dp, dp_rank = (1, 0) if batch_mesh is None else (batch_mesh.size(), batch_mesh.get_local_rank())
    for step in range(STEPS):
        trainer.step = step + 1
        trainer.train_step(batches(step, dp, dp_rank, PER_RANK))
    # HSDP: the last step's updates and clip reach the other replica at the next forward (as
    # any write between steps); publish them now to read them from any rank.
    dedicated_runtime(model).publish(wait=True)
    out = {
        "initial": initial,
        "losses": [m["loss"] for m in trainer.metrics_processor.logged],
        "final": {n: t for n, t in whole(model).items() if ".attention." in n},
        "clipped": None if opt.qk_clip is None else opt.qk_clip.clipped.clone(),
        "expert_stage": repr(opt._expert_stage[1]),
        # TP: the projections whose shards hold whole heads, planned on every TP rank
        "tp_local": sorted(tp.owners.local) if (tp := dedicated_runtime(model).tp) else [],
    }
    if arch == "dsv3":
        out["experts"] = {n: t for n, t in whole(model).items() if ".routed_experts." in n}
    if local:
        out.update(local=torch.stack(local), reduced=torch.stack(reduced))
    return out


def _scenarios(rank, world, folder, scenarios):
    """Several jobs in one set of rank processes (one start-up and torchtitan import)."""
    return {
        label: _train(rank, world, f"{folder}/{label}", **kw) for label, kw in scenarios.items()
    }


def _reference(arch: str, initial: dict, dp: int, **config):
    """One process: the same weights, the global batch of ``dp`` ranks, the same
    ``MuonOptimizers`` config, the steps of ``train_step`` (gradient clipping, the MoE
    load-balancing hook, a constant learning rate)."""
    spec, model = _build(arch)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (rope); weights from `initial`
    model.load_state_dict(initial, strict=False)
    optimizers = _config(arch, **config).build(model_parts=[model])
    if spec.post_optimizer_build_fn is not None:  # one process: no mesh to reduce over
        dims = types.SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
        spec.post_optimizer_build_fn(optimizers, [model], dims)
    (opt,) = optimizers.optimizers
    reduced, losses = [], []
    for step in range(STEPS):
        optimizers.zero_grad()
        loss = loss_of(model, tokens(step, dp), dp * PER_RANK * SEQ)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizers.step()
        losses.append(loss.item())
        if opt.qk_clip is not None:
            reduced.append(opt.qk_clip.last_max.clone())
    return {
        "losses": losses,
        "final": {n: p.detach().clone() for n, p in model.named_parameters() if ".attention." in n},
        "clipped": None if opt.qk_clip is None else opt.qk_clip.clipped.clone(),
        "reduced": torch.stack(reduced) if reduced else None,
    }


def _distance(a: dict, b: dict) -> float:
    """The largest relative difference between the attention weights of two runs."""
    return max(((a[n] - w).norm() / w.norm()).item() for n, w in b.items())


def _check(results, label, arch, dp, **config) -> dict:
    """Every rank of ``label`` against one process from its initial weights: the losses, the
    attention weights (or ``final``'s) at the end, each step's per-head maxima and the clip
    counts; the clip fired, and every rank's maxima are the largest of the ranks' own. Returns
    the reference."""
    runs = [r[label] for r in results]
    ref = _reference(arch, runs[0]["initial"], dp, **config)
    if ref["reduced"] is not None:  # no max so near tau that rounding could flip its clip
        margin = ((ref["reduced"] - TAU[arch]).abs() / TAU[arch]).min()
        assert margin > 2 * REL[arch], f"{label}: a max within {margin:.1e} of tau: move tau"
    for rank, r in enumerate(runs):
        msg = f"{label}, rank {rank}"
        for name, want in runs[0]["initial"].items():  # every rank started from these
            torch.testing.assert_close(r["initial"][name], want, rtol=0, atol=0, msg=msg)
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0, msg=msg
        )
        assert r["final"].keys() == ref["final"].keys(), msg
        distance = _distance(r["final"], ref["final"])
        assert distance < REL[arch], (msg, distance)
        if ref["clipped"] is None:
            assert r["clipped"] is None, msg
            continue
        assert r["clipped"].sum() > 0, msg  # the clip fired
        assert torch.equal(r["clipped"], ref["clipped"]), (msg, r["clipped"], ref["clipped"])
        torch.testing.assert_close(r["reduced"], ref["reduced"], rtol=REL[arch], atol=0)
        # One all_reduce(MAX): every rank scales by the largest of the ranks' maxima.
        largest = torch.stack([run["local"] for run in runs]).amax(0)
        assert torch.equal(r["reduced"], largest), msg
        fired = (r["reduced"] > TAU[arch]).sum(0)
        assert torch.equal(r["clipped"], fired), msg
    return ref


def _one_rank_over_tau(results, label: str, arch: str) -> int:
    """How many (step, head) maxima exceeded ``tau`` on one data-parallel rank only (the
    others below): heads that rank alone made every rank clip (``_check``: the clip counts
    follow the ranks' largest maxima)."""
    over = torch.stack([r[label]["local"] for r in results]) > TAU[arch]
    return int((over.any(0) & ~over.all(0)).sum())


SCENARIOS_2 = {
    "fsdp": {},
    "fsdp_normuon": {"normuon": True},
    "fsdp_no_clip": {"clip": False},
    "tp": {"arch": "llama_gqa", "tp": 2},
    "ep": {"arch": "dsv3", "ep": 2, "normuon": True},
}


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_per_head_normuon_and_qk_clip_train_like_one_process_on_fsdp_tp_and_ep(tmp_path):
    """2 ranks, torchtitan's ``train_step``: 1-D FSDP2 with dedicated weights (per-head NS and
    QK-clip; NorMuon too), TP 2 (grouped-query attention, its fused ``wqkv`` column-parallel by
    whole kv groups; per-head NS on the TP owners, and QK-clip) and EP 2
    (DeepSeek-V3, multi-head latent attention; per-head NS, NorMuon and QK-clip) each equal one
    process. Controls: the clip off ends elsewhere than the clipped run; per-head NS off
    ends elsewhere than per-head on."""
    pytest.importorskip("torchtitan")
    results = run_ranks(_scenarios, 2, str(tmp_path), SCENARIOS_2, timeout=220)
    fsdp = _check(results, "fsdp", "llama", 2)
    _check(results, "fsdp_normuon", "llama", 2, normuon=True)
    _check(results, "tp", "llama_gqa", 1)
    # dedicating(per_head=True): wqkv's and wo's TP shards hold whole kv groups and heads, so the
    # owner plan loads both TP ranks of the owner column with their own heads
    local = results[0]["tp"]["tp_local"]
    assert local and all(n.endswith((".wqkv.weight", ".wo.weight")) for n in local), local
    _check(results, "ep", "dsv3", 2, normuon=True)
    assert _one_rank_over_tau(results, "fsdp", "llama") > 0
    assert _one_rank_over_tau(results, "ep", "dsv3") > 0
    # Controls: the clip off (it equals one process without the clip) ends elsewhere than
    # one process with it from the same weights; whole-matrix NS elsewhere than per-head.
    off = results[0]["fsdp_no_clip"]
    _check(results, "fsdp_no_clip", "llama", 2, clip=False)
    assert _distance(off["final"], _reference("llama", off["initial"], 2)["final"]) > 1e-2
    whole = _reference("llama", results[0]["fsdp"]["initial"], 2, per_head=False)
    assert _distance(whole["final"], fsdp["final"]) > 1e-2


@pytest.mark.distributed  # spawns 4 gloo ranks
def test_per_head_and_qk_clip_train_like_one_process_under_hsdp_2x2(tmp_path):
    """4 ranks: HSDP (dp_replicate 2 × fsdp 2, dedicated weights: the global owner clips its
    masters, the next forward publishes them to the other replica) with per-head NS and
    QK-clip through ``train_step``, equal to one process."""
    pytest.importorskip("torchtitan")
    results = run_ranks(_scenarios, 4, str(tmp_path), {"hsdp": {"replicate": 2}}, timeout=200)
    _check(results, "hsdp", "llama", 4)


@pytest.mark.parametrize("arch", ["llama", "llama_gqa", "dsv3"])
def test_the_clip_brings_torchtitans_clipped_heads_to_tau_and_leaves_the_others(arch):
    """One process, one batch three times (the weights otherwise unchanged): with ``tau``
    between the first layer's maxima, each head above it has max ``tau`` on the same batch after
    the clip, every other head keeps its max bit for bit. torchtitan's fused ``wqkv`` holds its
    rows by kv head (``[q heads; k; v]`` per kv head, for column-parallel shards of whole
    groups), not ``[q; k; v]``: scaled as ``[q; k; v]``, the clip missed heads and scaled other
    heads' rows and v's."""
    pytest.importorskip("torchtitan")
    import dmuon_compile as dmuon

    spec, model = _build(arch)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    batch = tokens(0, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the steps leave the weights
    clip = dmuon.QKClip(model, tau=1e9).attach(opt)
    maxima = []
    for _ in range(3):
        loss_of(model, batch, batch.numel()).backward()
        opt.step()  # then the clip: the heads above tau scaled
        maxima.append(clip.max_logits()["layers.0.attention"])
        if len(maxima) == 1:  # tau between the middle two heads' maxima
            ordered = maxima[0].sort().values
            clip.tau = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    first, before, after = maxima
    assert torch.equal(before, first)
    fired = before > clip.tau
    assert fired.sum() == len(before) // 2
    torch.testing.assert_close(after[fired], torch.full_like(after[fired], clip.tau))
    assert torch.equal(after[~fired], before[~fired])


@pytest.mark.distributed  # spawns 4 gloo ranks
def test_deepseek_v3_experts_once_per_job_under_hsdp_2x2(tmp_path):
    """4 ranks, torchtitan's DeepSeek-V3 debug model under HSDP (dp_replicate 2 × fsdp 2) with
    ``MuonOptimizers.Config(expert_ns="once")`` through ``train_step``: the replicas split the
    routed experts' NS and all-gather it. It trains like one process (losses, attention) and
    its routed experts end bit for bit where ``"per_replica"``'s do (who orthogonalises
    changes, not the math; the expert weights are not compared with one process: rarely
    routed experts' gradients are near rank-deficient, and NS turns torchtitan's ~2e-3
    gradient differences into a few % of their update). Control: the plan splits over the
    replicas only with ``"once"``."""
    pytest.importorskip("torchtitan")
    hsdp = {"arch": "dsv3", "replicate": 2, "clip": False}
    scenarios = {"once": {**hsdp, "expert_ns": "once"}, "per_replica": hsdp}
    results = run_ranks(_scenarios, 4, str(tmp_path), scenarios, timeout=220)
    _check(results, "once", "dsv3", 4, clip=False, expert_ns="once")
    for r in results:
        once, each = r["once"]["experts"], r["per_replica"]["experts"]
        assert once and once.keys() == each.keys()
        for name, w in once.items():
            assert torch.equal(w, each[name]), name
        assert "split_replicas=True" in r["once"]["expert_stage"]
        assert r["per_replica"]["expert_stage"] == "None"
