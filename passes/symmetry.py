"""Symmetry provenance: which FX nodes provably hold symmetric matrices, and of which Gram root.

A rewrite into ``dmuon::sym_mm`` is only correct when the product ``A·B`` is symmetric, which
holds when ``A`` and ``B`` are symmetric *and commute*. Commuting is not a local property, so
the analysis tracks *provenance*: every symmetric value is recorded as a polynomial of one
**root**, a symmetric matrix the graph computed (a Gram matrix ``X·Xᵀ``, or any other value
that is symmetric but not known to be a polynomial of something older). Two polynomials of the
same root commute, so their product is symmetric and again a polynomial of that root.

Rules (``transfer``), over batched and unbatched graphs alike:

- ``mm/bmm(X, Xᵀ)`` and ``dmuon::syrk`` start a new root (themselves);
- the identity matrix (``eye``, or Inductor's ``iota == iota`` lowering of it) is a polynomial
  of every root (``IDENTITY``);
- ``mm/bmm/addmm/baddbmm`` and ``dmuon::sym_mm`` of polynomials of one root, sums and
  differences of same-shape polynomials of one root, scalar multiples (Python numbers, 0-d or
  per-matrix ``(b, 1, 1)`` tensors), negation, dtype conversion and copies keep the root;
- symmetric values that are not polynomials (a Hadamard product of two symmetric matrices,
  ``S + s`` with a broadcast scalar, ``dmuon::sym_mm`` of unrelated operands — its contract
  promises a symmetric result) start a new root of their own;
- anything else — graph inputs included — is *unknown*: no rewrite assumes it is symmetric.

Each known value also carries its polynomial in the root as a ``sympy.Poly`` (exact rational
coefficients), so a rewrite can *prove* that the replacement computes the same polynomial
(:mod:`dmuon_compile.passes.polynomial`).

Example::

    analysis = SymmetryAnalysis()
    for node in graph.nodes:
        analysis.visit(node)
    analysis.root_of(node)          # the root node, IDENTITY, or None (unknown)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from dmuon_compile.passes import polynomial as P
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims

IDENTITY = "identity"  # sentinel root: a scalar multiple of I commutes with every matrix

MATMULS = {aten.mm.default, aten.bmm.default}
ADDMMS = {aten.addmm.default, aten.baddbmm.default}
_SAME_VALUE = {  # ops whose output equals their (first) input as a matrix
    aten.clone.default,
    aten.alias.default,
    prims.convert_element_type.default,
    aten._to_copy.default,
}
_SCALE = {aten.mul.Tensor, aten.div.Tensor}
_ADD = {aten.add.Tensor, aten.sub.Tensor}


@dataclass(frozen=True)
class Provenance:
    """A symmetric value: a polynomial ``poly`` of the symmetric matrix ``root``.

    ``root`` is an FX node, or :data:`IDENTITY` for a scalar multiple of the identity.
    ``poly`` is a univariate ``sympy.Poly`` in the root's symbol, or ``None`` when the degree
    grew past :data:`polynomial.MAX_DEGREE` (the provenance still holds; only the proof is off).
    """

    root: object
    poly: object
    why: str


def val(node) -> torch.Tensor | None:
    """The fake tensor FX recorded for ``node`` (``None`` for non-nodes or missing meta)."""
    if isinstance(node, Node):
        v = node.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


def strip_noop_views(node):
    """Look through ``expand``/``view``/``reshape`` that keep the shape (bmm inserts them)."""
    while (
        isinstance(node, Node)
        and node.op == "call_function"
        and node.target
        in (
            aten.expand.default,
            aten.view.default,
            aten.reshape.default,
            aten._unsafe_view.default,
        )
    ):
        src, out = val(node.args[0]), val(node)
        if src is None or out is None or tuple(src.shape) != tuple(out.shape):
            break
        node = node.args[0]
    return node


def transposed_source(node) -> Node | None:
    """If ``node`` is ``Xᵀ`` (last two dims swapped, batch dims kept), return ``X``."""
    node = strip_noop_views(node)
    if not (isinstance(node, Node) and node.op == "call_function"):
        return None
    src = node.args[0] if node.args else None
    if node.target == aten.permute.default:
        dims = list(node.args[1])
        rank = len(dims)
        expected = list(range(rank - 2)) + [rank - 1, rank - 2]
        if rank >= 2 and [d % rank for d in dims] == expected:
            return strip_noop_views(src)
    elif node.target == aten.t.default:
        return strip_noop_views(src)
    elif node.target == aten.transpose.int:
        v = val(node)
        if v is not None:
            rank = v.dim()
            pair = sorted(d % rank for d in node.args[1:3])
            if pair == [rank - 2, rank - 1]:
                return strip_noop_views(src)
    return None


def is_gram_product(node: Node) -> Node | None:
    """``mm/bmm(X, Xᵀ)`` (or ``addmm``'s operands) → ``X``; else ``None``."""
    if node.target in MATMULS:
        lhs, rhs = node.args[0], node.args[1]
    elif node.target in ADDMMS:
        lhs, rhs = node.args[1], node.args[2]
    else:
        return None
    x = strip_noop_views(lhs)
    if isinstance(x, Node) and transposed_source(rhs) is x:
        return x
    return None


def _is_identity(node) -> bool:
    """``eye(n)`` or Inductor's ``convert(eq(unsqueeze(iota(n), -1), iota(n)))`` lowering."""
    if not (isinstance(node, Node) and node.op == "call_function"):
        return False
    if node.target == aten.eye.default:
        return True
    if node.target in (prims.convert_element_type.default, aten._to_copy.default):
        return _is_identity(node.args[0])
    if node.target != aten.eq.Tensor:
        return False
    a, b = node.args[0], node.args[1]

    def iota_len(n):
        if isinstance(n, Node) and n.target == prims.iota.default:
            kw = n.kwargs
            if kw.get("start", 0) == 0 and kw.get("step", 1) == 1:
                return n.args[0]
        return None

    for col, row in ((a, b), (b, a)):
        if (
            isinstance(col, Node)
            and col.target == aten.unsqueeze.default
            and col.args[1] in (-1, 1)
            and iota_len(col.args[0]) is not None
            and iota_len(col.args[0]) == iota_len(row)
        ):
            return True
    return False


def _scalar_value(arg):
    """A Python number, or ``None`` (:func:`_is_per_matrix_scalar` handles tensor scalars)."""
    return arg if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def _is_per_matrix_scalar(arg, like: torch.Tensor | None) -> bool:
    """A tensor that multiplies each matrix by one number: 0-d, or trailing dims (1, 1)."""
    v = val(arg)
    if v is None or like is None:
        return False
    if v.dim() == 0:
        return True
    return v.dim() >= 2 and v.shape[-2:] == (1, 1) and v.dim() <= like.dim()


class SymmetryAnalysis:
    """Forward provenance analysis; call :meth:`visit` on nodes in graph order.

    A rewrite pass visits each node *after* it may have replaced it, so the analysis always
    describes the graph as it is; :meth:`record` lets the pass state the provenance of a node
    it inserted (the same as the node it replaced).
    """

    def __init__(self) -> None:
        self.info: dict[Node, Provenance] = {}

    # ------------------------------------------------------------------ queries
    def get(self, node) -> Provenance | None:
        node = strip_noop_views(node)
        return self.info.get(node) if isinstance(node, Node) else None

    def root_of(self, node):
        """The root node (or :data:`IDENTITY`) of a known-symmetric value, else ``None``."""
        p = self.get(node)
        return None if p is None else p.root

    def is_symmetric(self, node) -> bool:
        return self.get(node) is not None

    def common_root(self, *nodes):
        """The one root all ``nodes`` are polynomials of (ignoring ``None`` and identity), or
        ``None``.

        Returns :data:`IDENTITY` when all are multiples of the identity.
        """
        root = IDENTITY
        for n in nodes:
            if n is None:
                continue
            r = self.root_of(n)
            if r is None:
                return None
            if r is IDENTITY:
                continue
            if root is IDENTITY:
                root = r
            elif r is not root:
                return None
        return root

    def describe(self, node) -> str:
        """Human-readable provenance for logs: ``'poly deg 3 of Gram root mm_1'``."""
        p = self.get(node)
        name = node.name if isinstance(node, Node) else repr(node)
        if p is None:
            origin = node.op if isinstance(node, Node) else "constant"
            target = getattr(node, "target", "")
            return f"{name} (no symmetry provenance: {origin} {target})"
        if p.root is IDENTITY:
            return f"{name} (multiple of I)"
        deg = "?" if p.poly is None else p.poly.degree()
        return f"{name} (degree-{deg} polynomial of root {p.root.name})"

    # ------------------------------------------------------------------ updates
    def record(self, node: Node, prov: Provenance | None) -> None:
        if prov is not None:
            self.info[node] = prov

    def poly(self, node):
        p = self.get(node)
        return None if p is None else p.poly

    def visit(self, node: Node) -> Provenance | None:
        prov = self.transfer(node)
        self.record(node, prov)
        return prov

    def _fresh(self, node: Node, why: str) -> Provenance:
        return Provenance(node, P.root_poly(node), why)

    def _in_root(self, root, poly, why) -> Provenance:
        return Provenance(root, P.capped(poly), why)

    def transfer(self, node: Node) -> Provenance | None:
        """Provenance of ``node`` from its inputs' (``None`` = not provably symmetric)."""
        if node.op != "call_function":
            return None
        t, args = node.target, node.args
        out = val(node)
        if _is_identity(node):
            return Provenance(IDENTITY, P.const(1), "identity matrix")
        if out is None or out.dim() < 2 or out.shape[-1] != out.shape[-2]:
            return None
        if t == torch.ops.dmuon.syrk.default or is_gram_product(node) is not None:
            if t in ADDMMS and not self.is_symmetric(args[0]):
                return None  # X·Xᵀ + C is symmetric only with a symmetric C
            return self._fresh(node, "Gram product X·Xᵀ")
        if t == torch.ops.dmuon.sym_mm.default:
            a, b, c = args[0], args[1], args[2]
            alpha, beta, gamma = args[3], args[4], args[5]
            root = self.common_root(a, b, c)
            if root is not None and root is not IDENTITY:
                poly = P.affine_product(
                    self.poly(a), self.poly(b), self.poly(c), alpha, beta, gamma
                )
                return self._in_root(root, poly, "sym_mm of polynomials of one root")
            return self._fresh(node, "dmuon::sym_mm output (symmetric by contract)")
        if t in MATMULS or t in ADDMMS:
            c, a, b = (None, args[0], args[1]) if t in MATMULS else (args[0], args[1], args[2])
            alpha = node.kwargs.get("alpha", 1) if t in ADDMMS else 1
            beta = node.kwargs.get("beta", 1) if t in ADDMMS else 0
            root = self.common_root(a, b, c)
            if root is None:
                return None
            poly = P.affine_product(self.poly(a), self.poly(b), self.poly(c), alpha, beta, 0)
            return self._in_root(root, poly, "product of polynomials of one root")
        if t in _SAME_VALUE or t == aten.neg.default:
            p = self.get(args[0])
            if p is None or val(args[0]) is None or tuple(val(args[0]).shape) != tuple(out.shape):
                return None
            poly = P.scale(p.poly, -1) if t == aten.neg.default else p.poly
            return Provenance(p.root, poly, p.why)
        if t == aten.permute.default and transposed_source(node) is not None:
            return self.get(args[0])  # Sᵀ = S
        if t in _SCALE:
            return self._scale(node, out)
        if t in _ADD:
            return self._add(node, out)
        return None

    def _scale(self, node: Node, out: torch.Tensor) -> Provenance | None:
        a, b = node.args[0], node.args[1]
        div = node.target == aten.div.Tensor
        for mat, other, may_divide in ((a, b, True), (b, a, False)):
            p = self.get(mat)
            if p is None or not self._fits(mat, out):
                continue
            if div and not may_divide:
                return None  # s / S is elementwise, not a scaling
            number = _scalar_value(other)
            if number is not None:
                factor = (1 / number if number != 0 else None) if div else number
                poly = None if factor is None else P.scale(p.poly, factor)
                return Provenance(p.root, poly, p.why)
            if _is_per_matrix_scalar(other, out):
                return Provenance(p.root, None, p.why + ", scaled by a tensor")
            if self.is_symmetric(other) and not div:
                return self._fresh(node, "Hadamard product of symmetric matrices")
        return None

    def _fits(self, x, out: torch.Tensor) -> bool:
        """``x`` has ``out``'s shape, or is a multiple of I broadcast over the batch dims."""
        v = val(x)
        if v is None:
            return False
        if tuple(v.shape) == tuple(out.shape):
            return True
        return self.root_of(x) is IDENTITY and tuple(v.shape[-2:]) == tuple(out.shape[-2:])

    def _add(self, node: Node, out: torch.Tensor) -> Provenance | None:
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if node.target == aten.sub.Tensor:
            alpha = -alpha
        full = [self._fits(x, out) for x in (a, b)]
        if all(full):
            root = self.common_root(a, b)
            if root is not None:
                if root is IDENTITY:
                    return Provenance(IDENTITY, None, "sum of multiples of I")
                poly = P.add(self.poly(a), self.poly(b), alpha)
                return self._in_root(root, poly, "sum of polynomials of one root")
            if self.is_symmetric(a) and self.is_symmetric(b):
                return self._fresh(node, "sum of symmetric matrices")
            return None
        # S + s·11ᵀ (a broadcast scalar) is symmetric but not a polynomial of S's root.
        for mat, other in ((a, b), (b, a)):
            if (
                full[(0 if mat is a else 1)]
                and self.is_symmetric(mat)
                and (_scalar_value(other) is not None or _is_per_matrix_scalar(other, out))
            ):
                return self._fresh(node, "symmetric matrix plus a broadcast scalar")
        return None
