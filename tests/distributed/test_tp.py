"""Tensor parallelism with dedicated weights: NS on the whole TP-sharded matrix, once per step.

``parallelize_module`` (colwise q/k/v/gate/up, rowwise o/down) → ``dedicate_params(mesh["dp"])``
→ ``fully_shard`` on gloo: 2 ranks (dp 1 × tp 2), 4 ranks (dp 2 × tp 2) and 8 ranks
(replicate 2 × shard 2 × tp 2) train like one process with the reference ``Muon`` and the global
batch (fp32 NS, tolerances as in test_dedicated_training). Controls: Newton–Schulz blockwise on
the TP shards misses the reference. ``replicate_async=True`` and ``False`` give bit-identical
losses; a double ``step()`` without a forward between stays exact; the mesh errors.
"""

from __future__ import annotations

import os

import pytest
import torch

from . import models
from .harness import local_device, run_ranks, run_ranks_expect_errors, train_steps, whole_tensor
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS = 10
REL = 1e-5  # per-step loss, relative
WEIGHT_ATOL = 2e-4


def tp_owners(layers: int = models.LAYERS, attention: bool = True) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        if attention:  # False: attention stays plain (replicated over TP), dedicated per TP rank
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _muon(model, compile=False, **kw):
    import dmuon_compile as dmuon

    return dmuon.Muon(model, ns_backend=_ns(), compile=compile, **HYPER, **kw)


def reference(dp: int, steps: int = STEPS, double_at: int | None = None, device: str = "cpu"):
    """One process: the same model, the whole global batch (dp × 2 samples), reference Muon."""
    model = models.build_llama().to(device)
    opt = _muon(model, predicate=models.proj_predicate)
    losses = train_steps(
        model,
        opt,
        models.batches(steps, dp),
        device=device,
        after_step=lambda i: opt.step() if i == double_at else None,
    )
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _whole_state(model) -> dict:
    """Every parameter whole on every rank (TP shards summed in from their owners)."""
    import torch.distributed as dist

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._stages import tp as _tp

    runtime = dedicated_runtime(model)
    runtime.wait_all()
    device = runtime.groups[0].device
    tp = {p.fqn: p for p in runtime.params if isinstance(p, _tp.TPDedicatedParam)}
    plain = {p.fqn: p for p in runtime.params if p.fqn not in tp}
    dp_group = runtime.mesh.get_group()
    state = {}
    for name, p in model.named_parameters():
        if name in plain:  # one owner per TP column: broadcast inside this rank's DP group
            dp = plain[name]
            buf = (
                dp.source.detach().clone()
                if dp.source is not None
                else torch.empty(dp.shape, device=device)
            )
            dist.broadcast(buf, src=dist.get_global_rank(dp_group, dp.owner), group=dp_group)
            state[name] = buf
            continue
        if name not in tp:
            state[name] = whole_tensor(p).detach().clone()
            continue
        dp = tp[name]
        whole = torch.zeros(dp.global_shape, device=device)
        if dp.owns:  # the global owner group: one holder per shard in the whole job
            t = runtime.tp.info.rank
            whole.narrow(dp.shard_dim, t * dp.shape[dp.shard_dim], dp.shape[dp.shard_dim]).copy_(
                dp.master
            )
        dist.all_reduce(whole)
        state[name] = whole
    return state


