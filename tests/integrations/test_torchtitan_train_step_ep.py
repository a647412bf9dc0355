"""torchtitan's own training step with expert parallelism: ``Trainer.train_step`` (its
zero_grad, forward-backward, loss, EP-aware gradient clipping ``_clip_grad_norm_with_ep``,
checkpointer wait, optimizer and LR-scheduler steps, loss metrics) on the DeepSeek-V3 debug
model (a dense and a MoE block) with ``expert_parallel_degree`` 2 on 4 gloo ranks, configured
as docs/moe.md says: ``dedicating(parallelize_fn)`` and ``MuonOptimizers``, nothing else.

- Step 1 equals torchtitan's own path (its ``parallelize_fn`` and AdamW) from the same weights:
  the loss and the clipped gradient norm torchtitan computes; step 2 trains on.
- Control (in the same launch): owner meshes without dimension names (before the fix) stop
  that step at torchtitan's ``assert mesh_dim_names is not None`` on every rank.

The trainer is torchtitan's ``Trainer`` class with the attributes its ``__init__`` would set
(:func:`titan_trainer`): its ``__init__`` needs a tokenizer, a dataset and an accelerator; the
step itself is torchtitan's code, unchanged.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import run_ranks

from integrations.test_torchtitan import checkpoint_manager, parallelize_on_cpu, tokens
from integrations.test_torchtitan_moe import _full, build_dsv3

pytestmark = [pytest.mark.timeout(240), pytest.mark.distributed]

SEQ, PER_RANK, MAX_NORM = 16, 2, 0.5  # MAX_NORM below the gradients' norm: the clip scales


class Metrics:
    """torchtitan's metrics processor as the step uses it: what it logs, kept."""

    def __init__(self):
        self.logged = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.logged.append({"step": step, "loss": float(global_avg_loss), "norm": grad_norm})


def disabled_checkpointer(model, optimizers, folder):
    """torchtitan's ``CheckpointManager`` switched off, as ``train_step`` needs one."""
    return checkpoint_manager([model], optimizers, folder, enable=False)


def constant_lr(trainer, optimizers, steps: int, max_norm: float) -> None:
    """``trainer`` clipping at ``max_norm`` with a constant learning rate (a one-process
    reference steps without a scheduler)."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    trainer.config.training.max_norm = max_norm
    trainer.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(
        optimizers=optimizers, training_steps=steps
    )


def titan_trainer(spec, dims, parallelism, model_parts, optimizers, checkpointer, *, pp=None):
    """A ``torchtitan.trainer.Trainer`` whose ``train_step`` runs as in a job: the attributes
    its ``__init__`` sets from the config (model parts, optimizers, LR schedulers, loss,
    checkpointer, context), no tokenizer, dataset or device set-up. ``pp``: ``(schedule,
    has_first, has_last, microbatches)``."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config = Trainer.Config(
        model_spec=spec,
        training=TrainingConfig(
            local_batch_size=PER_RANK if pp is None else pp[3],
            seq_len=SEQ,
            max_norm=MAX_NORM,
            steps=2,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        parallelism=parallelism,
    )
    trainer.parallel_dims = dims
    trainer.model_config = spec.model
    trainer.model_parts = model_parts
    trainer.optimizers = optimizers
    if spec.post_optimizer_build_fn is not None:  # MoE: the load-balancing bias update
        spec.post_optimizer_build_fn(optimizers, model_parts, dims)
    trainer.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=0).build(
        optimizers=optimizers, training_steps=2
    )
    trainer.loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    trainer.metrics_processor = Metrics()
    trainer.checkpointer = checkpointer
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=dims)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    trainer.gradient_accumulation_steps = 1
    trainer.num_pipeline_parallel_microbatches = 1 if pp is None else pp[3]
    trainer.device = torch.device("cpu")
    trainer.step = 0
    trainer.ntokens_seen = 0
    if pp is not None:
        trainer.pp_schedule, trainer.pp_has_first_stage, trainer.pp_has_last_stage = pp[:3]
    return trainer


