"""benchmarks/loss_parity.py and benchmarks/plot_scaling.py on hand-written inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given
from hypothesis import strategies as st

parity = load_benchmark("loss_parity")
scaling = load_benchmark("plot_scaling")


def _log(path: Path, losses: dict[int, float | None]) -> Path:
    lines = ["step,optimizer,train_loss,val_loss"]
    for step, loss in losses.items():
        lines.append(f"{step},dmuon,{'' if loss is None else loss},")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parity_passes_within_tolerance_and_fails_beyond(tmp_path, capsys):
    ref = _log(tmp_path / "ref.csv", {0: None, 1: 5.0, 2: 4.0, 3: 3.0})
    near = _log(tmp_path / "near.csv", {0: None, 1: 5.0, 2: 4.02, 3: 3.0})
    far = _log(tmp_path / "far.csv", {0: None, 1: 5.0, 2: 4.4, 3: 3.0})
    assert parity.main([str(ref), str(near), "--rtol", "1e-2"]) == 0
    assert "PARITY ok" in capsys.readouterr().out
    assert parity.main([str(ref), str(far), "--rtol", "1e-2"]) == 1
    out = capsys.readouterr().out
    assert "PARITY FAILED" in out and "1.00e-01" in out


def test_parity_fails_when_steps_differ_or_loss_is_nan(tmp_path, capsys):
    ref = _log(tmp_path / "ref.csv", {1: 5.0, 2: 4.0, 3: 3.0})
    short = _log(tmp_path / "short.csv", {1: 5.0, 2: 4.0})
    nan = _log(tmp_path / "nan.csv", {1: 5.0, 2: float("nan"), 3: 3.0})
    assert parity.main([str(ref), str(short)]) == 1
    assert "steps in one log only: [3]" in capsys.readouterr().out
    assert parity.main([str(ref), str(nan)]) == 1


def test_parity_rejects_a_file_that_is_not_a_demo_log(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    ref = _log(tmp_path / "ref.csv", {1: 5.0})
    assert parity.main([str(ref), str(bad)]) == 2
    assert "not a training-demo log.csv" in capsys.readouterr().err


@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=20), st.floats(-0.05, 0.05))
def test_parity_relative_difference_property(losses, scale):
    reference = dict(enumerate(losses))
    other = {s: v * (1 + scale) for s, v in reference.items()}
    rows, unmatched = parity.compare(reference, other)
    assert unmatched == [] and len(rows) == len(losses)
    assert max(r[3] for r in rows) == pytest.approx(abs(scale), rel=1e-6, abs=1e-12)


def _report(world: int, replicate: int | None = None, model: str = "M") -> dict:
    mesh = {"replicate": replicate, "shard": world // replicate} if replicate else {"shard": world}
    return {
        "model": model,
        "world_size": world,
        "mesh": mesh,
        "tokens_per_rank": 8192,
        "results": {
            "adamw": {
                "iter_ms": 100.0,
                "back_to_back_ms": 98.0,
                "b2b_muon_tax": 0.0,
                "step_balance": 1.01,
                "peak_mem_gib": 10.0,
            },
            "ours_compiled": {
                "iter_ms": 120.0 / world,
                "back_to_back_ms": 118.0 / world,
                "b2b_muon_tax": 0.2,
                "step_balance": 1.04,
                "planned_balance": {"ns_max_over_mean": 1.02},
                "peak_mem_gib": 12.5,
            },
        },
    }


def test_scaling_table_and_series(tmp_path, capsys):
    paths = []
    for world, rep in ((8, 2), (1, None), (4, None)):
        path = tmp_path / f"r{world}.json"
        path.write_text(json.dumps(_report(world, rep)))
        paths.append(str(path))
    out = tmp_path / "t.md"
    assert scaling.main(paths + ["--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    body = [line for line in lines[2:]]
    assert [line.split(" | ")[0] for line in body] == ["| 1", "| 1", "| 4", "| 4", "| 8", "| 8"]
    assert (
        "| 8 | HSDP 2×4 | ours_compiled | 15.00 | 14.75 | +20.0% | 1.040 | 1.020 | 12.50 |" in lines
    )
    lines_by_kind = scaling.series(scaling.load([Path(p) for p in paths]))
    assert lines_by_kind["ours_compiled (1-D)"] == [(1, 118.0), (4, 29.5)]
    assert lines_by_kind["ours_compiled (HSDP)"] == [(8, 14.75)]
    assert not math.isnan(sum(ms for _, ms in lines_by_kind["adamw (1-D)"]))


def test_scaling_refuses_mixed_models_and_foreign_files(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(2, model="S")))
    b.write_text(json.dumps(_report(4, model="M")))
    assert scaling.main([str(a), str(b)]) == 2
    assert "several models" in capsys.readouterr().err
    b.write_text(json.dumps({"hello": 1}))
    assert scaling.main([str(b)]) == 2
    assert "not a bench_fsdp.py report" in capsys.readouterr().err


def test_where_the_time_goes_lists_gpu_kernels_per_call():
    """bench_kernels.py --profile-ns and bench_step.py --profile: per-call ms and launches of the
    top kernels (trace_analysis.profile_calls result), and a clear line when there were no GPU
    events."""
    ta = load_benchmark("trace_analysis")
    profile = {
        "steps": 3,
        "gpu_events": 48,
        "gpu_ms_per_step": 4.0,
        "breakdown_ms_per_step": {"gemm": 1.0, "triton": 3.0, "nccl": 0.0},
        "top_kernels": [
            {
                "name": "_symmetric_product_tma_kernel",
                "category": "triton",
                "count_per_step": 14.0,
                "ms_per_step": 3.0,
            },
            {
                "name": "nvjet_sm90_gemm",
                "category": "gemm",
                "count_per_step": 2.0,
                "ms_per_step": 1.0,
            },
        ],
    }
    lines = ta.where_the_time_goes(profile, top=8, unit="call")
    assert (
        lines[0] == "  where the time goes (GPU ms/call, 4.000 in all): gemm 1.000 | triton 3.000"
    )
    assert (
        "3.000 ms" in lines[1] and "14×" in lines[1] and "_symmetric_product_tma_kernel" in lines[1]
    )
    assert "nvjet_sm90_gemm" in lines[2] and len(lines) == 3


def test_profile_calls_on_cpu_reports_no_gpu_events():
    import torch

    ta = load_benchmark("trace_analysis")
    x = torch.randn(32, 32)
    found = ta.profile_calls(lambda: x @ x, 2, x.device)
    assert found["steps"] == 2 and found["gpu_events"] == 0
    assert ta.where_the_time_goes(found, unit="call") == [
        "  where the time goes: no GPU events in 2 profiled calls (CPU run)"
    ]


def test_parity_of_a_two_optimizer_log_needs_optimizer(tmp_path, capsys):
    both = tmp_path / "both.csv"
    both.write_text(
        "step,optimizer,train_loss,val_loss\n1,dmuon,5.0,\n2,dmuon,4.0,\n1,adamw,6.0,\n2,adamw,5.5,\n"
    )
    ref = _log(tmp_path / "ref.csv", {1: 5.0, 2: 4.0})
    # Without --optimizer the adamw rows would replace the dmuon ones step by step: refused.
    assert parity.main([str(ref), str(both)]) == 2
    assert "pick one with --optimizer" in capsys.readouterr().err
    assert parity.main([str(ref), str(both), "--optimizer", "dmuon"]) == 0
    assert parity.main([str(ref), str(both), "--optimizer", "adamw"]) == 2  # ref has no adamw
    assert "no rows of optimizer 'adamw'" in capsys.readouterr().err
