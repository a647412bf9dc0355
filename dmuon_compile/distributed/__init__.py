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

The private modules live in rooms (sub-packages), each importing only the rooms before it in
this list (``tests/test_repository.py`` checks it); the public modules above sit beside them,
imported by the rooms where they are plans or protocols (``owner_plan``, ``step_plan``,
``stages``, ``split_ns``, ``mesh_checks``).

``_compat/``, what is read from torch, one module per part (docs/torch_internals.md):

- ``fsdp.py``: FSDP2 (managing modules, gradient settings, joined meshes).
- ``dtensor.py``: DTensor and DeviceMesh internals.
- ``c10d.py``: c10d process groups.
- ``autograd.py``: the autograd engine (in backward, queued callbacks).

``_comm/``, what the parts share to talk to other ranks:

- ``collectives.py``: every collective call, and the one place that knows their names.
- ``pending.py``: a runtime's comm context and its one queue of pending weight updates.

``_owner/``, owner tensors (a DTensor living whole on one rank) and the parameter holding one:

- ``tensor.py``: ``OwnerTensor``, the registered parameter of a dedicated weight.
- ``meshes.py``: the owners' one-rank meshes, process-wide.
- ``norms.py``: an owner tensor's norm and clip scaling (``clip_grad_norm_``).
- ``init.py``: ``nn.init`` functions and random fills on dedicated weights.
- ``holder.py``: the class a module holding dedicated weights gets (FSDP2 leaves them alone).
- ``param.py``: one dedicated parameter's life (master, compute copy, gradient).

``OwnerTensor`` is exported here: pickles name it ``dmuon_compile.distributed.OwnerTensor``.

``_stages/``, the step's stages across ranks (``StepStage``):

- ``split_step.py``: split Newton–Schulz inside ``Muon.step`` (``SplitStage``).
- ``expert_shards.py``: expert stacks sharded inside each expert, resharded to whole experts
  (``ExpertReshardStage``).
- ``tp/``: tensor parallelism (NS on the whole TP-sharded matrix, once): ``detect.py`` (the
  TP axis), ``plan.py`` (owners over DP × TP), ``param.py`` (a dedicated TP shard),
  ``stage.py`` (``TPStage``: the step's gather → NS → scatter), ``moments.py`` (NorMuon's
  second moments of TP weights).

``_runtime/``, the runtime:

- ``runtime.py``: ``DedicatedRuntime``, one per model: the forward/backward hooks.
- ``step.py``: its step side, the step plan and the HSDP publishes.
- ``group.py``: a hook group, its flat buffer, unshard, reshard and reduce.
- ``group_profile.py``: a hook group's counters.
- ``replicate.py``: HSDP's replicate stage: gradients to the global owner, weights back.

HSDP in four lines (the documented order; every matrix is orthogonalised once in the whole job)::

    hsdp = init_device_mesh(
        "cuda", (replicate_size, shard_size), mesh_dim_names=("replicate", "shard")
    )
    dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])
    for block in model.layers: fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=hsdp); opt = dmuon.Muon(model, lr=0.02)  # replicate_async=True
"""

import sys

import torch

from dmuon_compile.distributed._owner import tensor as _owner_tensor
from dmuon_compile.distributed._owner.tensor import OwnerTensor
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
    "OwnerTensor",
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

# Checkpoints pickled before the rooms name OwnerTensor by its old module (new ones name
# dmuon_compile.distributed.OwnerTensor): that path stays loadable, by pickle's import and by
# torch.load's weights_only allowlist, which matches classes by name.
_OLD_OWNER_MODULE = f"{__name__}._owned"
sys.modules.setdefault(_OLD_OWNER_MODULE, _owner_tensor)
torch.serialization.add_safe_globals([(OwnerTensor, f"{_OLD_OWNER_MODULE}.OwnerTensor")])