def build_tp(
    rank,
    world,
    dp,
    tp,
    replicas=1,
    attention=True,
    device="cpu",
    predicate=models.proj_predicate,
    bf16=False,
):
    """The model on a (dp, tp) or (replicate, shard, tp) mesh in the documented order
    (``bf16``: computing in bf16, fp32 masters, in FSDP2 and the dedicated weights alike)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    kw, mp = {}, {}
    if bf16:
        kw["param_policy"] = dmuon.ParamPolicy(
            defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
        mp["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model = models.build_llama().to(local_device(device))
    if replicas == 1:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_owners(attention=attention))
        dmuon.dedicate_params(model, mesh["dp"], predicate=predicate, **kw)
        fsdp_mesh, dp_rank = mesh["dp"], mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh(
            device, (replicas, dp // replicas, tp), mesh_dim_names=("replicate", "shard", "tp")
        )
        parallelize_module(model, mesh["tp"], tp_owners(attention=attention))
        dmuon.dedicate_params(
            model,
            mesh["shard"],
            predicate=predicate,
            replicate_mesh=mesh["replicate"],
            **kw,
        )
        fsdp_mesh = mesh["replicate", "shard"]
        dp_rank = (
            mesh["replicate"].get_local_rank() * (dp // replicas) + mesh["shard"].get_local_rank()
        )
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh, **mp)
    fully_shard(model, mesh=fsdp_mesh, **mp)
    return model, dp_rank


PROFILE = {"DMUON_RECORD_FORWARD_PROFILE": "1"}


def train_tp(
    rank,
    world,
    dp,
    tp,
    replicas=1,
    steps=STEPS,
    replicate_async=True,
    control=None,
    double_at=None,
    attention=True,
    compile_cache=None,
    device="cpu",
):
    """``compile_cache``: a directory for this rank's Inductor cache, and ``compile=True``."""

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    model, dp_rank = build_tp(rank, world, dp, tp, replicas, attention, device)
    stage = dedicated_runtime(model).tp
    if control == "blockwise":  # NS on each TP shard separately: a different update

        def blockwise(mats, ns, size=stage.info.size):
            from dmuon_compile import functional as F

            out = []
            for m in mats:
                dim = 0 if m.shape[0] > m.shape[1] or m.shape[0] == m.shape[1] else 1
                parts = F.orthogonalize(list(m.chunk(size, dim=dim)), ns)
                out.append(torch.cat(parts, dim=dim))
            return out

        stage.orthogonalize = blockwise
    if compile_cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(compile_cache, f"inductor-{rank}")
    opt = _muon(model, compile=compile_cache is not None, replicate_async=replicate_async)
    # TP ranks hold the same loss: the mean over all ranks is the DP mean
    losses = train_steps(
        model,
        opt,
        models.batches(steps, dp),
        dp_rank,
        dp,
        device=local_device(device),
        after_step=lambda i: opt.step() if i == double_at else None,
    )
    out = {
        "losses": losses,
        "state": _whole_state(model),
        "comm": dmuon.summarize_comm_plan(model).get("tp"),
        "profile": dmuon.collect_forward_unshard_profile(model, synchronize=True).get("tp"),
        "compiled": {f"{k.group}/{k.part}": step.calls for k, step in opt.compiled_steps.items()},
    }
    return out


def _check(results, ref_losses, ref_state):
    for r, res in enumerate(results):
        for step, (a, b) in enumerate(zip(res["losses"], ref_losses)):
            assert abs(a - b) <= REL * abs(b), (r, step, a, b)
        for name, ref in ref_state.items():
            torch.testing.assert_close(
                res["state"][name], ref, atol=WEIGHT_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 2)])
def test_tp_matches_single_process(dp, tp):
    results = run_ranks(train_tp, dp * tp, dp, tp, env=PROFILE, timeout=200)
    ref_losses, ref_state = reference(dp)
    _check(results, ref_losses, ref_state)
    comm = results[0]["comm"]
    assert comm["tp_size"] == tp and len(comm["matrices"]) == 7 * models.LAYERS
    # NS once per matrix in the whole job: the NS matrices of all ranks add up to the matrices.
    assert sum(r["comm"]["ns_matrices_here"] for r in results) == 7 * models.LAYERS


def test_tp_mixed_with_plain_dedicated_weights():
    """Only the MLP is TP-sharded: the attention matrices are plain weights of a TP model, each
    TP rank orthogonalising its own copy (their cost counts on every TP slot of the column)."""
    results = run_ranks(train_tp, 4, 2, 2, 1, 4, True, None, None, False, env=PROFILE, timeout=200)
    ref_losses, ref_state = reference(2, steps=4)
    _check(results, ref_losses, ref_state)
    assert len(results[0]["comm"]["matrices"]) == 3 * models.LAYERS


