"""Kernel benchmarks of benchmarks/README.md §A (Newton–Schulz per matrix) and §C (SYRK vs cuBLAS).

Run on one GPU::

    python benchmarks/bench_kernels.py --out kernels_results.md  # full; fold into RESULTS.md
    python benchmarks/bench_kernels.py --quick --out /tmp/quick.md         # short
    python benchmarks/bench_kernels.py --sections N --stress-inputs 1000   # NaN/Inf stress
    python benchmarks/bench_kernels.py --sections A --profile-ns           # + top kernels

Every number is a median of ``triton.testing.do_bench`` after warm-up; every claim is a ratio
of two things measured in this run. §A compares (1) the baseline — torch.optim.Muon's NS
(direct, Keller Jordan, bf16, cuBLAS) — with (2) ``NewtonSchulz(kernel="cublas")`` and (3)
``NewtonSchulz(kernel="triton")`` (eager, the SYRK custom ops; the compiled step with the pass
is another issue's). §C compares ``torch.ops.dmuon.syrk`` (after autotune) with
``torch.mm(A, A.T)`` and ``torch.addmm``. The markdown table goes to ``--out``; the last lines
printed are the headline ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

import dmuon_compile  # noqa: F401  (registers the ops)
from dmuon_compile import NewtonSchulz
from dmuon_compile.newton_schulz import direct_ns_flops

KJ = (3.4445, -4.7750, 2.0315)
NS_SHAPES = [
    (768, 3072),
    (1024, 4096),
    (2048, 5632),
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 28672),
    (32, 2048, 5632),
    (216, 2048, 7168),
    # Mixture-of-experts stacks (E, m, n), per-expert NS (a 3-D input is a batch of matrices):
    (32, 2048, 7168),  # 32 experts of hidden 2048 at dim 7168 (DeepSeek-V3's experts, E/8)
    (64, 768, 2048),  # benchmark model E's w1/w3 (bench_step.py, bench_fsdp.py)
    (8, 7168, 2048),  # DeepSeek-V3's w2 (dim × hidden), tall: transposed
    (16, 1536, 4096),  # Qwen3-MoE-like experts (hidden 1536 at dim 4096)
]
QUICK_NS_SHAPES = [(1024, 4096), (4096, 4096), (4096, 14336), (14336, 4096), (32, 2048, 5632)]
SYRK_BATCH = {1024: 16, 2048: 8, 4096: 4, 8192: 2}
# Shape classes of the NaN/Inf stress (section N): (rows, cols, stack) — every class runs the
# production kernels (Triton or Gluon where the choice picks them: m >= 4096, stacks of 2048-row
# matrices, the expert stacks past the size gate).
STRESS_CLASSES = {
    "square 4096×4096 (direct NS)": (4096, 4096, 4),
    "wide 4096×14336 (Gram NS)": (4096, 14336, 2),
    "tall 14336×4096 (Gram NS, transposed)": (14336, 4096, 2),
    "stacked 2048×5632": (2048, 5632, 8),
    "small 1024×4096 (cuBLAS)": (1024, 4096, 16),
    "expert stack 64×768×2048 (Gram NS, model E's)": (768, 2048, 64),
    "expert stack 16×1536×4096 (Gram NS, Qwen3-MoE-like)": (1536, 4096, 16),
}
INPUT_KINDS = (
    "gaussian",
    "low_rank",
    "ill_conditioned",
    "heavy_tailed",
    "duplicate_rows",
    "tiny_scale",
    "huge_scale",
)


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def baseline_ns(g: torch.Tensor, steps: int = 5, work_dtype=torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's NS (``_zeropower_via_newtonschulz``), extended to 3-D stacks."""
    if g.dim() == 2 and work_dtype == torch.bfloat16:
        try:
            from torch.optim._muon import _zeropower_via_newtonschulz

            return _zeropower_via_newtonschulz(g, KJ, steps, 1e-7)
        except ImportError:
            pass
    a, b, c = KJ
    x = g.to(work_dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        if x.dim() == 2:
            upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, upd, x, beta=a)
        else:
            upd = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, upd, x, beta=a)
    return x.mT if tall else x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def shape_name(shape) -> str:
    return f"{shape[0]}×({shape[1]}×{shape[2]})" if len(shape) == 3 else f"{shape[0]}×{shape[1]}"


