"""One dedicated parameter's life (the design, with diagrams: docs/dedicated_params.md).

- ``param``: the registered ``nn.Parameter`` under the original name (``module.weight``), on
  every rank: a DTensor of the global shape on the owner's one-rank mesh (``_owner/tensor.py``). Its
  local tensor is the **master** on the owner (whole, original dtype; the optimizer updates it in
  place) and empty elsewhere. This is what ``named_parameters()``, ``state_dict()``, DCP and the
  optimizer see between steps, as they see FSDP2's sharded DTensors.
- ``unsharded``: the compute copy, an ``nn.Parameter`` in the compute dtype (``param_policy``'s
  param_dtype) over a slice of its group's flat buffer. It aliases that slice through
  ``Tensor.set_`` (not a view), so it has its *own* version counter: refilling the buffer after a
  reshard does not trip autograd's saved-tensor version check. The group's unshard swaps it into
  ``module._parameters`` for forward and backward, the reshard swaps ``param`` back (FSDP2 swaps
  its sharded and unsharded parameters the same way). Between uses its storage is freed.
- gradient: accumulated on ``unsharded`` in backward, reduced to the owner, then set as
  ``param.grad``: an owner DTensor with the averaged full gradient on the owner, empty elsewhere.
  Every rank gets one, so every rank's ``parameters()`` have the same gradients and
  ``clip_grad_norm_`` issues the same collectives everywhere.

FSDP2 must not shard ``param``: ``fully_shard`` collects ``module.named_parameters(recurse=False)``,
and the holder module's class (``_owner/holder.py``) leaves dedicated names out of that one call
when FSDP2 makes it.

``Muon(offload="state")`` (``_owner/host_masters.py``): between steps the owner's master lives
in pinned host memory (``host_master``, then also ``param``'s local tensor) and the GPU keeps
``compute_copy``, the master cast to the compute dtype: what the unshard sends.

HSDP (replicate × shard): ``owner`` is the shard rank of the *owner column* (that shard
coordinate in every replica) and ``replica_owner`` the replica whose column member is the
*global owner*. Only the global owner holds the master (one Newton–Schulz per matrix in the
job); the other column members keep ``replica``, a plain copy that the replicate broadcast
refreshes after each step. ``source`` is whichever of the two this rank holds: what it sends
when its shard group unshards the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dmuon_compile.distributed._owner.tensor import local_of, make_owned, wrap_like


@dataclass(eq=False)
class DedicatedParam:
    fqn: str
    module: nn.Module
    attr: str
    owner: int  # rank within the shard group (HSDP: the owner column)
    shape: torch.Size
    orig_dtype: torch.dtype
    compute_dtype: torch.dtype
    param: nn.Parameter | None = None  # the registered owner DTensor (every rank)
    owns: bool = False  # this rank is the (global) owner: it holds the master
    _empty_grad: Tensor | None = None  # off the owner: the empty gradient reused every step
    unsharded: Tensor | None = None
    offset: int = 0  # element offset inside the group's flat buffer
    replica_owner: int = 0  # HSDP: replicate rank of the global owner
    replica: Tensor | None = None  # HSDP: the non-owning column members' copy of the weight
    # offload="state" (``_owner/host_masters.py``), on the owner: the master in host memory and
    # its cast to the compute dtype on the GPU; ``host_version``: the host master's version
    # counter when the compute copy was last cast from it (a write since is seen by it).
    host_master: Tensor | None = None
    compute_copy: Tensor | None = None
    host_version: int = -1
    # HSDP global owner with offload="state": the compute copy is the replicate column buffer,
    # and an HSDP publish inside the step has already cast this step's master into it.
    compute_cast: bool = False

    @property
    def master(self) -> Tensor | None:
        """The whole weight in its original dtype on the (global) owner: ``param``'s local
        tensor."""
        return local_of(self.param) if self.owns and self.param is not None else None

    @property
    def source(self) -> Tensor | None:
        """The whole weight this rank holds (master or replica), ``None`` off the owner column."""
        return self.master if self.master is not None else self.replica

    def unshard_source(self) -> Tensor | None:
        """What this rank sends when its shard group unshards the weight or its replicate group
        publishes it (both cast it to the compute dtype): :attr:`source`; with the master in
        host memory its compute copy (cast again first where the host master was written since:
        an ``nn.init`` or a load between steps), or during a step the master on the GPU (an
        HSDP publish inside the step, before the compute copy is cast)."""
        if self.compute_copy is None:
            return self.source
        master = local_of(self.param)
        if master is not self.host_master:  # swapped in for the step
            return master
        if self.host_master._version != self.host_version:
            self.compute_copy.copy_(self.host_master)
            self.host_version = self.host_master._version
        return self.compute_copy

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def bind(self, flat: Tensor) -> None:
        """Create the compute copy over ``flat[offset : offset + numel]`` (not installed yet)."""
        leaf = nn.Parameter(torch.empty(0, dtype=flat.dtype, device=flat.device))
        with torch.no_grad():
            leaf.set_(flat.untyped_storage(), flat.storage_offset() + self.offset, self.shape)
        self.unsharded = leaf

    def register(self, mesh, master: Tensor | None, device: torch.device) -> None:
        """Create the registered ``param`` on the owner ``mesh`` (``master``: this rank's whole
        tensor, or ``None`` off the owner) and put it in ``module._parameters``."""
        # nn.Parameter(x) of a tensor subclass returns x.detach() marked as a parameter; build
        # the OwnerTensor leaf directly and mark it the same way (FSDP2 registers DTensors so).
        self.param = make_owned(
            master, mesh, self.shape, self.orig_dtype, device, requires_grad=True
        )
        self.param._is_param = True
        self._empty_grad = None if master is not None else wrap_like(None, self.param)
        self.owns = master is not None
        self.module._parameters[self.attr] = self.param

    def use_compute_copy(self) -> None:
        """Forward/backward: ``module.weight`` is the unsharded compute copy."""
        self.module._parameters[self.attr] = self.unsharded

    def use_registered(self) -> None:
        """Between uses: ``module.weight`` is the registered DTensor parameter."""
        self.module._parameters[self.attr] = self.param

    @torch.no_grad()
    def accumulate_grad(self, full: Tensor | None) -> None:
        """Add this rank's part of the reduced gradient to ``param.grad`` (``None``: no rows)."""
        grad = self.param.grad
        if grad is None and full is None:
            # Off the owner: the same empty gradient every step (nothing to allocate or wrap on
            # the per-backward path; in-place ops on it, e.g. clip's scaling, are no-ops).
            self.param.grad = (
                self._empty_grad if self._empty_grad is not None else wrap_like(None, self.param)
            )
        elif grad is None:
            self.param.grad = wrap_like(full.to(self.orig_dtype), self.param)
        elif full is not None:
            local_of(grad).add_(full.to(self.orig_dtype))

    @torch.no_grad()
    def accumulate_reduced(self, summed: Tensor, divide_by: float) -> None:
        """:meth:`accumulate_grad` of ``summed / divide_by``, ``summed`` this weight's slice of a
        reduce's own output buffer: the division writes the gradient (one pass, not a copy and
        then an in-place division), and with nothing to divide the slice is the gradient."""
        self.accumulate_grad(summed if divide_by == 1 else torch.div(summed, divide_by))

    @property
    def master_device(self) -> torch.device:
        """The device the master steps on (with the master in host memory: its compute copy's)."""
        if self.compute_copy is not None:
            return self.compute_copy.device
        return local_of(self.param).device
