"""``dedicating`` under torchtitan's multi-axis SPMD backends, on gloo ranks.

``spmd_backend="full_dtensor"``: torchtitan's ``Module.parallelize`` makes every parameter a
DTensor on the dense storage mesh and hands ``fully_shard`` that mesh with ``dp_mesh_dims``;
the dedicated weights are taken from it and compute as DTensors of that mesh. 1-D FSDP (2
ranks), HSDP 2 × 2 and fsdp 2 × TP 2 (4 ranks) train like one process (the criteria of
``test_torchtitan.py``); FSDP's first gradients equal torchtitan's own FSDP2 path on the same
backend, and a dedicated gradient reduced twice (an all-reduce left in the forward's backward)
is caught. ``spmd_backend="spmd_types"`` (torchtitan's default) is refused naming the cause:
this torch's ``fully_shard`` takes only DTensor parameters with ``dp_mesh_dims``, and torchtitan's
own path fails there without dmuon too (checked here, so a torch that lifts it shows up).
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import full_state, run_ranks
from distributed.test_tp import _whole_state
from torch.distributed.tensor import DTensor

from integrations.test_torchtitan import (
    PER_RANK,
    SEQ,
    STEPS,
    _check_against_one_process,
    build_debug_model,
    parallelize_on_cpu,
    tokens,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]
BACKEND = "full_dtensor"
_DIMS: dict = {}  # in a rank process


def _loss(model, dims, batch, global_tokens: int):
    """torchtitan's loss on full_dtensor: inputs as DTensors of the storage mesh
    (``parallelize_inputs``), this rank's logits (vocab gathered over TP), summed over its
    tokens and divided by the global token count."""
    from torch.distributed.tensor import Replicate
    from torchtitan.distributed import full_dtensor

    inputs, _, _ = full_dtensor.parallelize_inputs(dims, batch[:, :-1], batch[:, 1:], {})
    logits = model(inputs)
    dp = ("dp_replicate", "dp_shard")
    names = logits.device_mesh.mesh_dim_names
    keep = [p if n in dp else Replicate() for n, p in zip(names, logits.placements)]
    logits = logits.redistribute(logits.device_mesh, keep).to_local()
    return (
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        / global_tokens
    )


def _whole_grads(model) -> dict:
    import dmuon_compile as dmuon

    grads = {}
    for name, p in model.named_parameters():
        grad = dmuon.full_tensor(p.grad)
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    return grads


def _train(
    rank, world, folder, replicate=1, tp=1, sequence_parallel=True, plain=None, mutate=False
):
    """``STEPS`` steps of the debug model on full_dtensor through ``dedicating``; ``plain``
    (initial weights): torchtitan's own ``parallelize_llama`` instead, one backward, its
    gradients. ``mutate``: the dedicated gradients all-reduced in the forward's backward too
    (the reduction ``_compute_on_storage_mesh`` avoids)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # Workaround for CPU (see test_torchtitan.py)
    dist_utils.set_spmd_backend(BACKEND)  # as torchtitan's trainer does
    # One ParallelDims per layout and process: a second one's equal meshes are other objects,
    # and a parameter can come out of model.parallelize on the first one's (fully_shard then
    # refuses the mesh); a trainer builds one.
    key = (world, replicate, tp)
    if key not in _DIMS:
        _DIMS[key] = ParallelDims(
            dp_replicate=replicate, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, world_size=world,
            spmd_backend=BACKEND,
        )  # fmt: skip
        _DIMS[key].build_mesh()
    dims = _DIMS[key]
    batch_mesh = dims.get_optional_mesh("batch")
    dp, dp_rank = (1, 0) if batch_mesh is None else (batch_mesh.size(), batch_mesh.get_local_rank())
    spec, model = build_debug_model(sequence_parallel)
    parallelize = (
        spec.parallelize_fn if plain is not None else dmuon_tt.dedicating(spec.parallelize_fn)
    )
    if mutate:
        from torch.distributed.tensor import Replicate

        original = dmuon_tt._take_tp_views

        def replicated_grads(*args):  # the from_local default: Partial -> Replicate, an all-reduce
            views = original(*args)
            return {k: (pl, tuple(Replicate() if g.is_partial() else g for g in grad), *rest)
                    for k, (pl, grad, *rest) in views.items()}  # fmt: skip

        dmuon_tt._take_tp_views = replicated_grads
    model = parallelize_on_cpu(
        parallelize, model, dims, ParallelismConfig(spmd_backend=BACKEND), folder
    )
    global_tokens = dp * PER_RANK * SEQ

    def batch_of(i):
        return tokens(i, dp)[dp_rank * PER_RANK : (dp_rank + 1) * PER_RANK]

    if plain is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        whole = {k: v.clone() for k, v in plain.items()}  # the loader replaces the values
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
        _loss(model, dims, batch_of(0), global_tokens).backward()
        return {"grads": _whole_grads(model)}
    dedicated_runtime(model).publish(wait=True)
    initial = _whole_state(model) if tp > 1 else full_state(model)
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=[model])
    out = {"initial": initial, "grads": {}}

    def step(i):
        loss = _loss(model, dims, batch_of(i), global_tokens)
        loss.backward()
        if i == 0:
            out["grads"] = _whole_grads(model)
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each TP rank holds its data-parallel rank's loss
        return total.item() / tp

    out["losses"] = [step(i) for i in range(STEPS)]
    out["groups"] = [(g["use_muon"], g["param_names"]) for o in optimizers for g in o.param_groups]
    out["dedicated"] = sorted(dedicated_runtime(model).param_names())
    return out


