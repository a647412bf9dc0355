"""Coefficient tables against their published values."""

import pytest

from dmuon_compile import coefficients as C


def test_keller_jordan_matches_torch_optim_muon():
    from torch.optim import _muon

    assert C.KELLER_JORDAN == (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    assert C.KELLER_JORDAN == (3.4445, -4.7750, 2.0315)


def test_you_table_published_values():
    assert C.YOU[0] == (4.0848, -6.8946, 2.9270)
    assert C.YOU[4] == (2.8366, -3.0525, 1.2012)
    assert len(C.YOU) == 5


def test_polar_express_raw_and_safety():
    # Algorithm 1 of arXiv:2505.16932 (first and fifth steps, rounded as docs/architecture.md
    # quotes them)
    first, fifth = C.POLAR_EXPRESS_RAW[0], C.POLAR_EXPRESS_RAW[4]
    assert [round(v, 5) for v in first] == [8.28721, -23.59589, 17.30039]
    assert [round(v, 5) for v in fifth] == [2.30065, -1.66890, 0.41881]
    scaled = C.polar_express(5, safety=1.05)
    a, b, c = scaled[0]
    assert a == pytest.approx(first[0] / 1.05, rel=1e-15)
    assert b == pytest.approx(first[1] / 1.05**3, rel=1e-15)
    assert c == pytest.approx(first[2] / 1.05**5, rel=1e-15)
    assert C.polar_express(5, safety=1.0) == C.POLAR_EXPRESS_RAW[:5]
    # past the table, the last (fixed-point) entry repeats
    assert C.polar_express(10, safety=1.0)[9] == (1.875, -1.25, 0.375)


def test_resolve_forms():
    assert C.resolve(None, "keller_jordan") == (C.KELLER_JORDAN,) * 5
    assert C.resolve("keller_jordan", "you", steps=3) == (C.KELLER_JORDAN,) * 3
    assert C.resolve((1.0, 2.0, 3.0), "you", steps=2) == ((1.0, 2.0, 3.0),) * 2
    assert C.resolve([(1, 2, 3), (4, 5, 6)], "you") == ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert C.resolve("Polar-Express", "you") == C.polar_express(5)


@pytest.mark.parametrize(
    "bad, match",
    [("nope", "unknown coefficient table"), ([(1, 2)], "needs"), ([], "at least one")],
)
def test_resolve_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        C.resolve(bad, "you")


def test_safety_below_one_rejected():
    with pytest.raises(ValueError, match="safety"):
        C.polar_express(5, safety=0.9)
