"""Sub-passes that rewrite the Newton–Schulz chain into ``torch.ops.dmuon`` symmetric kernels.

The matcher is written by hand over the FX graph instead of with ``register_replacement``:
the NS chain is a handful of ``mm/bmm/addmm/baddbmm`` nodes whose *operands* decide whether a
rewrite is valid (symmetric and commuting — a whole-graph property), the patterns would have
to be registered per rank (2-D/3-D), dtype (fp16/bf16/fp32 with or without
``convert_element_type``), per ``alpha``/``beta`` literal (``scalar_workaround``) and per
operand aliasing (``addmm(A, A, A)`` vs ``addmm(C, A, B)``), and a traced pattern breaks as
soon as Inductor's decompositions change. A node walk with the provenance analysis covers all
of those with four small rules and can say *why* it skipped a candidate.

Rules, applied to each node in graph order (the analysis sees rewritten nodes):

- ``SyrkRewrite``: ``mm/bmm(X, Xᵀ)`` → ``dmuon::syrk(X)``; ``addmm/baddbmm(C, X, Xᵀ)`` with a
  symmetric ``C`` → ``dmuon::syrk(X, C, alpha, beta)``.
- ``SymmetricProductRewrite``: ``mm/bmm(A, B)`` and ``addmm/baddbmm(C, A, B)`` where ``A`` and
  ``B`` are polynomials of one root and ``C`` is symmetric → ``dmuon::sym_mm``. This covers
  direct NS's ``b·A + c·A²`` and every Gram-space update (Z, Q, RZ, R).
- ``IdentityFold``: ``P + g·I`` with ``P`` a single-use dmuon op → ``P``'s ``gamma`` epilogue.
- ``EpilogueFold``: ``s·C + t·P`` with ``P = dmuon::sym_mm(A, B)`` single-use and ``C``
  symmetric → ``dmuon::sym_mm(A, B, C, t, s)`` (the raw ``b*A + c*(A@A)`` form user code
  writes, before Inductor folds it into ``addmm``).

Every replacement of a symmetric product is checked with :func:`polynomial.prove_same`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from dmuon_compile.passes import polynomial as P
from dmuon_compile.passes.symmetry import (
    ADDMMS,
    IDENTITY,
    MATMULS,
    SymmetryAnalysis,
    _is_identity,
    is_gram_product,
    strip_noop_views,
    val,
)
from torch.fx import Graph, Node

from dmuon_compile._compat import detect_fake_mode, dynamo_counters

log = logging.getLogger("dmuon_compile.passes")
aten = torch.ops.aten


def _syrk():
    return torch.ops.dmuon.syrk.default


def _sym_mm():
    return torch.ops.dmuon.sym_mm.default


@dataclass
class RewriteStats:
    """What one run of the pass did (also mirrored into ``dynamo_counters()["dmuon"]``)."""

    rewrites: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)
    proved: int = 0
    flops_before: int = 0
    flops_after: int = 0
    ops_inserted: set[str] = field(default_factory=set)

    def count(self, name: str) -> None:
        self.rewrites[name] += 1
        dynamo_counters()["dmuon"][name] += 1


@dataclass
class RewriteContext:
    graph: Graph
    analysis: SymmetryAnalysis
    stats: RewriteStats
    prove: bool = True

    def skip(self, node: Node, why: str) -> None:
        self.stats.skipped.append(f"{node.name}: {why}")
        dynamo_counters()["dmuon"]["skipped"] += 1
        log.debug("skip %s (%s): %s", node.name, _short(node.target), why)


def _short(target) -> str:
    return str(target).replace("aten.", "").replace(".default", "")


def _shape(node) -> tuple:
    v = val(node)
    return tuple(v.shape) if v is not None else ()


def _insert(ctx: RewriteContext, before: Node, target, args: tuple) -> Node:
    """Insert ``target(*args)`` before ``before``, with its fake value computed for later
    passes."""
    with ctx.graph.inserting_before(before):
        new = ctx.graph.call_function(target, args)
    fakes = [val(a) for a in args if isinstance(a, Node)]
    mode = detect_fake_mode(fakes)
    fake_args = tuple(val(a) if isinstance(a, Node) else a for a in args)
    if mode is not None:
        with mode:
            new.meta["val"] = target(*fake_args)
    for key in (
        "stack_trace",
        "nn_module_stack",
        "source_fn_stack",
        "seq_nr",
        "original_aten",
        "from_node",
    ):
        if key in before.meta:
            new.meta[key] = before.meta[key]
    return new


def _batch_m_k(node: Node) -> tuple[int, int, int]:
    v = val(node)
    batch = int(v.shape[0]) if v.dim() == 3 else 1
    return batch, int(v.shape[-2]), int(v.shape[-1])


class SyrkRewrite:
    """``X·Xᵀ`` (optionally ``+ β·C``) → ``dmuon::syrk``."""

    name = "syrk"

    def try_rewrite(self, ctx: RewriteContext, node: Node) -> Node | None:
        if node.target not in MATMULS and node.target not in ADDMMS:
            return None
        x = is_gram_product(node)
        if x is None:
            return None
        c, alpha, beta = None, 1.0, 0.0
        if node.target in ADDMMS:
            c = node.args[0]
            alpha = float(node.kwargs.get("alpha", 1))
            beta = float(node.kwargs.get("beta", 1))
            if not ctx.analysis.is_symmetric(c) or _shape(c) != _shape(node):
                ctx.skip(
                    node,
                    f"X·Xᵀ + C with C={ctx.analysis.describe(c)} not provably symmetric "
                    "(or broadcast)",
                )
                return None
            c = strip_noop_views(c)
        new = _insert(ctx, node, _syrk(), (x, c, alpha, beta, 0.0))
        batch, m, k = _batch_m_k(x)
        ctx.stats.flops_before += P.product_flops(batch, m, m, k)
        ctx.stats.flops_after += P.symmetric_flops(batch, m, k)
        ctx.stats.ops_inserted.add("syrk")
        ctx.stats.count(self.name)
        log.debug(
            "rewrite %s = %s(%s, %sᵀ) -> dmuon.syrk(%s, c=%s, alpha=%g, beta=%g): Gram product, "
            "lower triangle only (%s×%s from k=%s, batch %s)",
            node.name,
            _short(node.target),
            x.name,
            x.name,
            x.name,
            getattr(c, "name", None),
            alpha,
            beta,
            m,
            m,
            k,
            batch,
        )
        return new


class SymmetricProductRewrite:
    """Products of commuting symmetric matrices (polynomials of one root) → ``dmuon::sym_mm``."""

    name = "sym_mm"

    def try_rewrite(self, ctx: RewriteContext, node: Node) -> Node | None:
        if node.target not in MATMULS and node.target not in ADDMMS:
            return None
        an = ctx.analysis
        if node.target in MATMULS:
            c, a, b = None, node.args[0], node.args[1]
            alpha, beta = 1.0, 0.0
        else:
            c, a, b = node.args
            alpha = float(node.kwargs.get("alpha", 1))
            beta = float(node.kwargs.get("beta", 1))
        sa, sb = _shape(a), _shape(b)
        if len(sa) < 2 or len(sb) < 2 or sa[-2] != sa[-1] or sb[-2] != sb[-1]:
            ctx.skip(
                node,
                f"rectangular product {sa}·{sb}: no symmetric form (direct NS's (B + a·I)·X "
                "and Gram NS's Q·X stay BLAS products; there is no fused dmuon op for them)",
            )
            return None
        root = an.common_root(a, b)
        if root is None or root is IDENTITY:
            if not an.is_symmetric(a) or not an.is_symmetric(b):
                bad = a if not an.is_symmetric(a) else b
                why = f"operand {an.describe(bad)} is not provably symmetric"
            elif root is IDENTITY:
                why = "both operands are multiples of I"
            else:
                why = (
                    f"operands {an.describe(a)} and {an.describe(b)} are symmetric but not "
                    "polynomials of one root, so A·B need not be symmetric"
                )
            ctx.skip(node, why)
            return None
        if c is not None and (not an.is_symmetric(c) or _shape(c) != _shape(node)):
            ctx.skip(node, f"C = {an.describe(c)} is not a provably symmetric full matrix")
            return None
        a, b = strip_noop_views(a), strip_noop_views(b)
        c = strip_noop_views(c) if c is not None else None
        original = an.transfer(node)
        if ctx.prove and original is not None and original.poly is not None:
            replacement = P.affine_product(an.poly(a), an.poly(b), an.poly(c), alpha, beta, 0.0)
            if not P.prove_same(original.poly, replacement):
                ctx.skip(node, "sympy could not prove the replacement is the same polynomial")
                return None
            ctx.stats.proved += 1
            dynamo_counters()["dmuon"]["proved"] += 1
            proof = f"proved equal polynomials of degree {original.poly.degree()}"
        else:
            proof = "polynomial not carried (degree cap or tensor scale): provenance only"
        new = _insert(ctx, node, _sym_mm(), (a, b, c, alpha, beta, 0.0))
        batch, m, k = _batch_m_k(a)
        ctx.stats.flops_before += P.product_flops(batch, m, m, k)
        ctx.stats.flops_after += P.symmetric_flops(batch, m, k)
        ctx.stats.ops_inserted.add("sym_mm")
        ctx.stats.count(self.name)
        log.debug(
            "rewrite %s = %s -> dmuon.sym_mm(%s, %s, c=%s, alpha=%g, beta=%g): operands are "
            "polynomials of root %s; %s",
            node.name,
            _short(node.target),
            a.name,
            b.name,
            getattr(c, "name", None),
            alpha,
            beta,
            root.name,
            proof,
        )
        return new


def _scaled(node):
    """``mul(x, s)`` → ``(x, s)``; anything else → ``(node, 1.0)``."""
    if (
        isinstance(node, Node)
        and node.target == aten.mul.Tensor
        and isinstance(node.args[1], (int, float))
        and not isinstance(node.args[1], bool)
    ):
        return node.args[0], float(node.args[1])
    if (
        isinstance(node, Node)
        and node.target == aten.mul.Tensor
        and isinstance(node.args[0], (int, float))
        and not isinstance(node.args[0], bool)
    ):
        return node.args[1], float(node.args[0])
    return node, 1.0


def _single_use_chain(outer: Node, inner: Node) -> bool:
    """``inner`` is used only on the way to ``outer`` (so folding it away is safe)."""
    node = inner
    while node is not outer:
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return True


def _add_terms(node: Node):
    if node.target not in (aten.add.Tensor, aten.sub.Tensor) or len(node.args) != 2:
        return None
    if not all(isinstance(x, Node) for x in node.args):
        return None
    sign = -1.0 if node.target == aten.sub.Tensor else 1.0
    alpha = float(node.kwargs.get("alpha", 1)) * sign
    (x, sx), (y, sy) = _scaled(node.args[0]), _scaled(node.args[1])
    return [
        (node.args[0], strip_noop_views(x), sx),
        (node.args[1], strip_noop_views(y), sy * alpha),
    ]


def _is_dmuon(node) -> bool:
    return isinstance(node, Node) and node.target in (_syrk(), _sym_mm())


class IdentityFold:
    """``P + g·I`` with ``P`` a single-use dmuon op → ``P`` with ``gamma += g`` (fp32 epilogue)."""

    name = "fold_identity"

    def try_rewrite(self, ctx: RewriteContext, node: Node) -> Node | None:
        terms = _add_terms(node)
        if terms is None:
            return None
        for (_, p, sp), (_, ident, gi) in (terms, terms[::-1]):
            if not (_is_dmuon(p) and sp == 1.0 and _is_identity(ident)):
                continue
            if _shape(p) != _shape(node) or _shape(ident)[-2:] != _shape(node)[-2:]:
                return None
            if val(p).dtype != val(node).dtype:
                return None
            if not _single_use_chain(node, p):
                ctx.skip(node, f"P + g·I: {p.name} has other users, the identity stays an add")
                return None
            args = list(p.args)
            if p.target == _syrk():
                args[4] = float(args[4]) + gi
            else:
                args[5] = float(args[5]) + gi
            new = _insert(ctx, node, p.target, tuple(args))
            ctx.stats.count(self.name)
            log.debug(
                "rewrite %s = %s + %g·I -> %s with gamma=%g (identity in the fp32 epilogue)",
                node.name,
                p.name,
                gi,
                _short(p.target),
                args[-1],
            )
            return new
        return None


class EpilogueFold:
    """``s·C + t·sym_mm(A, B)`` (single use, no ``c`` yet) → ``sym_mm(A, B, C, t, s)``."""

    name = "fold_epilogue"

    def try_rewrite(self, ctx: RewriteContext, node: Node) -> Node | None:
        terms = _add_terms(node)
        if terms is None:
            return None
        an = ctx.analysis
        for (_, p, tp), (_, c, sc) in (terms, terms[::-1]):
            if not (isinstance(p, Node) and p.target == _sym_mm()):
                continue
            a, b, c_old, alpha, _beta, gamma = p.args  # beta multiplies c_old, which is None
            if c_old is not None or _shape(c) != _shape(node) or _shape(p) != _shape(node):
                continue
            if val(c).dtype != val(node).dtype or val(p).dtype != val(node).dtype:
                continue
            if not an.is_symmetric(c):
                ctx.skip(node, f"s·C + t·A·B with C={an.describe(c)} not provably symmetric")
                return None
            if not _single_use_chain(node, p):
                ctx.skip(node, f"s·C + t·A·B: {p.name} has other users")
                return None
            new_args = (a, b, strip_noop_views(c), float(alpha) * tp, sc, float(gamma) * tp)
            original = an.transfer(node)
            if ctx.prove and original is not None and original.poly is not None:
                replacement = P.affine_product(an.poly(a), an.poly(b), an.poly(c), *new_args[3:])
                if not P.prove_same(original.poly, replacement):
                    ctx.skip(
                        node, "sympy could not prove the folded epilogue is the same polynomial"
                    )
                    return None
                ctx.stats.proved += 1
                dynamo_counters()["dmuon"]["proved"] += 1
            new = _insert(ctx, node, _sym_mm(), new_args)
            ctx.stats.count(self.name)
            log.debug(
                "rewrite %s = %g·%s + %g·%s -> dmuon.sym_mm(%s, %s, c=%s, alpha=%g, beta=%g)",
                node.name,
                sc,
                c.name,
                tp,
                p.name,
                a.name,
                b.name,
                c.name,
                new_args[3],
                sc,
            )
            return new
        return None


SUBPASSES = {
    "syrk": SyrkRewrite,
    "sym_mm": SymmetricProductRewrite,
    "fold_identity": IdentityFold,
    "fold_epilogue": EpilogueFold,
}


def below_size_gate(node: Node) -> str | None:
    """Why a product stays on cuBLAS (too small for the Triton kernels), or ``None``.

    The decision is :func:`dmuon_compile.kernel_choice.choose_kernel`'s (``site="graph"``):
    the size gate of eager NS for CUDA products, so a compiled step runs the kernels eager NS
    runs; products elsewhere (the CPU reference, tests) are all rewritten. Only square
    ``mm``-family outputs with static sizes are asked (no guard is added here; a rectangular
    product is never rewritten anyway).
    """
    if node.target not in MATMULS and node.target not in ADDMMS:
        return None
    v = val(node)
    if v is None or v.dim() not in (2, 3):
        return None
    if not all(isinstance(d, int) for d in v.shape) or v.shape[-1] != v.shape[-2]:
        return None
    from dmuon_compile.kernel_choice import choose_kernel

    batch = v.shape[0] if v.dim() == 3 else 1
    choice = choose_kernel("graph", m=v.shape[-1], batch=batch, device=v.device.type)
    return None if choice.uses_op else choice.reason


def rewrite_ns_chain(graph: Graph, enabled=tuple(SUBPASSES), prove: bool = True) -> RewriteStats:
    """Run the enabled sub-passes over ``graph`` in one forward walk; returns what they did.

    >>> stats = rewrite_ns_chain(gm.graph)  # doctest: +SKIP
    >>> stats.rewrites["syrk"]              # doctest: +SKIP
    5
    """
    unknown = set(enabled) - set(SUBPASSES)
    if unknown:
        raise ValueError(
            f"unknown dmuon sub-pass(es) {sorted(unknown)}; choose from {sorted(SUBPASSES)}"
        )
    subpasses = [SUBPASSES[name]() for name in SUBPASSES if name in enabled]
    ctx = RewriteContext(graph, SymmetryAnalysis(), RewriteStats(), prove)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        too_small = below_size_gate(node)
        if too_small is not None:
            ctx.skip(node, too_small)
            ctx.analysis.visit(node)
            continue
        for sub in subpasses:
            new = sub.try_rewrite(ctx, node)
            if new is not None:
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                node = new
                break
        ctx.analysis.visit(node)
    graph.eliminate_dead_code()
    return ctx.stats
