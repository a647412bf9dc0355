"""DeepSeek-V3 with pipeline parallelism and expert parallelism together, through torchtitan's own
pipeline ``Trainer.train_step`` and its checkpointer, switched to dmuon as docs/moe.md and
docs/pipeline.md say: ``dedicating(parallelize_fn)`` and ``MuonOptimizers``, nothing else.

4 gloo ranks, ``ParallelismConfig(pipeline_parallel_degree=2, expert_parallel_degree=2)``
(``data_parallel_shard_degree`` -1: 2). The meshes torchtitan builds for it: the dense one
``(pp 2, dp_replicate 1, fsdp 2, tp 1)`` and the sparse one ``(pp 2, dp_replicate 1, efsdp 1,
ep 2)``: in each stage the two data-parallel ranks (0, 1 and 2, 3) are both FSDP2's ``fsdp``
group, over which the stage's dense matrices are dedicated, and the ``ep`` group, over which the
experts are split (4 of 8 each, whole; expert FSDP over 1 rank).

Model: torchtitan's DeepSeek-V3 debug model, its first 3 layers (a dense block, then MoE blocks:
MLA attention, 8 routed experts top-3, 2 shared, the load-balancing expert bias), split by its
``pipeline_llm`` into ``tok_embeddings, layers.0, layers.1`` and ``layers.2, norm, lm_head``
(each stage one MoE block), ``1F1B`` with 2 micro-batches of one sequence per data-parallel rank
(``GPipe``, run by hand with the same config: the same numbers).

- The job (3 steps of ``Trainer.train_step``: its token count, pipeline forward-backward, EP-
  aware gradient clipping across stages, the MoE load-balancing hook, the optimizers' and the LR
  schedulers' steps, its loss metrics) trains like one process running the same
  ``MuonOptimizers`` config on the global batch: the first step's gradients (every parameter,
  before the clip), each step's loss (on the last stage's ranks) and clipped norm, both expert
  biases, and every weight at the end, routed experts included.
- The optimizer sees what the model is: the expert stacks are ``"experts"`` layouts (per-expert
  NS on each rank's 4 whole experts), the routers get AdamW, each stage's dense matrices have
  owners among its own two ranks.
- torchtitan's ``CheckpointManager`` (model parts, optimizers, LR schedulers, train state) saves
  at step 2; a freshly built job that loads it runs step 3 bit for bit like the uninterrupted
  job (loss, norm, expert biases, every weight).
- Controls: the same resume without the optimizer state (``exclude_from_loading``) ends
  elsewhere (the resume check sees the Muon momentum); one process with each expert stack
  flattened into one matrix (one NS over all experts) ends elsewhere than the job (the routed
  experts' tolerance tells per-expert NS apart).

What is not dmuon's, set aside so that the comparison is tight (each as in the sibling tests):

- torchtitan 0.3.0's ``Trainer.pp_forward_backward_step`` hands the schedule pre-split
  micro-batches, which torch 2.13's schedules do not take (docs/pipeline.md): the schedule is
  wrapped in ``WholeBatchSchedule`` (test_torchtitan_pp_qk_clip.py), which concatenates them
  into the whole batch torch's ``step`` splits into the same micro-batches again.
- torch 2.13's pipeline stages infer their metadata in the first step with a forward of every
  stage, the last one on ``torch.empty`` inputs: torchtitan's MoE counts those tokens into
  ``tokens_per_expert_E``, which the load-balancing hook turns into the expert bias
  (torchtitan's code, whatever the optimizer; without the warm-up below, seen: the last stage's
  bias after step 1 differs from one process's). Each job runs one pipeline step first (the
  warm-up), then drops its routing counts and gradients. Gradients must be gone before a
  checkpoint load: torchtitan's ``init_optim_state`` does nothing while any gradient is set,
  and its load then silently loads no optimizer state at all (seen here before the warm-up's
  gradients were dropped: the resumed step ran without momentum).
- ``GroupedExperts.forward`` computes in bf16; its rounding differs with the token grouping and
  Newton–Schulz lifts it in an expert's near-null directions (test_torchtitan_qwen3.py): the
  experts compute in fp32 here (``_fp32_experts_forward``). Newton–Schulz is the direct backend
  (the Gram one squares a near-rank-deficient gradient's conditioning in fp32: with it the
  weights end 1.9e-4 from one process's here, 4.5e-6 direct).
- ``init_weights`` on CPU gloo ranks repeats one shard's values on every shard: every job loads
  one process's initial weights (``dmuon.set_model_state_dict``).
"""

