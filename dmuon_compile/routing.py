"""Which parameters get Muon and which AdamW: the routing rules, below the optimizer and the
runtime (``Muon`` routes a model's parameters with them; ``dedicate_params`` picks its default
weights with the same rule).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

# Module names that mark an output head: its weight is 2-D but is a classifier, not a hidden
# matrix, and Muon's orthogonalised update is wrong for it (Keller Jordan; Moonlight).
HEAD_NAMES = ("lm_head", "head", "output", "output_head", "classifier", "score", "fc_out")


def default_muon_predicate(name: str, param: Tensor, module: nn.Module | None = None) -> bool:
    """The documented routing rule: Muon for ≥2-D weights except embeddings and output heads.

    A parameter is excluded when its module is an ``nn.Embedding`` (or ``EmbeddingBag``) or when
    the module's own name (the last component before the parameter name) is one of
    ``HEAD_NAMES``. Everything excluded gets AdamW. Pass ``predicate=`` to ``Muon`` to override.
    """
    if param.ndim < 2:
        return False
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    parts = name.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    return owner not in HEAD_NAMES and "embed" not in owner


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


def route_model(
    model: nn.Module,
    predicate: Callable[[str, Tensor], bool] | None,
    only: set[int] | None = None,
):
    """Split a model's parameters into (muon [(name, p)], adamw [(name, p)]).

    ``only``: route just the parameters with these ids, trainable or not (``add_param_group``
    of a ``Muon(model)``: layers unfrozen later).
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
        if id(p) in dedicated:
            chosen = True
        elif dedicated and hasattr(p, "to_local"):
            chosen = (
                False  # an FSDP2 shard next to dedicated params: NS on a shard is wrong -> AdamW
            )
        elif predicate is not None:
            chosen = bool(predicate(name, p))
            if chosen and p.ndim < 2:
                raise ValueError(
                    f"Muon predicate selected {name!r} of shape {tuple(p.shape)}: Muon needs ≥2-D "
                    "weights. Make the predicate return False for it (it then gets AdamW)."
                )
        else:
            chosen = default_muon_predicate(name, p, routing_module(module_of.get(id(p), [])))
        if chosen and hasattr(p, "to_local") and id(p) not in dedicated:
            raise ValueError(
                f"Muon: {name!r} is a DTensor shard (FSDP2/TP), but Newton–Schulz needs the whole "
                "matrix. Call dmuon.dedicate_params(model, mesh, ...) before fully_shard so each "
                "matrix lives whole on an owner rank, or exclude it with predicate= (it then "
                "gets AdamW on its shard)."
            )
        (muon if chosen else adamw).append((name, p))
    return muon, adamw
