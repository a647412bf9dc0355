"""Check that every rank resolved the same Newton–Schulz backend and kernel.

Mixing kernels across ranks (Triton on some, cuBLAS on others, e.g. after a per-node
``DMUON_NS_KERNEL``) makes replicas drift apart; this turns that into a clear error at start-up.

The kernels are the floor of the package: this module imports nothing of ``dmuon_compile``
above them. :func:`agree_across_ranks` gathers and compares any per-rank description;
``dmuon.check_ns_backend_consistent`` (``dmuon_compile/newton_schulz.py``) gives it
``get_ns_backend(ns)``, the active orthogonaliser's when ``ns`` is omitted. The
:func:`check_ns_backend_consistent` here takes the orthogonaliser (or its ``Muon``) explicitly.
"""

from __future__ import annotations

import torch.distributed as dist


def agree_across_ranks(local: str, group=None) -> str:
    """All-gather ``local`` (this rank's backend description) over ``group`` and raise a
    ``RuntimeError`` naming the odd ranks if the ranks disagree; returns ``local``.

    Without an initialised process group it only returns ``local``. Collective: every rank of
    ``group`` must call it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return local
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    if len(set(gathered)) > 1:
        by_backend: dict[str, list[int]] = {}
        for index, backend in enumerate(gathered):
            rank = dist.get_global_rank(group, index) if group is not None else index
            by_backend.setdefault(backend, []).append(rank)
        majority = max(by_backend, key=lambda b: len(by_backend[b]))
        if 2 * len(by_backend[majority]) > world:  # "most" only for more than half the ranks
            odd = {b: r for b, r in by_backend.items() if b != majority}
            head = f"Most ranks ({by_backend[majority]}) use {majority!r}, but"
        else:  # an even split (1 vs 1) or no majority: every side by name
            odd, head = by_backend, "No backend is on most ranks:"
        lines = "\n".join(f"  ranks {ranks}: {backend!r}" for backend, ranks in odd.items())
        raise RuntimeError(
            "dmuon_compile: ranks resolved different Newton–Schulz kernels, which makes replicas "
            f"drift. {head}\n{lines}\n"
            "Set the same NewtonSchulz(kernel=...) or DMUON_NS_KERNEL on every rank "
            "(kernel='cublas' works everywhere)."
        )
    return local


def check_ns_backend_consistent(ns, group=None) -> str:
    """:func:`agree_across_ranks` over ``ns.describe()``: ``ns`` a ``NewtonSchulz``, or a
    ``Muon`` (its ``.ns``). ``dmuon.check_ns_backend_consistent`` also takes none (the active
    orthogonaliser).

    Example::

        check_ns_backend_consistent(dmuon.NewtonSchulz(kernel="cublas"))
    """
    describe = getattr(ns, "describe", None) or getattr(getattr(ns, "ns", None), "describe", None)
    if not callable(describe):
        raise TypeError(
            "check_ns_backend_consistent() takes a NewtonSchulz or a Muon, got "
            f"{type(ns).__name__}; dmuon.check_ns_backend_consistent() reads the active one"
        )
    return agree_across_ranks(describe(), group)
