"""The direct reshard of expert stacks sharded inside their experts
(``distributed/_stages/expert_shards.py``: an all-to-all over each in-expert mesh dim) against the
reference through ``DTensor.redistribute``, on 2 and 4 gloo ranks: hypothesis draws the stacks'
shapes, expert counts and mesh layouts (1-D, ep × efsdp, HSDP replicate × shard, two in-expert
dims, stacks replicated whole), uneven pieces and shares included; one spawn per drawn batch.
The same stacks split over their replicas (``split_replicas``) give the same bits, with each
expert orthogonalised once over the replicas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

S0, S1, S2, R = ("S", 0), ("S", 1), ("S", 2), ("R",)
# (mesh shape, placements): what each world size draws from.
LAYOUTS = {
    2: [((2,), (S1,)), ((2,), (S2,)), ((2,), (R,))],
    4: [
        ((4,), (S1,)),
        ((4,), (S2,)),
        ((2, 2), (S1, S0)),  # torchtitan: (efsdp, ep), expert FSDP Shard(1) over EP Shard(0)
        ((2, 2), (S0, S1)),
        ((2, 2), (R, S1)),  # HSDP replicate × shard
        ((2, 2), (R, S2)),
        ((2, 2), (S1, S2)),  # two in-expert dims
        ((2, 2), (S2, S1)),
        ((2, 2), (S1, S1)),  # one tensor dim cut twice: the later dim cuts the earlier's piece
        ((2, 2), (R, S0)),  # HSDP with whole experts: nothing to reshard, replicas to split
        ((4,), (R,)),  # every rank a replica
    ],
}
CASES_PER_SPAWN = 10
# Each example is a spawn of several seconds: no shrinking (the failing case is in the message).
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _placement(code):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if code[0] == "R":
        return Replicate()
    if code[0] == "SS":
        return _StridedShard(code[1], split_factor=code[2])
    return Shard(code[1])


def _per_expert_ns(seen: list):
    """Newton–Schulz one expert at a time on a contiguous copy: each expert's bits then depend
    on its values alone, not on which other experts share the call (a batched call's may, by an
    ulp) nor on the input's strides (DTensor's uneven redistribution hands over a view into its
    padded buffer, which changes the matmuls' bits too), so the two paths must agree bit for bit
    whatever experts each rank gets. ``seen``: the inputs, as received."""
    import dmuon_compile as dmuon
    from dmuon_compile import functional as F

    ns = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)

    def orthogonalize(mats, lays):
        (x,) = mats
        seen.append(x.clone())
        one = [F.orthogonalize([m[None].contiguous()], ns, layouts=lays)[0][0] for m in x]
        return [torch.stack(one).to(x.dtype)]

    return orthogonalize


def _batched_ns():
    import dmuon_compile as dmuon
    from dmuon_compile import functional as F

    ns = dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)
    return lambda mats, lays: F.orthogonalize(mats, ns, layouts=lays)


def _compare(rank: int, world: int, cases: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es

    meshes = {}
    lay = dmuon.Layout.experts()
    inputs = {"new": [], "ref": [], "split": []}
    batched = _batched_ns()
    sent = []
    original = es._all_to_all

    def recording(out, inp, out_splits, in_splits, group):
        me = torch.distributed.get_rank(group)
        item = inp.element_size()
        sent.append(
            ((sum(in_splits) - in_splits[me]) * item, (sum(out_splits) - out_splits[me]) * item)
        )
        original(out, inp, out_splits, in_splits, group)

    es._all_to_all = recording
    out = []
    stacks: dict = {}  # mesh shape -> [(p, u, this case's result)]: one call for all of them
    for mesh_shape, codes, shape, dtype, seed, loads in cases:
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        mesh = meshes[mesh_shape]
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        p = distribute_tensor(full, mesh, [_placement(c) for c in codes])
        u = p.to_local()
        assert es.needs_reshard(p, lay) or es.replicated_stack(p, lay)
        sent.clear()
        for seen in inputs.values():
            seen.clear()
        cuts = es._direct_cuts(p) or []

        def walk(loads=loads):  # the dedicated weights' loads of global ranks 0..3
            return es.ExpertWalk(dict(enumerate(loads)))

        new = es.orthogonalize_resharded([p], [u], [lay], _per_expert_ns(inputs["new"]), walk())[0]
        traffic = (sum(s for s, _ in sent), sum(r for _, r in sent), len(sent))
        got = {
            "dtype": str(new.dtype),
            "local_shape": tuple(u.shape),
            "coord": tuple(mesh.get_coordinate()),
            "direct": es._direct_cuts(p) is not None,
            "ranks": list(cuts[0].ranks) if len(cuts) == 1 else None,
            "member": cuts[0].member if cuts else None,
            "ns_count": sum(len(x) for x in inputs["new"]),
            "new": new,
            "ref": es._orthogonalize_resharded_reference(
                [p], [u], [lay], _per_expert_ns(inputs["ref"])
            )[0],
            # what each path hands NS on this rank (none: an empty tensor)
            "ns_in": [
                torch.cat(inputs[k]).float() if inputs[k] else torch.empty(0)
                for k in ("new", "ref")
            ],
            "new_batched": es.orthogonalize_resharded([p], [u], [lay], batched, walk())[0],
            # split over the replicas: the same bits, each expert once over them
            "split": es.orthogonalize_resharded(
                [p], [u], [lay], _per_expert_ns(inputs["split"]), walk(), split_replicas=True
            )[0],
            "split_count": sum(len(x) for x in inputs["split"]),
            "replicas": math.prod(n for n, c in zip(mesh_shape, codes) if c[0] == "R"),
            "ref_batched": es._orthogonalize_resharded_reference([p], [u], [lay], batched)[0],
            # no NS (a failed rank's placeholders): the round trip gives back the input
            "round_trip": torch.equal(
                es.orthogonalize_resharded([p], [u], [lay], lambda m, _: m, walk())[0], u
            ),
            "sent": traffic[0],
            "received": traffic[1],
            "calls": traffic[2],
        }
        stacks.setdefault(mesh_shape, []).append((p, u, new))
        # bfloat16 -> float32 is exact; the harness returns numpy arrays (no bfloat16)
        out.append({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in got.items()})
    together = []
    for items in stacks.values():
        # The stacks of a mesh in one call, as a step makes it: those cut by one mesh dim share
        # two all-to-alls per (group, dtype) and one NS call; per-expert NS gives each expert
        # the same bits whoever orthogonalises it, so each stack's result is the one above.
        ps, us, alone = zip(*items)
        sent.clear()
        seen: list = []
        calls = []

        def ns(mats, lays, seen=seen, calls=calls):
            calls.append(len(mats))
            return (
                _per_expert_ns(seen)(mats, lays)
                if len(mats) == 1
                else [_per_expert_ns(seen)([m], [la])[0] for m, la in zip(mats, lays)]
            )

        got = es.orthogonalize_resharded(list(ps), list(us), [lay] * len(ps), ns)
        sent_calls = len(sent)
        # split over the replicas, one stack per batch: each batch's all-gather in flight under
        # the next batch's work, the same bits
        piecewise = es.orthogonalize_resharded(
            list(ps),
            list(us),
            [lay] * len(ps),
            lambda mats, lays: [_per_expert_ns([])([m], [la])[0] for m, la in zip(mats, lays)],
            batch_bytes=1,
            split_replicas=True,
        )
        cuts = [es._direct_cuts(p) for p in ps]
        single = {(c[0].group, p.dtype) for c, p in zip(cuts, ps) if len(c) == 1}
        whole = {p.dtype for c, p in zip(cuts, ps) if not c}  # replicated whole: no all-to-all
        several = sum(len(c) for c in cuts if len(c) > 1)
        together.append(
            {
                "same": all(torch.equal(a, b) for a, b in zip(got, alone)),
                "same_split": all(torch.equal(a, b) for a, b in zip(piecewise, alone)),
                "calls": sent_calls,
                "want_calls": 2 * (len(single) + several),
                "ns_calls": len(calls),
                "most_ns_calls": len(single) + len(whole) + sum(len(c) > 1 for c in cuts),
            }
        )
    return out, together


def _case(world: int):
    return st.tuples(
        st.sampled_from(LAYOUTS[world]),
        st.integers(1, 9),  # experts: fewer than the members too
        st.integers(1, 9),  # rows and columns: uneven pieces, and pieces of none
        st.integers(1, 7),
        st.sampled_from([torch.float32, torch.bfloat16]),
        st.integers(0, 2**16),
        st.tuples(*[st.integers(0, 2)] * 4),  # dedicated loads of global ranks 0..3
    ).map(lambda t: (*t[0], (t[1], t[2], t[3]), t[4], t[5], t[6]))


def _chunked(n: int, k: int) -> tuple:
    """``torch.chunk``'s piece sizes (what the reference's DTensor plan gives each member)."""
    return tuple(len(c) for c in torch.arange(n).chunk(k)) + (0,) * (
        k - len(torch.arange(n).chunk(k))
    )


def _one_cut_shares(case, got) -> tuple | None:
    """With one in-expert mesh dim: how many of the ``L`` local experts each member gets whole
    (written out here, not taken from the package): ``L // n`` each, one more for the ``L % n``
    members with the least dedicated load, ties to the lower member."""
    if got["ranks"] is None:
        return None
    L, n, loads = got["local_shape"][0], len(got["ranks"]), case[-1]
    extra = sorted(range(n), key=lambda j: (loads[got["ranks"][j]], j))[: L % n]
    return tuple(L // n + (j in extra) for j in range(n))


def _one_cut_bytes(case, got) -> int | None:
    """What a rank receives (= sends) in the round trip of a stack with one in-expert mesh dim
    of ``n`` members (``c``: its coordinate there) on tensor dim ``d`` of size ``D``: its share
    ``m`` of the ``L`` local experts' other pieces ``m·(D − r)·rest``, then its piece ``r`` of
    the other experts ``(L − m)·r·rest``."""
    mesh_shape, codes, shape, dtype, *_ = case
    inside = [(i, c[1]) for i, c in enumerate(codes) if c[0] == "S" and c[1] != 0]
    if len(inside) != 1:
        return None
    (i, d), local = inside[0], got["local_shape"]
    c = got["coord"][i]
    L, r, D = local[0], local[d], shape[d]
    rest = math.prod(s for k, s in enumerate(local) if k not in (0, d))
    m = _one_cut_shares(case, got)[c]
    return (m * (D - r) * rest + (L - m) * r * rest) * torch.empty((), dtype=dtype).element_size()


def _check(world: int, cases: list) -> None:
    both = run_ranks(_compare, world, cases, timeout=200)
    results = [r[0] for r in both]
    for rank, (_, together) in enumerate(both):
        for t in together:
            assert t["same"] and t["same_split"], (rank, t)
            assert t["calls"] == t["want_calls"], (rank, t)
            assert t["ns_calls"] <= t["most_ns_calls"], (rank, t)
    for k, case in enumerate(cases):
        # split over the replicas: the job orthogonalises each expert once (not once a replica)
        once = sum(ranks[k]["split_count"] for ranks in results)
        every = sum(ranks[k]["ns_count"] for ranks in results)
        assert once * results[0][k]["replicas"] == every, (case, once, every)
        for rank, ranks in enumerate(results):
            got, where = ranks[k], (case, rank)
            assert got["direct"], where
            assert torch.equal(got["new"], got["ref"]), where  # bit for bit
            assert torch.equal(got["split"], got["new"]), where
            assert got["dtype"] == str(case[3]) and got["new"].shape == got["ref"].shape
            # each rank's experts differ by path where a dim-0 shard or a second in-expert dim
            # regroups them (the reference cuts all E experts over the whole mesh); a batched
            # NS call (and a strided input) may then differ by an ulp
            inside = [c for c in case[1] if c[0] == "S" and c[1] != 0]
            regrouped = len(inside) > 1 or any(c[0] != "R" and c[1] == 0 for c in case[1])
            shares = _one_cut_shares(case, got)
            if shares is not None:  # NS gets this member's share of whole experts
                assert got["ns_count"] == shares[got["member"]], where
                if not regrouped and shares == _chunked(sum(shares), len(shares)):
                    # the reference's experts on this rank: its NS input, bit for bit
                    assert torch.equal(*got["ns_in"]), where
            tol = 1e-4 if case[3] == torch.float32 else 2e-2
            torch.testing.assert_close(got["new_batched"], got["ref_batched"], atol=tol, rtol=0)
            assert got["round_trip"], where
            assert got["sent"] == got["received"], where  # the round trip: out = in
            assert got["calls"] == 2 * len(inside), where
            want = _one_cut_bytes(case, got)
            if want is not None:
                assert got["received"] == want, where


@settings(max_examples=2, phases=NO_SHRINK)
@given(st.lists(_case(2), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_direct_reshard_equals_redistribute_on_2_ranks(cases):
    _check(2, cases)


@settings(max_examples=3, phases=NO_SHRINK)
@given(st.lists(_case(4), min_size=CASES_PER_SPAWN, max_size=CASES_PER_SPAWN))
def test_direct_reshard_equals_redistribute_on_4_ranks(cases):
    _check(4, cases)


def _fallback(rank: int, world: int) -> dict:
    """Layouts the direct path leaves to the reference: a ``_StridedShard`` inside the experts
    (FSDP2 over a TP ``Shard(1)``), and a mesh whose group ranks are not its coordinates."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es

    calls = []
    original = es._all_to_all
    es._all_to_all = lambda *a: (calls.append(1), original(*a))
    lay = dmuon.Layout.experts()
    full = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(0))
    layouts = {
        "strided": (init_device_mesh("cpu", (2, 2)), [_StridedShard(1, split_factor=2), Shard(1)]),
        "permuted": (DeviceMesh("cpu", torch.tensor([[1, 0], [3, 2]])), [Shard(0), Shard(1)]),
        "direct": (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)]),  # the control
    }
    out = {}
    for name, (mesh, placements) in layouts.items():
        p = distribute_tensor(full, mesh, placements)
        u = p.to_local()
        calls.clear()
        new = es.orthogonalize_resharded([p], [u], [lay], _per_expert_ns([]))[0]
        ref = es._orthogonalize_resharded_reference([p], [u], [lay], _per_expert_ns([]))[0]
        out[name] = {
            "direct": es._direct_cuts(p) is not None,
            "calls": len(calls),
            "same": torch.equal(new, ref),
        }
    return out


