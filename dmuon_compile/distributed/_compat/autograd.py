"""What the runtime reads from the autograd engine, in one module.

The dedicated runtime needs to know whether a hook runs inside a backward (a checkpointed
forward recomputed during backward must not unshard or reshard like a real one) and to run
its end-of-backward work once every gradient of the backward is ready (the engine's
``queue_callback``, as FSDP2 does). Each accessor raises
:class:`dmuon_compile._compat.TorchInternalsError` when this torch moved what it reads.
"""

from __future__ import annotations

from dmuon_compile._compat import PrivateAPI

_MODULE = "distributed/_compat/autograd.py"

_GRAPH_TASK_ID = PrivateAPI(
    "torch", "_C._current_graph_task_id", "the dedicated runtime's backward detection", _MODULE
)
_ENGINE = PrivateAPI(
    "torch",
    "autograd.Variable._execution_engine.queue_callback",
    "the dedicated gradients' end-of-backward reduce",
    _MODULE,
)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread now."""
    return _GRAPH_TASK_ID.get()() != -1


def queue_callback(fn) -> None:
    """Run ``fn`` when the current backward has finished (``Variable._execution_engine``)."""
    _ENGINE.get()(fn)
