"""Worker process for the TRITON_INTERPRET=1 kernel tests (not a test module).

Triton decides at decoration time whether ``@triton.jit`` kernels are interpreted, and its own
library functions must be interpreted too, so the interpreter cannot be switched on inside a
pytest process that already imported Triton. The tests start this script once with
``TRITON_INTERPRET=1`` and send it one case per line on stdin: ``<input.pt> <output.pt>``. The
input file holds ``a, b, c, alpha, beta, gamma, config, num_sms, out`` (``out`` poisoned with
NaN); the worker runs the kernel into ``out``, saves it and answers ``ok tma`` or ``ok ptr``
(which loads the launch used: TMA descriptors or pointers; ``+cp`` / ``+ct`` when C was read
by TMA into the accumulator / in the epilogue, ``TileConfig.c_load``) or ``error: ...``.
A case with ``kind="mirror"`` runs ``mirror_lower_inplace(p, block)`` instead, and one with
``kind="scale_cast"`` runs ``kernels/scale_cast.py``'s kernel on ``g, denom, dtype``, and one
with ``kind="copy_unless"`` ``kernels/copy_unless.py``'s on ``flag, dst, src``.
"""

import os
import sys
import traceback

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("interpret_worker.py must run with TRITON_INTERPRET=1")

import torch  # noqa: E402
from dmuon_compile.kernels.copy_unless import copy_unless  # noqa: E402
from dmuon_compile.kernels.lower_tiles import TileConfig  # noqa: E402
from dmuon_compile.kernels.mirror import mirror_lower_inplace  # noqa: E402
from dmuon_compile.kernels.scale_cast import scale_cast  # noqa: E402
from dmuon_compile.kernels.symmetric_product import launch_symmetric_product  # noqa: E402
from dmuon_compile.kernels.syrk_tma import (  # noqa: E402
    c_descriptor,
    output_descriptors,
    tma_descriptors,
)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            in_path, out_path = line.split()
            case = torch.load(in_path)
            if case.get("kind") == "mirror":
                torch.save(mirror_lower_inplace(case["p"], block=case["block"]), out_path)
                print("ok", flush=True)
                continue
            if case.get("kind") == "scale_cast":
                torch.save(scale_cast(case["g"], case["denom"], case["dtype"]), out_path)
                print("ok", flush=True)
                continue
            if case.get("kind") == "copy_unless":
                out = copy_unless(case["flag"], case["dst"], case["src"])
                torch.save(out, out_path)
                print("ok", flush=True)
                continue
            config = TileConfig(**case["config"])
            used_tma = config.tma and tma_descriptors(case["a"], case["b"], config) is not None
            result = launch_symmetric_product(
                case["a"],
                case["b"],
                case["c"],
                case["alpha"],
                case["beta"],
                case["gamma"],
                config,
                num_sms=case["num_sms"],
                out=case["out"],
            )
            torch.save(result, out_path)
            by_tma = (
                used_tma
                and case["c"] is not None
                and case["beta"] != 0
                and c_descriptor(case["c"], config) is not None
            )
            suffix = ""
            if by_tma and config.c_load == "prologue" and case["alpha"] != 0:
                suffix = "+cp"
            elif by_tma and config.c_load == "tma" and output_descriptors(case["out"], config):
                suffix = "+ct"
            print(("ok tma" if used_tma else "ok ptr") + suffix, flush=True)
        except Exception:
            print("error: " + traceback.format_exc().replace("\n", " | "), flush=True)


if __name__ == "__main__":
    main()