from __future__ import annotations

import types

import pytest
import torch
from distributed.harness import run_ranks

from integrations.test_torchtitan import loss_of, tokens
from integrations.test_torchtitan_moe import build_dsv3
from integrations.test_torchtitan_pp import SEQ, _merged, _stage_state, pipeline_stages
from integrations.test_torchtitan_pp_qk_clip import WholeBatchSchedule
from integrations.test_torchtitan_qwen3 import _distances, _fp32_experts_forward, _whole
from integrations.test_torchtitan_train_step_ep import batches, constant_lr, titan_trainer

pytestmark = [pytest.mark.timeout(240), pytest.mark.distributed]

LAYERS, PP, EP, EXPERTS = 3, 2, 2, 8
MICROBATCHES = 2  # per data-parallel rank and step: 2 sequences, micro-batches of 1
STEPS, SAVE_AT = 3, 2
LR, ADAMW_LR, MAX_NORM = 0.02, 3e-3, 0.5
NS = "direct"
STACKS = ("w1_EFD", "w2_EDF", "w3_EFD")
# Seen: the first step's gradients (before the clip) within 1.7e-7 of one process's, relative
# per parameter; the losses 6e-8; the final weights 4.5e-6 (attention, every dense weight) and
# 5.2e-6 (routed experts) relative in their norms; the expert biases equal. With torchtitan's
# bf16 experts (against one process with them): the experts' gradients 2.4e-3, the final
# experts 6.6e-2, the other weights 2.6e-2. Controls: the flattened stacks 5.4e-1 (experts);
# the resume without the optimizer state 2.7e-1 (attention), 1.8e-1 (experts).
GRAD_TOL, LOSS_RTOL, TOL = 1e-5, 1e-6, 5e-5
# torchtitan's clipped norm (fp32 norms of the shards, EP and dense apart, summed over the pp
# group) is 2.6e-5 below the float64 norm of the same gradients; torch's own fp32 clip norm of
# the one-process gradients is 4e-5 below it (large fp32 sums on the CPU). The gradients
# themselves agree to GRAD_TOL: compared through the norm torchtitan logged.
NORM_RTOL = 1e-4


def _build_model(ep: bool):
    """The model on the meta device, its experts in fp32 (before ``parallelize``, which wraps
    their ``forward``; ``pipeline_llm``'s deep copies keep it)."""
    spec, model = build_dsv3(ep, LAYERS)
    for moe in _moe_layers([model]).values():
        experts = moe.routed_experts.inner_experts
        experts.forward = types.MethodType(_fp32_experts_forward, experts)
    return spec, model


