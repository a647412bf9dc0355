"""Tensor parallelism for dedicated weights: Newton–Schulz on the whole TP-sharded matrix, once.

A weight that ``parallelize_module`` made a DTensor (``ColwiseParallel``: ``Shard(0)``, local
shard ``(out/T, in)``; ``RowwiseParallel``: ``Shard(1)``, ``(out, in/T)``) is dedicated shard by
shard: each TP rank dedicates its *local shard* over its data-parallel mesh exactly like a plain
weight (owner-packed unshard and reduce, HSDP replicate stage). The plan is computed from the
same specs on every rank, so shard ``t`` of a matrix has the same DP owner ``d`` on every TP
rank: the TP group at DP coordinate ``d`` holds the whole matrix, one shard per member.

Per step, in that TP group (:class:`TPStage`), one shape bucket of whole matrices at a time (a
TP owner holds one bucket's gathered pieces and whole matrices, not all of its matrices'):

1. each member updates the momentum of its shard (elementwise: sharding changes nothing) and
   the Nesterov input ``u_t``;
2. the ``u_t`` are gathered to the matrix's *TP owner* ``t*``, which runs Newton–Schulz on the
   whole matrix (never blockwise on shards: that changes the update);
3. ``t*`` scatters the update's shards back; each member applies its shard with the learning-
   rate scale of the *global* shape. With ``Muon(replicate_async=True)`` (and no HSDP) the
   scatter is left in flight — an entry of the runtime's pending-update queue (``_comm/pending.py``)
   — and applied right before the group's next unshard (its forward pre-hook or the prefetch
   before it), or before anything reads or writes the weight (``p.full_tensor()``,
   ``p.to_local()``, ``model.state_dict()``, DCP, an in-place edit);
   ``replicate_async=False`` applies it inside ``step()``. A step first applies whatever an
   earlier step left pending, so two ``step()`` calls without a forward are safe. With HSDP the
   scatter is applied inside ``step()``, before the replicate publish reads the new weights.

A blocked matrix (per-head layouts) whose every shard holds whole blocks — the TP shard dim is
the dim its blocks are cut along, and the shard boundaries fall on block boundaries (8 heads
over TP 2; q/k/v column-parallel, o row-parallel) — skips steps 2 and 3: each member runs
Newton–Schulz on its own blocks (they are matrices of their own: the same result as on the
owner) and scales each by its own learning-rate rule over the whole matrix's. The choice is a
function of the layout, the global shape, the shard dim and the TP size, the same on every
member, so the other matrices' gathers and scatters stay paired. Heads straddling a shard
boundary (6 heads over TP 4) go through the gather.

The owners ``(d, t*)`` are spread by LPT over all DP × TP slots (:func:`plan_tp_owners`): a
TP matrix costs its whole-matrix NS on one slot; a plain (TP-replicated) matrix is charged on
every TP slot of its DP column.

A plain dedicated weight of a TP model has one owner per TP column: ``(d, t)`` for every ``t``
(each TP rank's own DP group unshards it from there). Those copies must stay bitwise equal —
separately updated, they drift on GPUs (each column's reduce sums in its own order, kernel
choices differ per rank) — so only TP rank 0 of the owner TP group updates them, and broadcasts
the new weight and its momentum over the TP group (:meth:`TPStage.broadcast_plain`): one
master per weight, the copy ``full_tensor()`` already reads.

The registered parameter is an ``OwnerTensor`` (a DTensor, ``_owner/tensor.py``) of the global shape
on the owner TP group (the TP ranks at DP coordinate ``d``) with the plan's placement: there its
local tensor is the master shard, elsewhere it is empty. DCP therefore sees a TP-sharded weight
and reshards it; ``full_tensor()``, torch's full state dict and ``clip_grad_norm_`` work on it
as on a plain dedicated weight. The compute copy
swapped in for forward is a DTensor on this rank's TP mesh with the plan's placement, over the
group's unsharded buffer, so ``parallelize_module``'s input/output redistribution is unchanged.

Modules: ``detect.py`` (the TP axis: :class:`TPInfo`, the TP groups' ranks), ``plan.py`` (the
owners over the DP × TP slots), ``param.py`` (:class:`TPDedicatedParam`, the owner groups'
meshes), ``stage.py`` (:class:`TPStage`: the step's TP stage — :meth:`TPStage.directions` runs
momentum, gather, the optimizer's Newton–Schulz and scatter — its commit or abort, the
plain-weight broadcast, the pending scatters, the norm and ``full_tensor`` meshes given to
``_owner/tensor.py``), ``moments.py`` (NorMuon's second moments of TP weights: where they live,
which the stage moves to the TP owner and back). What the rest of the package uses is imported here.
"""

from dmuon_compile.distributed._stages.tp.detect import (
    TPInfo,
    detect_tp,
    detect_tp_mesh,
    dp_grid_mesh,
    dp_tp_mesh,
    owner_group_ranks,
)
from dmuon_compile.distributed._stages.tp.param import (
    TPDedicatedParam,
    make_tp_param,
    owner_tp_mesh,
)
from dmuon_compile.distributed._stages.tp.plan import TPOwners, plan_tp_owners
from dmuon_compile.distributed._stages.tp.stage import (
    PLAIN_SOURCE,
    LocalUpdate,
    ScatterShard,
    ScatterUpdates,
    TPProfile,
    TPRow,
    TPStage,
    TPStepHalf,
    build_stage,
    local_blocks_layout,
)

__all__ = [
    "PLAIN_SOURCE",
    "LocalUpdate",
    "ScatterShard",
    "ScatterUpdates",
    "TPDedicatedParam",
    "TPInfo",
    "TPOwners",
    "TPProfile",
    "TPRow",
    "TPStage",
    "TPStepHalf",
    "build_stage",
    "detect_tp",
    "detect_tp_mesh",
    "dp_grid_mesh",
    "dp_tp_mesh",
    "local_blocks_layout",
    "make_tp_param",
    "owner_group_ranks",
    "owner_tp_mesh",
    "plan_tp_owners",
]
