"""How a parameter of any shape is the matrices Muon orthogonalises: its :class:`Layout`.

A 2-D weight is one matrix. A conv kernel ``(out, in, kh, kw)`` is one ``(out, in·kh·kw)``
matrix. A mixture-of-experts stack ``(E, m, n)`` is ``E`` matrices, each orthogonalised on its
own (flattening it into one ``(E, m·n)`` matrix mixes the experts: wrong math). A fused
gate/up weight (``(E, 2h, n)``, or a 2-D ``(2h, n)``) may be orthogonalised as its two halves,
stored one after the other (``split="chunk"``) or interleaved row by row
(``split="interleave"``).

Below the optimizer and the runtime: ``routing`` resolves each Muon parameter's layout,
``functional`` stacks and unstacks by it, ``dedicate_params`` plans owners by its matrices.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor, nn

KINDS = ("matrix", "conv", "experts")
SPLITS = (None, "chunk", "interleave")
_ATTR = "_dmuon_layout"

# What the error for an undeclared ≥3-D parameter shows (one place, so every message agrees).
DECLARE_HINT = (
    "Declare its layout: dmuon.set_layout(param, dmuon.Layout.experts()) for a stack of "
    "per-expert matrices (E, m, n), dmuon.Layout.conv() for a conv kernel, or return the "
    "Layout from your predicate (predicate=lambda name, p: dmuon.Layout.experts() if ... else "
    "...); or route it to AdamW (the predicate returns False)"
)


class Layout(NamedTuple):
    """The matrices a parameter is, for Newton–Schulz and the learning-rate rule.

    - ``kind``: ``"matrix"`` (2-D), ``"conv"`` (``(out, *rest)`` viewed as
      ``(out, prod(rest))``) or ``"experts"`` (``(E, m, n)``: ``E`` matrices ``(m, n)``).
    - ``split``: ``None``, or each matrix holds two fused halves (gate and up) along
      ``split_dim`` (0: rows, 1: columns), one after the other (``"chunk"``) or alternating
      (``"interleave"``); each half is orthogonalised as a matrix of its own.
    - ``transposed``: each matrix is stored ``(in, out)`` (``x @ W``); the ``"original"``
      learning-rate rule then reads its shape as ``(out, in)``. Newton–Schulz does not care.

    A NamedTuple of constants, so a compiled step takes it as a static input.

    >>> Layout.experts(split="chunk").matrix_shape((8, 64, 32))
    (32, 32)
    """

    kind: str = "matrix"
    split: str | None = None
    split_dim: int = 0
    transposed: bool = False

    @classmethod
    def matrix(cls, split: str | None = None, split_dim: int = 0, transposed: bool = False):
        return cls("matrix", split, split_dim, transposed).checked()

    @classmethod
    def conv(cls):
        return cls("conv")

    @classmethod
    def experts(cls, split: str | None = None, split_dim: int = 0, transposed: bool = False):
        return cls("experts", split, split_dim, transposed).checked()

    def checked(self) -> Layout:
        if self.kind not in KINDS:
            raise ValueError(f"Layout kind={self.kind!r}: choose one of {KINDS}")
        if self.split not in SPLITS:
            raise ValueError(f"Layout split={self.split!r}: choose one of {SPLITS}")
        if self.split_dim not in (0, 1):
            raise ValueError(f"Layout split_dim={self.split_dim!r}: 0 (rows) or 1 (columns)")
        if self.kind == "conv" and (self.split is not None or self.transposed):
            raise ValueError("Layout.conv() takes no split and no transposed")
        return self

    # ------------------------------------------------------------------ shapes
    def check_shape(self, shape, name: str = "the parameter") -> None:
        """Raise ``ValueError`` naming ``name`` when ``shape`` does not fit this layout."""
        want = {"matrix": "2", "experts": "3", "conv": "at least 3"}[self.kind]
        ok = {"matrix": len(shape) == 2, "experts": len(shape) == 3, "conv": len(shape) >= 3}
        if not ok[self.kind]:
            raise ValueError(
                f"{name} has shape {tuple(shape)} but its layout {self} needs {want} dims"
            )
        if self.split is not None and shape[len(shape) - 2 + self.split_dim] % 2:
            raise ValueError(
                f"{name} has shape {tuple(shape)}: split={self.split!r} along split_dim="
                f"{self.split_dim} needs an even size there"
            )

    def count(self, shape) -> int:
        """How many matrices a parameter of ``shape`` is."""
        stacked = shape[0] if self.kind == "experts" else 1
        return stacked * (2 if self.split is not None else 1)

    def stacked_shape(self, shape) -> tuple[int, int]:
        """The shape of each matrix as Newton–Schulz sees it (stored orientation)."""
        if self.kind == "conv":
            return int(shape[0]), math.prod(int(s) for s in shape[1:])
        m, n = int(shape[-2]), int(shape[-1])
        if self.split is not None:
            m, n = (m // 2, n) if self.split_dim == 0 else (m, n // 2)
        return m, n

    def matrix_shape(self, shape) -> tuple[int, int]:
        """Each matrix's ``(out, in)`` shape: what the learning-rate rule reads."""
        m, n = self.stacked_shape(shape)
        return (n, m) if self.transposed else (m, n)

    # ------------------------------------------------------------------ views
    def matrices(self, t: Tensor) -> Tensor:
        """``t`` as its matrices: 2-D ``(m, n)`` when it is one matrix, else ``(k, m, n)``."""
        if self.kind == "conv":
            return t.reshape(t.shape[0], -1)
        if self.kind == "matrix" and self.split is None:
            return t
        x = t.reshape(-1, t.shape[-2], t.shape[-1])  # (k0, m, n); k0 = 1 for a matrix
        if self.split is None:
            return x
        k0, m, n = x.shape
        if self.split_dim == 0:
            halves = (
                x.reshape(k0, 2, m // 2, n)
                if self.split == "chunk"
                else x.reshape(k0, m // 2, 2, n).transpose(1, 2)
            )
        else:
            halves = (
                x.reshape(k0, m, 2, n // 2).transpose(1, 2)
                if self.split == "chunk"
                else x.reshape(k0, m, n // 2, 2).permute(0, 3, 1, 2)
            )
        return halves.reshape(2 * k0, halves.shape[-2], halves.shape[-1])

    def unmatrices(self, x: Tensor, shape) -> Tensor:
        """The inverse of :meth:`matrices`: ``x`` back in the parameter's ``shape``."""
        if self.split is None:
            return x.reshape(shape)
        k2, a, b = x.reshape(-1, x.shape[-2], x.shape[-1]).shape
        pairs = x.reshape(k2 // 2, 2, a, b)
        if self.split_dim == 0:
            if self.split == "interleave":
                pairs = pairs.transpose(1, 2)  # (k0, a, 2, b)
        else:
            pairs = pairs.transpose(1, 2) if self.split == "chunk" else pairs.permute(0, 2, 3, 1)
        return pairs.reshape(shape)


def whole_expert_shards(param: Tensor, layout: Layout) -> bool:
    """Whether ``param`` is a DTensor expert stack each of whose local shards holds whole
    experts: sharded only along the expert dim (FSDP2's default ``Shard(0)``, expert
    parallelism's ``Shard(0)`` over an ``ep`` mesh, or both), replicated otherwise. Then each
    rank orthogonalises its own experts exactly: a local shard is a stack of whole matrices.
    (A ``Shard(1)`` split, as torchtitan's expert FSDP uses when ``efsdp · ep > E``, is not.)"""
    if layout.kind != "experts":  # first: the step asks this of every Muon matrix
        return False
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor):
        return False
    return all(isinstance(pl, Replicate) or _shards_dim0(pl) for pl in param.placements)


def _shards_dim0(placement) -> bool:
    """``Shard(0)``, or FSDP2's ``_StridedShard(0)`` over a ``Shard(0)`` (expert parallelism):
    either way a local index of dim 0 is one whole expert. (``_StridedShard`` is not a
    ``Shard`` subclass on torch 2.13, and its ``is_shard()`` is False there.)"""
    from torch.distributed.tensor import Shard

    strided = type(placement).__name__ == "_StridedShard"
    return (isinstance(placement, Shard) or strided) and getattr(placement, "dim", None) == 0


def set_layout(param: Tensor, layout: Layout) -> Tensor:
    """Declare ``param``'s layout (kept on the parameter; ``Muon`` and ``dedicate_params``
    read it before any rule of their own). Returns ``param``.

    Example::

        dmuon.set_layout(model.moe.experts.w13, dmuon.Layout.experts(split="chunk"))
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"set_layout takes a dmuon.Layout, got {type(layout).__name__}")
    layout.checked().check_shape(param.shape)
    param.__dict__[_ATTR] = layout
    return param


def get_layout(param: Tensor) -> Layout | None:
    """The layout declared on ``param`` (``set_layout``), or ``None``."""
    return param.__dict__.get(_ATTR)


def is_expert_module(module: nn.Module | None) -> bool:
    """torchtitan's ``GroupedExperts`` and transformers' fused experts (``*Experts`` classes,
    which transformers marks with ``is_transposed``/``is_concatenated``)."""
    if module is None:
        return False
    name = type(module).__name__
    return name.endswith("Experts") or hasattr(module, "is_concatenated")


def infer_layout(name: str, param: Tensor, module: nn.Module | None) -> Layout | None:
    """The layout the module tells, or ``None`` when a ≥3-D parameter's layout is unknown.

    - 2-D: one matrix;
    - conv modules (``nn.Conv1d/2d/3d``, transposed convs): ``Layout.conv()``;
    - 3-D parameters of an expert module (torchtitan ``GroupedExperts``; transformers 5.x
      ``*Experts``: a fused ``gate_up_proj`` is split into its halves, concatenated or
      interleaved as the module says, along its output dim; ``is_transposed`` stacks are
      stored ``(in, out)``): ``Layout.experts(...)``.
    """
    if param.ndim == 2:
        return Layout.matrix()
    if isinstance(module, nn.modules.conv._ConvNd) and param.ndim >= 3:
        return Layout.conv()
    if param.ndim == 3 and is_expert_module(module):
        transposed = bool(getattr(module, "is_transposed", False))
        split = None
        if name.rsplit(".", 1)[-1] == "gate_up_proj" and getattr(module, "has_gate", True):
            split = "chunk" if getattr(module, "is_concatenated", True) else "interleave"
        # The halves lie along the output dim: rows of (out, in), columns of (in, out).
        return Layout.experts(split=split, split_dim=1 if transposed else 0, transposed=transposed)
    return None


def resolve_layout(
    name: str, param: Tensor, module: nn.Module | None = None, chosen: object = None
) -> Layout:
    """The layout of a parameter selected for Muon: declared (``set_layout``), returned by
    the predicate (``chosen``), told by its module, or an error naming it and the fix."""
    layout = get_layout(param)
    if layout is None and isinstance(chosen, Layout):
        layout = chosen
    if layout is None:
        layout = infer_layout(name, param, module)
    if layout is None:
        raise ValueError(
            f"Muon: {name!r} has shape {tuple(param.shape)}; a parameter of more than two dims "
            "is not orthogonalised as one flattened matrix (that mixes, e.g., experts), and "
            f"its module ({type(module).__name__ if module is not None else 'unknown'}) does "
            f"not say what its matrices are. {DECLARE_HINT}."
        )
    layout.checked().check_shape(param.shape, repr(name))
    return layout
