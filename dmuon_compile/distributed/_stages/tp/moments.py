"""NorMuon's second moments of TP-sharded dedicated weights (``Muon(normuon=True)``).

The second moment ``v`` of a TP weight (``normuon.moment_shape`` of its global shape: the
matrix's input dim cut to the number of matrices along it) is an ``OwnerTensor`` on the weight's
owner TP group, like the weight and its momentum, with one of two placements
(:func:`moment_sharded`):

- ``Shard(d)`` where the TP shard dim ``d`` is the matrices' output dim (column-parallel
  ``Shard(0)`` of an ``(out, in)`` weight): ``v``'s rows are the weight's rows, so each member
  holds the rows of its shard; and where ``d`` is the input dim but every shard holds whole
  blocks of a layout cut along it, one block per moment column, the same count on every member
  (a row-parallel output projection per head: ``(d, H)`` cut like its ``H`` heads);
- ``Replicate()`` otherwise (row-parallel ``Shard(1)`` of a plain matrix: ``v`` is one column,
  every member holds all of it; blocks along the input dim that straddle the shards).

The TP stage (``stage.py``) gathers sharded ``v`` to the matrix's TP owner with its Nesterov
inputs, normalises the whole matrix there, and sends each member its rows of ``v′`` (a scatter;
a broadcast of a replicated one); a member holding whole blocks normalises its own.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon_compile.distributed._owner.tensor import local_of, make_owned
from dmuon_compile.layouts import Layout, block_shard_layouts
from dmuon_compile.normuon import moment_shape


def _out_dim(layout: Layout) -> int:
    """The tensor dim of a 2-D weight's matrices' output (rows; columns when transposed)."""
    return 1 if layout.transposed else 0


@functools.lru_cache(maxsize=256)
def moment_sharded(layout: Layout, shape: tuple, dim: int, size: int) -> bool:
    """Whether the second moment of a weight of global ``shape`` cut by TP ``Shard(dim)`` over
    ``size`` members is cut the same way (``Shard(dim)``, each member its rows or its blocks'
    columns), else replicated on the members. A function of the configuration only: the same on
    every rank.

    >>> moment_sharded(Layout(), (8, 4), 0, 2), moment_sharded(Layout(), (8, 4), 1, 2)
    (True, False)
    >>> moment_sharded(Layout.heads(2, dim=1), (8, 8), 1, 2)  # whole heads on each shard
    True
    >>> moment_sharded(Layout.heads(2, dim=1), (8, 6), 1, 2)  # the middle head straddles
    False
    """
    shape = tuple(int(s) for s in shape)
    if size < 2 or dim == _out_dim(layout):
        return True
    columns = moment_shape(layout, shape)[dim]
    if columns == 1 or columns % size:
        return False
    shards = block_shard_layouts(layout, shape, dim, size)
    if shards is None:
        return False
    piece = list(shape)
    piece[dim] //= size
    return all(moment_shape(lay, piece)[dim] == columns // size for lay in shards)


def moment_placement(layout: Layout, shape, dim: int, size: int):
    """``Shard(dim)`` or ``Replicate()``: the placement of the second moment on the owner
    group mesh (:func:`moment_sharded`)."""
    sharded = moment_sharded(layout, tuple(int(s) for s in shape), dim, size)
    return Shard(dim) if sharded else Replicate()


def member_moment_shape(layout: Layout, shape, dim: int, size: int) -> tuple[int, ...]:
    """The shape of a member's piece of the second moment (members' pieces are equal: TP
    shards are).

    >>> member_moment_shape(Layout(), (8, 4), 0, 2), member_moment_shape(Layout(), (8, 4), 1, 2)
    ((4, 1), (8, 1))
    """
    shape = tuple(int(s) for s in shape)
    whole = list(moment_shape(layout, shape))
    if size > 1 and moment_sharded(layout, shape, dim, size):
        whole[dim] //= size
    return tuple(whole)


def zeros(p: DTensor, layout: Layout) -> DTensor:
    """A new second moment (zeros, fp32) of TP weight ``p`` (an ``OwnerTensor`` on its owner
    group, ``Shard(d)``): on the same mesh with :func:`moment_placement`; this member's piece,
    or DTensor's empty local off the owner group."""
    mesh = p.device_mesh
    (placement,) = p.placements
    dim, size = placement.dim, mesh.size()
    local = local_of(p)
    held = None
    if mesh.get_coordinate() is not None:  # a member of the owner group
        piece = member_moment_shape(layout, p.shape, dim, size)
        held = torch.zeros(piece, dtype=torch.float32, device=local.device)
    return make_owned(
        held,
        mesh,
        moment_shape(layout, p.shape),
        torch.float32,
        local.device,
        placement=moment_placement(layout, p.shape, dim, size),
    )


def placeholder(layout: Layout, shape, dim: int, size: int, like: Tensor) -> Tensor:
    """Zeros of a member's piece (a failed member's stand-in: its collectives still go out)."""
    piece = member_moment_shape(layout, shape, dim, size)
    return torch.zeros(piece, dtype=torch.float32, device=like.device)
