"""dmuon_compile: a compiler-first distributed Muon optimizer for PyTorch.

``import dmuon_compile as dmuon`` gives the API of the DMuon troubleshooting page:
``dmuon.Muon``, ``dmuon.NewtonSchulz``, ``dmuon.get_ns_backend`` and (with the distributed
runtime) ``dmuon.dedicate_params`` and its diagnostics.
"""

from __future__ import annotations

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

from dmuon_compile import coefficients  # noqa: E402
from dmuon_compile.distributed import (  # noqa: E402
    MixedPrecision,
    ParamPolicy,
    collect_forward_unshard_profile,
    dedicate_params,
    summarize_comm_plan,
    summarize_param_groups,
    wait_all_replicate_broadcasts,
)
from dmuon_compile.distributed._owned import full_tensor  # noqa: E402
from dmuon_compile.distributed.checkpoint import (  # noqa: E402
    get_model_state_dict,
    set_model_state_dict,
)
from dmuon_compile.distributed.clip import clip_grad_norm_  # noqa: E402
from dmuon_compile.functional import lr_scale  # noqa: E402
from dmuon_compile.kernel_choice import check_ns_backend_consistent  # noqa: E402
from dmuon_compile.layouts import Layout, get_layout, set_layout  # noqa: E402
from dmuon_compile.newton_schulz import (  # noqa: E402
    NewtonSchulz,
    get_ns_backend,
    matrix_view,
)
from dmuon_compile.optimizer import Muon, MuonStepError, default_muon_predicate  # noqa: E402

__all__ = [
    "__version__",
    "Layout",
    "get_layout",
    "set_layout",
    "MixedPrecision",
    "Muon",
    "MuonStepError",
    "NewtonSchulz",
    "ParamPolicy",
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
