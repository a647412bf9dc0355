"""Compile the TMA symmetric-product kernel for SM90 on any machine (no GPU needed) and report
each tile configuration's shared memory, registers per thread and spill stack.

Triton compiles for a named target (``GPUTarget("cuda", 90, 32)``) with its bundled ``ptxas``,
so a configuration that would not compile, or that spills registers, is seen before a GPU
call is spent on it. The spill stack is what told where the ``beta·C`` epilogue's time went:
loading C by pointers after the K loop spills the 128-row tiles' accumulators (up to 744
bytes per thread); loading it by TMA, into the accumulator's start (``c_load="prologue"``) or
in the epilogue half a strip at a time (``c_load="tma"``), does not.

    python benchmarks/kernel_resources.py                 # every TMA candidate, with/without C
    python benchmarks/kernel_resources.py --dtype fp16

The Gluon kernel's offline compile (:func:`compile_for_target`, :func:`ptxas_resource_usage`)
lives here too, with the offline tooling, not in the kernel package (``gluon_probe.py
--compile`` and ``tests/kernels/test_gluon_kernel.py`` use it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

import triton
from dmuon_compile.kernels.lower_tiles import TileConfig
from dmuon_compile.kernels.syrk import CANDIDATES
from dmuon_compile.kernels.syrk_tma import _symmetric_product_tma_kernel

DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


def _signature(config: TileConfig, c_by_tma: bool, dtype: str) -> dict:
    """Triton's signature of the kernel for row-major operands (``A_ROWS_ARE_M``,
    ``B_ROWS_ARE_N``: a SYRK or a sym_mm with a column-major b) with this config's tiles."""
    rows, cols, block_k = config.block, config.cols, config.block_k
    strips = cols == 2 * rows
    out_tile = [1, rows, rows] if strips else [1, rows, cols]
    out_t_tile = [1, rows, rows] if strips else [1, cols, rows]
    unused = f"tensordesc<{dtype}[{rows}, {block_k}]>"  # a placeholder the kernel never reads
    signature = {
        "a_desc": f"tensordesc<{dtype}[{rows}, {block_k}]>",
        "b_desc": f"tensordesc<{dtype}[{cols}, {block_k}]>",
        "b_narrow_desc": f"tensordesc<{dtype}[{rows}, {block_k}]>",
        "c_desc": f"tensordesc<{dtype}{out_tile}>" if c_by_tma else unused,
        "c_ptr": f"*{dtype}",
        "out_ptr": f"*{dtype}",
        "out_desc": f"tensordesc<{dtype}{out_tile}>" if config.tma_store else unused,
        "out_t_desc": f"tensordesc<{dtype}{out_t_tile}>" if config.tma_store else unused,
    }
    for name in ("batch", "m", "k", "stride_cb", "stride_cm", "stride_cn"):
        signature[name] = "i32"
    for name in ("stride_ob", "stride_om", "stride_on"):
        signature[name] = "i32"
    for name in ("alpha", "beta", "gamma"):
        signature[name] = "fp32"
    signature["num_programs"] = "i32"
    return signature


