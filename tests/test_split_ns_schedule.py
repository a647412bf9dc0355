"""The collective schedule a failed split-NS member replays (``split_ns._collective_schedule``,
found by running the blocked NS on meta tensors) is the one the members run.

Compared, for direct and Gram NS, even and uneven (also empty) pieces and several restart
tables, with the collectives the simulated group issues for the same call
(``split_newton_schulz_reference``'s comm log: kind and result size, in order) — the header's
all-reduce first. A member that has failed issues exactly this list (zeros), so its peers'
collectives pair with it. Control: another restart table gives another schedule, and the
comparison sees it.
"""

from __future__ import annotations

import pytest
import torch

from dmuon_compile import NewtonSchulz
from dmuon_compile.distributed import split_ns

CASES = [
    # (shape, p, bounds or None, NewtonSchulz kwargs)
    ((96, 16), 2, None, {}),
    ((16, 96), 4, None, {}),
    ((40, 40), 3, None, {"backend": "direct"}),
    ((30, 8), 4, [(0, 10), (10, 10), (10, 25), (25, 30)], {}),
    ((64, 12), 2, None, {"restart_iterations": (1, 3)}),
]


class _Logged(split_ns._SimulatedComm):
    last = None

    def __init__(self, p: int) -> None:
        super().__init__(p)
        _Logged.last = self


def _simulated(shape, p, bounds, ns, monkeypatch) -> list[tuple[str, int]]:
    monkeypatch.setattr(split_ns, "_SimulatedComm", _Logged)
    split_ns.split_newton_schulz_reference(torch.randn(shape), ns, p, bounds=bounds)
    return list(_Logged.last.log)


def _replayed(shape, p, bounds, ns, rank) -> list[tuple[str, int]]:
    bounds = bounds or split_ns.split_bounds(shape, p)
    schedule = split_ns._collective_schedule(shape, bounds, ns, rank, torch.float32)
    assert schedule[0] == ("header", (p, split_ns._SLOT), torch.float64)
    out = []
    for kind, size, dtype in schedule[1:]:
        assert dtype == torch.float32
        # what the group's collective returns: an m×m sum, or p padded row blocks
        out.append((kind, size[0] * size[1] * (p if kind == "all_gather" else 1)))
    return out


@pytest.mark.parametrize("shape, p, bounds, kwargs", CASES)
def test_replayed_schedule_is_what_the_group_runs(shape, p, bounds, kwargs, monkeypatch):
    ns = NewtonSchulz(work_dtype=torch.float32, **kwargs)
    want = _simulated(shape, p, bounds, ns, monkeypatch)
    for rank in range(p):  # every member, an empty piece included
        assert _replayed(shape, p, bounds, ns, rank) == want, rank


def test_control_another_table_gives_another_schedule(monkeypatch):
    shape, p = (96, 16), 2
    want = _simulated(shape, p, None, NewtonSchulz(work_dtype=torch.float32), monkeypatch)
    other = NewtonSchulz(work_dtype=torch.float32, restart_iterations=(1, 3))
    assert _replayed(shape, p, None, other, 0) != want
