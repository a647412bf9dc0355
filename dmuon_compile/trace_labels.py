"""Profiler labels: a ``torch.profiler.record_function`` range around every runtime phase.

FSDP2 names its phases in a trace (``FSDP::all_gather``, ...); these name ours, so a trace shows
which CPU-side work (and, under it, which kernels and collectives) belongs to which phase:

=====================  ======================================================================
``dmuon::unshard``     a hook group's unshard: the owners' masters into its flat buffer (the
                       pending updates it applies first included) and the wait for it
``dmuon::reduce``      a hook group's gradient reduce to the owners (HSDP: and to the global
                       owner) and its finish (``param.grad`` set)
``dmuon::publish``     the HSDP publish: the global owners' broadcast of new weights, and
                       the wait for it
``dmuon::tp_gather``   TP: the Nesterov inputs of a shape bucket gathered to the TP owners
``dmuon::tp_scatter``  TP: the owners' update shards scattered back, and their application
``dmuon::step``        ``Muon.step``
``dmuon::ns``          Newton–Schulz (the compiled step's directions, or the eager reference)
=====================  ======================================================================

The unshard, reduce and publish ranges name their hook group as FSDP2's do
(``dmuon::unshard (layers.0)``); :func:`phase_of` gives the phase of such a name.

Cheap when no profiler runs (one check, no range object), and absent from compiled graphs (a
range inside a traced function is skipped: the compiled region has its own label).
"""

from __future__ import annotations

import contextlib

import torch

from dmuon_compile._compat import profiler_enabled

UNSHARD = "dmuon::unshard"
REDUCE = "dmuon::reduce"
PUBLISH = "dmuon::publish"
TP_GATHER = "dmuon::tp_gather"
TP_SCATTER = "dmuon::tp_scatter"
STEP = "dmuon::step"
NS = "dmuon::ns"
ALL = (UNSHARD, REDUCE, PUBLISH, TP_GATHER, TP_SCATTER, STEP, NS)

_NONE = contextlib.nullcontext()


def label(name: str, group: str | None = None):
    """A ``record_function(name)`` range while a profiler runs, else a no-op context.
    ``group``: the hook group it works for, named as FSDP2 names its ranges
    (``dmuon::unshard (layers.0)``, beside ``FSDP::pre_forward (layers.0)``)."""
    # is_compiling first: Dynamo folds it to True and never traces the profiler query.
    if torch.compiler.is_compiling() or not profiler_enabled():
        return _NONE
    return torch.profiler.record_function(name if group is None else f"{name} ({group})")


def phase_of(range_name: str) -> str:
    """The phase of a range's name, without its group: ``"dmuon::unshard (layers.0)"`` →
    ``"dmuon::unshard"``.

    >>> phase_of("dmuon::reduce (layers.3)")
    'dmuon::reduce'
    """
    return range_name.split(" (", 1)[0]
