"""The dry run's entry: :func:`dry_run` checks its arguments, plans one decoder
(:func:`~dmuon_compile.plan.run._run_group`) or its pipeline stages
(:func:`~dmuon_compile.plan.pipeline._pipeline_run`, which plans each stage with the same
function), and adds the notes of :mod:`~dmuon_compile.plan.advice`. It stands above both
planners, so neither imports the other's caller."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_compile.distributed.step_plan import EXPERT_NS
from dmuon_compile.momentum_storage import IN_FLIGHT
from dmuon_compile.ns_rates import H200, NSRates
from dmuon_compile.plan.advice import advise as add_notes
from dmuon_compile.plan.momentum import kept_note, momentum_cost, storage_note
from dmuon_compile.plan.pipeline import _pipeline_run
from dmuon_compile.plan.report import DryRunReport, GiB
from dmuon_compile.plan.run import _run_group


def dry_run(
    model_or_config,
    world_size: int,
    *,
    replicate_size: int = 1,
    tp_size: int = 1,
    split_size: int = 1,
    predicate: Callable | None = None,
    layer_id_fn: Callable | None = None,
    hook_boundary_predicate: Callable | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    momentum_dtype: torch.dtype | str | None = None,
    offload: str | None = None,
    host_link_gbps: float | None = None,
    momentum_in_flight: int | None = IN_FLIGHT,
    keep_new_momentum: bool = False,
    reshard_after_forward: bool | None = None,
    compiled: bool = True,
    rates: NSRates = H200,
    stack_bytes: int | None = None,
    ns=None,
    ep: int | None = None,
    expert_shard_dim: int | None = None,
    expert_ns: str = "per_replica",
    per_head: bool = False,
    pp: int | None = None,
    stages_per_rank: int = 1,
    pp_first_stage_less_layers: int = 1,
    pp_last_stage_less_layers: int = 1,
    gpu_memory_gib: float | None = None,
    advise: bool = True,
) -> DryRunReport:
    """Predict a job of ``world_size`` GPUs (``[pp ×] replicate_size × shard × tp_size``) per
    rank.

    ``model_or_config``: an ``nn.Module`` (meta device recommended), a preset name
    (:data:`PRESETS`), a :class:`ModelConfig`, a dict of its fields, a JSON path or a
    ``"module:function"`` factory. ``predicate``/``layer_id_fn``/``hook_boundary_predicate``:
    as for ``dedicate_params``. ``param_dtype``/``reduce_dtype``: the mixed-precision policy
    (unsharded compute copies; gradient reduces); ``None`` keeps the weights' dtype.
    ``momentum_dtype``: ``Muon(momentum_dtype=...)``, the Muon momentum's storage, what Muon
    takes (``None``: the weights' dtype; ``torch.bfloat16``: half of it; ``torch.int8``:
    blockwise 8-bit, 1 byte per value and an fp32 scale per 256, the step's working buffers in
    the weights' dtype; or the names ``"fp32"``, ``"bf16"``, ``"int8"``). ``offload``:
    ``Muon(offload=...)``: ``"momentum"`` keeps the momentum in pinned host memory between
    steps (the ``host`` columns), the step's working buffers on the GPU, the copy-in timed at
    ``host_link_gbps`` (GB/s, default :data:`~dmuon_compile.plan.momentum.HOST_LINK_GBPS`,
    PCIe 5.0) in the step's ms (the write-back overlaps the next forward, not counted).
    ``momentum_in_flight``: ``Muon(momentum_in_flight=...)`` with a stored momentum: the shape
    buckets the step materialises at once (their copy-in under the NS before them; ``None``:
    every working buffer at once, the copy-in waited for; a step with TP, split NS or the
    expert reshard materialises all at once whatever this says).
    ``keep_new_momentum``: ``Muon(keep_new_momentum=True)``: each rank holds buf′, the new
    momentum in its storage dtype, of every Muon matrix it steps itself (its dedicated weights,
    a TP model's plain ones on TP rank 0, its whole experts; not the matrices TP, split NS or
    the expert reshard step) from the Newton–Schulz to the commit, in ``step_extra_bytes``; the
    commit's elementwise bytes it saves come off ``step_ms``. Not with an 8-bit or offloaded
    momentum (``ValueError``, as ``Muon``).
    ``reshard_after_forward``: of FSDP2 and the dedicated groups (two all-gathers per step, or
    one); ``None``: torchtitan's "default" policy, True without ``pp`` and False with it.
    ``compiled``: the step's working set (``Muon(compile=True)`` holds one stack, eager about
    two). ``rates``: the device's NS rates (:class:`~dmuon_compile.ns_rates.NSRates`).
    ``stack_bytes``: ``NewtonSchulz(stack_bytes=...)`` (default 4 GiB).
    ``ns``: what prices NS for the owner plan (default: as ``dedicate_params`` on a GPU with
    Triton kernels; pass ``NewtonSchulz()`` to plan exactly as on this machine).
    ``ep``: expert parallelism as torchtitan lays it out (``None``: expert stacks on plain
    FSDP2 ``Shard(0)`` over the shard dim): each stack ``Shard(0)`` over groups of ``ep``
    consecutive shard ranks (``E/ep`` experts each), then expert FSDP over the other
    ``shard/ep`` ranks, ``Shard(0)`` unless ``efsdp · ep > E`` (then ``Shard(1)``, inside the
    experts: the step reshards to whole experts for NS). ``expert_shard_dim`` (0 or 1)
    overrides that choice. ``ep=1`` is torchtitan without EP (``Shard(1)`` when ``shard > E``).
    ``expert_ns``: ``Muon(expert_ns=...)``, where HSDP replicates the expert stacks:
    ``"per_replica"`` (default), each replica orthogonalises its copy of its whole experts;
    ``"once"``, the ``replicate_size`` replicas split them, each orthogonalising its share, and
    all-gather the results in NS's 2-byte output dtype (``replica gather`` column, in
    ``replicate_comm_bytes``). No effect with ``replicate_size=1``.
    ``per_head``: ``dmuon.set_head_layouts`` on the model first (``Muon(per_head=True)``): q,
    k, v and o orthogonalised head by head, planned and priced per head; with ``tp_size > 1``
    (q/k/v/gate/up column-parallel, o/down row-parallel, as torchtitan's and transformers' TP
    plans) a projection whose TP shards hold whole heads runs them on each TP rank, no gather.
    ``pp``: pipeline parallelism as torchtitan's ``pipeline_llm`` splits a decoder
    (:func:`pipeline_stages`): the model's ``layers`` cut into ``pp · stages_per_rank``
    contiguous stages (``pp_first_stage_less_layers``/``pp_last_stage_less_layers``: torchtitan's
    ``pipeline_parallel_first/last_stage_less_layers``, default 1 each; the embeddings go with
    the first stage, everything after the layers with the last), stage ``k`` on PP rank
    ``k mod pp`` (looped), each PP rank's ``world_size / pp`` data-parallel ranks planning its
    stages' dedicated weights, the later stages of a rank over the earlier ones' NS loads
    (``base_loads``, as ``dedicating(..., balance_stages=True)``). Global rank
    ``pp_rank · world_size / pp + data-parallel rank``. Not with ``tp_size > 1`` or ``ep > 1``.
    ``gpu_memory_gib``: one GPU's memory (default ``rates.memory_gib``, an H200's for the
    default rates); a peak above it gets a note. ``advise``: notes with numbers from more dry
    runs of the same job when many ranks idle (``split_size``) or the peak does not fit (more
    GPUs, ``split_size``, ``stack_bytes``); ``False``: none, one dry run.

    Example::

        report = dry_run("llama3-70b", 512, replicate_size=4)
        print(report.table())
    """
    arguments = dict(locals())
    if expert_ns not in EXPERT_NS:
        raise ValueError(
            f"dry_run: expert_ns={expert_ns!r}: choose one of {', '.join(EXPERT_NS)} "
            "(as Muon(expert_ns=...), --expert-ns)"
        )
    momentum = momentum_cost(
        momentum_dtype, offload, host_link_gbps, momentum_in_flight, keep_new_momentum
    )
    if stack_bytes is not None and (
        isinstance(stack_bytes, bool) or not isinstance(stack_bytes, int) or stack_bytes < 1
    ):
        raise ValueError(
            f"dry_run: stack_bytes={stack_bytes!r}: give a positive whole number of bytes, as "
            "NewtonSchulz(stack_bytes=...) takes (default 4 GiB, 4 << 30)"
        )
    memory = rates.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    if memory is not None and not (isinstance(memory, (int, float)) and 0 < memory < float("inf")):
        raise ValueError(f"dry_run: gpu_memory_gib={memory!r}: give one GPU's memory in GiB, > 0")
    skip = (
        "gpu_memory_gib",
        "advise",
        "momentum_dtype",
        "offload",
        "host_link_gbps",
        "momentum_in_flight",
        "keep_new_momentum",
    )
    report = _dry_run(**{k: v for k, v in arguments.items() if k not in skip}, momentum=momentum)
    note = storage_note(report, momentum)
    if note:
        report.notes.append(note)
    if memory is not None:
        report.gpu_memory_bytes = int(memory * GiB)
        report.card = (
            "--gpu-mem-gib"
            if gpu_memory_gib is not None
            else f"{rates.device.split(' (')[0]}, the rates'; another: --gpu-mem-gib G"
        )
    if advise:

        def rerun(**changes):
            return dry_run(**{**arguments, **changes, "gpu_memory_gib": memory, "advise": False})

        add_notes(report, rerun, split_size, momentum)
    note = kept_note(report, momentum)  # last: what the setting costs and saves, in one line
    if note:
        report.notes.append(note)
    return report


def _dry_run(
    model_or_config,
    world_size,
    *,
    replicate_size,
    tp_size,
    split_size,
    predicate,
    layer_id_fn,
    hook_boundary_predicate,
    param_dtype,
    reduce_dtype,
    momentum,
    reshard_after_forward,
    compiled,
    rates,
    stack_bytes,
    ns,
    ep,
    expert_shard_dim,
    expert_ns,
    per_head,
    pp,
    stages_per_rank,
    pp_first_stage_less_layers,
    pp_last_stage_less_layers,
) -> DryRunReport:
    if reshard_after_forward is None:
        reshard_after_forward = pp is None
    options = dict(
        replicate_size=replicate_size,
        tp_size=tp_size,
        split_size=split_size,
        predicate=predicate,
        layer_id_fn=layer_id_fn,
        hook_boundary_predicate=hook_boundary_predicate,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        momentum=momentum,
        reshard_after_forward=reshard_after_forward,
        compiled=compiled,
        rates=rates,
        stack_bytes=stack_bytes,
        ns=ns,
        ep=ep,
        expert_shard_dim=expert_shard_dim,
        expert_ns=expert_ns,
        per_head=per_head,
    )
    if pp is None:
        if (stages_per_rank, pp_first_stage_less_layers, pp_last_stage_less_layers) != (1, 1, 1):
            raise ValueError(
                "dry_run: stages_per_rank / pp_*_stage_less_layers need pp (pass pp=N, --pp N)"
            )
        return _run_group(model_or_config, world_size, **options)[0]
    less = (pp_first_stage_less_layers, pp_last_stage_less_layers)
    return _pipeline_run(model_or_config, world_size, pp, stages_per_rank, less, options)
