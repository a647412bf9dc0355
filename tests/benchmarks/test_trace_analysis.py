"""benchmarks/trace_analysis.py on hand-built Chrome traces (exact numbers), a gzip round trip,
a real CPU-only torch.profiler trace (no GPU events), and a brute-force property check."""

from __future__ import annotations

import gzip
import json

import pytest
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given
from hypothesis import strategies as st

ta = load_benchmark("trace_analysis")

AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
BC = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"
ELT = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)"


def ev(name, ts, dur, stream=7, device=0, cat="kernel", **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": device,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"device": device, "stream": stream, **args},
    }


def trace(*events):
    cpu = {
        "ph": "X",
        "cat": "cpu_op",
        "name": "aten::mm",
        "pid": 1,
        "tid": 1,
        "ts": -500,
        "dur": 9000,
        "args": {},
    }
    return {
        "traceEvents": [cpu, {"ph": "M", "name": "process_name", "pid": 0, "args": {}}, *events]
    }


def test_fully_hidden_comm_is_not_exposed():
    t = trace(ev(GEMM, 0, 100), ev(AG, 10, 50, stream=20))
    r = ta.exposed_comm(t)
    assert (r["window_us"], r["busy_compute_us"], r["comm_us"], r["exposed_comm_us"]) == (
        100,
        100,
        50,
        0,
    )
    assert r["exposed_fraction"] == 0
    assert r["by_kind"] == {"all_gather": {"count": 1, "comm_us": 50, "exposed_us": 0}}


def test_comm_alone_is_all_exposed():
    r = ta.exposed_comm(trace(ev(AG, 0, 40, stream=20)))
    assert (r["window_us"], r["comm_us"], r["exposed_comm_us"], r["exposed_fraction"]) == (
        40,
        40,
        40,
        1.0,
    )
    r = ta.exposed_comm(trace(ev(AG, 0, 40, stream=20), ev(GEMM, 50, 50)))
    assert (r["window_us"], r["exposed_comm_us"], r["exposed_fraction"]) == (100, 40, 0.4)


def test_partial_overlap_and_kinds():
    t = trace(ev(GEMM, 0, 50), ev(RS, 30, 50, stream=20), ev(AG, 90, 10, stream=21))
    r = ta.exposed_comm(t)
    assert (r["window_us"], r["comm_us"], r["exposed_comm_us"]) == (100, 60, 40)
    assert r["exposed_fraction"] == 0.4
    assert r["by_kind"]["reduce_scatter"] == {"count": 1, "comm_us": 50, "exposed_us": 30}
    assert r["by_kind"]["all_gather"] == {"count": 1, "comm_us": 10, "exposed_us": 10}


def test_memcpy_is_not_compute():
    t = trace(
        ev(AG, 0, 40, stream=20), ev("Memcpy DtoD (Device -> Device)", 0, 40, cat="gpu_memcpy")
    )
    assert ta.exposed_comm(t)["exposed_comm_us"] == 40


def test_streams_and_devices():
    t = trace(
        ev(GEMM, 0, 20, stream=7),
        ev(ELT, 10, 20, stream=8),  # compute union [0, 30]
        ev(AG, 25, 20, stream=20),
        ev(RS, 40, 20, stream=21),  # comm union [25, 60]
        ev(BC, 0, 10, stream=20, device=1),  # device 1: comm alone
    )
    d0, d1, both = ta.exposed_comm(t, device=0), ta.exposed_comm(t, device=1), ta.exposed_comm(t)
    assert (d0["window_us"], d0["busy_compute_us"], d0["comm_us"], d0["exposed_comm_us"]) == (
        60,
        30,
        35,
        30,
    )
    assert (d1["window_us"], d1["comm_us"], d1["exposed_comm_us"]) == (10, 10, 10)
    # device 0's compute does not hide device 1's collective: the devices add up
    assert (both["window_us"], both["exposed_comm_us"]) == (70, 40)
    assert both["exposed_fraction"] == pytest.approx(40 / 70)
    assert set(both["per_device"]) == {"0", "1"}
    assert "per_device" not in d0
    assert len(ta.gpu_events(t)) == 5 and len(ta.gpu_events(t, device=1)) == 1
    name, start, end, stream, cat = ta.gpu_events(t, device=1)[0]
    assert (name, start, end, stream, cat) == (BC, 0, 10, 20, "kernel")


