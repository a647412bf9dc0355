"""NorMuon (``Muon(normuon=True)``) under tensor parallelism and split Newton–Schulz: the TP stage
normalises each matrix where it is whole (``_stages/tp/stage.py``, ``_stages/tp/moments.py``), the
split owner its gathered result (``_stages/split_step.py``), and both train equal to one process.

- dp 1 × tp 2, every TP matrix whole (q/k/v/gate/up column-parallel: ``v``'s rows gathered to
  the TP owner and scattered back; o/down row-parallel: ``v`` replicated, ``v′`` broadcast);
  then, in the same processes, per-head layouts (``test_tp_local_heads``'s): q/k/v and o hold
  whole heads and normalise them where they are (no gather: the recorded gathers name only the
  MLP), gate (heads along the input dim, rows cut), up (a part straddling the shards) and down
  through the TP owner.
- dp 2 × tp 2 with only the MLP TP-sharded: the attention matrices are plain dedicated weights
  of a TP model, stepped by TP rank 0 and broadcast with their momentum and ``v`` (every TP
  column's copy of ``v`` equals one process's, not only the one ``full_tensor`` reads); before
  it, in the same processes, split NS over pairs of the 4 ranks (``test_split_dedicated``'s
  model: each FFN matrix split, its owner normalising the gathered result).

Each run is checked against one process with the same layouts and NorMuon: losses, weights and
every second moment. Control: one process without NorMuon ends elsewhere. fp32 Newton–Schulz;
tolerances as in test_tp.py and test_normuon_dist.py.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import full_state, run_ranks, train_steps
from .test_tp import _check, _muon, _whole_state, build_tp
from .test_tp_local_heads import ALIGNED, STRADDLING, _names, _set_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3
KEY = "normuon_second_moment"
MOMENT_RTOL, MOMENT_ATOL = 1e-3, 1e-7
SPLIT_SHAPE = {"layers": 1, "ffn": 1024}  # test_split_dedicated's: each FFN matrix split
FFN = sorted(f"layers.0.mlp.{m}_proj.weight" for m in ("down", "gate", "up"))


def _moments(model, opt) -> dict:
    """``{name: whole second moment}`` of every Muon matrix (collective on a TP model: every
    rank walks the parameters in the same order; ``full_tensor`` of owner tensors)."""
    import dmuon_compile as dmuon

    out = {}
    for name, p in model.named_parameters():
        v = opt.state.get(p, {}).get(KEY)
        if v is not None:
            out[name] = dmuon.full_tensor(v).detach().cpu().clone()
    return out


def _local_copies(model, opt) -> dict:
    """``{name: this rank's whole copy}`` of the second moments of plain dedicated weights it
    owns (one owner per TP column)."""
    from dmuon_compile.distributed._owner.tensor import is_owned, local_of

    out = {}
    for name, p in model.named_parameters():
        v = opt.state.get(p, {}).get(KEY)
        if v is not None and is_owned(v) and local_of(v).numel():
            out[name] = local_of(v).detach().cpu().clone()
    return out


def _reference(dp: int, per_head: bool, normuon: bool = True, **shape):
    model = models.build_llama(**shape)
    kw = {"adjust_lr_fn": "original"} if per_head else {}
    if per_head:
        _set_layouts(model)
    opt = _muon(model, predicate=models.proj_predicate, normuon=normuon, **kw)
    losses = train_steps(model, opt, models.batches(STEPS, dp))
    moments = _moments(model, opt) if normuon else {}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, moments


def _train(rank, world, dp, tp, per_head: bool, attention: bool = True, path=None) -> dict:
    """``path``: save a DCP checkpoint of model and optimizer there after training."""
    from dmuon_compile.distributed import dedicated_runtime

    model, dp_rank = build_tp(rank, world, dp, tp, attention=attention)
    kw = {}
    if per_head:
        _set_layouts(model)
        kw["adjust_lr_fn"] = "original"
    stage = dedicated_runtime(model).tp
    gathered = set()
    gather_parts = stage._gather_parts

    def recording(bucket, updates):
        gathered.update(row.param.fqn for row in bucket)
        return gather_parts(bucket, updates)

    stage._gather_parts = recording
    opt = _muon(model, normuon=True, **kw)
    losses = train_steps(model, opt, models.batches(STEPS, dp), dp_rank, dp)
    if path is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    from dmuon_compile.distributed._owner.tensor import local_of

    placed = {}  # where each TP weight's second moment lives on this rank
    tp_names = {p.fqn for p in stage.params}
    for name, p in model.named_parameters():
        v = opt.state.get(p, {}).get(KEY)
        if v is not None and name in tp_names:
            placed[name] = (repr(v.placements[0]), tuple(local_of(v).shape))
    # A plain opt.state_dict() loads back where it was saved (each rank its own pieces; the
    # second moments on their own placements, not the weights').
    saved = opt.state_dict()
    again = _muon(model, normuon=True, **kw)
    again.load_state_dict(saved)
    round_trip = all(
        torch.equal(local_of(again.state[p][KEY]), local_of(opt.state[p][KEY]))
        for p in opt.state
        if KEY in opt.state[p]
    )
    out = {
        "losses": losses,
        "state": _whole_state(model),
        "moments": _moments(model, opt),
        "copies": _local_copies(model, opt),
        "gathered": sorted(gathered),
        "placed": placed,
        "round_trip": round_trip,
    }
    if path is not None:  # a non-finite v on one member (as a load could bring), path by path
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        x = models.batches(1, dp, seed=9)[0]
        out["nan"] = [_nan_step(model, opt, w, rank, x) for w in (attn.o_proj, mlp.gate_proj)]
    return out


def _nan_step(model, opt, module, rank, x) -> tuple:
    """A step with a NaN in member 1's piece of ``module``'s second moment: what this rank
    raised, and whether the weight's shard and the moment stayed as they were."""
    from dmuon_compile.distributed._owner.tensor import local_of

    w = module.weight
    v = local_of(opt.state[w][KEY])
    good = v.clone()
    if rank == 1:
        v[0, 0] = float("nan")
    before = (local_of(w).clone(), v.clone())
    model(x).square().mean().backward()
    try:
        opt.step()
        raised = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        raised = type(err).__name__
    opt.zero_grad()
    same = torch.equal(local_of(w), before[0]) and torch.equal(
        v.nan_to_num(7.0), before[1].nan_to_num(7.0)
    )
    v.copy_(good)
    return raised, same


def _split(rank, world) -> dict:
    """``dedicate_params(split_size=2)`` over 4 ranks (1-D), NorMuon on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    model = models.build_llama(**SPLIT_SHAPE)
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, predicate=models.proj_predicate, split_size=2)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _muon(model, normuon=True)
    losses = train_steps(model, opt, models.batches(STEPS, world), rank, world)
    split = dmuon.summarize_comm_plan(model).get("split") or []
    return {
        "losses": losses,
        "state": full_state(model),
        "moments": _moments(model, opt),
        "split": sorted(s["param"] for s in split),
    }


def _split_and_tp(rank, world):
    """Split NS, then a TP model, in the same ranks (each model has its own owner meshes:
    tests/distributed/test_two_models.py)."""
    split = _split(rank, world)
    return _train(rank, world, 2, 2, False, False), split


def _two_layouts(rank, world, path):
    """dp 1 × tp 2: whole matrices, then per-head layouts (a new model and optimizer), saved."""
    return _train(rank, world, 1, world, False), _train(rank, world, 1, world, True, path=path)


def _check_moments(results, ref_moments) -> None:
    for res in results:
        assert sorted(res["moments"]) == sorted(ref_moments)
        for name, ref in ref_moments.items():
            torch.testing.assert_close(
                res["moments"][name], ref, rtol=MOMENT_RTOL, atol=MOMENT_ATOL, msg=name
            )
            assert ref.abs().sum() > 0, name


def _control(results, dp: int, per_head: bool) -> None:
    """One process without NorMuon ends elsewhere: the comparison sees the normalisation."""
    _, plain, _ = _reference(dp, per_head, normuon=False)
    got = results[0]["state"]
    gap = max((plain[n] - got[n]).abs().max() for n in plain if n.endswith("_proj.weight"))
    assert gap > 10 * 2e-4, gap


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("normuon_tp") / "ckpt")
    return path, run_ranks(_two_layouts, 2, path, timeout=200)


def test_whole_matrices_train_as_one_process(tp2):
    results = [whole for whole, _ in tp2[1]]
    ref_losses, ref_state, ref_moments = _reference(1, per_head=False)
    _check(results, ref_losses, ref_state)
    _check_moments(results, ref_moments)
    for res in results:  # every TP matrix went through its owner
        assert res["gathered"] == _names(ALIGNED + STRADDLING)
        assert res["round_trip"]
    _control(results, 1, per_head=False)


def test_per_head_layouts_normalise_whole_heads_where_they_are(tp2):
    results = [heads for _, heads in tp2[1]]
    ref_losses, ref_state, ref_moments = _reference(1, per_head=True)
    _check(results, ref_losses, ref_state)
    _check_moments(results, ref_moments)
    for res in results:  # q/k/v/o normalised on their members: never gathered
        assert res["gathered"] == _names(STRADDLING)
        assert res["round_trip"]
        placed = {k.split(".", 2)[2]: v for k, v in res["placed"].items() if ".0." in k}
        assert placed == {  # layer 0's: rows cut, head columns cut, replicated
            "self_attn.q_proj.weight": ("Shard(dim=0)", (16, 1)),
            "self_attn.k_proj.weight": ("Shard(dim=0)", (16, 1)),
            "self_attn.v_proj.weight": ("Shard(dim=0)", (16, 1)),
            "self_attn.o_proj.weight": ("Shard(dim=1)", (32, 2)),
            "mlp.gate_proj.weight": ("Shard(dim=0)", (32, 4)),
            "mlp.up_proj.weight": ("Shard(dim=0)", (32, 1)),
            "mlp.down_proj.weight": ("Replicate()", (32, 1)),
        }, placed
    _control(results, 1, per_head=True)


def test_a_non_finite_second_moment_raises_on_every_rank_and_writes_nothing(tp2):
    """A NaN in member 1's piece of ``v``: normalised locally (o, per head) or on the TP owner
    (gate, gathered): ``v′`` joins the finite check, every rank raises, nothing is written."""
    for res in tp2[1]:
        assert res[1]["nan"] == [("FloatingPointError", True)] * 2, res[1]["nan"]


def test_a_dcp_checkpoint_of_tp2_loads_into_one_process(tp2):
    """The per-head run's second moments (rows cut: q/k/v/gate/up; head columns cut: o;
    replicated: down) saved by the 2 TP ranks, loaded into a plain model in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path, results = tp2
    model = models.build_llama(seed=5)
    _set_layouts(model)
    opt = _muon(model, predicate=models.proj_predicate, adjust_lr_fn="original", normuon=True)
    train_steps(model, opt, models.batches(1, 1))  # state to load into
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = results[0][1]["moments"]
    loaded = _moments(model, opt)
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