def trace_analysis():
    """benchmarks/ is not a package: import the sibling module from this file's directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import trace_analysis as ta

    return ta


def gram_ns_peer():
    """Dao-AILab's gram-newton-schulz (its quack CuTe kernels, its default torch.compile with
    CUDA graphs), the fastest NS peer, or ``None`` with the reason where it does not import.
    Same coefficients as ours (Polar Express, safety 1.05) and the same restart (iteration 2),
    so its error is read against the same float64 run as ours."""
    try:
        from gram_newton_schulz import GramNewtonSchulz
    except Exception as exc:  # not installed (benchmarks/README.md: carried wheels)
        print(f"peer (4) Dao-AILab gram-newton-schulz not run: {type(exc).__name__}: {exc}")
        return None
    # Its compiled closures see every shape of the section (a stack and its first matrices):
    # past Dynamo's default 8 recompiles it would fall back to eager and time something else.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return GramNewtonSchulz(gram_newton_schulz_reset_iterations=[2])


# Extra NewtonSchulz arguments of our NS in section A (``--gram-min-aspect``).
OURS_NS: dict = {}


def run_ns_section(shapes, nan_inputs: int, profile: bool = False) -> tuple[list[str], dict, dict]:
    peer = gram_ns_peer()
    peer_ratios = {}
    rows = [
        "| shape | baseline ms | ours-cuBLAS ms | ours-Triton ms | speedup (1)/(3) "
        "| speedup (1)/(2) | TFLOP/s base | TFLOP/s (3) | rel.err base | rel.err (3) "
        "| rel.err decay base | rel.err decay (3) | NaN/Inf base | NaN/Inf (3) "
        "| (4) Dao ms | (4)/(3) | rel.err (4) | rel.err decay (4) | NaN/Inf (4) "
        "| (5) ours-quack ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours_cublas = NewtonSchulz(kernel="cublas", **OURS_NS)
    ours_triton = NewtonSchulz(kernel="triton", **OURS_NS)
    try:  # (5): our NS with quack's symmetric kernel (kernel="quack"), where quack is carried
        ours_quack = NewtonSchulz(kernel="quack", **OURS_NS)
    except (ImportError, RuntimeError) as exc:
        ours_quack = None
        print(f"(5) ours with kernel='quack' not run: {exc}")
    print(f"ours: {ours_triton.describe()}", flush=True)
    ours64 = NewtonSchulz(kernel="cublas", work_dtype=torch.float64, **OURS_NS)
    speedups = {}
    for shape in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        g = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        batch = shape[0] if len(shape) == 3 else 1
        m, n = sorted(shape[-2:])
        t0 = time.time()
        ours_triton(g)  # autotune the keys of this shape before timing
        tune_s = time.time() - t0
        t_base = bench_ms(lambda: baseline_ns(g))
        t_cublas = bench_ms(lambda: ours_cublas(g))
        t_triton = bench_ms(lambda: ours_triton(g))
        flops_base = batch * direct_ns_flops(m, n, 5, symmetric=False)
        flops_ours = batch * ours_triton.flops(m, n)
        # Accuracy against float64 runs of each iteration (first matrices of big stacks).
        sub = g[:4] if batch > 4 else g
        err_base = rel_err(baseline_ns(sub), baseline_ns(sub.double(), work_dtype=torch.float64))
        err_ours = rel_err(ours_triton(sub), ours64(sub.double()))
        # The same on an input whose spectrum decays over four decades (gradients look more
        # like this than like Gaussian noise; benchmarks/ns_rounding.py).
        dec = decaying_spectrum(sub.shape, gen)
        dec_base = rel_err(baseline_ns(dec), baseline_ns(dec.double(), work_dtype=torch.float64))
        dec_ours = rel_err(ours_triton(dec), ours64(dec.double()))
        bad_base = bad_ours = bad_peer = 0
        for i in range(nan_inputs):
            gi = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16) * (
                10.0 ** (i % 7 - 3)
            )
            bad_base += int(nonfinite(baseline_ns(gi)) > 0)
            bad_ours += int(nonfinite(ours_triton(gi)) > 0)
        peer_cells = "| n/a | n/a | n/a | n/a | n/a |"
        if peer is not None:
            try:
                peer(g)  # compile and capture before timing
                t_peer = bench_ms(lambda: peer(g))
                err_peer = rel_err(peer(sub), ours64(sub.double()))
                dec_peer = rel_err(peer(dec), ours64(dec.double()))
                for i in range(nan_inputs):
                    gi = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
                    bad_peer += int(nonfinite(peer(gi * 10.0 ** (i % 7 - 3))) > 0)
                peer_ratios[shape_name(shape)] = t_peer / t_triton
                peer_cells = (
                    f"| {t_peer:.3f} | {t_peer / t_triton:.2f}× | {err_peer:.2e} "
                    f"| {dec_peer:.2e} | {bad_peer}/{nan_inputs} |"
                )
            except Exception as exc:  # report, keep the section's other columns
                print(f"peer (4) failed on {shape}: {type(exc).__name__}: {str(exc)[:200]}")
        quack_cell = " n/a |"
        if ours_quack is not None:
            try:
                ours_quack(g)
                quack_cell = f" {bench_ms(lambda: ours_quack(g)):.3f} |"
            except Exception as exc:
                print(f"(5) failed on {shape}: {type(exc).__name__}: {str(exc)[:200]}")
        name = shape_name(shape)
        speedups[name] = t_base / t_triton
        rows.append(
            f"| {name} | {t_base:.3f} | {t_cublas:.3f} | {t_triton:.3f} "
            f"| {t_base / t_triton:.2f}× | {t_base / t_cublas:.2f}× "
            f"| {flops_base / t_base / 1e9:.0f} | {flops_ours / t_triton / 1e9:.0f} | "
            f"{err_base:.2e} | {err_ours:.2e} | {dec_base:.2e} | {dec_ours:.2e} "
            f"| {bad_base}/{nan_inputs} | {bad_ours}/{nan_inputs} {peer_cells}{quack_cell}"
        )
        print(rows[-1] + f"  (first call incl. autotune {tune_s:.1f} s)", flush=True)
        if profile:
            ta = trace_analysis()
            found = ta.profile_calls(lambda: ours_triton(g), 3, g.device)
            print(
                f"ours-Triton, {name}:\n"
                + "\n".join(ta.where_the_time_goes(found, top=8, unit="call")),
                flush=True,
            )
        del g
        torch.cuda.empty_cache()
    return rows, speedups, peer_ratios


def decaying_spectrum(shape, gen: torch.Generator, decades: float = 4.0) -> torch.Tensor:
    """bf16 matrices ``U·diag(σ)·Vᵀ`` with random orthonormal ``U, V`` and σ spaced
    logarithmically from 1 down to ``10^-decades`` (``shape``: ``(m, n)`` or ``(b, m, n)``)."""
    *batch, m, n = shape
    r = min(m, n)
    dev = gen.device

    def orthonormal(rows: int) -> torch.Tensor:
        q = torch.randn(*batch, rows, r, generator=gen, device=dev, dtype=torch.float64)
        return torch.linalg.qr(q).Q

    sigma = torch.logspace(0, -decades, r, device=dev, dtype=torch.float64)
    return ((orthonormal(m) * sigma) @ orthonormal(n).mT).to(torch.bfloat16)


def stress_inputs(
    kind: str, shape, gen: torch.Generator, variant: int = 0, device="cuda"
) -> torch.Tensor:
    """A stack of hard NS inputs of one kind (bf16, never all zeros); ``shape = (b, m, n)``."""
    b, m, n = shape
    g = torch.randn(shape, generator=gen, device=device)
    if kind == "low_rank":  # rank 1..8 plus a 1e-4 floor: a few huge singular values
        r = 1 + variant % 8
        u = torch.randn(b, m, r, generator=gen, device=device)
        v = torch.randn(b, r, n, generator=gen, device=device)
        g = u @ v + 1e-4 * g
    elif kind == "ill_conditioned":  # column scales over six decades
        g = g * torch.logspace(0, -6, n, device=device)
    elif kind == "heavy_tailed":  # ratio of Gaussians (Cauchy-like outliers)
        g = g / torch.randn(shape, generator=gen, device=device).abs().clamp(min=1e-3)
    elif kind == "duplicate_rows":  # exactly rank-deficient: every row twice
        g[:, 1 : m // 2 * 2 : 2] = g[:, 0 : m // 2 * 2 : 2]
    elif kind == "tiny_scale":
        g = g * 1e-6
    elif kind == "huge_scale":
        g = g * 1e4
    return g.to(torch.bfloat16)


def run_stress_section(inputs: int) -> tuple[list[str], dict]:
    """Section N: NaN/Inf over ``inputs`` random inputs per shape class, ours and the baseline."""
    rows = [
        "| shape class | inputs | kinds | NaN/Inf baseline | NaN/Inf ours (Triton) "
        "| max ‖out‖ ours / √m | s |",
        "|---|---|---|---|---|---|---|",
    ]
    ours = NewtonSchulz(kernel="triton")
    bad_total = {}
    for name, (m, n, stack) in STRESS_CLASSES.items():
        gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
        t0 = time.time()
        done = bad_base = bad_ours = 0
        worst_norm = 0.0
        i = 0
        while done < inputs:
            b = min(stack, inputs - done)
            kind = INPUT_KINDS[i % len(INPUT_KINDS)]
            g = stress_inputs(kind, (b, m, n), gen, variant=i // len(INPUT_KINDS))
            out = ours(g if b > 1 else g[0])
            out = out if out.dim() == 3 else out[None]
            base = torch.stack([baseline_ns(g[j]) for j in range(b)])
            bad_ours += int((~torch.isfinite(out)).flatten(1).any(1).sum())
            bad_base += int((~torch.isfinite(base)).flatten(1).any(1).sum())
            # An orthogonalised matrix has Frobenius norm ≈ √min(m, n): a blow-up shows here.
            worst_norm = max(
                worst_norm,
                float(torch.linalg.vector_norm(out.float(), dim=(-2, -1)).max()) / min(m, n) ** 0.5,
            )
            done += b
            i += 1
        torch.cuda.synchronize()
        bad_total[name] = bad_ours
        rows.append(
            f"| {name} | {done} | {len(INPUT_KINDS)} | {bad_base}/{done} | {bad_ours}/{done} | "
            f"{worst_norm:.3f} | {time.time() - t0:.0f} |"
        )
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows, bad_total


def run_syrk_section(ms, batched_too: bool) -> tuple[list[str], dict, dict]:
    from dmuon_compile.kernels import autotune
    from dmuon_compile.kernels.syrk import tuned_choice

    rows = [
        "| m | k | batch | torch.mm ms | torch.addmm ms | syrk ms | syrk+C ms | verdict "
        "| speedup vs mm | speedup vs addmm | eff. TFLOP/s | actual TFLOP/s | mm TFLOP/s "
        "| exact symmetry "
        "| GPU ms mm / syrk (graph) | GPU speedup vs mm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    speedups, gpu_speedups = {}, {}
    for m in ms:
        for k in (m, int(3.5 * m)):
            for batch in [1, SYRK_BATCH[m]] if batched_too else [1]:
                shape = (batch, m, k) if batch > 1 else (m, k)
                gen = torch.Generator(device="cuda").manual_seed(m + k)
                a = (torch.randn(shape, generator=gen, device="cuda") / k**0.25).to(torch.bfloat16)
                c = torch.randn(shape[:-2] + (m, m), generator=gen, device="cuda").to(
                    torch.bfloat16
                )
                out = torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0)  # autotunes this key
                torch.ops.dmuon.syrk(a, c, 1.0, 1.0, 0.0)
                verdict = tuned_choice("syrk", a, None, None, 0.0)
                verdict = verdict if verdict == autotune.CUBLAS else verdict.name
                symmetric = bool(torch.equal(out, out.mT))
                t_mm = bench_ms(lambda: a @ a.mT)
                t_addmm = bench_ms(
                    lambda: torch.baddbmm(c, a, a.mT) if a.dim() == 3 else torch.addmm(c, a, a.T)
                )
                t_syrk = bench_ms(lambda: torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0))
                t_syrk_c = bench_ms(lambda: torch.ops.dmuon.syrk(a, c, 1.0, 1.0, 0.0))
                # GPU time alone: replayed CUDA graphs carry no Python, so small products that
                # are host-bound per eager call (the wall times above) show their kernels' cost.
                g_mm = graph_ms(lambda: a @ a.mT)
                g_syrk = graph_ms(lambda: torch.ops.dmuon.syrk(a, None, 1.0, 0.0, 0.0))
                full = 2.0 * batch * m * m * k
                speedups[(m, k, batch)] = t_mm / t_syrk
                if g_mm and g_syrk:
                    gpu_speedups[(m, k, batch)] = g_mm / g_syrk
                gpu = (
                    f"{g_mm:.3f} / {g_syrk:.3f} | {g_mm / g_syrk:.2f}×"
                    if g_mm and g_syrk
                    else "n/a | n/a"
                )
                rows.append(
                    f"| {m} | {k} | {batch} | {t_mm:.3f} | {t_addmm:.3f} | {t_syrk:.3f} "
                    f"| {t_syrk_c:.3f} | {verdict} | {t_mm / t_syrk:.2f}× "
                    f"| {t_addmm / t_syrk_c:.2f}× | {full / t_syrk / 1e9:.0f} "
                    f"| {full / 2 / t_syrk / 1e9:.0f} | {full / t_mm / 1e9:.0f} "
                    f"| {'yes' if symmetric else 'NO'} | {gpu} |"
                )
                print(rows[-1], flush=True)
                del a, c, out
                torch.cuda.empty_cache()
    return rows, speedups, gpu_speedups


def graph_ms(fn) -> float | None:
    """Median GPU ms of ``fn`` replayed from a CUDA graph (``None`` if it cannot be captured)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception as exc:  # report, do not stop the section
        print(f"graph timing failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def set_size_gate(spec: str) -> None:
    """``ROWS,BATCH[,LARGE_ROWS,LARGE_BATCH]``: stacks of at least BATCH matrices with at least
    ROWS rows (and of at least LARGE_BATCH with at least LARGE_ROWS: the large-stack tier) pass
    the symmetric kernels' size gate (dmuon_compile.kernel_choice), for this process;
    ``2048,8,4096,1`` is the gate before expert stacks passed it."""
    from dmuon_compile import kernel_choice

    values = [int(v) for v in spec.split(",")]
    if len(values) not in (2, 4):
        raise SystemExit(
            f"--size-gate {spec!r}: give ROWS,BATCH or ROWS,BATCH,LARGE_ROWS,LARGE_BATCH"
        )
    kernel_choice.TRITON_MIN_ROWS_BATCHED, kernel_choice.TRITON_MIN_BATCH = values[:2]
    if len(values) == 4:
        large = values[2:]
        kernel_choice.TRITON_MIN_ROWS_LARGE_STACK, kernel_choice.TRITON_MIN_BATCH_LARGE_STACK = (
            large
        )
    print(
        f"size gate: stacks of >= {kernel_choice.TRITON_MIN_BATCH} with >= "
        f"{kernel_choice.TRITON_MIN_ROWS_BATCHED} rows, and of >= "
        f"{kernel_choice.TRITON_MIN_BATCH_LARGE_STACK} with >= "
        f"{kernel_choice.TRITON_MIN_ROWS_LARGE_STACK}, run the symmetric kernels"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and inputs")
    parser.add_argument("--out", default=None, help="write the markdown tables here")
    parser.add_argument(
        "--sections",
        default="CA",
        help="which sections to run: C (SYRK), A (NS per matrix), N (NaN/Inf stress); e.g. CAN",
    )
    parser.add_argument(
        "--stress-inputs", type=int, default=1000, help="inputs per shape class in section N"
    )
    parser.add_argument(
        "--nan-inputs", type=int, default=None, help="random inputs per shape for the NaN count"
    )
    parser.add_argument(
        "--ns-shapes",
        default=None,
        help="section A: only these shapes, e.g. 32x2048x7168,2048x5632 (a stack: batch first)",
    )
    parser.add_argument(
        "--profile-ns",
        action="store_true",
        help="section A: also print each shape's top GPU kernels (torch.profiler, 3 calls)",
    )
    parser.add_argument(
        "--size-gate",
        default=None,
        metavar="ROWS,BATCH",
        help="section A: let stacks of >= BATCH matrices with >= ROWS rows run the symmetric "
        "kernels (default gate: dmuon_compile.kernel_choice, 2048 rows in stacks of 8), e.g. "
        "512,8 to time the MoE expert stacks on them",
    )
    parser.add_argument(
        "--gram-min-aspect",
        type=float,
        default=None,
        help="section A: NewtonSchulz(gram_min_aspect=...) for ours (default 1.5); e.g. 3 to "
        "time 768x2048 and 1536x4096 stacks on direct NS instead of Gram NS",
    )
    args = parser.parse_args(argv)
    if args.size_gate:
        set_size_gate(args.size_gate)
    if args.gram_min_aspect is not None:
        OURS_NS["gram_min_aspect"] = args.gram_min_aspect
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    header = [
        "# Kernel benchmarks (benchmarks/README.md §A, §C)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {torch.cuda.get_device_name()} "
        f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        f"- torch {torch.__version__}, triton {triton.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- times: medians of triton.testing.do_bench (ms); bf16 inputs, random normal",
        "",
    ]
    lines = list(header)
    headlines = []

    def write_markdown() -> None:  # after each section, so a cut-off run still leaves a table
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(
                    "\n".join(lines + ["## Headlines", ""] + [f"- {h}" for h in headlines] + [""])
                )

    if "C" in args.sections:
        ms = [2048, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192]
        rows, sp, gpu_sp = run_syrk_section(ms, batched_too=True)
        lines += [
            "## C. SYRK vs cuBLAS (`torch.ops.dmuon.syrk` after autotune)",
            "",
            "eff. TFLOP/s counts the full GEMM (2·m²·k per matrix), actual half of it. Wall times "
            "are per eager call (host-bound for small products); the graph columns replay CUDA "
            "graphs of the same calls: GPU time alone.",
            "",
        ]
        lines += rows + [""]
        big = [v for (m, _k, _b), v in sp.items() if m >= 4096]
        if big:
            headlines.append(
                f"HEADLINE SYRK m>=4096: speedup vs torch.mm(A, A.T) min {min(big):.2f}x, "
                f"max {max(big):.2f}x (target >= 1.4x)"
            )
        headlines.append(
            f"HEADLINE SYRK all shapes: min speedup vs torch.mm {min(sp.values()):.2f}x "
            "per eager call (wall, host dispatch included)"
        )
        if gpu_sp:
            headlines.append(
                f"HEADLINE SYRK all shapes, GPU time (CUDA graphs): min speedup vs torch.mm "
                f"{min(gpu_sp.values()):.2f}x (target: never below ~1.0x after autotune)"
            )
        write_markdown()
    if "A" in args.sections:
        nan_inputs = args.nan_inputs if args.nan_inputs is not None else (3 if args.quick else 20)
        shapes = QUICK_NS_SHAPES if args.quick else NS_SHAPES
        if args.ns_shapes:
            shapes = [tuple(int(d) for d in s.split("x")) for s in args.ns_shapes.split(",")]
        rows, sp, peer_ratios = run_ns_section(shapes, nan_inputs, args.profile_ns)
        lines += [
            "## A. Newton–Schulz per matrix",
            "",
            "(1) baseline: torch.optim.Muon NS (direct, Keller Jordan, bf16, cuBLAS); "
            '(2) `NewtonSchulz(kernel="cublas")`; (3) `NewtonSchulz(kernel="triton")`, eager. '
            "TFLOP/s count each algorithm's own FLOPs (NewtonSchulz.flops for ours). rel.err: "
            "‖out − float64 run of the same iteration‖/‖ref‖, on the Gaussian input and on one "
            "whose singular values decay from 1 to 1e-4 (`decaying_spectrum`). "
            "NaN/Inf: inputs whose output had any, inputs scaled 1e-3..1e3. (4): Dao-AILab's "
            "gram-newton-schulz (`GramNewtonSchulz`, quack kernels, its default compile with "
            "CUDA graphs; n/a where it is not installed); (4)/(3) > 1: ours faster. (5): ours "
            'with `kernel="quack"` (quack\'s symmetric GEMM inside our NS), where quack is '
            "installed.",
            "",
        ]
        lines += rows + [""]
        targets = {
            "4096×14336": 1.8,
            "14336×4096": 1.8,
            "8192×28672": 1.8,
            "32×(2048×5632)": 1.5,
            "4096×4096": 1.0,
        }
        for name, target in targets.items():
            if name in sp:
                headlines.append(
                    f"HEADLINE NS {name}: {sp[name]:.2f}x vs baseline (target >= {target}x)"
                )
        if peer_ratios:
            slowest = min(peer_ratios, key=peer_ratios.get)
            headlines.append(
                f"HEADLINE NS vs Dao-AILab gram-newton-schulz: ours faster on "
                f"{sum(r > 1 for r in peer_ratios.values())}/{len(peer_ratios)} shapes; "
                f"least {peer_ratios[slowest]:.3f}x on {slowest} (target > 1 on every shape)"
            )
    if "N" in args.sections:
        rows, bad = run_stress_section(args.stress_inputs)
        lines += [
            "## N. NaN/Inf stress: random inputs per shape class",
            "",
            "Input kinds cycle through " + ", ".join(INPUT_KINDS) + " (bf16). Ours: "
            '`NewtonSchulz(kernel="triton")` (default Gram NS, Polar Express, fp16, restart); '
            "baseline: torch.optim.Muon's NS. Counted: inputs whose output had any NaN/Inf.",
            "",
        ]
        lines += rows + [""]
        headlines.append(
            f"HEADLINE NaN/Inf over {args.stress_inputs} inputs per class: "
            f"{sum(bad.values())} bad outputs in {len(bad)} classes (target 0)"
        )
    write_markdown()
    print("\n".join(headlines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
