"""HSDP (replicate × shard) with dedicated parameters: the math once, the publish async.

- 4 gloo ranks as a 2×2 mesh (``fully_shard(..., mesh=hsdp)``) train like 1-D FSDP over 4 and
  like one process with the global batch (fp32 NS; tolerances as in test_dedicated_training);
  ``replicate_async=True`` and ``False`` give bit-identical losses and weights.
- 2 ranks as 2×1 (pure replicate) and 1×2, and a 2×1 run with a double ``step()``; 2×1 with
  ``compile=True`` (the early/rest graphs).
- The mesh errors; ``wait_all_replicate_broadcasts`` after an exception mid-forward.
"""

from __future__ import annotations

import json

import pytest
import torch

from dmuon_compile.distributed._runtime.group import GroupState

from . import models
from .harness import full_state, local_device, run_ranks, run_ranks_expect_errors, train_steps
from .test_dedicated_training import HYPER, _ns, train_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 6
DOUBLE_AT = 2  # the scenario run calls step() twice at this iteration


def _muon(model, compile=False, **kw):
    import dmuon_compile as dmuon

    return dmuon.Muon(model, ns_backend=_ns(), compile=compile, **HYPER, **kw)


def reference(
    world: int,
    steps: int = STEPS,
    double_at: int | None = None,
    device: str = "cpu",
    layers: int = models.LAYERS,
):
    """One process, the whole global batch (the same sequence of steps)."""
    model = models.build_llama(layers=layers).to(device)
    opt = _muon(model, predicate=models.proj_predicate)
    first = {}
    losses = train_steps(
        model,
        opt,
        models.batches(steps, world),
        device=device,
        on_first_grads=lambda: first.update(
            {n: p.grad.clone() for n, p in model.named_parameters()}
        ),
        after_step=lambda i: opt.step() if i == double_at else None,
    )
    state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return losses, state, {n: g.cpu() for n, g in first.items()}


