"""Check that every rank resolved the same Newton–Schulz backend and kernel.

Mixing kernels across ranks (Triton on some, cuBLAS on others, e.g. after a per-node
``DMUON_NS_KERNEL``) makes replicas drift apart; this turns that into a clear error at start-up.
"""

from __future__ import annotations

import torch.distributed as dist


def check_ns_backend_consistent(ns=None, group=None) -> str:
    """All-gather ``get_ns_backend(ns)`` over ``group`` and raise if the ranks disagree.

    Returns this rank's backend string. Without an initialised process group it only returns
    the local string. Collective: every rank of ``group`` must call it.

    Example::

        opt = dmuon.Muon(model, lr=0.02)
        dmuon.check_ns_backend_consistent(opt)   # raises RuntimeError listing odd ranks
    """
    from dmuon_compile.newton_schulz import get_ns_backend

    local = get_ns_backend(ns)
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
