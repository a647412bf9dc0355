"""The dry run (``python -m dmuon_compile.plan``): runs on presets at thousands of ranks in
seconds, runs ``dedicate_params``' own planning, its bytes add up, HSDP/TP/split variants, its
errors name the fix, and the NS rates reproduce the measurements they come from. No processes
(tests/distributed/test_dry_run_dist.py compares it with a real multi-rank run)."""

from __future__ import annotations

import json
import time

import pytest
from torch import nn

from dmuon_compile import ns_rates
from dmuon_compile.distributed.dedicate import plan_dedicated
from dmuon_compile.distributed.owner_plan import MatrixSpec, plan_owners
from dmuon_compile.layouts import Layout
from dmuon_compile.plan import PRESETS, build_model, dry_run, main

GPUS = (8, 64, 512, 4096)


@pytest.fixture(scope="module")
def llama70b():
    return build_model("llama3-70b")[1]


def _muon_bytes(model, report) -> int:
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n in report.owners
    )


def test_the_cli_predicts_llama3_70b_at_four_sizes_in_seconds(capsys):
    t0 = time.perf_counter()
    assert main(["--model", "llama3-70b", "--gpus", *map(str, GPUS), "--top", "2"]) == 0
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    for gpus in GPUS:
        assert f"llama3-70b on {gpus} GPUs" in out
    for column in ("dedicated GiB", "AdamW GiB", "peak GiB", "NS ms", "step ms", "comm GiB/step"):
        assert out.count(column) >= len(GPUS), column
    assert "idle ranks (no NS work): 3536 of 4096" in out  # 560 matrices, one per rank
    assert "split matrices: none" in out
    assert elapsed < 120, f"the dry run took {elapsed:.1f} s (a shared CPU; ~2 s alone)"


def test_owners_are_plan_owners_on_the_same_specs(llama70b):
    report = dry_run(llama70b, 64)
    specs = [
        MatrixSpec(n, tuple(p.shape), p.element_size(), Layout.matrix())
        for n, p in llama70b.named_parameters()
        if n in report.owners
    ]
    assert len(specs) == 560
    expected = plan_owners(specs, 64, ns=ns_rates.TargetFlops()).owners()
    assert report.owners == expected
    # ... which is what dedicate_params' planning gives on this machine's NewtonSchulz too
    # (a meta model, no process group)
    planned = plan_dedicated(llama70b, world_size=64, ns=ns_rates.TargetFlops())
    assert planned.owners() == expected
    assert {n for n, _ in planned.selected} == set(expected)


def test_bytes_add_up(llama70b):
    report = dry_run(llama70b, 512)
    master = _muon_bytes(llama70b, report)
    assert sum(r.dedicated_bytes for r in report.rows) == 2 * master  # master + momentum
    rest = sum(
        p.numel() * p.element_size()
        for n, p in llama70b.named_parameters()
        if n not in report.owners
    )
    assert sum(r.adamw_bytes for r in report.rows) == 3 * rest  # weight, exp_avg, exp_avg_sq
    # every dedicated matrix runs NS on its owner: one per rank at 512 ranks
    assert sum(r.matrices for r in report.rows) == 560
    assert max(r.ns_ms for r in report.rows) == pytest.approx(
        ns_rates.H200.call_ms_of((28672, 8192)), rel=1e-9
    )
    d = report.to_dict()
    assert len(d["rows"]) == 512 and d["totals"]["dedicated_bytes"] == 2 * master
    json.dumps(d, default=str)


def test_hsdp_owners_are_global_and_copies_fill_the_owner_column(llama70b):
    flat = dry_run(llama70b, 512)
    hsdp = dry_run(llama70b, 512, replicate_size=4)
    assert hsdp.shard_size == 128 and set(hsdp.owners) == set(flat.owners)
    assert max(hsdp.owners.values()) >= 128  # owners over all 512 ranks, not one replica
    master = _muon_bytes(llama70b, hsdp)
    assert sum(r.dedicated_bytes for r in hsdp.rows) == 2 * master
    # each column member holds the column's weights in bf16 (the owner: beside its fp32 master)
    numel = master // 4
    assert sum(r.replica_bytes for r in hsdp.rows) == 4 * numel * 2
    assert all(r.replicate_comm_bytes > 0 for r in hsdp.rows if r.replica_bytes)


def test_tp_plans_over_dp_times_tp_slots(llama70b):
    report = dry_run(llama70b, 64, tp_size=8)
    assert report.shard_size == 8 and report.tp_size == 8
    master = _muon_bytes(llama70b, report)
    assert sum(r.dedicated_bytes for r in report.rows) == 2 * master  # shards add up
    assert sum(r.matrices for r in report.rows) == 560  # each whole-matrix NS on one slot
    assert "TP" in " ".join(report.notes)


def test_split_matrices_spread_ns_over_aligned_blocks():
    report = dry_run("llama3-405b", 4096, split_size=8)
    assert report.split, "405B's MLP matrices exceed a fair share at 4096 ranks"
    for s in report.split:
        ranks = s["ranks"]
        assert (
            len(ranks) == 8 and ranks[0] % 8 == 0 and ranks == list(range(ranks[0], ranks[0] + 8))
        )
        assert s["ns_ms_per_rank"] < s["ns_ms_one_rank"] / 4
    assert report.totals()["ns_ms_max"] < dry_run("llama3-405b", 4096).totals()["ns_ms_max"]


