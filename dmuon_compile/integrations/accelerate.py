"""HF accelerate and the HF ``Trainer`` with FSDP2: dedicated weights and ``dmuon.Muon``.

accelerate's FSDP2 prepare (``accelerator.prepare(model, optimizer)``) calls ``fully_shard``
on the model itself, so the weights must be dedicated *before* it, on the ranks its FSDP2
will shard over, and the optimizer must be built on the dedicated model (it routes the
dedicated weights to Muon). :func:`dedicate_params` does the first; then plain
``accelerator.prepare(model, dmuon.Muon(model))`` works: accelerate swaps the optimizer's
FSDP2 parameters for their shards (matching them by data address) and leaves the dedicated
ones, which ``fully_shard`` does not touch, in place::

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
    import accelerate as _accelerate  # noqa: F401 - the extra is checked at import
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dmuon_compile.integrations.accelerate needs HF accelerate: "
        'pip install "dmuon_compile[accelerate]"'
    ) from _exc

__all__ = ["MuonFactory", "dedicate_params", "fsdp_mesh"]


def _fsdp2_plugin(accelerator):
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not getattr(accelerator, "is_fsdp2", False) or plugin is None:
        raise ValueError(
            "dmuon_compile.integrations.accelerate: the Accelerator does not use FSDP2 "
            f"(distributed_type={accelerator.distributed_type}). Dedicated weights need FSDP2: "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) or "
            "`accelerate launch --use_fsdp --fsdp_version 2`; DistributedDataParallel cannot "
            "wrap them. To train without dedicated weights, build dmuon.Muon(model) directly."
        )
    return plugin


def fsdp_mesh(accelerator):
    """The 1-D device mesh accelerate's FSDP2 prepare shards over: what ``dedicate_params``
    needs (the same ranks as its ``fully_shard`` calls)."""
    _fsdp2_plugin(accelerator)
    from torch.distributed.device_mesh import init_device_mesh

    config = getattr(accelerator, "parallelism_config", None)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:  # fully_shard(mesh=None): every rank, one dimension
        return init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    names = tuple(config.fsdp_dim_names)
    extra = {
        "dp_replicate_size": config.dp_replicate_size,
        "tp_size": config.tp_size,
        "cp_size": config.cp_size,
    }
    if any(size > 1 for size in extra.values()) or len(names) != 1:
        raise ValueError(
            "dmuon_compile.integrations.accelerate supports one data-parallel dimension "
            f"(ParallelismConfig with only dp_shard_size); got {extra}. For HSDP or TP, build "
            "the meshes yourself and call dmuon.dedicate_params and fully_shard before "
            "accelerate (see the README)."
        )
    return mesh[names]


def dedicate_params(
    accelerator, model: nn.Module, predicate: Callable[[str, Tensor], bool] | None = None, **kwargs
) -> dict[str, int]:
    """``dmuon.dedicate_params`` for a model that ``accelerator.prepare`` will shard with FSDP2.

    Call it before ``accelerator.prepare`` (and before building ``dmuon.Muon(model)``). It
    dedicates over :func:`fsdp_mesh` and does first what accelerate's prepare would do to the
    weights it can no longer change once dedicated:

    - with ``mixed_precision`` other than ``"no"``, accelerate keeps fp32 master weights: the
      trainable weights are cast to fp32 here, as accelerate casts them;
    - the forward/backward dtype of the dedicated weights follows the plugin's
      ``mixed_precision_policy`` (``param_policy``), as FSDP2's weights do.

    ``predicate`` and ``kwargs`` (``param_policy``, ``layer_id_fn``, ...) go to
    ``dmuon.dedicate_params``; the default predicate is Muon's routing rule (hidden matrices;
    not embeddings, not output heads). Returns ``{name: owner rank}``.

    Raises ``ValueError`` for what accelerate would do to dedicated weights and cannot:
    ``cpu_ram_efficient_loading`` (moves the model to the meta device; load the weights with
    ``dmuon.set_model_state_dict`` after prepare instead), ``cpu_offload``, and an Accelerator
    without FSDP2.
    """
    import dmuon_compile as dmuon

    plugin = _fsdp2_plugin(accelerator)
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "dmuon_compile.integrations.accelerate: cpu_ram_efficient_loading moves the model "
            "to the meta device inside prepare, which dedicated weights cannot follow. Set it "
            "False (FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False) / "
            "FSDP_CPU_RAM_EFFICIENT_LOADING=false); to load large weights, build on the meta "
            "device and use dmuon.set_model_state_dict after prepare."
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        raise ValueError(
            "dmuon_compile.integrations.accelerate: FSDP2 CPU offload is not supported with "
            "dedicated weights (they stay on the accelerator). Turn cpu_offload off."
        )
    if accelerator.mixed_precision != "no":
        with torch.no_grad():  # accelerate's fp32 masters, before the weights are dedicated
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.to(torch.float32)
    if "param_policy" not in kwargs and "compute_dtype" not in kwargs:
        policy = getattr(plugin, "mixed_precision_policy", None)
        if policy is not None and getattr(policy, "param_dtype", None) is not None:
            kwargs["param_policy"] = policy
    return dmuon.dedicate_params(model, fsdp_mesh(accelerator), predicate, **kwargs)


class MuonFactory:
    """The HF ``Trainer``'s optimizer hook for ``dmuon.Muon`` on the whole model.

    ``Trainer(..., optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, ...}))``: the Trainer
    calls ``MuonFactory()(model, **kwargs)`` with its model before ``accelerator.prepare``.
    This dedicates the weights when the Trainer's accelerator uses FSDP2 (see
    :func:`dedicate_params`; ``dedicate_predicate`` / ``dedicate_kwargs`` go there) and
    returns ``dmuon.Muon(model, **kwargs)``: Muon for hidden matrices, AdamW for embeddings,
    heads and vectors. Without FSDP2 (one process) it only builds the optimizer.

    ``optimizer_cls_and_kwargs=(dmuon.Muon, ...)`` passes a flat parameter list instead, which
    cannot tell an embedding or a head from a hidden matrix: use this factory.
    """

    def __call__(
        self,
        model: nn.Module,
        *,
        accelerator=None,
        dedicate_predicate: Callable[[str, Tensor], bool] | None = None,
        dedicate_kwargs: dict | None = None,
        **muon_kwargs,
    ):
        import dmuon_compile as dmuon
        from dmuon_compile.dedicated_registry import dedicated_names

        if accelerator is None:
            from accelerate.state import AcceleratorState

            state = AcceleratorState()
            distributed = state.num_processes > 1
            accelerator = _StateView(state) if distributed else None
        if accelerator is not None and not dedicated_names(model):
            dedicate_params(accelerator, model, dedicate_predicate, **(dedicate_kwargs or {}))
        return dmuon.Muon(model, **muon_kwargs)


class _StateView:
    """The few ``Accelerator`` attributes :func:`dedicate_params` reads, from the shared
    ``AcceleratorState`` (the Trainer's accelerator is not passed to optimizer factories)."""

    def __init__(self, state) -> None:
        self.state = state
        self.is_fsdp2 = state.is_fsdp2
        self.distributed_type = state.distributed_type
        self.num_processes = state.num_processes
        self.device = state.device
        self.mixed_precision = state.mixed_precision
        self.parallelism_config = getattr(state, "parallelism_config", None)
        self.torch_device_mesh = getattr(state, "device_mesh", None)
