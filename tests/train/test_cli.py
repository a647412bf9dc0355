"""Bad arguments get argparse errors (exit status 2) that name the fix."""

import argparse

import pytest
import torch

from dmuon_compile.train import cli


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--steps", "0"], "--steps must be > 0"),
        (["--seq-len", "-4"], "--seq-len must be > 0"),
        (["--batch-size", "0"], "--batch-size must be > 0"),
        (["--layers", "0"], "--layers must be > 0"),
        (
            ["--d-model", "130", "--heads", "4"],
            "--d-model 130 is not divisible by --heads 4; use e.g. --d-model 128",
        ),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--adamw-lr=-1e-3"], "--adamw-lr must be a finite number > 0"),
        (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["--corpus-dir", "/definitely/not/here"], "is not a directory"),
        (
            ["--corpus-mb", "0.001", "--seq-len", "128"],
            "use a smaller --seq-len or a larger --corpus-mb",
        ),
    ],
)
def test_bad_arguments(capsys, argv, needle):
    assert needle in _error(capsys, argv)


def test_world_size_must_divide_batch(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _error(capsys, ["--batch-size", "7"])
    assert "--batch-size 7 is not divisible by the world size 2" in err and "--batch-size 6" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_gpu(capsys):
    assert "no CUDA GPU" in _error(capsys, ["--device", "cuda"])


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--optimizer",
        "--steps",
        "--batch-size",
        "--seq-len",
        "--d-model",
        "--layers",
        "--lr",
        "--adamw-lr",
        "--seed",
        "--out-dir",
        "--device",
        "--tp",
    ):
        assert flag in out


def _option_helps(parser, formatter_class) -> dict[str, str]:
    """Each option's help as printed (before line wrapping), by its flag."""
    formatter = formatter_class(parser.prog)
    return {
        action.option_strings[-1]: formatter._get_help_string(action) % vars(action)
        for action in parser._actions
        if action.help
    }


def test_help_states_each_default_once():
    helps = _option_helps(cli.build_parser(), cli._HelpFormatter)
    for flag, text in helps.items():
        assert text.count("default") <= 1, (flag, text)
        assert "(default: None)" not in text and "(default: False)" not in text, (flag, text)
    assert helps["--steps"].endswith("(default: 600)")
    assert helps["--seed"].endswith("(default: 0)")  # 0 is a value, shown
    assert helps["--save-every"].endswith("(default 0: never)")
    assert helps["--out-dir"].endswith("(default ./runs/<timestamp>)")
    assert helps["--lr"].startswith("Muon learning rate for the *_proj matrices (default: 0.005,")


def test_plain_defaults_formatter_repeats_defaults():
    """Control: argparse's own formatter does produce what the test above rules out."""
    helps = _option_helps(cli.build_parser(), argparse.ArgumentDefaultsHelpFormatter)
    assert helps["--out-dir"].endswith(") (default: None)")
    assert helps["--save-every"].count("default") == 2
    assert helps["--no-progress"].endswith("(default: False)")


@pytest.mark.parametrize(
    "world, argv, needle",
    [
        ("2", ["--tp", "3"], "--tp 3 does not divide the 2 process(es)"),
        ("1", ["--tp", "2"], "start a multiple of 2 processes (torchrun --nproc_per_node 2)"),
        ("2", ["--tp", "0"], "--tp must be >= 1"),
        ("2", ["--tp", "2", "--d-model", "48", "--heads", "3"], "--heads (3) must be a multiple"),
        ("2", ["--tp", "2", "--no-dedicate"], "--no-dedicate has no TP version"),
        ("4", ["--tp", "2", "--batch-size", "5"], "not divisible by dp = processes/--tp = 2"),
    ],
)
def test_bad_tp_arguments(capsys, monkeypatch, world, argv, needle):
    monkeypatch.setenv("WORLD_SIZE", world)
    assert needle in _error(capsys, argv)


def test_tp_batch_splits_over_dp_only(capsys, monkeypatch):
    """Control for the batch rule: with --tp 2 on 2 processes (dp 1) an odd batch is valid."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = cli.build_parser()
    cli.validate(parser.parse_args(["--tp", "2", "--batch-size", "7"]), parser, 2)
    assert "not divisible" in _error(capsys, ["--batch-size", "7"])  # without --tp it is not


@pytest.mark.parametrize(
    "flag,dtype",
    [(None, None), ("fp32", None), ("bf16", torch.bfloat16), ("int8", torch.int8)],
)
@pytest.mark.parametrize("offload", [None, "momentum"])
def test_momentum_dtype_and_offload_reach_the_optimizer(flag, dtype, offload):
    from dmuon_compile.train.loop import build_optimizer

    argv = [] if flag is None else ["--momentum-dtype", flag]
    argv += [] if offload is None else ["--offload", offload]
    args, _ = cli.parse_args(argv)
    cfg = cli.config_from_args(args, torch.device("cpu"))
    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(4, 4, bias=False)  # a *_proj name: the demo's Muon matrices
    opt = build_optimizer("dmuon", model, cfg, torch.device("cpu"))
    assert opt.momentum_dtype is dtype and opt.offload == offload


def test_keep_new_momentum_reaches_the_optimizer_and_its_conflict_is_refused():
    from dmuon_compile.train.loop import build_optimizer

    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(4, 4, bias=False)
    for argv, want in (([], False), (["--keep-new-momentum"], True)):
        args, _ = cli.parse_args(argv)
        cfg = cli.config_from_args(args, torch.device("cpu"))
        assert build_optimizer("dmuon", model, cfg, torch.device("cpu")).keep_new_momentum is want
    args, _ = cli.parse_args(["--keep-new-momentum", "--momentum-dtype", "int8"])
    cfg = cli.config_from_args(args, torch.device("cpu"))
    with pytest.raises(ValueError, match="keep_new_momentum"):
        build_optimizer("dmuon", model, cfg, torch.device("cpu"))


def test_an_unknown_momentum_dtype_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--momentum-dtype", "fp8"])
    assert "--momentum-dtype" in capsys.readouterr().err


def test_offload_state_asks_for_bf16_compute(capsys, monkeypatch):
    """``--offload state`` keeps bf16 compute copies on the device: fp32 (the CPU's default
    precision), --tp or --no-dedicate are refused naming the fix; with --precision bf16 it
    passes (control)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "add --precision bf16" in _error(capsys, ["--offload", "state", "--device", "cpu"])
    tp = ["--offload", "state", "--precision", "bf16", "--tp", "2"]
    assert "not with --tp" in _error(capsys, tp)
    parser = cli.build_parser()
    ok = parser.parse_args(["--offload", "state", "--precision", "bf16"])
    cli.validate(ok, parser, 2)
