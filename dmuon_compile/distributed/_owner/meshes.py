"""The owner meshes of dedicated weights and what is known about them, process-wide.

An owner mesh is a rank's one-rank mesh (:func:`owner_mesh`), or a TP weight's owner group mesh
(:func:`register_group`); :data:`MESHES` holds, per mesh, the norm mesh its tensors' norms are
given on (``_owner/norms.py``), its group's ranks and the rank ``full_tensor`` broadcasts from
(``_owner/tensor.py``). Also the queries on a tensor's holder: :func:`is_owned`, :func:`owner_rank`,
:func:`local_of`.

Every owner mesh has a named dimension, as the meshes torchtitan builds do: a one-rank owner
mesh's is :data:`OWNER_DIM` (a TP owner group's is its TP dim's name). Tools that read the names
of a parameter's mesh — torchtitan's gradient clipping with expert parallelism asserts that every
parameter's mesh has names and sorts the ``"ep"`` ones apart — treat a dedicated weight like any
DTensor parameter, without the ``"ep"`` dim: a dense weight.

An owner tensor's collectives (``full_tensor``'s broadcasts) run on its *norm mesh*'s process
groups (:func:`collective_mesh`): the data-parallel (× TP) ranks of the model part that holds it,
which are exactly the ranks that hold its dedicated weights. With pipeline parallelism that is
one stage's ranks; the other stages, busy with their own weights, are never part of them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon_compile.distributed._compat import dtensor as _dt


class MeshRegistry:
    """What is known about the meshes of dedicated weights, in one object.

    Process-wide, because the lookups run inside DTensor dispatch, where only the tensor's
    mesh is at hand; but an owner mesh is built per ``(device type, rank, data-parallel mesh)``
    (``owner_mesh``), so two models of one process (a TP model, then a plain one; a model and
    its teacher) never read each other's norm mesh or broadcast source. Keyed by ``id(mesh)`` (a
    DeviceMesh compares by its layout, and an owner group's mesh may be equal to this rank's own
    TP mesh); ``keep`` holds the meshes so no id is reused (by id: a mesh recorded again, at
    each ``dedicate_params`` over it, is held once).
    """

    def __init__(self) -> None:
        # (device type, rank, id(data-parallel mesh)) -> the one-rank owner mesh
        self.owner_meshes: dict[tuple[str, int, int], DeviceMesh] = {}
        # (device type, rank) -> the latest of them: an unpickled copy's stand-in (_owner/tensor.py)
        self.latest: dict[tuple[str, int], DeviceMesh] = {}
        self.owner_of: dict[int, int] = {}  # id(owner mesh) -> the owner's global rank (hot path)
        # id(owner mesh) -> (norm mesh, placements): where the norms of its tensors are given.
        self.norm_of: dict[int, tuple] = {}
        # id(owner group mesh) -> its global ranks in mesh order: a TP weight's owner group,
        # shard t on the t-th rank (its mesh may be this rank's TP mesh, _stages.tp.owner_tp_mesh).
        self.group_ranks: dict[int, tuple[int, ...]] = {}
        # id(one-rank owner mesh) -> the rank full_tensor broadcasts from. In a TP model a plain
        # weight has one owner per TP column (each column's copy is the same): all ranks agree
        # on column 0's.
        self.source_of: dict[int, int] = {}
        self.keep: dict[int, DeviceMesh] = {}

    def hold(self, mesh: DeviceMesh) -> None:
        """Keep ``mesh`` alive as long as the registry (its id is a key here)."""
        self.keep[id(mesh)] = mesh


# The name of a one-rank owner mesh's dimension (not "ep": a dedicated weight is a dense one).
OWNER_DIM = "dmuon_owner"

# The one process-wide mesh registry: DTensor dispatch forces it (an owner tensor's ops see only
# its mesh, never a runtime); per-runtime state lives in each runtime's ``CommContext``.
MESHES = MeshRegistry()


def set_norm_mesh(mesh: DeviceMesh, norm_mesh: DeviceMesh, partial_dims=None) -> None:
    """Give the norms of owner ``mesh``'s tensors on ``norm_mesh`` (FSDP2's mesh, or the DP × TP
    mesh of a TP model), partial over the dims named in ``partial_dims`` (``None``: all) and
    ``Replicate`` over the others (a plain weight of a TP model: one owner per TP column)."""
    names = norm_mesh.mesh_dim_names or (None,) * norm_mesh.ndim
    partial = [partial_dims is None or n in partial_dims for n in names]
    MESHES.norm_of[id(mesh)] = (norm_mesh, partial, _dt.norm_partial())
    MESHES.hold(mesh)


def set_dp_mesh(mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """Record the data-parallel mesh (FSDP2's) that owner ``mesh``'s norms are given on."""
    set_norm_mesh(mesh, dp_mesh)


def register_group(mesh: DeviceMesh, ranks) -> None:
    """Record an owner group mesh (a TP weight's owner TP group) and its global ranks."""
    MESHES.group_ranks[id(mesh)] = tuple(int(r) for r in ranks)
    MESHES.hold(mesh)


def set_source(mesh: DeviceMesh, rank: int) -> None:
    """The rank ``full_tensor`` broadcasts owner ``mesh``'s tensors from (default: the owner)."""
    MESHES.source_of[id(mesh)] = int(rank)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def is_owner_mesh(mesh: DeviceMesh) -> bool:
    return id(mesh) in MESHES.owner_of or id(mesh) in MESHES.group_ranks


def owner_mesh(device_type: str, global_rank: int, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The one-rank mesh of ``global_rank`` for the weights dedicated over ``dp_mesh`` (cached;
    built the same way on every rank).

    It needs no process group (a one-rank DTensor never communicates), so none is created where
    the torch version allows it.
    """
    key = (device_type, int(global_rank), id(dp_mesh))
    mesh = MESHES.owner_meshes.get(key)
    if mesh is None:
        mesh = _dt.mesh_without_backend(device_type, [global_rank], (OWNER_DIM,))
        MESHES.owner_meshes[key] = mesh
        MESHES.owner_of[id(mesh)] = int(global_rank)
        MESHES.hold(dp_mesh)  # its id is in the key
    MESHES.latest[(device_type, int(global_rank))] = mesh
    return mesh


def collective_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh whose process groups owner ``mesh``'s collectives run on: its norm mesh (the
    data-parallel, or DP × TP, mesh of the model part that holds it); ``None`` if no
    ``dedicate_params`` of this process made ``mesh``."""
    entry = MESHES.norm_of.get(id(mesh))
    return entry[0] if entry is not None else None


def empty_local(dtype: torch.dtype, device: torch.device) -> Tensor:
    """What a rank outside the owner mesh holds (DTensor's convention: an empty tensor)."""
    return torch.empty(0, dtype=dtype, device=device)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (the whole tensor on its owner, empty elsewhere), else "
    "``t``."""
    return _dt.local_tensor(t) if isinstance(t, DTensor) else t


def is_owned(t) -> bool:
    """True for a DTensor on a one-rank owner mesh (a dedicated weight, its gradient or its
    state; the shards of a TP weight on their owner group are not)."""
    if not isinstance(t, DTensor):
        return False
    mesh = t.device_mesh
    if id(mesh) in MESHES.owner_of:  # the per-step path: the very mesh objects made here
        return True
    return (
        mesh.ndim == 1
        and mesh.size() == 1
        and MESHES.latest.get((mesh.device_type, int(mesh.mesh.reshape(-1)[0]))) == mesh
    )


def owner_rank(t: DTensor) -> int:
    """Global rank that holds ``t`` (an owner tensor)."""
    rank = MESHES.owner_of.get(id(t.device_mesh))
    return rank if rank is not None else int(t.device_mesh.mesh.reshape(-1)[0])