def test_layouts_the_direct_path_does_not_cut_take_the_reference():
    for rank, got in enumerate(run_ranks(_fallback, 4, timeout=120)):
        for name in ("strided", "permuted"):
            assert got[name] == {"direct": False, "calls": 0, "same": True}, (name, rank)
        assert got["direct"] == {"direct": True, "calls": 2, "same": True}, rank


def _pipelined(rank: int, world: int) -> dict:
    """Stacks split over 2 replicas × 2 in-expert members in one batch each (``batch_bytes``
    of one stack): what happens in which order, and the results against one batch and against
    every replica orthogonalising its copy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es

    mesh = init_device_mesh("cpu", (2, 2))
    lay = dmuon.Layout.experts()
    params = [
        distribute_tensor(
            torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(k)),
            mesh,
            [_placement(("R",)), _placement(("S", 1))],
        )
        for k in range(3)
    ]
    updates = [p.to_local() for p in params]
    events: list[str] = []
    original = es._all_gather

    class Recorded:
        def __init__(self, work, k):
            self.work, self.k = work, k

        def wait(self):
            events.append(f"wait {self.k}")
            return self.work.wait()

    def all_gather(out, inp, group):
        k = sum(e.startswith("gather") for e in events)
        events.append(f"gather {k}")
        return Recorded(original(out, inp, group), k)

    def ns(mats, lays):
        events.append(f"ns {sum(e.startswith('ns') for e in events)}")
        return (
            _per_expert_ns([])(mats, lays)
            if len(mats) == 1
            else [_per_expert_ns([])([m], [la])[0] for m, la in zip(mats, lays)]
        )

    one_stack = updates[0].numel() * updates[0].element_size()
    es._all_gather = all_gather
    try:
        batched = es.orthogonalize_resharded(
            params, updates, [lay] * 3, ns, batch_bytes=one_stack, split_replicas=True
        )
        order = list(events)
        events.clear()
        whole = es.orthogonalize_resharded(params, updates, [lay] * 3, ns, split_replicas=True)
        one_batch = list(events)
    finally:
        es._all_gather = original
    each = es.orthogonalize_resharded(params, updates, [lay] * 3, ns)
    return {
        "order": order,
        "one_batch": one_batch,
        "same_as_one_batch": all(torch.equal(a, b) for a, b in zip(batched, whole)),
        "same_as_per_replica": all(torch.equal(a, b) for a, b in zip(batched, each)),
    }


def _waits_under_the_next_batch(order: list[str]) -> bool:
    """Whether every all-gather but the last is waited for only after the next batch's
    Newton–Schulz has run (and each after its own was issued)."""
    gathers = [e for e in order if e.startswith("gather")]
    for k in range(len(gathers)):
        waited = order.index(f"wait {k}")
        if waited < order.index(f"gather {k}"):
            return False
        if k + 1 < len(gathers) and waited < order.index(f"ns {k + 1}"):
            return False
    return True


def test_split_replicas_all_gathers_run_under_the_next_batch():
    # the check has teeth: all-gathers waited for at once are rejected
    assert not _waits_under_the_next_batch(
        ["ns 0", "gather 0", "wait 0", "ns 1", "gather 1", "wait 1"]
    )
    for rank, got in enumerate(run_ranks(_pipelined, 4, timeout=120)):
        assert got["order"].count("ns 2") == 1 and "gather 2" in got["order"], (rank, got)
        assert _waits_under_the_next_batch(got["order"]), (rank, got["order"])
        assert got["one_batch"] == ["ns 0", "gather 0", "wait 0"], (rank, got["one_batch"])
        assert got["same_as_one_batch"] and got["same_as_per_replica"], (rank, got)