def test_hidden_fraction():
    t = trace(ev(BC, 0, 100, stream=20), ev(GEMM, 20, 30), ev(ELT, 40, 30, stream=8))
    assert ta.hidden_fraction(t, "broadcast") == 0.5  # compute covers [20, 70]
    assert ta.hidden_fraction(t, "all_gather") is None
    assert ta.hidden_fraction(trace(ev(GEMM, 0, 10))) is None


def test_hidden_fraction_by_group():
    rep = {"Process Group Description": "mesh_replicate"}
    shard = {"Process Group Description": "mesh_shard"}
    t = trace(
        ev(BC, 0, 100, stream=20, **rep),
        ev(BC, 200, 100, stream=21, **shard),
        ev(GEMM, 200, 100),
        ev(GEMM, 0, 25),
    )
    assert ta.hidden_fraction(t, "broadcast") == 125 / 200
    assert ta.hidden_fraction(t, "broadcast", group="replicate") == 0.25
    assert ta.hidden_fraction(t, "broadcast", group="shard") == 1.0
    assert ta.hidden_fraction(t, "broadcast", group="tensor") is None
    s = ta.summarize(t, 1)
    assert (
        s["replicate_broadcast_hidden_fraction"] == 0.25 and s["broadcast_hidden_fraction"] == 0.625
    )


