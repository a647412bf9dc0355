"""The dry run (``python -m dmuon_compile.plan``): runs on presets at thousands of ranks in
seconds, runs ``dedicate_params``' own planning, its bytes add up, HSDP/TP/split and expert-
parallel variants, its errors name the fix, and the NS rates reproduce the measurements they
come from. No processes
(tests/distributed/test_dry_run_dist.py compares it with a real multi-rank run)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from torch import nn

from dmuon_compile import ns_rates
from dmuon_compile.distributed.dedicate import plan_dedicated
from dmuon_compile.distributed.owner_plan import MatrixSpec, plan_owners
from dmuon_compile.layouts import Layout
from dmuon_compile.plan import PRESETS, ModelConfig, build_model, dry_run, main

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


@pytest.mark.parametrize("ep", [None, 8], ids=["fsdp2_experts", "ep8"])
def test_a_bf16_momentum_takes_a_quarter_off_the_muon_state(ep):
    """fp32 weight + bf16 momentum: 6 bytes per Muon value instead of 8, for the dedicated
    matrices and the FSDP2 (or EP) expert stacks alike; AdamW state unchanged."""
    fp32 = dry_run("deepseek-v3", 64, ep=ep)
    bf16 = dry_run("deepseek-v3", 64, ep=ep, momentum_dtype=torch.bfloat16)
    for key in ("dedicated_bytes", "sharded_muon_bytes"):
        before = sum(getattr(r, key) for r in fp32.rows)
        assert before > 0 and sum(getattr(r, key) for r in bf16.rows) == before * 3 // 4, key
    assert [r.adamw_bytes for r in bf16.rows] == [r.adamw_bytes for r in fp32.rows]
    assert "momentum=bfloat16" in bf16.table() and "momentum=" not in fp32.table()


def test_momentum_dtype_is_checked_and_on_the_command_line(capsys):
    with pytest.raises(ValueError, match="torch.bfloat16"):
        dry_run("tiny", 2, momentum_dtype=torch.float16)
    assert main(["--model", "tiny", "--gpus", "2", "--momentum-dtype", "bf16"]) == 0
    assert "momentum=bfloat16" in capsys.readouterr().out


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
    from bench_scripts import load_benchmark  # tests/ is on sys.path

    module = load_benchmark("dry_run_check")
    assert module.main(["--quick", "--device", "cpu", "--models", "S", "G"]) == 0
    out = capsys.readouterr().out
    assert "| S | 56 |" in out and "| G | 56 |" in out and "| tiny |" in out
    assert "predicted / measured" in out and "warning" not in out


# ----------------------------------------------------------------------------- expert parallelism
# 2 MoE layers of 8 experts, stacks w1/w3 (8, 32, 64) and w2 (8, 64, 32); a shared expert.
SMALL_MOE = ModelConfig(64, 2, 4, 128, vocab=100, experts=8, expert_ffn=32, shared_ffn=32)
SMALL_EXPERT_MATRICES = 2 * 3 * 8


def _expert_bytes(model) -> int:
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )


def test_the_cli_models_expert_parallelism_for_deepseek_v3(capsys):
    assert main(["--model", "deepseek-v3", "--gpus", "64", "--ep", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "ep × efsdp = 8 × 8 per replica, 32 of 256 experts per EP rank, 174 stacks" in out
    assert "expert FSDP Shard(0)" in out and "64 of 64 ranks orthogonalise experts" in out
    assert "expert matrices" in out and "expert NS ms" in out
    assert "reshard" not in out  # whole experts everywhere: nothing to reshard
    assert main(["--model", "deepseek-v3", "--gpus", "64", "--ep", "8", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["ep"] == 8 and report["expert_layout"]["shard_dims"] == [0]
    # 58 MoE layers × 3 stacks × (256 / 8 / 8) experts on every rank
    assert {r["expert_matrices"] for r in report["rows"]} == {58 * 3 * 4}
    assert main(["--model", "deepseek-v3", "--gpus", "64", "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert set(plain) <= set(report) and set(plain["rows"][0]) <= set(report["rows"][0])
    assert plain["ep"] is None and plain["expert_layout"] is None
    # EP 8 × efsdp 8 gathers each expert stack over 8 ranks, not 64: less FSDP traffic
    fsdp = [sum(r["fsdp_comm_bytes"] for r in x["rows"]) for x in (report, plain)]
    assert fsdp[0] < fsdp[1] / 4


def test_without_ep_the_report_is_as_before():
    report = dry_run("E", 8)
    text = report.table()
    assert "expert matrices" not in text and "torchtitan EP" not in text
    assert report.ep is None and report.to_dict()["expert_layout"] is None
    # the expert fields are there (JSON) and count the FSDP2 Shard(0) experts: 64 / 8 per stack
    assert {r.expert_matrices for r in report.rows} == {4 * 3 * 8}


@pytest.mark.parametrize(
    "world, hsdp, ep, dim",
    [
        (8, 1, 2, 0),  # efsdp 4 × ep 2 = 8 experts: Shard(0), one whole expert per rank
        (12, 2, 2, 0),  # HSDP 2 × 6: efsdp 3 over 4 local experts: Shard(0), chunks 2, 2, 0
        (16, 1, 2, 1),  # efsdp 8 × ep 2 > 8 experts: Shard(1) inside the experts
        (16, 1, 8, 1),
        (32, 2, 4, 1),
        (4, 1, 1, 0),  # torchtitan without EP: Shard(0) while shard <= experts
        (16, 1, 1, 1),  # ... Shard(1) above
    ],
)
def test_ep_bytes_add_up(world, hsdp, ep, dim):
    model = build_model(SMALL_MOE)[1]
    report = dry_run(model, world, replicate_size=hsdp, ep=ep)
    assert report.expert_layout["shard_dims"] == [dim]
    assert report.expert_layout["efsdp"] == world // hsdp // ep
    experts = _expert_bytes(model)
    # every replica holds the expert stacks once, weight + momentum, over its ranks
    assert sum(r.sharded_muon_bytes for r in report.rows) == hsdp * 2 * experts
    # and orthogonalises every expert once (on whole experts, after a reshard for Shard(1))
    assert sum(r.expert_matrices for r in report.rows) == hsdp * SMALL_EXPERT_MATRICES
    assert all(r.ns_ms >= r.expert_ns_ms for r in report.rows)
    assert all((r.expert_ns_ms > 0) == (r.expert_matrices > 0) for r in report.rows)
    assert (report.expert_layout["resharded_stacks"] > 0) == (dim == 1)
    assert any(r.expert_reshard_comm_bytes for r in report.rows) == (dim == 1)
    if hsdp == 1:  # every gradient once: the dedicated owners' and every FSDP2 chunk
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(r.grad_bytes for r in report.rows) == total
    plain = dry_run(model, world, replicate_size=hsdp)  # the AdamW side is untouched by EP
    assert [r.adamw_bytes for r in report.rows] == [r.adamw_bytes for r in plain.rows]
    assert report.owners == plain.owners


def test_ep_1_without_resharding_is_the_plain_fsdp2_model():
    """Two code paths, one layout: torchtitan without EP at 8 shard ranks of 8 experts is FSDP2's
    Shard(0), which the default (no ep) dry run models on its own."""
    ep1, plain = dry_run(SMALL_MOE, 8, ep=1), dry_run(SMALL_MOE, 8)
    assert [r.to_dict() for r in ep1.rows] == [r.to_dict() for r in plain.rows]
    assert ep1.totals() == plain.totals()


def test_ep_inside_the_experts_reshards_to_whole_experts():
    """16 ranks, ep 2: efsdp 8 × 2 > 8 experts, so torchtitan shards the stacks Shard(1) (4 of
    each local expert's rows per rank); the step's all-to-all over efsdp gives each of the 8
    efsdp ranks of an EP rank's 4 experts one of them whole, to the 4 least loaded so far
    (``ExpertWalk``: the experts of earlier stacks and the dedicated weights a rank owns): every
    rank gets some (a fixed split gave shard ranks 0-7 six and left 8-15 idle), and the owners
    of larger dedicated weights fewer."""
    report = dry_run(SMALL_MOE, 16, ep=2)
    rows = report.rows
    counts = [r.expert_matrices for r in rows]
    assert sum(counts) == 2 * 4 * 6 and min(counts) >= 1, counts  # each expert once, no idle
    by_dedicated = sorted(rows, key=lambda r: r.dedicated_bytes)
    assert all(  # here every dedicated weight of more bytes is also the costlier NS
        a.expert_matrices >= b.expert_matrices for a, b in zip(by_dedicated, by_dedicated[1:])
    ), [(r.dedicated_bytes, r.expert_matrices) for r in rows]
    assert len(set(counts)) > 1  # the dedicated owners did get fewer
    # 1/16 of the stacks' weight and momentum on every rank
    assert {r.sharded_muon_bytes for r in rows} == {
        2 * _expert_bytes(build_model(SMALL_MOE)[1]) // 16
    }
    # w1 (8, 32, 64), 4 local experts, 4 rows each per rank. A rank given an expert: there its
    # other 28 rows 28 · 64 = 1792, back its rows of the other 3 experts 3 · 4 · 64 = 768; one
    # given none: nothing there, back its rows of all 4 experts 4 · 4 · 64 = 1024. w2 (8, 64,
    # 32) and w3: the same. fp32, 2 layers × 3 stacks. (DTensor's redistribution moved 6656.)
    reshard = [r.expert_reshard_comm_bytes for r in rows]
    assert reshard == [(k * 2560 + (6 - k) * 1024) * 4 for k in counts]
    assert all(r.comm_bytes >= r.expert_reshard_comm_bytes for r in rows)
    # the stacks are small: one batch, so one NS call per shape for a rank's whole experts of
    # every stack (a call per stack would cost call_ms each: 5 experts, 1.5 ms)
    for r in rows:
        k, rate = r.expert_matrices, ns_rates.H200
        one = min(rate.call_ms_of((32, 64), k), rate.call_ms_of((64, 32), k))
        both = rate.call_ms_of((32, 64), k) + rate.call_ms_of((64, 32), k)
        assert one <= r.expert_ns_ms * (1 + 1e-9) and r.expert_ns_ms <= both * (1 + 1e-9), r
    assert any("inside their experts" in n for n in report.notes)
    text = report.table()
    assert "reshard KiB/step" in text or "reshard MiB/step" in text
    assert "expert FSDP Shard(1) (6 stacks sharded inside the experts" in text
    # expert_shard_dim forces the placement where torchtitan's rule would pick Shard(0)
    forced = dry_run(SMALL_MOE, 8, ep=2, expert_shard_dim=1)
    assert forced.expert_layout["shard_dims"] == [1]
    assert sum(r.expert_matrices for r in forced.rows) == SMALL_EXPERT_MATRICES


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "64", "--ep", "3"], "must divide the data-parallel shard size 64"),
        (["--gpus", "96", "--ep", "3"], "must divide the number of experts"),
        (["--gpus", "64", "--ep", "8", "--tp", "2"], "with tp_size=1 (--tp 1)"),
        (["--gpus", "64", "--ep", "0"], "integer >= 1"),
        (["--gpus", "64", "--expert-shard-dim", "1"], "needs ep"),
    ],
)
def test_bad_ep_names_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "deepseek-v3", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_ep_errors_from_the_function():
    with pytest.raises(ValueError, match="no expert stacks"):
        dry_run("llama3-8b", 64, ep=8)
    with pytest.raises(ValueError, match="cannot be dedicated"):  # as dedicate_params refuses
        dry_run(SMALL_MOE, 8, ep=2, predicate=lambda n, p: p.ndim == 3)
    # Shard(1) over efsdp 8 of 36 rows: FSDP2 refuses an uneven Shard(1)
    uneven = ModelConfig(64, 1, 4, 128, experts=8, expert_ffn=36)
    with pytest.raises(ValueError, match="not divisible by 8"):
        dry_run(uneven, 16, ep=2)
    assert dry_run(uneven, 8, ep=2).expert_layout["shard_dims"] == [0]  # whole experts: fine


# ----------------------------------------------------------------------------- expert NS once
def _whole_expert_elements(model, shards: int) -> int:
    """Elements of the whole experts one rank holds of every stack: E / shards of each."""
    stacks = [p for n, p in model.named_parameters() if ".experts." in n]
    return sum(p.numel() // shards for p in stacks)


def _expert_ns_pair(model, world, **kwargs):
    return (
        dry_run(model, world, expert_ns="per_replica", **kwargs),
        dry_run(model, world, expert_ns="once", **kwargs),
    )


@pytest.mark.parametrize(
    "world, hsdp, kwargs",
    [
        (8, 2, {}),  # plain FSDP2 Shard(0): 2 whole experts per rank and stack
        (8, 2, {"ep": 2}),  # EP 2 × efsdp 2, Shard(0): the same 2 per rank
        (32, 2, {"ep": 2}),  # efsdp 8 × 2 > 8 experts: Shard(1), after the reshard
        (16, 2, {"pp": 2}),  # pipeline stages, each split over the replicas
        (12, 3, {}),  # three replicas
    ],
)
def test_expert_ns_once_orthogonalises_each_expert_once_per_job(world, hsdp, kwargs):
    """Muon(expert_ns="once"): the R replicas split their whole experts, so the job's expert
    matrices fall by exactly R; per_replica (the control) runs every expert R times."""
    per, once = _expert_ns_pair(SMALL_MOE, world, replicate_size=hsdp, **kwargs)
    assert sum(r.expert_matrices for r in per.rows) == hsdp * SMALL_EXPERT_MATRICES
    assert sum(r.expert_matrices for r in once.rows) == SMALL_EXPERT_MATRICES
    assert all(r.expert_gather_comm_bytes == 0 for r in per.rows)
    assert all(r.expert_gather_comm_bytes > 0 for r in once.rows)
    # the gather is HSDP traffic: part of the replicate column, of Muon extra and of comm (a
    # Shard(1) reshard moves other bytes: its walk leaves the dedicated loads to the replicas')
    for a, b in zip(per.rows, once.rows):
        assert b.replicate_comm_bytes - a.replicate_comm_bytes == b.expert_gather_comm_bytes
        extra = b.expert_gather_comm_bytes + b.expert_reshard_comm_bytes
        assert b.comm_bytes - extra == a.comm_bytes - a.expert_reshard_comm_bytes
    assert [r.sharded_muon_bytes for r in per.rows] == [r.sharded_muon_bytes for r in once.rows]
    assert per.owners == once.owners  # the dedicated plan is the same


@pytest.mark.parametrize("kwargs", [{}, {"ep": 2}])
def test_expert_ns_once_gathers_the_other_replicas_share_in_two_bytes(kwargs):
    """8 ranks, HSDP 2 × 4: each rank holds 2 of every stack's 8 experts, one per replica
    after the split; the all-gather brings each rank the other half of its whole experts'
    results in NS's 2-byte output dtype: (R - 1) / R × elements × 2."""
    model = build_model(SMALL_MOE)[1]
    per, once = _expert_ns_pair(model, 8, replicate_size=2, **kwargs)
    expected = (2 - 1) * _whole_expert_elements(model, 4) * 2 // 2
    assert expected == 2 * 3 * 2 * 32 * 64 * 2 // 2  # 2 layers, 3 stacks, 2 experts 32 × 64
    assert [r.expert_gather_comm_bytes for r in once.rows] == [expected] * 8
    assert {r.expert_matrices for r in once.rows} == {2 * 3 * 1}
    assert {r.expert_matrices for r in per.rows} == {2 * 3 * 2}
    text = once.table()
    assert "expert NS=once" in text and re.search(r"replica gather [KM]iB/step", text)
    assert "expert all-gather over replicas" in text and "expert_ns='once'" in text
    assert "expert NS=once" not in per.table() and "replica gather" not in per.table()
    if kwargs:
        assert once.expert_layout["expert_ns"] == "once" and "expert NS once per job" in text
    d = once.to_dict()
    assert d["expert_ns"] == "once" and d["settings"]["expert NS"] == "once"
    assert {r["expert_gather_comm_bytes"] for r in d["rows"]} == {expected}
    plain = per.to_dict()
    assert "expert_ns" not in plain and "expert_gather_comm_bytes" not in plain["rows"][0]


def test_expert_ns_once_divides_each_ranks_expert_ns_by_the_replicas():
    """Experts large enough for their FLOPs to count: each rank's expert NS ms falls to its
    per-replica ms / R, plus the call overhead of its now smaller calls (one per shape)."""
    moe = ModelConfig(1024, 1, 8, 1024, vocab=100, experts=8, expert_ffn=2048)
    for hsdp, ep in ((2, None), (2, 2), (4, None)):
        per, once = _expert_ns_pair(moe, 8 * hsdp, replicate_size=hsdp, ep=ep)
        call = ns_rates.H200.call_ms
        shapes = 2  # w1/w3 (2048, 1024) and w2 (1024, 2048)
        for a, b in zip(per.rows, once.rows):
            overhead = (1 - 1 / hsdp) * shapes * call
            assert b.expert_ns_ms <= a.expert_ns_ms / hsdp + overhead + 1e-9, (hsdp, ep, a, b)
            assert b.expert_ns_ms < 0.6 * a.expert_ns_ms
        assert sum(r.expert_matrices for r in per.rows) == hsdp * sum(
            r.expert_matrices for r in once.rows
        )


@pytest.mark.parametrize("kwargs", [{}, {"ep": 2}, {"ep": 8}])
def test_expert_ns_once_without_replicas_is_per_replica(kwargs):
    """One replica: nothing to split, the report is per_replica's, key for key."""
    per, once = _expert_ns_pair(SMALL_MOE, 16, **kwargs)
    a, b = per.to_dict(), once.to_dict()
    for d in (a, b):
        del d["plan_s"], d["total_s"]
    assert a == b
    strip = re.compile(r"planned in [\d.]+ s, reported in [\d.]+ s")
    assert strip.sub("", per.table()) == strip.sub("", once.table())


def test_expert_ns_is_checked_and_on_the_command_line(capsys):
    with pytest.raises(ValueError, match="choose one of per_replica, once"):
        dry_run(SMALL_MOE, 8, expert_ns="twice")
    with pytest.raises(SystemExit):
        main(["--model", "E", "--gpus", "8", "--expert-ns", "twice"])
    err = capsys.readouterr().err
    assert "--expert-ns" in err and "'per_replica', 'once'" in err
    argv = ["--model", "E", "--gpus", "16", "--hsdp", "2", "--json"]
    assert main([*argv, "--expert-ns", "once"]) == 0
    (once,) = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    (per,) = json.loads(capsys.readouterr().out)
    assert once["expert_ns"] == "once" and "expert_ns" not in per
    matrices = [sum(r["expert_matrices"] for r in x["rows"]) for x in (per, once)]
    assert matrices[0] == 2 * matrices[1]


# ----------------------------------------------------------------------------- pipeline (--pp)
def _stage_specs(model, names) -> list[MatrixSpec]:
    params = dict(model.named_parameters())
    return [
        MatrixSpec(n, tuple(params[n].shape), params[n].element_size(), Layout.matrix())
        for n in sorted(names)
    ]


def test_the_cli_models_pipeline_parallelism_for_llama3_405b(capsys):
    argv = ["--model", "llama3-405b", "--gpus", "512", "--pp", "8", "--top", "2"]
    assert main([*argv, "--stages-per-rank", "2"]) == 0
    out = capsys.readouterr().out
    assert "llama3-405b on 512 GPUs (pp × replicate × shard = 8 × 1 × 64)" in out
    assert "16 stages of 126 layers, 2 per PP rank" in out
    # torchtitan's default split: 128 effective layers (+1 embeddings, +1 output), 8 a stage
    assert "PP rank 0 (ranks 0-63): stages 0 (layers 0-6 + embeddings), 8 (layers 63-70)" in out
    assert "PP rank 7 (ranks 448-511): stages 7 (layers 55-62), 15 (layers 119-125 + output)" in out
    assert "not modelled" in out and "  rank  pp  matrices" in out
    assert main([*argv, "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["pp"] == 8 and d["stages_per_rank"] == 1 and len(d["stages"]) == 8
    assert [s["pp_rank"] for s in d["stages"]] == list(range(8))
    assert [len(s["layers"]) for s in d["stages"]] == [15] + [16] * 6 + [15]
    assert len(d["rows"]) == 512 and d["rows"][64]["pp_rank"] == 1
    assert [p["ranks"] for p in d["pp_ranks"]][:2] == [[0, 63], [64, 127]]
    for p in d["pp_ranks"]:
        assert p["ns_ms_max"] >= p["ns_ms_mean"] > 0
    # without --pp the JSON keys are as before
    assert main(["--model", "tiny", "--gpus", "4", "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert not {"pp", "stages", "pp_ranks", "stages_per_rank"} & set(plain)
    assert "pp_rank" not in plain["rows"][0]


@pytest.mark.parametrize("hsdp", [1, 2])
def test_pp_bytes_add_up_and_stay_on_their_stage(llama70b, hsdp):
    report = dry_run(llama70b, 256, replicate_size=hsdp, pp=4, stages_per_rank=2)
    flat = dry_run(llama70b, 64)
    assert set(report.owners) == set(flat.owners)  # the same 560 dedicated weights
    master = _muon_bytes(llama70b, report)
    # each weight's master and momentum once, on its stage's PP rank (× replicas: bf16 copies)
    assert sum(r.dedicated_bytes for r in report.rows) == 2 * master
    assert sum(r.replica_bytes for r in report.rows) == (hsdp * master // 4 * 2 if hsdp > 1 else 0)
    rest = sum(
        p.numel() * p.element_size()
        for n, p in llama70b.named_parameters()
        if n not in report.owners
    )
    assert sum(r.adamw_bytes for r in report.rows) == 3 * rest * hsdp  # each replica's shards
    assert sum(r.matrices for r in report.rows) == 560
    group = 256 // 4
    for fqn, owner in report.owners.items():
        layer = int(fqn.split(".")[2])
        (stage,) = [s for s in report.stages if layer in s["layers"]]
        assert owner // group == stage["pp_rank"] == stage["stage"] % 4
    # a PP rank's ranks hold only its stages: rank 0 has the embeddings, the last PP rank the
    # head, and each PP rank's dedicated bytes are its stages' weights'
    params = dict(llama70b.named_parameters())
    for p in range(4):
        ranks = report.rows[p * group : (p + 1) * group]
        mine = [n for n, o in report.owners.items() if o // group == p]
        assert sum(r.dedicated_bytes for r in ranks) == 2 * sum(
            params[n].numel() * params[n].element_size() for n in mine
        )
    embed = params["model.embed_tokens.weight"].numel() * 4 * 3  # weight, exp_avg, exp_avg_sq
    assert sum(r.adamw_bytes for r in report.rows[:group]) >= embed * hsdp
    assert sum(r.adamw_bytes for r in report.rows[group : 2 * group]) < embed // 100
    head = params["lm_head.weight"].numel() * 4 * 3
    assert sum(r.adamw_bytes for r in report.rows[3 * group :]) >= head * hsdp
    assert sum(r.adamw_bytes for r in report.rows[:group]) < (embed + head) * hsdp
    d = report.to_dict()
    assert d["totals"]["dedicated_bytes"] == 2 * master
    json.dumps(d, default=str)


@pytest.mark.parametrize("pp, per_rank", [(4, 1), (4, 2), (3, 3)])
def test_each_stage_is_plan_owners_over_the_loads_before_it(pp, per_rank):
    model = build_model("llama3-8b")[1]
    report = dry_run(model, pp * 16, pp=pp, stages_per_rank=per_rank)
    stages = report.stages
    assert len(stages) == pp * per_rank
    for p in range(pp):
        carried = None
        for k in range(p, pp * per_rank, pp):
            stage = stages[k]
            specs = _stage_specs(model, stage["owners"])
            plan = plan_owners(specs, 16, ns=ns_rates.TargetFlops(), base_loads=carried)
            assert stage["owners"] == plan.owners()
            assert stage["ns_flops_per_rank"] == pytest.approx(plan.ns_loads())
            loads = plan.ns_loads()
            carried = loads if carried is None else [a + b for a, b in zip(carried, loads)]
            # global owners: PP rank p's data-parallel ranks
            for fqn, o in stage["owners"].items():
                assert report.owners[fqn] == p * 16 + o
        mean = sum(carried) / 16
        assert report.pp_ranks[p]["ns_flops_max_over_mean"] == pytest.approx(max(carried) / mean)


def test_stages_of_a_rank_planned_together_balance_their_sum():
    """Four one-block stages over 2 data-parallel ranks per PP rank: a block's seven matrices
    cannot split evenly over two ranks, so each stage alone puts its larger part on the same
    rank (control: 1.055); planned over the loads of the one before, the second stage's goes
    to the other rank and the sum is nearly even (1.006)."""
    config = ModelConfig(64, 4, 4, 176, vocab=256)
    model = build_model(config)[1]
    report = dry_run(
        model, 4, pp=2, stages_per_rank=2, pp_first_stage_less_layers=0, pp_last_stage_less_layers=0
    )
    assert [s["layers"] for s in report.stages] == [[0], [1], [2], [3]]
    for p in range(2):
        together, alone = [0.0, 0.0], [0.0, 0.0]
        for k in (p, p + 2):
            specs = _stage_specs(model, report.stages[k]["owners"])
            loads = report.stages[k]["ns_flops_per_rank"]
            together = [a + b for a, b in zip(together, loads)]
            own = plan_owners(specs, 2, ns=ns_rates.TargetFlops()).ns_loads()
            alone = [a + b for a, b in zip(alone, own)]
            assert max(own) / (sum(own) / 2) > 1.02  # one stage alone is uneven
        ratio = max(together) / (sum(together) / 2)
        control = max(alone) / (sum(alone) / 2)
        assert report.pp_ranks[p]["ns_flops_max_over_mean"] == pytest.approx(ratio)
        assert ratio < control - 0.02, (ratio, control)


@pytest.mark.parametrize(
    "layers, stages, first, last",
    [(126, 8, 1, 1), (126, 16, 1, 1), (80, 8, 1, 1), (4, 4, 0, 0), (4, 2, 1, 0), (61, 16, 1, 1),
     (32, 4, 2, 1), (5, 5, 1, 1), (7, 1, 1, 1)],
)  # fmt: skip
def test_the_stage_split_is_torchtitans(layers, stages, first, last):
    from dmuon_compile.plan import pipeline_stage_layers

    ours = pipeline_stage_layers(layers, stages, first, last)
    assert sum(ours, []) == list(range(layers))  # contiguous, every layer once
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    theirs = _generate_llm_fqn_per_model_part(stages, layers, first, last)
    assert [[f"layers.{i}" for i in s] for s in ours] == [
        [m for m in s if m.startswith("layers.")] for s in theirs
    ]
    assert "tok_embeddings" in theirs[0] and "lm_head" in theirs[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "tiny", "--gpus", "8", "--pp", "3"], "multiple of 3"),
        (["--model", "tiny", "--gpus", "8", "--pp", "2", "--stages-per-rank", "2"], "<= 2"),
        (["--model", "llama3-8b", "--gpus", "64", "--pp", "2", "--tp", "2"], "--tp 1"),
        (["--model", "deepseek-v3", "--gpus", "64", "--pp", "2", "--ep", "8"], "--ep 1"),
        (["--model", "tiny", "--gpus", "8", "--stages-per-rank", "2"], "need pp"),
        (["--model", "tiny", "--gpus", "8", "--pp", "0"], "integer >= 1"),
    ],
)
def test_bad_pp_names_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_pp_errors_from_the_function():
    with pytest.raises(ValueError, match="exactly one `layers`"):
        dry_run(nn.Sequential(nn.Linear(8, 8)), 2, pp=2)
    with pytest.raises(ValueError, match="fewer effective layers"):
        dry_run("llama3-8b", 16, pp=16, stages_per_rank=2, pp_first_stage_less_layers=3)
    with pytest.raises(ValueError, match="pp=2 with tp_size=2"):
        dry_run("tiny", 8, pp=2, tp_size=2)
    # a trivial tp or ep is allowed
    assert dry_run("tiny", 4, pp=2, tp_size=1).pp == 2
    assert dry_run("E", 8, pp=2, ep=1).expert_layout["ep"] == 1


# ----------------------------------------------------------------------------- what a user trips
@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e-12"])
def test_stack_gib_must_be_a_positive_budget(value, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny", "--gpus", "2", "--stack-gib", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--stack-gib" in err and "number of GiB > 0" in err, err
    assert main(["--model", "tiny", "--gpus", "2", "--stack-gib", "0.5"]) == 0
    with pytest.raises(ValueError, match="positive whole number of bytes"):
        dry_run("tiny", 2, stack_bytes=0)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"anchor": [[768, 240.0]]}', "it has no 'anchors' or 'measured'"),
        ("[[768, 240.0]]", "it holds a JSON list, not an object"),
        ("{anchors: 1}", "not JSON"),
        ('{"anchors": [[768, "fast"]]}', "'anchors'[0] is [768, 'fast'], not [m, TFLOP/s]"),
        ('{"anchors": []}', "'anchors' is [], not a non-empty list"),
        ('{"anchors": [[768, 240.0]], "call_ms": "0.3"}', "call_ms is '0.3', not a number"),
        ('{"anchors": [[768, 240.0]], "tflops": 1}', "unknown keys ['tflops']"),
        ('{"anchors": [[2048, 1.0], [768, 1.0]]}', "m ascending"),
        ('{"measured": [[1024, 32, 10.0]]}', "'measured'[0] is [1024, 32, 10.0], not [[m, n]"),
        ('{"measured": [[[1024, 4096], 32, 0.1]]}', "not more than call_ms"),
    ],
)
def test_a_malformed_rates_file_says_what_is_wrong_and_what_it_must_hold(
    tmp_path, content, message, capsys
):
    path = tmp_path / "rates.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny", "--gpus", "2", "--rates", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"rates file {path}: " in err and message in err, err
    assert 'the file must hold one JSON object: either "anchors"' in err
    with pytest.raises(ValueError, match="the file must hold"):
        ns_rates.NSRates.load(str(path))


def test_a_rates_file_carries_its_cards_memory(tmp_path):
    path = tmp_path / "rates.json"
    measured = [[[1024, 4096], 32, 10.0, "here"], [[4096, 4096], 4, 20.0]]
    path.write_text(json.dumps({"measured": measured, "device": "X", "memory_gib": 20.0}))
    rates = ns_rates.NSRates.load(str(path))
    assert (rates.device, rates.memory_gib, rates.sources) == ("X", 20.0, ("here",))
    report = dry_run("llama3-8b", 8, rates=rates)
    assert report.gpu_memory_bytes == 20 * (1 << 30) and "X, the rates'" in report.card
    assert ns_rates.H200.memory_gib == pytest.approx(140.4, abs=0.05)  # 143771 MiB


def test_comm_is_split_into_fsdp2s_gathers_and_what_owning_adds(llama70b):
    plain = dry_run(llama70b, 64)
    for r in plain.rows:  # 1-D, no split: all of it is what FSDP2 alone would move
        assert r.gather_reduce_bytes == r.fsdp_comm_bytes + r.dedicated_comm_bytes == r.comm_bytes
        assert r.muon_extra_bytes == 0
    text = plain.table(top=1)
    assert "  AG/RS GiB/step" in text and "  Muon extra GiB/step" in text
    assert (
        "comm = AG/RS 100.0% (the weights' all-gathers and reduce-scatters: what FSDP2 alone"
        in text
    )
    assert "moves) + Muon extra 0.0% (what owning adds: none)" in text
    hsdp = dry_run(llama70b, 512, replicate_size=8, split_size=8)
    rows = hsdp.rows
    for r in rows:
        assert r.comm_bytes == r.gather_reduce_bytes + r.muon_extra_bytes
        assert r.muon_extra_bytes == r.replicate_comm_bytes + r.split_comm_bytes
    assert sum(r.split_comm_bytes for r in rows) > 0 and sum(r.replicate_comm_bytes for r in rows)
    assert sum(r.muon_extra_bytes for r in rows) < 0.05 * sum(r.comm_bytes for r in rows)
    text = hsdp.table(top=1)
    assert "HSDP column reduce/broadcast" in text and "split NS" in text
    d = hsdp.to_dict()
    assert d["totals"]["comm_bytes"] == (
        d["totals"]["gather_reduce_bytes"] + d["totals"]["muon_extra_bytes"]
    )


def test_a_peak_above_the_cards_memory_gets_a_note_with_what_fits(llama70b, capsys):
    argv = ["--model", "llama3-70b", "--gpus", "8", "--top", "1"]
    assert main([*argv, "--gpu-mem-gib", "79.6"]) == 0  # an 80 GB H100
    out = capsys.readouterr().out
    assert "memory: peak 119.48 GiB (rank 0) of 79.6 GiB per GPU (--gpu-mem-gib)" in out
    assert "DOES NOT FIT on 8 of 8 ranks" in out
    note = next(line for line in out.splitlines() if "does not fit" in line)
    assert "the predicted peak, 119.48 GiB on rank 0 (dedicated 63.75 + AdamW 2.94" in note
    assert "more GPUs (the state shards over them): 16 fit, peak 61.24 GiB" in note
    assert "--stack-gib 1" in note  # the working set's share
    at16 = dry_run(llama70b, 16, advise=False)
    assert max(r.peak_bytes for r in at16.rows) / (1 << 30) == pytest.approx(61.24, abs=0.005)
    # the default card is the rates' H200 (140.4 GiB): it fits, and says how much is left
    assert main(argv) == 0
    out = capsys.readouterr().out
    card = "H200, the rates'; another: --gpu-mem-gib G"
    assert f"of 140.4 GiB per GPU ({card}): 20.9 GiB left for activations" in out
    assert "does not fit" not in out
    with pytest.raises(SystemExit):
        main([*argv, "--gpu-mem-gib", "0"])
    assert "one GPU's memory as a number of GiB > 0" in capsys.readouterr().err
    # from Python: the note is in report.notes; advise=False plans once and notes nothing
    report = dry_run(llama70b, 8, gpu_memory_gib=79.6)
    assert any("does not fit the 79.6 GiB" in n for n in report.notes)
    assert not dry_run(llama70b, 8, gpu_memory_gib=79.6, advise=False).notes


def test_many_idle_ranks_point_to_split_size_with_what_it_would_do(llama70b):
    report = dry_run(llama70b, 4096)
    (note,) = [n for n in report.notes if "--split-size" in n]
    assert note.startswith("3536 of 4096 ranks (86%) own no matrix and idle in the step")
    split8 = dry_run(llama70b, 4096, split_size=8, advise=False)
    idle8 = len(split8.idle_ranks)
    ns8 = max(r.ns_ms for r in split8.rows)
    assert f"--split-size 8: {idle8} idle, NS ms max {ns8:.2f}" in note
    assert idle8 < 3536 / 4 and ns8 < 32.24 / 4
    assert "--split-size 16: 0 idle" in note
    # no note where every rank has work, or where split NS is already on
    assert not any("--split-size" in n for n in dry_run(llama70b, 512).notes)
    assert not any("idle in the step" in n for n in split8.notes)
    assert not any("idle in the step" in n for n in dry_run(llama70b, 4096, split_size=8).notes)
    # where splitting would not shorten the step, the note says so instead of pointing to it
    (small,) = [n for n in dry_run("tiny", 64).notes if "idle in the step" in n]
    assert "--split-size would not shorten the step (--split-size 8: 0 idle" in small


# ----------------------------------------------------------------------------- momentum storage
# Sizes that are no multiple of the 8-bit format's 256-value blocks (1600, 800, 4000 values...),
# and expert stacks (4, 24, 40) whose per-rank pieces are none either (960, 480 values).
ODD = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50, experts=4, expert_ffn=24, shared_ffn=30)
ODD_DENSE = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50)


