"""A model built on the meta device, in torchtitan's order, allocates only its share per rank.

``with torch.device("meta"): model = ...`` → (TP ``parallelize_module``) →
``dmuon.dedicate_params`` → ``fully_shard`` → ``model.to_empty(device=...)`` → initialisation
(``nn.init`` through the model's own init, or ``dmuon.set_model_state_dict`` of a full dict),
on gloo: 2 ranks 1-D, 4 ranks HSDP 2 × 2 and dp 2 × tp 2. Each run:

- measures, after every construction stage, the bytes of all live tensors of the rank (every
  tensor the garbage collector can reach, each storage once) above what it held before; they
  stay within the rank's share — the dedicated weights it owns whole (HSDP: its owner column's
  copies; TP: its shards) plus its FSDP2 shards plus 64 KiB — computed from the owner plan and
  the shapes, not from the runtime. Control: the same measure on the rank holding the model
  materialised whole exceeds it. (On 2 ranks a share is about half the model; with dp 2 × tp 2
  the model is over 4 × a rank's owned share.)
- initialises every dedicated weight with ``nn.init`` functions and checks the values on the
  owners (exact for zeros/ones/constant/eye, bounds and moments for the random ones, ``W Wᵀ = I``
  for orthogonal); the other ranks keep empty local tensors; HSDP: the other replicas' copies
  differ from the global owners' values until the first forward publishes them, then equal them.
- loads the one-process model's full state dict and trains 5 steps: losses equal one process
  started from the same weights within 1e-5 relative, final weights within 2e-4.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from . import models
from .harness import run_ranks, train_steps
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

DIMS = {"dim": 128, "ffn": 256, "heads": 4, "layers": 2}
STEPS = 5
REL = 1e-5
WEIGHT_ATOL = 2e-4
SLACK = 64 * 1024  # bytes: FSDP2's padding, meshes, the plan-digest buffers


# ------------------------------------------------------------------------------ measuring


def live_tensor_bytes() -> int:
    """Bytes of every live tensor storage of this process (each storage once; DTensor wrappers
    are counted through their local tensors, meta tensors hold nothing)."""
    import gc

    gc.collect(1)  # the young temporaries in reference cycles are not live
    plain = (torch.Tensor, torch.nn.Parameter)  # exact types: DTensor wrappers hold no storage
    seen, total = set(), 0
    for t in [obj for obj in gc.get_objects() if type(obj) in plain]:
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _share(shapes: dict, owners: dict, layout: str, coords: dict) -> tuple[int, int]:
    """(bytes of the dedicated weights this rank holds, bytes of its FSDP2 shards), from the
    owner plan ``dedicate_params`` returned and the global shapes."""
    held, shards = 0, 0
    for name, (shape, size) in shapes.items():
        numel = math.prod(shape)
        if name in owners:
            if layout == "hsdp":  # the owner column: the global owner and its replica peers
                mine = owners[name] % coords["shard_size"] == coords["shard"]
            else:  # 1-D: the owner; TP: the owner's DP coordinate holds one shard per TP rank
                mine = owners[name] % coords["dp_size"] == coords["dp"]
            held += numel * size // coords["tp_size"] if mine else 0
        else:  # FSDP2: dim 0 split over the shard dimension (padded to equal rows)
            rows = math.ceil(shape[0] / coords["fsdp_size"])
            shards += rows * (numel // shape[0]) * size
    return held, shards


# ------------------------------------------------------------------------------ the model


def _tp_plan():
    from .test_tp import tp_owners

    return tp_owners(layers=DIMS["layers"])


def init_weights(model, whole_matrices: bool = True) -> list[str]:
    """A model's own initialisation, as torchtitan's ``init_weights``: ``reset_parameters`` of
    every module that has one, then one ``nn.init`` function per dedicated weight type.
    ``whole_matrices=False`` (TP-sharded weights): ``eye_`` and ``orthogonal_`` must raise,
    naming the fix; those weights get ``zeros_`` instead. Returns those errors."""
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()  # kaiming_uniform_ (bias-free)
    layer0, layer1 = model.layers[0], model.layers[1]
    nn.init.trunc_normal_(layer0.self_attn.q_proj.weight, std=0.02, a=-0.03, b=0.03)
    nn.init.normal_(layer0.self_attn.k_proj.weight, mean=0.5, std=0.25)
    nn.init.uniform_(layer0.self_attn.v_proj.weight, -0.3, 0.3)
    nn.init.zeros_(layer0.self_attn.o_proj.weight)
    nn.init.ones_(layer0.mlp.gate_proj.weight)
    nn.init.xavier_uniform_(layer0.mlp.up_proj.weight)
    nn.init.kaiming_normal_(layer0.mlp.down_proj.weight)
    nn.init.xavier_normal_(layer1.self_attn.q_proj.weight)
    nn.init.constant_(layer1.self_attn.k_proj.weight, 0.125)
    nn.init.trunc_normal_(layer1.mlp.gate_proj.weight, std=0.02)  # torchtitan's call
    # layer1.self_attn.o_proj, layer1.mlp.down_proj: reset_parameters (kaiming_uniform_)
    errors = []
    for init, w in (
        (nn.init.eye_, layer1.self_attn.v_proj.weight),
        (nn.init.orthogonal_, layer1.mlp.up_proj.weight),
    ):
        try:
            init(w)
        except NotImplementedError as exc:
            if whole_matrices:
                raise
            errors.append(str(exc))
            nn.init.zeros_(w)
    return errors


def _check_init(name: str, w: torch.Tensor, shape, whole: bool) -> str | None:
    """What is wrong with an initialised dedicated weight (``w``: its values on one rank, the
    whole weight or a TP shard of the global ``shape``; ``None``: nothing)."""
    out_f, in_f = shape
    if not torch.isfinite(w).all():
        return "not finite"
    checks = {
        "layers.0.self_attn.q_proj.weight": lambda: w.abs().max() <= 0.03 and w.std() < 0.02,
        "layers.0.self_attn.k_proj.weight": lambda: (
            abs(w.mean() - 0.5) < 0.02 and abs(w.std() - 0.25) < 0.02
        ),
        "layers.0.self_attn.v_proj.weight": lambda: w.abs().max() <= 0.3 and w.std() > 0.15,
        "layers.0.self_attn.o_proj.weight": lambda: bool((w == 0).all()),
        "layers.0.mlp.gate_proj.weight": lambda: bool((w == 1).all()),
        "layers.0.mlp.up_proj.weight": lambda: (
            w.abs().max() <= math.sqrt(6 / (in_f + out_f))
            and w.std() > 0.5 * math.sqrt(2 / (in_f + out_f))
        ),
        "layers.0.mlp.down_proj.weight": lambda: abs(w.std() / math.sqrt(2 / in_f) - 1) < 0.05,
        "layers.1.self_attn.q_proj.weight": lambda: (
            abs(w.std() / math.sqrt(2 / (in_f + out_f)) - 1) < 0.05
        ),
        "layers.1.self_attn.k_proj.weight": lambda: bool((w == 0.125).all()),
        "layers.1.self_attn.v_proj.weight": lambda: (
            torch.equal(w, torch.eye(out_f, in_f)) if whole else bool((w == 0).all())
        ),
        "layers.1.mlp.up_proj.weight": lambda: (
            torch.allclose(w.T @ w, torch.eye(in_f), atol=1e-4) if whole else bool((w == 0).all())
        ),
        "layers.1.mlp.gate_proj.weight": lambda: w.abs().max() <= 2 and w.std() < 0.03,
    }
    default = lambda: w.abs().max() <= 1 / math.sqrt(in_f)  # noqa: E731 - kaiming_uniform_(a=√5)
    return None if bool(checks.get(name, default)()) else f"wrong values (std {w.std():.4g})"


def build(rank, world, layout: str, stages: list):
    """The model on the meta device, in torchtitan's order; appends (stage, live bytes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    with torch.device("meta"):
        model = models.TinyLlama(**DIMS)
    shapes = {n: (tuple(p.shape), p.element_size()) for n, p in model.named_parameters()}
    stages.append(("meta model", live_tensor_bytes()))
    if layout == "1d":
        mesh = fsdp_mesh = init_device_mesh("cpu", (world,))
        owners = dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
        coords = {"dp": rank, "dp_size": world, "tp_size": 1, "fsdp_size": world}
    elif layout == "hsdp":
        fsdp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        owners = dmuon.dedicate_params(
            model,
            fsdp_mesh["shard"],
            predicate=models.proj_predicate,
            replicate_mesh=fsdp_mesh["replicate"],
        )
        shard = fsdp_mesh["shard"]
        coords = {"shard": shard.get_local_rank(), "shard_size": shard.size(), "tp_size": 1}
        coords["fsdp_size"] = shard.size()
    else:  # "tp": dp 2 × tp 2
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan())
        fsdp_mesh = mesh["dp"]
        owners = dmuon.dedicate_params(model, fsdp_mesh, predicate=models.proj_predicate)
        coords = {"dp": fsdp_mesh.get_local_rank(), "dp_size": 2, "tp_size": mesh["tp"].size()}
        coords["fsdp_size"] = 2
    stages.append(("dedicate_params", live_tensor_bytes()))
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    stages.append(("fully_shard", live_tensor_bytes()))
    model.to_empty(device="cpu")
    stages.append(("to_empty", live_tensor_bytes()))
    held, shards = _share(shapes, owners, layout, coords)
    whole = sum(math.prod(s) * e for s, e in shapes.values())
    return model, {"held": held, "shards": shards, "whole": whole}


