"""Sympy side of the pass: exact polynomials of Gram roots, rewrite proofs and FLOP costs.

Every symmetric value the provenance analysis knows is a polynomial ``p(R)`` of one root ``R``
(:mod:`dmuon_compile.passes.symmetry`). Polynomials of one matrix commute, so arithmetic on
them is arithmetic in the commutative ring ``QQ[R]``: the analysis carries each value as a
``sympy.Poly`` with *exact* rational coefficients (every float is a dyadic rational). A rewrite
builds the polynomial of its replacement from the replacement's arguments and
:func:`prove_same` checks it equals the original node's polynomial — a wrong ``alpha``/``beta``
mapping, a dropped ``c`` or a misplaced identity term fails the proof and the rewrite is not
made. The FLOP formulas below are sympy expressions as well; the pass evaluates them per
rewrite to report what it saved.

Example::

    >>> r = root_poly()
    >>> z = affine_product(r, r, r, alpha=2.0, beta=-4.75, gamma=0)   # Z = -4.75·R + 2·R²
    >>> prove_same(z, affine_product(r, r, r, 2.0, -4.75, 0))
    True
"""

from __future__ import annotations

import sympy

# Beyond this degree the pass keeps the provenance (the value is still a polynomial of its
# root) but stops carrying the coefficients: a proof would cost more than it tells.
MAX_DEGREE = 256

b_, m_, n_, k_ = sympy.symbols("b m n k", positive=True, integer=True)
#: FLOPs of a general (batched) product (b, m, k)·(b, k, n).
GEMM_FLOPS = 2 * b_ * m_ * n_ * k_
#: FLOPs of a symmetric m×m result from a k-long inner dimension: lower triangle incl. diagonal.
SYMMETRIC_FLOPS = b_ * m_ * (m_ + 1) * k_


def _rational(x) -> sympy.Rational:
    return sympy.Rational(x)  # exact: a float is a dyadic rational


# One generator serves every root: the analysis only combines polynomials of the *same* root
# (or constants), and records which root a polynomial belongs to next to it.
R = sympy.Symbol("R")


def root_poly(node=None) -> sympy.Poly:
    """The polynomial ``R`` of a root (the root itself)."""
    return sympy.Poly(R, R, domain="QQ")


def const(value) -> sympy.Poly:
    """The constant polynomial ``value`` (``value·I`` as a matrix)."""
    return sympy.Poly(_rational(value), R, domain="QQ")


def capped(poly):
    return None if poly is None or poly.degree() > MAX_DEGREE else poly


def scale(poly, factor):
    return None if poly is None else poly * _rational(factor)


def add(pa, pb, alpha=1):
    if pa is None or pb is None:
        return None
    return pa + pb * _rational(alpha)


def affine_product(pa, pb, pc, alpha, beta, gamma):
    """``alpha·a·b + beta·c + gamma`` (the semantics of ``dmuon::sym_mm`` and ``addmm``)."""
    if pa is None or pb is None:
        return None
    if pa.degree() + pb.degree() > MAX_DEGREE:
        return None
    out = pa * pb * _rational(alpha)
    if beta != 0:
        if pc is None:
            return None
        out = out + pc * _rational(beta)
    if gamma != 0:
        out = out + const(gamma)
    return out


def prove_same(original, replacement) -> bool:
    """Whether two carried polynomials are identical (exact rational arithmetic)."""
    if original is None or replacement is None:
        return False
    return (original - replacement).is_zero


def degree(poly) -> int | None:
    return None if poly is None else poly.degree()


def product_flops(batch: int, m: int, n: int, k: int) -> int:
    """FLOPs of a plain ``mm``/``bmm`` of shapes (batch, m, k)·(batch, k, n)."""
    return int(GEMM_FLOPS.subs({b_: batch, m_: m, n_: n, k_: k}))


def symmetric_flops(batch: int, m: int, k: int) -> int:
    """FLOPs of a symmetric-kernel product (lower triangle only)."""
    return int(SYMMETRIC_FLOPS.subs({b_: batch, m_: m, k_: k}))


def composed_ns_polynomial(table) -> sympy.Expr:
    """The odd polynomial in ``x`` that NS with ``table`` applies to each singular value.

    Used by the tests to check the provenance carried through a traced Gram chain: for one
    segment, ``x·q(x²)`` with ``q`` the final ``Q`` polynomial must equal this.

    >>> composed_ns_polynomial([(1.5, -0.5, 0.0)]).as_poly().degree()
    3
    """
    x = sympy.Symbol("x")
    s = x
    for a, b, c in table:
        s = sympy.expand(_rational(a) * s + _rational(b) * s**3 + _rational(c) * s**5)
    return s
