"""Dry run: predict a dedicated-Muon job per rank before it starts, without GPUs.

    python -m dmuon_compile.plan --model llama3-70b --gpus 8 64 512 4096
    python -m dmuon_compile.plan --model llama3-405b --gpus 1024 --hsdp 4 --split-size 8
    python -m dmuon_compile.plan --model mypkg.models:build --gpus 64 --per-rank --json
    python -m dmuon_compile.plan --model deepseek-v3 --gpus 64 2048 --ep 8
    python -m dmuon_compile.plan --model llama3-405b --gpus 512 --pp 8 --stages-per-rank 2
    python -m dmuon_compile.plan --model llama3-8b --gpus 8 --momentum-dtype int8 --offload momentum

The model is built on the meta device (a preset, a JSON config or your own factory) and goes
through the planning ``dedicate_params`` itself runs
(:func:`~dmuon_compile.distributed.dedicate.plan_dedicated`: the same predicate, checks,
layouts, hook groups and owner plan), for ``replicate × shard × tp`` ranks, with no process
group; ``ep`` lays the expert stacks out as torchtitan's expert parallelism does, ``pp`` splits
the decoder into pipeline stages as torchtitan does (each PP rank's ranks own its stages'
weights). Per rank it
reports the dedicated Muon state it owns, the FSDP2-sharded state, the step's peak memory, the
Newton–Schulz milliseconds (from the measured kernel rates of :mod:`dmuon_compile.ns_rates`),
the communication volume per step, idle ranks and split matrices. docs/dry_run_reference.md
states the model behind every column.

The package: :mod:`~dmuon_compile.plan.models` (presets and meta-device models),
:mod:`~dmuon_compile.plan.dispatch` (:func:`dry_run`: its arguments, one decoder or the pipeline
stages, the notes), :mod:`~dmuon_compile.plan.run` (the planning and one row per rank),
:mod:`~dmuon_compile.plan.experts` (expert parallelism), :mod:`~dmuon_compile.plan.pipeline`
(pipeline stages), :mod:`~dmuon_compile.plan.momentum` (the momentum's storage: bf16, 8-bit,
offloaded to host memory), :mod:`~dmuon_compile.plan.report` (the table and JSON),
:mod:`~dmuon_compile.plan.advice` (the notes on a peak that does not fit and on idle ranks) and
:mod:`~dmuon_compile.plan.cli` (the command line).
"""

from dmuon_compile.plan.cli import main
from dmuon_compile.plan.dispatch import dry_run
from dmuon_compile.plan.models import PRESETS, CausalLM, GroupedExperts, ModelConfig, build_model
from dmuon_compile.plan.pipeline import pipeline_stage_layers
from dmuon_compile.plan.report import DryRunReport, RankRow

__all__ = [
    "PRESETS",
    "CausalLM",
    "DryRunReport",
    "GroupedExperts",
    "ModelConfig",
    "RankRow",
    "build_model",
    "dry_run",
    "main",
    "pipeline_stage_layers",
]
