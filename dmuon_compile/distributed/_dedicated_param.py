"""One dedicated parameter's life: master copy on its owner, compute copy everywhere in forward.

- ``master``: the ``nn.Parameter`` the optimizer updates. It exists on the owner rank only,
  whole and in the original dtype; it is the source of truth (the next forward's unshard
  reads it, so a ``step()`` publishes itself).
- ``unsharded``: a plain leaf tensor in the compute dtype (``param_policy``'s param_dtype)
  set as the module attribute (``module.weight``). It aliases a slice of its group's flat
  buffer through ``Tensor.set_`` (not a view), so it has its *own* version counter: refilling
  the buffer after a reshard does not trip autograd's saved-tensor version check.
  Between forwards its storage is freed (resized to 0 bytes) with the whole buffer.

The parameter is removed from ``module._parameters`` so that ``fully_shard`` (which collects
``module.named_parameters(recurse=False)``) never sees it.

HSDP (replicate × shard): ``owner`` is the shard rank of the *owner column* (that shard
coordinate in every replica) and ``replica_owner`` the replica whose column member is the
*global owner*. Only the global owner has ``master`` (one Newton–Schulz per matrix in the job);
the other column members keep ``replica``, a plain copy that the replicate broadcast refreshes
after each step. ``source`` is whichever of the two this rank holds: what it sends when its
shard group unshards the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(eq=False)
class DedicatedParam:
    fqn: str
    module: nn.Module
    attr: str
    owner: int  # rank within the shard group (HSDP: the owner column)
    shape: torch.Size
    orig_dtype: torch.dtype
    compute_dtype: torch.dtype
    master: nn.Parameter | None = None
    unsharded: Tensor | None = None
    offset: int = 0  # element offset inside the group's flat buffer
    hook_handles: list = field(default_factory=list)
    replica_owner: int = 0  # HSDP: replicate rank of the global owner
    replica: Tensor | None = None  # HSDP: the non-owning column members' copy of the weight

    @property
    def source(self) -> Tensor | None:
        """The whole weight this rank holds (master or replica), ``None`` off the owner column."""
        return self.master if self.master is not None else self.replica

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def is_owner(self) -> bool:
        return self.master is not None

    def bind(self, flat: Tensor) -> None:
        """Create the unsharded leaf over ``flat[offset : offset + numel]`` and install it."""
        with torch.no_grad():
            leaf = torch.empty(0, dtype=flat.dtype, device=flat.device)
            leaf.set_(flat.untyped_storage(), flat.storage_offset() + self.offset, self.shape)
        leaf.requires_grad_(True)
        self.unsharded = leaf
        # nn.Module.__setattr__ stores a non-Parameter tensor as a plain attribute once the
        # name is gone from _parameters: invisible to named_parameters() and so to FSDP.
        setattr(self.module, self.attr, leaf)
