"""Scaling of the training iteration with the number of GPUs, from ``bench_fsdp.py --out`` files.

    python benchmarks/plot_scaling.py fsdp_M_1gpu.json fsdp_M_2gpu.json fsdp_M_4gpu.json \\
        fsdp_M_8gpu.json --png scaling_M.png --out scaling_M.md

Writes a markdown table (one row per file and configuration: GPUs, mesh, iteration and
back-to-back times, Muon tax against AdamW in the same run, owner-load balance, peak memory) and,
with ``--png`` and matplotlib installed, a plot of back-to-back iteration time against GPUs,
one line per configuration and mesh kind. Files of different models are refused: a scaling
line mixes nothing but world sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(paths: list[Path]) -> list[dict]:
    """The reports, sorted by world size; all must be of one model."""
    reports = []
    for path in paths:
        with open(path) as handle:
            report = json.load(handle)
        if "results" not in report or "world_size" not in report:
            raise ValueError(f"{path}: not a bench_fsdp.py report (no 'results' / 'world_size')")
        report["_path"] = str(path)
        reports.append(report)
    models = {r.get("model") for r in reports}
    if len(models) > 1:
        raise ValueError(
            f"reports of several models {sorted(map(str, models))}: plot one model at a time"
        )
    return sorted(reports, key=lambda r: (r["world_size"], mesh_name(r)))


def mesh_name(report: dict) -> str:
    mesh = report.get("mesh", {})
    if "replicate" in mesh:
        return f"HSDP {mesh['replicate']}×{mesh['shard']}"
    return f"1-D over {report['world_size']}"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(reports: list[dict]) -> list[str]:
    rows = [
        "| GPUs | mesh | config | iter ms | back-to-back ms | Muon tax (b2b) "
        "| step balance max/mean | planned NS max/mean | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for config, r in report["results"].items():
            tax = r.get("b2b_muon_tax")
            planned = r.get("planned_balance", {}).get("ns_max_over_mean")
            tax_pct = None if tax is None else tax * 100
            rows.append(
                f"| {report['world_size']} | {mesh_name(report)} | {config} "
                f"| {_fmt(r.get('iter_ms'), '.2f')} | {_fmt(r.get('back_to_back_ms'), '.2f')} "
                f"| {_fmt(tax_pct, '+.1f', '%')} | {_fmt(r.get('step_balance'), '.3f')} "
                f"| {_fmt(planned, '.3f')} | {_fmt(r.get('peak_mem_gib'), '.2f')} |"
            )
    return rows


def series(reports: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{"config (mesh kind)": [(GPUs, back-to-back ms), ...]}`` for the plot."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for report in reports:
        kind = "HSDP" if "replicate" in report.get("mesh", {}) else "1-D"
        for config, r in report["results"].items():
            ms = r.get("back_to_back_ms", r.get("iter_ms"))
            if ms is not None:
                lines.setdefault(f"{config} ({kind})", []).append((report["world_size"], ms))
    return lines


def plot(reports: list[dict], png: Path) -> bool:
    """Draw the plot; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "plot skipped: matplotlib is not installed (pip install 'dmuon_compile[plot]')",
            file=sys.stderr,
        )
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series(reports).items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    model = reports[0].get("model", "?")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("iteration, back to back (ms)")
    ax.set_title(
        f"model {model}: iteration time vs GPUs "
        f"({reports[0].get('tokens_per_rank', '?')} tokens/GPU)"
    )
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="bench_fsdp.py --out JSON files")
    parser.add_argument(
        "--png", type=Path, default=None, help="write the plot here (needs matplotlib)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    try:
        reports = load(args.reports)
    except (OSError, ValueError) as exc:
        print(f"plot_scaling: {exc}", file=sys.stderr)
        return 2
    lines = table(reports)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if args.png:
        plot(reports, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
