"""Plain saving of models with dedicated weights: ``torch.save`` / ``torch.load`` (its default,
``weights_only=True``) and ``copy.deepcopy`` of ``model.state_dict()`` and ``opt.state_dict()``.

On one process, 2 gloo ranks (1-D), HSDP 2 × 1 and dp 1 × tp 2, after one step:

- every tensor comes back with its type, global shape, mesh and placements, and this rank's
  values (the whole weight or TP shard where it is held, an empty local tensor elsewhere);
- ``dmuon.full_tensor`` of the loaded or copied optimizer state gives the whole tensor (each
  owner tensor is on this process's owner mesh itself, not a copy of it);
- a fresh model and optimizer that load the saved dicts (``model.load_state_dict``,
  ``opt.load_state_dict``) continue exactly like the run that saved (every rank's tensors equal
  after two more steps), from ``torch.load`` and from the deep copy alike; so does one that
  loads a ``dcp.async_save`` checkpoint of ``get_state_dict(model, opt)``. Control: the
  resume with a fresh optimizer (no saved state) does not.

Before, each of these raised "Attempted to access the data pointer ... on an invalid python
storage" (``copy_()`` for the deep copy and ``async_save``) on every rank holding a dedicated
weight: torch treats a tensor subclass as a wrapper only when its ``data_ptr()`` is 0.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from . import models
from .harness import run_ranks
from .test_registered_params import _opt
from .test_tp_checkpoint import _build_tp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

LAYOUTS = [("1d", 1), ("1d", 2), ("hsdp", 2), ("tp", 2)]  # (layout, ranks)


def _build(layout: str, world: int, seed: int):
    """The model and this rank's data-parallel (rank, size)."""
    import torch.distributed as dist

    if layout == "tp":  # dp 1 x tp 2: every rank sees the whole batch
        return _build_tp(seed), 0, 1
    model = models.build_dedicated(world, seed=seed, hsdp=layout == "hsdp")[0]
    return model, dist.get_rank(), world


def _step(model, opt, x, dp_rank: int, dp: int) -> None:
    per = x.shape[0] // dp
    model(x[dp_rank * per : (dp_rank + 1) * per]).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _diffs(got, want, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: tensor type, global shape, mesh, placements, values
    of this rank's local tensor; containers and other values by equality."""
    from dmuon_compile.distributed._owner.tensor import OwnerTensor

    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in _diffs(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diffs(g, w, f"{path}[{i}]")]
    if not isinstance(want, torch.Tensor):
        return [] if got == want else [f"{path}: {got!r} != {want!r}"]
    if type(got) is not type(want) or got.shape != want.shape or got.dtype != want.dtype:
        return [f"{path}: {type(got).__name__}{tuple(got.shape)} != {type(want).__name__}"]
    if hasattr(want, "placements") and (
        got.placements != want.placements or got.device_mesh != want.device_mesh
    ):
        return [f"{path}: {got.device_mesh} {got.placements} != {want.placements}"]
    if isinstance(want, OwnerTensor) and got.device_mesh is not want.device_mesh:
        # on this process's owner mesh itself, which full_tensor and the norms know it by
        return [f"{path}: a copy of the owner mesh"]
    if not torch.equal(_local(got), _local(want)):
        return [f"{path}: values"]
    return []


def _resume(layout, world, saved, x, load_optimizer: bool = True) -> dict:
    """A model of other initial values and a fresh optimizer load ``saved`` (a DCP checkpoint's
    path, or the state dicts), then take the steps of ``x``: this rank's local tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, dp_rank, dp = _build(layout, world, seed=7)
    opt = _opt(model)
    if isinstance(saved, str):
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=saved)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(saved["model"])
        if load_optimizer:
            opt.load_state_dict(saved["optim"])
    for xb in x:
        _step(model, opt, xb, dp_rank, dp)
    return {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def _save_and_resume(rank, world, layout, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dmuon_compile as dmuon
    from dmuon_compile.distributed._owner.tensor import OwnerTensor

    model, dp_rank, dp = _build(layout, world, seed=0)
    opt = _opt(model)
    x = models.batches(3, world)
    _step(model, opt, x[0], dp_rank, dp)

    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()))  # weights_only=True, torch's default
    snapshot = copy.deepcopy(state)
    diffs = _diffs(loaded, state, "load") + _diffs(snapshot, state, "deepcopy")
    dedicated = [v for v in state["model"].values() if isinstance(v, OwnerTensor)]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path).result()
    gathered = all(  # collective, in the same order on every rank
        torch.equal(dmuon.full_tensor(copied["optim"]["state"][i][k]), dmuon.full_tensor(v))
        for copied in (loaded, snapshot)
        for i, values in state["optim"]["state"].items()
        for k, v in values.items()
        if isinstance(v, OwnerTensor)
    )

    for xb in x[1:]:
        _step(model, opt, xb, dp_rank, dp)
    final = {n: _local(p).detach().clone() for n, p in model.named_parameters()}

    def same(resumed):
        return all(torch.equal(resumed[n], final[n]) for n in final)

    return {
        "diffs": diffs,
        "gathered": gathered,
        "held": sum(1 for v in dedicated if _local(v).numel() > 0),
        "empty": sum(1 for v in dedicated if _local(v).numel() == 0),
        "from_load": same(_resume(layout, world, loaded, x[1:])),
        "from_deepcopy": same(_resume(layout, world, snapshot, x[1:])),
        "from_async_save": same(_resume(layout, world, path, x[1:])),
        "fresh_optimizer": same(_resume(layout, world, loaded, x[1:], load_optimizer=False)),
    }


@pytest.mark.parametrize(("layout", "world"), LAYOUTS, ids=[f"{a}_{w}" for a, w in LAYOUTS])
def test_plain_save_load_deepcopy_and_resume(layout, world, tmp_path):
    results = run_ranks(_save_and_resume, world, layout, str(tmp_path / "dcp"), timeout=100)
    for rank, out in enumerate(results):
        assert out["diffs"] == [], (rank, out["diffs"][:5])
        assert out["gathered"], rank  # full_tensor of the copied optimizer state: the whole
        assert out["held"] > 0, rank  # every rank holds some dedicated weights
        if layout in ("1d", "hsdp") and world > 1:
            assert out["empty"] > 0, rank  # ... and not others (one owner per weight)
        assert out["from_load"] and out["from_deepcopy"] and out["from_async_save"], rank
        assert not out["fresh_optimizer"], rank  # control: the optimizer state matters
