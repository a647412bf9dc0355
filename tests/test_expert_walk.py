"""``ExpertWalk`` (distributed/_stages/expert_shards.py): who orthogonalises which experts of the
stacks sharded inside their experts. Pure bookkeeping, no process group: hypothesis draws walks
(stacks of local experts and costs over groups of members, dedicated loads) and checks them
against the rule written out plainly, and the properties the step's balance rests on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_compile.distributed._stages.expert_shards import ExpertWalk, ns_cost

stacks = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=12)


def _reference(walk_stacks, n: int, base: list[int]) -> list[tuple[int, ...]]:
    """The rule, one extra expert at a time: every member ``local // n``; then each of the
    ``local % n`` extras to the member not yet given one whose load (earlier experts × their
    cost, plus its dedicated load) is least, ties to the first in turn from where the last
    stack's extras ended."""
    loads, start, out = [0] * n, 0, []
    for local, cost in walk_stacks:
        shares = [local // n] * n
        given_extra: set[int] = set()
        for _ in range(local % n):
            free = [j for j in range(n) if j not in given_extra]
            best = min(free, key=lambda j: (loads[j] + base[j], (j - start) % n))
            given_extra.add(best)
            shares[best] += 1
        for j in range(n):
            loads[j] += shares[j] * cost
        start = (start + local % n) % n
        out.append(tuple(shares))
    return out


@settings(max_examples=200, deadline=None)
@given(stacks, st.integers(1, 9), st.data())
def test_the_walk_follows_the_rule(walk_stacks, n, data):
    base = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    ranks = data.draw(st.permutations(range(100, 100 + n)))  # members' global ranks, any order
    walk = ExpertWalk(dict(zip(ranks, base)))
    got = [walk.shares("g", ranks, local, cost) for local, cost in walk_stacks]
    assert got == _reference(walk_stacks, n, base)
    for (local, _), shares in zip(walk_stacks, got):
        assert sum(shares) == local and max(shares) - min(shares) <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=20), st.integers(1, 9))
def test_equal_costs_stay_within_one_expert(locals_, n):
    """No dedicated loads, one cost: after every stack each member's count of experts is within
    one of every other's (a fixed split gave the first members every stack's extras)."""
    walk, counts = ExpertWalk(), [0] * n
    for local in locals_:
        for j, s in enumerate(walk.shares("g", list(range(n)), local, cost=7)):
            counts[j] += s
        assert max(counts) - min(counts) <= 1, counts


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=20), st.data())
def test_dedicated_owners_get_no_more_experts(locals_, data):
    """One cost per expert: a member with a larger dedicated load ends with no more experts
    than one with a smaller load."""
    n = data.draw(st.integers(1, 9))
    base = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    walk, counts = ExpertWalk(dict(enumerate(base))), [0] * n
    for local in locals_:
        for j, s in enumerate(walk.shares("g", list(range(n)), local, cost=10)):
            counts[j] += s
    for i in range(n):
        for j in range(n):
            if base[i] > base[j]:
                assert counts[i] <= counts[j], (base, counts)


def test_groups_walk_apart_and_earlier_cuts_ignore_the_dedicated_loads():
    walk = ExpertWalk({0: 100})
    assert walk.shares("a", [0, 1], local=1, cost=1) == (0, 1)  # rank 0 owns a dedicated weight
    assert walk.shares("b", [0, 1], local=1, cost=1, last=False) == (1, 0)  # not where NS runs
    assert walk.shares("a", [0, 1], local=1, cost=1) == (0, 1)  # group a's own history
    lazy = ExpertWalk(lambda: {1: 5})  # a callable base is read at the first split
    assert lazy.shares("g", [0, 1], local=1, cost=1) == (1, 0)


def test_ns_cost_is_symmetric_and_grows_with_the_small_side():
    assert ns_cost((2048, 7168)) == ns_cost((7168, 2048)) == 2048 * 2048 * 7168
    assert ns_cost((4096, 4096)) > ns_cost((2048, 8192))  # same elements, bigger Gram
