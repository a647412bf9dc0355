"""``dmuon_compile.integrations.torchtitan`` with torchtitan's own pieces, on 2 gloo ranks.

torchtitan's Llama-3 debug model (2 of its layers), built on the meta device; its
``ParallelDims`` meshes (1-D FSDP); its ``parallelize_llama`` wrapped by ``dedicating``; its
``init_weights`` after ``to_empty``; ``MuonOptimizers`` built from its config; its DCP
``CheckpointManager`` saving and resuming mid-run. The losses match one process training the
same initial weights on the global batch with ``dmuon.Muon``, and the resumed step repeats the
step after the save exactly. Without torchtitan the tests that need it skip; the import error
and ``import dmuon_compile`` staying free of torchtitan are checked either way.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from distributed.harness import full_state, run_ranks
from distributed.test_tp import _whole_state
from torch.distributed.tensor import DTensor

pytestmark = [pytest.mark.timeout(200)]

SEQ, PER_RANK, LAYERS, STEPS = 16, 2, 2, 3
VOCAB = 2048  # the debug model's


def build_debug_model(sequence_parallel: bool = True):
    """torchtitan's Llama-3 debug model (first ``LAYERS`` layers) on the meta device, with the
    sharding config its trainer sets (``update_from_config``: TP plans, sequence parallel).
    Workaround for CPU: its FlexAttention has no backward there, so each block's inner
    attention is torchtitan's causal SDPA module (same layout, no parameters)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:LAYERS]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(spec.model, enable_sp=sequence_parallel)
    with torch.device("meta"):
        model = spec.model.build()
    return spec, model


def tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (world * PER_RANK, SEQ + 1), generator=g)


def loss_of(model, batch, global_tokens: int):
    """torchtitan's loss: summed over this rank's tokens, divided by the global token count
    (FSDP2 then sums gradients: ``apply_fsdp_to_decoder`` disables its division)."""
    logits = model(batch[:, :-1])
    if isinstance(logits, DTensor):  # TP: vocab-sharded (torchtitan's loss-parallel layout)
        logits = logits.full_tensor()
    return (
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        / global_tokens
    )


def materialize_on_cpu(part) -> None:
    """A parallelized torchtitan model part made real on the CPU as its trainer does: FSDP2's
    reduce forced to a sum (gloo has no PREMUL_SUM, FSDP2's reduce op), weights allocated and
    ``init_weights`` under one seed (as torchtitan's set_determinism: all ranks agree)."""
    from torch.distributed.fsdp import FSDPModule

    for m in part.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    part.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        part.init_weights(buffer_device=None)


