"""Any mesh names: HSDP and TP on meshes named and derived as torchtitan's ``ParallelDims``
builds them (every mesh unflattened from a flattened 1-D ``("world",)`` root; HSDP dims
``("dp_replicate", "fsdp")``; the TP dim ``"tp"`` from another unflattening of the same root).

4 gloo ranks, built with torch alone (the torchtitan tests use its own ``ParallelDims``):

- HSDP 2 × 2 trains like one process with the global batch, and ``torch``'s
  ``clip_grad_norm_`` over the mixed FSDP2/dedicated parameters gives the reference norm;
- dp 2 × tp 2 likewise (owners' TP rows and norms on the DP × TP mesh FSDP2 uses);
- the documented HSDP error stays for unnamed, lone 1-D and unrelated meshes (control: the
  same call on one mesh's two named slices passes).
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import local_device, run_ranks, train_steps
from .test_dedicated_training import HYPER, _ns

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

STEPS = 3
BIG = 1e9  # clip threshold that never clips: clip_grad_norm_ only measures


def _muon(model):
    import dmuon_compile as dmuon

    return dmuon.Muon(model, ns_backend=_ns(), **HYPER)


def _titan_meshes(world: int, replicate: int, tp: int):
    """torchtitan's layout (``ParallelDims.build_mesh``, partial-DTensor backend): the dense
    mesh ``(pp, dp_replicate, fsdp, tp)`` and the data-loading mesh ``(pp, batch, cp, tp)``,
    both unflattened from the 1-D world mesh; TP comes from the latter, HSDP from the former."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    fsdp = world // (replicate * tp)
    dense = root._unflatten(0, (1, replicate, fsdp, tp), ("pp", "dp_replicate", "fsdp", "tp"))
    loading = root._unflatten(0, (1, replicate * fsdp, 1, tp), ("pp", "batch", "cp", "tp"))
    return dense, loading


def _reference(dp: int):
    """One process, the global batch of ``dp`` ranks: losses, final weights, first grad norm."""
    model = models.build_llama()
    opt = _muon_reference(model)
    norm = []
    losses = train_steps(
        model,
        opt,
        models.batches(STEPS, dp),
        on_first_grads=lambda: norm.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), BIG))
        ),
    )
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norm[0]


def _muon_reference(model):
    import dmuon_compile as dmuon

    return dmuon.Muon(model, ns_backend=_ns(), predicate=models.proj_predicate, **HYPER)


def _train(model, dp_rank: int, dp: int, world: int):
    """Losses (the mean over all ``world`` ranks) and the first step's gradient norm."""
    opt = _muon(model)
    norm = []

    def first_norm():  # torch's own clip over FSDP2 and dedicated parameters together
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), BIG)
        norm.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))

    losses = train_steps(
        model, opt, models.batches(STEPS, dp), dp_rank, dp, on_first_grads=first_norm
    )
    return losses, norm[0]


def _hsdp_titan(rank, world):
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon

    from .harness import full_state

    dense, _ = _titan_meshes(world, 2, 1)
    model = models.build_llama().to(local_device("cpu"))
    dmuon.dedicate_params(
        model,
        dense["fsdp"],
        predicate=models.proj_predicate,
        replicate_mesh=dense["dp_replicate"],
    )
    hsdp = dense["dp_replicate", "fsdp"]  # ParallelDims.get_mesh(["dp_replicate", "fsdp"])
    for block in model.layers:
        fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    losses, norm = _train(model, rank, world, world)
    return {"losses": losses, "norm": norm, "state": full_state(model)}


def _tp_titan(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon_compile as dmuon

    from .test_tp import _whole_state, tp_owners

    dense, loading = _titan_meshes(world, 1, 2)
    model = models.build_llama().to(local_device("cpu"))
    parallelize_module(model, loading["tp"], tp_owners())  # ParallelDims.get_mesh("tp")
    fsdp = dense["fsdp"]
    dmuon.dedicate_params(model, fsdp, predicate=models.proj_predicate)
    for block in model.layers:
        fully_shard(block, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    losses, norm = _train(model, fsdp.get_local_rank(), fsdp.size(), world)
    return {"losses": losses, "norm": norm, "state": _whole_state(model)}


def _scenarios(rank, world):
    out = {}
    for label, fn in {"hsdp": _hsdp_titan, "tp": _tp_titan, "errors": _errors}.items():
        try:
            out[label] = fn(rank, world)
        except ValueError as exc:  # each scenario reports its own failure
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _check(results, ref):
    ref_losses, ref_state, ref_norm = ref
    assert ref_losses[-1] < ref_losses[0]
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6
        )
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-4)
        for name, want in ref_state.items():
            torch.testing.assert_close(
                r["state"][name], want, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_torchtitan_meshes_hsdp_and_tp_match_single_process_errors_stay():
    results = run_ranks(_scenarios, 4, timeout=180)
    failed = [f"{k}: {r[k]}" for r in results for k in ("hsdp", "tp") if not isinstance(r[k], dict)]
    assert not failed, "\n".join(failed)
    _check([r["hsdp"] for r in results], _reference(4))
    _check([r["tp"] for r in results], _reference(2))
    for r in results:
        errors = r["errors"]
        assert errors.pop("named_slices") is None
        for label, err in errors.items():
            assert err is not None, label
            assert "HSDP mesh must be 2D with names ('replicate', 'shard')" in err, (label, err)
            assert 'replicate_mesh=hsdp["replicate"]' in err, label


def _errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_compile as dmuon

    dense, _ = _titan_meshes(world, 2, 1)
    unnamed = init_device_mesh("cpu", (2, world // 2))
    lone = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    cases = {
        "named_slices": (dense["fsdp"], dense["dp_replicate"]),  # the control: accepted
        "unnamed": (dense["fsdp"], unnamed),
        "lone_1d": (dense["fsdp"], lone),
        "one_dim_twice": (dense["fsdp"], dense["fsdp"]),
        "whole_2d": (dense["fsdp"], dense["dp_replicate", "fsdp"]),
    }
    out = {}
    for label, (mesh, rep) in cases.items():
        try:
            dmuon.dedicate_params(
                models.build_llama(), mesh, predicate=models.proj_predicate, replicate_mesh=rep
            )
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)
    return out
