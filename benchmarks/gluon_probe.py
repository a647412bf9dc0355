"""Probe of the Gluon symmetric-product kernel on one SM90 GPU: correctness, then time.

For each case (the Newton–Schulz products that dominate a step) it checks every Gluon
configuration against an fp32 torch reference (max relative error, bitwise symmetry, every
element written) and times it against the Triton TMA kernel (two tile configurations) and
cuBLAS (``torch.baddbmm``/``addmm``, the full product). Times are CUDA-event medians after
warm-up; TFLOP/s count the useful FLOPs of the lower triangle, ``batch·m·(m+1)·k`` (cuBLAS
computes twice that). One failing variant prints its error and the probe goes on.

Run::

    python benchmarks/gluon_probe.py                       # every case, the default configs
    python benchmarks/gluon_probe.py --cases rr2048 --configs "split=1,stages=4;split=2,stages=2"
    python benchmarks/gluon_probe.py --smoke-only          # small shapes, correctness only
    python benchmarks/gluon_probe.py --compile-only        # no GPU: smem/registers per config
    python benchmarks/gluon_probe.py --isolate-smoke 90    # a deadlocking config cannot hang it

``--pick FILE`` writes the shortlist the timings argue for (:func:`pick_shortlist`) in the
``--configs`` syntax, for the next stage of the same device call (``gpu_suite.sh``'s
``SHORTLIST_NEW=auto``).

``--configs`` takes ``;``-separated ``GluonConfig`` fields (``split``, ``block_k``, ``stages``,
``consumers``, ``num_warps``, ``c_slots``, ``store_slots``, ``wide``, ``maxnreg``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import asdict

import torch

DEFAULT_CONFIGS = ";".join(
    [
        "split=1,stages=4",  # 128×128, one 8-warp consumer
        "split=1,stages=3,consumers=2,num_warps=4",  # 128×128 ping-pong (C fits)
        "split=1,stages=4,consumers=2,num_warps=4",  # ping-pong, 4 stages (no C only)
        "split=2,stages=3,c_slots=1",  # 128×256, C one block ahead
        "split=2,stages=4",  # 128×256, 4 stages (no C only)
        "split=2,block_k=32,stages=5,c_slots=2",  # 128×256, finer stages, C fully prefetched
    ]
)

# name: (shape of a, op, C term)
CASES = {
    "syrk2048": ((56, 2048, 5632), "syrk", False),  # the first X·Xᵀ of the S stack
    "rr2048": ((56, 2048, 2048), "sym_mm", True),  # Gram-space R·R with C, S stack
    "rr4096": ((28, 4096, 4096), "sym_mm", True),  # Gram-space R·R with C, M stack
    "syrk4096": ((4096, 14336), "syrk", False),  # one 4096×14336 X·Xᵀ
    # Mixture-of-experts stacks below today's size gate (cuBLAS there): Gram-space R·R with C
    "rr768": ((64, 768, 768), "sym_mm", True),  # model E's 64 experts of hidden 768
    "rr1536": ((16, 1536, 1536), "sym_mm", True),  # Qwen3-MoE-like experts of hidden 1536
    "rr768x512": ((512, 768, 768), "sym_mm", True),  # model E's whole 768-row expert bucket
    "syrk768x512": ((512, 768, 2048), "syrk", False),  # its first X·Xᵀ
}
SMOKE = [
    ((3, 520, 776), "syrk", True),
    ((3, 520, 520), "sym_mm", True),
    ((264, 1000), "syrk", False),
    ((2, 136, 64), "sym_mm", False),
]
ALPHA, BETA, GAMMA = 2.0315, -4.775, 3.4445  # Newton–Schulz-like coefficients


def parse_configs(spec: str):
    from dmuon_compile.kernels.syrk_gluon import GluonConfig

    configs = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        fields = {}
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, value = pair.split("=")
            fields[key.strip()] = int(value)
        configs.append(GluonConfig(**fields))
    return configs


def triton_configs():
    from dmuon_compile.kernels.lower_tiles import TileConfig

    # The autotune shortlist, and its variants reading C by TMA in the epilogue (the autotune's
    # picks for every product with C of the S and M steps, benchmarks/RESULTS.md §13; without
    # C they are the same kernel as the first two).
    return [
        TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True),
        TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True),
        TileConfig(128, 64, 8, 3, 1, block_n=256, tma=True, tma_store=True, c_load="tma"),
        TileConfig(128, 64, 8, 4, 1, tma=True, tma_store=True, c_load="tma"),
    ]


def make_inputs(shape, op, use_c, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, k = shape[-2], shape[-1]
    lead = tuple(shape[:-2])
    if op == "syrk":
        a = (torch.randn(shape, generator=gen, device="cuda") / k**0.25).to(dtype)
        b = None
    else:  # commuting symmetric operands, as Newton–Schulz's Gram-space products are
        x = torch.randn(shape, generator=gen, device="cuda") / k**0.5
        r = x @ x.mT / 4
        a = r.to(dtype)
        b = (r @ r).to(dtype)
        del x, r
    c = a.clone() if (use_c and op == "sym_mm") else None
    if use_c and c is None:  # symmetric, as every C of Newton–Schulz is: the kernels read
        c = torch.randn(lead + (m, m), generator=gen, device="cuda")  # only its lower triangle
        c = ((c + c.mT) / 2).to(dtype)
    return a, b, c


def reference(a, b, c, alpha, beta, gamma):
    """fp32 (no TF32) ``alpha·a·b + beta·c + gamma·I``, matrix by matrix to bound memory."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a3 = a if a.dim() == 3 else a[None]
        b3 = None if b is None else (b if b.dim() == 3 else b[None])
        c3 = None if c is None else (c if c.dim() == 3 else c[None])
        m = a.shape[-2]
        out = torch.empty(a3.shape[0], m, m, device=a.device, dtype=torch.float32)
        eye = torch.eye(m, device=a.device)
        for i in range(a3.shape[0]):
            ai = a3[i].float()
            p = ai @ (ai.mT if b3 is None else b3[i].float())
            p = p * alpha
            if c3 is not None:
                p = p + beta * c3[i].float()
            out[i] = p + gamma * eye
        return out if a.dim() == 3 else out[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def check(out, ref) -> str:
    written = bool(torch.isfinite(out).all())
    symmetric = bool(torch.equal(out, out.mT))
    diff = (out.float() - ref).abs().max().item()
    rel = diff / max(ref.abs().max().item(), 1e-30)
    ok = written and symmetric and rel < 1e-2  # bf16 output rounding is ~4e-3
    return (
        f"max_rel_err={rel:.2e} symmetric={symmetric} all_written={written}"
        f" {'OK' if ok else 'WRONG'}"
    )


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cublas_fn(a, b, c, alpha, beta):
    bt = a.mT if b is None else b
    if c is None:
        return lambda: torch.matmul(a, bt)
    if a.dim() == 2:
        return lambda: torch.addmm(c, a, bt, beta=beta, alpha=alpha)
    return lambda: torch.baddbmm(c, a, bt, beta=beta, alpha=alpha)


def run_variant(label, launch, ref, flops, args, results, *, timed=True, cublas=False):
    """Check (unless cuBLAS) and time one variant; print one line; never raise."""
    try:
        t0 = time.perf_counter()
        out = launch()  # first call compiles
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        verdict = "(full product, not checked)" if cublas else check(out, ref)
        del out
        line = f"  {label:44s} first call {compile_s:6.1f}s  {verdict}"
        if timed:
            ms = time_ms(launch, args.warmup, args.iters)
            tflops = flops / ms / 1e9
            line += f"  {ms:8.3f} ms  {tflops:7.1f} TF/s"
            results.append((label, ms, tflops, cublas or verdict.endswith("OK")))
        print(line, flush=True)
    except Exception as exc:  # one broken variant must not end the probe
        if isinstance(exc, ValueError) and "shared memory" in str(exc):
            print(f"  {label:44s} SKIPPED: {exc}")  # a config over budget for this case
            return
        first = str(exc).strip().splitlines()
        print(f"  {label:44s} FAILED {type(exc).__name__}: {' | '.join(first[-4:])[:800]}")
        if args.traceback:
            traceback.print_exc()
    finally:
        torch.cuda.empty_cache()


def run_case(name, shape, op, use_c, configs, args, timed=True):
    from dmuon_compile.kernels.symmetric_product import launch_symmetric_product
    from dmuon_compile.kernels.syrk_gluon import launch_gluon_kernel

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch = shape[0] if len(shape) == 3 else 1
    m, k = shape[-2], shape[-1]
    flops = batch * m * (m + 1) * k
    alpha, beta, gamma = (ALPHA, BETA, GAMMA) if use_c else (1.0, 0.0, 0.0)
    print(f"\n{name}: {op} {'x'.join(map(str, shape))} {args.dtype} C={use_c}", flush=True)
    a, b, c = make_inputs(shape, op, use_c, dtype)
    ref = reference(a, b, c, alpha, beta, gamma)
    out = torch.empty(shape[:-2] + (m, m), device="cuda", dtype=dtype)
    results = []
    for config in configs:

        def gluon(config=config):
            return launch_gluon_kernel(a, b, c, alpha, beta, gamma, out=out, config=config)

        out.fill_(float("nan"))
        run_variant(f"gluon {config.name}", gluon, ref, flops, args, results, timed=timed)
    if timed and not args.no_triton:
        for config in triton_configs():
            out.fill_(float("nan"))

            def triton_kernel(config=config):
                return launch_symmetric_product(a, b, c, alpha, beta, gamma, config, out=out)

            run_variant(f"triton {config.name}", triton_kernel, ref, flops, args, results)
    if timed and not args.no_cublas:
        run_variant(
            "cublas", cublas_fn(a, b, c, alpha, beta), ref, flops, args, results, cublas=True
        )
    if results:
        best = min(results, key=lambda r: r[1])
        print(f"  best: {best[0]} {best[1]:.3f} ms {best[2]:.1f} TF/s")
    del a, b, c, ref, out
    torch.cuda.empty_cache()
    return results


def pick_shortlist(cases: dict[str, list], base: str, margin: float = 0.02) -> list[str]:
    """The Gluon configurations worth the autotune's time, from one probe's timings.

    ``cases``: case name -> ``[(label, ms, tflops, correct), ...]`` (``run_case``'s results;
    Gluon labels are ``"gluon <config name>"``); ``base``: today's shortlisted configuration's
    name. A configuration is kept if it was correct in every case it ran and at least
    ``margin`` faster than the base in some case (the autotune then picks per product); the
    base is kept unless another kept configuration is faster in every case. One that failed
    a case, or never beat the base, is left out.

    >>> cases = {"rr": [("gluon a", 1.0, 0, True), ("gluon b", 0.9, 0, True)],
    ...          "rr4": [("gluon a", 2.0, 0, True), ("gluon b", 2.1, 0, True)]}
    >>> pick_shortlist(cases, "a")
    ['a', 'b']
    """
    times: dict[str, dict[str, float]] = {}
    wrong = set()
    for case, rows in cases.items():
        for label, ms, _tflops, correct in rows:
            if not label.startswith("gluon "):
                continue
            name = label.removeprefix("gluon ")
            if not correct:
                wrong.add(name)
            times.setdefault(name, {})[case] = ms
    base_ms = times.get(base, {})
    kept = [
        name
        for name, ms in times.items()
        if name != base
        and name not in wrong
        and any(case in base_ms and t < base_ms[case] * (1 - margin) for case, t in ms.items())
    ]
    beaten = any(
        base_ms and all(case in times[n] and times[n][case] < t for case, t in base_ms.items())
        for n in kept
    )
    if base in times and base not in wrong and not beaten:
        kept.insert(0, base)
    return kept


def config_spec(configs) -> str:
    """``configs`` in the ``--configs`` syntax (every field that differs from the default)."""
    from dmuon_compile.kernels.syrk_gluon import GluonConfig

    default = asdict(GluonConfig())
    return ";".join(
        ",".join(
            f"{key}={int(value)}"
            for key, value in asdict(c).items()
            if value != default[key] or key == "split"
        )
        for c in configs
    )


def compile_table(configs) -> None:
    """Compile every config for sm_90 (no GPU needed): shared memory, registers, spills."""
    import importlib.util
    from pathlib import Path

    from dmuon_compile.kernels.syrk_gluon import SMEM_LIMIT

    # The offline compile lives with the benchmarks (kernel_resources.py), not in the kernels.
    path = Path(__file__).resolve().parent / "kernel_resources.py"
    spec = importlib.util.spec_from_file_location("_dmuon_bench_kernel_resources", path)
    resources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resources)
    compile_for_target, ptxas_resource_usage = (
        resources.compile_for_target,
        resources.ptxas_resource_usage,
    )

    for config in configs:
        for syrk, has_c in ((True, False), (False, True), (True, True), (False, False)):
            label = f"{config.name} {'syrk' if syrk else 'sym_mm'}{' +C' if has_c else ''}"
            try:
                compiled = compile_for_target(config, syrk=syrk, has_c=has_c)
                usage = ptxas_resource_usage(compiled)
                shared = compiled.metadata.shared
                fits = "fits" if shared <= SMEM_LIMIT else "OVER 227 KiB"
                print(
                    f"  {label:44s} smem {shared:7d} B ({fits})  regs/thread {usage['registers']}"
                    f"  spills {usage['spill_stores']}/{usage['spill_loads']} B",
                    flush=True,
                )
            except Exception as exc:
                print(f"  {label:44s} FAILED {type(exc).__name__}: {str(exc)[-400:]}")


