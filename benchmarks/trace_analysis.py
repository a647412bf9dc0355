"""Exposed communication and "where the GPU time goes", read from a torch.profiler trace.

Input: the Chrome trace dict that ``torch.profiler.profile(...).export_chrome_trace(path)``
writes (plain ``.json`` or ``.json.gz``). Only GPU activity is read: events with ``"cat"`` in
``kernel`` / ``gpu_memcpy`` / ``gpu_memset``, ``"ts"`` and ``"dur"`` in microseconds, and
``"args"`` carrying ``"device"`` and ``"stream"``. Standard library only (``profile_calls`` imports
torch when called), so it runs wherever a trace file lands.

Definitions (per device; with several devices in one trace the times add up, device by device):

- *communication*: NCCL kernels (names starting ``nccl``); *compute*: every other kernel.
  Memcpy/memset (copy engines) are neither: they are counted in the breakdown only.
- ``exposed_comm_us`` = |union(comm) − union(compute)|: time in which a collective runs on the
  GPU and no compute kernel does — the GPU waits on communication. ``exposed_fraction`` divides
  it by the window (first GPU event start to last GPU event end).
- ``hidden_fraction(kind)`` = |union(kind) ∩ union(compute)| / |union(kind)|.

Caveat: an NCCL kernel starts when it is launched and spins until its peers arrive, so its
duration includes waiting on the slowest rank; exposed time is an upper bound on the time the
wire itself costs.

    python benchmarks/trace_analysis.py trace.json.gz --iterations 3   # summary + JSON
    python benchmarks/trace_analysis.py ours.json.gz --against adamw.json.gz --iterations 3

``profile_calls(fn, calls, device)`` profiles a callable and returns this module's summary of it
per call; ``where_the_time_goes`` prints that (bench_step.py: per optimizer step; bench_kernels.py
--profile-ns: per NS call).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "other",
)
CATEGORIES = ("gemm", "triton", "nccl", "attention", "elementwise_other", "memcpy_memset")
TOP_KERNELS = 15
NAME_CHARS = 160  # kernel names (demangled templates) can run to kilobytes


# ---------------------------------------------------------------------------- loading


def load_trace(path_or_dict):
    """A trace dict from a dict, a ``.json`` path or a gzip-compressed one (sniffed, not named)."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    if isinstance(path_or_dict, list):  # the bare-array form of the Chrome trace format
        return {"traceEvents": path_or_dict}
    with open(path_or_dict, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw.decode("utf-8", errors="replace"))
    return {"traceEvents": data} if isinstance(data, list) else data


def _strip(name: str) -> str:
    return name.strip().removeprefix("void ")


def _records(trace, device=None):
    """GPU events as dicts (name, start, end, stream, cat, device, collective, group)."""
    out = []
    for ev in load_trace(trace).get("traceEvents", []):
        if not isinstance(ev, dict) or ev.get("cat") not in GPU_CATS or ev.get("ph", "X") != "X":
            continue
        try:
            start, dur = float(ev["ts"]), float(ev["dur"])
        except (KeyError, TypeError, ValueError):
            continue
        args = ev.get("args") or {}
        dev = args.get("device", ev.get("pid"))
        if device is not None and str(dev) != str(device):
            continue
        group = args.get("Process Group Description") or args.get("Process Group Name")
        out.append(
            {
                "name": str(ev.get("name", "")),
                "start": start,
                "end": start + max(dur, 0.0),
                "stream": args.get("stream", ev.get("tid")),
                "cat": ev["cat"],
                "device": dev,
                "collective": args.get("Collective name"),
                "group": None if group is None else str(group),
            }
        )
    return out


def gpu_events(trace, device=None):
    """``[(name, start_us, end_us, stream, cat)]`` for kernels, memcpys and memsets."""
    return [
        (r["name"], r["start"], r["end"], r["stream"], r["cat"]) for r in _records(trace, device)
    ]


# ---------------------------------------------------------------------------- classification


def is_comm_kernel(name: str) -> bool:
    """NCCL kernels (``ncclDevKernel_*``, ``ncclKernel_*``, ...); c10d copy kernels are compute."""
    return _strip(name).lower().startswith("nccl")