@pytest.mark.timeout(480)
def test_tp_compiled_matches_single_process(tmp_path, cache_dir):
    """``compile=True`` compiles the TP owners' Newton–Schulz too (one graph per rank, the NS-chain
    pass included; on CPU its ops run their torch reference) and trains like one process."""
    steps = 3
    results = run_ranks(
        train_tp, 2, 1, 2, 1, steps, True, None, None, True, str(tmp_path), timeout=400
    )
    ref_losses, ref_state = reference(1, steps=steps)
    _check(results, ref_losses, ref_state)
    for res in results:  # every TP matrix is in the TP stage: its compiled NS ran every step
        # the TP owners' NS runs compiled once per TP shape bucket, every step
        calls = res["compiled"]
        assert set(calls) == {"0/tp"} and calls["0/tp"] >= steps, calls
        assert calls["0/tp"] % steps == 0, calls


def test_tp_blockwise_control_misses():
    results = run_ranks(train_tp, 2, 1, 2, 1, 4, True, "blockwise")
    ref_losses, _ = reference(1, steps=4)
    worst = max(abs(a - b) / abs(b) for a, b in zip(results[0]["losses"], ref_losses))
    assert worst > 100 * REL, worst


def test_tp_sync_async_bit_identical_and_double_step():
    a = run_ranks(train_tp, 2, 1, 2, 1, 4, True, env=PROFILE)
    s = run_ranks(train_tp, 2, 1, 2, 1, 4, False, env=PROFILE)
    assert a[0]["losses"] == s[0]["losses"]
    for name in a[0]["state"]:
        assert torch.equal(a[0]["state"][name], s[0]["state"][name]), name
    # Async: each forward waited for the scatter of its groups' updates.
    assert a[0]["profile"]["waits"] > 0 and s[0]["profile"]["waits"] == 0
    d = run_ranks(train_tp, 2, 1, 2, 1, 4, True, None, 1)
    ref_losses, ref_state = reference(1, steps=4, double_at=1)
    _check(d, ref_losses, ref_state)


def test_hsdp_tp_3d_matches_single_process():
    results = run_ranks(train_tp, 8, 4, 2, 2, 6, True, timeout=300)
    ref_losses, ref_state = reference(4, steps=6)
    _check(results, ref_losses, ref_state)
    assert sum(r["comm"]["ns_matrices_here"] for r in results) == 7 * models.LAYERS


def _unnamed_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    model = models.build_llama()
    mesh = init_device_mesh("cpu", (world,))  # no mesh_dim_names
    parallelize_module(model, mesh, tp_owners())
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)


def test_unnamed_mesh_raises():
    errors = run_ranks_expect_errors(_unnamed_mesh, 2)
    for text in errors.values():
        assert text is not None and "ValueError" in text
        assert "DMuon requires named DeviceMesh for TP detection" in text
        assert 'mesh_dim_names=("dp", "tp")' in text


def test_tp_size_one_is_plain_dedication():
    """dp 2 × tp 1: the TP stage has nothing to gather; training equals one process."""
    results = run_ranks(train_tp, 2, 2, 1, 1, 3, True, env=PROFILE, timeout=200)
    ref_losses, ref_state = reference(2, steps=3)
    _check(results, ref_losses, ref_state)
    assert results[0]["comm"]["gather_bytes_per_step"] == 0


def _full_tensor_on_tp_model(rank, world, dp):
    import dmuon_compile as dmuon

    model, _ = build_tp(rank, world, dp, 2, attention=False)
    out = {}
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight"):
        w = model.get_parameter(name)
        out[name] = {
            "full": w.full_tensor(),
            "doubled": (w.detach() * 2).full_tensor(),  # op results stay owner tensors
            "sum": dmuon.full_tensor(w.sum()),  # a TP shard's sum is partial over its group
        }
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_full_tensor_on_a_tp_model(dp):
    # A plain weight (one owner per TP column) and a TP weight (shards on the owner group): the
    # whole initial weight on every rank, bit for bit.
    want = dict(models.build_llama().named_parameters())
    for got in run_ranks(_full_tensor_on_tp_model, 2 * dp, dp, timeout=120):
        for name, value in got.items():
            ref = want[name].detach()
            assert torch.equal(value["full"], ref), name
            assert torch.equal(value["doubled"], ref * 2), name
            torch.testing.assert_close(value["sum"], ref.sum(), rtol=1e-5, atol=1e-6)


