"""The ``DMUON_*`` environment variables ``dmuon_compile`` reads, all read here.

=================================  =======  ===================================================
variable                           default  effect
=================================  =======  ===================================================
``DMUON_NS_KERNEL``                unset    overrides ``NewtonSchulz(kernel="auto")``:
                                            ``triton``, ``quack`` or ``cublas``
``DMUON_NS_GRAPHS``                ``1``    ``0`` turns off the CUDA-graph replay of small eager
                                            ``NewtonSchulz`` calls (``ns_graphs.py``)
``DMUON_COMPILE_LOG``              ``1``    ``0`` silences the per-rank "compiling the Muon
                                            step" progress lines
``DMUON_RECORD_FORWARD_PROFILE``   ``0``    ``1`` before ``dedicate_params``: the runtime counts
                                            and times its unshards, publishes and TP scatters
                                            (``collect_forward_unshard_profile``)
=================================  =======  ===================================================

The kernel package reads its own (``DMUON_CACHE_DIR``, ``DMUON_SYRK_AUTOTUNE``,
``DMUON_SYRK_AUTOTUNE_LOG``); README.md lists every variable. Each is read when it is used, so
a variable set before the call it governs takes effect.
"""

from __future__ import annotations

import os

NS_KERNEL = "DMUON_NS_KERNEL"
NS_GRAPHS = "DMUON_NS_GRAPHS"
COMPILE_LOG = "DMUON_COMPILE_LOG"
RECORD_FORWARD_PROFILE = "DMUON_RECORD_FORWARD_PROFILE"
NS_KERNELS = ("triton", "quack", "cublas")


def flag(name: str, default: bool = True) -> bool:
    """A boolean switch: unset or empty → ``default``; ``0/false/no/off`` → False."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def ns_kernel() -> str | None:
    """``DMUON_NS_KERNEL`` (``"triton"`` / ``"quack"`` / ``"cublas"``), ``None`` when unset;
    anything else raises, naming the values it takes."""
    value = os.environ.get(NS_KERNEL, "").strip().lower()
    if not value:
        return None
    if value not in NS_KERNELS:
        raise ValueError(
            f"{NS_KERNEL}={value!r} is not a kernel; "
            "set it to 'triton', 'quack' or 'cublas' or unset it"
        )
    return value


def ns_graphs() -> bool:
    return flag(NS_GRAPHS, True)


def record_forward_profile() -> bool:
    return flag(RECORD_FORWARD_PROFILE, False)
