"""torchtitan's checkpointer with pipeline parallelism and dedicated weights: pp 2 × dp 2 on 4
gloo ranks, torchtitan's Llama-3 debug model (one block per stage) split by its ``pipeline_llm``
(1F1B, 2 micro-batches), each stage's part parallelised by ``dedicating(parallelize_llama)``,
``MuonOptimizers``, and torchtitan's DCP ``CheckpointManager``.

torchtitan's state-dict hook of the fused ``wqkv`` weight gathers it with
``redistribute(Replicate)``, on every state dict the checkpointer takes (at its construction,
at each save and load). A dedicated weight gathers on its stage's data-parallel group; before,
it broadcast on the default group, which the other stage never joins: the job hung at start-up.

- The checkpointer starts, saves after a step, and a resumed step repeats the step after the
  save exactly (losses of torchtitan's own schedule step and its clip across stages).
- Every broadcast of a dedicated weight ran on its stage's data-parallel group.
- ``dmuon.full_tensor`` gathers a stage's weight on that stage's ranks; a weight of the other
  stage (loaded from its rank's save) raises an error naming the fix instead of waiting.
- Control: the old gather (the default group) makes the checkpointer's start-up fail within a
  bounded time (a hang, or a broken collective): the test above could not pass.

torchtitan 0.3.0's ``Trainer.pp_forward_backward_step`` fails on torch 2.13 for every optimizer
(``Expecting 2 arg_mbs but got 1``: it hands the schedule pre-split micro-batches; checked at the
end, docs/pipeline.md), so the steps here call the schedule's own ``step`` with the whole batch,
then torchtitan's ``clip_grad_norm_`` across stages and the optimizers.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import run_ranks

from integrations.test_torchtitan import checkpoint_manager
from integrations.test_torchtitan_pp import pipeline_stages

pytestmark = [pytest.mark.timeout(240), pytest.mark.distributed]

SEQ, MICROBATCHES, LAYERS, PP, MAX_NORM = 16, 2, 2, 2, 0.5
VOCAB = 2048  # the debug model's


def _tokens(step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (dp * MICROBATCHES, SEQ + 1), generator=g)


def _build_model():
    """torchtitan's Llama-3 debug model, its first ``LAYERS`` layers (one per stage), on the
    meta device (CPU: its FlexAttention has no backward there, so the inner attention is its
    SDPA; the fused ``wqkv`` stays)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:LAYERS]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    return spec, model


def _parallelism():
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=PP,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=1,
        pipeline_parallel_last_stage_less_layers=0,  # a block in every stage
    )


def _build(rank, world, folder, old_gather=False):
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = _parallelism()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    spec, model = _build_model()
    schedule, parts, has_first, has_last = pipeline_stages(
        spec, model, dims, parallelism, folder, MICROBATCHES
    )
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=parts)
    if old_gather:  # the gather as it was: broadcasts on the default group
        import torch.distributed as dist

        from dmuon_compile.distributed._owner import tensor as _owned

        _owned.broadcast_on_mesh = lambda buf, src, mesh: dist.broadcast(buf, src=src)
        open(f"{folder}/built_rank{rank}", "w").close()  # all that is left: the checkpointer
    checkpointer = checkpoint_manager(parts, optimizers, folder)
    return dims, schedule, parts, has_first, has_last, optimizers, checkpointer


