"""HF accelerate and the HF ``Trainer`` with FSDP2: dedicated weights and ``dmuon.Muon``.

accelerate's FSDP2 prepare (``accelerator.prepare(model, optimizer)``) calls ``fully_shard``
on the model itself, so the weights must be dedicated *before* it, on the ranks its FSDP2
will shard over, and the optimizer must be built on the dedicated model (it routes the
dedicated weights to Muon). :func:`dedicate_params` does the first; then plain
``accelerator.prepare(model, dmuon.Muon(model))`` works: accelerate swaps the optimizer's
FSDP2 parameters for their shards (matching them by data address, which tells no dedicated
weight apart), and right after that swap the ``Muon`` puts its dedicated weights, which
``fully_shard`` does not touch, back where they were (:func:`dedicate_params` installs that,
once per process; see :func:`_restore_after_swap`)::

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import accelerate as dmuon_accelerate

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    dmuon_accelerate.dedicate_params(accelerator, model)  # before prepare
    opt = dmuon.Muon(model, lr=0.02)
    model, opt = accelerator.prepare(model, opt)

For the ``Trainer``, :class:`MuonFactory` builds the optimizer the same way from the
Trainer's own hook (``optimizer_cls_and_kwargs``, or a ``create_optimizer`` override).

Supported: accelerate's FSDP2 plugin (``fsdp_version=2``) on one data-parallel dimension
(no ``ParallelismConfig``, or one with only ``dp_shard_size``), its auto-wrap policies,
activation checkpointing and mixed precision. DDP (accelerate's multi-GPU/CPU mode without the
FSDP plugin) cannot wrap dedicated weights: ``DistributedDataParallel`` raises, naming FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

try:
    from accelerate.state import AcceleratorState, is_initialized
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dmuon_compile.integrations.accelerate needs HF accelerate: "
        'pip install "dmuon_compile[accelerate]"'
    ) from _exc

__all__ = ["MuonFactory", "dedicate_params", "fsdp_mesh"]


def _state(accelerator):
    """accelerate's shared state: of an ``Accelerator``, or an ``AcceleratorState`` itself."""
    return getattr(accelerator, "state", accelerator)


def _fsdp2_plugin(accelerator):
    state = _state(accelerator)
    plugin = getattr(state, "fsdp_plugin", None)
    if not getattr(state, "is_fsdp2", False) or plugin is None:
        raise ValueError(
            "dmuon_compile.integrations.accelerate: the Accelerator does not use FSDP2 "
            f"(distributed_type={state.distributed_type}). Dedicated weights need FSDP2: "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) or "
            "`accelerate launch --use_fsdp --fsdp_version 2`; DistributedDataParallel cannot "
            "wrap them. To train without dedicated weights, build dmuon.Muon(model) directly."
        )
    return plugin


def fsdp_mesh(accelerator):
    """The 1-D device mesh accelerate's FSDP2 prepare shards over: what ``dedicate_params``
    needs (the same ranks as its ``fully_shard`` calls). ``accelerator``: an ``Accelerator``
    or its ``AcceleratorState``."""
    _fsdp2_plugin(accelerator)
    from torch.distributed.device_mesh import init_device_mesh

    state = _state(accelerator)
    mesh = getattr(state, "device_mesh", None)
    if mesh is None:  # no ParallelismConfig: fully_shard(mesh=None), every rank on one dim
        return init_device_mesh(state.device.type, (state.num_processes,))
    config = state.parallelism_config
    names = tuple(config.fsdp_dim_names)
    others = {
        "dp_replicate_size": config.dp_replicate_size,
        "tp_size": config.tp_size,
        "cp_size": config.cp_size,
    }
    if any(size > 1 for size in others.values()) or len(names) != 1:
        raise ValueError(
            "dmuon_compile.integrations.accelerate supports one data-parallel dimension "
            f"(a ParallelismConfig with dp_shard_size only); got {others}. For HSDP or TP, "
            "build the meshes, dmuon.dedicate_params and fully_shard yourself (README.md's "
            "example; docs/integrations.md)."
        )
    return mesh[names]


def dedicate_params(
    accelerator, model: nn.Module, predicate: Callable[[str, Tensor], bool] | None = None, **kwargs
) -> dict[str, int]:
    """``dmuon.dedicate_params`` for a model that ``accelerator.prepare`` will shard with FSDP2.

    Call it before ``accelerator.prepare`` and build ``dmuon.Muon(model)`` after it. It
    dedicates over :func:`fsdp_mesh` and first does what accelerate's prepare would do to the
    weights, which it can no longer change once they are dedicated:

    - with ``mixed_precision`` other than ``"no"`` accelerate keeps fp32 master weights: the
      trainable weights are cast to fp32 here, as accelerate casts them;
    - the dedicated weights compute in the plugin's ``mixed_precision_policy.param_dtype``
      (``param_policy``), as FSDP2's weights do.

    ``predicate`` and ``kwargs`` (``param_policy``, ``layer_id_fn``, ...) go to
    ``dmuon.dedicate_params``; the default predicate is Muon's routing rule (hidden matrices;
    not embeddings, not output heads). ``accelerator``: an ``Accelerator`` or its
    ``AcceleratorState``. Returns ``{name: owner rank}``.

    Raises ``ValueError`` without FSDP2, and for what accelerate's prepare would do to
    dedicated weights and cannot: ``cpu_ram_efficient_loading`` (moves the model to the meta
    device; build on the meta device yourself and load with ``dmuon.set_model_state_dict``
    after prepare instead) and ``cpu_offload``.
    """
    import dmuon_compile as dmuon

    plugin = _fsdp2_plugin(accelerator)
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "dmuon_compile.integrations.accelerate: cpu_ram_efficient_loading moves the model "
            "to the meta device inside prepare, which dedicated weights cannot follow. Set it "
            "False (FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False) / "
            "FSDP_CPU_RAM_EFFICIENT_LOADING=false); for large models build on the meta device "
            "and load with dmuon.set_model_state_dict after prepare."
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        raise ValueError(
            "dmuon_compile.integrations.accelerate: FSDP2 CPU offload is not supported with "
            "dedicated weights (they stay on the accelerator). Turn cpu_offload off."
        )
    if _state(accelerator).mixed_precision != "no":
        with torch.no_grad():  # accelerate's fp32 masters, before the weights are dedicated
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.to(torch.float32)
    if "param_policy" not in kwargs and "compute_dtype" not in kwargs:
        policy = getattr(plugin, "mixed_precision_policy", None)
        if getattr(policy, "param_dtype", None) is not None:
            kwargs["param_policy"] = policy
    _restore_after_swap()
    return dmuon.dedicate_params(model, fsdp_mesh(accelerator), predicate, **kwargs)