def smoke_in_subprocesses(configs, args) -> list:
    """Run each config's smoke checks in its own process under a timeout (a deadlocked kernel
    cannot be interrupted from Python); return the configs that passed."""
    import subprocess

    passed = []
    for config in configs:
        spec = ",".join(
            f"{key}={int(value)}" for key, value in asdict(config).items() if value is not None
        )
        command = [sys.executable, __file__, "--smoke-only", "--configs", spec]
        command += ["--dtype", args.dtype]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=args.isolate_smoke
            )
            output = done.stdout + done.stderr
            ok = done.returncode == 0 and "WRONG" not in output and "FAILED" not in output
            verdict = "passed" if ok else f"FAILED (exit {done.returncode})"
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else ""
            ok, verdict = False, f"TIMED OUT after {args.isolate_smoke}s (deadlock?)"
        print(f"smoke {config.name}: {verdict}", flush=True)
        if not ok:
            print("\n".join("    " + line for line in output.strip().splitlines()[-12:]))
        else:
            passed.append(config)
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated GluonConfigs")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-smoke", action="store_true", help="skip the small-shape checks")
    parser.add_argument("--smoke-only", action="store_true")
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--no-cublas", action="store_true")
    parser.add_argument("--traceback", action="store_true", help="full tracebacks of failures")
    parser.add_argument(
        "--isolate-smoke",
        type=float,
        default=0,
        metavar="SECONDS",
        help="smoke-check each config in a subprocess with this timeout; time only those passing",
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="compile for sm_90 and report (no GPU)"
    )
    parser.add_argument(
        "--pick",
        default=None,
        metavar="FILE",
        help="write the shortlist the timings argue for (pick_shortlist; the first --configs "
        "entry is today's) to FILE in the --configs syntax",
    )
    args = parser.parse_args(argv)

    if args.compile_only:
        compile_table(parse_configs(args.configs))
        return 0
    if not torch.cuda.is_available():
        print("gluon_probe: needs a CUDA GPU")
        return 1
    props = torch.cuda.get_device_properties(0)
    import triton

    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    try:
        configs = parse_configs(args.configs)
    except Exception as exc:
        print(f"gluon_probe: bad --configs: {type(exc).__name__}: {exc}")
        return 2
    print("configs:", ", ".join(c.name for c in configs))
    if args.isolate_smoke and not args.smoke_only:
        configs = smoke_in_subprocesses(configs, args)
    elif not args.no_smoke:
        for i, (shape, op, use_c) in enumerate(SMOKE):
            run_case(f"smoke{i}", shape, op, use_c, configs, args, timed=False)
    if args.smoke_only:
        return 0
    base = parse_configs(args.configs)[0].name  # today's shortlist comes first
    timings = {}
    for name in filter(None, args.cases.split(",")):
        if name not in CASES:
            print(f"\n{name}: unknown case (have {', '.join(CASES)})")
            continue
        try:
            timings[name] = run_case(name, *CASES[name], configs, args)
        except Exception as exc:  # e.g. out of memory building the inputs
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
            torch.cuda.empty_cache()
    if args.pick:
        by_name = {c.name: c for c in configs}
        picked = [by_name[n] for n in pick_shortlist(timings, base) if n in by_name]
        spec = config_spec(picked) if picked else config_spec(parse_configs(args.configs)[:1])
        with open(args.pick, "w") as handle:
            handle.write(spec + "\n")
        print(f"picked shortlist: {spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