def train_hsdp(
    rank,
    world,
    replicas,
    steps,
    replicate_async,
    double_at=None,
    device="cpu",
    compile_cache=None,
    layers=models.LAYERS,
):
    """``compile_cache``: a directory for this rank's Inductor cache, and ``compile=True``."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    dev = local_device(device)
    hsdp = init_device_mesh(
        device, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )
    model = models.build_llama(layers=layers).to(dev)
    owners = dmuon.dedicate_params(
        model, hsdp["shard"], predicate=models.proj_predicate, replicate_mesh=hsdp["replicate"]
    )
    for block in model.layers:
        fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    if compile_cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(compile_cache, f"inductor-{rank}")
    opt = _muon(model, compile=compile_cache is not None, replicate_async=replicate_async)
    runtime = dedicated_runtime(model)
    first, in_flight = {}, []

    def after_step(i):
        in_flight.append(runtime.pending_collectives())
        if i == double_at:
            opt.step()  # no forward in between: the second step drains the first one's publish

    losses = train_steps(
        model,
        opt,
        models.batches(steps, world),
        rank,
        world,
        device=dev,
        on_first_grads=lambda: first.update(
            {n: g.clone() for n, g in models.owned_grads(model).items()}
        ),
        after_step=after_step,
    )
    # the Muon matrices this rank holds whole: the ones its step runs Newton–Schulz on
    muon_params = [
        opt.param_name(p)
        for g in opt.param_groups
        if g["use_muon"]
        for p in g["params"]
        if p.to_local().numel() == p.numel()
    ]
    out = {
        "owners": owners,
        "losses": losses,
        "first": first,
        "muon": muon_params,
        "in_flight": in_flight,
        "comm": json.dumps(dmuon.summarize_comm_plan(model)),
        "profile": json.dumps(dmuon.collect_forward_unshard_profile(model, synchronize=True)),
        "state": full_state(model),
        "compiled": {f"{k.group}/{k.part}": step.calls for k, step in opt.compiled_steps.items()},
        "replicate_peak": runtime.replicate_peak,
    }
    dmuon.wait_all_replicate_broadcasts(model)
    out["pending_after"] = runtime.pending_collectives()
    return out


def _two_by_two(rank, world):
    return {
        "async": train_hsdp(rank, world, 2, STEPS, True),
        "sync": train_hsdp(rank, world, 2, STEPS, False),
        "fsdp": train_distributed(rank, world, STEPS, False),
    }


def _check_run(results, ref, world: int, replicas: int, layers: int = models.LAYERS) -> None:
    ref_losses, ref_state, ref_grads = ref
    r0 = results[0]
    n = 7 * layers
    assert all(r["owners"] == r0["owners"] for r in results) and len(r0["owners"]) == n
    assert sorted(set(r0["owners"].values())) == list(range(world))  # spread over all R×S ranks
    # one Newton–Schulz per matrix in the job: each matrix in exactly one rank's Muon
    owned = [name for r in results for name in r["muon"]]
    assert sorted(owned) == sorted(r0["owners"])
    for rank, r in enumerate(results):
        assert sorted(r["muon"]) == sorted(k for k, o in r["owners"].items() if o == rank)
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
    )
    assert ref_losses[-1] < ref_losses[0]
    for name, want in ref_state.items():
        for r in results:  # every replica holds the same, right weights
            torch.testing.assert_close(
                r["state"][name], want, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
            )
    seen = set()  # gradient scale: the global owner holds the global-batch gradient
    for r in results:
        for name, g in r["first"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6)
            seen.add(name)
    assert seen == set(r0["owners"])
    for r in results:
        assert r["pending_after"] == 0
    comm = json.loads(r0["comm"])
    if replicas > 1:
        rep = comm["replicate"]
        assert rep["active"] and rep["size"] == replicas and rep["shard_size"] == world // replicas
        assert rep["publish_bytes_per_step"] > 0 and rep["roots"]
        assert all("replicate" in g for g in comm["groups"])


def test_hsdp_2x2_matches_fsdp_over_4_and_single_process():
    ref = reference(4)
    results = run_ranks(_two_by_two, 4, timeout=150, env={"DMUON_RECORD_FORWARD_PROFILE": "1"})
    _check_run([r["async"] for r in results], ref, 4, 2)
    _check_run([r["sync"] for r in results], ref, 4, 2)
    for r in results:
        # replicate_async=True/False: bit-identical losses and weights
        assert r["async"]["losses"] == r["sync"]["losses"]
        for name, w in r["async"]["state"].items():
            assert torch.equal(w, r["sync"]["state"][name]), name
        # async leaves the publish in flight after step(); sync does not
        assert all(k > 0 for k in r["async"]["in_flight"]) and set(r["sync"]["in_flight"]) == {0}
        # and equals 1-D FSDP over the same 4 ranks
        torch.testing.assert_close(
            torch.tensor(r["async"]["losses"]),
            torch.tensor(r["fsdp"]["losses"]),
            rtol=1e-4,
            atol=1e-6,
        )
        prof = json.loads(r["async"]["profile"])["total"]
        # one publish per group and step, waited for in the next forward (the last step's
        # publish is drained by full_state), each forward unshard of a group waits once
        assert prof["publishes"] == STEPS * models.LAYERS
        assert prof["publish_waits"] == (STEPS - 1) * models.LAYERS
        assert 0 <= prof["publish_not_ready"] <= prof["publish_waits"]
        assert prof["replicate_reduces"] > 0 and prof["publish_bytes"] > 0


def _two_ranks(rank, world):
    return {
        "2x1": train_hsdp(rank, world, 2, STEPS, True),
        "1x2": train_hsdp(rank, world, 1, STEPS, True),
        "double": train_hsdp(rank, world, 2, STEPS, True, double_at=DOUBLE_AT),
    }


def test_hsdp_2x1_pure_replicate_1x2_and_double_step():
    ref = reference(2)
    results = run_ranks(_two_ranks, 2, timeout=150)
    _check_run([r["2x1"] for r in results], ref, 2, 2)
    _check_run([r["1x2"] for r in results], ref, 2, 1)
    _check_run([r["double"] for r in results], reference(2, double_at=DOUBLE_AT), 2, 2)
    assert json.loads(results[0]["1x2"]["comm"])["replicate"] == {"size": 1, "active": False}


DEEP = 6  # layers: more hook groups than replicate reduces may be in flight


def _deep_2x1(rank, world):
    from dmuon_compile.distributed._runtime import runtime as _runtime

    bounded = train_hsdp(rank, world, 2, 3, True, layers=DEEP)
    _runtime.REPLICATE_REDUCES_IN_FLIGHT = 10**6  # control: every group's sums until the end
    unbounded = train_hsdp(rank, world, 2, 3, True, layers=DEEP)
    return {"bounded": bounded, "unbounded": unbounded}


def test_hsdp_keeps_at_most_two_replicate_reduces_in_flight():
    """The column sums of at most two groups live at once in a backward, and the training is
    the same as one process's; the control (no bound) holds every group's but the last's."""
    results = run_ranks(_deep_2x1, 2, timeout=150)
    ref = reference(2, steps=3, layers=DEEP)
    _check_run([r["bounded"] for r in results], ref, 2, 2, layers=DEEP)
    _check_run([r["unbounded"] for r in results], ref, 2, 2, layers=DEEP)
    for r in results:
        assert r["bounded"]["replicate_peak"] == 2
        assert r["unbounded"]["replicate_peak"] == DEEP - 1