@pytest.mark.parametrize(
    "name, collective, kind",
    [
        (AG, None, "all_gather"),
        (RS, None, "reduce_scatter"),
        (BC, None, "broadcast"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", None, "all_reduce"),
        ("ncclDevKernel_Reduce_Sum_bf16_RING_LL", None, "reduce"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", None, "other"),
        ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", None, "other"),
        (
            "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
            "_allgather_base",
            "all_gather",
        ),
        ("ncclDevKernel_Generic_4", "reduce_scatter_tensor_coalesced", "reduce_scatter"),
        (AG, "coalesced", "all_gather"),
        # c10d gather/scatter (the TP stage) run as send/recv: the collective name decides
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "gather", "gather"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "scatter", "scatter"),
        ("ncclDevKernel_Generic", "allgather_into_tensor_coalesced", "all_gather"),
        ("ncclDevKernel_Generic", "reduce_scatter_tensor", "reduce_scatter"),
    ],
)
def test_comm_kind(name, collective, kind):
    assert ta.is_comm_kernel(name)
    assert ta.comm_kind(name, collective) == kind


def test_comm_kind_uses_collective_name_from_args():
    t = trace(ev("ncclDevKernel_Generic(x)", 0, 10, stream=20, **{"Collective name": "broadcast"}))
    assert ta.hidden_fraction(t, "broadcast") == 0.0


@pytest.mark.parametrize(
    "name",
    [
        "void c10d::detail::copy_kernel<float>(float*)",
        "void at::native::(anonymous)::chunk_cat_cuda_kernel",
        GEMM,
        "triton_poi_fused_0",
        "Memcpy DtoD",
    ],
)
def test_not_comm(name):
    assert not ta.is_comm_kernel(name)


def test_breakdown():
    t = trace(
        ev(GEMM, 0, 1000),
        ev("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm>(...)", 0, 500, stream=8),
        ev("_symmetric_product_kernel", 1000, 200),
        ev("_symmetric_product_tma_kernel", 1200, 100),
        ev("_mirror_lower_kernel", 1300, 100),
        ev("triton_poi_fused_add_mul_0", 1400, 50),
        ev(AG, 0, 2000, stream=20),
        ev("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>(...)", 2000, 700),
        ev(ELT, 2700, 40),
        ev(ELT, 2740, 60),
        ev("Memcpy HtoD (Pageable -> Device)", 3000, 30, cat="gpu_memcpy"),
        ev("Memset (Device)", 3030, 20, cat="gpu_memset"),
    )
    b = ta.breakdown(t)
    assert b["ms"] == pytest.approx(
        {
            "gemm": 1.5,
            "triton": 0.45,
            "nccl": 2.0,
            "attention": 0.7,
            "elementwise_other": 0.1,
            "memcpy_memset": 0.05,
        }
    )
    assert b["total_ms"] == pytest.approx(4.8)
    top = b["top_kernels"]
    assert [e["name"] for e in top[:2]] == [AG, GEMM]
    elt = next(e for e in top if e["name"] == ELT)
    assert (
        elt["count"] == 2
        and elt["ms"] == pytest.approx(0.1)
        and elt["category"] == "elementwise_other"
    )
    s = ta.summarize(t, iterations=2)
    assert s["breakdown_ms_per_iter"]["gemm"] == pytest.approx(0.75)
    assert s["gpu_ms_per_iter"] == pytest.approx(2.4)
    assert s["top_kernels"][0]["ms_per_iter"] == pytest.approx(1.0)


def test_top_kernels_capped():
    t = trace(*(ev(f"kernel_{i}", i * 10, i + 1) for i in range(40)))
    top = ta.breakdown(t)["top_kernels"]
    assert len(top) == ta.TOP_KERNELS and top[0]["name"] == "kernel_39"


def test_summarize_per_iteration_and_format():
    t = trace(ev(GEMM, 0, 3000), ev(BC, 2000, 3000, stream=20), ev(AG, 6000, 3000, stream=21))
    s = ta.summarize(t, iterations=3)
    assert s["window_ms_per_iter"] == pytest.approx(3.0)
    assert s["exposed_comm_ms_per_iter"] == pytest.approx(5 / 3)
    assert s["exposed_fraction"] == pytest.approx(5 / 9)
    assert s["comm_by_kind"]["broadcast"]["hidden_fraction"] == pytest.approx(1 / 3)
    assert s["comm_by_kind"]["all_gather"]["exposed_ms_per_iter"] == pytest.approx(1.0)
    json.dumps(s)
    text = "\n".join(ta.format_summary(s))
    assert "55.6%" in text and "broadcast" in text and "gemm" in text


def test_gzip_round_trip(tmp_path):
    t = trace(ev(GEMM, 0, 50), ev(RS, 30, 50, stream=20))
    plain, packed, misnamed = (
        tmp_path / "t.json",
        tmp_path / "t.json.gz",
        tmp_path / "gz_named.json",
    )
    plain.write_text(json.dumps(t))
    with gzip.open(packed, "wt") as f:
        json.dump(t, f)
    misnamed.write_bytes(gzip.compress(json.dumps(t).encode()))
    want = ta.summarize(t, 1)
    for path in (plain, packed, misnamed, str(packed)):
        assert ta.summarize(path, 1) == want
    assert want["exposed_comm_ms_per_iter"] == pytest.approx(0.03)
    (tmp_path / "array.json").write_text(json.dumps(t["traceEvents"]))
    assert ta.summarize(tmp_path / "array.json", 1) == want


def test_real_cpu_profiler_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            a @ a
    path = tmp_path / "cpu_trace.json"
    prof.export_chrome_trace(str(path))
    s = ta.summarize(path, iterations=2)
    assert s["gpu_events"] == 0 and s["devices"] == []
    assert s["exposed_fraction"] is None and s["broadcast_hidden_fraction"] is None
    assert s["replicate_broadcast_hidden_fraction"] is None and s["comm_by_kind"] == {}
    assert s["window_ms_per_iter"] == 0 and s["exposed_comm_ms_per_iter"] == 0
    assert set(s["breakdown_ms_per_iter"].values()) == {0.0} and s["top_kernels"] == []
    json.dumps(s)
    assert "no GPU events" in ta.format_summary(s)[0]


def test_interval_helpers():
    assert ta.union([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert ta.total_length([(0, 10), (5, 15), (20, 21)]) == 16
    assert ta.overlap_length([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert ta.minus_length([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert ta.minus_length([(0, 10)], []) == 10 and ta.overlap_length([], [(0, 1)]) == 0


_interval = st.tuples(st.integers(0, 40), st.integers(0, 12), st.booleans(), st.integers(0, 2))


@given(st.lists(_interval, max_size=12))
def test_exposed_matches_brute_force(items):
    events = [
        ev(AG if comm else GEMM, s, d, stream=stream + (20 if comm else 0))
        for s, d, comm, stream in items
    ]
    r = ta.exposed_comm(trace(*events))
    grid = range(60)
    comm_at = {t for s, d, c, _ in items if c for t in grid if s <= t < s + d}
    comp_at = {t for s, d, c, _ in items if not c for t in grid if s <= t < s + d}
    assert r["comm_us"] == len(comm_at)
    assert r["busy_compute_us"] == len(comp_at)
    assert r["exposed_comm_us"] == len(comm_at - comp_at)
    assert r["exposed_comm_us"] == r["comm_us"] - len(comm_at & comp_at)
    window = (max(s + d for s, d, _, _ in items) - min(s for s, _, _, _ in items)) if items else 0
    assert r["window_us"] == window
    assert 0 <= r["exposed_comm_us"] <= r["comm_us"] <= r["window_us"]
    bc = ta.hidden_fraction(trace(*events), "all_gather")
    assert bc == (len(comm_at & comp_at) / len(comm_at) if comm_at else None)


def _step_annotation(ts):
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": "Optimizer.step#Muon.step",
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": 5,
        "args": {},
    }


def test_publish_hidden_fraction_excludes_the_last_steps_broadcasts():
    # Two iterations: a broadcast after step 1 hidden under the next forward's GEMM, and the
    # last step's broadcast with nothing after it (excluded from publish_hidden_fraction).
    t = trace(
        _step_annotation(100),
        ev(BC, 110, 20, stream=20),
        ev(GEMM, 105, 40),
        _step_annotation(200),
        ev(BC, 210, 20, stream=20),
    )
    assert ta.last_annotation_start(t) == 200
    s = ta.summarize(t, iterations=2)
    assert s["publish_hidden_fraction"] == 1.0
    assert s["broadcast_hidden_fraction"] == 0.5  # all broadcasts: half their time is covered
    no_steps = ta.summarize(trace(ev(BC, 0, 10, stream=20)), iterations=1)
    assert no_steps["publish_hidden_fraction"] is None


def test_gpu_idle_is_the_window_minus_every_gpu_event():
    t = trace(ev(GEMM, 0, 10), ev(AG, 5, 10, stream=20), ev(ELT, 30, 10), ev(GEMM, 0, 5, device=1))
    recs = ta._records(t)
    assert ta.gpu_idle_us(recs) == 15.0  # device 0: window 40, busy [0, 15) ∪ [30, 40)
    s = ta.summarize(t, iterations=1)
    assert s["gpu_idle_ms_per_iter"] == pytest.approx(0.015)


SR = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def test_tp_scatter_hidden_fraction_excludes_the_last_steps_scatter():
    # Step 1's scatter half under the next forward's GEMM; the last step's scatter has nothing
    # after it (left out); the gather (inside step) is counted over the whole window.
    gather, scatter = {"Collective name": "gather"}, {"Collective name": "scatter"}
    t = trace(
        _step_annotation(100),
        ev(SR, 100, 10, stream=20, **gather),
        ev(SR, 120, 20, stream=20, **scatter),
        ev(GEMM, 130, 40),
        _step_annotation(200),
        ev(SR, 200, 10, stream=20, **gather),
        ev(SR, 210, 20, stream=20, **scatter),
    )
    s = ta.summarize(t, iterations=2)
    assert s["tp_scatter_hidden_fraction"] == 0.5
    assert s["tp_gather_hidden_fraction"] == 0.0
    assert set(s["comm_by_kind"]) == {"gather", "scatter"}
    assert any("TP scatter issued before the last step" in line for line in ta.format_summary(s))
    # Control: without the collective names the same kernels are "other" and get no TP share.
    bare = trace(_step_annotation(100), ev(SR, 120, 20, stream=20), _step_annotation(200))
    b = ta.summarize(bare, iterations=2)
    assert b["tp_scatter_hidden_fraction"] is None and set(b["comm_by_kind"]) == {"other"}


def _range(name, ts, dur):
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": dur,
        "args": {},
    }


def test_dmuon_labels_split_the_timeline_and_time_the_phases():
    # Muon.step's own range wins over torch's Optimizer.step annotation (a step inside a
    # user-compiled or wrapped optimizer may carry neither); each dmuon:: phase gets its host
    # time, per iteration.
    t = trace(
        _step_annotation(100),
        _range("dmuon::step", 150, 40),
        _range("dmuon::publish", 180, 6),
        _range("dmuon::unshard", 10, 4),
        _range("dmuon::unshard", 210, 2),
        _range("FSDP::all_gather", 20, 9),
        ev(GEMM, 0, 10),
    )
    assert ta.last_annotation_start(t) == 150
    assert ta.last_annotation_start(t, "Optimizer.step") == 100
    assert ta.phase_host_ms(t) == pytest.approx(
        {
            "dmuon::publish": 0.006,
            "dmuon::step": 0.04,
            "dmuon::unshard": 0.006,
        }
    )
    s = ta.summarize(t, iterations=2)
    assert s["dmuon_host_ms_per_iter"] == pytest.approx(
        {
            "dmuon::publish": 0.003,
            "dmuon::step": 0.02,
            "dmuon::unshard": 0.003,
        }
    )


def host(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def test_idle_gaps_are_charged_to_the_innermost_host_event():
    t = trace(
        ev(GEMM, 0, 10),
        ev(ELT, 15, 5),  # a 5 µs hole at 10: the host was launching inside a custom op
        ev(GEMM, 40, 10),  # a 20 µs hole at 20: the host was waiting in a synchronisation
        ev(ELT, 51, 1),  # a 1 µs hole: below min_gap_us, not a gap
        host("dmuon::step", 0, 100, cat="user_annotation"),
        host("dmuon::syrk", 8, 6),
        host("cudaLaunchKernel", 9, 5, cat="cuda_runtime"),
        host("cudaStreamSynchronize", 18, 20, cat="cuda_runtime"),
    )
    got = ta.idle_gaps(t, min_gap_us=2.0)
    assert got["gaps"] == 2 and got["idle_us"] == pytest.approx(25.0)
    assert got["by_host"] == [
        ("dmuon::step > cudaStreamSynchronize", pytest.approx(20.0), 1),
        ("dmuon::syrk > cudaLaunchKernel", pytest.approx(5.0), 1),
    ]
    assert ta.idle_gaps(trace(), min_gap_us=2.0) == {"idle_us": 0.0, "gaps": 0, "by_host": []}


def test_compare_two_traces_kernel_by_kernel(tmp_path):
    """``compare``: per iteration, each trace's window, GPU work and idle, and the kernels by
    how much more time the second trace spends in them (exact numbers on hand-built traces);
    the CLI's ``--against`` prints the same."""
    base = trace(ev(GEMM, 0, 100), ev(ELT, 100, 60), ev(GEMM, 300, 100))  # 2 iterations
    other = trace(
        ev(GEMM, 0, 100), ev(ELT, 100, 20), ev(AG, 150, 200, stream=20), ev(GEMM, 400, 100)
    )
    got = ta.compare(base, other, iterations=2, top=3)
    assert got["base"] == pytest.approx({"window_ms": 0.2, "gpu_ms": 0.13, "idle_ms": 0.07})
    assert got["other"] == pytest.approx({"window_ms": 0.25, "gpu_ms": 0.21, "idle_ms": 0.04})
    names = [row[0] for row in got["more"]]
    assert names[0] == AG[: ta.NAME_CHARS]
    assert got["more"][0][1:] == pytest.approx((0.1, 0.0, 0.1))
    assert got["less"][0][0] == ELT[: ta.NAME_CHARS]
    assert got["less"][0][3] == pytest.approx(-0.02)
    a, b = tmp_path / "base.json", tmp_path / "other.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(other))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ta.main([str(b), "--against", str(a), "--iterations", "2", "--gaps"]) == 0
    assert "+0.100     0.100     0.000  ncclDevKernel_AllGather" in out.getvalue()
    assert "GPU idle 0.07" in out.getvalue()
    assert f"GPU idle in {a}: 0.070 ms" in out.getvalue()