def comm_kind(name: str, collective: str | None = None) -> str:
    """The collective of an NCCL kernel, from the profiler's ``Collective name`` when given,
    else from the kernel name (``ncclDevKernel_Generic`` carries none: ``"other"``)."""
    for text in (collective, _strip(name)):
        if not text:
            continue
        t = text.lower().replace("_", "")
        if "allgather" in t:
            return "all_gather"
        if "reducescatter" in t:
            return "reduce_scatter"
        if "allreduce" in t:
            return "all_reduce"
        if "broadcast" in t:
            return "broadcast"
        if "reduce" in t:
            return "reduce"
        # c10d's gather/scatter (the TP stage's) run as NCCL send/recv: only the profiler's
        # collective name tells them apart, the kernel name (SendRecv) does not.
        if "gather" in t:
            return "gather"
        if "scatter" in t:
            return "scatter"
    return "other"


def category(name: str, cat: str = "kernel") -> str:
    """The breakdown bucket of one GPU event (see ``CATEGORIES``)."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy_memset"
    if is_comm_kernel(name):
        return "nccl"
    low = _strip(name).lower()
    if "_symmetric_product" in low or "_mirror_lower_kernel" in low or "triton_" in low:
        return "triton"
    if any(k in low for k in ("flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    if any(k in low for k in ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "gemv")):
        return "gemm"
    if low.startswith(("memcpy", "memset")):
        return "memcpy_memset"
    return "elementwise_other"


# ---------------------------------------------------------------------------- intervals


def union(intervals):
    """Sorted, disjoint ``[(start, end)]`` covering the same points; empty ones dropped."""
    merged = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def total_length(intervals) -> float:
    """Length of the union (overlaps counted once)."""
    return float(sum(e - s for s, e in union(intervals)))


def overlap_length(a, b) -> float:
    """|union(a) ∩ union(b)|."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def minus_length(a, b) -> float:
    """|union(a) − union(b)|: the part of a that b does not cover."""
    return total_length(a) - overlap_length(a, b)


# ---------------------------------------------------------------------------- metrics


def _by_device(records):
    groups = defaultdict(list)
    for r in records:
        groups[r["device"]].append(r)
    return dict(sorted(groups.items(), key=lambda kv: str(kv[0])))


def _exposed_one(records):
    compute = [
        (r["start"], r["end"])
        for r in records
        if r["cat"] == "kernel" and not is_comm_kernel(r["name"])
    ]
    comm_recs = [r for r in records if r["cat"] == "kernel" and is_comm_kernel(r["name"])]
    comm = [(r["start"], r["end"]) for r in comm_recs]
    window = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    by_kind = {}
    for kind in COMM_KINDS:
        iv = [
            (r["start"], r["end"])
            for r in comm_recs
            if comm_kind(r["name"], r["collective"]) == kind
        ]
        if iv:
            by_kind[kind] = {
                "count": len(iv),
                "comm_us": total_length(iv),
                "exposed_us": minus_length(iv, compute),
            }
    return {
        "window_us": float(window),
        "busy_compute_us": total_length(compute),
        "comm_us": total_length(comm),
        "exposed_comm_us": minus_length(comm, compute),
        "by_kind": by_kind,
    }


def exposed_comm(trace, device=None) -> dict:
    """Window, compute busy time, comm union and exposed comm (µs), plus the same per kind.

    ``by_kind[k]["exposed_us"]`` is kind k's union minus compute: kinds running at the same
    time on different streams are each counted, so those can add up to more than the total.
    """
    return _exposed(_records(trace, device))


def _exposed(records) -> dict:
    per_device = {dev: _exposed_one(recs) for dev, recs in _by_device(records).items()}
    out = {
        "window_us": 0.0,
        "busy_compute_us": 0.0,
        "comm_us": 0.0,
        "exposed_comm_us": 0.0,
        "by_kind": {},
    }
    for res in per_device.values():
        for key in ("window_us", "busy_compute_us", "comm_us", "exposed_comm_us"):
            out[key] += res[key]
        for kind, k in res["by_kind"].items():
            agg = out["by_kind"].setdefault(kind, {"count": 0, "comm_us": 0.0, "exposed_us": 0.0})
            for key in agg:
                agg[key] += k[key]
    out["exposed_fraction"] = (
        out["exposed_comm_us"] / out["window_us"] if out["window_us"] > 0 else None
    )
    out["devices"] = list(per_device)
    if len(per_device) > 1:
        out["per_device"] = {str(d): r for d, r in per_device.items()}
    return out


def hidden_fraction(trace, kind: str = "broadcast", device=None, group: str | None = None):
    """Share of the ``kind`` comm kernels' time (union) that compute kernels overlap.

    ``group``: keep only kernels whose process-group description/name contains it (e.g.
    ``"replicate"`` for the DeviceMesh group ``mesh_replicate``). None when nothing matches.
    """
    return _hidden(_records(trace, device), kind, group)


