"""Two models dedicated in one process: a TP model's registrations never reach a later model.

An owner's one-rank mesh carries where its tensors' norms are given and which rank
``full_tensor`` broadcasts from (``_owner/meshes.py``). A TP model's plain weights broadcast from
their owner in TP column 0; when a later plain model of the same ranks reused those meshes, its
``full_tensor`` broadcast from the wrong rank and the ranks hung. Owner meshes are now built per
data-parallel mesh. Test: a TP model (dp 1 × tp 2) trains a step, then a plain FSDP2 model on the
same two ranks trains like one process and gathers its weights. Control: with one owner mesh
per rank (the old keying), the plain model's meshes keep the TP model's broadcast source.
"""

from __future__ import annotations

import pytest
import torch

from .harness import run_ranks
from .test_dedicated_training import reference, train_distributed
from .test_tp import build_tp, train_tp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

STEPS = 3


def _plain_after_tp(rank, world):
    train_tp(rank, world, 1, world, steps=1, attention=False)  # plain weights: one owner per column
    out = train_distributed(rank, world, STEPS, False)
    return {"losses": out["losses"], "state": out["state"]}


def test_a_plain_model_after_a_tp_model_trains_like_one_process():
    ref_losses, ref_state, _ = reference(2, steps=STEPS)
    results = run_ranks(_plain_after_tp, 2, timeout=120)
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
        )
        for name, ref in ref_state.items():
            torch.testing.assert_close(r["state"][name], ref, rtol=0, atol=2e-4, msg=name)


def _sources(rank, world, one_mesh_per_rank):
    """The broadcast sources left on the plain model's owner meshes."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicate
    from dmuon_compile.distributed._owner import meshes as _owner_meshes

    from . import models

    if one_mesh_per_rank:  # the old keying: (device type, rank), whatever the model
        real, fixed = dedicate.owner_mesh, {}
        dedicate.owner_mesh = lambda dev, r, dp_mesh: real(dev, r, fixed.setdefault(r, dp_mesh))
    build_tp(rank, world, 1, world, attention=False)
    model = models.build_llama()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), predicate=models.proj_predicate)
    meshes = {
        id(p.device_mesh): p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")
    }
    return sorted(_owner_meshes.MESHES.source_of.get(i, -1) for i in meshes)


@pytest.mark.parametrize("one_mesh_per_rank", [False, True])
def test_control_one_owner_mesh_per_rank_keeps_the_tp_models_source(one_mesh_per_rank):
    sources = run_ranks(_sources, 2, one_mesh_per_rank, timeout=60)
    for s in sources:
        assert s, "the plain model has dedicated weights"
        assert (any(x != -1 for x in s)) == one_mesh_per_rank, s
