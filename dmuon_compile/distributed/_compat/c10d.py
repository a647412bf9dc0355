"""What the runtime reads from c10d process groups, in one module.

The runtime's own groups inherit the default group's timeout (``init_process_group(timeout=)``),
read from the backend options (``ProcessGroup._get_backend(device).options._timeout``), and the
step's agreement collective names the default group (``_get_default_group``). Each accessor
raises :class:`dmuon_compile._compat.TorchInternalsError` when this torch moved what it reads.
"""

from __future__ import annotations

import datetime

from dmuon_compile._compat import PrivateAPI, torch_internals_error

_MODULE = "distributed/_compat/c10d.py"
_TIMEOUT = "the dedicated groups' timeout (inherited from init_process_group)"

_DEFAULT_GROUP = PrivateAPI(
    "torch.distributed.distributed_c10d",
    "_get_default_group",
    "the dedicated runtime's process groups",
    _MODULE,
)
_GET_BACKEND = PrivateAPI("torch.distributed", "ProcessGroup._get_backend", _TIMEOUT, _MODULE)
_DEVICE_TYPES = PrivateAPI("torch.distributed", "ProcessGroup._device_types", _TIMEOUT, _MODULE)

# Backends whose options carry ``_timeout`` on every checked torch; others (a custom or fake
# backend) may not expose one, and then the timeout is unknown (``None``).
_TIMED_BACKENDS = ("gloo", "nccl")


def default_group():
    """The default process group (``init_process_group``'s)."""
    return _DEFAULT_GROUP.get()()


def backend_timeout(group) -> datetime.timedelta | None:
    """``group``'s timeout as its backend options hold it; ``None`` for a backend that keeps
    none (neither gloo nor NCCL); raises when a gloo/NCCL backend's options moved."""
    _GET_BACKEND.get()
    _DEVICE_TYPES.get()
    for device in group._device_types:
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # no backend registered for that device
            continue
        options = getattr(backend, "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
        if any(name in type(backend).__name__.lower() for name in _TIMED_BACKENDS):
            raise torch_internals_error(
                f"{type(backend).__name__}.options._timeout", _TIMEOUT, _MODULE
            )
    return None
