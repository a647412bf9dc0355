"""torchtitan's pipeline parallelism with dedicated weights per stage: pp 2 × dp 2 on 4 gloo ranks
(and pp 2 × dp 1 on 2).

torchtitan's Llama-3 debug model (4 layers) split into stages by its own ``pipeline_llm``
(``Schedule1F1B``: one stage per rank; ``ScheduleInterleaved1F1B``: two per rank, four in all),
each stage's model part parallelised by ``parallelize_llama`` wrapped in ``dedicating`` (its
2-D weights get owners among the stage's two data-parallel ranks, the rest FSDP2), one
``dmuon.Muon`` per model part (``MuonOptimizers``), 4 micro-batches a step, torchtitan's loss
(token sum over the global token count) and its gradient clipping across stages. It trains like
one process with ``dmuon.Muon`` on the global batch: the first step's gradients (the
micro-batches' sum, reduced once), the clipped norms, the losses and the final weights.

Controls: with the schedule's micro-batch scaling (``scale_grads``) the gradients are a quarter
of one process's, dedicated ones included; without dmuon's reduce at the stage's end the
owners get no gradient at all.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import run_ranks

from integrations.test_torchtitan import materialize_on_cpu

pytestmark = [pytest.mark.timeout(200), pytest.mark.distributed]

SEQ, LOCAL_BATCH, LAYERS, STEPS, PP = 16, 4, 4, 3, 2  # LOCAL_BATCH: 4 micro-batches of 1
VOCAB = 2048  # the debug model's
MAX_NORM = 0.5  # below the gradients' norm: clipping scales them
SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


def build_model(layers: int = LAYERS):
    """torchtitan's Llama-3 debug model, its first ``layers`` layers, on the meta device (CPU
    workaround: its FlexAttention has no backward there, so the inner attention is its SDPA)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    return spec, model


def tokens(step: int, dp: int) -> torch.Tensor:
    """The global batch of ``dp`` data-parallel ranks at ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (dp * LOCAL_BATCH, SEQ + 1), generator=g)


def pipeline_stages(spec, model, dims, parallelism, folder, local_batch: int = LOCAL_BATCH):
    """torchtitan's ``pipelining_fn`` (``pipeline_llm``) with ``dedicating(parallelize_fn)`` on
    the CPU (fp32, compile and AC off, its cross-entropy loss), each model part materialised
    (``materialize_on_cpu``): ``(schedule, parts, has_first, has_last)``."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    compile_config = CompileConfig()
    schedule, parts, has_first, has_last = spec.pipelining_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(
            mixed_precision_param="float32", local_batch_size=local_batch, seq_len=SEQ
        ),
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=None,
        dump_folder=folder,
        device=torch.device("cpu"),
        model_config=spec.model,
        parallelize_fn=dmuon_tt.dedicating(spec.parallelize_fn),
        loss_fn=CrossEntropyLoss.Config().build(compile_config=compile_config),
    )
    for part in parts:
        materialize_on_cpu(part)
    return schedule, parts, has_first, has_last


def _stage_state(parts, grads: bool = False) -> dict:
    """Every parameter (``grads``: gradient) of this rank's stages, whole: FSDP2's gathered, the
    dedicated ones broadcast from their owner inside the stage's data-parallel group (the
    harness's ``full_state`` broadcasts over all ranks, which the other stages, busy with other
    weights, never join; ``dmuon.full_tensor`` gathers on the stage's own mesh)."""
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime

    out = {}
    for part in parts:
        runtime = dedicated_runtime(part)
        runtime.wait_all()
        group = runtime.mesh.get_group()
        dedicated = {dp.fqn: dp for dp in runtime.params}
        for name, p in part.named_parameters():
            t = p.grad if grads else p
            if name in dedicated:
                dp = dedicated[name]
                buf = t.to_local().detach().clone() if dp.owns else torch.empty(dp.shape)
                dist.broadcast(buf, src=dist.get_global_rank(group, dp.owner), group=group)
                out[name] = buf
            else:
                out[name] = t.full_tensor().detach().clone()
    return out


