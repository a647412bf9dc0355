"""Pipeline parallelism in the dry run: torchtitan's split of the decoder into stages, looped
placement, each PP rank's stages planned together (``base_loads``)."""

from __future__ import annotations

import time

from torch import nn

from dmuon_compile.plan.experts import _merge_expert_layout
from dmuon_compile.plan.models import build_model
from dmuon_compile.plan.report import DryRunReport, RankRow
from dmuon_compile.plan.run import _run_group

# ----------------------------------------------------------------------------- pipeline
_SUMMED = (  # RankRow fields a PP rank adds up over its stages (each stage's own optimizer)
    "matrices",
    "dedicated_bytes",
    "replica_bytes",
    "sharded_muon_bytes",
    "adamw_bytes",
    "grad_bytes",
    "ns_ms",
    "step_ms",
    "fsdp_comm_bytes",
    "dedicated_comm_bytes",
    "replicate_comm_bytes",
    "tp_comm_bytes",
    "split_comm_bytes",
    "expert_matrices",
    "expert_ns_ms",
    "expert_reshard_comm_bytes",
    "expert_gather_comm_bytes",
    "host_bytes",
    "host_link_bytes",
    "_momentum_gpu_bytes",
    "_momentum_working_bytes",
    "_master_host_bytes",
    "_kept_saved_bytes",
    "_kept_saved_ms",
)


def pipeline_stage_layers(
    num_layers: int, num_stages: int, first_less: int = 1, last_less: int = 1
) -> list[list[int]]:
    """The layer indices of each of ``num_stages`` pipeline stages, cut as torchtitan's
    ``pipeline_llm`` cuts a decoder by default: the embeddings count as ``first_less`` layers of
    the first stage and the output (norm + head) as ``last_less`` of the last
    (``pipeline_parallel_first/last_stage_less_layers``, default 1), the ``num_layers +
    first_less + last_less`` effective layers are dealt evenly, the first stages one more each
    when they do not divide. One stage: every layer."""
    for name, v, least in (
        ("num_layers", num_layers, 1),
        ("num_stages", num_stages, 1),
        ("first_less", first_less, 0),
        ("last_less", last_less, 0),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"pipeline_stage_layers: {name} must be an integer >= {least}")
    if num_stages == 1:
        return [list(range(num_layers))]
    effective = num_layers + first_less + last_less
    each, extra = divmod(effective, num_stages)
    if each < max(1, first_less, last_less):
        raise ValueError(
            f"dry_run: {num_stages} stages over {num_layers} layers (+{first_less} for the "
            f"embeddings, +{last_less} for the output, torchtitan's "
            "pipeline_parallel_first/last_stage_less_layers) leave a stage fewer effective "
            f"layers ({each}) than the embeddings or output count for: pass fewer stages "
            "(--pp / --stages-per-rank) or smaller --pp-first-less-layers/--pp-last-less-layers"
        )
    stages, start = [], 0
    for k in range(num_stages):
        n = each + (k < extra) - (first_less if k == 0 else 0)
        n -= last_less if k == num_stages - 1 else 0
        n = max(0, min(n, num_layers - start))
        stages.append(list(range(start, start + n)))
        start += n
    return stages


