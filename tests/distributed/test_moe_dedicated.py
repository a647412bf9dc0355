"""Expert stacks under dedicate_params + FSDP2 (1-D and HSDP) train equal to one process with
per-expert Newton–Schulz, including a rank whose tokens reach only some experts.

The control: the same single-process run with each stack orthogonalised as one flattened
``(E, hidden·dim)`` matrix (what a ≥3-D weight got before layouts) ends far from the
distributed run, so the comparison can tell per-expert from flattened updates.
Everything in fp32 (NewtonSchulz(work_dtype=float32)); tolerances as in
test_dedicated_training.py (only reduction orders differ).
"""

from __future__ import annotations

import pytest
import torch

from . import moe_models
from .harness import full_state, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 5
HYPER = {"lr": 0.02, "momentum": 0.95, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def _loss(model, x):
    # Depends on the output (not only on its normalisation): a wrong update changes it.
    return (model(x) - 0.5).square().mean()


def reference(world: int, flattened: bool = False, device: str = "cpu"):
    import dmuon_compile as dmuon

    model = moe_models.build_moe().to(device)
    predicate = None
    if flattened:  # the control: each expert stack as one (E, hidden·dim) matrix

        def predicate(name, p):
            if p.ndim == 3:
                return dmuon.Layout.conv()
            return dmuon.default_muon_predicate(name, p)

    opt = dmuon.Muon(model, ns_backend=_ns(), predicate=predicate, **HYPER)
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses = train_steps(model, opt, batches, device=device, loss_fn=_loss)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _muon_layouts(opt) -> dict:
    """``{name: layout kind}`` of the optimizer's Muon parameters."""
    return {
        opt.param_name(p): opt._layout(p).kind
        for g in opt.param_groups
        if g["use_muon"]
        for p in g["params"]
    }


def _select_experts_too(name, p):
    import dmuon_compile as dmuon

    return p.ndim == 3 or dmuon.default_muon_predicate(name, p)


def train(
    rank: int,
    world: int,
    replicas: int,
    dedicate_experts: bool,
    device: str = "cpu",
    compile: bool = False,
    expert_ns: str = "per_replica",
    expert_shard_dim: int = 0,
):
    """``replicas`` > 1: HSDP ``replicas × (world / replicas)``; ``compile``: the compiled
    step (``device="cuda"``: ranks sharing the one GPU over gloo); ``expert_ns``: Muon's;
    ``expert_shard_dim``: FSDP2's shard dim of the expert stacks. Also returns how many expert
    matrices this rank orthogonalised over the run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import dmuon_compile as dmuon
    from dmuon_compile import functional as F

    from .harness import local_device

    experts_done = []
    original = F.orthogonalize

    def counting(updates, *args, layouts=None, **kwargs):
        for u, lay in zip(updates, F.layouts_of(updates, layouts)):
            if lay.kind == "experts":
                experts_done.append(lay.count(u.shape))
        return original(updates, *args, layouts=layouts, **kwargs)

    F.orthogonalize = counting

    dev = local_device(device)
    model = moe_models.build_moe().to(dev)
    predicate = _select_experts_too if dedicate_experts else None
    if replicas > 1:
        shape = (replicas, world // replicas)
        mesh2 = init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))
        owners = dmuon.dedicate_params(
            model, mesh2["shard"], predicate=predicate, replicate_mesh=mesh2["replicate"]
        )
        mesh = mesh2
    else:
        mesh = init_device_mesh(device, (world,))
        owners = dmuon.dedicate_params(model, mesh, predicate=predicate)
    for block in model.layers:
        placement = Shard(expert_shard_dim)
        fully_shard(block.experts, mesh=mesh, shard_placement_fn=lambda _: placement)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), **{**HYPER, "compile": compile}, expert_ns=expert_ns)
    layouts = _muon_layouts(opt)
    per_rank = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses, reached = [], []
    for x in per_rank:
        reached.append(
            sorted(moe_models.experts_reached(moe_models.build_moe(), x.chunk(world)[rank]))
        )
        losses.append(_step(model, opt, x.to(dev), rank, world))
    state = {k: v.cpu() for k, v in full_state(model).items()}
    compiled = len(opt.compiled_steps)
    return losses, state, owners, layouts, reached[0], compiled, sum(experts_done)


@pytest.mark.parametrize(
    "world, replicas, dedicate_experts",
    [(2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True), (4, 2, False)],
    ids=["fsdp2-sharded", "fsdp2-dedicated", "hsdp2x1-sharded", "hsdp2x1-dedicated", "hsdp2x2"],
)
def test_expert_stacks_train_equal_to_one_process(world, replicas, dedicate_experts):
    """Expert stacks either left to FSDP2 (the default: ``Shard(0)``, each rank's whole experts
    orthogonalised where they live) or dedicated whole (a predicate selecting them)."""
    check_expert_stacks(world, replicas, dedicate_experts)


def check_expert_stacks(world, replicas, dedicate_experts, device="cpu", compile=False):
    ref_losses, ref_state = reference(world, device=device)
    results = run_ranks(
        train, world, replicas, dedicate_experts, device, compile, device=device, timeout=200
    )
    losses, state, owners, layouts, _, compiled, _ = results[0]
    assert compiled == (1 if compile else 0)
    assert layouts["layers.0.experts.w1"] == "experts"
    assert ("layers.0.experts.w1" in owners) == dedicate_experts
    assert "layers.0.proj.weight" in owners  # the dense matrices are dedicated either way
    assert "layers.0.router.weight" not in layouts  # the router gets AdamW
    # The last rank's tokens reach only experts 0 and 1 of the first layer.
    assert results[world - 1][4] == [0, 1]
    tol = 2e-4 if device == "cpu" else 1e-3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=tol, rtol=0, msg=name)
    # Control: the flattened form moves the expert weights elsewhere.
    _, flat_state = reference(world, flattened=True)
    gap = (flat_state["layers.0.experts.w1"] - state["layers.0.experts.w1"]).abs().max()
    assert gap > 1e-2, gap


@pytest.mark.parametrize("expert_shard_dim", [0, 1], ids=["shard0", "shard1"])
def test_hsdp_expert_stacks_orthogonalised_once_per_job(expert_shard_dim):
    """HSDP 2 × 2 with ``expert_ns="once"``: the replicas split each stack's experts (after the
    in-expert all-to-all with ``Shard(1)``) and all-gather the results: the training equals one
    process's, and the job orthogonalises each expert once per step — the control,
    ``"per_replica"``, twice (once per replica)."""
    check_expert_once(expert_shard_dim)


def check_expert_once(expert_shard_dim: int, device: str = "cpu") -> None:
    world, replicas = 4, 2
    ref_losses, ref_state = reference(world, device=device)
    runs = {
        mode: run_ranks(
            train,
            world,
            replicas,
            False,
            device,
            False,
            mode,
            expert_shard_dim,
            device=device,
            timeout=200,
        )
        for mode in ("once", "per_replica")
    }
    per_step = 2 * 3 * moe_models.EXPERTS  # 2 layers × w1, w2, w3 of 4 experts
    done = {mode: sum(r[-1] for r in results) for mode, results in runs.items()}
    assert done == {"once": STEPS * per_step, "per_replica": replicas * STEPS * per_step}
    losses, state = runs["once"][0][:2]
    tol = 2e-4 if device == "cpu" else 1e-3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=tol, rtol=0, msg=name)


def train_ep(
    rank: int,
    world: int,
    ep: int,
    expert_shard_dim: int = 0,
    device: str = "cpu",
    user_compiled: bool = False,
):
    """Dense matrices dedicated over all ranks, expert stacks ``Shard(0)`` over ``ep`` and
    FSDP2 ``Shard(expert_shard_dim)`` over the expert-data-parallel mesh (size
    ``world // ep``): with 0 each rank holds whole experts and orthogonalises only those; with
    1 (torchtitan's choice when efsdp · ep exceeds the experts) the step redistributes the
    stacks' Nesterov inputs to whole experts for Newton–Schulz. ``user_compiled``: the user's
    ``opt.step = torch.compile(opt.step)`` (Dynamo's eager backend: what is traced, and what
    stays eager, is the point, not Inductor's code)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._stages import expert_shards as es

    from .harness import local_device, whole_tensor

    all_to_alls = []  # the direct reshard's collectives (Shard(1)); none for whole experts
    original = es._all_to_all
    es._all_to_all = lambda *a: (all_to_alls.append(1), original(*a))
    dev = local_device(device)
    model = moe_models.build_moe().to(dev)
    dp = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    experts_mesh = init_device_mesh(device, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    moe_models.make_expert_parallel(model, experts_mesh["ep"])
    owners = dmuon.dedicate_params(model, dp)
    for block in model.layers:
        placement = Shard(expert_shard_dim)
        fully_shard(
            block.experts, mesh=experts_mesh["efsdp"], shard_placement_fn=lambda _: placement
        )
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    if user_compiled:
        opt.step = torch.compile(opt.step, backend="eager")
    w1 = model.layers[0].experts.w1
    local_experts = w1.to_local().shape[0]
    layouts = _muon_layouts(opt)
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses = [_step(model, opt, x.to(dev), rank, world) for x in batches]
    state = {}
    for name, p in model.named_parameters():
        state[name] = whole_tensor(p).cpu() if "experts" in name else None
    state.update({k: v.cpu() for k, v in full_state(model).items() if "experts" not in k})
    return losses, state, owners, layouts, local_experts, str(w1.placements), len(all_to_alls)


@pytest.mark.parametrize(
    "world, ep, shard_dim",
    [(2, 2, 0), (4, 2, 0), (2, 1, 1), (4, 2, 1)],
    ids=["ep2", "ep2xefsdp2", "fsdp2-shard1", "ep2xefsdp2-shard1"],
)
def test_expert_parallel_trains_equal_to_one_process(world, ep, shard_dim):
    check_expert_parallel(world, ep, shard_dim)


def test_expert_reshard_under_the_users_compiled_step():
    """``opt.step = torch.compile(opt.step)`` with stacks sharded inside their experts: the
    reshard's collectives stay eager, the training equals one process's."""
    check_expert_parallel(2, 1, 1, user_compiled=True)


def check_expert_parallel(world, ep, shard_dim, device="cpu", user_compiled=False):
    ref_losses, ref_state = reference(world, device=device)
    results = run_ranks(
        train_ep, world, ep, shard_dim, device, user_compiled, device=device, timeout=200
    )
    losses, state, owners, layouts, local_experts, placements, all_to_alls = results[0]
    # Shard(1): the 3 stacks × 2 layers in one batch over the in-expert mesh dim: 2
    # all-to-alls per step (one per stack and direction before the batching: 12)
    assert all_to_alls == (0 if shard_dim == 0 else 2 * STEPS), placements
    # Whole experts split over all ranks, or (Shard(1)) every local expert's slice.
    expected = moe_models.EXPERTS // world if shard_dim == 0 else moe_models.EXPERTS // ep
    assert local_experts == expected, placements
    assert layouts["layers.0.experts.w1"] == "experts"
    assert "layers.0.experts.w1" not in owners and "layers.0.proj.weight" in owners
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    tol = 2e-4 if device == "cpu" else 1e-3
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=tol, rtol=0, msg=name)


def _build_ep(world: int, ep: int):
    """The MoE model with dedicated dense matrices, expert stacks ``Shard(0)`` over ``ep`` and
    FSDP2 over the rest of the ranks, and its Muon (``ep`` 1: plain FSDP2 experts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    model = moe_models.build_moe()
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if ep > 1:
        experts_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        moe_models.make_expert_parallel(model, experts_mesh["ep"])
    dmuon.dedicate_params(model, dp)
    for block in model.layers:
        if ep > 1:
            fully_shard(block.experts, mesh=experts_mesh["efsdp"])
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dmuon.Muon(model, ns_backend=_ns(), **HYPER)


def _step(model, opt, x, rank, world):
    """One step on this rank's slice of the global batch ``x``; the loss averaged over ranks."""
    (loss,) = train_steps(model, opt, [x], rank, world, loss_fn=_loss)
    return loss


def save_then_step(rank: int, world: int, ep: int, folder: str):
    """Two steps, a DCP save, then the third step (what a resume must repeat)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _build_ep(world, ep)
    batches = moe_models.expert_batches(moe_models.build_moe(), 3, 4)
    for x in batches[:2]:
        _step(model, opt, x, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    return _step(model, opt, batches[2], rank, world)


def load_then_step(rank: int, world: int, ep: int, folder: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build_ep(world, ep)
    batches = moe_models.expert_batches(moe_models.build_moe(), 3, 4)
    # The momentum buffers exist once a step ran: DCP loads into existing state.
    _step(model, opt, torch.zeros_like(batches[0]), rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _step(model, opt, batches[2], rank, world)


def test_dcp_saved_at_ep2_resumes_at_ep1_and_at_ep2_on_4_ranks(tmp_path):
    """The expert stacks' weights and per-expert momentum reshard through torch's DCP: a
    checkpoint of EP 2 on 2 ranks resumes on 2 ranks without EP and on 4 ranks (EP 2 × expert
    FSDP 2), and the next step's loss is the uninterrupted run's."""
    folder = str(tmp_path / "ckpt")
    after = run_ranks(save_then_step, 2, 2, folder, timeout=120)[0]
    for world, ep in ((2, 1), (4, 2)):
        resumed = run_ranks(load_then_step, world, ep, folder, timeout=140)[0]
        assert resumed == pytest.approx(after, rel=1e-5), (world, ep)
    # Control: without the load, the step differs (the checkpoint carried the state).
    fresh = run_ranks(_fresh_third_step, 2, timeout=120)[0]
    assert fresh != pytest.approx(after, rel=1e-3)


def _fresh_third_step(rank: int, world: int):
    model, opt = _build_ep(world, 1)
    batches = moe_models.expert_batches(moe_models.build_moe(), 3, 4)
    return _step(model, opt, batches[2], rank, world)
