"""Dedicated parameters on FSDP2 (the distributed runtime of ``dmuon_compile``).

Files, one concept each (FSDP2's layout): ``dedicate.py`` (entry point), ``owner_plan.py``
(who owns what), ``policy.py`` (mixed precision), ``mesh_checks.py`` (mesh validation),
``_dedicated_param.py`` (one parameter's life), ``_dedicated_group.py`` (a group's buffers and
collectives; its counters in ``_group_profile.py``), ``_collectives.py`` (the collective
calls), ``_runtime.py`` (hooks), ``_fsdp_compat.py`` (what is read from FSDP2),
``diagnostics.py``, ``_replicate.py`` (HSDP:
gradients to the one global owner over the replicate group, the post-step replicate broadcast),
``_tp/`` (TP: NS on the whole TP-sharded matrix on its TP owner, the update scattered back),
``_owned.py`` (a registered dedicated weight, an ``OwnerTensor``; its meshes, norms and
initialisation in ``_owner_meshes.py``, ``_owner_norms.py`` and ``_owner_init.py``).

HSDP in four lines (the documented order; every matrix is orthogonalised once in the whole job)::

    hsdp = init_device_mesh(
        "cuda", (replicate_size, shard_size), mesh_dim_names=("replicate", "shard")
    )
    dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])
    for block in model.layers: fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=hsdp); opt = dmuon.Muon(model, lr=0.02)  # replicate_async=True
"""

from dmuon_compile.distributed.dedicate import PROFILE_ENV, dedicate_params, dedicated_runtime
from dmuon_compile.distributed.diagnostics import (
    collect_forward_unshard_profile,
    summarize_comm_plan,
    summarize_param_groups,
    wait_all_replicate_broadcasts,
)
from dmuon_compile.distributed.owner_plan import (
    MatrixSpec,
    OwnerPlan,
    extract_layer_id,
    plan_owners,
)
from dmuon_compile.distributed.policy import MixedPrecision, ParamPolicy

__all__ = [
    "PROFILE_ENV",
    "MatrixSpec",
    "MixedPrecision",
    "OwnerPlan",
    "ParamPolicy",
    "collect_forward_unshard_profile",
    "dedicate_params",
    "dedicated_runtime",
    "extract_layer_id",
    "plan_owners",
    "summarize_comm_plan",
    "summarize_param_groups",
    "wait_all_replicate_broadcasts",
]
