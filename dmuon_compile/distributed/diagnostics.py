"""Diagnostics of the dedicated-parameter runtime; every result is a JSON-serialisable dict."""

from __future__ import annotations

import torch
from torch import nn

from dmuon_compile.dedicated_registry import runtime_of


def _dtype(dt) -> str:
    return str(dt).replace("torch.", "")


def summarize_param_groups(model: nn.Module, optimizer=None) -> dict:
    """Rank-local routing: which optimizer each parameter gets, its dtype, owner and bytes.

    Example::

        print(json.dumps(dmuon.summarize_param_groups(model, optimizer), indent=2, default=str))
    """
    import torch.distributed as dist

    runtime = runtime_of(model)
    rank = (
        runtime.rank if runtime is not None else (dist.get_rank() if dist.is_initialized() else 0)
    )
    params = []
    in_opt: dict[int, str] = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            route = "muon" if group.get("use_muon", False) else "adamw"
            for p in group["params"]:
                in_opt[id(p)] = route
    bytes_per_owner: dict[int, int] = {}
    if runtime is not None:
        for dp in runtime.params:
            nbytes = dp.numel * torch.empty((), dtype=dp.orig_dtype).element_size()
            bytes_per_owner[dp.owner] = bytes_per_owner.get(dp.owner, 0) + nbytes
            params.append(
                {
                    "name": dp.fqn,
                    "route": "dedicated/muon",
                    "shape": list(dp.shape),
                    "dtype": _dtype(dp.orig_dtype),
                    "compute_dtype": _dtype(dp.compute_dtype),
                    "owner": dp.owner,
                    "replica_owner": dp.replica_owner,
                    "owned_here": dp.master is not None,
                    "replica_here": dp.replica is not None,
                    "bytes": nbytes,
                    "in_optimizer": in_opt.get(id(dp.param)),
                    **_tp_fields(dp),
                }
            )
    dedicated = {dp.fqn for dp in runtime.params} if runtime is not None else set()
    for name, p in model.named_parameters():
        if name in dedicated:
            continue  # listed above, with its owner
        local = p.to_local() if hasattr(p, "to_local") else p
        params.append(
            {
                "name": name,
                "route": in_opt.get(id(p), "fsdp" if hasattr(p, "to_local") else "local"),
                "shape": list(p.shape),
                "dtype": _dtype(p.dtype),
                "owner": None,
                "sharded": hasattr(p, "to_local"),
                "local_bytes": local.numel() * local.element_size(),
            }
        )
    counts: dict[str, int] = {}
    for row in params:
        counts[str(row["route"])] = counts.get(str(row["route"]), 0) + 1
    return {
        "rank": rank,
        "world_size": runtime.world if runtime is not None else None,
        "params": params,
        "counts_by_route": counts,
        "dedicated_bytes_per_owner": {str(k): v for k, v in sorted(bytes_per_owner.items())},
        "ns_backend": optimizer.ns.describe()
        if optimizer is not None and hasattr(optimizer, "ns")
        else None,
    }


