"""benchmarks/bench_fsdp.py --tp: argument checks, and one tiny 2-process gloo run (dp 1 × tp 2)
that finishes with its table, the TP stage's counters and the 1-D configurations beside it."""

from __future__ import annotations

import json

import pytest
from bench_scripts import BENCHMARKS, load_benchmark  # tests/ is on sys.path
from native_crash import run_torchrun  # tests/ is on sys.path

_PATH = BENCHMARKS / "bench_fsdp.py"
bench = load_benchmark("bench_fsdp")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(tp=3, world=2, model="S"), "--tp 3: must divide the world size 2"),
        (dict(tp=0, world=2, model="S"), "use one of [1, 2]"),
        (dict(tp=2, world=2, model="S", replicate=2), "drop --replicate/--hsdp"),
        (dict(tp=2, world=2, model="S", hsdp=True), "drop --replicate/--hsdp"),
        (dict(tp=8, world=8, model="quick"), "attention heads of model quick (4) do not split"),
        (dict(tp=8, world=8, model="G"), "k/v heads of model G (4) do not split over 8"),
    ],
)
def test_check_tp_names_the_fix(kwargs, needle):
    with pytest.raises(SystemExit) as exc:
        bench.check_tp(**kwargs)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    "tp, world, model",
    [(None, 2, "S"), (1, 2, "S"), (2, 2, "S"), (2, 4, "M"), (4, 4, "quick"), (4, 4, "G")],
)
def test_check_tp_accepts(tp, world, model):
    bench.check_tp(tp, world, model)  # no exception: each model's heads and FFN split over tp


def test_tp_plan_covers_every_projection():
    plan = bench.tp_owners(2)
    names = {n.split(".")[-1] for n in plan}
    assert len(plan) == 14 and names == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert type(plan["layers.1.o_proj"]).__name__ == "RowwiseParallel"
    assert type(plan["layers.0.up_proj"]).__name__ == "ColwiseParallel"


def _bench(args, timeout=150):
    env = {"DMUON_RECORD_FORWARD_PROFILE": "1"}
    argv = [str(_PATH), "--quick", "--device", "cpu", *args]
    return run_torchrun(argv, 2, timeout=timeout, env=env)


@pytest.mark.distributed
def test_bench_tp2_on_two_processes(tmp_path):
    out = tmp_path / "tp2.json"
    proc = _bench(
        [
            "--tp",
            "2",
            "--configs",
            "adamw,ours_eager",
            "--with-1d",
            "adamw",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "mesh: dp 1 × tp 2" in proc.stdout
    for config in ("adamw", "ours_eager", "ours_eager_sync", "1d_adamw"):
        assert f"| {config} |" in proc.stdout, config
    assert "TP 2, ours_eager: Muon tax / NS floor" in proc.stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"dp": 1, "tp": 2} and report["errors"] == {}
    res = report["results"]
    assert res["1d_adamw"]["tax_against"] == "1d_adamw" and res["1d_adamw"]["muon_tax"] == 0
    assert res["ours_eager"]["tax_against"] == "adamw"
    # NS once per matrix across the TP group: rank 0 runs half of the 2 layers' 14 matrices.
    assert res["ours_eager"]["tp_owners"]["ns_matrices_here"] == 7
    assert res["ours_eager"]["tp_owners"]["gather_bytes_per_step"] > 0
    # Async: forwards applied pending scatters; the sync control applied them inside step().
    assert res["ours_eager"]["tp_owners"]["replicate_async"] is True
    assert res["ours_eager_sync"]["tp_owners"]["replicate_async"] is False
    assert res["ours_eager"]["tp_profile"]["waits"] > 0
    assert res["ours_eager_sync"]["tp_profile"]["waits"] == 0
    assert res["ours_eager"]["tp_profile"]["scatters"] > 0


@pytest.mark.distributed
def test_bench_tp_that_does_not_divide_the_world_exits_cleanly():
    proc = _bench(["--tp", "3", "--configs", "adamw"], timeout=90)
    assert proc.returncode != 0
    assert "--tp 3: must divide the world size 2" in proc.stderr + proc.stdout