def _restore_after_swap() -> None:
    """Make accelerate's FSDP2 prepare leave a ``dmuon.Muon``'s dedicated weights in place.

    The prepare swaps every optimizer parameter for the one ``fully_shard`` registered under its
    name, found by data address (``fsdp2_switch_optimizer_parameters``). A dedicated weight has
    no address that tells it apart: none here where another rank holds it, and where it is held,
    accelerate versions differ (1.10 to 1.12 key the model's side by ``data_ptr()``, which is
    0 for every DTensor wrapper, and the optimizer's by the local tensor's address). So for a
    ``Muon`` (also inside accelerate's ``AcceleratedOptimizer``) the dedicated slots may find
    any weight or none in that lookup, and right after it ``Muon.restore_dedicated`` puts each
    dedicated weight back by identity, once per prepare instead of a check in every step; any
    other parameter must still be found. accelerate offers no hook after the swap, so its swap
    function is wrapped (once per process). Other optimizers are left as accelerate leaves
    them."""
    import accelerate.accelerator as accelerator_module

    swap = getattr(accelerator_module, "fsdp2_switch_optimizer_parameters", None)
    if swap is None:
        raise RuntimeError(
            "dmuon_compile.integrations.accelerate: this accelerate version has no "
            "accelerate.accelerator.fsdp2_switch_optimizer_parameters (its FSDP2 prepare's "
            "parameter swap), so the dedicated weights cannot be kept in place. Use an accelerate "
            "version that supports fsdp_version=2, or update this module for it."
        )
    if getattr(swap, "restores_dedicated", False):
        return

    def swap_then_restore(optimizer, mapping):
        from dmuon_compile.optimizer import Muon

        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not isinstance(inner, Muon):
            swap(optimizer, mapping)
            return
        swap(optimizer, _Unmatched(mapping))
        inner.restore_dedicated()
        if any(p is _Unmatched.MISSING for g in inner.param_groups for p in g["params"]):
            raise KeyError(  # accelerate's own error for a parameter it cannot find
                "A parameter in the optimizer couldn't be switched to its sharded version "
                "(accelerate's FSDP2 prepare found no parameter of the model at its address)."
            )

    swap_then_restore.restores_dedicated = True
    accelerator_module.fsdp2_switch_optimizer_parameters = swap_then_restore


class _Unmatched(dict):
    """accelerate's address -> parameter mapping, giving ``MISSING`` for an address it lacks (a
    dedicated slot's: ``restore_dedicated`` refills those; any other is an error)."""

    MISSING = None

    def __missing__(self, key):
        return self.MISSING


class MuonFactory:
    """``dmuon.Muon`` for the HF ``Trainer``'s ``optimizer_cls_and_kwargs``.

    ``Trainer(..., optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, ...}))``: the Trainer
    calls ``MuonFactory()(model, **kwargs)`` with its model, before ``accelerator.prepare``.
    With accelerate's FSDP2 this first dedicates the weights (:func:`dedicate_params`;
    ``dedicate_predicate`` and ``dedicate_kwargs`` go there); then it returns
    ``dmuon.Muon(model, **kwargs)``: Muon for the hidden matrices, AdamW for embeddings, heads
    and vectors, whatever the Trainer's parameter groups.

    ``optimizer_cls_and_kwargs=(dmuon.Muon, ...)`` gives Muon a flat parameter list instead,
    which cannot tell an embedding or a head from a hidden matrix (every ≥2-D tensor gets
    Muon); under FSDP2 those matrices are shards, and the first ``step()`` raises.
    """

    def __call__(
        self,
        model: nn.Module,
        *,
        dedicate_predicate: Callable[[str, Tensor], bool] | None = None,
        dedicate_kwargs: dict | None = None,
        **muon_kwargs,
    ):
        import dmuon_compile as dmuon
        from dmuon_compile.dedicated_registry import dedicated_names

        if is_initialized():
            state = AcceleratorState()  # the Trainer's (a shared state)
            if state.is_fsdp2 and not dedicated_names(model):
                dedicate_params(state, model, dedicate_predicate, **(dedicate_kwargs or {}))
            elif state.is_fsdp2:  # dedicated by the caller: prepare must still keep them
                _restore_after_swap()
        return dmuon.Muon(model, **muon_kwargs)