# ------------------------------------------------------------------------------ one rank


def meta_run(rank, world, layout: str):

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    full = models.build_llama(seed=0, **DIMS).state_dict()  # the checkpoint to start from
    batches = models.batches(STEPS, 2 if layout == "tp" else world, dim=DIMS["dim"])
    base = live_tensor_bytes()
    stages: list = []
    model, share = build(rank, world, layout, stages)
    runtime = dedicated_runtime(model)

    torch.manual_seed(0)  # the same seed on every rank (DTensor's random ops need it too)
    whole = layout != "tp"
    out = {"share": share, "init_errors": {}, "init": {}}
    out["whole_matrix_errors"] = init_weights(model, whole_matrices=whole)
    stages.append(("init_weights", live_tensor_bytes()))
    for dp in runtime.params:
        local = dp.param.to_local()
        if not dp.owns:
            if local.numel():
                out["init_errors"][dp.fqn] = "a rank that does not hold it got values"
            continue
        if tuple(local.shape) != tuple(dp.shape):  # the whole weight, or this rank's TP shard
            out["init_errors"][dp.fqn] = f"local tensor reshaped to {tuple(local.shape)}"
            continue
        problem = _check_init(dp.fqn, local.detach(), tuple(dp.param.shape), whole)
        if problem:
            out["init_errors"][dp.fqn] = problem
        if whole:
            out["init"][dp.fqn] = local.detach().numpy().copy()  # numpy: outside the measure
    if layout == "hsdp":  # the other replicas' copies: stale until the first forward publishes
        out["replicas_before"] = _replica_gap(runtime)
        with torch.no_grad():
            model(batches[0][:1])
        out["replicas_after"] = _replica_gap(runtime)

    dmuon.set_model_state_dict(model, full)
    stages.append(("set_model_state_dict", live_tensor_bytes()))
    out["stages"] = [(name, n - base) for name, n in stages]

    opt = dmuon.Muon(model, ns_backend=_ns(), compile=False, **HYPER)
    dp_rank = rank // 2 if layout == "tp" else rank
    dp_size = 2 if layout == "tp" else world
    # TP ranks hold the same loss: the mean over all ranks is the DP mean
    out["losses"] = train_steps(model, opt, batches, dp_rank, dp_size)
    state = dmuon.get_model_state_dict(model)  # collective; rank 0 gets it
    out["state"] = state if rank == 0 else {}

    # Control: the same measure on this rank holding the whole model (materialised).
    del opt, model, runtime
    whole_model = models.TinyLlama(**DIMS)
    out["materialised"] = live_tensor_bytes() - base
    del whole_model
    return out


