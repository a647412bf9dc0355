"""Initialisation of dedicated weights: ``nn.init`` functions and random fills.

A model built on the meta device is initialised after ``model.to_empty`` by its own
``reset_parameters()`` / ``init_weights()``: ``nn.init`` functions and random fills
(``w.normal_()``, ``w.data.uniform_()``) on the registered dedicated weights. They run on the
holder's local tensor (the owner's whole master, or a TP shard on its owner group member) and
change nothing elsewhere:

- a random fill draws on the holder from a generator of its own, seeded by
  ``torch.initial_seed()``, the weight's name, its TP shard index and how many fills the
  weight had (a temporary of an ``nn.init`` function, e.g. ``trunc_normal_``'s rejection
  samples or ``orthogonal_``'s Gaussian matrix, counts as a fill of the weight that function
  initialises). The default generators are never advanced: a holder that
  drew from them would leave its RNG state behind the other ranks', and DTensor's random ops
  on FSDP2's replicated shards (HSDP, TP) need every rank's state in step. DTensor's own
  random path is never taken either: on CUDA its first use broadcasts an RNG state over the
  default group, which the owner alone would enter. So a dedicated weight gets the same
  values whichever rank owns it and however many ranks there are (the TP copies of a plain
  weight are the same), given the same seed on every rank, as DTensor also requires; they
  are not the values a single process drawing from its default generator would get.
- inside an ``nn.init`` function, the ranks that hold nothing see a meta tensor of the global
  shape (shape arithmetic works, fills are no-ops, scalar reads such as the rejection test
  never read a value that is not there).
- every such write, on every rank (the holder and the others run the same ``nn.init`` call),
  makes a publish due (``_comm/pending.py``): the next forward sends the global owners' new weights
  to the other replicas first.

The ops of an ``nn.init`` body on an owner tensor are handled in ``_owner/tensor.py``
(``_in_init``).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon_compile import _compat
from dmuon_compile.distributed._comm import pending as _pending
from dmuon_compile.distributed._compat import dtensor as _dt

INIT_MODULE = "torch.nn.init"
# DistributedDataParallel's module: it would broadcast and all-reduce every parameter as a
# whole replicated tensor. A dedicated weight is whole on its owner only, so DDP breaks deep
# inside (a mixed Tensor/DTensor ``cat`` in its first broadcast); its first touch of one raises.
DDP_MODULE = "torch.nn.parallel.distributed"


def ddp_error() -> RuntimeError:
    return RuntimeError(
        "DistributedDataParallel cannot wrap a model with dedicated weights "
        "(dmuon.dedicate_params): each dedicated weight lives whole on one owner rank, and DDP "
        "replicates and all-reduces every parameter. Shard the model with FSDP2 instead: "
        "torch.distributed.fsdp.fully_shard after dedicate_params (accelerate: "
        "FullyShardedDataParallelPlugin(fsdp_version=2) and "
        "dmuon_compile.integrations.accelerate.dedicate_params). Without dedicate_params, "
        "DDP with dmuon.Muon works as with any optimizer."
    )


RANDOM_FILLS = frozenset(
    {
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.random_,
        Tensor.bernoulli_,
        Tensor.exponential_,
        Tensor.cauchy_,
        Tensor.log_normal_,
        Tensor.geometric_,
    }
)
# data_ptr of a holder's local tensor -> [name, TP shard index, fills so far]
_FILL_KEYS: dict[int, list] = {}
_GENERATOR: list = [None]  # the last fill's generator (a temporary of user code continues it)


def key_fills(param: DTensor, fqn: str, shard: int = 0) -> None:
    """Random fills of ``param`` (a dedicated weight this rank holds) draw from a generator keyed
    by ``fqn`` and ``shard`` (its TP shard index; 0 for a whole weight)."""
    local = _dt.local_tensor(param)
    if local.numel():
        _FILL_KEYS[local.data_ptr()] = [fqn, int(shard), 0]


def note_init_write() -> None:
    _pending.before_access(write=True)


def _seed(fqn: str, shard: int, count: int) -> int:
    text = f"{torch.initial_seed()}/{fqn}/{shard}/{count}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _fill_generator(local: Tensor, frame) -> torch.Generator:
    """A fresh generator for a fill of ``local``: keyed by the weight it is (or, for a temporary
    of an ``nn.init`` function, the weight that function initialises) and its fill count."""
    key = _FILL_KEYS.get(local.data_ptr())
    if key is None and frame.f_globals.get("__name__") == INIT_MODULE:
        target = frame.f_locals.get("tensor")  # every nn.init function names its weight so
        if isinstance(target, DTensor) and _dt.local_tensor(target).numel():
            key = _FILL_KEYS.get(_dt.local_tensor(target).data_ptr())
    gen = _GENERATOR[0]
    if key is None and gen is not None and gen.device == local.device:
        return gen  # a temporary of user code that filled a weight just before
    if key is None:
        key = _FILL_KEYS.setdefault(-1, ["", 0, 0])  # no weight to name: one stream of its own
    fqn, shard, count = key
    key[2] = count + 1
    gen = torch.Generator(device=local.device)
    gen.manual_seed(_seed(fqn, shard, count))
    _GENERATOR[0] = gen
    return gen


def random_fill(func, args, kwargs, frame):
    """``t.uniform_(...)`` and the other random fills: on the holder's local tensor."""
    t = args[0]
    note_init_write()
    local = _dt.local_tensor(t)
    if local.numel():
        if kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": _fill_generator(local, frame)}
        with torch.no_grad():
            func(local, *args[1:], **kwargs)
    return t


def _uniform(tensor, a=0.0, b=1.0, generator=None):
    with torch.no_grad():
        return tensor.uniform_(a, b, generator=generator)


def _normal(tensor, mean=0.0, std=1.0, generator=None):
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator)


def _constant(tensor, val):
    with torch.no_grad():
        return tensor.fill_(val)


def _kaiming_uniform(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    if 0 in tensor.shape:
        return tensor
    fan = _compat.calculate_correct_fan(tensor, mode)
    bound = math.sqrt(3.0) * nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
    with torch.no_grad():
        return tensor.uniform_(-bound, bound, generator=generator)


# The nn.init functions that hand a tensor subclass to __torch_function__ whole (the others run
# their body, whose ops come here one by one): the same math as torch's, on our fills.
INIT_ENTRIES = {
    nn.init.uniform_: _uniform,
    nn.init.normal_: _normal,
    nn.init.constant_: _constant,
    nn.init.kaiming_uniform_: _kaiming_uniform,
}


def init_entry(func, args, kwargs):
    kwargs = dict(kwargs)  # torch passes every argument by name, the tensor included
    tensor, rest = (kwargs.pop("tensor"), args) if "tensor" in kwargs else (args[0], args[1:])
    note_init_write()
    return INIT_ENTRIES[func](tensor, *rest, **kwargs)


# nn.init functions that need the whole matrix in one place (not element-wise).
WHOLE_MATRIX_INITS = frozenset({"eye_", "orthogonal_", "sparse_", "dirac_"})