def _two_ranks_compiled(rank, world, cache):
    return train_hsdp(rank, world, 2, 3, True, compile_cache=cache)


@pytest.mark.timeout(480)
def test_hsdp_2x1_compiled_matches_single_process(tmp_path, cache_dir):
    """``compile=True`` on HSDP 2×1: the step is two graphs per rank (the first forward group's
    matrices, published early, and the rest), each run every step; the job trains like one
    process."""
    results = run_ranks(_two_ranks_compiled, 2, str(tmp_path), timeout=400)
    _check_run(results, reference(2, steps=3), 2, 2)
    for r in results:
        assert r["compiled"] == {"0/early": 3, "0/rest": 3}, r["compiled"]


def _mesh_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    unnamed = init_device_mesh("cpu", (world, 1))
    lone = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
    cases = {
        "unnamed_2d": (hsdp["shard"], unnamed),
        "whole_2d": (hsdp["shard"], hsdp),
        "lone_1d": (hsdp["shard"], lone),
        "different_meshes": (other["shard"], hsdp["replicate"]),
    }
    errors = {}
    for label, (mesh, rep) in cases.items():
        try:
            dmuon.dedicate_params(
                models.build_llama(), mesh, predicate=models.proj_predicate, replicate_mesh=rep
            )
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    return errors


def test_hsdp_mesh_errors_name_the_fix():
    for errors in run_ranks(_mesh_errors, 2, timeout=90):
        for label, err in errors.items():
            assert err is not None, label
            assert "HSDP mesh must be 2D with names ('replicate', 'shard')" in err, (label, err)
            assert (
                'mesh_dim_names=("replicate", "shard")' in err
                and 'replicate_mesh=hsdp["replicate"]' in err
            )


