"""``dedicating``'s record of the stages planned per data-parallel mesh (one process, no ranks):
it sums the stages' Newton–Schulz loads per mesh object, never mixes two meshes (equal ranks
included), drops the records of meshes gone, and leaves ``base_loads`` to itself."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

tt = pytest.importorskip("dmuon_compile.integrations.torchtitan")


class Mesh:
    """Stands for a DeviceMesh: the record goes by the object, not by its ranks."""


def _runtime(loads):
    return SimpleNamespace(plan=SimpleNamespace(ns_loads=lambda: list(loads)))


def test_record_sums_stages_per_mesh_object():
    planned = {}
    mesh, other = Mesh(), Mesh()
    assert tt._carried_loads(planned, mesh) is None  # the first stage: planned alone
    tt._record_loads(planned, mesh, _runtime([3.0, 1.0]))
    tt._record_loads(planned, mesh, None)  # a stage without dedicated weights adds nothing
    assert tt._carried_loads(planned, mesh) == [3.0, 1.0]
    tt._record_loads(planned, mesh, _runtime([1.0, 3.0]))
    assert tt._carried_loads(planned, mesh) == [4.0, 4.0]
    assert tt._carried_loads(planned, other) is None  # control: another job's mesh
    tt._record_loads(planned, other, _runtime([2.0, 0.0]))
    assert tt._carried_loads(planned, other) == [2.0, 0.0]
    assert tt._carried_loads(planned, mesh) == [4.0, 4.0]
    del other
    gc.collect()
    tt._record_loads(planned, mesh, _runtime([0.0, 0.0]))
    assert len(planned) == 1  # the dead mesh's record went


def test_record_ignores_a_new_mesh_at_a_dead_ones_id():
    mesh = Mesh()
    planned = {}
    tt._record_loads(planned, mesh, _runtime([1.0]))
    _, loads = planned[id(mesh)]
    planned[id(mesh)] = (lambda: None, loads)  # as if the mesh died and its id came back
    assert tt._carried_loads(planned, mesh) is None


def test_dedicating_sets_base_loads_itself():
    from torchtitan.models.llama3 import parallelize_llama

    with pytest.raises(TypeError, match="balance_stages=False"):
        tt.dedicating(parallelize_llama, base_loads=[0.0, 0.0])
    assert callable(tt.dedicating(parallelize_llama, balance_stages=False))