def _train(rank, world, folder, schedule_name):
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=PP,
        pipeline_parallel_schedule=schedule_name,
        pipeline_parallel_microbatch_size=1,
        pipeline_parallel_last_stage_less_layers=0,  # a block in every stage, the last too
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's Trainer does
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=PP, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    dp = world // PP
    batch_mesh = dims.get_optional_mesh("batch")  # the data-parallel ranks (none at dp 1)
    dp_rank = 0 if batch_mesh is None else batch_mesh.get_local_rank()
    spec, model = build_model()
    schedule, parts, has_first, has_last = pipeline_stages(spec, model, dims, parallelism, folder)
    for part in parts:
        dedicated_runtime(part)  # every stage has dedicated weights
    initial = _stage_state(parts)
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=parts)
    pp_mesh = dims.get_mesh("pp")

    def forward_backward(i):
        batch = tokens(i, dp)[dp_rank * LOCAL_BATCH : (dp_rank + 1) * LOCAL_BATCH]
        losses = [] if has_last else None
        schedule.step(
            *((batch[:, :-1],) if has_first else ()),
            target=batch[:, 1:] if has_last else None,
            losses=losses,
            loss_kwargs={"global_valid_tokens": torch.tensor(float(dp * LOCAL_BATCH * SEQ))},
            return_outputs=False,
        )
        total = torch.stack(losses).sum() if has_last else torch.zeros(())
        dist.all_reduce(total)  # the last stage's ranks hold their micro-batches' losses
        return total.item()

    out = {"initial": initial, "losses": [], "norms": [], "gathers": []}
    from dmuon_compile.distributed._compat.autograd import in_backward
    from dmuon_compile.distributed._runtime.group import DedicatedGroup, GroupState

    unshard = DedicatedGroup.unshard

    def counting(group, prefetch=False):  # the forward's all-gathers of dedicated groups
        if group.state == GroupState.SHARDED and not in_backward() and out["gathers"]:
            out["gathers"][-1] += 1
        unshard(group, prefetch)

    DedicatedGroup.unshard = counting
    out["groups"] = sum(len(dedicated_runtime(part).groups) for part in parts)
    # Control 1, first (from the initial weights): the schedule's micro-batch scaling divides
    # every gradient by the 4 micro-batches, dedicated ones too (their reduce runs before it).
    schedule.scale_grads = True
    forward_backward(0)
    out["scaled_grads"] = _stage_state(parts, grads=True)
    schedule.scale_grads = False

    for i in range(STEPS):
        optimizers.zero_grad()
        out["gathers"].append(0)
        out["losses"].append(forward_backward(i))
        if i == 0:
            out["grads"] = _stage_state(parts, grads=True)
        norm = dist_utils.clip_grad_norm_(
            [p for part in parts for p in part.parameters()], MAX_NORM, pp_mesh=pp_mesh
        )
        out["norms"].append(norm.item())
        optimizers.step()
    DedicatedGroup.unshard = unshard
    out["final"] = _stage_state(parts)
    out["plans"] = dmuon_tt.summarize_stages(parts)
    out["owners"] = {  # global ranks, for the dry run's prediction
        p.fqn: dist.get_global_rank(dedicated_runtime(part).mesh.get_group(), p.owner)
        for part in parts
        for p in dedicated_runtime(part).params
    }
    out["muon"] = sorted(
        name
        for o in optimizers
        for g in o.param_groups
        if g["use_muon"]
        for name in g["param_names"]
    )

    # Control 2: torch's stage alone (dmuon's reduce at its end undone) leaves the dedicated
    # gradients on the compute copies: the owners get none. Last: its state is never cleaned up.
    optimizers.zero_grad()
    patched = PipelineStage.perform_reduce_grad
    PipelineStage.perform_reduce_grad = patched.__wrapped__
    try:
        forward_backward(STEPS)
    finally:
        PipelineStage.perform_reduce_grad = patched
    runtimes = [dedicated_runtime(part) for part in parts]
    params = [p for runtime in runtimes for p in runtime.params]
    out["unreduced"] = {
        "owner_grads": sum(p.param.grad is not None for p in params if p.owns),
        "local_grads": sum(p.unsharded.grad is not None for p in params),
        "owned": sum(p.owns for p in params),
    }
    return out


def _scenarios(rank, world, folder, labels):
    return {label: _train(rank, world, f"{folder}/{label}", SCHEDULES[label]) for label in labels}