def _int8_bytes(numel: int) -> int:
    """One tensor's 8-bit momentum: a byte per value, an fp32 scale per started 256 values."""
    return numel + 4 * -(-numel // 256)


def _owned_numel(model, report) -> dict[int, list[int]]:
    """Per data-parallel rank, the element counts of the dedicated weights it owns."""
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    out: dict[int, list[int]] = {r.rank: [] for r in report.rows}
    for fqn, owner in report.owners.items():
        out[owner].append(numel[fqn])
    return out


def test_an_8bit_momentum_is_a_byte_per_value_and_a_scale_per_block_of_each_tensor():
    """Owned dedicated weights: fp32 weight + codes + scales, counted per tensor (a sum over
    the rank's values would miss the started blocks); the step's working buffers in fp32, all
    at once (``momentum_in_flight=None``)."""
    model = build_model(ODD_DENSE)[1]
    fp32 = dry_run(model, 2, advise=False)
    int8 = dry_run(model, 2, momentum_dtype=torch.int8, momentum_in_flight=None, advise=False)
    owned = _owned_numel(model, int8)
    assert all(len(v) > 1 for v in owned.values())
    for a, b in zip(fp32.rows, int8.rows):
        numels = owned[a.rank]
        assert any(n % 256 for n in numels)
        assert a.dedicated_bytes == 8 * sum(numels)  # fp32 weight + fp32 momentum
        assert b.dedicated_bytes == sum(4 * n + _int8_bytes(n) for n in numels)
        assert b.step_extra_bytes == a.step_extra_bytes + 4 * sum(numels)
        assert (b.grad_bytes, b.adamw_bytes, b.host_bytes) == (a.grad_bytes, a.adamw_bytes, 0)
    assert "momentum=int8 (8-bit, an fp32 scale per 256 values)" in int8.table()
    assert "host" not in int8.table() and "host_bytes" not in int8.to_dict()["rows"][0]
    assert "momentum storage: 8-bit codes and scales in GPU memory" in int8.notes[-1]


@pytest.mark.parametrize(
    "world, ep, piece",
    [(4, None, 960), (8, 2, 480)],  # FSDP2 Shard(0): one expert a rank; EP: Shard(1) rows
)
def test_an_8bit_momentum_of_expert_stacks_counts_each_ranks_piece(world, ep, piece):
    model = build_model(ODD)[1]
    stacks = [p for n, p in model.named_parameters() if ".experts." in n]
    assert len(stacks) == 6 and all(p.numel() // world == piece for p in stacks)
    fp32 = dry_run(model, world, ep=ep, advise=False)
    int8 = dry_run(
        model, world, ep=ep, momentum_dtype="int8", momentum_in_flight=None, advise=False
    )
    for a, b in zip(fp32.rows, int8.rows):
        assert a.sharded_muon_bytes == 6 * 8 * piece
        assert b.sharded_muon_bytes == 6 * (4 * piece + _int8_bytes(piece))
        working = b.step_extra_bytes - a.step_extra_bytes
        assert working == 6 * 4 * piece + 4 * sum(_owned_numel(model, fp32)[a.rank])


@pytest.mark.parametrize("dtype, item", [(None, 4), ("bf16", 2), ("int8", None)])
def test_offload_moves_the_stored_momentum_to_host_memory_and_its_working_buffer_into_the_step(
    dtype, item
):
    model = build_model(ODD)[1]
    gpu = dry_run(model, 8, ep=2, momentum_dtype=dtype, advise=False)
    host = dry_run(model, 8, ep=2, momentum_dtype=dtype, offload="momentum", advise=False)
    owned = _owned_numel(model, gpu)
    stored = (lambda n: n * item) if item else _int8_bytes
    for a, b in zip(gpu.rows, host.rows):
        mine = owned[a.rank] + [480] * 6  # the dedicated weights and the expert stacks' pieces
        assert b.host_bytes == sum(stored(n) for n in mine) > 0
        assert b.host_link_bytes == 2 * b.host_bytes  # copied in, written back
        assert b.dedicated_bytes == 4 * sum(owned[a.rank])  # weights only on the GPU
        assert b.sharded_muon_bytes == 4 * 480 * 6
        working = sum(n * (item or 4) for n in mine)  # the weights' dtype, bf16 stays bf16
        extra = b.step_extra_bytes - a.step_extra_bytes
        assert extra == (working if item else 0)  # 8-bit already had its working buffers
        assert b.peak_bytes == a.peak_bytes - (0 if item else sum(stored(n) for n in mine))
    text = host.table()
    assert "host KiB" in text and "host link KiB/step" in text
    assert "offload=momentum (pinned host memory, 25 GB/s)" in text
    assert "host" not in gpu.table()
    d = host.to_dict()
    assert d["offload"] == "momentum" and d["rows"][0]["host_bytes"] == host.rows[0].host_bytes
    assert "offload" not in gpu.to_dict() and "host_bytes_max" not in gpu.to_dict()["totals"]
    assert "the write-back, as much again, overlaps the next forward" in host.notes[-1]


def test_offload_adds_the_copy_in_at_the_host_links_rate_to_the_step():
    from dmuon_compile.plan.momentum import HOST_LINK_GBPS

    gpu = dry_run("tiny", 2, advise=False)
    for gbps in (None, 10, 2.5):
        host = dry_run(
            "tiny",
            2,
            offload="momentum",
            host_link_gbps=gbps,
            momentum_in_flight=None,
            advise=False,
        )
        rate = (gbps or HOST_LINK_GBPS) * 1e9
        for a, b in zip(gpu.rows, host.rows):
            assert b.host_bytes == a.dedicated_bytes // 2  # the fp32 momentum
            assert b.ns_ms == a.ns_ms
            assert b.step_ms - a.step_ms == pytest.approx(b.host_bytes / rate * 1e3, rel=1e-9)
            assert b.step_ms > a.step_ms


def test_pipeline_stages_add_up_their_host_bytes_and_copy_ins():
    """Two stages on one PP rank: each stage's optimizer copies its momentum in before its
    step, one stage's working buffers at a time, so offload lowers the step's peak here."""
    gpu = dry_run("tiny", 2, pp=1, stages_per_rank=2, advise=False)
    host = dry_run(
        "tiny",
        2,
        pp=1,
        stages_per_rank=2,
        offload="momentum",
        momentum_in_flight=None,
        advise=False,
    )
    for a, b in zip(gpu.rows, host.rows):
        assert b.host_bytes == a.dedicated_bytes // 2 and b.host_link_bytes == 2 * b.host_bytes
        assert b.step_ms - a.step_ms == pytest.approx(b.host_bytes / 25e9 * 1e3, rel=1e-9)
        assert b.peak_bytes < a.peak_bytes
    assert "lower than in place" in host.notes[-1]


def test_the_memory_note_tries_the_momentum_storages():
    """A peak above the card: bf16 lowers it; 8-bit and offload only where not every matrix's
    working buffer is live at once (here two pipeline stages), and the note says so by
    leaving them out of a one-stage job."""
    at_once = dict(gpu_memory_gib=1e-4, momentum_in_flight=None)
    (note,) = [n for n in dry_run("tiny", 2, **at_once).notes if "does not fit" in n]
    assert "momentum_dtype=torch.bfloat16 (--momentum-dtype bf16): peak" in note
    assert "int8" not in note and "offload" not in note
    staged = dry_run("tiny", 2, pp=1, stages_per_rank=2, **at_once)
    (note,) = [n for n in staged.notes if "does not fit" in n]
    assert 'offload="momentum" (--offload momentum' in note and "torch.int8" in note
    (note,) = [  # an offloaded job is not told to offload
        n for n in dry_run("tiny", 2, offload="momentum", **at_once).notes if "does not fit" in n
    ]
    assert "--offload" not in note and "--momentum-dtype bf16" in note


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"momentum_dtype": torch.float16}, "torch.int8 (blockwise 8-bit)"),
        ({"momentum_dtype": "fp8"}, "['bf16', 'fp32', 'int8']"),
        ({"offload": "cpu"}, "or 'state'"),
        ({"offload": True}, "or 'state'"),
        ({"offload": "momentum", "host_link_gbps": 0}, "a number > 0"),
        ({"offload": "momentum", "host_link_gbps": float("inf")}, "a number > 0"),
        ({"host_link_gbps": 25}, "needs offload='momentum'"),
    ],
)
def test_bad_momentum_storage_names_the_choices(kwargs, message):
    with pytest.raises(ValueError, match="^dry_run: ") as info:
        dry_run("tiny", 2, **kwargs)
    assert message in str(info.value)


