"""Newton–Schulz polynomial coefficient tables.

Each step applies the odd quintic p(x) = a·x + b·x³ + c·x⁵ to the singular values. A table is a
tuple of (a, b, c) triples, one per step.

- Keller Jordan (Muon blog post; torch.optim.Muon's default): one triple used every step.
- You (Jiacheng You's per-step quintics, used by modded-nanogpt and Dion): five triples.
- Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932, Algorithm 1): per-step
  minimax-optimal triples; a safety factor s rescales each as (a/s, b/s³, c/s⁵) so that
  rounding cannot push a singular value above the interval the polynomial was fitted on.
  s = 1.05 is what Gram NS in half precision uses.
"""

from __future__ import annotations

from collections.abc import Sequence

Coefficients = tuple[tuple[float, float, float], ...]

KELLER_JORDAN: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

YOU: Coefficients = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Unscaled, as printed in the paper's Algorithm 1 (degree 5). Steps past the table repeat the
# last entry, which is the fixed point (1.875, -1.25, 0.375) of the classical quintic.
POLAR_EXPRESS_RAW: Coefficients = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

DEFAULT_SAFETY = 1.05
DEFAULT_STEPS = 5
NAMES = ("keller_jordan", "you", "polar_express")


def polar_express(steps: int = DEFAULT_STEPS, safety: float = DEFAULT_SAFETY) -> Coefficients:
    """Polar Express triples for ``steps`` steps, each scaled by the safety factor.

    >>> polar_express(5)[0][0] == 8.28721201814563 / 1.05
    True
    """
    if safety < 1.0:
        raise ValueError(f"safety factor must be >= 1.0 (got {safety}); 1.0 means no safety")
    table = [POLAR_EXPRESS_RAW[min(i, len(POLAR_EXPRESS_RAW) - 1)] for i in range(steps)]
    return tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in table)


def resolve(
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] | None,
    default: str,
    steps: int | None = None,
) -> Coefficients:
    """Turn a user's ``coefficients=`` argument into a per-step table.

    Accepts a table name (``"keller_jordan"``, ``"you"``, ``"polar_express"``), a single
    ``(a, b, c)`` triple (used every step), a sequence of triples, or ``None`` (``default``).
    ``steps`` overrides the number of steps for names and single triples.
    """
    if coefficients is None:
        coefficients = default
    if isinstance(coefficients, str):
        name = coefficients.lower().replace("-", "_").replace(" ", "_")
        if name == "keller_jordan":
            return (KELLER_JORDAN,) * (steps or DEFAULT_STEPS)
        if name == "you":
            if steps not in (None, len(YOU)):
                raise ValueError(
                    f"the 'you' table has exactly {len(YOU)} steps (asked for {steps})"
                )
            return YOU
        if name == "polar_express":
            return polar_express(steps or DEFAULT_STEPS)
        raise ValueError(
            f"unknown coefficient table {coefficients!r}; choose one of {NAMES} or pass "
            "(a, b, c) triples"
        )
    seq = list(coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        return (tuple(float(v) for v in seq),) * (steps or DEFAULT_STEPS)  # type: ignore[return-value]
    table = []
    for i, triple in enumerate(seq):
        triple = tuple(float(v) for v in triple)
        if len(triple) != 3:
            raise ValueError(
                f"coefficient step {i} has {len(triple)} values; each step needs (a, b, c)"
            )
        table.append(triple)
    if not table:
        raise ValueError("coefficients must hold at least one (a, b, c) step")
    if steps is not None and steps != len(table):
        raise ValueError(f"{len(table)} coefficient steps given but steps={steps}")
    return tuple(table)  # type: ignore[return-value]
