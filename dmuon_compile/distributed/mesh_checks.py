"""Mesh validation for ``dedicate_params``: shard mesh, HSDP replicate mesh (TP detection:
``_tp.detect_tp``, with :data:`TP_ERROR`)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from dmuon_compile.distributed import _dtensor_compat, _fsdp_compat

HSDP_SNIPPET = (
    "from torch.distributed.device_mesh import init_device_mesh\n\n"
    "hsdp = init_device_mesh(\n"
    '    "cuda",\n'
    "    (replicate_size, shard_size),\n"
    '    mesh_dim_names=("replicate", "shard"),\n'
    ")\n"
    'dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])'
)
# The names are examples: any two named dims of one mesh work (torchtitan: dp_replicate, fsdp).
HSDP_ERROR = (
    "HSDP mesh must be 2D with names ('replicate', 'shard') (or any two named dims of one mesh, "
    "e.g. torchtitan's ('dp_replicate', 'fsdp'))"
)
TP_ERROR = (
    "DMuon requires named DeviceMesh for TP detection: it finds the TP axis by subtracting the "
    "data-parallel dim names from each parameter's DTensor.mesh_dim_names. Fix: build the mesh "
    "with names, e.g.\n"
    '    mesh = init_device_mesh("cuda", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))'
)


def check_shard_mesh(mesh) -> None:
    """The shard mesh is a 1-D DeviceMesh (``init_device_mesh(dev, (n,))`` or ``hsdp["shard"]``)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "dedicate_params(model, mesh, ...): mesh must be a DeviceMesh, got "
            f"{type(mesh).__name__}. "
            'Fix: mesh = init_device_mesh("cuda", (world_size,))'
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"dedicate_params: mesh must be the 1-D shard mesh, got a {mesh.ndim}-D mesh with "
            "names "
            f"{mesh.mesh_dim_names}. For HSDP pass mesh=hsdp['shard'] and replicate_mesh="
            f"hsdp['replicate']:\n{HSDP_SNIPPET}"
        )


def _root(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh ``mesh`` was sliced from (``None`` for a mesh built on its own)."""
    return _dtensor_compat.root_mesh(mesh)


def check_replicate_mesh(mesh: DeviceMesh, replicate_mesh) -> None:
    """``replicate_mesh`` and ``mesh`` are the replicate and shard dims of one HSDP mesh: two
    named 1-D slices of one mesh, whatever their names (``hsdp["replicate"]``/``hsdp["shard"]``,
    torchtitan's ``"dp_replicate"``/``"fsdp"``), also when that mesh was unflattened from a
    flattened 1-D root. Unnamed meshes, a mesh built on its own, slices of different meshes or
    one dim twice raise the documented error with the snippet that builds the right mesh.
    """
    if replicate_mesh is None:
        return
    message = f"{HSDP_ERROR}: pass the two 1-D slices of such a mesh. Fix:\n{HSDP_SNIPPET}"
    if not isinstance(replicate_mesh, DeviceMesh):
        raise ValueError(f"{message}\n(replicate_mesh is a {type(replicate_mesh).__name__})")  # noqa: TRY004 - the documented error
    if replicate_mesh.ndim != 1 or replicate_mesh.mesh_dim_names is None:
        raise ValueError(
            f"{message}\n(replicate_mesh has {replicate_mesh.ndim} dims named "
            f"{replicate_mesh.mesh_dim_names})"
        )
    if mesh.mesh_dim_names is None or mesh.mesh_dim_names == replicate_mesh.mesh_dim_names:
        raise ValueError(
            f"{message}\n(mesh has names {mesh.mesh_dim_names}, replicate_mesh "
            f"{replicate_mesh.mesh_dim_names}: two different named dims are needed)"
        )
    rep_root, shard_root = _root(replicate_mesh), _root(mesh)
    if rep_root is None or shard_root is None:
        raise ValueError(
            f"{message}\n(a 1-D mesh built on its own was passed; slice both from the 2-D mesh)"
        )
    if rep_root is not shard_root and rep_root != shard_root:
        raise ValueError(f"{message}\n(mesh and replicate_mesh were sliced from different meshes)")
    hsdp_mesh(mesh, replicate_mesh)  # the two dims must be different dims of that mesh


def hsdp_mesh(mesh: DeviceMesh, replicate_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of the two slices, under their own names: the mesh
    ``fully_shard(..., mesh=...)`` is given for HSDP (equal to the one they were sliced from)."""
    try:
        return _fsdp_compat.joined_mesh([replicate_mesh, mesh])
    except RuntimeError as exc:
        raise ValueError(
            f"{HSDP_ERROR}: mesh {mesh.mesh_dim_names} and replicate_mesh "
            f"{replicate_mesh.mesh_dim_names} are not two dims of one mesh ({exc}). "
            f"Fix:\n{HSDP_SNIPPET}"
        ) from exc
