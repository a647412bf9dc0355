"""Registers the ``dmuon`` ``TORCH_LOGS`` name during ``import torch``, and nothing else.

``import torch`` validates ``TORCH_LOGS`` before any other package runs, so
``TORCH_LOGS="+dmuon"`` from the environment needs the name to exist at that moment. torch
calls every ``torch.backends`` entry point just before it parses ``TORCH_LOGS``; this module is
the package's. It lives outside ``dmuon_compile`` and imports only ``os`` because torch loads
it on *every* ``import torch``: it must cost nothing, import nothing of the package, and never
fail. It registers the name only when ``TORCH_LOGS`` mentions it; importing ``dmuon_compile``
registers it in any case (``dmuon_compile.log.register_torch_logs``).
"""

import os

NAME = "dmuon"
LOGGER = "dmuon_compile"


def mentions(setting: str) -> bool:
    """Whether a ``TORCH_LOGS`` value names ``dmuon`` (with or without ``+``/``-``)."""
    return any(part.strip().lstrip("+-") == NAME for part in setting.split(","))


def register() -> None:
    """The entry point: register ``dmuon`` → the ``dmuon_compile`` logger if asked for."""
    if not mentions(os.environ.get("TORCH_LOGS", "")):
        return
    try:
        from torch._logging import _internal

        _internal.register_log(NAME, LOGGER)
    except Exception:  # noqa: BLE001 - a private torch API; never break `import torch`
        pass
