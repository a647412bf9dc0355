"""The one place that knows about torch-version differences.

The floor is torch 2.11 (the first release this project is tested on: FSDP2's public
``fully_shard`` hooks, ``torch.library.custom_op`` with ``register_fake`` and
``CustomGraphPass`` all behave as the code expects from there on).
"""

from __future__ import annotations

import re

TORCH_FLOOR = (2, 11)
TORCH_FLOOR_STR = "2.11"


def parse_version(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; unparseable parts count as 0."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str) -> None:
    """Raise an ImportError that names the needed version and the upgrade command."""
    if parse_version(version) < TORCH_FLOOR:
        raise ImportError(
            f"dmuon_compile requires PyTorch >= {TORCH_FLOOR_STR} (found {version}): it builds on "
            "FSDP2 (fully_shard from torch.distributed.fsdp), torch.library.custom_op and "
            "Inductor's CustomGraphPass. Fix: upgrade PyTorch, e.g.\n"
            f'    pip install "torch>={TORCH_FLOOR_STR}"\n'
            "(add --index-url https://download.pytorch.org/whl/cu130 for a CUDA build)."
        )