def summarize_comm_plan(model: nn.Module) -> dict:
    """The planned collectives per hook group: mode, owners, bytes per owner, padding.

    Each group has one collective per unshard and one per gradient reduce: ``mode``
    ``all_gather`` (chunks padded to the largest: all-gather / reduce-scatter of ``bytes``) or
    ``all_gather_v`` (uneven chunks, ``bytes_per_rank`` in shard-group rank order).
    Owners in ``bytes_per_owner``/``unshard``/``reduce`` are ranks of the shard group (HSDP:
    owner columns). With HSDP, ``replicate`` describes the replicate stage of this rank's
    column: per group the gradient ``reduce`` and the post-step ``publish`` broadcasts, each
    with its ``root`` (replicate rank of the global owner) and bytes, and the step's totals.

    Example::

        print(json.dumps(dmuon.summarize_comm_plan(model), indent=2))
    """
    runtime = runtime_of(model)
    if runtime is None:
        return {"dedicated": False, "groups": []}
    groups = []
    for g in runtime.groups:
        item = g.flat.element_size()
        ritem = torch.empty((), dtype=g.reduce_dtype).element_size()
        payload = sum(g.chunk_numel)
        if g.mode == "all_gather":
            unshard = [{"op": "all_gather", "bytes": g.flat.numel() * item}]
            reduce = [{"op": "reduce_scatter", "bytes": g.flat.numel() * ritem}]
        else:  # one collective of uneven chunks each way: the bytes each rank contributes
            unshard = [
                {
                    "op": "all_gather_v",
                    "bytes": payload * item,
                    "bytes_per_rank": [n * item for n in g.chunk_numel],
                }
            ]
            reduce = [
                {
                    "op": "reduce_scatter_v",
                    "bytes": payload * ritem,
                    "bytes_per_rank": [n * ritem for n in g.chunk_numel],
                }
            ]
        groups.append(
            {
                "group": g.name,
                "params": [p.fqn for p in g.params],
                "mode": g.mode,
                "compute_dtype": _dtype(g.compute_dtype),
                "reduce_dtype": _dtype(g.reduce_dtype),
                "bytes_per_owner": {
                    str(o): g.chunk_numel[o] * item for o in range(g.world) if g.chunk_numel[o]
                },
                "payload_bytes": payload * item,
                "padding_bytes": (g.flat.numel() - payload) * item,
                "unshard": unshard,
                "reduce": reduce,
                "reshard_after_forward": g.reshard_after_forward,
            }
        )
        if g.replicate is not None:
            rs = g.replicate
            rep_item = torch.empty((), dtype=g.reduce_dtype).element_size()
            groups[-1]["replicate"] = {
                "column_params": [p.fqn for p in rs.params],
                "owned_here": [p.fqn for p in rs.params if p.master is not None],
                "reduce": [
                    {"op": "reduce", "root": s.root, "bytes": s.numel * rep_item}
                    for s in rs.segments
                ],
                "publish": [
                    {"op": "broadcast", "root": s.root, "bytes": s.numel * rs.element_size}
                    for s in rs.segments
                ],
            }
    plan = runtime.plan
    return {
        "dedicated": True,
        "rank": runtime.rank,
        "world_size": runtime.world,
        "plan_digest": plan.digest(),
        "balance": plan.balance(),
        "ns_flops_per_owner": {str(r): v for r, v in enumerate(plan.ns_loads())},
        "bytes_per_owner": {str(r): v for r, v in enumerate(plan.byte_loads())},
        "forward_order": [g.name for g in runtime.forward_order],
        "replicate": _replicate_summary(runtime, groups),
        "tp": _tp_summary(runtime),
        "split": _split_summary(runtime),
        "groups": groups,
    }


def _split_summary(runtime) -> list[dict]:
    """Matrices whose NS a group of ranks shares: per matrix its global ranks, its owner, whether
    this rank takes part; per step the owner scatters the input and gathers the result, each
    ``elements`` (the gradient's dtype out, NS's work dtype back)."""
    return [
        {
            "param": s.fqn,
            "shape": list(s.shape),
            "ranks": list(s.ranks),
            "owner": s.owner,
            "member": s.pg is not None,
            "elements": s.shape[0] * s.shape[1],
        }
        for s in getattr(runtime, "split", ())
    ]


def _tp_fields(dp) -> dict:
    """TP shard rows: ``shape`` is the local shard's; the TP owner runs NS on the whole matrix."""
    if not hasattr(dp, "tp_owner"):
        return {}
    return {
        "global_shape": list(dp.global_shape),
        "placement": f"Shard({dp.shard_dim})",
        "tp_owner": dp.tp_owner,
    }


def _tp_summary(runtime) -> dict | None:
    """The TP stage: per matrix its DP owner, TP owner and whether NS runs here; this rank's
    gather/scatter bytes per step; the NS balance over the DP × TP slots."""
    stage = getattr(runtime, "tp", None)
    if stage is None:
        return None
    out = stage.summary(runtime)
    if stage.owners is not None:
        out["balance"] = stage.owners.balance()
        out["ns_flops_per_slot"] = {str(k): v for k, v in enumerate(stage.owners.slot_flops)}
    return out


