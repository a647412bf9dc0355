"""``Muon(offload="state")``: the owners' masters in host memory between steps, on real ranks.

- 2 gloo ranks, bf16 compute (dmuon's ``ParamPolicy`` and FSDP2's ``MixedPrecisionPolicy``):
  training with the masters offloaded gives the losses and weights of training with them on the
  device, bit for bit, and with the momentum offloaded alone too; between steps each owner's
  registered weight holds its master in host memory (the same object, its values current) and
  the compute copy is the master's bf16 cast.
- An in-place write to a master between steps (on every rank, as the user runs the same code)
  reaches the next forward; a checkpoint (``state_dict``) of offloaded masters loads into a
  model without offload and trains on to the same bits; the setting switches on a live
  optimizer both ways.
- HSDP (2 replicas of one shard, and of two shards on 4 ranks): the global owners' masters
  offloaded, bit for bit as well; so are expert stacks dedicated whole (3-D masters), TP 2 (each
  member's shards, the scattered updates applied at the commit), 2 replicas of TP 2 and split
  Newton-Schulz on 4 ranks.
- Where it cannot hold the masters so, ``Muon`` raises naming the fix (no dedicated weights,
  fp32 compute, ``qk_clip``).

Controls: a forward that kept the stale compute copy after a step (its refresh skipped) ends
elsewhere; training with another learning rate ends elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

from . import models, moe_models
from .harness import full_state, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 4
HYPER = {"lr": 0.02, "momentum": 0.9, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}


def _build_moe(world: int):
    """The tiny MoE with its expert stacks dedicated whole (one owner each), bf16 compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon_compile as dmuon

    model = moe_models.build_moe()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(
        model,
        mesh,
        predicate=lambda n, p: p.ndim == 3 or dmuon.default_muon_predicate(n, p),
        param_policy=dmuon.ParamPolicy(
            defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ),
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train_moe(rank, world, settings):
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    model = _build_moe(world)
    opt = dmuon.Muon(model, **{**HYPER, **settings})
    stacks = [dp for dp in dedicated_runtime(model).params if len(dp.shape) == 3]
    batches = moe_models.expert_batches(moe_models.build_moe(), STEPS, world)
    losses = train_steps(model, opt, batches, rank, world, loss_fn=_loss)
    state = {k: v.detach().cpu().float() for k, v in full_state(model).items()}
    offloaded = [dp.host_master is not None for dp in stacks if dp.owns]
    return {"losses": losses, "state": state, "stacks": len(stacks), "offloaded": offloaded}


def test_offloaded_expert_stacks_train_bit_for_bit_like_on_the_device():
    """Expert stacks dedicated whole (3-D masters, NS per expert) offloaded with the rest."""
    on = run_ranks(_train_moe, 2, {})
    off = run_ranks(_train_moe, 2, {"offload": "state"})
    assert on[0]["stacks"] == 6 and all(off[0]["offloaded"] + off[1]["offloaded"])
    assert off[0]["offloaded"] or off[1]["offloaded"]
    for a, b in zip(on, off):
        _assert_same(a, b)


def _build(world: int, bf16: bool = True, device: str = "cpu", hsdp: int = 0, split: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon_compile as dmuon

    from .harness import local_device

    # split: FFN matrices of 1024 rows, each more Newton-Schulz than a rank's share, split over
    # pairs of ranks (the test of split NS's shape)
    kw: dict = {}
    model = models.build_llama(**({"layers": 1, "ffn": 1024} if split else {}))
    model = model.to(local_device(device))
    if split:
        kw["split_size"] = 2
    if hsdp:  # ``hsdp`` replicas of world // hsdp shards: one global owner per matrix in the job
        mesh = init_device_mesh(
            device, (hsdp, world // hsdp), mesh_dim_names=("replicate", "shard")
        )
        kw["replicate_mesh"], shard = mesh["replicate"], mesh["shard"]
    else:
        mesh = init_device_mesh(device, (world,))
        shard = mesh
    mp = {}
    if bf16:
        kw["param_policy"] = dmuon.ParamPolicy(
            defaults=dmuon.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
        mp["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    dmuon.dedicate_params(model, shard, predicate=models.proj_predicate, **kw)
    for block in model.layers:
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model


def _loss(model, x):
    return model(x).float().square().mean()


def _train(
    rank, world, settings, stale=False, switch=None, device="cpu", hsdp=0, tp=False, split=False
):
    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._owner import host_masters

    from .harness import local_device

    dp_rank, dp = rank, world
    if tp:  # TP 2: each matrix's shards on its owner's TP group (hsdp: 2 replicas of 1 shard)
        from .test_tp import build_tp

        dp = world // 2
        model, dp_rank = build_tp(rank, world, dp, 2, replicas=hsdp or 1, device=device, bf16=True)
    else:
        model = _build(world, device=device, hsdp=hsdp, split=split)
    settings = {**HYPER, **settings}
    traced = settings.pop("user_compile", False)
    opt = dmuon.Muon(model, **settings)
    if traced:  # the user's torch.compile(opt.step) traces the step (Dynamo, no Inductor)
        opt.step = torch.compile(opt.step, backend="aot_eager")
    runtime = dedicated_runtime(model)
    seen = {}

    def between(i):
        owned = [dp for dp in runtime.params if dp.owns]
        seen.setdefault("host", []).append(
            bool(owned)
            and all(
                dp.host_master is not None
                and dp.param.to_local().data_ptr() == dp.host_master.data_ptr()
                for dp in owned
            )
        )
        if owned and owned[0].compute_copy is not None:
            dp = owned[0]  # the compute copy is the master's cast, the registered value current
            host = dp.param.to_local()
            seen.setdefault("cast", []).append(
                torch.equal(dp.compute_copy.cpu(), host.to(torch.bfloat16).cpu())
                and host.device.type == "cpu"
                and (device == "cpu" or host.is_pinned())
            )
        if hsdp and owned and owned[0].compute_copy is not None:  # one buffer, not two
            columns = {
                id(p): view
                for g in runtime.groups
                if g.replicate is not None
                for p, view in g.replicate.copy_in
            }
            seen.setdefault("column", []).append(
                all(dp.compute_copy is columns.get(id(dp)) for dp in owned)
            )
        if switch is not None and i == 1:
            opt.offload = None if switch == "none" else switch

    real_bring_in = host_masters.HostMasters._bring_in
    copies = []  # masters brought in by the commit, per shape bucket (none: all at the start)

    def bring_in(self, tensors, idx, side, slot):
        works, event = real_bring_in(self, tensors, idx, side, slot)
        copies.append(sum(w is not None for w in works))
        return works, event

    host_masters.HostMasters._bring_in = bring_in
    real = host_masters.HostMasters._cast
    if stale:  # the control: the new masters reach the host but not the compute copies
        host_masters.HostMasters._cast = staticmethod(lambda dp, work: None)
    try:
        losses = train_steps(
            model,
            opt,
            models.batches(STEPS, dp),
            dp_rank,
            dp,
            device=local_device(device),
            loss_fn=_loss,
            between=between,
        )
    finally:
        host_masters.HostMasters._cast = staticmethod(real)
        host_masters.HostMasters._bring_in = real_bring_in
    state = {k: v.detach().cpu().float() for k, v in full_state(model).items()}  # replicas: bf16
    owned = sum(dp.owns for dp in runtime.params)
    out = {"losses": losses, "state": state, "seen": seen, "copies": copies, "owned": owned}
    return {**out, "split": len(runtime.split or ())}


def _assert_same(a, b) -> None:
    assert a["losses"] == b["losses"]
    for name, ref in a["state"].items():
        torch.testing.assert_close(b["state"][name], ref, rtol=0, atol=0, msg=name)


def _differs(a, b) -> bool:
    return any(not torch.equal(b["state"][k], v) for k, v in a["state"].items())


@pytest.mark.parametrize("hsdp, world", [(0, 2), (2, 2), (2, 4)], ids=["1d", "hsdp2x1", "hsdp2x2"])
def test_offloaded_masters_train_bit_for_bit_like_masters_on_the_device(hsdp, world):
    check_offloaded_masters_equal_on_device("cpu", hsdp, world)


def check_offloaded_masters_equal_on_device(device: str, hsdp: int = 0, world: int = 2) -> None:
    """``world`` ranks on ``device`` (``"cuda"``: all on the one GPU, the copies on side
    streams); ``hsdp``: that many replicas of ``world // hsdp`` shards (the global owners'
    masters offloaded, the publish from the master on the GPU inside the step and from the
    compute copy after it; with 2 shards the owners of a column differ per matrix)."""
    settings_list = ({}, {"offload": "state"}) + (({"offload": "momentum"},) if world == 2 else ())
    on, off, *momentum_only = (
        run_ranks(_train, world, settings, False, None, device, hsdp, device=device)
        for settings in settings_list
    )
    for a, b in zip(on, off):
        _assert_same(a, b)
        assert b["seen"]["host"] == [True] * STEPS and b["seen"]["cast"] == [True] * STEPS
        assert a["seen"]["host"] == [False] * STEPS
        # streamed momentum: the commit brings the masters in bucket by bucket, each once a step
        assert sum(b["copies"]) == STEPS * b["owned"] and len(b["copies"]) > STEPS
        if hsdp and b["owned"]:  # the global owner's compute copy is its column buffer
            assert b["seen"]["column"] == [True] * STEPS
    for run in momentum_only:
        for a, c in zip(on, run):
            _assert_same(a, c)
    if hsdp and world > 2:  # all at once: the early publish casts into the compute copy
        whole = {"offload": "state", "momentum_in_flight": None}
        for a, c in zip(
            on, run_ranks(_train, world, whole, False, None, device, hsdp, device=device)
        ):
            _assert_same(a, c)
            assert c["copies"] == []
            assert not c["owned"] or c["seen"]["column"] == [True] * STEPS
    # Controls: stale compute copies (the forward never sees the new masters), another lr.
    stale = run_ranks(_train, world, {"offload": "state"}, True, None, device, hsdp, device=device)
    assert stale[0]["losses"][1:] != on[0]["losses"][1:] and _differs(on[0], stale[0])
    if device == "cpu" and not hsdp:
        other = run_ranks(_train, 2, {"offload": "state", "lr": 0.01})
        assert _differs(on[0], other[0])
        # under the user's torch.compile(opt.step) too (against the same traced on the device)
        traced_on, traced_off = (
            run_ranks(_train, 2, {**settings, "user_compile": True})
            for settings in ({}, {"offload": "state"})
        )
        for a, b in zip(traced_on, traced_off):
            _assert_same(a, b)
            assert b["copies"] == []  # traced: all at once, when the step starts


@pytest.mark.parametrize("hsdp", [0, 2], ids=["tp2", "hsdp2x1_tp2"])
def test_offloaded_tp_masters_train_bit_for_bit_like_masters_on_the_device(hsdp):
    check_offloaded_tp_masters_equal_on_device("cpu", hsdp)


def check_offloaded_tp_masters_equal_on_device(device: str, hsdp: int = 0) -> None:
    """TP 2: each rank's shards of the TP matrices offloaded (the TP owner gathers the inputs,
    scatters the update, which each member applies to its master on the GPU at the commit,
    not in the next forward), bit for bit like the masters on the device; ``hsdp``: 2 replicas
    of that (4 ranks; the global owners' column buffers are their compute copies). Control: a
    stale compute copy ends elsewhere."""
    world = 4 if hsdp else 2
    args = (False, None, device, hsdp, True)
    on, off = (
        run_ranks(_train, world, settings, *args, device=device)
        for settings in ({}, {"offload": "state"})
    )
    for a, b in zip(on, off):
        _assert_same(a, b)
        assert b["seen"]["host"] == [b["owned"] > 0] * STEPS
        assert b["copies"] == []  # a stage takes the matrices: all at once, at the start
        if hsdp and b["owned"]:
            assert b["seen"]["column"] == [True] * STEPS
    assert any(b["owned"] for b in off)
    stale_args = (True, None, device, hsdp, True)
    stale = run_ranks(_train, world, {"offload": "state"}, *stale_args, device=device)
    assert stale[0]["losses"][1:] != on[0]["losses"][1:] and _differs(on[0], stale[0])


def test_offloaded_masters_of_split_newton_schulz_train_bit_for_bit_like_on_the_device():
    """Split Newton-Schulz on 4 ranks (each FFN matrix orthogonalised by a pair, its owner
    committing it like any other): offloaded masters bit for bit like on the device; control:
    a stale compute copy ends elsewhere."""
    args = (False, None, "cpu", 0, False, True)
    on, off = (run_ranks(_train, 4, settings, *args) for settings in ({}, {"offload": "state"}))
    assert on[0]["split"] > 0  # the planner split matrices: the split stage ran
    for a, b in zip(on, off):
        _assert_same(a, b)
        assert b["seen"]["host"] == [b["owned"] > 0] * STEPS
    stale = run_ranks(_train, 4, {"offload": "state"}, True, None, "cpu", 0, False, True)
    assert stale[0]["losses"][1:] != on[0]["losses"][1:] and _differs(on[0], stale[0])


def test_offload_switches_on_a_live_optimizer_both_ways():
    on = run_ranks(_train, 2, {})
    to_host = run_ranks(_train, 2, {}, False, "state")
    to_device = run_ranks(_train, 2, {"offload": "state"}, False, "none")
    for a, b, c in zip(on, to_host, to_device):
        _assert_same(a, b)
        _assert_same(a, c)
    assert to_host[0]["seen"]["host"] == [False, False, True, True]
    assert to_device[0]["seen"]["host"] == [True, True, False, False]


def _write_and_checkpoint(rank, world):
    """Train 2 steps with offloaded masters, scale a dedicated weight in place between steps
    (every rank), save ``state_dict()``s, then load them into a model without offload (and one
    with) and train both 2 more steps."""
    import dmuon_compile as dmuon

    batches = models.batches(STEPS, world)
    model = _build(world)
    opt = dmuon.Muon(model, offload="state", **HYPER)
    train_steps(model, opt, batches[:2], rank, world, loss_fn=_loss)
    weight = model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(0.5)  # between steps: on every rank (those without the master: a no-op)
    x = batches[2][rank * 2 : rank * 2 + 2]
    with torch.no_grad():
        after_write = _loss(model, x).item()
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_sd = opt.state_dict()
    owned = [dp for dp in dmuon.distributed.dedicated_runtime(model).params if dp.owns]
    out = {"after_write": after_write, "offloaded": all(dp.host_master is not None for dp in owned)}
    for offload in (None, "state"):
        resumed = _build(world)
        resumed.load_state_dict(model_sd)
        ropt = dmuon.Muon(resumed, **HYPER, **({"offload": offload} if offload else {}))
        ropt.load_state_dict(copy.deepcopy(opt_sd))  # the first resume steps its tensors
        with torch.no_grad():
            out[f"loaded_{offload}"] = _loss(resumed, x).item()
        losses = train_steps(resumed, ropt, batches[2:], rank, world, loss_fn=_loss)
        out[f"losses_{offload}"] = losses
        out[f"state_{offload}"] = {k: v.cpu() for k, v in full_state(resumed).items()}
    return out


def test_a_write_between_steps_and_a_checkpoint_reach_the_forward():
    r = run_ranks(_write_and_checkpoint, 2)
    for out in r:
        assert out["offloaded"]
        # the loaded models see the written weight, as the offloaded one did
        assert out["loaded_None"] == out["after_write"] == out["loaded_state"]
        assert out["losses_None"] == out["losses_state"]
        for name, ref in out["state_None"].items():
            torch.testing.assert_close(out["state_state"][name], ref, rtol=0, atol=0, msg=name)


def _refusals(rank, world):

    import dmuon_compile as dmuon

    errors = {}
    for case in ("plain", "fp32", "qk_clip"):
        if case == "plain":
            target = models.build_llama()
        elif case == "fp32":
            target = _build(world, bf16=False)
        else:
            target = _build(world)
        try:
            kw = {"qk_clip": 50.0} if case == "qk_clip" else {}
            dmuon.Muon(target, offload="state", compile=False, **kw)
            errors[case] = None
        except ValueError as exc:
            errors[case] = str(exc)
    # A second optimizer of the same model: with offload="state" it shares the host masters;
    # without, it would step masters in host memory, and is refused.
    model = _build(world)
    first = dmuon.Muon(model, offload="state", compile=False)
    second = dmuon.Muon(model, offload="state", compile=False)
    errors["shared"] = second._host_masters is first._host_masters
    try:
        dmuon.Muon(model, compile=False)
        errors["second"] = None
    except ValueError as exc:
        errors["second"] = str(exc)
    return errors


def test_offloaded_masters_are_refused_where_they_cannot_be_held_so():
    errors = run_ranks(_refusals, 2)[0]
    assert "dedicate_params" in errors["plain"] and "offload='momentum'" in errors["plain"]
    assert "param_dtype=torch.bfloat16" in errors["fp32"]
    assert "qk_clip" in errors["qk_clip"] and "offload='momentum'" in errors["qk_clip"]
    assert errors["shared"] is True
    assert "another optimizer was built with offload='state'" in errors["second"]


def _train_through_a_failure(rank, world, settings, fail_rank, where="ns"):
    """4 batches; on rank ``fail_rank`` at batch 1 (``where``) Newton–Schulz raises at the
    second shape bucket (a streamed step's first bucket done, its masters not yet committed),
    or ``"reserve"``: the GPU memory for the masters' commit runs out (``HostMasters.reserve``,
    after every bucket's NS); every rank catches the step's error and goes on. Returns the
    losses, the weights, the errors, and per step whether every owner's registered weight is
    its host master again with its compute copy the cast."""
    import dmuon_compile as dmuon
    from dmuon_compile import functional as F
    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._owner import host_masters

    model = _build(world)
    opt = dmuon.Muon(model, **{**HYPER, **settings})
    owned = [dp for dp in dedicated_runtime(model).params if dp.owns]
    step, calls, original = [0], [], F.orthogonalize
    reserve = host_masters.HostMasters.reserve

    def second_fails(*args, **kwargs):
        if where == "ns" and rank == fail_rank and step[0] == 1:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("simulated Newton-Schulz failure")
        return original(*args, **kwargs)

    def reserve_fails(self, jobs, in_flight):
        if where == "reserve" and rank == fail_rank and step[0] == 1:
            raise torch.OutOfMemoryError("simulated: out of memory for the masters' commit")
        return reserve(self, jobs, in_flight)

    F.orthogonalize = second_fails
    host_masters.HostMasters.reserve = reserve_fails
    losses, errors, held = [], [], []
    try:
        for i, x in enumerate(models.batches(STEPS, world)):
            step[0] = i
            loss = _loss(model, x[rank * 2 : rank * 2 + 2])
            loss.backward()
            try:
                opt.step()
                errors.append(None)
            except dmuon.MuonStepError as exc:
                errors.append("memory" if "masters' commit" in str(exc) else "ns")
            opt.zero_grad()
            losses.append(loss.item())
            held.append(
                all(
                    dp.param.to_local().data_ptr() == dp.host_master.data_ptr()
                    and torch.equal(dp.compute_copy, dp.host_master.to(torch.bfloat16))
                    for dp in owned
                )
                if settings.get("offload") == "state"
                else None
            )
    finally:
        F.orthogonalize = original
        host_masters.HostMasters.reserve = reserve
    state = {k: v.detach().cpu().float() for k, v in full_state(model).items()}
    return {"losses": losses, "state": state, "errors": errors, "held": held}


def test_an_offloaded_step_that_fails_on_one_rank_changes_no_master():
    """A step that fails on rank 1 after its first bucket, or whose commit finds no GPU memory
    for the masters on rank 1 (every rank raises ``MuonStepError`` naming it), leaves every
    master where and as it was: the run goes on bit for bit like the masters on the device
    through the same (Newton–Schulz) failure. Control: the same failure on no rank ends
    elsewhere (the failed step would have moved the weights)."""
    on = run_ranks(_train_through_a_failure, 2, {}, 1)
    off = run_ranks(_train_through_a_failure, 2, {"offload": "state"}, 1)
    # the commit's GPU memory runs out on rank 1: before the verdict, so the same
    short = run_ranks(_train_through_a_failure, 2, {"offload": "state"}, 1, "reserve")
    for a, b, c in zip(on, off, short):
        assert a["errors"] == b["errors"] == [None, "ns", None, None]
        assert c["errors"] == [None, "memory", None, None]
        assert b["held"] == c["held"] == [True] * STEPS
        _assert_same(a, b)
        _assert_same(a, c)
    unfailed = run_ranks(_train_through_a_failure, 2, {"offload": "state"}, -1)
    assert unfailed[0]["errors"] == [None] * STEPS and _differs(off[0], unfailed[0])


def test_offloaded_masters_with_normuon_train_bit_for_bit_like_on_the_device():
    """NorMuon's per-row second moments are written by the commit with the weights: bucket by
    bucket with the masters too. Control: NorMuon off ends elsewhere."""
    on = run_ranks(_train, 2, {"normuon": True})
    off = run_ranks(_train, 2, {"normuon": True, "offload": "state"})
    for a, b in zip(on, off):
        _assert_same(a, b)
        assert len(b["copies"]) > STEPS  # committed bucket by bucket
    plain = run_ranks(_train, 2, {"offload": "state"})
    assert _differs(off[0], plain[0])