def _scenarios(rank, world, folder, scenarios):
    out = {}
    for label, kw in scenarios.items():
        if "plain_of" in kw:  # torchtitan's own path from another scenario's initial weights
            kw = {k: v for k, v in kw.items() if k != "plain_of"}
            kw["plain"] = out[scenarios[label]["plain_of"]]["initial"]
        out[label] = _train(rank, world, f"{folder}/{label}", **kw)
    return out


def _same_grads(got: dict, want: dict, names) -> list[str]:
    bad = []
    for name in names:
        if not torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7):
            err = (got[name] - want[name]).norm() / want[name].norm()
            bad.append(f"{name}: relative error {err:.2e}")
    return bad


def test_full_dtensor_fsdp_and_tp_train_like_one_process_with_fsdp2s_gradients(tmp_path):
    """2 ranks on full_dtensor: 1-D FSDP (the block weights dedicated) and TP 2 without sequence
    parallel (row-wise gradients come out Partial over TP), each equal to one process within
    1e-4 over 3 steps; FSDP's first gradients (every parameter) equal torchtitan's own FSDP2
    path on full_dtensor. Control: dedicated gradients reduced twice
    (the dp all-reduce ``from_local`` would add) differ, so the comparison can fail."""
    pytest.importorskip("torchtitan")
    scenarios = {
        "fsdp": {},
        "plain": {"plain_of": "fsdp"},
        "mutant": {"mutate": True},
        "tp": {"tp": 2, "sequence_parallel": False},
    }
    results = run_ranks(_scenarios, 2, str(tmp_path), scenarios, timeout=180)
    r0 = results[0]
    dedicated = set(r0["fsdp"]["dedicated"])
    assert len(dedicated) == 10 and all(n.startswith("layers.") for n in dedicated)
    _check_against_one_process([r["fsdp"] for r in results], 2)
    _check_against_one_process([r["tp"] for r in results], 1)
    want = r0["plain"]["grads"]
    assert r0["fsdp"]["grads"].keys() == want.keys()
    assert not _same_grads(r0["fsdp"]["grads"], want, want)
    # The control: the gradient all-reduced on the way is counted twice. (The losses alone
    # would not show it: Muon's update is invariant to the gradient's scale.) The mutant run
    # starts from other initial values of some weights (the rank processes' RNG went on), so
    # the check is on the norms: each dedicated gradient about twice torchtitan's.
    wrong = _same_grads(r0["mutant"]["grads"], want, sorted(dedicated))
    assert len(wrong) == len(dedicated), wrong
    for name in dedicated:
        ratio = r0["mutant"]["grads"][name].norm() / want[name].norm()
        assert ratio == pytest.approx(2, rel=0.05), (name, ratio)


def test_full_dtensor_hsdp_and_dp_tp_train_like_one_process(tmp_path):
    """4 ranks on full_dtensor: HSDP (dp_replicate 2 × dp_shard 2) and dp_shard 2 × TP 2
    (sequence parallel) through torchtitan's storage mesh, each equal to one process; dp × TP's
    first gradients equal torchtitan's own FSDP2 path's."""
    pytest.importorskip("torchtitan")
    scenarios = {
        "hsdp": {"replicate": 2},
        "dp_tp": {"tp": 2},
        "dp_tp_plain": {"tp": 2, "plain_of": "dp_tp"},
    }
    results = run_ranks(_scenarios, 4, str(tmp_path), scenarios, timeout=190)
    r0 = results[0]
    failed = _same_grads(r0["dp_tp"]["grads"], r0["dp_tp_plain"]["grads"], r0["dp_tp"]["grads"])
    for label, dp in (("dp_tp", 2), ("hsdp", 4)):
        try:
            _check_against_one_process([r[label] for r in results], dp)
        except AssertionError as exc:
            failed.append(f"{label}: {exc}")
    assert not failed, "\n".join(failed)


def _spmd_types(rank, world):
    """torchtitan's ``parallelize_llama`` on spmd_types (2 ranks, FSDP), through ``dedicating``
    and alone: each one's error."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"
    dist_utils.set_spmd_backend("spmd_types")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="spmd_types",
    )  # fmt: skip
    dims.build_mesh()
    errors = {}
    for label in ("dmuon", "torchtitan"):
        spec, model = build_debug_model()
        fn = spec.parallelize_fn
        parallelize = dmuon_tt.dedicating(fn) if label == "dmuon" else fn
        try:
            parallelize_on_cpu(
                parallelize, model, dims, ParallelismConfig(spmd_backend="spmd_types"), "unused"
            )
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    return errors


def test_spmd_types_is_refused_naming_the_cause_which_torchtitan_alone_hits_too():
    """spmd_types: ``dedicating`` raises naming the cause and the backends that work; without
    dmuon torchtitan's own path fails in ``fully_shard`` on this torch. When torch's FSDP2
    takes spmd_types' annotated parameters the second check fails: then lift the refusal and
    test dedicated weights under spmd_types."""
    pytest.importorskip("torchtitan")
    for errors in run_ranks(_spmd_types, 2, timeout=120):
        ours, theirs = errors["dmuon"], errors["torchtitan"]
        assert ours is not None and "spmd_types" in ours and '"full_dtensor"' in ours, ours
        assert theirs is not None and "must be DTensors on the full SPMD mesh" in theirs, theirs