def _hidden(records, kind, group=None):
    covered = total = 0.0
    for recs in _by_device(records).values():
        compute = [
            (r["start"], r["end"])
            for r in recs
            if r["cat"] == "kernel" and not is_comm_kernel(r["name"])
        ]
        mine = [
            (r["start"], r["end"])
            for r in recs
            if r["cat"] == "kernel"
            and is_comm_kernel(r["name"])
            and comm_kind(r["name"], r["collective"]) == kind
            and (group is None or (r["group"] is not None and group in r["group"]))
        ]
        total += total_length(mine)
        covered += overlap_length(mine, compute)
    return covered / total if total > 0 else None


HOST_CATS = ("user_annotation", "cpu_op", "python_function")
# dmuon_compile's record_function ranges (dmuon_compile/trace_labels.py; a literal here: this
# module runs without the package)
LABEL_PREFIX = "dmuon::"
STEP_LABEL = "dmuon::step"


def _host_events(trace, name: str):
    return [
        ev
        for ev in load_trace(trace).get("traceEvents", [])
        if isinstance(ev, dict)
        and ev.get("cat") in HOST_CATS
        and name in str(ev.get("name", ""))
        and "ts" in ev
    ]


def last_annotation_start(trace, name: str | None = None):
    """Start (µs) of the last CPU-side event whose name contains ``name``, or None. Default: the
    last ``Muon.step`` (its ``dmuon::step`` range), else the last ``Optimizer.step``.

    Kineto puts host and device events on one clock, so this splits the GPU timeline: the
    comm kernels issued by the last optimizer step of a profile have no next forward inside
    the window that could hide them.
    """
    names = (name,) if name is not None else (STEP_LABEL, "Optimizer.step")
    for n in names:
        starts = [float(ev["ts"]) for ev in _host_events(trace, n)]
        if starts:
            return max(starts)
    return None


def phase_host_ms(trace) -> dict:
    """Host milliseconds inside each ``dmuon::`` range (``dmuon::unshard``, ``dmuon::reduce``,
    ``dmuon::publish``, ...), summed over its occurrences (nested ranges count in each) and over
    hook groups (``dmuon::unshard (layers.0)`` counts as ``dmuon::unshard``)."""
    out: dict = {}
    for ev in _host_events(trace, LABEL_PREFIX):
        name = str(ev["name"]).split(" (", 1)[0]
        if name.startswith(LABEL_PREFIX):
            out[name] = out.get(name, 0.0) + float(ev.get("dur", 0.0)) / 1e3
    return dict(sorted(out.items()))


def gpu_idle_us(records) -> float:
    """Window minus the union of every GPU event, summed over devices: time no kernel, copy or
    collective ran at all (the host did not keep the GPU fed)."""
    idle = 0.0
    for recs in _by_device(records).values():
        window = max(r["end"] for r in recs) - min(r["start"] for r in recs)
        idle += window - total_length([(r["start"], r["end"]) for r in recs])
    return idle


def idle_gaps(trace, device=None, min_gap_us: float = 2.0, top: int = 15) -> dict:
    """Where the GPU sat idle and what the host was doing then.

    The gaps are the holes (≥ ``min_gap_us``) in the union of every GPU event; each is charged
    to the innermost host event (``cpu_op``, ``user_annotation``, ``python_function``, CUDA
    runtime call) open when the gap began, named with its parent (``parent > inner``). A gap
    charged to a launch or to Python between launches is host-bound (the host did not keep
    the GPU fed); one charged to a synchronisation is the host waiting for the GPU's previous
    work while nothing new was queued. Returns ``{"idle_us", "gaps", "by_host"}``: the total,
    the gap count and the ``top`` host events by idle time charged, as ``(name, us, gaps)``.
    """
    records = _records(trace, device)
    if not records:
        return {"idle_us": 0.0, "gaps": 0, "by_host": []}
    spans = union([(r["start"], r["end"]) for r in records])
    holes = [(end, nxt) for (_, end), (nxt, _) in zip(spans, spans[1:]) if nxt - end >= min_gap_us]
    host = []
    for ev in load_trace(trace).get("traceEvents", []):
        if not isinstance(ev, dict) or ev.get("ph", "X") != "X":
            continue
        if ev.get("cat") not in HOST_CATS + ("cuda_runtime", "cuda_driver"):
            continue
        try:
            host.append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), str(ev["name"])))
        except (KeyError, TypeError, ValueError):
            continue
    host.sort()
    charged: dict = defaultdict(lambda: [0.0, 0])
    for start, end in holes:
        open_now = [h for h in host if h[0] <= start < h[1]]
        open_now.sort(key=lambda h: h[1] - h[0])  # innermost first
        if not open_now:
            name = "(no host event: outside the profiled calls)"
        elif len(open_now) == 1:
            name = open_now[0][2][:NAME_CHARS]
        else:
            name = f"{open_now[1][2][:60]} > {open_now[0][2][:NAME_CHARS]}"
        charged[name][0] += end - start
        charged[name][1] += 1
    ranked = sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "idle_us": sum(e - s for s, e in holes),
        "gaps": len(holes),
        "by_host": [(name, us, n) for name, (us, n) in ranked],
    }


