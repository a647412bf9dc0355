"""The compat modules: every private torch API resolves on this torch, and each one that is
taken away gives the loud error (version, API, feature), never a default."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch.distributed.tensor import DTensor

from dmuon_compile import _compat
from dmuon_compile._compat import PRIVATE_APIS, TorchInternalsError
from dmuon_compile.distributed._compat import autograd as _autograd_compat
from dmuon_compile.distributed._compat import c10d as _c10d_compat  # noqa: F401 - registers its APIs
from dmuon_compile.distributed._compat import dtensor as _dtensor_compat
from dmuon_compile.distributed._compat import fsdp as _fsdp_compat

AREAS = {
    "_compat.py",
    "distributed/_compat/dtensor.py",
    "distributed/_compat/fsdp.py",
    "distributed/_compat/autograd.py",
    "distributed/_compat/c10d.py",
}


def test_every_area_registers_its_apis():
    assert {api.module for api in PRIVATE_APIS} == AREAS


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda a: a.name)
def test_private_api_resolves_on_this_torch(api):
    # resolve() raises TorchInternalsError if missing (an Inductor option may be None); get()
    # returns what it resolved.
    value = api.resolve()
    assert api.get() == value


def _take_away(monkeypatch, api) -> None:
    """Delete the deepest attribute of ``api``'s path held by a module or a class (an attribute
    of a C object, such as the autograd engine's methods, cannot be deleted)."""
    parts = [api.root, *api.path.split(".")]
    for depth in range(len(parts) - 1, 0, -1):
        owner = importlib.import_module(api.root)
        for part in parts[1:depth]:
            owner = getattr(owner, part)
        if not (inspect.ismodule(owner) or inspect.isclass(owner)):
            continue
        try:
            monkeypatch.delattr(owner, parts[depth])
            return
        except (AttributeError, TypeError):
            continue
    pytest.fail(f"could not take {api.name} away")


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda a: a.name)
def test_missing_private_api_raises_naming_version_api_and_feature(monkeypatch, api):
    _take_away(monkeypatch, api)
    with pytest.raises(TorchInternalsError) as info:
        api.resolve()
    message = str(info.value)
    assert torch.__version__ in message
    assert api.name in message
    assert api.feature in message
    assert api.module in message


def test_accessor_raises_instead_of_defaulting(monkeypatch):
    """The control: without the engine's graph-task id, ``in_backward`` raises rather than
    answering False (which would unshard/reshard during a checkpointed recompute)."""
    api = _autograd_compat._GRAPH_TASK_ID
    assert _autograd_compat.in_backward() is False  # resolves and answers on this torch
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    monkeypatch.setattr(api, "_value", _compat._UNSET)  # as if first used now
    with pytest.raises(TorchInternalsError, match="backward detection"):
        _autograd_compat.in_backward()


def test_in_backward_and_profiler_answer():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(_autograd_compat.in_backward()) or g)
    y.sum().backward()
    assert seen == [True]
    assert _compat.profiler_enabled() is False
    with torch.profiler.profile():
        assert _compat.profiler_enabled() is True


def test_dtensor_layout_check(monkeypatch):
    _dtensor_compat.check_dtensor_layout()
    monkeypatch.setattr(DTensor, "__slots__", ("_local_tensor",))
    with pytest.raises(TorchInternalsError, match="DTensor._spec"):
        _dtensor_compat.check_dtensor_layout()


def test_fully_shard_parameter_collection_check(monkeypatch):
    _fsdp_compat.check_parameter_collection()
    api = _fsdp_compat._MANAGED_STATES

    def collects_otherwise(modules, ignored_params=None):
        return [p for m in modules for p in m._parameters.values()], []

    collects_otherwise.__module__ = api.root
    monkeypatch.setattr(
        importlib.import_module(api.root), "_get_managed_states", collects_otherwise
    )
    monkeypatch.setattr(api, "_value", _compat._UNSET)
    with pytest.raises(TorchInternalsError, match="out of fully_shard"):
        _fsdp_compat.check_parameter_collection()


def test_called_by_fsdp_reads_the_calling_module():
    def named_parameters():  # stands in for the holder's method: asks about its caller
        return _fsdp_compat.called_by_fsdp(1)

    assert named_parameters() is False
    fake_fsdp = {
        "__name__": "torch.distributed.fsdp._fully_shard._fsdp_init",
        "np": named_parameters,
    }
    exec("def collect():\n    return np()\n", fake_fsdp)  # noqa: S102 - a frame from that module
    assert fake_fsdp["collect"]() is True


def test_fsdp_state_reader_raises_on_a_moved_attribute():
    class State:  # an FSDP2 state without the settings the runtime reads
        _is_root = True

    with pytest.raises(TorchInternalsError, match="_state_ctx"):
        _fsdp_compat._require(State(), "_state_ctx", "Muon.zero_grad after a failed backward")
    assert _fsdp_compat._require(State(), "_is_root", "x") is True
