"""QK-clip under torchtitan's pipeline parallelism: ``MuonOptimizers.Config(qk_clip=tau)`` with
pp 2 × dp 2 on 4 gloo ranks, through torchtitan's own ``Trainer.train_step`` (its token count,
its pipeline forward-backward, its gradient clipping across stages, the optimizers' and the LR
schedulers' steps, its loss metrics).

torchtitan's Llama-3 debug model (2 layers: one block per stage) split by its ``pipeline_llm``
(``1F1B``, 4 micro-batches of one sequence), each stage's part parallelised by
``dedicating(parallelize_llama)``, from one process's initial weights. Each part's ``Muon``
clips that part's attention: its maxima are reduced over the groups of the part's own dedicated
runtime (``dmuon_compile.qk_clip.model_groups``: the stage's data-parallel ranks), not over the
default group, which holds the other stage's ranks and layers.

- The job trains like one process running the same config (``MuonOptimizers`` with the same
  clip) on the global batch: each step's per-head maxima and the clip counts of every layer,
  the losses (on the last stage's ranks), the gradient norms and every weight at the end.
- Each rank's reduced maxima are the largest of its stage's two data-parallel ranks' own, and
  some heads exceed ``tau`` on one of them only (the reduce matters).
- Control (same launch; it fails fast: every rank packs 16 heads, so the reduce completes): the
  maxima reduced over the default group are the largest over both stages, each stage's layer
  taken with the other's: they differ from one process's.

Found here, a bug in the clip (``test_the_clip_observes_only_the_micro_batches_of_a_step``):
torch 2.13's pipeline stages run their module's forward once more on the first step (metadata
inference; again after an eval/train switch of the schedule), the last stage's on
``torch.empty`` inputs, and the clip recorded it. The clip now collects nothing inside that
forward (``qk_clip.not_collecting``); control: with torch's method unwrapped, it is seen.

torchtitan 0.3.0's ``Trainer.pp_forward_backward_step`` hands the schedule pre-split
micro-batches (``step(arg_mbs=..., target_mbs=...)``), which torch 2.13's schedules do not take
(``Expecting 2 arg_mbs but got 1``, with any optimizer: docs/pipeline.md). The schedule is
wrapped in :class:`WholeBatchSchedule`, which concatenates the micro-batches into the whole batch
torch's ``step`` takes (it splits it back into the same micro-batches); the rest of
``train_step`` is torchtitan's code, unchanged.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import run_ranks

from integrations.test_torchtitan_pp import (
    LOCAL_BATCH,
    _merged,
    _stage_state,
    build_model,
    pipeline_stages,
    tokens,
)
from integrations.test_torchtitan_train_step_ep import (
    constant_lr,
    disabled_checkpointer,
    titan_trainer,
)

pytestmark = [pytest.mark.timeout(200), pytest.mark.distributed]

LAYERS, PP, STEPS = 2, 2, 3  # one block per stage; LOCAL_BATCH micro-batches of 1 sequence
LR, ADAMW_LR, MAX_NORM = 0.02, 3e-3, 0.5
# Between the heads' maxima in these 3 steps (~0.25-0.45): every step some heads of each layer
# clip, others not (the test checks that no max is so near tau that rounding could flip it).
TAU = 0.35
# Against one process, relative. Seen: maxima 9e-7, weights at the end 3e-6 (every weight),
# losses 1.2e-7. Direct NS: with the Gram backend the attention ends 3e-5 away, the MLPs 1.3e-4.
REL = 2e-5
# The logged gradient norm against one process's in float64: the stages' norms are summed from
# fp32 norms of FSDP2 shards, 3.1e-5 off (torch's fp32 norm of the whole 2048 × 256 head is
# 8e-5 off).
NORM_RTOL = 2e-4


class WholeBatchSchedule:
    """torch 2.13's pipeline schedule behind the ``step`` signature torchtitan 0.3.0's trainer
    calls: its micro-batches concatenated into the whole batch (the schedule splits it into as
    many micro-batches again, the same ones)."""

    def __init__(self, schedule):
        self.schedule = schedule

    def step(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if any(kwarg_mbs or ()):
            raise NotImplementedError(f"model kwargs per micro-batch: {kwarg_mbs}")
        args = tuple(torch.cat(parts) for parts in zip(*arg_mbs)) if arg_mbs else ()
        target = None if target_mbs is None else torch.cat(target_mbs)
        return self.schedule.step(*args, target=target, **kwargs)


def _config():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    return dmuon_tt.MuonOptimizers.Config(
        lr=LR, adamw_lr=ADAMW_LR, qk_clip=TAU, compile=False, ns_backend="direct"
    )


def _microbatches(step: int, dp: int, dp_rank: int):
    """This data-parallel rank's micro-batches at ``step`` as torchtitan's dataloader yields
    them: ``LOCAL_BATCH`` pairs ``({"input": tokens}, labels)`` of one sequence each."""
    batch = tokens(step, dp)[dp_rank * LOCAL_BATCH : (dp_rank + 1) * LOCAL_BATCH]
    return [({"input": b[None, :-1]}, b[None, 1:]) for b in batch]


def _train(rank, world, folder, steps=STEPS, default_group=False, unguarded=False):
    """``steps`` torchtitan train steps under PP. ``default_group``: the control, every part's
    clip reducing over the default group. ``unguarded``: the control of the metadata forward,
    torch's ``PipelineStage`` metadata inference unwrapped (the clip then sees it)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    # As in a job, torchtitan's trainer module is loaded before the meshes: it registers the
    # "fake" process-group backend ParallelDims.build_mesh gives its size-1 dims.
    import torchtitan.trainer  # noqa: F401
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    import dmuon_compile as dmuon

    parallel_dims_module.device_type = "cpu"  # torchtitan names "cuda" without an accelerator
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=PP,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=1,
        pipeline_parallel_last_stage_less_layers=0,  # a block in every stage
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    spec, model = build_model(LAYERS)
    schedule, parts, has_first, has_last = pipeline_stages(spec, model, dims, parallelism, folder)
    # One process's initial weights, the same in every scenario of the launch (init_weights
    # does not repeat itself from one model to the next in a process, and repeats one shard's
    # values on every FSDP2 shard).
    whole = _one_process_model()
    for part in parts:
        names = dict(part.named_parameters())
        dmuon.set_model_state_dict(part, {n: whole[n] for n in names}, strict=False)
    initial = _stage_state(parts)
    for name, want in initial.items():
        assert torch.equal(want, whole[name]), name
    batch_mesh = dims.get_mesh("batch")
    dp, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    pipeline = WholeBatchSchedule(schedule)
    optimizers = _config().build(model_parts=parts)
    if unguarded:
        from torch.distributed.pipelining import PipelineStage

        name = "_forward_metadata_inference"
        guarded = PipelineStage.__dict__[name]
        setattr(PipelineStage, name, guarded.__wrapped__)
    clips = [opt.qk_clip for opt in optimizers.optimizers]
    groups = [
        sorted(tuple(torch.distributed.get_process_group_ranks(g)) for g in clip.group)
        for clip in clips
    ]
    if default_group:
        for clip in clips:
            clip.group = None  # the default group: every rank, both stages
    # Per step: {layer: this rank's maxima}, {layer: the forwards the clip saw}, {layer: the
    # clip's maxima} (before and after the step's reduce).
    local, seen, reduced = [], [], []
    optimizers.register_step_pre_hook(
        lambda *a, **k: local.append(
            {att.name: att.running.clone() for clip in clips for att in clip.attentions}
        )
    )
    optimizers.register_step_pre_hook(
        lambda *a, **k: seen.append(
            {att.name: att.records for clip in clips for att in clip.attentions}
        )
    )
    optimizers.register_step_post_hook(
        lambda *a, **k: reduced.append(
            {name: m.clone() for clip in clips for name, m in clip.max_logits().items()}
        )
    )
    checkpointer = disabled_checkpointer(model, optimizers, folder)
    trainer = titan_trainer(
        spec, dims, parallelism, parts, optimizers, checkpointer,
        pp=(pipeline, has_first, has_last, LOCAL_BATCH),
    )  # fmt: skip
    constant_lr(trainer, optimizers, steps, MAX_NORM)
    try:
        for step in range(steps):
            trainer.step = step + 1
            trainer.train_step(iter(_microbatches(step, dp, dp_rank)))
    finally:
        if unguarded:
            setattr(PipelineStage, name, guarded)
    logged = trainer.metrics_processor.logged
    clipped = {}
    for clip in clips:
        heads = torch.split(clip.clipped, [att.n_heads for att in clip.attentions])
        clipped.update({att.name: n.clone() for att, n in zip(clip.attentions, heads)})
    return {
        "dp": dp,
        "last_stage": has_last,
        "groups": groups,
        "initial": initial,
        "final": _stage_state(parts),
        "losses": [m["loss"] for m in logged],
        "norms": [m["norm"] for m in logged],
        "local": local,
        "seen": seen,
        "reduced": reduced,
        "clipped": clipped,
    }