def _replicate_summary(runtime, groups: list[dict]) -> dict | None:
    if runtime.replicate_mesh is None:
        return None
    size = runtime.replicate_mesh.size()
    if not runtime.replicated:
        return {"size": size, "active": False}
    stages = [g["replicate"] for g in groups if "replicate" in g]
    return {
        "size": size,
        "active": True,
        "shard_size": runtime.world,
        "rank": runtime.replicate_mesh.get_local_rank(),
        "owned_here": sum(len(s["owned_here"]) for s in stages),
        "publish_broadcasts_per_step": sum(len(s["publish"]) for s in stages),
        "publish_bytes_per_step": sum(b["bytes"] for s in stages for b in s["publish"]),
        "reduce_bytes_per_step": sum(b["bytes"] for s in stages for b in s["reduce"]),
        "roots": sorted({b["root"] for s in stages for b in s["publish"]}),
    }


def collect_forward_unshard_profile(model: nn.Module, synchronize: bool = True) -> dict:
    """Forward-unshard counters and wait times (``DMUON_RECORD_FORWARD_PROFILE=1`` before
    ``dedicate_params``). ``synchronize=True`` syncs the device first so the numbers are
    complete; do not call it inside a timed loop.

    Per group and in total: ``unshards`` issued (``prefetched`` of them ahead of need),
    ``waits`` and how many found the collective already finished (``found_ready``), host
    ``wait_s`` (blocking on gloo; ~0 on CUDA where the wait is a stream dependency),
    ``stream_stall_s`` (CUDA: how long the compute stream stood still at those waits, from
    events), bytes received, and the owner reduces issued with their bytes. Counters are
    cumulative since ``dedicate_params``.

    HSDP adds the replicate stage: ``replicate_reduces``/``replicate_bytes_reduced`` (gradients
    to global owners), ``publishes``/``publish_broadcasts``/``publish_bytes`` (post-step
    broadcasts this rank joined), ``publish_waits`` (forward unshards that waited for one),
    ``publish_not_ready`` (how many of those found the broadcast not finished yet: the part
    the previous compute did not hide), ``publish_wait_s`` (host) and ``publish_stall_s`` (CUDA
    stream stall, events).

    TP adds ``tp``: ``gathers``/``gather_bytes`` and ``scatters``/``scatter_bytes`` of the TP
    stage (bytes this rank sent to / received from TP owners), ``waits`` (forward unshards that
    applied a pending update scatter, ``replicate_async=True``), ``not_ready`` (of those, the
    ones whose scatter had not finished) and host ``wait_s``.

    Example::

        profile = dmuon.collect_forward_unshard_profile(model, synchronize=True)
    """
    runtime = runtime_of(model)
    if runtime is None:
        return {"enabled": False, "reason": "no dedicated parameters (dedicate_params not called)"}
    if synchronize and runtime.groups and runtime.groups[0].device.type == "cuda":
        torch.cuda.synchronize(runtime.groups[0].device)
    if not runtime.record_profile:
        return {
            "enabled": False,
            "reason": "set DMUON_RECORD_FORWARD_PROFILE=1 before dmuon.dedicate_params()",
        }
    groups = {}
    total = None
    for g in runtime.groups:
        if synchronize:
            g.collect_stalls()
        row = dict(vars(g.profile))
        groups[g.name] = row
        total = dict.fromkeys(row, 0) if total is None else total
        for k in total:
            total[k] += row[k]
    out = {"enabled": True, "rank": runtime.rank, "groups": groups, "total": total or {}}
    if runtime.replicated:
        out["replicate_rank"] = runtime.replicate_mesh.get_local_rank()
    stage = getattr(runtime, "tp", None)
    if stage is not None:  # TP: gathers/scatters and the forwards that waited for a scatter
        out["tp"] = dict(vars(stage.profile))
    return out


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Drain every collective the runtime has in flight and free unsharded buffers.

    Safe at any point outside forward/backward (shutdown, checkpoint, evaluation, after an
    exception mid-forward); a no-op for a model without dedicated parameters. With HSDP it
    also waits for the replicate broadcasts ``Muon.step`` left in flight
    (``replicate_async=True``) and for gradient reduces to global owners. Collective-free
    itself: it only waits for work every rank has already issued.

    Example::

        try:
            train()
        except KeyboardInterrupt:
            dmuon.wait_all_replicate_broadcasts(model)
    """
    runtime = runtime_of(model)
    if runtime is not None:
        runtime.wait_all()