def _merged(results, key) -> dict:
    """One dict of every rank's stages' tensors (the two data-parallel ranks of a stage agree)."""
    merged = {}
    for r in results:
        for name, t in r[key].items():
            if name in merged:
                torch.testing.assert_close(t, merged[name], rtol=0, atol=0, msg=name)
            merged[name] = t
    return merged


def _reference(initial, dp):
    """One process: the whole model from the stages' initial weights, the global batch of every
    step, ``dmuon.Muon``, torch's clipping."""
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    _, model = build_model()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (rope); weights come from `initial`
    missing, unexpected = model.load_state_dict(initial, strict=False)
    assert not unexpected and all("freqs" in k or "rope" in k for k in missing), missing
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, predicate=dmuon_tt.default_predicate)

    def loss_of(i):
        batch = tokens(i, dp)
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        ) / float(batch[:, 1:].numel())

    out = {"losses": [], "norms": []}
    for i in range(STEPS):
        opt.zero_grad()
        loss = loss_of(i)
        loss.backward()
        if i == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        out["losses"].append(loss.item())
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _check(results, label) -> None:
    rs = [r[label] for r in results]
    initial = _merged(rs, "initial")
    ref = _reference(initial, len(rs) // PP)
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the weights moved
    muon = set(rs[0]["muon"]) | set(rs[-1]["muon"])  # pp rank 0's stages, pp rank 1's
    assert len(muon) == 5 * LAYERS  # wqkv, wo, w1, w2, w3 of every block, in some stage
    grads = _merged(rs, "grads")
    assert grads.keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-7, msg=name)
    for r in rs:
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0
        )
    # Final weights by norm: AdamW's elementwise steps amplify float noise in the near-zero
    # gradients of a few embedding / head entries (one process vs the stages' sums).
    final = _merged(rs, "final")
    for name, want in ref["final"].items():
        err = (final[name] - want).norm() / want.norm()
        assert err < 1e-3, (name, err.item())
    # torchtitan's FSDP2 modules under PP keep their weights after forward (its "default"
    # reshard policy) and the schedule keeps them after every micro-batch's backward but the
    # last (set_reshard_after_backward(False)): so do the dedicated groups, whose forwards then
    # gather each group fewer times per step than once per micro-batch (4 here, what they did
    # before; a forward that follows a forward without a backward between, the schedule's
    # warm-up, still gathers again: the runtime cannot tell it from one after a weight write).
    for r in rs:
        assert all(0 < n < 4 * r["groups"] for n in r["gathers"]), (r["gathers"], r["groups"])
    # Control 1: a quarter of one process's gradients, everywhere (so 4 micro-batches summed).
    scaled = _merged(rs, "scaled_grads")
    for name, want in ref["grads"].items():
        torch.testing.assert_close(scaled[name] * 4, want, rtol=1e-4, atol=1e-7, msg=name)
        assert not torch.allclose(scaled[name], want, rtol=0.5), name
    # Control 2: without dmuon's reduce at the stage's end no owner has a gradient.
    for r in rs:
        unreduced = r["unreduced"]
        assert unreduced["owned"] > 0 and unreduced["local_grads"] > 0
        assert unreduced["owner_grads"] == 0


def _check_all(results, labels) -> None:
    failed = []
    for label in labels:  # report every schedule's mismatches
        try:
            _check(results, label)
        except AssertionError as exc:
            failed.append(f"{label}: {exc}")
    assert not failed, "\n".join(failed)


def test_torchtitan_pipeline_1f1b_and_interleaved_train_like_one_process(tmp_path):
    """pp 2 × dp 2 (4 ranks): each stage's weights owned by its two data-parallel ranks."""
    pytest.importorskip("torchtitan")
    results = run_ranks(_scenarios, PP * 2, str(tmp_path), list(SCHEDULES), timeout=180)
    _check_all(results, SCHEDULES)
    # The planner's view: each stage's owners among its data-parallel ranks (pp rank 0: global
    # ranks 0 and 1; pp rank 1: 2 and 3) and their Newton–Schulz FLOPs, summed over the stages
    # a rank runs (two with the interleaved schedule), planned together: balanced summed.
    for rank, r in enumerate(results):
        for label in SCHEDULES:
            summary = r[label]["plans"]
            stages = summary["stages"]
            assert len(stages) == (1 if label == "1f1b" else 2)
            totals = dict.fromkeys(stages[0]["ranks"], 0.0)
            for stage in stages:
                assert stage["plan"]["dedicated"] and stage["dedicated"]
                assert rank in stage["ranks"] and stage["ranks"] == stages[0]["ranks"]
                assert set(stage["ns_flops_per_rank"]) == set(stage["ranks"])
                for owner, flops in stage["ns_flops_per_rank"].items():
                    assert flops > 0
                    totals[owner] += flops
            assert summary["ns_flops_per_rank"] == pytest.approx(totals)
            assert summary["ns_max_over_mean"] >= 1.0
            _check_stages_balanced_together(r[label], rank)
    _check_dry_run_predicts_the_owners(results)