def checkpoint_manager(parts, optimizers, folder, enable: bool = True):
    """torchtitan's ``CheckpointManager`` of ``parts`` and ``optimizers`` saving every step
    under ``folder/ckpt`` (``enable=False``: switched off, as ``train_step`` needs one)."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=False)
    if enable:
        config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=list(parts),
        optimizers=optimizers,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )


def parallelize_on_cpu(parallelize, model, dims, parallelism, folder, **configs):
    """``parallelize`` (torchtitan's ``parallelize_fn``, wrapped by ``dedicating`` or not) with
    fp32 training and, unless ``configs`` give them, compile and AC off; then
    :func:`materialize_on_cpu`."""
    from torchtitan.config import CompileConfig, TrainingConfig

    model = parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=configs.get("precision", "float32")),
        parallelism=parallelism,
        compile_config=configs.get("compile_config", CompileConfig()),
        ac_config=configs.get("ac_config"),
        dump_folder=folder,
    )
    materialize_on_cpu(model)
    return model


def _train_torchtitan(
    rank,
    world,
    folder,
    replicate=1,
    tp=1,
    sequence_parallel=True,
    checkpoint=False,
    precision="float32",
    offload=None,
):
    """``STEPS`` trainer steps of torchtitan's model on its ``ParallelDims`` (``replicate`` ×
    fsdp × ``tp``); with ``checkpoint``, a save, one more step, a resume and that step again.
    ``precision``: ``training.mixed_precision_param``; ``offload``: ``MuonOptimizers.Config``'s."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    # Workaround for CPU: torchtitan names its device "cuda" when no accelerator is present.
    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dims = ParallelDims(
        dp_replicate=replicate, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    batch_mesh = dims.get_optional_mesh("batch")  # the data-parallel ranks (dp_replicate × fsdp)
    dp, dp_rank = (1, 0) if batch_mesh is None else (batch_mesh.size(), batch_mesh.get_local_rank())
    spec, model = build_debug_model(sequence_parallel)
    parallelize = dmuon_tt.dedicating(spec.parallelize_fn)
    model = parallelize_on_cpu(parallelize, model, dims, parallelism, folder, precision=precision)
    # HSDP: the other replicas get the global owners' initial values at the first forward;
    # publish now to read them from any rank.
    dedicated_runtime(model).publish(wait=True)
    initial = _whole_state(model) if tp > 1 else full_state(model)
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3, offload=offload).build(
        model_parts=[model]
    )

    def step(i):
        batch = tokens(i, dp)[dp_rank * PER_RANK : (dp_rank + 1) * PER_RANK]
        loss = loss_of(model, batch, dp * PER_RANK * SEQ)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each TP rank holds its data-parallel rank's loss
        return total.item() / tp

    losses = [step(i) for i in range(STEPS)]
    groups = [(g["use_muon"], g["param_names"]) for opt in optimizers for g in opt.param_groups]
    out = {"initial": initial, "losses": losses, "groups": groups}
    if checkpoint:
        checkpointer = checkpoint_manager([model], optimizers, folder)
        checkpointer.save(curr_step=STEPS)
        out["after_save"] = step(STEPS)
        out["after_save_state"] = full_state(model)
        assert checkpointer.load(step=STEPS)
        out["resumed"] = step(STEPS)
        # the weights after the resumed step: they differ unless the momentum came back too
        out["resumed_state"] = full_state(model)
    return out


def _scenarios(rank, world, folder, scenarios):
    """Several layouts in one set of rank processes (one start-up and torchtitan import)."""
    return {
        label: _train_torchtitan(rank, world, f"{folder}/{label}", **kw)
        for label, kw in scenarios.items()
    }


def _reference(initial, dp):
    """One process: the same initial weights, the global batch of ``dp`` ranks, ``dmuon.Muon``."""
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    _, model = build_debug_model()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (rope); weights come from `initial`
    model.load_state_dict(initial, strict=False)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, predicate=dmuon_tt.default_predicate)
    losses = []
    for i in range(STEPS):
        loss = loss_of(model, tokens(i, dp), dp * PER_RANK * SEQ)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _check_against_one_process(results, dp):
    ref_initial = results[0]["initial"]
    ref = _reference(results[0]["initial"], dp)
    assert ref[1] != pytest.approx(ref[0], rel=1e-3)  # the weights moved
    for r in results:  # every rank (HSDP: both replicas) started from the same weights
        for name, want in ref_initial.items():
            torch.testing.assert_close(r["initial"][name], want, rtol=0, atol=0)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_torchtitan_llama_fsdp_and_tp_train_like_one_process_and_resume(tmp_path):
    """2 ranks: 1-D FSDP with a checkpoint resume, and TP 2 through torchtitan's own
    ``parallelize_llama`` (its sharding config, vocab-sharded logits) without sequence
    parallel: there its row-wise weights' gradients come out ``Partial`` on the TP mesh, not in
    the weights' ``Shard(1)`` (without reducing them first the dedicated gradient reduce
    raised a size mismatch)."""
    pytest.importorskip("torchtitan")
    scenarios = {"fsdp": {"checkpoint": True}, "tp": {"tp": 2, "sequence_parallel": False}}
    results = run_ranks(_scenarios, 2, str(tmp_path), scenarios, timeout=180)
    r0 = results[0]["fsdp"]
    muon = {name for use_muon, names in r0["groups"] if use_muon for name in names}
    assert muon and all(n.startswith("layers.") and n.endswith(".weight") for n in muon)
    assert len(muon) == 5 * LAYERS  # wqkv, wo, w1, w2, w3 of each block
    adamw = {name for use_muon, names in r0["groups"] if not use_muon for name in names}
    assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= adamw
    _check_against_one_process([r["fsdp"] for r in results], 2)
    for r in results:  # the checkpointer's resume repeats the step after the save
        r = r["fsdp"]
        assert r["resumed"] == pytest.approx(r["after_save"], rel=1e-6)
        assert r["after_save"] != pytest.approx(r["losses"][-1], rel=1e-4)
        for name, want in r["after_save_state"].items():  # optimizer state resumed as well
            torch.testing.assert_close(r["resumed_state"][name], want, rtol=1e-6, atol=1e-7)
    assert results[0]["tp"]["groups"] == r0["groups"]
    _check_against_one_process([r["tp"] for r in results], 1)