def _scenarios(rank, world, folder):
    """The job and its controls in one set of rank processes (one start-up and torchtitan
    import)."""
    return {
        "stage": _train(rank, world, f"{folder}/stage"),
        "default_group": _train(rank, world, f"{folder}/default_group", default_group=True),
        "unguarded": _train(rank, world, f"{folder}/unguarded", steps=1, unguarded=True),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torchtitan")
    return run_ranks(_scenarios, PP * 2, str(tmp_path_factory.mktemp("pp_qk_clip")), timeout=180)


def _one_process_model(params: bool = True):
    """The whole model on the CPU, its buffers (rope) and weights from ``init_weights`` under
    seed 0; ``params``: its parameters by name, detached."""
    _, model = build_model(LAYERS)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {n: p.detach() for n, p in model.named_parameters()} if params else model


def _reference(initial: dict, dp: int) -> dict:
    """One process: the whole model from the stages' initial weights, the global batch of every
    step, the same ``MuonOptimizers`` config (the clip on its attention), torch's clipping."""
    model = _one_process_model(params=False)
    missing, unexpected = model.load_state_dict(initial, strict=False)
    assert not unexpected and all("freqs" in k or "rope" in k for k in missing), missing
    optimizers = _config().build(model_parts=[model])
    (clip,) = [opt.qk_clip for opt in optimizers.optimizers]
    out = {"losses": [], "norms": [], "reduced": []}
    for step in range(STEPS):
        optimizers.zero_grad()
        batch = tokens(step, dp)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        ) / float(batch[:, 1:].numel())
        loss.backward()
        # The norm the runs log, in float64 (torch's fp32 norm of the 2048 × 256 head alone is
        # ~8e-5 off here; the stages' fp32 shard norms ~3e-5); the clip as torch computes it.
        grads = [p.grad.double().norm() for p in model.parameters()]
        out["norms"].append(torch.stack(grads).norm().item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizers.step()  # then the clip
        out["losses"].append(loss.item())
        out["reduced"].append({name: m.clone() for name, m in clip.max_logits().items()})
    heads = torch.split(clip.clipped, [att.n_heads for att in clip.attentions])
    out["clipped"] = {att.name: n.clone() for att, n in zip(clip.attentions, heads)}
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _distance(a: dict, b: dict, part: str = "") -> float:
    """The largest relative difference (per weight, in its norm) of the weights named ``part``."""
    return max(((a[n] - w).norm() / w.norm()).item() for n, w in b.items() if part in n)


def test_pp2_dp2_qk_clip_through_train_step_trains_like_one_process(results):
    runs = [r["stage"] for r in results]
    dp = runs[0]["dp"]
    initial = _merged(runs, "initial")
    ref = _reference(initial, dp)
    layers = [f"layers.{i}.attention" for i in range(LAYERS)]
    assert sorted(ref["clipped"]) == layers
    maxima = torch.stack([torch.cat([step[n] for n in layers]) for step in ref["reduced"]])
    margin = ((maxima - TAU).abs() / TAU).min()
    assert margin > 2 * REL, f"a max within {margin:.1e} of tau: move tau"
    for step in ref["reduced"]:  # every step, some heads of every layer clip, others not
        for layer in layers:
            assert 0 < (step[layer] > TAU).sum() < len(step[layer]), (layer, step[layer])
    assert _distance(ref["final"], initial) > 1e-3  # it trained
    assert ref["norms"][0] > MAX_NORM  # the clip of the gradients scaled them
    stages: dict[str, list[int]] = {}  # layer -> the ranks of its stage
    for rank, r in enumerate(runs):
        msg = f"rank {rank}"
        # Each part's clip reduces over its stage's data-parallel ranks: one group of 2.
        (groups,) = r["groups"]
        ((stage_ranks),) = groups
        assert rank in stage_ranks and len(stage_ranks) == dp, (msg, groups)
        (layer,) = r["clipped"]  # one block per stage
        assert stages.setdefault(layer, list(stage_ranks)) == list(stage_ranks), msg
        # The clip saw one forward per micro-batch, every step, the first one too.
        assert [step[layer] for step in r["seen"]] == [LOCAL_BATCH] * STEPS, (msg, r["seen"])
        # The same maxima and clip counts as one process, layer by layer, step by step.
        assert torch.equal(r["clipped"][layer], ref["clipped"][layer]), (msg, r["clipped"])
        for got, want in zip(r["reduced"], ref["reduced"], strict=True):
            assert got.keys() == {layer}, msg
            torch.testing.assert_close(got[layer], want[layer], rtol=REL, atol=0, msg=msg)
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=NORM_RTOL, atol=0, msg=msg
        )
        if r["last_stage"]:  # torchtitan logs the loss where the last stage computes it
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=REL, atol=0,
                msg=msg,
            )  # fmt: skip
    assert sorted(stages) == layers
    # Every rank's maxima are the largest of its stage's ranks' own (one all_reduce(MAX) over
    # the stage's group), and some heads were over tau on one of them only.
    one_only = 0
    for layer, ranks in stages.items():
        own = torch.stack([torch.stack([s[layer] for s in runs[q]["local"]]) for q in ranks])
        for q in ranks:
            got = torch.stack([s[layer] for s in runs[q]["reduced"]])
            assert torch.equal(got, own.amax(0)), (layer, q)
        over = own > TAU
        one_only += int((over.any(0) & ~over.all(0)).sum())
    assert one_only > 0
    final = _merged(runs, "final")
    assert final.keys() == ref["final"].keys()
    assert _distance(final, ref["final"]) < REL
    # Control: reduced over the default group, each rank's maxima are the largest of every
    # rank's, its stage's layer taken with the other stage's (16 heads each, head by head):
    # they differ from one process's, and so do the clip counts.
    controls = [r["default_group"] for r in results]
    everywhere = torch.stack([torch.stack([next(iter(s.values())) for s in c["local"]])
                              for c in controls]).amax(0)  # fmt: skip
    for rank, control in enumerate(controls):
        (layer,) = control["clipped"]
        got = torch.stack([s[layer] for s in control["reduced"]])
        assert torch.equal(got, everywhere), rank
        want = torch.stack([s[layer] for s in ref["reduced"]])
        assert not torch.allclose(got, want, rtol=0.1, atol=0), rank
        assert not torch.equal(control["clipped"][layer], ref["clipped"][layer]), rank


def test_the_clip_observes_only_the_micro_batches_of_a_step(results):
    """The job in the order torchtitan's trainer builds it (the optimizers, with their clips,
    before the first pipeline step): the clip must see one forward per micro-batch in the first
    step too. torch 2.13's pipeline stages run a forward of their module for metadata inference
    on the first step (and again after any eval/train switch of the schedule), the first stage
    on its first micro-batch, the others on ``torch.empty`` inputs: the clip recorded it, and the
    last stage's maxima of that step could be any value (seen: heads at 0.44 and 0.34 whose
    maxima were 0.32 and 0.27; 0.44 > tau clipped a head one process leaves alone)."""
    for rank, r in enumerate(results):
        seen = r["stage"]["seen"][0]
        assert all(n == LOCAL_BATCH for n in seen.values()), (rank, seen)
    # control: unwrapped, the metadata forward is seen (the last stage's, on empty inputs)
    unguarded = [n for r in results for n in r["unguarded"]["seen"][0].values()]
    assert any(n > LOCAL_BATCH for n in unguarded), unguarded