def test_moe_expert_stacks_stay_on_fsdp2_with_per_expert_ns():
    report = dry_run("deepseek-v3", 256)
    model = build_model("deepseek-v3")[1]
    assert not any(".experts." in n or n.endswith("mlp.gate.weight") for n in report.owners)
    assert report.sharded_muon_params > 0.9 * sum(p.numel() for p in model.parameters())
    # 256 experts over 256 ranks: each rank orthogonalises 58 layers × 3 experts of its own
    assert all(r.sharded_muon_bytes > 0 and r.ns_ms > 0 for r in report.rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama3-70b", "--gpus", "100", "--hsdp", "3"], "multiple of 3"),
        (["--model", "llama3-7b", "--gpus", "8"], "choose a preset"),
        (["--model", "nowhere.module:build", "--gpus", "8"], "cannot import"),
        (["--gpus", "8"], "--model"),
        (["--model", "tiny", "--gpus", "0"], "integer >= 1"),
    ],
)
def test_bad_inputs_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_sizes_raise_from_the_function():
    with pytest.raises(ValueError, match="multiple of 4"):
        dry_run("tiny", 6, replicate_size=2, tp_size=2)
    with pytest.raises(ValueError, match="unknown model"):
        dry_run("llama-9000", 8)


def test_config_json_factory_and_json_output(tmp_path, monkeypatch, capsys):
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"dim": 256, "layers": 2, "heads": 4, "ffn": 512, "vocab": 1000}))
    factory = tmp_path / "my_models.py"
    factory.write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))\n"
        "    def forward(self, x):\n"
        "        return x\n"
        "def build():\n"
        "    return Net()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--config", str(config), "--gpus", "4", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 4 and report["dedicated_matrices"] == 14
    assert main(["--model", "my_models:build", "--gpus", "2", "--per-rank"]) == 0
    out = capsys.readouterr().out
    assert "every rank:" in out and "4 dedicated weights" in out
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "missing.json"), "--gpus", "2"])


def test_a_model_on_any_device_plans_without_a_process_group():
    import torch.distributed as dist

    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))
    report = dry_run(model, 2, param_dtype=None, reduce_dtype=None)
    assert not dist.is_initialized()
    assert sorted(report.owners.values()) == [0, 1]
    assert report.dedicated_params == 2 * 8 * 32
    # dedicate_params' own checks run in the dry run: a tied weight is refused the same way
    tied = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied weights"):
        dry_run(tied, 2)


def test_presets_have_the_benchmark_models_matrices():
    report = dry_run("G", 1)
    shapes = sorted(tuple(s.shape) for s in plan_dedicated(build_model("G")[1], world_size=1).specs)
    assert shapes.count((512, 2048)) == 16 and len(shapes) == 56 == report.dedicated_matrices
    assert set(PRESETS) >= {"llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3", "S", "M"}


# ----------------------------------------------------------------------------- the NS rates
def test_rates_reproduce_their_anchor_measurements():
    for m in ns_rates.MEASURED:
        assert ns_rates.H200.call_ms_of(m.shape, m.batch) == pytest.approx(m.ms, rel=1e-9)
    for m in ns_rates.CHECKS + (ns_rates.SINGLE_2048,):
        assert ns_rates.H200.call_ms_of(m.shape, m.batch) == pytest.approx(m.ms, rel=0.25)


@pytest.mark.parametrize("model", ["S", "M", "G", "E"])
def test_one_gpu_step_predictions_are_within_15_percent(model):
    """The benchmark models' compiled step alone on one H200 (ns_rates.STEP_MEASURED)."""
    row = dry_run(model, 1).rows[0]
    measured, ns_measured, _ = ns_rates.STEP_MEASURED[model]
    assert row.step_ms == pytest.approx(measured, rel=0.15)
    if ns_measured is not None:
        assert row.ns_ms == pytest.approx(ns_measured, rel=0.15)


def test_own_rates_from_json(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(
        json.dumps(
            {"measured": [[[1024, 4096], 32, 10.0], [[4096, 4096], 4, 20.0]], "call_ms": 0.2}
        )
    )
    rates = ns_rates.NSRates.load(str(path))
    assert [m for m, _ in rates.anchors] == [1024, 4096]
    assert rates.call_ms_of((1024, 4096), 32) == pytest.approx(10.0)
    slow = dry_run("S", 1, rates=rates).rows[0].ns_ms
    assert slow > 2 * dry_run("S", 1).rows[0].ns_ms  # a device 2-4x slower than an H200
    back = tmp_path / "anchors.json"
    back.write_text(json.dumps(rates.to_dict()))
    assert ns_rates.NSRates.load(str(back)).anchors == rates.anchors
    with pytest.raises(ValueError, match="ascending"):
        ns_rates.NSRates(anchors=((4096, 1.0), (1024, 1.0)))


def test_dry_run_check_quick_prints_the_table(capsys):
    """benchmarks/dry_run_check.py --quick on the CPU: the predictions beside the RESULTS.md
    numbers, and the measuring path on the tiny model."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dry_run_check.py"
    spec = importlib.util.spec_from_file_location("_dmuon_dry_run_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--device", "cpu", "--models", "S", "G"]) == 0
    out = capsys.readouterr().out
    assert "| S | 56 |" in out and "| G | 56 |" in out and "| tiny |" in out
    assert "predicted / measured" in out and "warning" not in out
