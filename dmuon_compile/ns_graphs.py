"""Per-shape CUDA-graph replay of eager Newton–Schulz, where launches cost more than the math.

An eager NS call issues a few dozen kernel launches from Python (normalise, the symmetric
products, the restarts, the rectangular products). On small matrices the host takes longer
than the GPU (``benchmarks/ns_graph_probe.py`` measures it).
:class:`GraphedCalls` captures one CUDA graph per input layout after an ordinary first call
(which autotunes and compiles the kernels), then replays it: the input is copied into the
graph's static buffer, the graph replays, and the static output is cloned (a caller may keep
the result across calls). The replay runs the same kernels on the same
data as the eager call, so the result is bitwise the eager one (``tests/test_ns_graphs.py`` on
the GPU).

A call is replayed only when all of these hold (otherwise it runs eagerly, unchanged):

- the input is a CUDA tensor with at most :data:`MAX_ELEMENTS` elements (larger calls are
  GPU-bound: a graph saves nothing there and keeps its intermediates' memory);
- no autograd graph is recorded (no input requiring grad under grad mode), no ``torch.compile``
  trace and no CUDA-graph capture is running;
- ``DMUON_NS_GRAPHS`` is not ``0``.

A capture that fails (an op that cannot be captured) is reported once and the layout stays
eager from then on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from dmuon_compile import env

SWITCH = env.NS_GRAPHS
# 16M elements: past this size the call is GPU-bound, so a graph saves nothing and would only
# keep its intermediates' memory in the graph's pool.
MAX_ELEMENTS = 1 << 24
_EAGER = "eager"  # a layout whose capture failed


def wanted(g: Tensor) -> bool:
    """Whether a call on ``g`` would be replayed from a graph (the rules of the module doc).

    >>> wanted(torch.randn(4, 8))  # a CPU tensor
    False
    """
    return (
        g.is_cuda
        and g.numel() <= MAX_ELEMENTS
        and not (g.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
        and env.ns_graphs()
    )


class _Captured:
    """One captured call: its static input, the graph and its static output."""

    def __init__(self, fn: Callable[[Tensor], Tensor], example: Tensor) -> None:
        self.static_in = torch.empty_strided(
            example.shape, example.stride(), dtype=example.dtype, device=example.device
        )
        self.static_in.copy_(example)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (NCCL watchdogs) must not fail the capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_out = fn(self.static_in)

    def __call__(self, g: Tensor) -> Tensor:
        self.static_in.copy_(g)
        self.graph.replay()
        return self.static_out.clone()


class GraphedCalls:
    """The captured graphs of one function, keyed by the input's layout and a config key.

    ``fn`` must be a pure function of its input whose kernels do not change between calls
    with the same key (NS's verdicts are final once a shape is tuned). The first call of a key
    runs eagerly (autotune, compiles, lazy CUDA state), the second captures, later ones replay.

    Example::

        calls = GraphedCalls()
        out = calls(ns_config_key, ns._eager_call, g)
    """

    def __init__(self) -> None:
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Captured | str] = {}

    def __call__(self, config_key: tuple, fn: Callable[[Tensor], Tensor], g: Tensor) -> Tensor:
        key = (config_key, tuple(g.shape), g.stride(), g.dtype, g.device)
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen:  # first call: eager, so the kernels exist before capture
                self._seen.add(key)
                return fn(g)
            captured = self._capture(key, fn, g)
        if captured == _EAGER:
            return fn(g)
        return captured(g)  # type: ignore[operator]

    def _capture(self, key: tuple, fn: Callable[[Tensor], Tensor], g: Tensor):
        try:
            captured: _Captured | str = _Captured(fn, g)
        except Exception as exc:  # a kernel that cannot be captured: stay eager, say so once
            warnings.warn(
                f"dmuon_compile: eager Newton–Schulz for {tuple(g.shape)} {g.dtype} could not be "
                f"captured in a CUDA graph ({type(exc).__name__}: {exc}); it runs eagerly. "
                f"{SWITCH}=0 turns graph replay off",
                RuntimeWarning,
                stacklevel=4,
            )
            captured = _EAGER
        self._graphs[key] = captured
        return captured

    def __deepcopy__(self, memo) -> GraphedCalls:
        return GraphedCalls()  # graphs belong to one process and one set of buffers

    def __getstate__(self) -> dict:
        return {"_seen": set(), "_graphs": {}}

    def __len__(self) -> int:
        return sum(1 for c in self._graphs.values() if c != _EAGER)