def breakdown(trace, device=None) -> dict:
    """GPU milliseconds per category (sum of durations: concurrent streams both count) and the
    ``TOP_KERNELS`` names by total time."""
    return _breakdown(_records(trace, device))


def _by_name(records) -> dict:
    """GPU milliseconds, launches and category per event name (sum of durations)."""
    per_name = {}
    for r in records:
        entry = per_name.get(r["name"])
        if entry is None:
            cat = category(r["name"], r["cat"])
            entry = per_name[r["name"]] = {
                "name": r["name"][:NAME_CHARS], "category": cat, "count": 0, "ms": 0.0
            }  # fmt: skip
        entry["count"] += 1
        entry["ms"] += (r["end"] - r["start"]) / 1e3
    return per_name


def _breakdown(records) -> dict:
    ms = {c: 0.0 for c in CATEGORIES}
    per_name = _by_name(records)
    for entry in per_name.values():
        ms[entry["category"]] += entry["ms"]
    top = sorted(per_name.values(), key=lambda e: -e["ms"])[:TOP_KERNELS]
    return {"ms": ms, "total_ms": sum(ms.values()), "top_kernels": top}


def summarize(path_or_dict, iterations: int = 1, device=None) -> dict:
    """Everything above in one JSON-serialisable dict; ``*_ms_per_iter`` are per ``iterations``."""
    n = max(int(iterations), 1)

    def per(us):
        return us / 1e3 / n

    trace = load_trace(path_or_dict)
    records = _records(trace, device)
    exp = _exposed(records)
    # Broadcasts a following forward could hide: those issued before the last optimizer step.
    last_step = last_annotation_start(trace)
    before_last = [r for r in records if last_step is None or r["start"] < last_step]
    bd = _breakdown(records)
    by_kind = {}
    for kind, k in exp["by_kind"].items():
        by_kind[kind] = {
            "count": k["count"],
            "ms_per_iter": per(k["comm_us"]),
            "exposed_ms_per_iter": per(k["exposed_us"]),
            "hidden_fraction": _hidden(records, kind),
        }
    return {
        "iterations": n,
        "gpu_events": len(records),
        "devices": [str(d) for d in exp["devices"]],
        "window_ms_per_iter": per(exp["window_us"]),
        "compute_ms_per_iter": per(exp["busy_compute_us"]),
        "comm_ms_per_iter": per(exp["comm_us"]),
        "exposed_comm_ms_per_iter": per(exp["exposed_comm_us"]),
        "exposed_fraction": exp["exposed_fraction"],
        "comm_by_kind": by_kind,
        "broadcast_hidden_fraction": _hidden(records, "broadcast"),
        "publish_hidden_fraction": _hidden(before_last, "broadcast")
        if last_step is not None
        else None,
        "gpu_idle_ms_per_iter": per(gpu_idle_us(records)) if records else 0.0,
        "replicate_broadcast_hidden_fraction": _hidden(records, "broadcast", group="replicate"),
        # TP stage: the gather of Muon inputs runs inside step(); the update scatter of every
        # step but the last can hide under the next forward (the last one has none after it).
        "tp_gather_hidden_fraction": _hidden(records, "gather"),
        "tp_scatter_hidden_fraction": _hidden(before_last, "scatter")
        if last_step is not None
        else None,
        "breakdown_ms_per_iter": {c: v / n for c, v in bd["ms"].items()},
        "dmuon_host_ms_per_iter": {k: v / n for k, v in phase_host_ms(trace).items()},
        "gpu_ms_per_iter": bd["total_ms"] / n,
        "top_kernels": [dict(e, ms_per_iter=e["ms"] / n) for e in bd["top_kernels"]],
        "exposed_comm": exp,
    }


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def format_summary(summary: dict, top: int = 5) -> list[str]:
    """A few markdown-ish lines for logs."""
    n = summary["iterations"]
    if not summary["gpu_events"]:
        return [f"- no GPU events in the trace ({n} iterations profiled; CPU run?)"]
    lines = [
        (
            f"- GPU window {summary['window_ms_per_iter']:.3f} ms/iter ({n} iters): compute busy "
            f"{summary['compute_ms_per_iter']:.3f} ms, comm {summary['comm_ms_per_iter']:.3f} ms, "
            f"exposed comm {summary['exposed_comm_ms_per_iter']:.3f} ms "
            f"({_pct(summary['exposed_fraction'])} of the window)"
        )
    ]
    if summary["comm_by_kind"]:
        kinds = ", ".join(
            f"{k} {v['ms_per_iter']:.3f} ms (exposed {v['exposed_ms_per_iter']:.3f}, hidden "
            f"{_pct(v['hidden_fraction'])}, {v['count']} kernels)"
            for k, v in summary["comm_by_kind"].items()
        )
        lines.append(f"- comm per iter: {kinds}")
    lines.append(
        f"- GPU idle (no kernel, copy or collective at all: host-bound) "
        f"{summary.get('gpu_idle_ms_per_iter', 0.0):.3f} ms/iter"
    )
    if summary.get("publish_hidden_fraction") is not None:
        lines.append(
            f"- broadcasts issued before the last step (a next forward follows them): "
            f"{_pct(summary['publish_hidden_fraction'])} hidden under compute"
        )
    if summary.get("replicate_broadcast_hidden_fraction") is not None:
        lines.append(
            f"- replicate broadcast hidden under compute: "
            f"{_pct(summary['replicate_broadcast_hidden_fraction'])}"
        )
    if summary.get("tp_scatter_hidden_fraction") is not None:
        lines.append(
            f"- TP scatter issued before the last step (a next forward follows it): "
            f"{_pct(summary['tp_scatter_hidden_fraction'])} hidden under compute; TP gather "
            f"{_pct(summary.get('tp_gather_hidden_fraction'))}"
        )
    cats = " | ".join(f"{c} {v:.3f}" for c, v in summary["breakdown_ms_per_iter"].items() if v > 0)
    lines.append(
        "- where the time goes (GPU ms/iter, sum over streams "
        f"{summary['gpu_ms_per_iter']:.3f}): {cats}"
    )
    for e in summary["top_kernels"][:top]:
        lines.append(
            f"  - {e['ms_per_iter']:.3f} ms/iter  {e['count'] / n:.3g}×  "
            f"[{e['category']}] {e['name'][:100]}"
        )
    return lines


