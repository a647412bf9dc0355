"""Pickles name ``OwnerTensor`` by a stable path, and those of older checkpoints still load.

``torch.save`` records a tensor subclass by its module path. ``OwnerTensor`` lives in
``distributed/_owner/tensor.py`` and pickles as ``dmuon_compile.distributed.OwnerTensor`` (its
``__module__``, exported there). Checkpoints written before the module moved name
``dmuon_compile.distributed._owned.OwnerTensor``: ``dmuon_compile.distributed`` registers that
path in ``sys.modules`` (for ``torch.load(weights_only=False)``, plain pickle) and in torch's
``weights_only`` allowlist (torch's default load), so such a checkpoint loads to the same tensors.

The old pickle is written the way the old code wrote it: with ``OwnerTensor.__module__`` set to
the old path for the ``torch.save`` (a stand-in module of that name for the save only).
Controls: without the ``sys.modules`` entry the plain load raises ``ModuleNotFoundError``,
without the allowlist entry the ``weights_only`` load raises ``UnpicklingError``; the new pickle
needs neither.
"""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from . import models
from .harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

NEW = "dmuon_compile.distributed"
OLD = "dmuon_compile.distributed._owned"


def _class_reference(module: str) -> bytes:
    return f"{module}\nOwnerTensor\n".encode()  # pickle's GLOBAL: module, newline, name


def _pickled(buf: io.BytesIO) -> bytes:
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def _same(loaded: dict, state: dict) -> bool:
    from dmuon_compile.distributed import OwnerTensor

    return loaded.keys() == state.keys() and all(
        type(loaded[k]) is OwnerTensor
        and loaded[k].shape == v.shape
        and loaded[k].placements == v.placements
        and torch.equal(loaded[k].to_local(), v.to_local())
        for k, v in state.items()
    )


def _load_fails(buf: io.BytesIO, weights_only: bool, error: type[Exception]) -> bool:
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=weights_only)
    except error:
        return True
    return False


def _save_as_before_the_move(state: dict) -> io.BytesIO:
    """``torch.save`` of ``state`` as the code before the move wrote it: ``OwnerTensor`` named by
    its old module. Pickle checks that the name resolves, so a stand-in module holds it for the
    save (this test's own, whatever the package registers)."""
    import sys
    import types

    from dmuon_compile.distributed import OwnerTensor

    stand_in = types.ModuleType(OLD)
    stand_in.OwnerTensor = OwnerTensor
    before = sys.modules.get(OLD)
    sys.modules[OLD] = stand_in
    OwnerTensor.__module__ = OLD
    try:
        buf = io.BytesIO()
        torch.save(state, buf)
    finally:
        OwnerTensor.__module__ = NEW
        if before is None:
            del sys.modules[OLD]
        else:
            sys.modules[OLD] = before
    return buf


def _old_and_new_pickles(rank, world):
    import sys

    from dmuon_compile.distributed import OwnerTensor

    model = models.build_dedicated(world, seed=0)[0]
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, OwnerTensor)}
    new = io.BytesIO()
    torch.save(state, new)
    old = _save_as_before_the_move(state)
    out = {
        "owner_tensors": len(state),
        "module": OwnerTensor.__module__,
        "new_names_new": _class_reference(NEW) in _pickled(new),
        "old_names_old": _class_reference(OLD) in _pickled(old),
        "new_names_no_old": _class_reference(OLD) not in _pickled(new),
        "old_weights_only": _same(torch.load(io.BytesIO(old.getvalue())), state),
        "old_plain": _same(torch.load(io.BytesIO(old.getvalue()), weights_only=False), state),
    }

    alias = sys.modules.pop(OLD)  # control: the sys.modules entry gone
    try:
        out["no_alias_plain_fails"] = _load_fails(old, False, ModuleNotFoundError)
        out["no_alias_new_plain"] = _same(
            torch.load(io.BytesIO(new.getvalue()), weights_only=False), state
        )
    finally:
        sys.modules[OLD] = alias

    allowed = torch.serialization.get_safe_globals()  # control: the allowlist entry gone
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(
        [g for g in allowed if not (isinstance(g, tuple) and g[1] == f"{OLD}.OwnerTensor")]
    )
    try:
        import pickle

        out["no_entry_weights_only_fails"] = _load_fails(old, True, pickle.UnpicklingError)
        out["no_entry_new_weights_only"] = _same(torch.load(io.BytesIO(new.getvalue())), state)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)
    out["old_weights_only_again"] = _same(torch.load(io.BytesIO(old.getvalue())), state)
    return out


def test_old_owner_tensor_pickles_load_and_new_ones_name_the_stable_path():
    for rank, out in enumerate(run_ranks(_old_and_new_pickles, 2)):
        assert out["owner_tensors"] > 0, rank
        assert out["module"] == NEW, rank
        assert out["new_names_new"] and out["new_names_no_old"], rank
        assert out["old_names_old"], rank  # the crafted pickle names the old path
        assert out["old_weights_only"] and out["old_plain"], rank
        assert out["no_alias_plain_fails"], rank  # control: the alias is what resolves it
        assert out["no_entry_weights_only_fails"], rank  # control: so is the allowlist entry
        assert out["no_alias_new_plain"] and out["no_entry_new_weights_only"], rank
        assert out["old_weights_only_again"], rank