def _layers_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's one ``layers`` ModuleList or ModuleDict (what torchtitan's split cuts)."""
    found = [
        (path, m)
        for path, m in model.named_modules()
        if path.rsplit(".", 1)[-1] == "layers" and isinstance(m, (nn.ModuleList, nn.ModuleDict))
    ]
    if len(found) != 1:
        where = ", ".join(p for p, _ in found) or "none"
        raise ValueError(
            f"dry_run: pp needs a decoder with exactly one `layers` ModuleList/ModuleDict (what "
            f"torchtitan's pipeline split cuts); this model has {len(found)} ({where}): pass a "
            "model with one (e.g. a preset or --config) or drop pp/--pp"
        )
    return found[0]


def _stage_params(model: nn.Module, stage_layers: list[list[int]]) -> list[set[str]]:
    """Each stage's parameter names: its layers', those registered before the layers
    (embeddings) with the first stage, those after (norm, head) with the last."""
    path, layers = _layers_of(model)
    stage_of = {}
    for k, indices in enumerate(stage_layers):
        for i in indices:
            stage_of[i] = k
    prefixes = {f"{path}.{key}.": i for i, (key, _) in enumerate(layers.named_children())}
    out: list[set[str]] = [set() for _ in stage_layers]
    seen_layer = False
    for name, _ in model.named_parameters():
        head = name[: name.index(".", len(path) + 1) + 1] if name.startswith(path + ".") else ""
        if head in prefixes:
            out[stage_of[prefixes[head]]].add(name)
            seen_layer = True
        else:
            out[-1 if seen_layer else 0].add(name)
    return out


def _check_pp(pp, per_rank, less, world, options) -> None:
    for name, v, least in (
        ("pp", pp, 1),
        ("stages_per_rank", per_rank, 1),
        ("pp_first_stage_less_layers", less[0], 0),
        ("pp_last_stage_less_layers", less[1], 0),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"dry_run: {name} must be an integer >= {least}, got {v!r}")
    tp, ep, replicate = options["tp_size"], options["ep"], options["replicate_size"]
    if tp != 1:
        raise ValueError(
            f"dry_run: pp={pp} with tp_size={tp} is not modelled (torchtitan's PP stages with TP: "
            "dedicating(...) plans each stage alone on the DP × TP slots, and the package's "
            "pipeline runs are not tested with TP): pass tp_size=1 (--tp 1) or drop pp (--pp)"
        )
    if ep is not None and ep > 1:
        raise ValueError(
            f"dry_run: pp={pp} with ep={ep} is not modelled (the package's pipeline runs are not "
            "tested with expert parallelism, whose EP groups torchtitan carves out of each "
            "stage's data-parallel ranks): pass ep=1 or none (--ep 1 or no --ep) or drop pp"
        )
    per = pp * replicate * tp
    if not isinstance(world, int) or isinstance(world, bool) or world < 1 or world % per:
        lo = world // per * per if isinstance(world, int) else 0
        near = f"{lo} or {lo + per}" if lo else f"{per}"
        raise ValueError(
            f"dry_run: {world} GPUs are not divisible by pp {pp} × replicate_size {replicate} "
            f"× tp_size {tp} = {per} (each PP rank holds world / pp of them): pass a multiple "
            f"of {per} (e.g. {near}) or change --pp/--hsdp"
        )


def _pipeline_run(model_or_config, world_size, pp, per_rank, less, options) -> DryRunReport:
    """:func:`dry_run` with pipeline parallelism: each PP rank's data-parallel group plans its
    stages in order, each over the NS loads of the ones before (``dedicating``'s
    ``balance_stages``); its ranks' rows add its stages up."""
    t_start = time.perf_counter()
    _check_pp(pp, per_rank, less, world_size, options)
    name, model = build_model(model_or_config)
    num_stages = pp * per_rank
    layers = len(_layers_of(model)[1])
    if num_stages > layers:
        fits = max(1, layers // pp)
        raise ValueError(
            f"dry_run: pp {pp} × stages_per_rank {per_rank} = {num_stages} stages for {layers} "
            f"layers: each stage needs at least one layer; pass pp · stages_per_rank <= {layers} "
            f"(e.g. --stages-per-rank {fits} with --pp {pp}, or a smaller --pp)"
        )
    stage_layers = pipeline_stage_layers(layers, num_stages, *less)
    keeps = _stage_params(model, stage_layers)
    group = world_size // pp
    rows = [RankRow(g) for g in range(world_size)]
    owners: dict[str, int] = {}
    stages: list[dict] = [{} for _ in range(num_stages)]
    pp_ranks, split_rows, notes = [], [], []
    first = None  # one stage's report: the group's sizes, rates and settings
    plan_s = 0.0
    totals = {"dedicated_matrices": 0, "dedicated_params": 0, "adamw": 0, "sharded": 0}
    expert = None
    once = False  # expert_ns="once" split some stage's expert stacks over the replicas
    for p in range(pp):
        carried = None  # NS FLOPs per data-parallel slot of this PP rank's stages so far
        base = p * group
        for k in range(p, num_stages, pp):
            report, planned = _run_group(model, group, keep=keeps[k], base_loads=carried, **options)
            first = first or report
            once = once or report.expert_ns is not None
            plan_s += report.plan_s
            loads = planned.plan.ns_loads() if planned.plan is not None else []
            if loads:
                carried = loads if carried is None else [a + b for a, b in zip(carried, loads)]
            for d, r in enumerate(report.rows):
                row = rows[base + d]
                for f in _SUMMED:
                    setattr(row, f, getattr(row, f) + getattr(r, f))
                # each stage's optimizer steps in turn: one stage's working set at a time; what
                # kept buf′s add to the largest is the largest with them less the largest without
                without = max(
                    row.step_extra_bytes - row._kept_bytes, r.step_extra_bytes - r._kept_bytes
                )
                row.step_extra_bytes = max(row.step_extra_bytes, r.step_extra_bytes)
                row._kept_bytes = row.step_extra_bytes - without
                row._momentum_step_bytes = max(row._momentum_step_bytes, r._momentum_step_bytes)
            owners.update({fqn: base + o for fqn, o in report.owners.items()})
            for s in report.split:
                split_rows.append({**s, "ranks": [base + g for g in s["ranks"]]})
            notes += [n for n in report.notes if n not in notes]
            totals["dedicated_matrices"] += report.dedicated_matrices
            totals["dedicated_params"] += report.dedicated_params
            totals["adamw"] += report.adamw_params
            totals["sharded"] += report.sharded_muon_params
            if report.expert_layout is not None:
                expert = _merge_expert_layout(expert, report.expert_layout)
            mean = sum(loads) / len(loads) if loads else 0.0
            stages[k] = {
                "stage": k,
                "pp_rank": p,
                "layers": stage_layers[k],
                "embeddings": k == 0,
                "output": k == num_stages - 1,
                "dedicated": report.dedicated_matrices,
                "owners": report.owners,  # data-parallel ranks of the PP rank's group
                "ns_flops_per_rank": loads,
                "ns_max_over_mean": max(loads) / mean if mean else 1.0,
            }
            if not report.dedicated_matrices:
                notes.append(
                    f"stage {k} (PP rank {p}) has no dedicated weights"
                    + (" (only what follows the layers)" if not stage_layers[k] else "")
                )
        ns = [rows[base + d].ns_ms for d in range(group)]
        mean_flops = sum(carried) / len(carried) if carried else 0.0
        pp_ranks.append(
            {
                "pp_rank": p,
                "ranks": [base, base + group - 1],
                "stages": list(range(p, num_stages, pp)),
                "layers": sum(len(stage_layers[k]) for k in range(p, num_stages, pp)),
                "ns_ms_max": max(ns),
                "ns_ms_mean": sum(ns) / group,
                "ns_flops_max_over_mean": max(carried) / mean_flops if mean_flops else 1.0,
            }
        )
    if options["ep"] is not None and expert is None:
        raise ValueError(
            f"dry_run: ep={options['ep']}, but the model has no expert stacks left to FSDP2/EP: "
            "drop ep/--ep for a dense model"
        )
    if expert is not None:
        expert["ranks_with_experts"] = sum(1 for r in rows if r.expert_matrices)
    notes.append(
        "pipeline parallelism: each PP rank counts its own stages only. Not modelled: the "
        "activations and gradients the stages send each other, the schedule's bubbles, and "
        "the unshards per micro-batch (comm counts one forward and backward, as without PP; "
        "dedicated groups are gathered for every micro-batch's forward and backward, FSDP2 "
        "under torchtitan's default policy keeps its weights unsharded after forward)"
    )
    out = DryRunReport(
        model=name,
        world_size=world_size,
        replicate_size=first.replicate_size,
        shard_size=first.shard_size,
        tp_size=first.tp_size,
        split_size=first.split_size,
        rows=rows,
        owners=owners,
        dedicated_matrices=totals["dedicated_matrices"],
        dedicated_params=totals["dedicated_params"],
        adamw_params=totals["adamw"],
        sharded_muon_params=totals["sharded"],
        split=split_rows,
        rates=first.rates,
        settings={**first.settings, "expert NS": "once"} if once else first.settings,
        plan_s=plan_s,
        notes=notes,
        ep=options["ep"],
        expert_layout=expert,
        offload=options["momentum"].offload,
        expert_ns="once" if once else None,
        pp=pp,
        stages_per_rank=per_rank,
        stage_less_layers=list(less),
        stages=stages,
        pp_ranks=pp_ranks,
    )
    out.total_s = time.perf_counter() - t_start
    return out