def profile_calls(fn, calls: int, device, save_as: str | None = None) -> dict:
    """``calls`` calls of ``fn`` under torch.profiler (CUDA activity on GPU): GPU ms per call by
    kernel category and the top kernels; the chrome trace is kept, gzipped, at ``save_as``.

    The keys say "per_step" (the first user profiles optimizer steps): read "per call".
    """
    import os
    import shutil
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    fd, tmp = tempfile.mkstemp(prefix="dmuon_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        summary = summarize(tmp, calls)
        if save_as:
            with open(tmp, "rb") as fin, gzip.open(save_as, "wb") as fout:
                shutil.copyfileobj(fin, fout)
    finally:
        os.remove(tmp)
    out = {
        "steps": calls,
        "gpu_events": summary["gpu_events"],
        "gpu_ms_per_step": summary["gpu_ms_per_iter"],
        "breakdown_ms_per_step": summary["breakdown_ms_per_iter"],
        "top_kernels": [
            {
                "name": e["name"],
                "category": e["category"],
                "count_per_step": e["count"] / calls,
                "ms_per_step": e["ms_per_iter"],
            }
            for e in summary["top_kernels"]
        ],
    }
    if save_as:
        out["trace_file"] = save_as
    return out


def where_the_time_goes(profile: dict, top: int = 5, unit: str = "step") -> list[str]:
    """A short block for stdout from a :func:`profile_calls` result."""
    if not profile["gpu_events"]:
        return [
            f"  where the time goes: no GPU events in {profile['steps']} profiled {unit}s (CPU run)"
        ]
    cats = " | ".join(f"{c} {v:.3f}" for c, v in profile["breakdown_ms_per_step"].items() if v > 0)
    lines = [
        f"  where the time goes (GPU ms/{unit}, {profile['gpu_ms_per_step']:.3f} in all): {cats}"
    ]
    for e in profile["top_kernels"][:top]:
        lines.append(
            f"    {e['ms_per_step']:8.3f} ms  {e['count_per_step']:.3g}×  "
            f"[{e['category']}] {e['name'][:90]}"
        )
    return lines


def compare(base, other, iterations: int = 1, device=None, top: int = 25) -> dict:
    """Two traces of the same iterations side by side (``base``: e.g. AdamW's, ``other``:
    ours): per iteration, the window, GPU work and idle of each, and the ``top`` kernel names
    by how much more GPU time ``other`` spends in them than ``base`` (then the ``top // 3``
    ``other`` spends least), as ``(name, other_ms, base_ms, delta_ms)``."""
    n = max(int(iterations), 1)
    sides = {}
    for tag, path in (("base", base), ("other", other)):
        records = _records(path, device)
        per_name: dict = defaultdict(float)  # by the printed (cut) name
        for entry in _by_name(records).values():
            per_name[entry["name"]] += entry["ms"] / n
        window = _exposed(records)["window_us"] if records else 0.0
        sides[tag] = {
            "window_ms": window / 1e3 / n,
            "gpu_ms": sum(per_name.values()),
            "idle_ms": gpu_idle_us(records) / 1e3 / n if records else 0.0,
            "per_name": per_name,
        }
    a, b = sides["base"]["per_name"], sides["other"]["per_name"]
    rows = []
    for name in set(a) | set(b):
        mine, theirs = b.get(name, 0.0), a.get(name, 0.0)
        rows.append((name, mine, theirs, mine - theirs))
    rows.sort(key=lambda row: (-row[3], row[0]))
    summary = {
        tag: {k: v for k, v in side.items() if k != "per_name"} for tag, side in sides.items()
    }
    return {**summary, "more": rows[:top], "less": rows[::-1][: max(top // 3, 1)]}


def format_compare(result: dict) -> list[str]:
    lines = []
    for tag in ("base", "other"):
        side = result[tag]
        lines.append(
            f"{tag}: window {side['window_ms']:.2f} ms per iteration, GPU work (sum over streams) "
            f"{side['gpu_ms']:.2f}, GPU idle {side['idle_ms']:.2f}"
        )
    lines.append("kernels, other − base (ms per iteration): delta, other, base, name")
    for name, mine, theirs, delta in result["more"]:
        lines.append(f"  {delta:+8.3f}  {mine:8.3f}  {theirs:8.3f}  {name}")
    lines.append("least:")
    for name, mine, theirs, delta in result["less"]:
        lines.append(f"  {delta:+8.3f}  {mine:8.3f}  {theirs:8.3f}  {name}")
    return lines


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a chrome trace (.json or .json.gz)")
    ap.add_argument("--iterations", type=int, default=1, help="iterations the trace holds")
    ap.add_argument("--device", default=None, help="only this GPU (the trace's args.device)")
    ap.add_argument("--json", action="store_true", help="print the whole summary as JSON")
    ap.add_argument(
        "--gaps", action="store_true", help="also: GPU idle gaps and the host event charged"
    )
    ap.add_argument(
        "--against",
        default=None,
        metavar="BASE",
        help="compare with this trace of the same iterations (e.g. AdamW's): where the extra "
        "GPU time and idle go, kernel by kernel",
    )
    args = ap.parse_args(argv)
    traces = [args.trace]
    if args.against:
        result = compare(args.against, args.trace, args.iterations, args.device)
        print("\n".join(format_compare(result)))
        traces = [args.against, args.trace]
    else:
        summary = summarize(args.trace, args.iterations, args.device)
        print("\n".join(format_summary(summary)))
    for path in traces if args.gaps else []:
        gaps = idle_gaps(path, args.device)
        per = max(args.iterations, 1)
        print(
            f"GPU idle in {path}: {gaps['idle_us'] / 1e3 / per:.3f} ms per iteration in "
            f"{gaps['gaps'] / per:.0f} gaps; charged to the host event open when each began:"
        )
        for name, us, n in gaps["by_host"]:
            print(f"  {us / 1e3 / per:8.3f} ms  {n / per:6.1f} gaps  {name}")
    if args.json:
        print(json.dumps(result if args.against else summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