def _interrupt(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    # Two replicas of two-rank shards: a one-rank shard group gathers without a collective,
    # and the prefetch's gather is what this test needs in flight beside the publishes.
    hsdp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(5))
    twins = []
    for _ in range(2):
        m = models.build_llama()
        dmuon.dedicate_params(
            m, hsdp["shard"], predicate=models.proj_predicate, replicate_mesh=hsdp["replicate"]
        )
        opt = _muon(m)
        m(x).square().mean().backward()
        opt.step()  # the publish is now in flight
        opt.zero_grad()
        twins.append(m)
    model, twin = twins
    runtime = dedicated_runtime(model)

    models.interrupt_forward(model, x, layer=1)
    before = runtime.pending_collectives()
    dmuon.wait_all_replicate_broadcasts(model)
    out = {
        "before": before,
        "after": runtime.pending_collectives(),
        "states": sorted({g.state for g in runtime.groups}, key=str),
    }
    with torch.no_grad():
        out["diff"] = float((model(x) - twin(x)).abs().max())
    return out


def test_wait_all_after_exception_mid_forward_leaves_nothing_pending():
    for r in run_ranks(_interrupt, 4, timeout=120):
        assert r["before"] > 0  # layers.2's prefetched unshard was still in flight
        assert r["after"] == 0 and r["states"] == [GroupState.SHARDED]
        assert r["diff"] == 0.0


def test_plan_mismatch_across_replicas_raises():
    # 2×1: the shard groups have one rank each, so only the replicate-group check can see it
    errors = run_ranks_expect_errors(_replica_mismatch, 2, timeout=60)
    for err in errors.values():
        assert err is not None and "owner plan differs across ranks of the replicate group" in err


