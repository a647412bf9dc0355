"""Command line of the training demo: ``python -m dmuon_compile.train`` (or under ``torchrun``).

Examples::

    python -m dmuon_compile.train                                  # one process, Muon
    torchrun --nproc_per_node 2 -m dmuon_compile.train             # 2 ranks, gloo/CPU or NCCL/GPU
    torchrun --nproc_per_node 2 -m dmuon_compile.train --tp 2      # tensor parallel over the 2
    python -m dmuon_compile.train --optimizer both --steps 200     # Muon vs AdamW, same data/init
    python -m dmuon_compile.train --preset gpu --optimizer both    # one GPU, bf16, compiled
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from dmuon_compile.train import checkpointing, runtime
from dmuon_compile.train.data import DEFAULT_VAL_FRACTION, load_corpus
from dmuon_compile.train.loop import OPTIMIZERS, TrainConfig, model_sizes, train_one
from dmuon_compile.train.metrics import CsvLog, mfu, peak_flops, plot_losses
from dmuon_compile.train.model import GPTConfig

DEFAULTS = TrainConfig()
# Sizes by preset; flags given on the command line override them. "cpu" is TrainConfig's
# defaults (a few minutes on 2 CPU cores). "gpu" is GPT-2-small-like (12 × 768, 85M matmul
# parameters, 1024-byte windows) for one H200 in bf16 with compiled blocks: --optimizer both
# trains Muon and AdamW in a few minutes, compilation included.
PRESETS = {
    "cpu": {},
    "gpu": {
        "d_model": 768,
        "layers": 12,
        "heads": 12,
        "seq_len": 1024,
        "batch_size": 32,
        "steps": 600,
        "eval_every": 100,
        "eval_batches": 8,
        "log_every": 20,
        "adamw_lr": 1e-3,
        "corpus_mb": 64.0,
    },
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where it says something: not for flags (``False``), unset
    options (``None``) or help that already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dmuon_compile.train",
        description=(
            "Train a small byte-level GPT on the Python standard library's source files with "
            "dmuon's Muon (dedicate_params + FSDP2 under torchrun) and/or AdamW. "
            "Run under torchrun for several processes; gloo/CPU or NCCL/GPU is picked "
            "automatically."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--optimizer",
        choices=(*OPTIMIZERS, "both"),
        default="dmuon",
        help="both: dmuon then adamw, same data, seed and initial weights",
    )
    p.add_argument("--steps", type=int, default=DEFAULTS.steps, help="optimizer steps per run")
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS.batch_size,
        help="global batch (sequences per step), split evenly across processes",
    )
    p.add_argument(
        "--seq-len", type=int, default=DEFAULTS.seq_len, help="tokens (bytes) per sequence"
    )
    p.add_argument("--d-model", type=int, default=DEFAULTS.d_model, help="model width")
    p.add_argument("--layers", type=int, default=DEFAULTS.layers, help="transformer blocks")
    p.add_argument(
        "--heads", type=int, default=DEFAULTS.heads, help="attention heads (must divide --d-model)"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=DEFAULTS.lr,
        help="Muon learning rate for the *_proj matrices (default: %(default)s, tuned for this "
        "small model; 0.02 is the package's general starting point)",
    )
    p.add_argument(
        "--adamw-lr",
        type=float,
        default=DEFAULTS.adamw_lr,
        help="AdamW learning rate (the adamw run, and dmuon's embeddings/head/norms)",
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULTS.seed, help="seed of the weights and the data order"
    )
    p.add_argument(
        "--eval-every", type=int, default=DEFAULTS.eval_every, help="validate every N steps"
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=DEFAULTS.eval_batches,
        help="global batches of held-out windows per validation",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=DEFAULTS.log_every,
        help="CSV row / progress update every N steps",
    )
    p.add_argument("--corpus-mb", type=float, default=8.0, help="cap on the corpus size read (MB)")
    p.add_argument(
        "--corpus-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory of .py files to train on (default: this Python's standard library)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where log.csv and loss.png go (default ./runs/<timestamp>)",
    )
    p.add_argument(
        "--device",
        choices=runtime.DEVICES,
        default="auto",
        help="auto: CUDA when available, else CPU",
    )
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="cpu",
        help="model and run size: cpu (the defaults shown here), gpu (12 layers × 768, "
        "1024-byte windows, batch 32, 600 steps, AdamW lr 1e-3, 64 MB of corpus: Muon "
        "against AdamW on one H200 in a few minutes with --optimizer both); flags given "
        "explicitly win",
    )
    p.add_argument(
        "--precision",
        choices=runtime.PRECISIONS,
        default="auto",
        help="auto: bf16 on CUDA, fp32 on CPU. bf16: FSDP2 MixedPrecisionPolicy(param_dtype="
        "bf16, reduce_dtype=fp32) and dmuon.ParamPolicy for the dedicated weights (torch."
        "autocast in one process); weights and optimizer state stay fp32",
    )
    p.add_argument(
        "--momentum-dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="the Muon momentum's storage dtype (dmuon.Muon(momentum_dtype=...)): bf16 halves its "
        "memory (the momentum update is computed in fp32 and rounded once where stored); int8 "
        "is blockwise 8-bit (a quarter of fp32's memory, stochastic rounding)",
    )
    p.add_argument(
        "--offload",
        choices=("momentum", "state"),
        default=None,
        help="dmuon.Muon(offload=...): keep the Muon momentum ('momentum'), and with 'state' "
        "the dedicated weights' fp32 masters too, in host memory between steps (copied in for "
        "each step, written back behind it; the same math bit for bit)",
    )
    p.add_argument(
        "--keep-new-momentum",
        action="store_true",
        help="dmuon.Muon(keep_new_momentum=True): the new momentum kept from the Newton-Schulz "
        "input to the commit and swapped in (fewer bytes per step, one more momentum's memory "
        "during it; the same math bit for bit; not with --momentum-dtype int8 or --offload)",
    )
    p.add_argument(
        "--compile-model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each transformer block (default: on for CUDA, off on CPU)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="F",
        help="peak TFLOP/s of one device for the MFU in the summary (default: known for "
        "H100/H200: 989 bf16, 67 fp32; MFU n/a otherwise and on CPU)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress lines (summary only)")
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="write a DCP checkpoint (model + optimizer + LR schedule) every N steps and "
        "after the last one, under <out-dir>/checkpoints/step-N (default 0: never)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue from a checkpoint: a step-N directory, or a run/checkpoints directory "
        "(its newest step); any number of processes. The CSV log of that run continues",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor parallel over T processes (T must divide them): mesh (processes/T, T) "
        "named (dp, tp), attention and MLP projections column-/row-parallel (parallelize_module),"
        " then dedicate_params and FSDP2 over dp; the ranks of a TP group share a batch slice",
    )
    p.add_argument(
        "--no-dedicate",
        action="store_true",
        help="with several processes, keep the *_proj matrices whole on every rank and "
        "all-reduce their gradients instead of dmuon.dedicate_params (the naive baseline)",
    )
    return p


def parse_args(argv: list[str] | None = None):
    """``(args, parser)``: the command line, with the chosen ``--preset``'s sizes as defaults."""
    parser = build_parser()
    preset = parser.parse_known_args(argv)[0].preset
    parser.set_defaults(**PRESETS[preset])
    return parser.parse_args(argv), parser


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser, world_size: int) -> None:
    """Reject bad arguments with an argparse error that names the fix (exits with status 2)."""
    positive = {
        "--steps": args.steps,
        "--batch-size": args.batch_size,
        "--seq-len": args.seq_len,
        "--d-model": args.d_model,
        "--layers": args.layers,
        "--heads": args.heads,
        "--eval-every": args.eval_every,
        "--eval-batches": args.eval_batches,
        "--log-every": args.log_every,
    }
    for flag, value in positive.items():
        if value <= 0:
            parser.error(f"{flag} must be > 0, got {value}")
    for flag, value in {
        "--lr": args.lr,
        "--adamw-lr": args.adamw_lr,
        "--corpus-mb": args.corpus_mb,
    }.items():
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a finite number > 0, got {value}")
    if args.d_model % args.heads:
        parser.error(
            f"--d-model {args.d_model} is not divisible by --heads {args.heads}; "
            f"use e.g. --d-model {args.heads * max(1, round(args.d_model / args.heads))} "
            "or change --heads"
        )
    if (args.d_model // args.heads) % 2:
        parser.error(f"head size --d-model/--heads = {args.d_model // args.heads} must be even")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if world_size % args.tp:
        parser.error(
            f"--tp {args.tp} does not divide the {world_size} process(es); start a multiple of "
            f"{args.tp} processes (torchrun --nproc_per_node {args.tp}) or change --tp"
        )
    if args.tp > 1:
        hidden = GPTConfig(d_model=args.d_model, heads=args.heads).mlp_hidden
        for what, n in (("--heads", args.heads), ("the MLP width", hidden)):
            if n % args.tp:
                parser.error(f"--tp {args.tp}: {what} ({n}) must be a multiple of {args.tp}")
        if args.no_dedicate:
            parser.error("--no-dedicate has no TP version: drop --tp or --no-dedicate")
    if args.offload == "state":  # Muon refuses it otherwise; say it in the CLI's words
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device != "auto":
            device = torch.device(args.device)
        if runtime.resolve_precision(args.precision, device) != "bf16":
            parser.error(
                "--offload state keeps the fp32 masters in host memory and bf16 compute copies "
                "on the device: add --precision bf16 (or use --offload momentum)"
            )
        if args.tp > 1 or args.no_dedicate:
            parser.error(
                "--offload state moves dedicated weights' masters: not with --tp or "
                "--no-dedicate (use --offload momentum)"
            )
    dp = world_size // args.tp  # data-parallel ranks: the batch splits over these
    if args.batch_size % dp:
        lo = max(dp, args.batch_size // dp * dp)
        what = f"the world size {dp} (processes)" if args.tp == 1 else f"dp = processes/--tp = {dp}"
        parser.error(
            f"--batch-size {args.batch_size} is not divisible by {what}; "
            f"use a multiple of {dp}, e.g. --batch-size {lo}"
        )
    if args.corpus_dir is not None and not args.corpus_dir.is_dir():
        parser.error(f"--corpus-dir {args.corpus_dir} is not a directory")
    if args.save_every < 0:
        parser.error(f"--save-every must be >= 0, got {args.save_every}")
    if (args.save_every or args.resume is not None) and args.optimizer == "both":
        parser.error(
            "--save-every/--resume need one optimizer: pass --optimizer dmuon or --optimizer adamw"
        )
    if args.resume is not None:
        try:
            args.resume = checkpointing.find(args.resume)
        except FileNotFoundError as exc:
            parser.error(str(exc))
        try:
            checkpointing.check_sizes(args.resume, model_sizes(args))
        except checkpointing.ResumeMismatch as exc:
            fail(parser, exc)
    if args.peak_tflops is not None and not (
        math.isfinite(args.peak_tflops) and args.peak_tflops > 0
    ):
        parser.error(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda, but no CUDA GPU is usable here; use --device cpu or --device auto"
        )


def fail(parser: argparse.ArgumentParser, exc: Exception) -> NoReturn:
    """Exit with status 2 and one line naming the problem: the usage text would bury it."""
    parser.exit(2, f"{parser.prog}: error: {exc}\n")


def make_out_dir(out_dir: Path | None) -> Path:
    if out_dir is None:
        out_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def config_from_args(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    """The run's configuration; ``auto`` precision and compile resolved for ``device``."""
    compile_model = args.compile_model
    if compile_model is None:
        compile_model = device.type == "cuda"
    return TrainConfig(
        precision=runtime.resolve_precision(args.precision, device),
        compile_model=compile_model,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        lr=args.lr,
        adamw_lr=args.adamw_lr,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        log_every=args.log_every,
        momentum_dtype=args.momentum_dtype,
        offload=args.offload,
        keep_new_momentum=args.keep_new_momentum,
    )


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, train, write ``log.csv``, ``loss.png`` and ``summary.json``; return the
    summary."""
    args, parser = parse_args(argv)
    validate(args, parser, runtime.env_world_size())
    runtime.set_default_threads(print if runtime.env_rank() == 0 else lambda *_: None)
    if args.resume is not None:
        done = checkpointing.read_meta(args.resume)["step"]
        if done >= args.steps:  # nothing to train: say so instead of an empty run
            if runtime.env_rank() == 0:
                print(
                    f"{args.resume}: the run is already complete (checkpoint at step {done}, "
                    f"--steps {args.steps}); nothing to train. Pass --steps larger than {done} "
                    "to train further."
                )
            return {"already_complete": True, "step": done, "steps": args.steps}
    try:
        corpus = load_corpus(
            max_bytes=int(args.corpus_mb * 1024 * 1024),
            val_fraction=DEFAULT_VAL_FRACTION,
            root=args.corpus_dir,
        )
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if tokens.numel() <= args.seq_len:
            parser.error(
                f"the {split} split has only {tokens.numel()} bytes, "
                f"not more than --seq-len {args.seq_len}; "
                "use a smaller --seq-len or a larger --corpus-mb"
            )

    try:
        env = runtime.setup(args.device, tp=args.tp)
    except ValueError as exc:  # e.g. more processes per node than GPUs
        parser.error(str(exc))
    try:
        return _run(args, config_from_args(args, env.device), corpus, env)
    except checkpointing.ResumeMismatch as exc:  # a checkpoint without sizes: found on load
        fail(parser, exc)
    finally:
        runtime.teardown(env)


def _run(args, cfg: TrainConfig, corpus, env: runtime.DistEnv) -> dict:
    if args.resume is not None and args.out_dir is None:
        args.out_dir = checkpointing.run_dir(args.resume)  # the resumed run's log continues
    out_dir = make_out_dir(args.out_dir) if env.is_main else None
    say = print if env.is_main else (lambda *a, **k: None)
    names = list(OPTIMIZERS) if args.optimizer == "both" else [args.optimizer]
    say(corpus.describe())
    flops_per_token = GPTConfig(
        seq_len=cfg.seq_len, d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads
    ).flops_per_token()
    if args.peak_tflops is not None:
        peak, peak_name = args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    else:
        peak, peak_name = peak_flops(env.device, cfg.precision)
    compiled = "compiled blocks" if cfg.compile_model else "eager"
    say(
        f"run: {env.describe()}, torch {torch.__version__}, optimizers {', '.join(names)}, "
        f"{cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"{cfg.d_model} wide x {cfg.layers} layers, {cfg.precision}, {compiled}"
    )
    resumed_step = None
    if args.resume is not None:
        resumed_step = checkpointing.read_meta(args.resume)["step"]
    log = CsvLog(out_dir / "log.csv" if out_dir is not None else None, keep_until=resumed_step)
    results = []
    for name in names:
        result = train_one(
            name,
            cfg,
            corpus,
            env,
            log,
            show_progress=not args.no_progress,
            dedicate=not args.no_dedicate,
            save_every=args.save_every,
            out_dir=out_dir,
            resume=args.resume,
        )
        results.append(result)
        resumed = f" (resumed at step {resumed_step})" if resumed_step is not None else ""
        result_mfu = mfu(result.tokens_per_s, flops_per_token, env.world_size, peak)
        mfu_text = "n/a" if result_mfu is None else f"{100 * result_mfu:.1f}%"
        say(
            f"{name} [{result.mode}]: validation loss "
            f"{result.first_val:.4f} -> {result.final_val:.4f} "
            f"in {result.wall_s:.1f}s{resumed}; {result.tokens_per_s / 1e3:.1f}k tokens/s, "
            f"MFU {mfu_text} ({flops_per_token / 1e6:.3g} MFLOP/token, peak: {peak_name})"
        )
        result.mfu = result_mfu
    summary = {
        "out_dir": str(out_dir) if out_dir is not None else None,
        "world_size": env.world_size,
        "tp": env.tp,
        "device": str(env.device),
        "config": vars(cfg),
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "peak": peak_name,
        "runs": [
            {
                "optimizer": r.optimizer,
                "mode": r.mode,
                "first_val_loss": r.first_val,
                "final_val_loss": r.final_val,
                "final_train_loss": r.train_losses[-1][1],
                "wall_s": r.wall_s,
                "train_time_s": r.train_time_s,
                "tokens_per_s": r.tokens_per_s,
                "mfu": r.mfu,
                "compute_dtype": r.compute_dtype,
                "ms_per_step": {k: v / max(1, r.timed_steps) for k, v in r.phase_ms.items()},
                "exposed_comm": r.comm_kind,
                "exposed_comm_note": r.comm_note,
                "runtime_comm_profile": r.comm_profile,
            }
            for r in results
        ],
    }
    if env.is_main:
        say("")
        for r in results:
            say(r.breakdown())
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        say(f"log: {out_dir / 'log.csv'}")
        say(plot_losses(out_dir / "log.csv", out_dir / "loss.png"))
        sys.stdout.flush()
    return summary
