"""How a parameter of any shape is the matrices Muon orthogonalises: its :class:`Layout`.

A 2-D weight is one matrix. A conv kernel ``(out, in, kh, kw)`` is one ``(out, in·kh·kw)``
matrix. A mixture-of-experts stack ``(E, m, n)`` is ``E`` matrices, each orthogonalised on its
own (flattening it into one ``(E, m·n)`` matrix mixes the experts: wrong math). A fused
gate/up weight (``(E, 2h, n)``, or a 2-D ``(2h, n)``) may be orthogonalised as its two halves,
stored one after the other (``split="chunk"``) or interleaved row by row
(``split="interleave"``). A blocked layout cuts each matrix into consecutive blocks along a
dim: attention heads of ``head_dim`` rows or columns (per-head Newton–Schulz,
:meth:`Layout.heads`), or the parts of a fused weight with their sizes, each part whole or per
head (:meth:`Layout.fused`, :meth:`Layout.qkv`); every block is a matrix of its own, with the
learning-rate scale of its own shape. docs/recipes.md has the presets.

Below the optimizer and the runtime: ``routing`` resolves each Muon parameter's layout,
``functional`` stacks and unstacks by it, ``dedicate_params`` plans owners by its matrices.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
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
    - ``parts`` / ``head_dims`` (blocked layouts; ``split`` stays ``None``): each matrix is
      consecutive blocks along ``split_dim``. ``parts``: the sizes of the fused parts, in
      order (``()``: the whole dim is one part); ``head_dims``: per part, the size of the heads
      it is cut into (``0``: the part is one block; ``()``: no part is cut; with ``parts=()``,
      one entry for the whole dim). Each block is orthogonalised as a matrix of its own and
      gets the learning-rate scale of its own shape. Build them with :meth:`heads`,
      :meth:`fused` or :meth:`qkv`.

    A NamedTuple of constants, so a compiled step takes it as a static input.

    >>> Layout.experts(split="chunk").matrix_shape((8, 64, 32))
    (32, 32)
    >>> Layout.heads(64).matrix_shape((512, 256)), Layout.heads(64).count((512, 256))
    ((64, 256), 8)
    """

    kind: str = "matrix"
    split: str | None = None
    split_dim: int = 0
    transposed: bool = False
    parts: tuple[int, ...] = ()
    head_dims: tuple[int, ...] = ()

    @classmethod
    def matrix(cls, split: str | None = None, split_dim: int = 0, transposed: bool = False):
        return cls("matrix", split, split_dim, transposed).checked()

    @classmethod
    def conv(cls):
        return cls("conv")

    @classmethod
    def experts(cls, split: str | None = None, split_dim: int = 0, transposed: bool = False):
        return cls("experts", split, split_dim, transposed).checked()

    # ------------------------------------------------------------------ blocked presets
    @classmethod
    def heads(
        cls, head_dim: int, dim: int = 0, *, experts: bool = False, transposed: bool = False
    ) -> Layout:
        """Per-head Newton–Schulz: each matrix is heads of ``head_dim`` rows (``dim=0``) or
        columns (``dim=1``), in stored orientation, each head a matrix of its own.

        For ``nn.Linear`` weights (``(out, in)``): q, k and v projections ``(heads·head_dim,
        dim)`` take ``dim=0``; the output projection ``(dim, heads·head_dim)`` takes ``dim=1``.
        ``experts=True``: an expert stack ``(E, m, n)``, per expert and per head.
        """
        return cls._blocked((), _head_sizes(head_dim, 1), dim, experts, transposed)

    @classmethod
    def fused(
        cls,
        sizes,
        dim: int = 0,
        *,
        heads: int | tuple | None = None,
        experts: bool = False,
        transposed: bool = False,
    ) -> Layout:
        """A fused weight: parts of ``sizes`` rows (``dim=0``) or columns (``dim=1``), one
        after the other, each orthogonalised on its own (parts of different sizes are matrices
        of different shapes, each with its own learning-rate scale).

        ``heads``: ``None`` (each part one matrix), an ``int`` (every part cut into heads of
        that size), or one entry per part (``0`` or ``None``: that part whole).

        >>> Layout.fused((512, 128, 128)).count((768, 256))
        3
        """
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else sizes
        if not isinstance(sizes, tuple) or not sizes:
            raise ValueError(
                f"Layout.fused(sizes={sizes!r}): give the parts' sizes, e.g. (q, k, v)"
            )
        return cls._blocked(sizes, _head_sizes(heads, len(sizes)), dim, experts, transposed)

    @classmethod
    def qkv(
        cls,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        per_head: bool = True,
        experts: bool = False,
        transposed: bool = False,
    ) -> Layout:
        """A fused ``wqkv`` stored ``[q; k; v]`` along its output dim (rows of ``(out, in)``;
        columns with ``transposed=True``): q of ``n_heads·head_dim``, k and v of
        ``n_kv_heads·head_dim``. ``per_head=True``: every head its own matrix; ``False``: q, k
        and v each one matrix."""
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        heads = head_dim if per_head else None
        dim = 1 if transposed else 0
        return cls.fused((q, kv, kv), dim, heads=heads, experts=experts, transposed=transposed)

    @classmethod
    def gate_up(
        cls, interleaved: bool = False, *, experts: bool = False, transposed: bool = False
    ) -> Layout:
        """A fused gate/up (``w13``) weight: its two halves along the output dim (rows of
        ``(out, in)``; columns with ``transposed=True``), one after the other or interleaved
        row by row, each half a matrix of its own (``split="chunk"`` / ``"interleave"``)."""
        kind = "experts" if experts else "matrix"
        split = "interleave" if interleaved else "chunk"
        return cls(kind, split, 1 if transposed else 0, transposed).checked()

    @classmethod
    def _blocked(cls, parts, head_dims, dim, experts, transposed) -> Layout:
        kind = "experts" if experts else "matrix"
        return cls(kind, None, dim, bool(transposed), parts, head_dims).checked()

    @property
    def blocked(self) -> bool:
        """Whether each matrix is cut into blocks (``parts`` or ``head_dims``)."""
        return bool(self.parts) or bool(self.head_dims)

    def checked(self) -> Layout:
        if self.kind not in KINDS:
            raise ValueError(f"Layout kind={self.kind!r}: choose one of {KINDS}")
        if self.split not in SPLITS:
            raise ValueError(f"Layout split={self.split!r}: choose one of {SPLITS}")
        if self.split_dim not in (0, 1):
            raise ValueError(f"Layout split_dim={self.split_dim!r}: 0 (rows) or 1 (columns)")
        if self.kind == "conv" and (self.split is not None or self.transposed or self.blocked):
            raise ValueError("Layout.conv() takes no split, no blocks and no transposed")
        if self.blocked:
            self._check_blocks()
        return self

    def _check_blocks(self) -> None:
        for field, values in (("parts", self.parts), ("head_dims", self.head_dims)):
            if not isinstance(values, tuple) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values
            ):
                raise ValueError(f"Layout {field}={values!r}: a tuple of ints")
        if self.split is not None:
            raise ValueError(
                f"Layout split={self.split!r} does not combine with parts/head_dims: give a "
                "fused gate/up as Layout.gate_up() (its halves) or Layout.fused((h, h)), not both"
            )
        if any(p <= 0 for p in self.parts):
            raise ValueError(f"Layout parts={self.parts}: each part's size must be positive")
        if any(h < 0 for h in self.head_dims) or (self.head_dims and not any(self.head_dims)):
            raise ValueError(
                f"Layout head_dims={self.head_dims}: head sizes must be positive (0 leaves a "
                "part whole; give at least one head size, or no head_dims)"
            )
        if self.parts and self.head_dims and len(self.head_dims) != len(self.parts):
            raise ValueError(
                f"Layout head_dims={self.head_dims} for parts={self.parts}: give one head size "
                "per part (0: that part whole)"
            )
        if not self.parts and len(self.head_dims) > 1:
            raise ValueError(
                f"Layout head_dims={self.head_dims} without parts: give one head size, or the "
                "parts' sizes (Layout.fused(sizes, heads=...))"
            )
        for size, head in zip(self.parts, self.head_dims):
            if head and size % head:
                raise ValueError(
                    f"Layout: head_dim {head} does not divide the part of size {size} "
                    f"(parts={self.parts}): give each part a size that is a multiple of its "
                    "head_dim, or 0 to keep the part whole"
                )

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
        if self.blocked:
            size = int(shape[self.block_dim(shape)])
            along = f"dim {self.block_dim(shape)} ({'rows' if self.split_dim == 0 else 'columns'})"
            if self.parts and sum(self.parts) != size:
                raise ValueError(
                    f"{name} has shape {tuple(shape)} but its layout's parts {self.parts} sum "
                    f"to {sum(self.parts)}, not to the {size} of {along}: give part sizes that "
                    f"sum to {size}, or the other dim (Layout.fused(sizes, dim=...))"
                )
            if not self.parts and size % self.head_dims[0]:
                raise ValueError(
                    f"{name} has shape {tuple(shape)}: head_dim {self.head_dims[0]} does not "
                    f"divide the {size} of {along}: give the head size that divides it, or "
                    "the dim the heads lie along (Layout.heads(head_dim, dim=...))"
                )

    def block_dim(self, shape) -> int:
        """The dim of a parameter of ``shape`` that ``split`` / the blocks cut."""
        return len(shape) - 2 + self.split_dim

    def _part_blocks(self, size: int) -> list[tuple[int, int]]:
        """Per part, ``(its size, its blocks' size)`` along a block dim of ``size``."""
        parts = self.parts or (size,)
        heads = self.head_dims or (0,) * len(parts)
        return [(p, h or p) for p, h in zip(parts, heads)]

    def block_sizes(self, shape) -> list[int]:
        """The size along :meth:`block_dim` of each block of one matrix, in order (one entry,
        the whole dim, for a layout without blocks)."""
        size = int(shape[self.block_dim(shape)])
        if not self.blocked:
            return [size // 2] * 2 if self.split is not None else [size]
        return [b for p, b in self._part_blocks(size) for _ in range(p // b)]

    def pieces(self, shape) -> list[tuple[int, int, Layout]]:
        """``shape``'s :meth:`block_dim` as consecutive ranges ``(start, stop)``, each with a
        layout all of whose matrices share one shape: ``[(0, size, self)]`` when this layout's
        do (every layout but a blocked one whose blocks differ in size), else one range per
        part (a part whole: a plain layout; a part per head: ``head_dims=(h,)``)."""
        size = int(shape[self.block_dim(shape)]) if self.kind != "conv" else 0
        if not self.blocked or len(set(self.block_sizes(shape))) == 1:
            return [(0, size, self)]
        out, start = [], 0
        for part, block in self._part_blocks(size):
            heads = (block,) if block != part else ()
            sub = Layout(self.kind, None, self.split_dim, self.transposed, (), heads)
            out.append((start, start + part, sub))
            start += part
        return out

    def count(self, shape) -> int:
        """How many matrices a parameter of ``shape`` is."""
        stacked = shape[0] if self.kind == "experts" else 1
        if self.blocked:
            return stacked * len(self.block_sizes(shape))
        return stacked * (2 if self.split is not None else 1)

    def stacked_shape(self, shape) -> tuple[int, int]:
        """The shape of each matrix as Newton–Schulz sees it (stored orientation). A blocked
        layout whose blocks differ in shape has no one shape: ``ValueError`` (see
        :meth:`pieces`)."""
        if self.kind == "conv":
            return int(shape[0]), math.prod(int(s) for s in shape[1:])
        m, n = int(shape[-2]), int(shape[-1])
        if self.split is not None:
            m, n = (m // 2, n) if self.split_dim == 0 else (m, n // 2)
        if self.blocked:
            sizes = sorted(set(self.block_sizes(shape)))
            if len(sizes) != 1:
                raise ValueError(
                    f"the layout {self} of shape {tuple(shape)} has blocks of {len(sizes)} "
                    f"sizes {sizes}: no one matrix shape. The single-process step takes it "
                    "part by part (Layout.pieces); the planners of dedicate_params and the "
                    "dry run need one shape per weight: give parts of one size, or cut every "
                    "part into heads of one size (heads=...)"
                )
            m, n = (sizes[0], n) if self.split_dim == 0 else (m, sizes[0])
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
        if self.kind == "matrix" and self.split is None and not self.blocked:
            return t
        x = t.reshape(-1, t.shape[-2], t.shape[-1])  # (k0, m, n); k0 = 1 for a matrix
        if self.blocked:
            return self._blocks(x)
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

    def _blocks(self, x: Tensor) -> Tensor:
        """``(k0, m, n)`` as its blocks, all of one size ``b``: ``(k0·m/b, b, n)`` along the
        rows, ``(k0·n/b, m, b)`` along the columns (consecutive blocks, in order)."""
        k0, m, n = x.shape
        b = self.stacked_shape(x.shape)[self.split_dim]
        if self.split_dim == 0:
            return x.reshape(k0 * (m // b), b, n)
        return x.reshape(k0, m, n // b, b).permute(0, 2, 1, 3).reshape(k0 * (n // b), m, b)

    def unmatrices(self, x: Tensor, shape) -> Tensor:
        """The inverse of :meth:`matrices`: ``x`` back in the parameter's ``shape``."""
        if self.blocked and self.split_dim == 1:
            m, n = int(shape[-2]), int(shape[-1])
            b = x.shape[-1]
            blocks = x.reshape(-1, n // b, m, b).permute(0, 2, 1, 3)
            return blocks.reshape(shape)
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


# A parameter carries its layout as an attribute, which ``torch.save(param)`` pickles with it:
# ``torch.load(weights_only=True)`` (torch's default) then needs the class allowed.
torch.serialization.add_safe_globals([Layout])


def _head_sizes(heads, n_parts: int) -> tuple[int, ...]:
    """``head_dims`` from a presets' ``heads``: ``None`` (no heads), an int (every part), or
    one entry per part (``0``/``None``: that part whole)."""
    if heads is None:
        return ()
    if isinstance(heads, int) and not isinstance(heads, bool):
        if heads <= 0:
            raise ValueError(f"head_dim={heads}: a head's size must be positive")
        return (heads,) * n_parts
    heads = tuple(0 if h is None else h for h in heads)
    if len(heads) != n_parts:
        raise ValueError(
            f"heads={heads} for {n_parts} parts: give one head size per part (0 or None: that "
            "part whole), or one int for all"
        )
    return heads if any(heads) else ()


def block_shard_layouts(layout: Layout, shape, dim: int, size: int) -> list[Layout] | None:
    """Per shard, the layout of its blocks when a 2-D matrix of ``shape`` cut into ``size``
    equal shards along ``dim`` (tensor parallelism's ``Shard(dim)``) leaves every block of the
    blocked ``layout`` whole in one shard; else ``None``. A function of the configuration only,
    so every rank decides the same. Each shard's layout cuts it into the blocks it holds, in
    order: heads of one size, or the blocks as parts when their sizes differ.

    >>> block_shard_layouts(Layout.heads(8), (64, 32), 0, 2)[1].head_dims
    (8,)
    >>> block_shard_layouts(Layout.heads(8), (48, 32), 0, 4) is None  # 6 heads over 4 shards
    True
    """
    if not layout.blocked or layout.kind != "matrix" or len(shape) != 2 or size < 1:
        return None
    length = int(shape[dim])
    if dim != layout.block_dim(shape) or length % size:
        return None
    chunk = length // size
    per_shard: list[list[int]] = [[] for _ in range(size)]
    start = 0
    for block in layout.block_sizes(shape):
        shard = start // chunk
        if (start + block - 1) // chunk != shard:  # the block straddles a shard boundary
            return None
        per_shard[shard].append(block)
        start += block
    out = []
    for blocks in per_shard:
        if len(set(blocks)) == 1:
            parts, heads = (), (blocks[0],)
        else:
            parts, heads = tuple(blocks), ()
        out.append(Layout("matrix", None, layout.split_dim, layout.transposed, parts, heads))
    return out


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


def needs_reshard(param: Tensor, layout: Layout) -> bool:
    """Whether ``param`` is a DTensor expert stack some of whose mesh dims shard inside the
    experts (its Newton–Schulz needs the experts gathered whole first:
    ``distributed/_stages/expert_shards.py``)."""
    if layout.kind != "experts":
        return False
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return (
        isinstance(param, DTensor)
        and not whole_expert_shards(param, layout)
        and all(
            isinstance(pl, (Shard, Replicate)) or type(pl).__name__ == "_StridedShard"
            for pl in param.placements
        )
    )


def replicated_stack(param: Tensor, layout: Layout) -> bool:
    """Whether ``param`` is a DTensor expert stack replicated over some mesh dim of more than
    one rank (HSDP's replicate dim): its replicas can split the stack's Newton–Schulz
    (``Muon(expert_ns="once")``, ``distributed/_stages/expert_shards.py``)."""
    if layout.kind != "experts":
        return False
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(param, DTensor) and any(
        isinstance(pl, Replicate) and param.device_mesh.size(i) > 1
        for i, pl in enumerate(param.placements)
    )


def _shards_dim0(placement) -> bool:
    """``Shard(0)``, or FSDP2's ``_StridedShard(0)`` over a ``Shard(0)`` (expert parallelism):
    either way a local index of dim 0 is one whole expert. (``_StridedShard`` is not a
    ``Shard`` subclass on torch 2.13, and its ``is_shard()`` is False there.)"""
    from torch.distributed.tensor import Shard

    strided = type(placement).__name__ == "_StridedShard"
    return (isinstance(placement, Shard) or strided) and getattr(placement, "dim", None) == 0


def check_blocked_placement(param: Tensor, layout: Layout, name: str = "the parameter") -> None:
    """Refuse a blocked layout on a DTensor whose local shards are not whole matrices: the
    tensor-parallel step and the in-expert reshard orthogonalise one matrix per tensor (they
    would silently ignore the blocks). Supported: one process, dedicated weights (each on its
    owner: a one-rank mesh; TP-sharded ones, gathered whole to their TP owner: a class that
    says ``orthogonalised_whole``), replicated DTensors, and expert stacks sharded along the
    expert dim only (:func:`whole_expert_shards`)."""
    import torch.distributed as dist

    if not layout.blocked or not dist.is_available():
        return
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor) or param.device_mesh.size() == 1:
        return
    if getattr(type(param), "orthogonalised_whole", False):
        return
    if all(isinstance(pl, Replicate) for pl in param.placements):
        return
    if whole_expert_shards(param, layout):
        return
    raise NotImplementedError(
        f"{name} is a DTensor sharded {tuple(param.placements)} on {param.device_mesh} with "
        f"the blocked layout {layout}: blocked layouts (per-head / fused-part Newton–Schulz) "
        "run where Newton–Schulz sees whole matrices: one process, dedicated weights (with "
        "tensor parallelism too: dmuon.dedicate_params gathers them to their TP owner), and "
        "expert stacks sharded along the expert dim only. Other shards (FSDP2's, in-expert) "
        "are not supported: declare Layout.matrix() / Layout.experts() for this weight, or "
        "dedicate it"
    )


def set_layout(param: Tensor, layout: Layout) -> Tensor:
    """Declare ``param``'s layout (kept on the parameter; ``Muon`` and ``dedicate_params``
    read it before any rule of their own). Returns ``param``.

    Example::

        dmuon.set_layout(model.moe.experts.w13, dmuon.Layout.experts(split="chunk"))
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"set_layout takes a dmuon.Layout, got {type(layout).__name__}")
    layout.checked().check_shape(param.shape)
    check_blocked_placement(param, layout)
    param.__dict__[_ATTR] = layout
    return param


# The attention modules ``head_layouts`` recognises: their q/k/v/o projections by name
# (transformers' and torchtitan's), and where their head counts live.
_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"))
HEAD_COUNT_ATTRS = ("num_heads", "n_heads", "heads", "num_attention_heads")
_N_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def config_count(module: nn.Module, names) -> int | None:
    """The first positive int among ``names`` on ``module`` or its ``config`` (a head count, a
    head dim), else ``None``. Shared with QK-clip, which finds the same attention modules."""
    config = getattr(module, "config", None)
    for owner in (module, config):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _weight(module: nn.Module | None, name: str) -> Tensor | None:
    sub = getattr(module, name, None) if module is not None else None
    weight = getattr(sub, "weight", None)
    return weight if isinstance(weight, Tensor) and weight.dim() == 2 else None


# Multi-head latent attention (DeepSeek-V2/V3): the up-projections to the heads, by name
# (transformers', torchtitan's): q (``q_proj``/``q_b_proj``, ``wq``/``wq_b``), kv and o.
MLA_Q_PROJECTIONS = ("q_b_proj", "q_proj", "wq_b", "wq")
MLA_KV_PROJECTIONS = ("kv_b_proj", "wkv_b")
_MLA_O = ("o_proj", "wo")


def _mla_layouts(module: nn.Module, base: str) -> dict[str, Layout]:
    """Per-head layouts of a multi-head latent attention module: each head's q rows (its nope
    and rope parts together), each head's k and v parts of the kv up-projection, each head's
    columns of o. The low-rank down-projections stay whole. Empty for any other module."""
    nope = config_count(module, ("qk_nope_head_dim",))
    rope = config_count(module, ("qk_rope_head_dim",))
    v_dim = config_count(module, ("v_head_dim",))
    n_heads = config_count(module, HEAD_COUNT_ATTRS)
    kv = next((n for n in MLA_KV_PROJECTIONS if _weight(module, n) is not None), None)
    if None in (nope, rope, v_dim, n_heads) or kv is None:
        return {}
    found = {
        # k_nope and v of one head follow each other: equal sizes are heads of that size
        f"{base}{kv}.weight": Layout.heads(nope)
        if nope == v_dim
        else Layout.fused((nope, v_dim) * n_heads)
    }
    q = next((n for n in MLA_Q_PROJECTIONS if _weight(module, n) is not None), None)
    if q is not None:
        found[f"{base}{q}.weight"] = Layout.heads(nope + rope)
    o = next((n for n in _MLA_O if _weight(module, n) is not None), None)
    if o is not None:
        found[f"{base}{o}.weight"] = Layout.heads(v_dim, dim=1)
    return found


def head_layouts(model: nn.Module) -> dict[str, Layout]:
    """Per-head layouts of the attention projections of ``model``, by parameter name: q, k and
    v (``Layout.heads(head_dim)``: one matrix per head's rows), o (``Layout.heads(head_dim,
    dim=1)``: per head's columns) and a fused ``wqkv`` (``Layout.qkv``). Recognised: modules
    holding ``q_proj/k_proj/v_proj/o_proj`` (transformers) or ``wq/wk/wv/wo`` (torchtitan, also
    under its ``qkv_linear``; ``qkv_linear.wqkv`` fused) whose ``head_dim`` is an attribute or
    follows from a head count (``num_heads``, ``n_heads``, ``heads`` or the module's
    ``config.num_attention_heads``). Multi-head latent attention (DeepSeek-V2/V3: a module with
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim``): q per head, the kv
    up-projection per head and part (k, v), o per head; its low-rank down-projections stay
    whole. Nothing is set: :func:`set_head_layouts` sets them.

    >>> from torch import nn
    >>> attn = nn.Module(); attn.head_dim = 4
    >>> for n in ("q_proj", "k_proj", "v_proj"): setattr(attn, n, nn.Linear(8, 8))
    >>> attn.o_proj = nn.Linear(8, 8)
    >>> sorted(head_layouts(attn))
    ['k_proj.weight', 'o_proj.weight', 'q_proj.weight', 'v_proj.weight']
    """
    found: dict[str, Layout] = {}
    for prefix, module in model.named_modules():
        mla = _mla_layouts(module, f"{prefix}." if prefix else "")
        if mla:
            found.update(mla)
            continue
        holder = getattr(module, "qkv_linear", None)
        holders = [(module, ""), (holder, "qkv_linear.")] if holder is not None else [(module, "")]
        for q, k, v, o in _PROJECTIONS:
            out = _weight(module, o)
            for where, sub in holders:
                ws = [_weight(where, n) for n in (q, k, v)]
                fused = _weight(where, "wqkv")
                if out is None or (None in ws and fused is None):
                    continue
                n_heads = config_count(module, HEAD_COUNT_ATTRS)
                head_dim = getattr(module, "head_dim", None)
                if not isinstance(head_dim, int) or head_dim <= 0:
                    if n_heads is None:
                        continue
                    rows = ws[0].shape[0] if ws[0] is not None else out.shape[1]
                    head_dim = rows // n_heads
                base = f"{prefix}." if prefix else ""
                if None not in ws:
                    for name in (q, k, v):
                        found[f"{base}{sub}{name}.weight"] = Layout.heads(head_dim)
                else:
                    n_kv = config_count(module, _N_KV_HEADS) or n_heads
                    if n_heads is None:
                        continue
                    found[f"{base}{sub}wqkv.weight"] = Layout.qkv(n_heads, n_kv, head_dim)
                found[f"{base}{o}.weight"] = Layout.heads(head_dim, dim=1)
    return found


def set_head_layouts(model: nn.Module) -> dict[str, Layout]:
    """Per-head Newton–Schulz for every attention module of ``model`` that
    :func:`head_layouts` recognises: sets each projection's layout (``set_layout``, checked
    against its shape) and returns them by name. Call it before ``dedicate_params`` and
    ``Muon``, which read the layouts. Raises ``ValueError`` when it recognises no attention
    module, naming what to do instead.

    Example::

        dmuon.set_head_layouts(model)       # q, k, v, o per head
        opt = dmuon.Muon(model, lr=0.02)
    """
    layouts = head_layouts(model)
    if not layouts:
        raise ValueError(
            "set_head_layouts: no attention module recognised (q_proj/k_proj/v_proj/o_proj or "
            "wq/wk/wv/wo, with a head_dim or a head count on the module): declare each "
            "projection's layout yourself, dmuon.set_layout(p, dmuon.Layout.heads(head_dim)) "
            "for q/k/v and Layout.heads(head_dim, dim=1) for o"
        )
    params = dict(model.named_parameters())
    for name, layout in layouts.items():
        set_layout(params[name], layout)
    return layouts


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
    name: str,
    param: Tensor,
    module: nn.Module | None = None,
    chosen: object = None,
    dedicating: bool = False,
) -> Layout:
    """The layout of a parameter selected for Muon: declared (``set_layout``), returned by
    the predicate (``chosen``), told by its module, or an error naming it and the fix.
    ``dedicating``: ``dedicate_params`` is about to dedicate it (a TP shard is then gathered
    whole to its TP owner, or holds whole blocks: any blocked layout runs)."""
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
    if not dedicating:
        check_blocked_placement(param, layout, repr(name))
    return layout
