"""Mesh validation for ``dedicate_params``: shard mesh, HSDP replicate mesh (TP detection:
``_stages.tp.detect_tp``, with :data:`TP_ERROR`). The fix snippets in the errors name the job's
device type (:func:`job_device_type`): ``init_device_mesh("cpu", ...)`` on a gloo job on CPUs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon_compile.distributed._compat import dtensor as _dtensor_compat
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat


def job_device_type(mesh=None) -> str:
    """The device type the fix snippets name: the mesh's, else the one the default process
    group's backend serves (``gloo`` → ``"cpu"``, ``nccl`` → ``"cuda"``; an accelerator first
    where it serves several), else ``"cuda"`` when this process sees a GPU."""
    if isinstance(mesh, DeviceMesh):
        return mesh.device_type
    if dist.is_available() and dist.is_initialized():
        served: dict[str, str] = {}  # backend → its first device type (gloo → cpu, not mps)
        for device_type, name in dist.Backend.default_device_backend_map.items():
            served.setdefault(name, device_type)
        names = [part.rpartition(":")[2] for part in str(dist.get_backend()).split(",")]
        devices = [served[n] for n in names if n in served]
        if devices:
            return next((d for d in devices if d != "cpu"), devices[0])
    return "cuda" if torch.cuda.is_available() else "cpu"


def hsdp_snippet(device_type: str = "cuda") -> str:
    """The code that builds an HSDP mesh and passes its two dims, for ``device_type``."""
    return (
        "from torch.distributed.device_mesh import init_device_mesh\n\n"
        "hsdp = init_device_mesh(\n"
        f'    "{device_type}",\n'
        "    (replicate_size, shard_size),\n"
        '    mesh_dim_names=("replicate", "shard"),\n'
        ")\n"
        'dmuon.dedicate_params(model, hsdp["shard"], replicate_mesh=hsdp["replicate"])'
    )


def tp_error(device_type: str = "cuda") -> str:
    """The error for an unnamed mesh under TP, with the snippet for ``device_type``."""
    return (
        "DMuon requires named DeviceMesh for TP detection: it finds the TP axis by subtracting "
        "the data-parallel dim names from each parameter's DTensor.mesh_dim_names. Fix: build "
        "the mesh with names, e.g.\n"
        f'    mesh = init_device_mesh("{device_type}", (dp_size, tp_size), '
        'mesh_dim_names=("dp", "tp"))'
    )


# The names are examples: any two named dims of one mesh work (torchtitan: dp_replicate, fsdp).
HSDP_ERROR = (
    "HSDP mesh must be 2D with names ('replicate', 'shard') (or any two named dims of one mesh, "
    "e.g. torchtitan's ('dp_replicate', 'fsdp'))"
)


def __getattr__(name: str) -> str:
    # HSDP_SNIPPET and TP_ERROR (read as module attributes where the error is raised) name the
    # job's device type, not always "cuda": a gloo job on CPUs gets init_device_mesh("cpu", ...).
    if name == "HSDP_SNIPPET":
        return hsdp_snippet(job_device_type())
    if name == "TP_ERROR":
        return tp_error(job_device_type())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_shard_mesh(mesh) -> None:
    """The shard mesh is a 1-D DeviceMesh (``init_device_mesh(dev, (n,))`` or ``hsdp["shard"]``)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "dedicate_params(model, mesh, ...): mesh must be a DeviceMesh, got "
            f"{type(mesh).__name__}. "
            f'Fix: mesh = init_device_mesh("{job_device_type()}", (world_size,))'
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"dedicate_params: mesh must be the 1-D shard mesh, got a {mesh.ndim}-D mesh with "
            "names "
            f"{mesh.mesh_dim_names}. For HSDP pass mesh=hsdp['shard'] and replicate_mesh="
            f"hsdp['replicate']:\n{hsdp_snippet(mesh.device_type)}"
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
    snippet = hsdp_snippet(mesh.device_type)
    message = f"{HSDP_ERROR}: pass the two 1-D slices of such a mesh. Fix:\n{snippet}"
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
            f"Fix:\n{hsdp_snippet(mesh.device_type)}"
        ) from exc
