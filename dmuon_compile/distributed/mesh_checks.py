"""Mesh validation for ``dedicate_params``: shard mesh, HSDP replicate mesh (TP detection:
``_tp.detect_tp``, with :data:`TP_ERROR`)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

HSDP_SNIPPET = (
    "from torch.distributed.device_mesh import init_device_mesh\n\n"
    "hsdp = init_device_mesh(\n"
    '    "cuda",\n'
    "    (replicate_size, shard_size),\n"
    '    mesh_dim_names=("replicate", "shard"),\n'
    ")\n"
    'dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])'
)
HSDP_ERROR = "HSDP mesh must be 2D with names ('replicate', 'shard')"
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
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else None
    return root if root is not None and root is not mesh else None


def check_replicate_mesh(mesh: DeviceMesh, replicate_mesh) -> None:
    """``replicate_mesh`` is ``hsdp["replicate"]`` and ``mesh`` is ``hsdp["shard"]`` of one 2-D
    ``("replicate", "shard")`` mesh (a 3-D mesh whose first names are those, with TP last, also
    passes); anything else raises the documented error with the snippet that builds the right mesh.
    """
    if replicate_mesh is None:
        return
    message = f"{HSDP_ERROR}: pass the two 1-D slices of such a mesh. Fix:\n{HSDP_SNIPPET}"
    if not isinstance(replicate_mesh, DeviceMesh):
        raise ValueError(f"{message}\n(replicate_mesh is a {type(replicate_mesh).__name__})")  # noqa: TRY004 - the documented error
    if replicate_mesh.ndim != 1 or replicate_mesh.mesh_dim_names != ("replicate",):
        raise ValueError(
            f"{message}\n(replicate_mesh has {replicate_mesh.ndim} dims named "
            f"{replicate_mesh.mesh_dim_names})"
        )
    if mesh.mesh_dim_names != ("shard",):
        raise ValueError(f"{message}\n(mesh has names {mesh.mesh_dim_names}; expected ('shard',))")
    rep_root, shard_root = _root(replicate_mesh), _root(mesh)
    if rep_root is None or shard_root is None:
        raise ValueError(
            f"{message}\n(a 1-D mesh built on its own was passed; slice both from the 2-D mesh)"
        )
    if rep_root is not shard_root and rep_root != shard_root:
        raise ValueError(f"{message}\n(mesh and replicate_mesh were sliced from different meshes)")
    names = tuple(rep_root.mesh_dim_names or ())
    if names[:2] != ("replicate", "shard"):
        raise ValueError(f"{message}\n(parent mesh names {names or None})")
