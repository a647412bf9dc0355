"""Show the Triton source behind pass-inserted ``torch.ops.dmuon`` calls under ``TORCH_LOGS``.

Inductor's ``output_code`` prints a pass-inserted custom op only as a call
(``torch.ops.dmuon.sym_mm.default(...)``): its Triton kernels are compiled by the kernel
package, not by Inductor. When ``TORCH_LOGS="+dmuon"`` is set, the pass logs at DEBUG level,
under the ``dmuon`` logger, the source of every kernel behind the ops it inserted:

- sources registered with :func:`register_kernel_source` (rendered templates), and
- every ``@triton.jit`` function found in the loaded ``dmuon_compile.kernels.*`` modules.

Example::

    register_kernel_source("syrk_lower_tiles[BLOCK=128]", rendered_text)
    # TORCH_LOGS="+dmuon" python train.py   -> "dmuon kernel source syrk_lower_tiles[...]: ..."
"""

from __future__ import annotations

import logging
import sys

from torch.fx import Graph

log = logging.getLogger("dmuon_compile.passes")

_REGISTERED: dict[str, str] = {}


def register_kernel_source(name: str, source: str) -> None:
    """Record the rendered source of a kernel so the pass can log it (latest wins).

    >>> register_kernel_source("demo_kernel", "@triton.jit\\ndef demo_kernel(): pass")
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"register_kernel_source({name!r}, ...): source must be non-empty text")
    _REGISTERED[name] = source


def kernel_sources() -> dict[str, str]:
    """``{name: source}`` of every known dmuon kernel (registered or ``@triton.jit`` in kernels)."""
    found = dict(_REGISTERED)
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("dmuon_compile.kernels"):
            continue
        for attr, obj in list(vars(module).items()):
            src = getattr(obj, "src", None)  # triton.runtime.jit.JITFunction keeps its source
            if isinstance(src, str) and type(obj).__name__ in (
                "JITFunction",
                "Autotuner",
                "Heuristics",
            ):
                found.setdefault(f"{mod_name}.{attr}", src)
            elif type(obj).__name__ in ("Autotuner", "Heuristics"):
                inner = getattr(obj, "fn", None)
                if isinstance(getattr(inner, "src", None), str):
                    found.setdefault(f"{mod_name}.{attr}", inner.src)
    return found


def log_kernel_sources(graph: Graph, ops_inserted, devices=None) -> None:
    """Log (DEBUG) which implementation the inserted ops run and, on CUDA, the kernel sources.

    ``devices`` overrides the device types read from the graph (tests use ``["cuda"]``).
    """
    from dmuon_compile.passes.symmetry import val

    if devices is None:
        devices = sorted(
            {
                val(n).device.type
                for n in graph.nodes
                if n.op == "call_function"
                and str(n.target).startswith("dmuon.")
                and val(n) is not None
            }
        )
    ops = ", ".join(f"dmuon::{name}" for name in sorted(ops_inserted))
    if "cuda" not in devices:
        log.debug(
            "kernel source: %s run their torch reference implementation on %s (no Triton "
            "kernel involved; on CUDA the Triton sources are logged here)",
            ops,
            "/".join(devices) or "an unknown device",
        )
        return
    sources = kernel_sources()
    if not sources:
        log.debug(
            "kernel source: no Triton kernel of dmuon_compile.kernels is loaded; %s use "
            "their torch reference implementation",
            ops,
        )
        return
    for name, src in sorted(sources.items()):
        log.debug(
            "dmuon kernel source %s (behind %s; per shape, autotune may pick cuBLAS instead):\n%s",
            name,
            ops,
            src,
        )
