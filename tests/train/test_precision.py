"""The demo's bf16 mixed precision, per-block compile and GPU preset, on CPU.

bf16 is chosen explicitly here (on CPU the default is fp32): one process computes under
``torch.autocast``, two processes through FSDP2's ``MixedPrecisionPolicy`` and
``dmuon.ParamPolicy`` (a mismatch between those two would raise at the first forward). The
compiled run uses the ``aot_eager`` backend: it traces the blocks as Inductor would see them,
without a C++ build per graph on a 2-core CI machine.
"""

import json

import pytest
import torch
from test_run import TINY, _torchrun  # tests/train is on sys.path (rootdir-less modules)

from dmuon_compile.train import cli, runtime

SHORT = [*TINY, "--steps", "8", "--eval-every", "8"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_defaults_bf16_and_compiled_on_cuda_fp32_and_eager_on_cpu():
    args, _ = cli.parse_args([])
    cuda = cli.config_from_args(args, torch.device("cuda", 0))
    cpu = cli.config_from_args(args, torch.device("cpu"))
    assert (cuda.precision, cuda.compile_model) == ("bf16", True)
    assert (cpu.precision, cpu.compile_model) == ("fp32", False)
    args, _ = cli.parse_args(["--precision", "fp32", "--no-compile-model"])
    cuda = cli.config_from_args(args, torch.device("cuda", 0))
    assert (cuda.precision, cuda.compile_model) == ("fp32", False)


def test_gpu_preset_sizes_and_explicit_flags_win():
    args, _ = cli.parse_args(["--preset", "gpu", "--steps", "5"])
    assert (args.d_model, args.layers, args.heads, args.seq_len) == (768, 12, 12, 1024)
    assert args.steps == 5  # given on the command line: wins over the preset's 600
    plain, _ = cli.parse_args([])
    assert (plain.d_model, plain.steps) == (128, 600)  # cpu preset: TrainConfig's defaults


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    return cli.main([*SHORT, "--optimizer", "both", "--precision", "bf16", "--out-dir", str(out)])


def test_one_process_bf16_computes_in_bf16(one_process_bf16):
    assert one_process_bf16["config"]["precision"] == "bf16"
    for run in one_process_bf16["runs"]:
        assert run["compute_dtype"] == "bfloat16", run
        assert run["final_val_loss"] < run["first_val_loss"] - 0.3


def test_compiled_blocks_train_like_eager(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(runtime, "COMPILE_BACKEND", "aot_eager")
    compiled_blocks = []
    real = runtime.compile_blocks

    def spy(model):
        real(model)
        compiled_blocks.extend(b._compiled_call_impl is not None for b in model.blocks)

    monkeypatch.setattr(runtime, "compile_blocks", spy)
    args = [*TINY, "--steps", "4", "--eval-every", "4", "--log-every", "2", "--optimizer", "dmuon"]
    eager = cli.main([*args, "--out-dir", str(tmp_path / "eager")])
    assert compiled_blocks == []  # control: CPU default is eager
    assert eager["runs"][0]["compute_dtype"] == "float32"  # and fp32: nothing cast
    torch._dynamo.reset()
    counters.clear()
    compiled = cli.main([*args, "--compile-model", "--out-dir", str(tmp_path / "compiled")])
    assert compiled_blocks == [True, True] and compiled["config"]["compile_model"]
    assert counters["stats"]["unique_graphs"] >= 1
    for key in ("first_val_loss", "final_val_loss", "final_train_loss"):
        assert compiled["runs"][0][key] == pytest.approx(eager["runs"][0][key], rel=1e-5)


@pytest.mark.distributed
def test_two_processes_bf16_fsdp2_and_dedicated_weights(tmp_path, one_process_bf16):
    """dedicate_params + FSDP2 and FSDP2 alone in bf16 (MixedPrecisionPolicy + ParamPolicy):
    both compute in bf16 and reach the one-process bf16 (autocast) losses."""
    argv = [*SHORT, "--optimizer", "both", "--precision", "bf16", "--out-dir", str(tmp_path)]
    assert "bf16, eager" in _torchrun(argv)
    runs = {r["optimizer"]: r for r in json.loads((tmp_path / "summary.json").read_text())["runs"]}
    for r in one_process_bf16["runs"]:
        two = runs[r["optimizer"]]
        assert two["compute_dtype"] == "bfloat16", two
        assert two["mode"] in ("dedicate_params + FSDP2", "FSDP2")
        # bf16 rounds differently under FSDP2 (weights cast once) and autocast (per op)
        assert two["final_val_loss"] == pytest.approx(r["final_val_loss"], rel=2e-2)


@pytest.mark.gpu
def test_gpu_preset_short_run(tmp_path):
    """The GPU preset, cut to 40 steps: bf16 by default, compiled blocks, an MFU against the
    H100/H200 peak (or n/a on other GPUs), and learning for both optimizers."""
    argv = ["--preset", "gpu", "--optimizer", "both", "--steps", "40", "--eval-every", "20"]
    summary = cli.main([*argv, "--corpus-mb", "8", "--no-progress", "--out-dir", str(tmp_path)])
    assert summary["config"]["precision"] == "bf16" and summary["config"]["compile_model"]
    for run in summary["runs"]:
        assert run["compute_dtype"] == "bfloat16" and run["tokens_per_s"] > 0
        assert run["final_val_loss"] < run["first_val_loss"] - 1.0, run
        if summary["peak_flops"] is not None:
            assert 0 < run["mfu"] < 1, run