def compile_sm90(config: TileConfig, has_c: bool, dtype: str = "bf16") -> dict:
    """Compile one launch variant for SM90: ``{"shared": bytes, "registers": n, "spill": bytes}``.

    ``has_c`` compiles the variant of ``config.c_load``: C by pointers in the epilogue, by TMA
    before the K loop (C_PROLOGUE) or by TMA in the epilogue (C_TMA).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    c_prologue = has_c and config.c_load == "prologue"
    c_tma = has_c and config.c_load == "tma"
    constexprs = {
        "A_ROWS_ARE_M": True,
        "B_ROWS_ARE_N": True,
        "HAS_C": has_c and not c_prologue,
        "C_PROLOGUE": c_prologue,
        "C_TMA": c_tma,
        "BLOCK_M": config.block,
        "BLOCK_N": config.cols,
        "BLOCK_K": config.block_k,
        "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "DOT_IN_FP32": False,
        "FLATTEN": config.flatten and config.cols != 2 * config.block,
        "TMA_STORE": config.tma_store,
    }
    signature = _signature(config, c_prologue or c_tma, dtype)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    compiled = triton.compile(
        ASTSource(_symmetric_product_tma_kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    usage = _resource_usage(compiled.asm["cubin"])
    return {"shared": compiled.metadata.shared, **usage}


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread and spill stack of a cubin, from Triton's bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", handle.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if registers is None or stack is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {text[:200]!r}")
    return {"registers": int(registers.group(1)), "spill": int(stack.group(1))}


# ----------------------------------------------------------------------------------------------
# The Gluon kernel (kernels/syrk_gluon.py), compiled without a GPU
# ----------------------------------------------------------------------------------------------


def _gluon_descriptor_signature(dtype, block: list) -> str:
    import torch
    from dmuon_compile.kernels.syrk_gluon import _shared_layout

    layout = _shared_layout(tuple(block), dtype)
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return f"tensordesc<{name}{list(block)},{layout!r}>"


def compile_for_target(
    config,
    *,
    syrk: bool,
    has_c: bool,
    dtype=None,
    c_dtype=None,
    capability: int = 90,
):
    """Compile the Gluon kernel with ``config`` (a ``GluonConfig``) for ``sm_<capability>``
    without a GPU (``triton.compile``); ``dtype`` defaults to bf16.

    Returns Triton's compiled kernel: ``.asm`` holds the TTGIR, PTX and cubin, ``.metadata``
    the shared memory (``shared``) and launch options. Registers per thread are in the cubin
    (see :func:`ptxas_resource_usage`).
    """
    import torch
    from dmuon_compile.kernels.syrk_gluon import BLOCK, _symmetric_product_gluon_kernel
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    dtype = dtype or torch.bfloat16
    bk = config.block_k
    c_dtype = c_dtype or dtype
    cols = config.cols if config.wide else BLOCK  # as syrk_gluon.kernel_arguments
    b_block = [cols, bk] if syrk else [1, bk, cols]
    out_sig = _gluon_descriptor_signature(dtype, [1, BLOCK, BLOCK])
    signature = {
        "a_desc": _gluon_descriptor_signature(dtype, [BLOCK, bk]),
        "b_desc": _gluon_descriptor_signature(dtype, b_block),
        "c_desc": _gluon_descriptor_signature(c_dtype, [1, BLOCK, cols]) if has_c else out_sig,
        "out_desc": out_sig,
        "m": "i32",
        "k": "i32",
        "total_tiles": "i32",
        "tiles_per_matrix": "i32",
        "alpha": "fp32",
        "beta": "fp32",
        "gamma": "fp32",
    }
    constexprs = dict(
        SPLIT=config.split,
        STAGES=config.stages,
        C_SLOTS=config.c_slots,
        CONSUMERS=config.consumers,
        SYRK=syrk,
        HAS_C=has_c,
        STORE_SLOTS=config.store_slots,
        WIDE=config.wide,
        num_warps=config.num_warps,
    )
    for name in constexprs:
        signature[name] = "constexpr"
    source = GluonASTSource(_symmetric_product_gluon_kernel, signature, constexprs)
    options = dict(num_warps=config.num_warps)
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def ptxas_resource_usage(compiled) -> dict:
    """``{"registers", "spill_stores", "spill_loads"}`` of a compiled kernel, from Triton's
    bundled ``ptxas -v`` run on its PTX (no GPU needed)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    arch = re.search(r"^\.target\s+(\S+)", compiled.asm["ptx"], re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    print("| config | C | shared KB | registers | spill bytes |")
    print("|---|---|---|---|---|")
    for config in (c for c in CANDIDATES if c.tma):
        variants = (
            ("none", config, False),
            ("epilogue", config, True),
            ("prologue", replace(config, c_load="prologue"), True),
        )
        if config.tma_store:
            variants += (("tma", replace(config, c_load="tma"), True),)
        for label, variant, has_c in variants:
            try:
                r = compile_sm90(variant, has_c, DTYPES[args.dtype])
                print(
                    f"| {config.name} | {label} | {r['shared'] / 1024:.0f} | {r['registers']} | "
                    f"{r['spill']} |",
                    flush=True,
                )
            except Exception as exc:  # a configuration that does not compile is a result too
                print(f"| {config.name} | {label} | failed: {type(exc).__name__} | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
