"""A parameter's layout travels with it through ``torch.save`` and a ``weights_only`` load
(torch's default): the class is allowed, and the loaded parameter's layout is the saved one."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import dmuon_compile as dmuon
from dmuon_compile.layouts import Layout


@pytest.mark.parametrize(
    "layout,shape",
    [
        (Layout.experts(), (2, 4, 4)),
        (Layout.experts(transposed=True), (2, 4, 4)),
        (Layout.heads(2), (4, 4)),
    ],
)
def test_a_parameter_with_a_layout_loads_weights_only(layout, shape):
    p = torch.nn.Parameter(torch.randn(shape))
    dmuon.set_layout(p, layout)
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    q = torch.load(buffer, weights_only=True)
    assert torch.equal(q, p) and dmuon.get_layout(q) == layout


class Unlisted(tuple):
    """A module-level class the weights-only loader has not been told of."""


def test_control_an_unlisted_class_is_refused_by_the_same_load():
    p = torch.nn.Parameter(torch.randn(2, 3))
    p.extra = Unlisted((1,))
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buffer, weights_only=True)