def test_the_momentum_storage_is_on_the_command_line(capsys):
    argv = ["--model", "tiny", "--gpus", "2", "--momentum-dtype", "int8", "--offload", "momentum"]
    assert main([*argv, "--host-link-gbps", "50"]) == 0
    out = capsys.readouterr().out
    assert "momentum=int8 (8-bit" in out and "offload=momentum (pinned host memory, 50 GB/s)" in out
    assert "host KiB" in out and "host link KiB/step" in out and "note: momentum storage" in out
    assert main([*argv, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    expected = dry_run("tiny", 2, momentum_dtype=torch.int8, offload="momentum")
    assert [r["host_bytes"] for r in report["rows"]] == [r.host_bytes for r in expected.rows]
    assert report["totals"]["host_bytes"] == sum(r.host_bytes for r in expected.rows) > 0
    assert main(["--model", "tiny", "--gpus", "2", "--momentum-dtype", "fp32"]) == 0
    assert "momentum=" not in capsys.readouterr().out  # fp32: the weights' dtype, the default
    for bad, message in (
        (["--momentum-dtype", "fp16"], "choose from 'fp32', 'bf16', 'int8'"),
        (["--offload", "cpu"], "choose from 'momentum'"),
        (["--offload", "momentum", "--host-link-gbps", "-1"], "a number > 0"),
        (["--host-link-gbps", "10"], "needs offload='momentum'"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["--model", "tiny", "--gpus", "2", *bad])
        assert info.value.code == 2 and message in capsys.readouterr().err, bad


# ----------------------------------------------------------------------------- per-head NS
def _ns_matrices(report) -> dict[tuple, int]:
    """Over all ranks: how many matrices of each shape Newton–Schulz runs."""
    out: dict[tuple, int] = {}
    for row in report.rows:
        for shape, n in row._buckets.items():
            out[tuple(shape)] = out.get(tuple(shape), 0) + n
    return out


def test_per_head_prices_every_head_of_each_projection():
    """llama3-8b: q and o are 32 heads of 128, k and v 8 each (per layer), each an NS matrix."""
    c = PRESETS["llama3-8b"]
    whole = _ns_matrices(dry_run("llama3-8b", 8, advise=False))
    heads = _ns_matrices(dry_run("llama3-8b", 8, per_head=True, advise=False))
    hd = c.dim // c.heads
    assert (hd, c.dim) not in whole
    # per layer: q's 32 heads and k's and v's 8 kv heads of rows, o's 32 heads of columns
    assert heads[(hd, c.dim)] == c.layers * (c.heads + 2 * c.kv_heads)
    assert heads[(c.dim, hd)] == c.layers * c.heads
    assert (c.dim, c.dim) in whole and (c.dim, c.dim) not in heads


def test_per_head_under_tp_runs_whole_heads_on_each_tp_rank_without_the_gather():
    """TP 2: every attention projection's shards hold 16 (q, o) or 4 (k, v) whole heads, so each
    TP rank of the owner column runs its own (the NS matrices the same in number, spread over
    both TP ranks) and the TP gather/scatter moves the MLP matrices only."""
    c = PRESETS["llama3-8b"]
    hd = c.dim // c.heads
    whole = dry_run("llama3-8b", 16, tp_size=2, advise=False)
    heads = dry_run("llama3-8b", 16, tp_size=2, per_head=True, advise=False)
    ns = _ns_matrices(heads)
    assert ns[(hd, c.dim)] == c.layers * (c.heads + 2 * c.kv_heads)
    assert ns[(c.dim, hd)] == c.layers * c.heads
    for shape in ((hd, c.dim), (c.dim, hd)):  # both TP ranks of a column run as many heads
        per_rank = [r._buckets.get(shape, 0) for r in heads.rows]
        assert all(per_rank[2 * d] == per_rank[2 * d + 1] for d in range(8)), per_rank
    mlp = sum(p.numel() for n, p in build_model("llama3-8b")[1].named_parameters() if ".mlp." in n)
    gathered = sum(r.tp_comm_bytes for r in heads.rows)
    # per MLP matrix: the other TP rank sends its shard of u (fp32) and gets its shard of the
    # update (the fp32 weight) back, counted on both ends: 2 × (4 + 4) bytes per half element
    assert gathered == pytest.approx(2 * 8 * mlp / 2, rel=1e-6)
    assert sum(r.tp_comm_bytes for r in whole.rows) > gathered  # the control: q, k, v, o too


def test_per_head_needs_an_attention_module_and_is_on_the_command_line(capsys):
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    with pytest.raises(ValueError, match="no attention module recognised"):
        dry_run(mlp, 4, per_head=True, advise=False)
    assert main(["--model", "tiny", "--gpus", "4", "--tp", "2", "--per-head", "--top", "1"]) == 0
    assert "rank" in capsys.readouterr().out


# ------------------------------------------------------------- a streamed stored momentum
def test_a_streamed_offload_holds_the_buckets_in_flight_and_hides_the_copy_under_ns():
    """llama3-70b on 8 GPUs, offloaded: the step holds the working momentum of at most
    ``in_flight`` shape buckets (each at most the stack cap of fp32 values), fewer buckets
    less, all at once the whole; the copy-in beyond the first bucket hides under NS."""
    cap = 1 << 30
    kw = dict(offload="momentum", stack_bytes=cap, advise=False)
    gpu = dry_run("llama3-70b", 8, stack_bytes=cap, advise=False)
    runs = {n: dry_run("llama3-70b", 8, momentum_in_flight=n, **kw) for n in (1, 2, None)}
    for g, one, two, every in zip(gpu.rows, *(r.rows for r in runs.values())):
        total = every._momentum_step_bytes
        assert total == every._momentum_working_bytes > 4 * cap
        assert one._momentum_step_bytes <= cap < two._momentum_step_bytes <= 2 * cap
        for row in (one, two):
            saved = total - row._momentum_step_bytes
            assert every.step_extra_bytes - row.step_extra_bytes == saved > 0
            assert row.host_bytes == every.host_bytes and row.host_link_bytes == 2 * row.host_bytes
            # the first bucket's copy is exposed; with NS longer than the rest's copy, no more
            first = row.host_bytes * one._momentum_step_bytes / total
            assert row.step_ms - g.step_ms == pytest.approx(first / 25e9 * 1e3, rel=1e-6)
        assert every.step_ms - g.step_ms == pytest.approx(every.host_bytes / 25e9 * 1e3, rel=1e-9)
    note = runs[2].notes[-1]
    assert "2 shape buckets' momentum at a time" in note and "bucket by bucket" in note


def test_a_streamed_8bit_momentum_keeps_the_new_codes_beside_the_old_until_the_commit():
    model = build_model(ODD_DENSE)[1]
    fp32 = dry_run(model, 2, stack_bytes=4096, advise=False)
    int8 = dry_run(model, 2, momentum_dtype="int8", stack_bytes=4096, advise=False)
    for a, b in zip(fp32.rows, int8.rows):
        held = b._momentum_step_bytes - b._momentum_gpu_bytes  # the buckets in flight
        assert 0 < held < b._momentum_working_bytes
        assert b.step_extra_bytes - a.step_extra_bytes == held + b._momentum_gpu_bytes


def test_a_step_with_stages_materialises_the_momentum_at_once_whatever_in_flight_says():
    """TP 2 (a TP stage reads every buffer before the local directions run)."""
    kw = dict(tp_size=2, offload="momentum", stack_bytes=1 << 30, advise=False)
    streamed = dry_run("llama3-8b", 8, **kw)
    every = dry_run("llama3-8b", 8, momentum_in_flight=None, **kw)
    assert [r.step_extra_bytes for r in streamed.rows] == [r.step_extra_bytes for r in every.rows]
    assert [r.step_ms for r in streamed.rows] == [r.step_ms for r in every.rows]


@pytest.mark.parametrize("value, ok", [("all", True), ("1", True), ("0", False), ("x", False)])
def test_momentum_in_flight_on_the_command_line(value, ok, capsys):
    argv = ["--model", "tiny", "--gpus", "2", "--offload", "momentum"]
    if ok:
        assert main([*argv, "--momentum-in-flight", value]) == 0
        want = "all" if value == "all" else value
        assert f"momentum in flight={want}" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit):
            main([*argv, "--momentum-in-flight", value])
        assert "shape buckets >= 1, or all" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^dry_run: momentum_in_flight=0"):
        dry_run("tiny", 2, offload="momentum", momentum_in_flight=0)


def test_an_offloaded_stream_is_priced_in_buckets_of_the_offload_cap():
    """Offloaded, the streamed buckets are cut to ``OFFLOAD_BUCKET_BYTES`` whatever the stack
    cap (4 GiB by default), as the optimizer cuts them; control: the 8-bit momentum on the GPU
    keeps NS's 4 GiB buckets (each of 70B's 0.94 GiB matrices joins three more)."""
    from dmuon_compile.momentum_storage import OFFLOAD_BUCKET_BYTES

    kw = dict(momentum_in_flight=1, advise=False)
    off = dry_run("llama3-70b", 8, offload="momentum", **kw)
    int8 = dry_run("llama3-70b", 8, momentum_dtype="int8", **kw)
    for a, b in zip(off.rows, int8.rows):
        assert 0 < a._momentum_step_bytes <= OFFLOAD_BUCKET_BYTES
        assert b._momentum_step_bytes - b._momentum_gpu_bytes > 2 * OFFLOAD_BUCKET_BYTES


def test_an_offloaded_streams_newton_schulz_is_priced_in_the_buckets_it_runs_in():
    """The streamed offloaded step runs NS in the buckets it cuts at ``OFFLOAD_BUCKET_BYTES``
    (one of 70B's 0.94 GiB matrices each, not four): the dry run prices NS there, so its NS ms
    differ from the in-place step's; control: offloaded all at once, NS runs in the stack
    cap's buckets and costs what the in-place step's does."""
    from dmuon_compile.momentum_storage import OFFLOAD_BUCKET_BYTES
    from dmuon_compile.ns_rates import H200

    base = dry_run("llama3-70b", 8, advise=False)
    off = dry_run("llama3-70b", 8, offload="momentum", advise=False)
    whole = dry_run("llama3-70b", 8, offload="momentum", momentum_in_flight=None, advise=False)
    for b, o, w in zip(base.rows, off.rows, whole.rows):
        cap = OFFLOAD_BUCKET_BYTES
        capped = sum(H200.bucket_ms(shape, n, cap) for shape, n in b._buckets.items())
        assert o.ns_ms == pytest.approx(capped)
        assert o.ns_ms != pytest.approx(b.ns_ms)
        assert w.ns_ms == pytest.approx(b.ns_ms)


def test_a_link_bound_offload_says_the_host_link_sets_the_pace():
    """Model E on one GPU (small expert matrices: NS covers a quarter of the copy) gets the
    note; Llama-3 70B on 8 (NS covers the copy but its first bucket) does not."""
    e = dry_run("E", 1, offload="momentum", advise=False)
    assert "the host link sets this step's pace" in e.notes[-1]
    share = e.rows[0]._copy_in_ms / e.rows[0].step_ms
    assert f"{share:.0%} of its 'step ms'" in e.notes[-1]
    big = dry_run("llama3-70b", 8, offload="momentum", advise=False)
    assert "bucket by bucket" in big.notes[-1] and "sets this step's pace" not in big.notes[-1]
