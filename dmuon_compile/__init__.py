"""dmuon_compile: a compiler-first distributed Muon optimizer for PyTorch.

``import dmuon_compile as dmuon`` gives the API of the DMuon troubleshooting page:
``dmuon.Muon``, ``dmuon.NewtonSchulz``, ``dmuon.get_ns_backend`` and (with the distributed
runtime) ``dmuon.dedicate_params`` and its diagnostics.

The import itself is light: it checks the torch version and registers the ``TORCH_LOGS`` name;
each public name (and each submodule, ``dmuon.distributed``, ``dmuon.functional``, ...) is
imported on first use (PEP 562 ``__getattr__``), so ``import dmuon_compile`` does not load
Dynamo, Inductor, sympy or DTensor until something needs them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

try:
    import torch as _torch
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dmuon_compile needs PyTorch (>= 2.11). Install it first, e.g. pip install 'torch>=2.11'"
    ) from _exc

from dmuon_compile._compat import check_torch_version as _check_torch_version

_check_torch_version(_torch.__version__)

from dmuon_compile.log import register_torch_logs as _register_torch_logs  # noqa: E402

# ``TORCH_LOGS="+dmuon"``: the name exists (and a TORCH_LOGS set after `import torch` applies)
# from the package's import on, whatever imported torch before.
_register_torch_logs()

# ``torch.ops.dmuon.*`` (the NS kernels' custom ops) exist from the package's import on, as
# before: a light import (no Dynamo, Inductor or sympy).
from dmuon_compile import kernels as _kernels  # noqa: E402, F401

# Public name -> (module, attribute): imported on first access (``__getattr__`` below).
_LAZY: dict[str, tuple[str, str]] = {
    "MixedPrecision": ("dmuon_compile.distributed", "MixedPrecision"),
    "ParamPolicy": ("dmuon_compile.distributed", "ParamPolicy"),
    "collect_forward_unshard_profile": (
        "dmuon_compile.distributed",
        "collect_forward_unshard_profile",
    ),
    "dedicate_params": ("dmuon_compile.distributed", "dedicate_params"),
    "summarize_comm_plan": ("dmuon_compile.distributed", "summarize_comm_plan"),
    "summarize_param_groups": ("dmuon_compile.distributed", "summarize_param_groups"),
    "wait_all_replicate_broadcasts": (
        "dmuon_compile.distributed",
        "wait_all_replicate_broadcasts",
    ),
    "full_tensor": ("dmuon_compile.distributed._owner.tensor", "full_tensor"),
    "get_model_state_dict": ("dmuon_compile.distributed.checkpoint", "get_model_state_dict"),
    "set_model_state_dict": ("dmuon_compile.distributed.checkpoint", "set_model_state_dict"),
    "clip_grad_norm_": ("dmuon_compile.distributed.clip", "clip_grad_norm_"),
    "lr_scale": ("dmuon_compile.functional", "lr_scale"),
    "check_ns_backend_consistent": (
        "dmuon_compile.newton_schulz",
        "check_ns_backend_consistent",
    ),
    "Layout": ("dmuon_compile.layouts", "Layout"),
    "get_layout": ("dmuon_compile.layouts", "get_layout"),
    "set_layout": ("dmuon_compile.layouts", "set_layout"),
    "set_head_layouts": ("dmuon_compile.layouts", "set_head_layouts"),
    "NewtonSchulz": ("dmuon_compile.newton_schulz", "NewtonSchulz"),
    "get_ns_backend": ("dmuon_compile.newton_schulz", "get_ns_backend"),
    "matrix_view": ("dmuon_compile.newton_schulz", "matrix_view"),
    "Muon": ("dmuon_compile.optimizer", "Muon"),
    "NorMuon": ("dmuon_compile.normuon", "NorMuon"),
    "MuonStepError": ("dmuon_compile.optimizer", "MuonStepError"),
    "default_muon_predicate": ("dmuon_compile.optimizer", "default_muon_predicate"),
    "QKClip": ("dmuon_compile.qk_clip", "QKClip"),
    # The troubleshooting page's name for the rule that groups parameters into layers for the
    # owner plan (``blocks.N``, ``layers.N``, ...): ``distributed.owner_plan.extract_layer_id``.
    "_extract_layer_id": ("dmuon_compile.distributed.owner_plan", "extract_layer_id"),
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from dmuon_compile import coefficients
    from dmuon_compile.distributed import (
        MixedPrecision,
        ParamPolicy,
        collect_forward_unshard_profile,
        dedicate_params,
        summarize_comm_plan,
        summarize_param_groups,
        wait_all_replicate_broadcasts,
    )
    from dmuon_compile.distributed._owner.tensor import full_tensor
    from dmuon_compile.distributed.checkpoint import get_model_state_dict, set_model_state_dict
    from dmuon_compile.distributed.clip import clip_grad_norm_
    from dmuon_compile.distributed.owner_plan import (  # noqa: F401
        extract_layer_id as _extract_layer_id,
    )
    from dmuon_compile.functional import lr_scale
    from dmuon_compile.layouts import Layout, get_layout, set_head_layouts, set_layout
    from dmuon_compile.newton_schulz import (
        NewtonSchulz,
        check_ns_backend_consistent,
        get_ns_backend,
        matrix_view,
    )
    from dmuon_compile.normuon import NorMuon
    from dmuon_compile.optimizer import Muon, MuonStepError, default_muon_predicate
    from dmuon_compile.qk_clip import QKClip


def __getattr__(name: str):
    """A public name or a submodule, imported on first access and kept (PEP 562)."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")  # dmuon.distributed, ...
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"coefficients"})


__all__ = [
    "__version__",
    "Layout",
    "get_layout",
    "set_head_layouts",
    "set_layout",
    "MixedPrecision",
    "Muon",
    "MuonStepError",
    "NewtonSchulz",
    "NorMuon",
    "ParamPolicy",
    "QKClip",
    "collect_forward_unshard_profile",
    "dedicate_params",
    "summarize_comm_plan",
    "summarize_param_groups",
    "wait_all_replicate_broadcasts",
    "check_ns_backend_consistent",
    "clip_grad_norm_",
    "coefficients",
    "full_tensor",
    "default_muon_predicate",
    "get_model_state_dict",
    "get_ns_backend",
    "set_model_state_dict",
    "lr_scale",
    "matrix_view",
]