def _replica_gap(runtime) -> float:
    """Largest difference between an HSDP column copy and its global owner's weight (every rank
    takes part: ``full_tensor`` broadcasts from the global owner)."""
    gap = 0.0
    for dp in runtime.params:
        whole = dp.param.full_tensor()
        if dp.replica is not None:
            gap = max(gap, (dp.replica - whole).abs().max().nan_to_num(float("inf")).item())
    return gap


# ------------------------------------------------------------------------------ one process


@functools.cache
def reference(global_batch_ranks: int):
    """One process from the same weights, the global batch: (losses, final weights)."""
    import dmuon_compile as dmuon

    model = models.build_llama(seed=0, **DIMS)
    opt = dmuon.Muon(
        model, predicate=models.proj_predicate, ns_backend=_ns(), compile=False, **HYPER
    )
    losses = train_steps(model, opt, models.batches(STEPS, global_batch_ranks, dim=DIMS["dim"]))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


_RUNS: dict[str, list] = {}


def run_layout(layout: str) -> list:
    """``meta_run`` on every rank of ``layout`` (once per session: two tests read the runs)."""
    if layout not in _RUNS:
        _RUNS[layout] = run_ranks(meta_run, 2 if layout == "1d" else 4, layout, timeout=360)
    return _RUNS[layout]


