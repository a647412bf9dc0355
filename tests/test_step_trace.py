"""The traced Muon step costs Dynamo a few calls per matrix, not one per operation.

``functional.muon_update`` traces momentum and the update as ``foreach`` calls (one per list,
or per distinct learning-rate scale), so a step over many matrices stays quick to trace (the
warm first compiled step is mostly this trace). Counted with Dynamo's ``calls_captured`` on
the ``eager`` backend (no Inductor): the count grows by at most ``PER_MATRIX`` per added
same-shape matrix. Control: the same update written one matrix at a time (the shape the step
had before) grows by more than that bound on the same counter.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dmuon_compile import functional as F
from dmuon_compile.compiled_step import torch_chain
from dmuon_compile.newton_schulz import NewtonSchulz

# Per matrix: the getitems that unpack a foreach result (momentum, Nesterov) and a stack's
# unbind.
PER_MATRIX = 4


def _per_matrix_update(params, grads, bufs, *, lr, weight_decay, momentum, nesterov, ns):
    """The control: momentum and update one matrix at a time (tensor hyper-parameters)."""
    updates = []
    for g, buf in zip(grads, bufs):
        buf.mul_(momentum).add_(g)
        updates.append(g + momentum * buf if nesterov else buf)
    ortho = F.orthogonalize(updates, ns)
    for p, o in zip(params, ortho):
        p.mul_(1.0 - lr * weight_decay)
        p.sub_(o.to(p.dtype) * (lr * F.lr_scale(p.shape, "match_rms_adamw")))


def _calls_captured(fn, n: int) -> int:
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(n)
    params = [torch.randn(8, 24, generator=g) for _ in range(n)]
    grads = [torch.randn(8, 24, generator=g) for _ in range(n)]
    bufs = [torch.zeros(8, 24) for _ in range(n)]
    hypers = {k: torch.tensor(v) for k, v in dict(lr=0.02, weight_decay=0.01, momentum=0.9).items()}
    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
    compiled(params, grads, bufs, nesterov=True, ns=torch_chain(NewtonSchulz()), **hypers)
    calls = counters["stats"]["calls_captured"]
    torch._dynamo.reset()
    return calls


@pytest.mark.parametrize(
    "fn, bounded",
    [(F.muon_update, True), (_per_matrix_update, False)],
    ids=["muon_update", "control_per_matrix"],
)
def test_trace_grows_by_a_few_calls_per_matrix(fn, bounded):
    growth = (_calls_captured(fn, 8) - _calls_captured(fn, 4)) / 4
    assert growth > 0  # the counter sees the matrices at all
    assert (growth <= PER_MATRIX) is bounded, f"{growth} traced calls per added matrix"
