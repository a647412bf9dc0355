"""The multi-rank CUDA tier: 2–8 ranks share ``cuda:0`` over gloo, on CUDA tensors.

gloo runs broadcast, all_reduce, all_gather_into_tensor, reduce_scatter_tensor and reduce on CUDA
tensors, so several processes on the one GPU exercise what the CPU tests cannot: CUDA streams and
events (FSDP2's, the dedicated runtime's publish and scatter), the caching allocator, and one
compiled graph per rank. Each test reuses a CPU test's worker with ``device="cuda"`` and compares
against one process on the same device with the CPU test's tolerances (fp32, TF32 off), plus a
race detector: a run equals the same run under ``CUDA_LAUNCH_BLOCKING=1`` bit for bit.

On the GPU machine: ``python -m pytest -m gpu tests/distributed/test_gpu_tier.py`` (or the
``tier`` stage of benchmarks/gpu_suite.sh). Without a GPU the tier is skipped;
``DMUON_TIER_DEVICE=cpu`` runs the same tests over gloo on the CPU (to check the tier itself; the
race detector then only checks that the run is deterministic).
"""

from __future__ import annotations

import pytest
import torch

from . import models
from . import test_activation_checkpointing as ac
from . import test_clip as clip
from . import test_gqa_collectives as gqa
from . import test_hsdp as hsdp
from . import test_nested_groups as nested
from . import test_registered_params as dcp_tests
from . import test_step_faults as faults
from . import test_tp as tp
from .harness import full_state, local_device, run_ranks
from .test_compiled_step_dist import _ns as _auto_ns
from .test_compiled_step_dist import check_compiled
from .test_dedicated_runtime import check_gradient_accumulation
from .test_dedicated_training import HYPER, _ns, check_against_reference
from .test_faults import check_unused_on_one_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.tier,
    pytest.mark.distributed,
    pytest.mark.timeout(600),
]


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """The one-process references run in this process: full fp32 (the workers' default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------------------------- the harness
def _collectives(rank, world, device):
    """The collectives the runtime uses, on this rank's device, over gloo; a 2×2 mesh's groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dev = local_device(device)
    mine = torch.arange(4, dtype=torch.float32, device=dev) + 10 * rank
    out = {"device": str(dev), "current": str(torch.empty(0, device=device).device)}
    out["broadcast"] = mine.clone()
    dist.broadcast(out["broadcast"], src=1)
    out["all_reduce"] = mine.clone()
    dist.all_reduce(out["all_reduce"])
    out["all_gather"] = torch.empty(4 * world, device=dev)
    dist.all_gather_into_tensor(out["all_gather"], mine)
    out["reduce_scatter"] = torch.empty(4 // world, device=dev)
    dist.reduce_scatter_tensor(out["reduce_scatter"], mine)
    out["reduce"] = mine.clone()
    dist.reduce(out["reduce"], dst=0)
    mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["mesh_device"] = mesh.device_type
    out["shard_sum"] = mine.clone()
    dist.all_reduce(out["shard_sum"], group=mesh["shard"].get_group())
    out["tensor_devices"] = sorted({str(v.device) for v in out.values() if torch.is_tensor(v)})
    return out


def test_collectives_on_one_device_over_gloo(tier_device):
    world = 4  # reduce_scatter_tensor: one element of the 4 per rank
    results = run_ranks(_collectives, world, tier_device, device=tier_device, timeout=120)
    base = torch.arange(4, dtype=torch.float32)
    per_rank = [base + 10 * r for r in range(world)]
    total = sum(per_rank)
    want_device = "cuda:0" if tier_device == "cuda" else "cpu"
    for rank, r in enumerate(results):
        assert r["device"] == r["current"] == want_device  # every rank on cuda:0
        assert r["tensor_devices"] == [want_device] and r["mesh_device"] == tier_device
        assert torch.equal(r["broadcast"], per_rank[1])
        assert torch.equal(r["all_reduce"], total)
        assert torch.equal(r["all_gather"], torch.cat(per_rank))
        assert torch.equal(r["reduce_scatter"], total[rank : rank + 1])
        if rank == 0:
            assert torch.equal(r["reduce"], total)
        replica = rank // 2
        assert torch.equal(r["shard_sum"], per_rank[2 * replica] + per_rank[2 * replica + 1])


# ---------------------------------------------------------------------------------- 1-D, HSDP
def test_fsdp2_dedicated_1d_matches_single_process(tier_device):
    check_against_reference(2, tier_device)


def _hsdp_async_and_sync(rank, world, replicas, device):
    return {
        "async": hsdp.train_hsdp(rank, world, replicas, hsdp.STEPS, True, device=device),
        "sync": hsdp.train_hsdp(rank, world, replicas, hsdp.STEPS, False, device=device),
    }


@pytest.mark.parametrize(("world", "replicas"), [(2, 2), (4, 2)], ids=["2x1", "2x2"])
def test_hsdp_matches_single_process(tier_device, world, replicas):
    ref = hsdp.reference(world, device=tier_device)
    results = run_ranks(
        _hsdp_async_and_sync,
        world,
        replicas,
        tier_device,
        device=tier_device,
        timeout=300,
        env={"DMUON_RECORD_FORWARD_PROFILE": "1"},
    )
    for mode in ("async", "sync"):
        hsdp._check_run([r[mode] for r in results], ref, world, replicas)
    for r in results:  # the publish on its stream (async) or inline (sync): the same bits
        assert r["async"]["losses"] == r["sync"]["losses"]
        for name, w in r["async"]["state"].items():
            assert torch.equal(w, r["sync"]["state"][name]), name


# ---------------------------------------------------------------------------------- TP
@pytest.mark.parametrize(
    ("dp", "replicas", "steps"), [(1, 1, tp.STEPS), (4, 2, 6)], ids=["dp1xtp2", "2x2x2"]
)
def test_tp_matches_single_process(tier_device, dp, replicas, steps):
    world = 2 * dp
    results = run_ranks(
        tp.train_tp,
        world,
        dp,
        2,
        replicas,
        steps,
        True,
        None,
        None,
        True,
        None,
        tier_device,
        device=tier_device,
        env=tp.PROFILE,
        timeout=400,
    )
    ref_losses, ref_state = tp.reference(dp, steps=steps, device=tier_device)
    tp._check(results, ref_losses, ref_state)
    # Newton–Schulz once per matrix in the whole job
    assert sum(r["comm"]["ns_matrices_here"] for r in results) == 7 * models.LAYERS


# ---------------------------------------------------------------------------------- compile=True
def test_compiled_step_1d_matches_eager_single_process(tier_device, tmp_path, cache_dir):
    check_compiled(tmp_path, tier_device)


def test_compiled_hsdp_2x1_matches_single_process(tier_device, tmp_path, cache_dir):
    steps = 3
    results = run_ranks(
        hsdp.train_hsdp,
        2,
        2,
        steps,
        True,
        None,
        tier_device,
        str(tmp_path),
        device=tier_device,
        timeout=500,
    )
    hsdp._check_run(results, hsdp.reference(2, steps=steps, device=tier_device), 2, 2)
    for r in results:  # one graph per rank and part, each run every step
        assert r["compiled"] == {"0/early": steps, "0/rest": steps}, r["compiled"]


def test_compiled_tp_dp1xtp2_matches_single_process(tier_device, tmp_path, cache_dir):
    steps = 3
    results = run_ranks(
        tp.train_tp,
        2,
        1,
        2,
        1,
        steps,
        True,
        None,
        None,
        True,
        str(tmp_path),
        tier_device,
        device=tier_device,
        timeout=500,
    )
    ref_losses, ref_state = tp.reference(1, steps=steps, device=tier_device)
    tp._check(results, ref_losses, ref_state)
    for r in results:
        # the TP owners' NS runs compiled once per TP shape bucket, every step
        calls = r["compiled"]
        assert set(calls) == {"0/tp"} and calls["0/tp"] >= steps, calls
        assert calls["0/tp"] % steps == 0, calls


# ---------------------------------------------------------------------------------- bf16
BF16_STEPS = 4


def _bf16_reference(world, device, dtype=torch.bfloat16):
    """One process, fp32 weights and optimizer; forward and backward of each rank's slice on a
    ``dtype`` copy of the model (what FSDP2's ``param_dtype`` computes: bf16 rounding depends on
    the batch shape, so the slices are computed as the ranks compute them), the gradients summed
    in fp32 and averaged (``reduce_dtype=float32``)."""
    import copy

    import dmuon_compile as dmuon

    model = models.build_llama().to(device)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False, **HYPER
    )
    losses = []
    for x in models.batches(BF16_STEPS, world):
        work = copy.deepcopy(model).to(dtype)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        total = 0.0
        for part in x.to(device, dtype).chunk(world):
            loss = work(part).float().square().mean()
            loss.backward()
            for g, w in zip(grads, work.parameters()):
                g.add_(w.grad.float())
                w.grad = None
            total += loss.item()
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world
        opt.step()
        opt.zero_grad()
        losses.append(total / world)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _train_bf16(rank, world, device):
    """dedicate_params(param_policy=bf16/fp32) next to FSDP2 MixedPrecisionPolicy(bf16/fp32)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    dev = local_device(device)
    mesh = init_device_mesh(device, (world,))
    model = models.build_llama().to(dev)
    policy = dmuon.ParamPolicy(
        defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate, param_policy=policy)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False, **HYPER)
    losses = []
    for x in models.batches(BF16_STEPS, world):
        per = x.shape[0] // world
        loss = model(x[rank * per : (rank + 1) * per].to(dev)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    runtime = dedicated_runtime(model)
    return {
        "losses": losses,
        "state": full_state(model),
        "masters": sorted({str(dp.master.dtype) for dp in runtime.params if dp.master is not None}),
    }


def test_bf16_param_policy_with_fsdp2_mixed_precision_matches_single_process(tier_device):
    """On CPU, the tolerances of the fp32 tests: with each slice's bf16 gradient computed as its
    rank does, only fp32 summation orders differ. On CUDA the ranks' bf16 products need not round
    as the reference's do (cuBLAS may choose other kernels, split-K and reduced-precision
    reductions, for FSDP2's gathered buffers than for the reference's copy): bf16-level
    tolerances there. Control (both): the same
    per-slice training in fp32 (the bf16 policies ignored) lands at least 5x further away."""
    results = run_ranks(_train_bf16, 2, tier_device, device=tier_device, timeout=300)
    ref_losses, ref_state = _bf16_reference(2, tier_device)
    _, fp32_state = _bf16_reference(2, tier_device, dtype=torch.float32)
    loss_rtol, state_atol = (1e-4, 2e-4) if tier_device == "cpu" else (5e-3, 2e-3)
    r0 = results[0]
    assert r0["masters"] == ["torch.float32"]
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=loss_rtol, atol=1e-6
    )
    for name, want in ref_state.items():
        for r in results:
            torch.testing.assert_close(
                r["state"][name], want, rtol=0, atol=state_atol, msg=lambda m, n=name: f"{n}: {m}"
            )
    err = max((r0["state"][n] - ref_state[n]).abs().max().item() for n in ref_state)
    miss = max((r0["state"][n] - fp32_state[n]).abs().max().item() for n in fp32_state)
    print(f"bf16 tier: max weight error {err:.3g} vs bf16 reference, {miss:.3g} vs fp32 training")
    assert miss > 5 * state_atol, (err, miss)


# ---------------------------------------------------------------------------------- clip
@pytest.mark.parametrize("layout", ["1d", "hsdp_2x1", "dp1xtp2"])
def test_clip_matches_single_process(tier_device, layout):
    if layout == "1d" and tier_device == "cuda":
        pytest.skip(
            "clip_grad_norm_ reduces FSDP2's sharded norms with DTensor's functional all-reduce, "
            "which crashes on CUDA tensors over gloo (torch 2.11); the 1-D clip runs on CPU "
            "(tests/distributed/test_clip.py) and on NCCL"
        )
    dp = 1 if layout == "dp1xtp2" else 2
    ref_total, ref_grads = clip._reference(1e-3, dp, device=tier_device)
    if layout == "dp1xtp2":
        args = (clip._clip_tp, 2, 1, True, True, False, tier_device)
    else:
        args = (clip._clip, 2, 1e-3, True, layout == "hsdp_2x1", tier_device)
    results = run_ranks(*args, device=tier_device, timeout=150)
    for total, grads, *_ in results:
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert ref_total > 1e-3  # it clipped


# ---------------------------------------------------------------------------------- DCP
def test_dcp_save_and_resume(tier_device, tmp_path):
    """2 ranks save a DCP checkpoint mid-run; a resume on 2 ranks continues bit for bit, one
    process (a plain model) within 1e-5; the control with a fresh optimizer misses."""
    path = str(tmp_path / "step")
    full = run_ranks(
        dcp_tests._train_and_save, 2, (2,), path, tier_device, device=tier_device, timeout=150
    )
    assert full[0] == full[1]
    expected = full[0][dcp_tests.SAVE_AT :]
    for losses in run_ranks(
        dcp_tests._resume, 2, (2,), path, False, tier_device, device=tier_device, timeout=150
    ):
        assert losses == expected
    one = run_ranks(
        dcp_tests._resume, 1, (1,), path, False, tier_device, device=tier_device, timeout=150
    )[0]
    # One process multiplies the whole batch where each rank multiplied half: on CUDA the
    # kernels (and so the rounding) differ with the shape (seen: 1.1e-5 relative).
    tol = 1e-5 if tier_device == "cpu" else 5e-5
    for got, want in zip(one, expected):
        assert got == pytest.approx(want, rel=tol)
    fresh = run_ranks(
        dcp_tests._resume, 2, (2,), path, True, tier_device, device=tier_device, timeout=150
    )[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(fresh[1:], expected[1:])) > 10 * tol


# ---------------------------------------------------------------------------------- training
def test_weight_unused_on_one_rank(tier_device):
    check_unused_on_one_rank(tier_device)


def test_gradient_accumulation(tier_device):
    check_gradient_accumulation(tier_device)


# ---------------------------------------------------------------------------------- races
RACE_LAYERS, RACE_STEPS = 2, 3
# Model width: 1024 on the GPU (kernels with many blocks, long enough to overlap the
# communication); on the CPU, where CUDA_LAUNCH_BLOCKING means nothing and the run only checks
# the tier itself, 256 keeps it short.
RACE_WIDTH = {"cuda": 1024, "cpu": 256}
# Both runs pick the same kernels, deterministic ones: cuBLAS with a fixed workspace, the math
# attention (the fused ones' backward may accumulate in any order).
RACE_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _race_run(rank, world, device, width, compile_cache):
    """HSDP 2×2 at ``width`` (FSDP2's streams, the owner reduce, the async publish; compiled:
    each rank's own step graph) with no host sync in the loop: the losses stay on the device
    until the end."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import dmuon_compile as dmuon

    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = local_device(device)
    mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = models.build_llama(dim=width, ffn=width, heads=8, layers=RACE_LAYERS).to(dev)
    dmuon.dedicate_params(
        model, mesh["shard"], predicate=models.proj_predicate, replicate_mesh=mesh["replicate"]
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compile_cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(compile_cache, f"inductor-{rank}")
    compiled = compile_cache is not None  # the NS-chain pass and its kernels, one graph per rank
    opt = dmuon.Muon(
        model,
        ns_backend=_auto_ns() if compiled else _ns(),
        compile=compiled,
        replicate_async=True,
        **HYPER,
    )
    batches = [x.to(dev) for x in models.batches(RACE_STEPS, world, dim=width)]
    per = batches[0].shape[0] // world
    losses = []
    with sdpa_kernel(SDPBackend.MATH):
        for x in batches:
            loss = model(x[rank * per : (rank + 1) * per]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    state = full_state(model)  # collective: every rank; rank 0's copy is compared
    return {"losses": torch.stack(losses), "state": state if rank == 0 else None}


@pytest.mark.timeout(1800)  # three runs
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_race_detector_run_equals_run_under_cuda_launch_blocking(
    tier_device, tmp_path, cache_dir, compiled
):
    """A missing stream wait or event shows as a difference between a run and the same run with
    every launch synchronous. A second free run first proves the run deterministic (else the
    comparison could not judge)."""

    def run(blocking, tag):
        cache = str(tmp_path / tag) if compiled else None
        env = {**RACE_ENV, "CUDA_LAUNCH_BLOCKING": "1" if blocking else "0"}
        return run_ranks(
            _race_run,
            4,
            tier_device,
            RACE_WIDTH[tier_device],
            cache,
            device=tier_device,
            env=env,
            timeout=500,
        )

    free, again, blocking = run(False, "a"), run(False, "b"), run(True, "c")
    for other, what in ((again, "a second free run: not deterministic"), (blocking, "a race")):
        for rank in range(4):
            assert torch.equal(free[rank]["losses"], other[rank]["losses"]), (rank, what)
        for name, w in free[0]["state"].items():
            assert torch.equal(w, other[0]["state"][name]), (name, what)
    # every step moved the weights (the comparison is not between idle runs)
    assert len(set(free[0]["losses"].tolist())) == RACE_STEPS, free[0]["losses"]


# ---------------------------------------------------------------------------------- checkpointing
def _checkpointing(rank, world, device):
    """The checkpointing runs with the math attention: its backward is deterministic (the fused
    ones' may accumulate in any order), so runs with and without recomputation compare at the
    CPU test's 1e-6."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return ac._all(rank, world, device)


def test_activation_checkpointing_unshards_once_and_trains_the_same(tier_device, record_property):
    """Recomputation inside backward (torch.utils.checkpoint, checkpoint_wrapper after and
    before dedicate_params, two hook groups per block) unshards nothing twice, leaves every
    group sharded and empty at the end of backward and trains as the run without checkpointing
    (the one-process comparison of the runtime is the 1-D test above); the old rule's control
    fails. On CUDA each rank's peak of allocated memory per configuration is printed and recorded
    as the test's ``peak_allocated_bytes`` property."""
    results = run_ranks(_checkpointing, 2, tier_device, device=tier_device, timeout=300)
    ac.check_checkpointing(results)
    if tier_device == "cuda":
        peaks = [r["peak_bytes"] for r in results]
        print("peak allocated bytes per rank and configuration:", peaks)  # with -s or -rP
        record_property("peak_allocated_bytes", peaks)  # the JUnit XML (gpu_suite's tier.xml)
        for rank, peak in enumerate(peaks):
            assert set(peak) == set(ac.CONFIGS), peak
            assert all(b > 0 for b in peak.values()), (rank, peak)


# ---------------------------------------------------------------------------------- faults
FAULT_CASES = [  # (kind, layout, phase, the failing rank's own exception)
    ("eager", "1d", "the eager Muon step (momentum, Newton–Schulz)", "InjectedError"),
    ("eager", "hsdp", "the eager Muon step (momentum, Newton–Schulz)", "InjectedError"),
    ("oom", "1d", "the eager Muon step (momentum, Newton–Schulz)", "OutOfMemoryError"),
    ("oom", "hsdp", "the eager Muon step (momentum, Newton–Schulz)", "OutOfMemoryError"),
    ("eager", "tp", "the TP owners' Newton–Schulz (eager)", "InjectedError"),
    # The compiled step holds its verdict on the device (pinned copy, event): read next call.
    ("compiled", "1d", "the compiled Muon step", "BackendCompilerFailed"),
    ("compiled", "hsdp", "the compiled Muon step", "BackendCompilerFailed"),
]


@pytest.mark.parametrize(
    ("kind", "layout", "phase", "cause"),
    FAULT_CASES,
    ids=[f"{k}-{'hsdp_2x1' if lay == 'hsdp' else lay}" for k, lay, *_ in FAULT_CASES],
)
def test_one_rank_failure_in_step_raises_everywhere_then_trains_exactly(
    tier_device, kind, layout, phase, cause
):
    """Rank 1 fails inside step() (1-D, HSDP 2×1, dp1 × tp2): every rank raises MuonStepError
    naming rank 1 and the phase, and the steps after it give the weights of one process that
    skipped that batch."""
    from dmuon_compile import optimizer

    phase = next(p for p in optimizer.STEP_PHASES if p.startswith(phase))
    results = run_ranks(
        faults._train,
        faults.WORLD,
        kind,
        layout,
        True,
        tier_device,
        device=tier_device,
        timeout=300,
    )
    ref = faults.reference(1 if layout == "tp" else faults.WORLD, tier_device)
    at = faults.FAIL_AT + 1 if kind == "compiled" else faults.FAIL_AT
    assert faults._problems(results, phase, cause, ref, at) == []


# ----------------------------------------------------------------------- stored momentum
@pytest.mark.parametrize("kind", ["dense", "hsdp"])
def test_an_offloaded_momentum_trains_bit_for_bit_like_the_one_on_the_device(tier_device, kind):
    """``Muon(offload="momentum")`` on 2 ranks sharing the GPU: the pinned host copy streamed
    in and out on each rank's side streams (events, the allocator's record_stream) trains bit
    for bit like the momentum kept on the device."""
    from .test_momentum_storage_dist import check_offloaded_equals_on_device

    check_offloaded_equals_on_device(kind, tier_device)


@pytest.mark.parametrize("hsdp, world", [(0, 2), (2, 2), (2, 4)], ids=["1d", "hsdp2x1", "hsdp2x2"])
def test_offloaded_masters_train_bit_for_bit_like_masters_on_the_device(tier_device, hsdp, world):
    """``Muon(offload="state")`` on 2 (or 4) ranks sharing the GPU, bf16 compute: the masters in
    pinned host memory, brought in bucket by bucket by the commit on a side stream and copied out on
    another (the host waiting for each bucket's copy out), train bit for bit like the masters on
    the device. HSDP (2 replicas): two jobs a step (the first forward group's matrices first),
    their masters through the same slots; 2×2: a column's two owners."""
    from .test_host_masters import check_offloaded_masters_equal_on_device

    check_offloaded_masters_equal_on_device(tier_device, hsdp, world)


def test_offloaded_tp_masters_train_bit_for_bit_like_masters_on_the_device(tier_device):
    """``Muon(offload="state")`` with TP 2 on 2 ranks sharing the GPU: each member's shards
    copied in all at once on a side stream, the scattered updates applied at the commit."""
    from .test_host_masters import check_offloaded_tp_masters_equal_on_device

    check_offloaded_tp_masters_equal_on_device(tier_device)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_kept_new_momentum_trains_bit_for_bit_like_the_default(tier_device, compiled):
    """``Muon(keep_new_momentum=True)`` on 2 ranks sharing the GPU: each owner's buf′ swapped
    in at the commit (compiled: the verdict left on the device, the undo queued behind) trains
    bit for bit like the default step."""
    from .test_momentum_storage_dist import check_kept_equals_default

    check_kept_equals_default("dense", tier_device, compile=compiled)


# ---------------------------------------------------------------------------------- GQA
def _gqa_counted(rank, world, device):
    """GQA training with every unshard's and reduce's collectives counted; the padding
    threshold at 0 so 2 ranks take the uneven path (as 4+ ranks do on their own)."""
    from dmuon_compile.distributed._runtime import group as G

    G.MAX_GATHER_PADDING = 0.0
    return gqa.train(rank, world, gqa.STEPS, gqa._count_group_collectives(), device)


def test_gqa_one_collective_per_unshard_and_reduce_trains_like_one_process(tier_device):
    """Owners holding different byte counts (k/v a quarter of q): one launch per unshard and
    per reduce, the same on every rank, and the weights of one process."""
    runs = run_ranks(_gqa_counted, 2, tier_device, device=tier_device, timeout=300)
    gqa.check_one_collective_each(runs)
    gqa.check_equals_one_process(runs[0], *gqa.reference(2, device=tier_device))


# ---------------------------------------------------------------------------------- nesting
def test_nested_hook_groups_train_like_one_process(tier_device):
    """A hook group whose forward encloses others (a ViT's root ``pos_embed``, a CNN's root
    parameter, two forwards before one backward): the enclosed groups' reduces wait for their
    gradients, 2 ranks train like one process; the old rule's control misses."""
    refs = {case: nested.reference(case, 2, tier_device) for case in nested.CASES}
    nested.check_nested(
        run_ranks(nested._cases, 2, tier_device, device=tier_device, timeout=300), refs
    )