def _one_process_model():
    """The whole model on the CPU, its buffers and weights from ``init_weights`` under seed 0."""
    spec, model = _build_model(False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return spec, model


def _moe_layers(parts) -> dict:
    """``{"layers.N": its MoE module}`` of the MoE blocks of ``parts``."""
    return {
        f"layers.{name}": layer.moe
        for part in parts
        for name, layer in part.layers.items()
        if layer.moe_enabled
    }


def _config():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    return dmuon_tt.MuonOptimizers.Config(lr=LR, adamw_lr=ADAMW_LR, compile=False, ns_backend=NS)


def _warm_up(pipeline, parts, has_first, has_last, dp, dp_rank) -> None:
    """One pipeline step before the optimizers exist (torch's metadata inference, see the
    docstring), its routing counts dropped as the load-balancing hook drops a step's."""
    inputs, labels = zip(*batches(0, dp, dp_rank, MICROBATCHES, MICROBATCHES))
    pipeline.step(
        arg_mbs=[(i["input"],) for i in inputs] if has_first else None,
        target_mbs=list(labels) if has_last else None,
        losses=[] if has_last else None,
        loss_kwargs={"global_valid_tokens": torch.tensor(float(dp * MICROBATCHES * SEQ))},
        return_outputs=False,
    )
    for moe in _moe_layers(parts).values():
        moe.tokens_per_expert_E.zero_()


def _job(rank, world, folder, load_from=None, exclude=()):
    """The job: ``STEPS`` train steps saving at ``SAVE_AT``; or (``load_from``) a fresh job that
    loads that save (without the ``exclude``d states) and runs the steps after it."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=PP,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=1,
        expert_parallel_degree=EP,
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    spec, model = _build_model(True)
    schedule, parts, has_first, has_last = pipeline_stages(
        spec, model, dims, parallelism, folder, local_batch=MICROBATCHES
    )
    start = {n: p.detach() for n, p in _one_process_model()[1].named_parameters()}
    for part in parts:
        names = dict(part.named_parameters())
        dmuon.set_model_state_dict(part, {n: start[n] for n in names}, strict=False)
    initial = _stage_state(parts)
    batch_mesh = dims.get_mesh("batch")
    dp, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    pipeline = WholeBatchSchedule(schedule)
    _warm_up(pipeline, parts, has_first, has_last, dp, dp_rank)

    optimizers = _config().build(model_parts=parts)
    optimizers.zero_grad()  # the warm-up's (see the docstring: before a checkpoint load)
    trainer = titan_trainer(
        spec, dims, parallelism, parts, optimizers, None,
        pp=(pipeline, has_first, has_last, MICROBATCHES),
    )  # fmt: skip
    constant_lr(trainer, optimizers, STEPS, MAX_NORM)
    trainer.checkpointer = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder="ckpt",
            interval=1,
            keep_latest_k=0,
            exclude_from_loading=list(exclude),
        ),
        dataloader=None,
        model_parts=parts,
        optimizers=optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        sd_adapter=None,
        base_folder=load_from or folder,
    )
    grads = {}

    def first_gradients(*args, **kwargs):  # after train_step's clip, before the first update
        if not grads:
            grads.update(_stage_state(parts, grads=True))

    if load_from is None:
        optimizers.register_step_pre_hook(first_gradients)
    else:
        assert trainer.checkpointer.load(step=SAVE_AT)
    loaded_step = trainer.step  # the train state: SAVE_AT after the load
    while trainer.step < STEPS:
        trainer.step += 1
        trainer.train_step(batches(trainer.step - 1, dp, dp_rank, MICROBATCHES, MICROBATCHES))
        if trainer.step == SAVE_AT and load_from is None:
            trainer.checkpointer.save(curr_step=SAVE_AT)

    (opt,) = optimizers.optimizers  # 1F1B: one stage per rank
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    experts = next(iter(_moe_layers(parts).values())).routed_experts.inner_experts
    ranks = dmuon_tt.summarize_stages(parts)["stages"][0]["ranks"]
    logged = trainer.metrics_processor.logged
    return {
        "dp": dp,
        "last_stage": has_last,
        "loaded_step": loaded_step,
        "initial": initial,
        "grads": grads,
        "steps": [m["step"] for m in logged],
        "losses": [m["loss"] for m in logged],
        "norms": [m["norm"] for m in logged],
        "bias": {n: _whole(m.expert_bias_E) for n, m in _moe_layers(parts).items()},
        "final": _stage_state(parts),
        "muon": sorted(opt.param_name(p) for p in muon),
        "kinds": {opt.param_name(p): opt._layout(p).kind for p in muon},
        "experts_local": tuple(experts.w1_EFD.to_local().shape),
        "owner_ranks": ranks,
        "ep_ranks": dist.get_process_group_ranks(dims.get_mesh("ep").get_group()),
        "efsdp": dims.get_mesh("efsdp").size(),
    }


def _scenarios(rank, world, folder):
    """The job, its resume and the resume's control in one set of rank processes (one start-up
    and torchtitan import)."""
    job = f"{folder}/job"
    return {
        "job": _job(rank, world, job),
        "resumed": _job(rank, world, f"{folder}/resumed", load_from=job),
        "no_optimizer": _job(
            rank, world, f"{folder}/no_optimizer", load_from=job, exclude=("optimizer",)
        ),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torchtitan")
    folder = tmp_path_factory.mktemp("pp_ep")
    return run_ranks(_scenarios, PP * EP, str(folder), timeout=200)


def _reference(initial: dict, dp: int, flatten_experts: bool = False) -> dict:
    """One process: the same weights, the global batch of ``dp`` ranks, the same
    ``MuonOptimizers`` config, ``STEPS`` steps as ``train_step`` takes them (torch's clip, the
    MoE load-balancing hook, a constant learning rate). ``flatten_experts`` (control): each
    expert stack orthogonalised as one ``(E, F·D)`` matrix. On one thread, as the ranks: on a
    shared 2-core machine two threads wait on each other (seen: 30 s instead of 3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process_run(initial, dp, flatten_experts)
    finally:
        torch.set_num_threads(threads)


def _one_process_run(initial: dict, dp: int, flatten_experts: bool) -> dict:
    import dmuon_compile as dmuon

    spec, model = _one_process_model()
    missing, unexpected = model.load_state_dict(initial, strict=False)  # buffers: their init
    assert not unexpected and all("rope" in k or "expert_bias" in k for k in missing), missing
    if flatten_experts:
        for moe in _moe_layers([model]).values():
            for name in STACKS:
                dmuon.set_layout(getattr(moe.routed_experts.inner_experts, name),
                                 dmuon.Layout.conv())  # fmt: skip
    optimizers = _config().build(model_parts=[model])
    dims = types.SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
    spec.post_optimizer_build_fn(optimizers, [model], dims)  # one process: no mesh to reduce
    out = {"losses": [], "norms": [], "grads": None}
    for step in range(STEPS):
        optimizers.zero_grad()
        loss = loss_of(model, tokens(step, dp), dp * MICROBATCHES * SEQ)
        loss.backward()
        if out["grads"] is None:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.stack([p.grad.double().norm() for p in model.parameters()]).norm()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizers.step()
        out["losses"].append(loss.item())
        out["norms"].append(norm.item())
    (opt,) = optimizers.optimizers
    out["muon"] = sorted(
        opt.param_name(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]
    )
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["bias"] = {n: m.expert_bias_E.clone() for n, m in _moe_layers([model]).items()}
    return out


def _all(results, label) -> list[dict]:
    return [r[label] for r in results]


@pytest.fixture(scope="module")
def reference(results):
    job = _all(results, "job")
    return _reference(_merged(job, "initial"), job[0]["dp"])


def test_meshes_and_what_the_optimizer_sees(results, reference):
    """Each stage's two ranks: FSDP2's group (the dedicated weights' owners) and the EP group
    alike; whole experts, per-expert layouts, routers on AdamW."""
    job = _all(results, "job")
    muon = set()
    for rank, r in enumerate(job):
        stage = [0, 1] if rank < 2 else [2, 3]
        assert r["owner_ranks"] == stage and sorted(r["ep_ranks"]) == stage, rank
        assert r["efsdp"] == 1, rank
        assert r["experts_local"] == (EXPERTS // EP, 256, 256), rank  # 4 whole experts
        layer = "layers.1" if rank < 2 else "layers.2"  # the stage's MoE block
        stacks = {f"{layer}.moe.routed_experts.inner_experts.{s}" for s in STACKS}
        assert {n for n, k in r["kinds"].items() if k == "experts"} == stacks, rank
        assert f"{layer}.moe.router.gate.weight" not in r["muon"], rank
        muon |= set(r["muon"])
    assert sorted(muon) == reference["muon"]  # the stages' Muon matrices: one process's


def test_pp2_ep2_train_step_trains_like_one_process(results, reference):
    job, ref = _all(results, "job"), reference
    initial = _merged(job, "initial")
    for name in ("layers.1.moe.routed_experts.inner_experts.w1_EFD", "tok_embeddings.weight"):
        w = initial[name]  # one process's weights, not init_weights' repeated shards
        assert not torch.equal(w[: len(w) // 2], w[len(w) // 2 :]), name
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # it trained
    assert ref["norms"][0] > MAX_NORM  # the clip scaled the gradients
    assert all(b.abs().max() > 0 for b in ref["bias"].values())  # the hook moved the biases
    for rank, r in enumerate(job):
        msg = f"rank {rank}"
        assert r["steps"] == list(range(1, STEPS + 1)), msg
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=NORM_RTOL, atol=0,
            msg=msg,
        )  # fmt: skip
        if r["last_stage"]:  # torchtitan logs the loss where the last stage computes it
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL,
                atol=0, msg=msg,
            )  # fmt: skip
        for layer, bias in r["bias"].items():
            torch.testing.assert_close(bias, ref["bias"][layer], rtol=0, atol=1e-7, msg=msg)
    # The first step's gradients, every parameter, before the clip: the clipped ones over the
    # factor torchtitan clipped them by (from the norm it logged).
    grads = _merged(job, "grads")
    assert grads.keys() == ref["grads"].keys()
    unclip = (job[0]["norms"][0] + 1e-6) / MAX_NORM  # torch's clip_grads_with_norm_
    for name, want in ref["grads"].items():
        err = ((grads[name] * unclip - want).norm() / want.norm()).item()
        assert err < GRAD_TOL, (name, err)
    final = _merged(job, "final")
    assert final.keys() == ref["final"].keys()
    far = _distances(final, ref["final"])
    assert all(d < TOL for d in far.values()), far
    # Control: one process with the expert stacks flattened (one NS over all 8 experts of a
    # stack) ends elsewhere: the experts' tolerance tells per-expert NS apart.
    flat = _distances(final, _reference(initial, job[0]["dp"], flatten_experts=True)["final"])
    assert flat["experts"] > 100 * TOL, flat


def test_checkpointer_resume_continues_bit_for_bit(results):
    job, resumed = _all(results, "job"), _all(results, "resumed")
    for rank, (j, r) in enumerate(zip(job, resumed)):
        assert r["loaded_step"] == SAVE_AT and r["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert r["norms"] == j["norms"][SAVE_AT:], rank
        if r["last_stage"]:
            assert r["losses"] == j["losses"][SAVE_AT:], rank
        assert r["bias"].keys() == j["bias"].keys()
        for layer, bias in r["bias"].items():
            assert torch.equal(bias, j["bias"][layer]), (rank, layer)
    final, want = _merged(resumed, "final"), _merged(job, "final")
    assert final.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(final[name], w), name
    # A fresh job's weights differ from the saved ones: the load did something.
    assert _distances(_merged(resumed, "initial"), want)["dense"] > 100 * TOL
    # Control: without the optimizer state the same step (same loss) ends elsewhere.
    control = _all(results, "no_optimizer")
    for j, c in zip(job, control):
        if c["last_stage"]:
            assert c["losses"] == j["losses"][SAVE_AT:]
    far = _distances(_merged(control, "final"), want)
    assert far["attention"] > 100 * TOL and far["experts"] > 100 * TOL, far
