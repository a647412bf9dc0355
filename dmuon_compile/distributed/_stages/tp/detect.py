"""The TP axis of a model: which mesh ``parallelize_module`` used, and which ranks form its TP
groups (the rows of the DP × TP grid)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon_compile.distributed import mesh_checks
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat


@dataclass(frozen=True)
class TPInfo:
    """The TP axis of a model: this rank's TP mesh (the one ``parallelize_module`` used)."""

    mesh: DeviceMesh
    dim_name: str
    # The DP × TP mesh FSDP2 puts TP parameters on (:func:`dp_tp_mesh`); None: TP mesh alone.
    dp_tp: DeviceMesh | None = None

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


def detect_tp(selected, dp_mesh: DeviceMesh, replicate_mesh=None) -> TPInfo | None:
    """The TP axis of the selected DTensor parameters (``None`` when there are none).

    The TP dims are each parameter's ``DTensor.mesh_dim_names`` minus the data-parallel names
    (the names of ``mesh`` and ``replicate_mesh``), so every mesh must be named. Supported:
    one TP dim, each weight ``Shard(0)`` (colwise) or ``Shard(1)`` (rowwise) with an even split.
    """
    dp_names: set[str] = set()
    dtensors = [(n, p) for n, p in selected if isinstance(p, DTensor)]
    if not dtensors:
        return None
    for m in (dp_mesh, replicate_mesh):
        if m is None:
            continue
        if m.mesh_dim_names is None:
            raise ValueError(
                f"{mesh_checks.TP_ERROR}\n(the data-parallel mesh passed to dedicate_params has "
                "no mesh_dim_names)"
            )
        dp_names.update(m.mesh_dim_names)
    info = None
    for name, p in dtensors:
        mesh = p.device_mesh
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"{mesh_checks.TP_ERROR}\n(parameter {name} is a DTensor on an unnamed mesh)"
            )
        tp_names = [n for n in mesh.mesh_dim_names if n not in dp_names]
        if mesh.ndim != 1 or len(tp_names) != 1:
            raise ValueError(
                f"dedicate_params: {name} is a DTensor on mesh dims {mesh.mesh_dim_names}; with "
                f"data-parallel dims {sorted(dp_names)} that leaves TP dims {tp_names}. Supported: "
                'one TP dim: parallelize_module(model, mesh["tp"], plan), then '
                'dedicate_params(model, mesh["dp"]) (or mesh["shard"] with replicate_mesh=).'
            )
        placement = p.placements[0]
        if p.ndim == 3 and isinstance(placement, Shard) and placement.dim == 0:
            raise ValueError(
                f"dedicate_params: {name} is an expert-parallel stack (Shard(0) over mesh dim "
                f"{mesh.mesh_dim_names}); it cannot be dedicated. Leave it out of the predicate "
                "(the default does): each rank's Muon then orthogonalises its own whole experts."
            )
        if not isinstance(placement, Shard) or placement.dim not in (0, 1) or p.ndim != 2:
            raise ValueError(
                f"dedicate_params: {name} is a {p.ndim}-D DTensor with placement {placement}; TP "
                "dedication supports 2-D weights sharded by ColwiseParallel (Shard(0)) or "
                "RowwiseParallel (Shard(1)). Exclude it with predicate= (it then gets AdamW)."
            )
        if p.shape[placement.dim] % mesh.size() != 0:
            raise ValueError(
                f"dedicate_params: {name} has shape {tuple(p.shape)}, dim {placement.dim} not "
                f"divisible by the TP size {mesh.size()}; the TP gather needs even shards. Pick "
                "sizes divisible by the TP size or exclude it with predicate=."
            )
        if info is None:
            info = TPInfo(mesh, tp_names[0], dp_tp_mesh(dp_mesh, replicate_mesh, mesh))
        elif mesh != info.mesh:
            raise ValueError(
                f"dedicate_params: {name} lives on TP mesh {mesh}, another weight on {info.mesh}; "
                "use one TP mesh for the whole model."
            )
    return info


def detect_tp_mesh(model: nn.Module, dp_mesh: DeviceMesh, replicate_mesh=None) -> TPInfo | None:
    """The TP axis of a model none of whose *dedicated* weights is TP-sharded (``None`` when
    no parameter is a DTensor on a named mesh with one data-parallel-free dim).

    Its plain dedicated weights are held by every TP rank of the owner's column all the same,
    so they need the TP stage's one-master rule (:meth:`TPStage.broadcast_plain`).
    """
    dp_names = {
        n for m in (dp_mesh, replicate_mesh) if m is not None for n in m.mesh_dim_names or ()
    }
    for p in model.parameters():
        if p.ndim != 2:  # expert stacks sharded over an ``ep`` mesh: no TP axis for matrices
            continue
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        if mesh is None or mesh.ndim != 1 or mesh.mesh_dim_names is None:
            continue
        (name,) = mesh.mesh_dim_names
        if name not in dp_names and mesh.size() > 1:
            return TPInfo(mesh, name, dp_tp_mesh(dp_mesh, replicate_mesh, mesh))
    return None


def dp_grid_mesh(mesh: DeviceMesh, replicate_mesh) -> DeviceMesh:
    """The data-parallel mesh of this rank's TP coordinate: ``mesh`` (1-D), or the 2-D
    (replicate, shard) mesh of the HSDP slices, whatever their names."""
    if replicate_mesh is None:
        return mesh
    return mesh_checks.hsdp_mesh(mesh, replicate_mesh)


def dp_tp_mesh(mesh: DeviceMesh, replicate_mesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The data-parallel dims then the TP dim: the mesh FSDP2 puts a TP parameter on (and the
    rows of TP groups), also for slices of a mesh unflattened from a flattened 1-D root (where
    the root itself has none of these dims). ``None`` when the meshes are unrelated."""
    try:
        return _fsdp_compat.joined_mesh([dp_grid_mesh(mesh, replicate_mesh), tp_mesh])
    except RuntimeError:
        return None


def owner_group_ranks(info: TPInfo, rank_grid, replica_owner: int, owner: int) -> list[int]:
    """Global ranks of the TP group at DP coordinate ``(replica_owner, owner)``, in TP order."""
    return tp_row(info, int(rank_grid[replica_owner, owner]))  # that coordinate in this column


def tp_row(info: TPInfo, global_rank: int) -> list[int]:
    """Global ranks of the TP group that holds ``global_rank``, in TP order."""
    root = info.dp_tp
    if root is None:
        rows = info.mesh.mesh.reshape(1, -1)
    else:
        axis = list(root.mesh_dim_names).index(info.dim_name)
        rows = root.mesh.movedim(axis, -1).reshape(-1, info.size)
    for row in rows.tolist():
        if global_rank in row:
            return [int(r) for r in row]
    raise RuntimeError(f"rank {global_rank} is in no TP group of {root}")  # a mesh we cannot read
