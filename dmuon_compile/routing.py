"""Which parameters get Muon and which AdamW: the routing rules, below the optimizer and the
runtime (``Muon`` routes a model's parameters with them; ``dedicate_params`` picks its default
weights with the same rule).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from dmuon_compile.layouts import (
    Layout,
    is_expert_module,
    needs_reshard,
    resolve_layout,
    whole_expert_shards,
)

# Module names that mark an output head: its weight is 2-D but is a classifier, not a hidden
# matrix, and Muon's orthogonalised update is wrong for it (Keller Jordan; Moonlight).
HEAD_NAMES = ("lm_head", "head", "output", "output_head", "classifier", "score", "fc_out")
# Module names of mixture-of-experts routers (a dense MLP's gate is ``gate_proj``, not these).
ROUTER_NAMES = ("router", "gate")


def default_muon_predicate(name: str, param: Tensor, module: nn.Module | None = None) -> bool:
    """The documented routing rule: Muon for ≥2-D weights except embeddings, output heads,
    mixture-of-experts routers (:func:`is_router`), biases (also an expert module's 2-D
    per-expert bias stacks) and ≥3-D tensors of one non-trivial dim (a per-channel scale
    ``(C, 1, 1)``); a ≥3-D weight needs a known layout: a conv kernel, an expert
    stack, or one declared with ``dmuon.set_layout`` (``dmuon_compile.layouts``).

    A parameter is excluded when its module is an ``nn.Embedding`` (or ``EmbeddingBag``) or when
    the module's own name (the last component before the parameter name) is one of
    ``HEAD_NAMES``. Everything excluded gets AdamW. Pass ``predicate=`` to ``Muon`` to override.
    """
    if param.ndim < 2 or name.rsplit(".", 1)[-1].endswith("bias"):
        return False
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    if is_router(name, module):
        return False
    if is_expert_module(module) and param.ndim < 3:  # per-expert vectors (GPT-OSS's biases)
        return False
    if param.ndim >= 3 and sum(int(s) > 1 for s in param.shape) <= 1:
        return False  # a vector in ≥3-D shape (a per-channel scale (C, 1, 1)): no matrix
    parts = name.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    return owner not in HEAD_NAMES and "embed" not in owner


def is_router(name: str, module: nn.Module | None = None) -> bool:
    """A mixture-of-experts router (torchtitan ``moe.router.gate``; transformers' ``mlp.gate``
    and ``mlp.router``; any ``*Router`` module). Routed to AdamW by default, as other Muon
    trainers do: it is a small classifier over the experts, whose logits' scale decides the
    routing, and Muon's orthogonalised update would equalise its directions (as for a head)."""
    if module is not None and "Router" in type(module).__name__:
        return True
    return any(part in ROUTER_NAMES for part in name.split(".")[:-1])


def routing_module(modules: list[nn.Module]) -> nn.Module | None:
    """The module the routing rule judges a parameter by, given every module that holds it.

    A weight tied between an ``nn.Embedding`` and a head (GPT-2's ``wte``/``lm_head``) is an
    embedding wherever it appears first, so it gets AdamW with and without ``dedicate_params``
    and on any number of ranks.
    """
    for mod in modules:
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            return mod
    return modules[0] if modules else None


def _layout_or_none(name: str, p: Tensor, module, verdict) -> Layout | None:
    try:
        return resolve_layout(name, p, module, verdict)
    except ValueError:
        return None


def route_model(
    model: nn.Module,
    predicate: Callable[[str, Tensor], bool | Layout] | None,
    only: set[int] | None = None,
    layouts: dict[int, Layout] | None = None,
):
    """Split a model's parameters into (muon [(name, p)], adamw [(name, p)]).

    ``only``: route just the parameters with these ids, trainable or not (``add_param_group``
    of a ``Muon(model)``: layers unfrozen later). ``layouts``: receives each Muon parameter's
    :class:`Layout` by id (declared, returned by the predicate, or told by its module); a ≥3-D
    parameter whose layout none of them gives raises, naming it and how to declare it.
    """
    from dmuon_compile.dedicated_registry import dedicated_parameters  # late: no import cycle

    # By identity, not name: a module wrapped after dedicate_params (checkpoint_wrapper adds
    # ``_checkpoint_wrapped_module.`` to the names) still holds the same dedicated parameters.
    dedicated = {id(p) for _, p in dedicated_parameters(model)}
    module_of: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            module_of.setdefault(id(p), []).append(mod)
    muon, adamw = [], []
    for name, p in model.named_parameters():  # named_parameters dedups tied weights
        if (id(p) not in only) if only is not None else not p.requires_grad:
            continue
        module = routing_module(module_of.get(id(p), []))
        verdict = True  # what the predicate returned (a Layout declares the matrices)
        if id(p) not in dedicated:
            verdict = (
                predicate(name, p)
                if predicate is not None
                else default_muon_predicate(name, p, module)
            )
        chosen = isinstance(verdict, Layout) or bool(verdict)
        layout = None
        if chosen and hasattr(p, "to_local") and id(p) not in dedicated:  # FSDP2/TP/EP shard
            layout = _layout_or_none(name, p, module, verdict)
            if layout is not None and (whole_expert_shards(p, layout) or needs_reshard(p, layout)):
                pass  # whole experts: held, or redistributed for NS (_stages/expert_shards.py)
            elif dedicated:
                chosen = False  # an FSDP2 shard next to dedicated params: NS on a shard is wrong
            else:
                raise ValueError(
                    f"Muon: {name!r} is a DTensor shard ({getattr(p, 'placements', '?')}), but "
                    "Newton–Schulz needs whole matrices. Call dmuon.dedicate_params(model, mesh, "
                    "...) before fully_shard so each matrix lives whole on an owner rank, or "
                    "exclude it with predicate= (it then gets AdamW on its shard). An expert "
                    "stack may stay sharded along its expert dim (Shard(0)): each rank then "
                    "orthogonalises its own experts."
                )
        elif chosen:
            if p.ndim < 2:
                raise ValueError(
                    f"Muon predicate selected {name!r} of shape {tuple(p.shape)}: Muon needs "
                    "≥2-D weights. Make the predicate return False for it (it then gets AdamW)."
                )
            layout = resolve_layout(name, p, module, verdict)
        if chosen and layouts is not None:
            layouts[id(p)] = layout
        (muon if chosen else adamw).append((name, p))
    return muon, adamw