def _check_memory(results, min_ratio: float):
    for rank, res in enumerate(results):
        share = res["share"]
        budget = share["held"] + share["shards"] + SLACK
        for stage, used in res["stages"]:
            assert used <= budget, (rank, stage, used, share)
        assert share["whole"] >= min_ratio * share["held"], (rank, share)
        # control: a rank that materialises the whole model fails the same bound
        assert res["materialised"] > budget and res["materialised"] >= share["whole"], (rank, res)


def _check_training(results, ref_losses, ref_state):
    for rank, res in enumerate(results):
        for step, (a, b) in enumerate(zip(res["losses"], ref_losses, strict=True)):
            assert abs(a - b) <= REL * abs(b), (rank, step, a, b)
    state = results[0]["state"]
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=WEIGHT_ATOL, rtol=0)


def _initialised(results) -> dict:
    """``{name: value}`` of every dedicated weight after ``init_weights``, from its owner."""
    for rank, res in enumerate(results):
        assert not res["init_errors"], (rank, res["init_errors"])
    merged = {n: torch.as_tensor(w) for res in results for n, w in res["init"].items()}
    assert len(merged) == 7 * DIMS["layers"]  # every dedicated weight, checked on its owner
    return merged


def test_meta_1d_two_ranks():
    results = run_layout("1d")
    _check_memory(results, min_ratio=1.9)
    _initialised(results)
    _check_training(results, *reference(2))


def test_meta_hsdp_2x2():
    results = run_layout("hsdp")
    _check_memory(results, min_ratio=1.9)
    _initialised(results)
    # before the first forward the other replicas' copies are not the owners' values; after it
    # they are, exactly
    assert max(r["replicas_before"] for r in results) > 0.01
    assert max(r["replicas_after"] for r in results) == 0.0
    _check_training(results, *reference(4))


def test_meta_dp2_tp2():
    results = run_layout("tp")
    _check_memory(results, min_ratio=4.0)
    for rank, res in enumerate(results):
        assert not res["init_errors"], (rank, res["init_errors"])
        # eye_ and orthogonal_ need the whole matrix: every rank raised, naming the fix
        assert len(res["whole_matrix_errors"]) == 2, (rank, res["whole_matrix_errors"])
        assert all("set_model_state_dict" in e for e in res["whole_matrix_errors"])
    _check_training(results, *reference(2))


def test_init_values_do_not_depend_on_the_layout():
    """A dedicated weight's random init depends on the seed and its name, not on who owns it:
    the 1-D run (2 owners) and the HSDP run (4 owners) initialise every weight identically."""
    one_d, hsdp = _initialised(run_layout("1d")), _initialised(run_layout("hsdp"))
    assert set(one_d) == set(hsdp)
    for name, w in one_d.items():
        assert torch.equal(w, hsdp[name]), name


def _cuda_meta_init(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    mesh = init_device_mesh("cuda", (world,))
    with torch.device("meta"):
        model = models.TinyLlama(**DIMS)
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    init_weights(model)  # on CUDA DTensor's random path would first broadcast on the owner only
    errors = {}
    for dp in dedicated_runtime(model).params:
        if dp.owns:
            local = dp.param.to_local().detach().cpu()
            problem = _check_init(dp.fqn, local, tuple(dp.param.shape), True)
            if problem:
                errors[dp.fqn] = problem
    x = models.batches(1, world, dim=DIMS["dim"])[0][rank : rank + 1].cuda()
    return {"errors": errors, "finite": bool(torch.isfinite(model(x)).all())}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_meta_init_on_cuda():
    """The same construction and ``init_weights`` on CUDA + NCCL (1 or 2 GPUs): no rank waits
    in an RNG-state broadcast, the owners' values are right, the forward is finite."""
    world = min(2, torch.cuda.device_count())
    for rank, res in enumerate(run_ranks(_cuda_meta_init, world, backend="nccl", timeout=240)):
        assert not res["errors"] and res["finite"], (rank, res)
