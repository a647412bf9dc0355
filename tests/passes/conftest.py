"""Fixtures of the pass tests: fresh Dynamo state, caches off, the global pass restored.

Caches are disabled because a warm FX graph cache skips a custom pass entirely (its uuid is
part of the key) and the tests assert that the pass ran.
"""

import logging

import dmuon_compile.passes  # noqa: F401  (registers torch.ops.dmuon and the log name)
import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    counters.clear()
    saved = torch._inductor.config.post_grad_custom_pre_pass
    with torch._inductor.config.patch(force_disable_caches=True, fx_graph_cache=False):
        yield
    torch._inductor.config.post_grad_custom_pre_pass = saved
    torch._dynamo.reset()


def aten_graph(fn, *args):
    """``fn`` traced to an aten-level ``GraphModule`` with fake-tensor metadata (no Inductor)."""
    return make_fx(fn, tracing_mode="fake")(*args)


@pytest.fixture
def trace():
    """The ``aten_graph`` helper (conftest modules are not importable by name here)."""
    return aten_graph


class Records(logging.Handler):
    """Collects the formatted records of a logger (torch's handlers do not propagate to caplog)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def dmuon_records():
    log = logging.getLogger("dmuon_compile.passes")
    handler = Records()
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(old_level)