def _check_dry_run_predicts_the_owners(results) -> None:
    """``python -m dmuon_compile.plan --pp 2`` on the same meta model (no ranks of its own):
    the owners and each stage's per-rank NS FLOPs these runs planned."""
    from dmuon_compile.integrations import torchtitan as dmuon_tt
    from dmuon_compile.newton_schulz import NewtonSchulz
    from dmuon_compile.plan import dry_run

    _, model = build_model()
    dp = len(results) // PP
    for label, per_rank in (("1f1b", 1), ("interleaved", 2)):
        report = dry_run(
            model,
            len(results),
            pp=PP,
            stages_per_rank=per_rank,
            pp_last_stage_less_layers=0,  # as the runs' ParallelismConfig
            predicate=dmuon_tt.default_predicate,
            ns=NewtonSchulz(),  # dedicate_params' default on this machine
        )
        owners = {}
        for r in results:
            owners.update(r[label]["owners"])
        assert report.owners == owners, label
        predicted = {
            frozenset(s["owners"]): {
                s["pp_rank"] * dp + o: f for o, f in enumerate(s["ns_flops_per_rank"])
            }
            for s in report.stages
        }
        for r in results:
            for stage in r[label]["plans"]["stages"]:
                want = predicted[frozenset(stage["dedicated"])]
                assert stage["ns_flops_per_rank"] == pytest.approx(want), label


def _check_stages_balanced_together(result, rank) -> None:
    """A rank's stages were planned together: each stage's plan is the planner's over the loads
    of the stages before it on the same data-parallel ranks, and their sum is balanced where
    the stages planned alone (control) repeat one uneven split."""
    from dmuon_compile.distributed.owner_plan import MatrixSpec, plan_owners

    summary, initial = result["plans"], result["initial"]
    stages = summary["stages"]
    world = len(stages[0]["ranks"])
    carried, alone = [0.0] * world, [0.0] * world
    for stage in stages:
        specs = [MatrixSpec(n, tuple(initial[n].shape)) for n in stage["dedicated"]]
        together = plan_owners(specs, world, base_loads=carried)
        assert together.digest() == stage["plan"]["plan_digest"]
        carried = [a + b for a, b in zip(carried, together.ns_loads())]
        alone = [a + b for a, b in zip(alone, plan_owners(specs, world).ns_loads())]
    assert [summary["ns_flops_per_rank"][r] for r in stages[0]["ranks"]] == pytest.approx(carried)
    ratio = summary["ns_max_over_mean"]
    before = max(alone) / (sum(alone) / world)
    print(f"\nrank {rank}, {len(stages)} stage(s): NS max/mean {ratio:.4f} (alone {before:.4f})")
    assert ratio <= 1.05
    if len(stages) > 1:  # interleaved: two equal blocks, each split unevenly on its own
        assert before > 1.1


def test_torchtitan_pipeline_without_data_parallelism_trains_like_one_process(tmp_path):
    """pp 2 × dp 1 (2 ranks, 1F1B): every dedicated weight of a stage on its one rank, which
    reduces nothing but still sums its micro-batches once, at the stage's end."""
    pytest.importorskip("torchtitan")
    results = run_ranks(_scenarios, PP, str(tmp_path), ["1f1b"], timeout=120)
    _check_all(results, ["1f1b"])
    for rank, r in enumerate(results):
        (stage,) = r["1f1b"]["plans"]["stages"]
        assert stage["ranks"] == [rank] and len(stage["dedicated"]) == 5 * LAYERS // PP
