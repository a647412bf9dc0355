"""The demo's corpus: the Python standard library's own source files, as bytes.

Every machine that runs Python has this text, so the demo needs no download. The pipeline:

1. :func:`list_source_files` finds every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``
   (skipping ``site-packages``/``dist-packages``, which hold installed third-party code, and
   files over ``max_file_bytes``), and orders them by a hash of their relative path: a fixed,
   machine-independent shuffle, so a size cap takes a mix of modules instead of an
   alphabetical prefix.
2. :func:`split_files` puts each file in *train* or *validation* by another hash of its path:
   deterministic, disjoint by file, and stable when the cap changes.
3. :func:`load_corpus` reads files in that order until ``max_bytes`` and returns two
   ``uint8`` token tensors (byte-level tokens, vocabulary 256), files joined by a newline.
4. :class:`WindowSampler` draws random windows ``(x, y = x shifted by one)`` from a seeded
   generator. The *global* batch of a step depends only on ``(seed, step)``; rank ``r`` of
   ``W`` takes rows ``r·B/W … (r+1)·B/W − 1`` of it, so every rank reads a different slice and
   one process sees the same data as two.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

VOCAB_SIZE = 256
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_FILE_BYTES = 256 * 1024
DEFAULT_VAL_FRACTION = 0.05


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _hash01(text: str, salt: str) -> float:
    """A deterministic number in [0, 1) from ``text`` (sha1; independent of PYTHONHASHSEED)."""
    digest = hashlib.sha1(f"{salt}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def list_source_files(
    root: Path | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> list[Path]:
    """All ``*.py`` files under ``root`` (default: the stdlib) in a fixed hash order.

    Raises ``FileNotFoundError`` with a clear message when there are none (e.g. a Python
    build that ships only ``.pyc`` files).
    """
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts) or not path.is_file():
            continue
        if path.stat().st_size > max_file_bytes or path.stat().st_size == 0:
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(
            f"no *.py source files found under {root}; this Python seems to ship without its "
            "standard-library sources. Point --corpus-dir at any directory of .py files."
        )
    return sorted(
        files, key=lambda p: (_hash01(p.relative_to(root).as_posix(), "order"), p.as_posix())
    )


def split_files(
    files: list[Path], root: Path, val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into (train, validation) by a hash of each relative path.

    The split is disjoint by file and keeps the input order. Validation gets at least one
    file and train keeps at least one.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(files) < 2:
        raise ValueError(
            f"need at least 2 source files to split train/validation, got {len(files)}"
        )
    train, val = [], []
    for path in files:
        (
            val if _hash01(path.relative_to(root).as_posix(), "split") < val_fraction else train
        ).append(path)
    if not val:
        val.append(train.pop())
    if not train:
        train.append(val.pop())
    return train, val


def _read(files: list[Path], budget: int) -> tuple[Tensor, list[Path]]:
    chunks, used, total = [], [], 0
    for path in files:
        if total >= budget:
            break
        data = (path.read_bytes() + b"\n")[: budget - total]  # the last file may be cut
        chunks.append(data)
        used.append(path)
        total += len(data)
    buf = bytearray(b"".join(chunks))
    return torch.frombuffer(buf, dtype=torch.uint8).clone() if buf else torch.empty(
        0, dtype=torch.uint8
    ), used


@dataclass
class Corpus:
    """Byte tokens of the train and validation splits and the files they came from."""

    train: Tensor
    val: Tensor
    train_files: list[Path]
    val_files: list[Path]
    root: Path

    def describe(self) -> str:
        """One line: sizes and where the text came from."""
        return (
            f"corpus: {len(self.train_files)} train files ({self.train.numel() / 1e6:.2f} MB), "
            f"{len(self.val_files)} validation files ({self.val.numel() / 1e6:.2f} MB) "
            f"from {self.root}"
        )


def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: Path | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Corpus:
    """Read the corpus: at most ``max_bytes`` in total, the validation split its share of it."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    files = list_source_files(root, max_file_bytes)
    train_files, val_files = split_files(files, root, val_fraction)
    val_budget = max(1, int(max_bytes * val_fraction))
    train, train_used = _read(train_files, max_bytes - val_budget)
    val, val_used = _read(val_files, val_budget)
    return Corpus(train, val, train_used, val_used, root)


class WindowSampler:
    """Random ``(x, y)`` windows of ``seq_len`` tokens from one token stream.

    ``batch(step)`` builds the global batch of ``global_batch`` windows from a generator seeded
    with ``(seed, step)`` (reproducible, independent of how many steps ran before), and returns
    this rank's rows. ``x`` is ``int64 [B/W, seq_len]``; ``y`` is ``x`` shifted by one token.
    """

    def __init__(
        self,
        tokens: Tensor,
        seq_len: int,
        global_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the token stream has {tokens.numel()} tokens, "
                f"fewer than seq_len + 1 = {seq_len + 1}; "
                "use a smaller --seq-len or a larger --corpus-mb"
            )
        if global_batch <= 0 or global_batch % world_size:
            raise ValueError(
                f"global batch {global_batch} must be > 0 and divisible by world size {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.local_batch = global_batch // world_size

    @property
    def num_starts(self) -> int:
        """Number of valid window start positions."""
        return self.tokens.numel() - self.seq_len

    def starts(self, step: int) -> Tensor:
        """Start offsets of the whole global batch of ``step`` (same on every rank)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.num_starts, (self.global_batch,), generator=gen)

    def batch(self, step: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """This rank's ``(x, y)`` for ``step``."""
        lo = self.rank * self.local_batch
        starts = self.starts(step)[lo : lo + self.local_batch]
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets].long()
        return windows[:, :-1].to(device), windows[:, 1:].to(device)