def _replica_mismatch(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    pred = models.proj_predicate if rank == 0 else (lambda n, p: n.endswith("q_proj.weight"))
    dmuon.dedicate_params(
        models.build_llama(), hsdp["shard"], predicate=pred, replicate_mesh=hsdp["replicate"]
    )


def _fallback_and_precision(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon
    from dmuon_compile.dedicated_registry import dedicated_parameters
    from dmuon_compile.distributed import dedicated_runtime

    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    x = torch.randn(
        2, 8, models.D, generator=torch.Generator().manual_seed(9)
    )  # same on every rank
    out = {}
    # Muon(model) publishes in step(); a parameter-list Muon cannot, so the first forward after
    # the synchronising backward publishes instead: both give the same outputs
    outs = []
    for by_model in (True, False):
        m = models.build_llama()
        dmuon.dedicate_params(
            m, hsdp["shard"], predicate=models.proj_predicate, replicate_mesh=hsdp["replicate"]
        )
        if by_model:
            opt = _muon(m)
        else:
            dedicated = [p for _, p in dedicated_parameters(m)]
            others = [p for n, p in m.named_parameters() if not models.proj_predicate(n, p)]
            opt = dmuon.Muon(
                [{"params": dedicated, "use_muon": True}, {"params": others, "use_muon": False}],
                ns_backend=_ns(),
                compile=False,
                **HYPER,
            )
        for _ in range(2):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            outs.append(m(x))
    out["fallback_diff"] = float((outs[0] - outs[1]).abs().max())
    # param_policy bf16 compute / fp32 masters: replicas and the publish in bf16, masters fp32
    m = models.build_llama()
    for module in m.modules():  # the rest of the model computes in bf16 too
        if isinstance(module, models.RMSNorm) or module is m.lm_head:
            module.to(torch.bfloat16)
    policy = dmuon.ParamPolicy(
        dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    dmuon.dedicate_params(
        m,
        hsdp["shard"],
        predicate=models.proj_predicate,
        replicate_mesh=hsdp["replicate"],
        param_policy=policy,
    )
    opt = _muon(m)
    m(x.bfloat16()).float().square().mean().backward()
    opt.step()
    runtime = dedicated_runtime(m)
    out["master_dtypes"] = sorted(
        {str(dp.master.dtype) for dp in runtime.params if dp.master is not None}
    )
    out["replica_dtypes"] = sorted(
        {str(dp.replica.dtype) for dp in runtime.params if dp.replica is not None}
    )
    comm = dmuon.summarize_comm_plan(m)
    out["publish_bytes"] = comm["replicate"]["publish_bytes_per_step"]
    out["weight_numel"] = sum(dp.numel for dp in runtime.params)
    dmuon.wait_all_replicate_broadcasts(m)
    # every replica unshards the same bf16 weights: the owner's rounding of its fp32 master
    out["weights"] = {}
    for g in runtime.groups:
        g.unshard()
        g.wait_unshard()
        out["weights"].update({dp.fqn: dp.unsharded.detach().float().clone() for dp in g.params})
        g.reshard()
    return out


def test_parameter_list_muon_publishes_in_next_forward_and_bf16_publish():
    r0, r1 = run_ranks(_fallback_and_precision, 2, timeout=90)
    for r in (r0, r1):
        assert r["fallback_diff"] == 0.0
        assert r["master_dtypes"] == ["torch.float32"] and r["replica_dtypes"] == ["torch.bfloat16"]
        assert r["publish_bytes"] == r["weight_numel"] * 2  # bf16: each matrix once per step
    assert r0["weights"].keys() == r1["weights"].keys() and r0["weights"]
    for name, w in r0["weights"].items():
        assert torch.equal(w, r1["weights"][name]), name


def _two_gpus(rank, world):
    return {
        "2x1": train_hsdp(rank, world, 2, STEPS, True, device="cuda"),
        "2x1_sync": train_hsdp(rank, world, 2, STEPS, False, device="cuda"),
        "1x2": train_hsdp(rank, world, 1, STEPS, True, device="cuda"),
    }


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_hsdp_on_two_gpus_nccl():
    """2×1 and 1×2 on 2 GPUs with NCCL: CUDA streams/events of the async publish."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = reference(2, device="cuda")
    results = run_ranks(_two_gpus, 2, timeout=300, backend="nccl")
    _check_run([r["2x1"] for r in results], ref, 2, 2)
    _check_run([r["2x1_sync"] for r in results], ref, 2, 2)
    _check_run([r["1x2"] for r in results], ref, 2, 1)
    for r in results:
        assert r["2x1"]["losses"] == r["2x1_sync"]["losses"]


def _early_publish_order(rank, world):
    """Record, at each replicate publish, which group it is and whether the other groups'
    masters were already updated: the first forward group must go out before the rest."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._runtime import replicate as _replicate

    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = models.build_llama()
    dmuon.dedicate_params(
        model, hsdp["shard"], predicate=models.proj_predicate, replicate_mesh=hsdp["replicate"]
    )
    opt = _muon(model)
    runtime = dedicated_runtime(model)
    x = torch.randn(2, 8, models.D, generator=torch.Generator().manual_seed(3))
    model(x).square().mean().backward()  # records the forward order
    first = runtime.forward_order[0]
    others = [
        p.master for g in runtime.groups if g is not first for p in g.params if p.master is not None
    ]
    before = [m.detach().clone() for m in others]
    names = {id(g.replicate): g.name for g in runtime.groups}
    events = []
    original = _replicate.ReplicateStage.publish

    def spy(self, profile=None):
        updated = any(not torch.equal(m, b) for m, b in zip(others, before))
        events.append((names[id(self)], updated))
        return original(self, profile)

    _replicate.ReplicateStage.publish = spy
    try:
        opt.step()
    finally:
        _replicate.ReplicateStage.publish = original
    opt.zero_grad()
    dmuon.wait_all_replicate_broadcasts(model)
    return {
        "events": events,
        "first": first.name,
        "groups": len(runtime.groups),
        "has_others": bool(others),
    }


def test_first_forward_group_is_published_before_the_rest_of_the_step():
    for r in run_ranks(_early_publish_order, 2, timeout=90):
        assert r["groups"] >= 2 and r["has_others"]
        names = [name for name, _ in r["events"]]
        assert names[0] == r["first"]  # published first ...
        assert r["events"][0][1] is False  # ... before any other group's master changed
        assert sorted(names) == sorted(set(names)) and len(names) == r["groups"]  # each once
