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
``DMUON_CACHE_DIR``                unset    where the SYRK autotune verdicts persist (default
                                            ``$XDG_CACHE_HOME/dmuon_compile`` or
                                            ``~/.cache/dmuon_compile``; ``kernels/autotune.py``)
``DMUON_SYRK_AUTOTUNE``            ``1``    ``0``: the ops do not time, an untimed rule picks;
                                            ``all``: every candidate is timed, not the shortlist
``DMUON_SYRK_AUTOTUNE_LOG``        ``1``    ``0`` silences the per-rank autotune progress lines
=================================  =======  ===================================================

The kernel package (``dmuon_compile.kernels``) and the pass (``dmuon_compile.passes``) read
theirs here too: this module imports nothing of ``dmuon_compile``, so the kernels, the floor of
the package, may import it. docs/environment.md lists every variable. Each is read when it is
used, so a variable set before the call it governs takes effect.
"""

from __future__ import annotations

import os

NS_KERNEL = "DMUON_NS_KERNEL"
NS_GRAPHS = "DMUON_NS_GRAPHS"
COMPILE_LOG = "DMUON_COMPILE_LOG"
RECORD_FORWARD_PROFILE = "DMUON_RECORD_FORWARD_PROFILE"
CACHE_DIR = "DMUON_CACHE_DIR"
SYRK_AUTOTUNE = "DMUON_SYRK_AUTOTUNE"
SYRK_AUTOTUNE_LOG = "DMUON_SYRK_AUTOTUNE_LOG"
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


def ns_kernel_setting() -> str:
    """``DMUON_NS_KERNEL`` as set, unvalidated (``""`` when unset): part of the NS-chain pass's
    cache key (``passes/manager.py``), which must not raise where :func:`ns_kernel` would."""
    return os.environ.get(NS_KERNEL, "")


def ns_graphs() -> bool:
    return flag(NS_GRAPHS, True)


def record_forward_profile() -> bool:
    return flag(RECORD_FORWARD_PROFILE, False)


def cache_dir() -> str | None:
    """``DMUON_CACHE_DIR``, ``None`` when unset or empty (the autotune cache's folder)."""
    return os.environ.get(CACHE_DIR) or None


def syrk_autotune() -> bool:
    """False when ``DMUON_SYRK_AUTOTUNE=0`` (the ops' untimed rule decides instead)."""
    return flag(SYRK_AUTOTUNE, True)


def syrk_autotune_all() -> bool:
    """True when ``DMUON_SYRK_AUTOTUNE=all``: time every candidate, not the shortlist."""
    return os.environ.get(SYRK_AUTOTUNE, "").strip().lower() == "all"
