"""The one place that knows about torch-version differences.

The floor is torch 2.11 (the first release this project is tested on: FSDP2's public
``fully_shard`` hooks, ``torch.library.custom_op`` with ``register_fake`` and
``CustomGraphPass`` all behave as the code expects from there on).
"""

from __future__ import annotations

import importlib
import re
import sys

TORCH_FLOOR = (2, 11)
TORCH_FLOOR_STR = "2.11"


def parse_version(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; unparseable parts count as 0."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str) -> None:
    """Raise an ImportError that names the needed version and the upgrade command."""
    if parse_version(version) < TORCH_FLOOR:
        raise ImportError(
            f"dmuon_compile requires PyTorch >= {TORCH_FLOOR_STR} (found {version}): it builds on "
            "FSDP2 (fully_shard from torch.distributed.fsdp), torch.library.custom_op and "
            "Inductor's CustomGraphPass. Fix: upgrade PyTorch, e.g.\n"
            f'    pip install "torch>={TORCH_FLOOR_STR}"\n'
            "(add --index-url https://download.pytorch.org/whl/cu130 for a CUDA build)."
        )


# --- private torch APIs: each resolved in one place, failing loudly when torch moves it -----
#
# One module per torch area (the table in docs/torch_internals.md lists every API):
#
# - this module: torch core, Dynamo, Inductor (the NS-chain pass of ``passes/`` included), the
#   profiler and ``torch._logging``;
# - ``distributed/_compat/dtensor.py``: DTensor and DeviceMesh internals;
# - ``distributed/_compat/fsdp.py``: FSDP2 internals;
# - ``distributed/_compat/autograd.py``: the autograd engine;
# - ``distributed/_compat/c10d.py``: c10d process groups and their backend options.
#
# An accessor never falls back to a default when the API is missing: it raises
# :class:`TorchInternalsError`, naming the torch version, the missing API and the feature of
# dmuon_compile that needs it, so a torch upgrade fails at the first use instead of silently
# skipping a sync, a hook or a check.

CHECKED_TORCH = ("2.11", "2.13")


class TorchInternalsError(RuntimeError):
    """A private torch API dmuon_compile relies on is missing or changed in this torch."""


def torch_internals_error(api: str, feature: str, module: str) -> TorchInternalsError:
    """The error of an accessor in ``module`` whose private torch ``api`` is missing."""
    import torch

    return TorchInternalsError(
        f"dmuon_compile: torch {torch.__version__} has no {api}, which {feature} needs "
        f"(checked on torch {' and '.join(CHECKED_TORCH)}). Fix: use a checked torch version, or "
        f"update dmuon_compile/{module} for this one (docs/torch_internals.md lists what it "
        "reads)."
    )


class PrivateAPI:
    """A private torch API: ``root`` (a module name) ``.path`` (dotted), resolved at first use
    and cached; :meth:`get` raises :class:`TorchInternalsError` naming ``feature`` when this
    torch lacks it. Every instance is listed in :data:`PRIVATE_APIS` (tests resolve them all)."""

    def __init__(self, root: str, path: str, feature: str, module: str = "_compat.py") -> None:
        self.root, self.path, self.feature, self.module = root, path, feature, module
        self._value = _UNSET
        PRIVATE_APIS.append(self)

    @property
    def name(self) -> str:
        return f"{self.root}.{self.path}"

    def resolve(self):
        """Look the API up now (uncached)."""
        try:
            obj = importlib.import_module(self.root)
            for part in self.path.split("."):
                obj = getattr(obj, part)
        except (AttributeError, ImportError):
            raise torch_internals_error(self.name, self.feature, self.module) from None
        return obj

    def get(self):
        if self._value is _UNSET:
            self._value = self.resolve()
        return self._value

    def forget(self) -> None:
        """Drop the cached value (tests that monkeypatch torch)."""
        self._value = _UNSET


_UNSET = object()
PRIVATE_APIS: list[PrivateAPI] = []

_DISABLE_TORCH_FUNCTION = PrivateAPI(
    "torch", "_C.DisableTorchFunctionSubclass", "owner tensors' torch functions"
)
_PROFILER_ENABLED = PrivateAPI(
    "torch", "_C._autograd._profiler_enabled", "the profiler labels (dmuon::*)"
)
_MODE_OPTIONS = PrivateAPI(
    "torch._inductor", "list_mode_options", "the compiled step's compile mode"
)
_INDUCTOR_CONFIG = PrivateAPI(
    "torch._inductor", "config.post_grad_custom_pre_pass", "the NS-chain pass"
)
_CUSTOM_GRAPH_PASS = PrivateAPI(
    "torch._inductor.custom_graph_pass", "CustomGraphPass", "the NS-chain pass (passes/)"
)
_HASH_FOR_FILES = PrivateAPI(
    "torch._inductor.custom_graph_pass",
    "get_hash_for_files",
    "the NS-chain pass's FX-graph-cache key (passes/)",
)
_DYNAMO_COUNTERS = PrivateAPI(
    "torch._dynamo.utils", "counters", "the NS-chain pass's counters['dmuon'] (passes/)"
)
_DETECT_FAKE_MODE = PrivateAPI(
    "torch._guards", "detect_fake_mode", "the fake values of the NS-chain pass's ops (passes/)"
)
_MARK_STATIC = PrivateAPI(
    "torch._dynamo", "mark_static_address", "the compiled step's static state"
)
_DYNAMO_EXCEPTION = PrivateAPI(
    "torch._dynamo.exc", "TorchDynamoException", "the compiled commit's eager fallback"
)
_REGISTER_LOG = PrivateAPI(
    "torch._logging._internal", "register_log", "the TORCH_LOGS alias 'dmuon'"
)
_INIT_LOGS = PrivateAPI("torch._logging._internal", "_init_logs", "the TORCH_LOGS alias 'dmuon'")
_CORRECT_FAN = PrivateAPI(
    "torch.nn.init", "_calculate_correct_fan", "Kaiming init of dedicated weights"
)
_AGREEMENT = "Muon.zero_grad's agreement after an exception in forward or backward"
# c10d internals read by that agreement (here: distributed/_compat/c10d.py is another area's).
_DEFAULT_STORE = PrivateAPI("torch.distributed.distributed_c10d", "_get_default_store", _AGREEMENT)
_SEQUENCE_NUMBER = PrivateAPI(
    "torch.distributed", "ProcessGroup._get_sequence_number_for_group", _AGREEMENT
)
_TREE_FLATTEN = PrivateAPI("torch.utils._pytree", "tree_flatten", "owner tensors' torch functions")
_TREE_MAP = PrivateAPI("torch.utils._pytree", "tree_map", "owner tensors' torch functions")


def disable_torch_function_subclass():
    """``torch._C.DisableTorchFunctionSubclass()``: run a ``__torch_function__`` override's
    default behaviour (owner tensors and their norms, ``distributed/_owner/tensor.py``,
    ``_owner/norms.py``)."""
    return _DISABLE_TORCH_FUNCTION.get()()


def profiler_enabled() -> bool:
    """Whether a profiler records now (``torch._C._autograd._profiler_enabled``): the runtime's
    ``record_function`` labels (``trace_labels.py``) cost nothing without one."""
    return _PROFILER_ENABLED.get()()


def inductor_mode_options(mode: str) -> dict:
    """``torch._inductor.list_mode_options(mode)``: the options a ``torch.compile`` mode sets,
    merged into the compiled step's own options."""
    return _MODE_OPTIONS.get()(mode)


def post_grad_custom_pre_pass():
    """Inductor's global ``config.post_grad_custom_pre_pass`` now (where a user-compiled step's
    NS-chain pass is installed, ``compiled_step.py``; ``passes/manager.py``)."""
    # resolve(), not get(): a setting, read live (get() would cache its first value).
    return _INDUCTOR_CONFIG.resolve()


def set_post_grad_custom_pre_pass(value) -> None:
    """Set Inductor's global ``config.post_grad_custom_pre_pass`` (``passes/manager.py``'s
    ``install_global_pass``)."""
    _INDUCTOR_CONFIG.resolve()  # raises if Inductor dropped the option
    import torch._inductor.config

    torch._inductor.config.post_grad_custom_pre_pass = value


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass``: the base class of the NS-chain
    pass (``passes/manager.py``)."""
    return _CUSTOM_GRAPH_PASS.get()


def hash_for_files(paths: tuple, extra: str = "") -> bytes:
    """``torch._inductor.custom_graph_pass.get_hash_for_files``: the NS-chain pass's uuid."""
    return _HASH_FOR_FILES.get()(paths, extra)


def dynamo_counters():
    """``torch._dynamo.utils.counters`` (the pass keeps its totals under ``"dmuon"``)."""
    return _DYNAMO_COUNTERS.get()


def detect_fake_mode(inputs=None):
    """``torch._guards.detect_fake_mode``: the fake mode of a graph's values (the pass computes
    its inserted ops' fake values in it)."""
    return _DETECT_FAKE_MODE.get()(inputs)


def no_eager_after_recompile_limit():
    """A context in which a function compiled by ``torch.compile`` raises
    ``FailOnRecompileLimitHit`` past Dynamo's recompile limit instead of running eagerly
    (``torch._dynamo.config.fail_on_recompile_limit_hit``; a torch without it: no change)."""
    import contextlib

    import torch._dynamo

    if not hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def mark_static_address(t) -> None:
    """``torch._dynamo.mark_static_address``: the compiled step's state keeps its address, so
    CUDA graphs and guards never copy or recompile for it."""
    _MARK_STATIC.get()(t)


def compile_error_type() -> type:
    """``torch._dynamo.exc.TorchDynamoException``: the base of what ``torch.compile`` raises when
    tracing or compiling fails (``BackendCompilerFailed``, ``Unsupported``, Inductor's errors),
    before the compiled code runs."""
    return _DYNAMO_EXCEPTION.get()


def register_torch_log(name: str, qualified_name: str) -> None:
    """``torch._logging._internal.register_log``: the ``TORCH_LOGS`` alias (``log.py``)."""
    _REGISTER_LOG.get()(name, qualified_name)


def reparse_torch_logs() -> None:
    """``torch._logging._internal._init_logs``: parse ``TORCH_LOGS`` again (``log.py``)."""
    _INIT_LOGS.get()()


def calculate_correct_fan(tensor, mode: str) -> int:
    """``torch.nn.init._calculate_correct_fan``: the fan the Kaiming initialisers use, for an
    owner tensor initialised on its owner (``distributed/_owner/init.py``)."""
    return _CORRECT_FAN.get()(tensor, mode)


def default_store():
    """``torch.distributed.distributed_c10d._get_default_store()``: the rendezvous store, a
    channel beside the process groups (``Muon.zero_grad``'s agreement)."""
    return _DEFAULT_STORE.get()()


def collectives_issued(group) -> int | None:
    """How many collectives this rank has issued on ``group``
    (``ProcessGroup._get_sequence_number_for_group``); ``None`` where its backend keeps no count."""
    _SEQUENCE_NUMBER.get()  # raises if this torch dropped it
    try:
        return int(group._get_sequence_number_for_group())
    except RuntimeError:  # a backend without sequence numbers
        return None


def tree_flatten(tree):
    """``torch.utils._pytree.tree_flatten`` (owner tensors among a function's arguments)."""
    return _TREE_FLATTEN.get()(tree)


def tree_map(fn, tree):
    """``torch.utils._pytree.tree_map`` (owner tensors' local tensors, ``_owner/tensor.py``)."""
    return _TREE_MAP.get()(fn, tree)


# torch.distributed.pipelining: the forwards a stage runs only to infer shapes and metadata
# (2.13: ``_forward_metadata_inference``, on empty tensors past the first stage; earlier
# versions: ``_shape_inference``).
PIPELINE_METADATA_FORWARDS = ("_forward_metadata_inference", "_shape_inference")


def wrap_pipeline_metadata_forwards(context) -> list[str]:
    """Run ``PipelineStage``'s metadata-only forwards inside ``context()`` (a context-manager
    factory), once per process; returns the names wrapped (none on a torch without pipelining
    or without such a method: then there is nothing to keep out)."""
    try:
        from torch.distributed.pipelining import PipelineStage
    except ImportError:
        return []
    wrapped = []
    for name in PIPELINE_METADATA_FORWARDS:
        owner = next((c for c in PipelineStage.__mro__ if name in c.__dict__), None)
        if owner is None:
            continue
        original = owner.__dict__[name]
        if not getattr(original, "_dmuon_wrapped", False):

            def run(self, *args, _original=original, **kwargs):
                with context():
                    return _original(self, *args, **kwargs)

            run._dmuon_wrapped = True
            run.__wrapped__ = original
            setattr(owner, name, run)
        wrapped.append(name)
    return wrapped


def caller_frame(depth: int):
    """The frame of the function ``depth`` frames above the caller of this one.

    Owner tensors (``distributed/_owner/tensor.py``) and the holder class (``_owner/holder.py``,
    through ``distributed._compat.fsdp.called_by_fsdp``) tell apart calls made by torch's own code
    (``torch.nn.init``, DDP, ``fully_shard``) by the module of the calling frame: those calls come
    from user code that runs after ``dedicate_params`` returned, with no code of ours around them
    to set a flag.
    """
    return sys._getframe(depth + 1)