@pytest.mark.distributed  # spawns 2 gloo ranks
def test_torchtitan_checkpointer_resumes_offloaded_state_like_state_on_the_device(tmp_path):
    """bf16 training (``mixed_precision_param="bfloat16"``) on 2 ranks, through torchtitan's
    ``parallelize_llama`` and its DCP ``CheckpointManager`` (flattened optimizer state): with
    the momentum (``offload="momentum"``) or the owners' fp32 masters and momentum
    (``offload="state"``) in host memory between steps, the losses, the step after the save, the
    resumed step and the weights after it equal those of the state on the device, bit for bit.
    The resume is checked by the weights after the resumed step: before ``MuonOptimizers``
    showed the stored momentum's checkpoint key to torchtitan's unflatten, the offloaded
    momentum did not load and they differed (the control the device run gives: its resumed
    step repeats the step after the save)."""
    pytest.importorskip("torchtitan")
    bf16 = {"checkpoint": True, "precision": "bfloat16"}
    # One process set each: a second scenario in the same processes starts from other bf16
    # losses (process state torchtitan's model keeps), offloaded or not.
    runs = {
        offload: run_ranks(
            _scenarios, 2, f"{tmp_path}/{offload}", {"r": {**bf16, "offload": offload}}, timeout=180
        )
        for offload in (None, "momentum", "state")
    }
    for rank, on in enumerate(r["r"] for r in runs[None]):
        assert on["after_save"] != on["losses"][-1] and on["resumed"] == on["after_save"]
        for name, want in on["after_save_state"].items():
            torch.testing.assert_close(on["resumed_state"][name], want, rtol=0, atol=0)
        for offload in ("momentum", "state"):
            off = runs[offload][rank]["r"]
            assert off["losses"] == on["losses"], offload
            assert (off["after_save"], off["resumed"]) == (on["after_save"], on["resumed"])
            for name, want in on["resumed_state"].items():
                torch.testing.assert_close(
                    off["resumed_state"][name], want, rtol=0, atol=0, msg=f"{offload}: {name}"
                )


@pytest.mark.distributed  # spawns 4 gloo ranks
def test_torchtitan_llama_hsdp_and_dp_tp_train_like_one_process(tmp_path):
    """4 ranks: HSDP (dp_replicate 2 × fsdp 2) and fsdp 2 × TP 2 (sequence parallel, as
    torchtitan's default) on torchtitan's meshes."""
    pytest.importorskip("torchtitan")
    scenarios = {"hsdp": {"replicate": 2}, "dp_tp": {"tp": 2}}
    results = run_ranks(_scenarios, 4, str(tmp_path), scenarios, timeout=180)
    failed = []
    for label, dp in (("dp_tp", 2), ("hsdp", 4)):  # report both layouts' mismatches
        try:
            _check_against_one_process([r[label] for r in results], dp)
        except AssertionError as exc:
            failed.append(f"{label}: {exc}")
    assert not failed, "\n".join(failed)


def test_import_error_names_the_extra_and_core_import_stays_free_of_torchtitan():
    code = (
        "import sys\n"
        "import dmuon_compile\n"
        "assert 'torchtitan' not in sys.modules, 'import dmuon_compile imported torchtitan'\n"
        "sys.modules['torchtitan'] = None  # as if not installed\n"
        "try:\n"
        "    import dmuon_compile.integrations.torchtitan\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert 'pip install "dmuon_compile[torchtitan]"' in out.stdout, out.stdout + out.stderr
