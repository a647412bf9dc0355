"""``python -m dmuon_compile.plan``: the dry run's command line."""

from __future__ import annotations

import argparse
import json
import math
import sys

from dmuon_compile.distributed.step_plan import EXPERT_NS
from dmuon_compile.momentum_storage import IN_FLIGHT, MOMENTUM_DTYPES
from dmuon_compile.ns_rates import H200, NSRates
from dmuon_compile.plan.dispatch import dry_run
from dmuon_compile.plan.models import PRESETS, build_model
from dmuon_compile.plan.momentum import HOST_LINK_GBPS
from dmuon_compile.plan.report import GiB
from dmuon_compile.plan.run import _DTYPES


# ----------------------------------------------------------------------------- command line
def _gib(what: str, least_bytes: int = 1):
    """An argparse type: a finite number of GiB of at least ``least_bytes`` bytes."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or int(value * GiB) < least_bytes:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give {what} as a number of GiB > 0 (at least {least_bytes} byte"
                f"{'s' * (least_bytes > 1)}, {least_bytes / GiB:.3g} GiB)"
            )
        return value

    return parse


def _positive(what: str):
    """An argparse type: a finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}, a number > 0")
        return value

    return parse


def _in_flight(text: str) -> int | None:
    """``--momentum-in-flight``: a number of buckets >= 1, or ``all``."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of shape buckets >= 1, or all")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dmuon_compile.plan",
        description=(
            "Dry run of a dedicated-Muon job: builds the model on the meta device, runs "
            "dedicate_params' planning for each GPU count (no GPUs, no process group) and "
            "prints per rank the owned Muon state, FSDP2 state, peak step memory, predicted "
            "Newton–Schulz ms, communication per step, idle ranks and split matrices."
        ),
        epilog=(
            "Presets: " + ", ".join(PRESETS) + ". Your model: --model package.module:function "
            "(returns an nn.Module; built under torch.device('meta')) or --config path.json "
            "(ModelConfig fields). Example: python -m dmuon_compile.plan --model llama3-70b "
            "--gpus 8 64 512 4096"
        ),
    )
    ap.add_argument("--model", help="preset name or package.module:function factory")
    ap.add_argument("--config", help="JSON file of ModelConfig fields (instead of --model)")
    ap.add_argument(
        "--gpus", type=int, nargs="+", required=True, help="total GPU counts to predict"
    )
    ap.add_argument("--hsdp", type=int, default=1, metavar="R", help="replicate size (HSDP)")
    ap.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size")
    ap.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help="expert parallelism as torchtitan lays it out: expert stacks over groups of N "
        "shard ranks (E/N experts each), expert FSDP over the other shard/N (Shard(0), or "
        "Shard(1) inside the experts when efsdp·N > E); default: plain FSDP2 Shard(0)",
    )
    ap.add_argument(
        "--expert-shard-dim",
        type=int,
        choices=(0, 1),
        help="with --ep: force the expert FSDP shard dim (default: torchtitan's rule)",
    )
    ap.add_argument(
        "--per-head",
        action="store_true",
        help="Muon(per_head=True): q, k, v and o orthogonalised head by head (with --tp: "
        "a projection whose TP shards hold whole heads runs them on each TP rank, no gather)",
    )
    ap.add_argument(
        "--expert-ns",
        choices=EXPERT_NS,
        default="per_replica",
        help="Muon(expert_ns=...) under --hsdp R > 1: per_replica (default), each replica "
        "orthogonalises its copy of the expert stacks; once, the R replicas split the whole "
        "experts (expert NS per rank / R) and all-gather the results in 2 bytes per element "
        "over the replicate dim ('replica gather' column)",
    )
    ap.add_argument(
        "--pp",
        type=int,
        metavar="N",
        help="pipeline parallelism as torchtitan splits a decoder: the layers in N·V contiguous "
        "stages, stage k on PP rank k mod N, each PP rank's GPUs/N ranks planning its stages "
        "(activations and sends between stages not modelled)",
    )
    ap.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        metavar="V",
        help="with --pp: stages per PP rank (looped schedules such as Interleaved1F1B: 2); "
        "default 1",
    )
    ap.add_argument(
        "--pp-first-less-layers",
        type=int,
        default=1,
        metavar="K",
        help="with --pp: torchtitan's pipeline_parallel_first_stage_less_layers (default 1)",
    )
    ap.add_argument(
        "--pp-last-less-layers",
        type=int,
        default=1,
        metavar="K",
        help="with --pp: torchtitan's pipeline_parallel_last_stage_less_layers (default 1)",
    )
    ap.add_argument(
        "--split-size",
        type=int,
        default=1,
        help="split NS: matrices above a fair share run over aligned blocks of this many ranks",
    )
    ap.add_argument(
        "--param-dtype",
        choices=[*_DTYPES, "none"],
        default="bf16",
        help="compute dtype of the unsharded weights (default bf16; none: as stored)",
    )
    ap.add_argument(
        "--reduce-dtype",
        choices=[*_DTYPES, "none"],
        default="fp32",
        help="gradient reduce dtype (default fp32; none: the compute dtype)",
    )
    ap.add_argument(
        "--momentum-dtype",
        choices=list(MOMENTUM_DTYPES),
        default=None,
        help="the Muon momentum's storage (Muon(momentum_dtype=...)): fp32 (the weights' dtype, "
        "the default), bf16, or int8 (blockwise 8-bit: 1 byte per value + an fp32 scale per "
        "256; the step works on a buffer in the weights' dtype)",
    )
    ap.add_argument(
        "--offload",
        choices=["momentum", "state"],
        default=None,
        help="Muon(offload='momentum'): the momentum in pinned host memory between steps "
        "('host' columns), copied in before each step (in 'step ms') and written back under "
        "the next forward; 'state': the owned dedicated masters too (the GPU keeps their "
        "compute-dtype copies)",
    )
    ap.add_argument(
        "--momentum-in-flight",
        type=_in_flight,
        default=IN_FLIGHT,
        metavar="N|all",
        help="with an int8 or offloaded momentum: the shape buckets the step materialises at "
        f"once (Muon(momentum_in_flight=...); default {IN_FLIGHT}: the copy-in of each under the "
        "NS before it); all: every working buffer at once, the copy-in waited for",
    )
    ap.add_argument(
        "--keep-new-momentum",
        action="store_true",
        help="Muon(keep_new_momentum=True): each rank holds the new momentum of the Muon "
        "matrices it steps itself (not those TP, split NS or the expert reshard step) from "
        "Newton-Schulz to the commit, one more momentum in 'step extra', and the commit moves "
        "~8 B per fp32 value less (in 'step ms'); not with --momentum-dtype int8 or --offload",
    )
    ap.add_argument(
        "--host-link-gbps",
        type=_positive("the pinned host-to-device copy rate in GB/s"),
        metavar="R",
        help=f"with --offload: the host-to-device copy rate in GB/s (default {HOST_LINK_GBPS:g}, "
        "pinned memory over PCIe 5.0 x16; PCIe 4.0: about half)",
    )
    ap.add_argument("--eager", action="store_true", help="size the eager step's working set")
    ap.add_argument(
        "--no-reshard",
        action="store_true",
        help="reshard_after_forward=False (one unshard; the default with --pp, as torchtitan)",
    )
    ap.add_argument("--rates", help="JSON file of your device's NS rates (ns_rates.NSRates.load)")
    ap.add_argument(
        "--stack-gib",
        type=_gib("the NS stack budget (NewtonSchulz(stack_bytes=...), which refuses 0 bytes)"),
        help="NewtonSchulz(stack_bytes=...) in GiB, > 0 (default 4)",
    )
    ap.add_argument(
        "--gpu-mem-gib",
        type=_gib("one GPU's memory"),
        metavar="G",
        help="one GPU's memory in GiB, to check the peak against (default: the rates' card, "
        "an H200's 140.4 GiB; an 80 GB H100: 79.6)",
    )
    ap.add_argument("--top", type=int, default=5, help="busiest ranks shown (default 5)")
    ap.add_argument("--per-rank", action="store_true", help="print every rank's row")
    ap.add_argument("--json", action="store_true", help="print JSON (every rank) instead")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.model is None) == (args.config is None):
        ap.error("pass one of --model (a preset or package.module:function) or --config")
    spec = args.config if args.config is not None else args.model
    if args.config is not None and not args.config.endswith(".json"):
        ap.error(f"--config {args.config}: expected a .json file of ModelConfig fields")
    try:
        rates = NSRates.load(args.rates) if args.rates else H200
        name, model = build_model(spec)
    except (ValueError, OSError, KeyError) as e:
        ap.error(str(e))
    reports = []
    for gpus in args.gpus:
        try:
            report = dry_run(
                model,
                gpus,
                replicate_size=args.hsdp,
                tp_size=args.tp,
                split_size=args.split_size,
                param_dtype=_DTYPES.get(args.param_dtype),
                reduce_dtype=_DTYPES.get(args.reduce_dtype),
                momentum_dtype=args.momentum_dtype,
                offload=args.offload,
                host_link_gbps=args.host_link_gbps,
                momentum_in_flight=args.momentum_in_flight,
                keep_new_momentum=args.keep_new_momentum,
                reshard_after_forward=False if args.no_reshard else None,
                compiled=not args.eager,
                rates=rates,
                stack_bytes=None if args.stack_gib is None else int(args.stack_gib * GiB),
                ep=args.ep,
                expert_shard_dim=args.expert_shard_dim,
                expert_ns=args.expert_ns,
                per_head=args.per_head,
                pp=args.pp,
                stages_per_rank=args.stages_per_rank,
                pp_first_stage_less_layers=args.pp_first_less_layers,
                pp_last_stage_less_layers=args.pp_last_less_layers,
                gpu_memory_gib=args.gpu_mem_gib,
            )
        except (ValueError, NotImplementedError) as e:
            ap.error(str(e))
        report.model = name
        reports.append(report)
        if not args.json:
            print(report.table(per_rank=args.per_rank or None, top=args.top), flush=True)
            print(flush=True)
    if args.json:
        json.dump([r.to_dict() for r in reports], sys.stdout, default=str)
        print()
    return 0
