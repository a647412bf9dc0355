"""A dedicated TP shard (:class:`TPDedicatedParam`): its compute copy (a DTensor on this rank's TP
mesh over the group's unsharded buffer) and its registered parameter (an ``OwnerTensor`` on the
owner TP group, ``_owner/tensor.py``), with the owner groups' meshes it needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon_compile.distributed._compat import dtensor as _dt
from dmuon_compile.distributed._owner.param import DedicatedParam
from dmuon_compile.distributed._owner.tensor import local_of, make_owned, wrap_like
from dmuon_compile.distributed._stages.tp.detect import TPInfo

_TP_MESHES: dict[tuple, DeviceMesh] = {}


def owner_tp_mesh(info: TPInfo, ranks: list[int]) -> DeviceMesh:
    """The TP group of the owner's DP coordinate: this rank's own TP mesh when it is a member
    (it has a process group, so DTensor ops that communicate work there), else a backend-less
    mesh (``full_tensor()`` gathers over the model part's data-parallel × TP mesh, not this
    one, so it needs none)."""
    if sorted(ranks) == sorted(int(r) for r in info.mesh.mesh.flatten().tolist()):
        return info.mesh
    key = (info.mesh.device_type, tuple(ranks), info.dim_name)
    mesh = _TP_MESHES.get(key)
    if mesh is None:
        mesh = _dt.mesh_without_backend(info.mesh.device_type, ranks, (info.dim_name,))
        _TP_MESHES[key] = mesh
    return mesh


@dataclass(eq=False)
class TPDedicatedParam(DedicatedParam):
    """A dedicated TP shard: ``shape`` is the local shard's (what the DP group moves)."""

    global_shape: torch.Size | None = None
    shard_dim: int = 0
    tp_owner: int = 0  # t*: the TP rank that runs NS on the whole matrix
    tp_mesh: DeviceMesh | None = None  # this rank's TP mesh (the compute copy's)
    reg_mesh: DeviceMesh | None = None  # the owner TP group (the registered parameter's)

    def bind(self, flat: Tensor) -> None:
        local = torch.empty(0, dtype=flat.dtype, device=flat.device)
        with torch.no_grad():
            local.set_(flat.untyped_storage(), flat.storage_offset() + self.offset, self.shape)
        self.unsharded = _dtensor(local, self.tp_mesh, self.shard_dim, self.global_shape, True)

    def register(self, mesh, master: Tensor | None, device: torch.device) -> None:  # noqa: ARG002
        # An OwnerTensor on the owner group: full_tensor(), clip_grad_norm_ and DCP's full state
        # dict treat it like a plain dedicated weight (_owner/tensor.py).
        self.param = make_owned(
            master,
            self.reg_mesh,
            self.global_shape,
            self.orig_dtype,
            device,
            requires_grad=True,
            placement=Shard(self.shard_dim),
        )
        self.param._is_param = True
        self.owns = master is not None
        self._empty_grad = None if self.owns else self._wrap(None)
        self.module._parameters[self.attr] = self.param

    def _wrap(self, local: Tensor | None) -> DTensor:
        return wrap_like(local, self.param)

    @torch.no_grad()
    def accumulate_grad(self, full: Tensor | None) -> None:
        grad = self.param.grad
        if grad is None and full is None:
            self.param.grad = self._empty_grad if self._empty_grad is not None else self._wrap(None)
        elif grad is None:
            self.param.grad = self._wrap(full.to(self.orig_dtype))
        elif full is not None:
            local_of(grad).add_(full.to(self.orig_dtype))


def _dtensor(local: Tensor, mesh: DeviceMesh, dim: int, shape, requires_grad: bool) -> DTensor:
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    plain = DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=stride
    )
    return DTensor(_dt.local_tensor(plain), _dt.spec(plain), requires_grad=requires_grad)


def make_tp_param(
    name,
    module,
    attr,
    owner,
    p: DTensor,
    orig_dtype,
    param_dtype,
    replica_owner,
    tp_owner,
    info,
    reg_ranks,
) -> TPDedicatedParam:
    local_shape = p.to_local().shape
    return TPDedicatedParam(
        name,
        module,
        attr,
        owner,
        local_shape,
        orig_dtype,
        param_dtype,
        replica_owner=replica_owner,
        global_shape=p.shape,
        shard_dim=p.placements[0].dim,
        tp_owner=tp_owner,
        tp_mesh=info.mesh,
        reg_mesh=owner_tp_mesh(info, reg_ranks),
    )