@pytest.fixture(scope="module")
def four():
    return run_ranks(_split_and_tp, 4, timeout=200)


def test_dp2_tp2_with_plain_weights_of_a_tp_model(four):
    results = [tp for tp, _ in four]
    ref_losses, ref_state, ref_moments = _reference(2, per_head=False)
    _check(results, ref_losses, ref_state)
    _check_moments(results, ref_moments)
    attention = _names(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
    attention += _names(("self_attn.o_proj",))
    holders: dict = {}
    for rank, res in enumerate(results):  # every TP column's owner holds the same v
        for name, v in res["copies"].items():
            holders.setdefault(name, []).append(rank)
            torch.testing.assert_close(
                v, ref_moments[name], rtol=MOMENT_RTOL, atol=MOMENT_ATOL, msg=name
            )
    assert sorted(holders) == sorted(attention)
    assert all(len(ranks) == 2 for ranks in holders.values()), holders  # one per TP rank


def test_split_newton_schulz_normalises_on_the_owner(four):
    results = [split for _, split in four]
    ref_losses, ref_state, ref_moments = _reference(4, per_head=False, **SPLIT_SHAPE)
    assert results[0]["split"] == FFN  # every FFN matrix split over a pair
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
    )
    for res in results:
        for name, want in ref_state.items():
            torch.testing.assert_close(res["state"][name], want, rtol=0, atol=2e-4, msg=name)
    _check_moments(results, ref_moments)
    _, plain, _ = _reference(4, per_head=False, normuon=False, **SPLIT_SHAPE)  # control
    gap = max((plain[n] - results[0]["state"][n]).abs().max() for n in FFN)
    assert gap > 10 * 2e-4, gap
