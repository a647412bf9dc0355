"""What dmuon_compile reads from DTensor and DeviceMesh internals, in one module.

Owner tensors (``_owner/tensor.py``) are DTensors built from a local tensor and a ``DTensorSpec``
(DTensor's own constructor, no redistribution), whose norms are ``_NormPartial``; the owner
meshes are one-rank ``DeviceMesh`` objects built without a backend (``_init_backend=False``:
no process group per owner); the HSDP and TP checks read a slice's root mesh. Each accessor
raises :class:`dmuon_compile._compat.TorchInternalsError` when this torch moved what it reads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon_compile._compat import PrivateAPI, torch_internals_error

_MODULE = "distributed/_compat/dtensor.py"
_OWNER = "owner tensors (dedicated weights)"

_SPEC = PrivateAPI("torch.distributed.tensor._dtensor_spec", "DTensorSpec", _OWNER, _MODULE)
_META = PrivateAPI("torch.distributed.tensor._dtensor_spec", "TensorMeta", _OWNER, _MODULE)
_NORM_PARTIAL = PrivateAPI(
    "torch.distributed.tensor._ops._math_ops",
    "_NormPartial",
    "clip_grad_norm_ over dedicated weights",
    _MODULE,
)
_ROOT_MESH = PrivateAPI(
    "torch.distributed.device_mesh",
    "DeviceMesh._get_root_mesh",
    "the HSDP and TP mesh checks",
    _MODULE,
)


_FULL_LOAD = "full state dicts loaded into dedicated weights (torch's set_*_state_dict)"
# The two calls torch's full-state loads place each tensor with (read on torch 2.13): the
# distribution of a dict held on every rank, and the copy after the broadcast from rank 0.
_SD_DISTRIBUTE = PrivateAPI(
    "torch.distributed._state_dict_utils", "distribute_tensor", _FULL_LOAD, _MODULE
)
_SD_DISTRIBUTE_TENSORS = PrivateAPI(
    "torch.distributed._state_dict_utils", "_distribute_tensors", _FULL_LOAD, _MODULE
)


def route_full_state_loads(distribute, distribute_tensors) -> None:
    """Route the two calls by which torch's full-state loads (``set_model_state_dict`` /
    ``set_optimizer_state_dict`` with ``full_state_dict=True``, with or without
    ``broadcast_from_rank0``) place a tensor into a DTensor through ``distribute(original, ...)``
    and ``distribute_tensors(original, ...)``, which handle owner meshes and call ``original``
    otherwise. Owner meshes have no process group (``distribute_tensor`` broadcasts on one) and
    a rank outside one holds nothing (the copy after the broadcast slices for every rank).
    Installed once, as attributes of ``torch.distributed._state_dict_utils``, where torch's own
    calls look them up; resolved uncached, so a second call finds its wrappers in place."""
    import torch.distributed._state_dict_utils as utils

    for api, route in ((_SD_DISTRIBUTE, distribute), (_SD_DISTRIBUTE_TENSORS, distribute_tensors)):
        original = api.resolve()
        if not getattr(original, "dmuon_routed", False):
            setattr(utils, api.path, _routed(route, original))


def _routed(route, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        return route(original, *args, **kwargs)

    call.dmuon_routed = True
    return call


def check_dtensor_layout() -> None:
    """Raise unless DTensor keeps its local tensor and spec in the slots ``_local_tensor`` and
    ``_spec`` (read directly on the hot path; owner tensors are built from them with
    ``DTensor(local, spec, requires_grad=...)``, DTensor's own constructor). Run at import."""
    if not {"_local_tensor", "_spec"} <= set(getattr(DTensor, "__slots__", ())):
        raise torch_internals_error(
            "DTensor._local_tensor / DTensor._spec (DTensor.__slots__)", _OWNER, _MODULE
        )


check_dtensor_layout()


def local_tensor(t: DTensor):
    """``t._local_tensor``: this rank's data, without ``to_local()``'s autograd node and
    without an owner tensor's pending-update drain."""
    return t._local_tensor


def set_local_tensor(t: DTensor, local) -> None:
    """``t._local_tensor = local``: the same DTensor (its spec, its wrapper's device, its
    identity as a parameter) over another tensor of the same shape and dtype."""
    t._local_tensor = local


def spec(t: DTensor):
    """``t._spec``: the ``DTensorSpec`` (mesh, placements, global shape) of ``t``."""
    return t._spec


def set_spec_mesh(t: DTensor, mesh: DeviceMesh) -> None:
    """``t._spec`` with its mesh replaced by ``mesh`` (an equal mesh object: lookups by
    identity find it)."""
    t._spec = dataclasses.replace(t._spec, mesh=mesh)


def set_pickled_state(t, state) -> None:
    """``torch._utils._set_obj_state``: what ``Tensor.__setstate__`` does for a tensor
    subclass's unpickled state."""
    import torch._utils

    torch._utils._set_obj_state(t, state)


def make_spec(mesh: DeviceMesh, placements, shape, stride, dtype):
    """``DTensorSpec(mesh, placements, TensorMeta(shape, stride, dtype))``."""
    return _SPEC.get()(mesh, tuple(placements), tensor_meta=_META.get()(shape, stride, dtype))


def norm_partial():
    """The ``_NormPartial`` placement class (a partial p-norm over a mesh dim)."""
    return _NORM_PARTIAL.get()


def root_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh ``mesh`` was sliced from (``None`` for a mesh built on its own)."""
    root = _ROOT_MESH.get()(mesh)
    return root if root is not None and root is not mesh else None


def _init_backend_kwargs() -> dict:
    if "_init_backend" not in inspect.signature(DeviceMesh.__init__).parameters:
        raise torch_internals_error("DeviceMesh(..., _init_backend=False)", "owner meshes", _MODULE)
    return {"_init_backend": False}


_NO_BACKEND: dict | None = None


def mesh_without_backend(device_type: str, ranks, mesh_dim_names=None) -> DeviceMesh:
    """``DeviceMesh(device_type, ranks)`` built on every rank without creating a process group
    (owner meshes never communicate; TP owner groups use the existing TP group's)."""
    global _NO_BACKEND
    if _NO_BACKEND is None:
        _NO_BACKEND = _init_backend_kwargs()
    ranks = [int(r) for r in ranks]
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, **_NO_BACKEND)
