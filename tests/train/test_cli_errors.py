"""The demo CLI's weak spots: a resume with other model sizes is one line naming the flag (not
DCP's traceback), and one process without OMP_NUM_THREADS gets a thread count that fits its
cores."""

import json

import pytest
import torch

from dmuon_compile.train import cli, runtime

SMALL = [
    "--batch-size",
    "4",
    "--seq-len",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--corpus-mb",
    "0.2",
    "--no-progress",
    "--device",
    "cpu",
    "--optimizer",
    "dmuon",
]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-step run of width 32 with its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("run")
    cli.main(
        [*SMALL, "--steps", "2", "--d-model", "32", "--save-every", "2", "--out-dir", str(out)]
    )
    return out / "checkpoints" / "step-2"


def _resume_error(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_resume_with_another_width_is_one_line_naming_the_flag(checkpoint, capsys):
    err = _resume_error(
        capsys, [*SMALL, "--steps", "4", "--d-model", "64", "--resume", str(checkpoint)]
    )
    assert "written with --d-model 32" in err and "this run has --d-model 64" in err, err


def test_a_checkpoint_without_sizes_is_checked_by_its_shapes(checkpoint, tmp_path, capsys):
    """Checkpoints written before meta.json recorded the sizes: read off the tensors' shapes,
    before DCP loads anything."""
    import shutil

    old = tmp_path / "step-2"
    shutil.copytree(checkpoint, old)
    meta = json.loads((old / "meta.json").read_text())
    meta.pop("model", None)
    (old / "meta.json").write_text(json.dumps(meta))
    for flag, value, theirs in (
        ("--d-model", "64", "--d-model 32"),
        ("--layers", "2", "--layers 1"),
    ):
        argv = [*SMALL, "--steps", "4", "--d-model", "32", flag, value, "--resume", str(old)]
        err = _resume_error(capsys, argv)
        assert f"written with {theirs}" in err, err


@pytest.mark.parametrize(
    "environ, cores, current, expected",
    [
        ({}, 2, 16, 2),  # one process, a 2-core container that shows 16 cores
        ({"LOCAL_WORLD_SIZE": "2"}, 8, 8, 4),  # cores // local processes
        ({}, 4, 4, None),  # torch's count fits: left alone
        ({"OMP_NUM_THREADS": "16"}, 2, 16, None),  # the user chose
        ({"LOCAL_WORLD_SIZE": "4"}, 2, 2, 1),
    ],
)
def test_thread_choice(environ, cores, current, expected):
    threads, why = runtime.choose_threads(environ, cores=cores, current=current)
    assert threads == expected
    assert (f"using {expected}" in why) if expected else why == ""


def test_the_cli_sets_threads_when_omp_is_unset(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "available_cores", lambda: 1)
    monkeypatch.setattr(cli, "_run", lambda *a: {"ran": True})  # the choice, not the training
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cli.main([*SMALL, "--steps", "1", "--d-model", "32"]) == {"ran": True}
        assert torch.get_num_threads() == 1
        lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("threads:")]
        assert len(lines) == 1 and "OMP_NUM_THREADS is unset" in lines[0], lines
        # With OMP_NUM_THREADS set, the user's choice stands.
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        cli.main([*SMALL, "--steps", "1", "--d-model", "32"])
        assert torch.get_num_threads() == 2
        assert "threads:" not in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