def batches(step: int, dp: int, dp_rank: int, per_rank: int, microbatches: int = 1):
    """This data-parallel rank's slice of the global batch at ``step`` as torchtitan's
    dataloader yields it: ``microbatches`` ``({"input": tokens}, labels)`` pairs."""
    batch = tokens(step, dp * per_rank // PER_RANK)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    size = per_rank // microbatches
    for m in range(microbatches):
        mb = batch[m * size : (m + 1) * size]
        yield {"input": mb[:, :-1]}, mb[:, 1:]


def _train(rank, world, folder, dmuon_path, initial=None, unnamed=False):
    """Two torchtitan train steps at EP 2 (``dmuon_path``: ``dedicating`` and
    ``MuonOptimizers``; else torchtitan's parallelize_fn and AdamW from ``initial``)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=2)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    spec, model = build_dsv3(True)
    parallelize = dmuon_tt.dedicating(spec.parallelize_fn) if dmuon_path else spec.parallelize_fn
    model = parallelize_on_cpu(parallelize, model, dims, parallelism, folder)
    if dmuon_path:
        from dmuon_compile.distributed import dedicated_runtime

        dedicated_runtime(model).publish(wait=True)
        optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(
            model_parts=[model]
        )
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        whole = {k: v.clone() for k, v in initial.items()}  # torch's loader replaces values
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
        adamw = {"lr": 3e-3, "foreach": False, "fused": False}
        optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs=adamw)],
            implementation="for-loop",
        ).build(model_parts=[model])  # fmt: skip
    if unnamed:  # the owner meshes as they were before they had dimension names
        from dmuon_compile.distributed._owner.meshes import MESHES

        for mesh in MESHES.owner_meshes.values():
            mesh._mesh_dim_names = None
    checkpointer = disabled_checkpointer(model, optimizers, folder)
    trainer = titan_trainer(spec, dims, parallelism, [model], optimizers, checkpointer)
    batch_mesh = dims.get_mesh("batch")
    dp, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    out = {"initial": _full(model) if dmuon_path and not unnamed else None}
    for step in (1, 2):  # the same batch twice: the second step's loss shows the first's update
        trainer.step = step
        trainer.train_step(batches(1, dp, dp_rank, PER_RANK))
    out["logged"] = trainer.metrics_processor.logged
    return out


def _scenarios(rank, world, folder):
    """The three runs in one launch (one start-up and torchtitan import); the control last: it
    strips the names of the process-wide owner meshes."""
    import traceback

    muon = _train(rank, world, f"{folder}/muon", dmuon_path=True)
    adamw = _train(rank, world, f"{folder}/adamw", dmuon_path=False, initial=muon["initial"])
    try:
        _train(rank, world, f"{folder}/control", dmuon_path=True, unnamed=True)
        control = None
    except AssertionError:  # raised on every rank alike, before any collective of the clip
        control = traceback.format_exc()  # torchtitan's bare assert: its line says which
    return {"muon": muon, "adamw": adamw, "control": control}


def test_deepseek_v3_ep2_train_step_clips_and_steps_like_torchtitans_adamw(tmp_path):
    pytest.importorskip("torchtitan")
    results = run_ranks(_scenarios, 4, str(tmp_path), timeout=200)
    for rank, r in enumerate(results):
        muon, adamw = r["muon"]["logged"], r["adamw"]["logged"]
        assert [m["step"] for m in muon] == [1, 2]
        # Step 1: the same loss and the same clipped norm as torchtitan's own AdamW path.
        assert muon[0]["loss"] == pytest.approx(adamw[0]["loss"], rel=1e-5)
        assert muon[0]["norm"] == pytest.approx(adamw[0]["norm"], rel=1e-4)
        assert muon[0]["norm"] > MAX_NORM  # the clip scaled the gradients
        # Step 2, the same batch again: trained on (Muon moved the weights, not as AdamW did).
        assert torch.isfinite(torch.tensor(muon[1]["loss"]))
        assert muon[1]["loss"] < muon[0]["loss"]
        assert muon[1]["loss"] != pytest.approx(adamw[1]["loss"], rel=1e-4)
        # Control: owner meshes without dimension names (before) stop at torchtitan's assert.
        err = r["control"]
        assert err is not None and "assert mesh_dim_names is not None" in err, (rank, err)
        assert "_clip_grad_norm_with_ep" in err, (rank, err)