def _record_broadcasts():
    """The group of every ``dist.broadcast`` that dmuon's owner tensors make from here on: its
    ranks, or ``None`` for the default group."""
    import sys

    import torch.distributed as dist

    seen = []
    original = dist.broadcast

    def broadcast(tensor, src=None, group=None, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "dmuon_compile.distributed._owner.tensor":
            seen.append(None if group is None else tuple(dist.get_process_group_ranks(group)))
        return original(tensor, src, group, *args, **kwargs)

    dist.broadcast = broadcast
    return seen


def _train(rank, world, folder):
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    seen = _record_broadcasts()
    dims, schedule, parts, has_first, has_last, optimizers, checkpointer = _build(
        rank, world, folder
    )
    dp_mesh = dims.get_mesh("batch")
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    pp_mesh = dims.get_mesh("pp")

    def step(i):
        """One optimizer step as torchtitan's trainer runs it under PP (see the docstring)."""
        optimizers.zero_grad()
        batch = _tokens(i, dp)[dp_rank * MICROBATCHES : (dp_rank + 1) * MICROBATCHES]
        losses = [] if has_last else None
        schedule.step(
            *((batch[:, :-1],) if has_first else ()),
            target=batch[:, 1:] if has_last else None,
            losses=losses,
            loss_kwargs={"global_valid_tokens": torch.tensor(float(dp * MICROBATCHES * SEQ))},
            return_outputs=False,
        )
        dist_utils.clip_grad_norm_(
            [p for part in parts for p in part.parameters()], MAX_NORM, pp_mesh=pp_mesh
        )
        optimizers.step()
        total = torch.stack(losses).sum() if has_last else torch.zeros(())
        dist.all_reduce(total)  # the last stage's ranks hold their micro-batches' losses
        return total.item() / dp

    out = {"first": step(0)}
    checkpointer.save(curr_step=1)
    out["after_save"] = step(1)
    assert checkpointer.load(step=1)
    out["resumed"] = step(1)

    # dmuon.full_tensor of this stage's weights, on this stage's ranks only.
    runtime = dedicated_runtime(parts[0])
    out["stage_ranks"] = [int(r) for r in runtime.mesh.mesh.flatten().tolist()]
    dedicated = {dp_.fqn for dp_ in runtime.params}
    name = sorted(dedicated)[0]
    weight = dict(parts[0].named_parameters())[name]
    whole = dmuon.full_tensor(weight)
    out["whole"] = (name, whole.shape == weight.shape, float(whole.norm()))
    out["broadcast_groups"] = sorted(set(seen), key=str)

    # A weight of the other stage (saved by its rank at this data-parallel coordinate): a clear
    # error on every rank, no collective.
    torch.save(weight.detach(), f"{folder}/stage_weight_rank{rank}.pt")
    dist.barrier()
    other = (rank + world // PP) % world  # the same data-parallel rank of the other stage
    foreign = torch.load(f"{folder}/stage_weight_rank{other}.pt")
    try:
        dmuon.full_tensor(foreign)
        out["foreign"] = None
    except RuntimeError as exc:
        out["foreign"] = str(exc)
    dist.barrier()

    # torchtitan's own PP step (Trainer.train_step) on this torch: it raises on every rank
    # before any stage communicates (torchtitan 0.3.0 hands the schedule pre-split
    # micro-batches, which torch 2.13's schedules do not take), for any optimizer.
    from integrations.test_torchtitan_train_step_ep import titan_trainer

    trainer = titan_trainer(
        _build_model()[0], dims, _parallelism(), parts, optimizers, checkpointer,
        pp=(schedule, has_first, has_last, MICROBATCHES),
    )  # fmt: skip
    batch = _tokens(2, dp)[dp_rank * MICROBATCHES : (dp_rank + 1) * MICROBATCHES]
    trainer.step = 3
    try:
        trainer.train_step(iter([({"input": b[None, :-1]}, b[None, 1:]) for b in batch]))
        out["trainer_pp_step"] = "ran"
    except ValueError as exc:
        out["trainer_pp_step"] = str(exc)
    return out


def _old_gather(rank, world, folder):
    _build(rank, world, folder, old_gather=True)
    return "started"


def test_pp2_checkpointer_starts_saves_and_resumes_with_stage_local_gathers(tmp_path):
    pytest.importorskip("torchtitan")
    results = run_ranks(_train, 4, str(tmp_path), timeout=200)
    for rank, r in enumerate(results):
        assert r["resumed"] == pytest.approx(r["after_save"], rel=1e-6), rank
        assert r["after_save"] != pytest.approx(r["first"], rel=1e-4)  # the weights moved
        stage = r["stage_ranks"]
        assert rank in stage and len(stage) == 2
        # Every broadcast (dedicated weights' gathers) ran on this stage's data-parallel group.
        assert r["broadcast_groups"] == [tuple(stage)], (rank, r["broadcast_groups"])
        name, same_shape, norm = r["whole"]
        assert same_shape and norm > 0
        assert r["foreign"] is not None and "pipeline stage" in r["foreign"], r["foreign"]
        # torchtitan 0.3.0's Trainer PP step on torch 2.13 (docs/pipeline.md: the pairs)
        if torch.__version__.startswith("2.13"):
            assert "Expecting 2 arg_mbs but got 1" in r["trainer_pp_step"], r["trainer_pp_step"]
    # The two data-parallel ranks of a stage gathered the same whole weight.
    assert results[0]["whole"] == results[1]["whole"]
    assert results[2]["whole"] == results[3]["whole"]


def test_control_old_gather_on_the_default_group_breaks_the_checkpointers_start(tmp_path):
    pytest.importorskip("torchtitan")
    with pytest.raises(TimeoutError):  # no rank got past the checkpointer's construction
        run_ranks(_old_gather, 4, str(tmp_path), timeout=45)
    # Every rank had built its stage and optimizers: the hang is the checkpointer's start.
    assert sorted(p.name for p in tmp_path.glob("built_rank*")) == [
        f"built_rank{r}" for r in range(4)
    ]
