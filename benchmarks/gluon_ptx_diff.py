"""Does a change leave the GPU-checked Gluon kernels as they were? A CPU check, no GPU needed.

Compiles ``kernels/syrk_gluon.py`` of two source trees for sm_90 (Triton's own compiler and
bundled ptxas, ``kernel_resources.compile_for_target`` of each tree) for every configuration
named, SYRK and ``sym_mm``, with and without a C term, and compares the PTX instructions
(comments, line information, debug sections and the labels debug information adds are
dropped). "identical" means the GPU runs the same instructions as the base tree's kernel did.

    git archive <base commit> | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python benchmarks/gluon_ptx_diff.py /tmp/base .
    python benchmarks/gluon_ptx_diff.py /tmp/base . --configs "split=1,stages=4"

Each tree is compiled in its own process (both trees define the same module names).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

# The configurations the GPU tests and the autotune have run (tests/kernels/test_gluon_kernel.py).
DEFAULT_CONFIGS = (
    "split=1,stages=4;split=2,stages=3,c_slots=1;split=1,stages=3,consumers=2,num_warps=4"
)


def normalized_ptx(ptx: str) -> str:
    """The PTX's instructions: no comments, ``.loc``/``.file``, debug sections or debug labels."""
    ptx = ptx.split(".section")[0]
    keep = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(("//", ".loc", ".file")):
            continue
        if re.match(r"^\$L__(tmp|func_end)\d+:$", stripped):
            continue
        keep.append(line)
    return "\n".join(keep)


def _fingerprints(root: Path, spec: str) -> dict[str, str]:
    """In this process: compile ``root``'s kernel for each configuration and variant."""
    import importlib.util

    sys.path.insert(0, str(root))
    import dmuon_compile  # noqa: F401  (the installed package; the kernel module is replaced)

    name = "dmuon_compile.kernels.syrk_gluon"
    spec0 = importlib.util.spec_from_file_location(name, root / "kernels" / "syrk_gluon.py")
    kernel = importlib.util.module_from_spec(spec0)
    sys.modules[name] = kernel  # what this tree's kernel_resources imports
    spec0.loader.exec_module(kernel)
    path = root / "benchmarks" / "kernel_resources.py"
    spec1 = importlib.util.spec_from_file_location("_ptx_diff_resources", path)
    resources = importlib.util.module_from_spec(spec1)
    spec1.loader.exec_module(resources)

    out = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        fields = {k.strip(): int(v) for k, v in (p.split("=") for p in item.split(","))}
        config = kernel.GluonConfig(**fields)
        for syrk in (True, False):
            for has_c in (False, True):
                compiled = resources.compile_for_target(config, syrk=syrk, has_c=has_c)
                text = normalized_ptx(compiled.asm["ptx"])
                key = f"{config.name} {'syrk' if syrk else 'sym_mm'}{' +C' if has_c else ''}"
                out[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the base source tree (e.g. a git archive of a commit)")
    ap.add_argument("new", help="the tree to compare (e.g. .)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated GluonConfigs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one tree, in its own process
        print(json.dumps(_fingerprints(Path(args.base).resolve(), args.configs)))
        return 0
    prints = []
    for tree in (args.base, args.new):
        done = subprocess.run(
            [sys.executable, __file__, tree, tree, "--configs", args.configs, "--worker"],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(f"compiling {tree} failed:\n{done.stderr[-2000:]}")
            return 2
        prints.append(json.loads(done.stdout.strip().splitlines()[-1]))
    differ = 0
    for key in prints[0]:
        same = prints[0][key] == prints[1].get(key)
        differ += not same
        print(f"{key:44s} {'identical' if same else 'DIFFERS'}")
    print(f"{len(prints[0]) - differ}/{len(prints[0])} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