def sequence_parallel_plan(layers: int = models.LAYERS) -> dict:
    """The Megatron-style sequence-parallel plan (as torchtitan's Llama): norms and the residual
    stream sharded on the sequence, attention and MLP column/row-parallel in between."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather_seq():
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    plan = {
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
    }
    for i in range(layers):
        p = f"layers.{i}"
        plan[f"{p}.attn_norm"] = SequenceParallel()
        plan[f"{p}.self_attn"] = gather_seq()
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{p}.mlp_norm"] = SequenceParallel()
        plan[f"{p}.mlp"] = gather_seq()
        plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def sequence_parallel_model(world: int):
    """dp 1 × tp ``world``: the sequence-parallel plan, the projections dedicated, FSDP2 per
    block (the page's order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    model = models.build_llama()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], sequence_parallel_plan())
    dmuon.dedicate_params(model, mesh["dp"], predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train_sequence_parallel(rank, world, steps):
    import torch.distributed as dist

    model = sequence_parallel_model(world)
    opt = _muon(model)
    losses = []
    for x in models.batches(steps, 1):
        chunk = x.shape[1] // world  # each TP rank feeds its slice of the sequence
        local = model(x[:, rank * chunk : (rank + 1) * chunk]).square().mean()
        (local / world).backward()  # the mean over the whole sequence, split over the TP ranks
        opt.step()
        opt.zero_grad()
        mean = local.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "state": _whole_state(model)}


def test_sequence_parallel_plan_matches_single_process():
    results = run_ranks(_train_sequence_parallel, 2, 4, timeout=200)
    ref_losses, ref_state = reference(1, steps=4)
    _check(results, ref_losses, ref_state)


def _user_compiled_tp_step(rank, world):
    model, dp_rank = build_tp(rank, world, 1, world)
    opt = _muon(model)
    opt.step = torch.compile(opt.step)
    model(models.batches(1, 1)[0]).square().mean().backward()
    opt.step()


def test_a_user_compiled_step_with_tp_weights_raises_naming_the_fix():
    """``torch.compile(opt.step)`` would trace NS on one TP shard: refused on every rank alike,
    before any collective of the step (the control, the uncompiled step, trains above)."""
    errors = run_ranks_expect_errors(_user_compiled_tp_step, 2)
    for text in errors.values():
        assert text is not None and "NotImplementedError" in text
        assert "Muon(compile=True)" in text


PER_HEAD_STEPS = 4


def _per_head_reference(per_head: bool):
    import dmuon_compile as dmuon

    model = models.build_llama()
    if per_head:
        dmuon.set_head_layouts(model)
    opt = _muon(model, predicate=models.proj_predicate, adjust_lr_fn="original")
    losses = train_steps(model, opt, models.batches(PER_HEAD_STEPS, 1))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_per_head_tp(rank, world):
    import dmuon_compile as dmuon

    model, dp_rank = build_tp(rank, world, 1, world)
    dmuon.set_head_layouts(model)  # on the TP-sharded dedicated weights: blocks of the whole
    opt = _muon(model, adjust_lr_fn="original")  # o's (dim, head_dim) blocks: scale 2, whole 1
    losses = train_steps(model, opt, models.batches(PER_HEAD_STEPS, 1), dp_rank, 1)
    q = model.layers[0].self_attn.q_proj.weight
    o = model.layers[0].self_attn.o_proj.weight
    layouts = [str(dmuon.get_layout(q)), str(dmuon.get_layout(o))]
    return {"losses": losses, "state": _whole_state(model), "layouts": layouts}


def test_per_head_ns_under_tp_matches_single_process():
    """q, k, v per head (rows) and o per head (columns) on TP-sharded dedicated weights (4 heads
    over TP 2: each shard holds whole heads, so each member orthogonalises its own heads,
    test_tp_local_heads.py), and each head moves by its own learning-rate scale. Control:
    whole-matrix NS ends elsewhere."""
    results = run_ranks(_train_per_head_tp, 2, timeout=200)
    ref_losses, ref_state = _per_head_reference(True)
    assert all("head_dims" in text for text in results[0]["layouts"])
    _check(results, ref_losses, ref_state)
    _, whole_state = _per_head_reference(False)
    gap = max((whole_state[k] - ref_state[k]).abs().max() for k in ref_state)
    assert gap > 100 * WEIGHT_ATOL, gap
