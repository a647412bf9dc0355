"""Dedicated parameters on FSDP2 (the distributed runtime of ``dmuon_compile``).

One concept per file, as FSDP2's ``_fully_shard`` (the life of a dedicated weight:
docs/dedicated_params.md). Public:

- ``dedicate.py``: ``dedicate_params``, the entry point (plans, builds, attaches the runtime).
- ``owner_plan.py``: which rank owns each dedicated matrix, which hook group it travels in.
- ``policy.py``: the mixed-precision policy of dedicated weights (``ParamPolicy``).
- ``mesh_checks.py``: validation of the shard and replicate meshes, errors with their fix.
- ``step_plan.py``: the plan of one ``Muon.step``, built by the runtime, walked by ``Muon``.
- ``stages.py``: ``StepStage``, the one seam through which Newton–Schulz reaches other ranks.
- ``split_ns.py``: split Newton–Schulz, one matrix orthogonalised by a group of ranks.
- ``checkpoint.py``: full (unsharded) model state dicts, dedicated weights included.
- ``clip.py``: ``dmuon.clip_grad_norm_``, a thin alias of torch's.
- ``diagnostics.py``: the comm plan, group summaries and profiles, as JSON-ready dicts.

The runtime:

- ``_runtime.py``: ``DedicatedRuntime``, one per model: the forward/backward hooks.
- ``_runtime_step.py``: its step side, the step plan and the HSDP publishes.
- ``_pending.py``: its comm context and the one queue of pending weight updates.
- ``_dedicated_group.py``: a hook group, its flat buffer, unshard, reshard and reduce.
- ``_dedicated_param.py``: one dedicated parameter's life (master, compute copy, gradient).
- ``_group_profile.py``: a hook group's counters.
- ``_collectives.py``: every collective call, and the one place that knows their names.
- ``_replicate.py``: HSDP's replicate stage: gradients to the global owner, weights back.
- ``_split_step.py``: split Newton–Schulz inside ``Muon.step`` (``SplitStage``).
- ``_expert_shards.py``: expert stacks sharded inside each expert, resharded to whole experts
  (``ExpertReshardStage``).
- ``_tp/``: tensor parallelism (NS on the whole TP-sharded matrix, once): ``detect.py`` (the
  TP axis), ``plan.py`` (owners over DP × TP), ``param.py`` (a dedicated TP shard),
  ``stage.py`` (``TPStage``: the step's gather → NS → scatter).

Owner tensors (a DTensor living whole on one rank):

- ``_owned.py``: ``OwnerTensor``, the registered parameter of a dedicated weight.
- ``_owner_meshes.py``: the owners' one-rank meshes, process-wide.
- ``_owner_norms.py``: an owner tensor's norm and clip scaling (``clip_grad_norm_``).
- ``_owner_init.py``: ``nn.init`` functions and random fills on dedicated weights.
- ``_holder.py``: the class a module holding dedicated weights gets (FSDP2 leaves them alone).

What is read from torch, one module per part (docs/torch_internals.md):

- ``_fsdp_compat.py``: FSDP2 (managing modules, gradient settings, joined meshes).
- ``_dtensor_compat.py``: DTensor and DeviceMesh internals.
- ``_c10d_compat.py``: c10d process groups.
- ``_autograd_compat.py``: the autograd engine (in backward, queued callbacks).

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
