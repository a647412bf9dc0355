"""``dmuon._extract_layer_id``: the troubleshooting page's name ("verify that _extract_layer_id
correctly identifies your model's layer structure", for an OOM on owner ranks) for the rule
that groups parameter names into layers for the owner plan,
``dmuon_compile.distributed.owner_plan.extract_layer_id``.

Control: the name did not exist before (``AttributeError``); the page's ViT case (``blocks.N``
in the name, or every parameter collapses into one layer key) is what it answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import dmuon_compile as dmuon
from dmuon_compile.distributed.owner_plan import extract_layer_id

ROOT = Path(__file__).resolve().parents[1]


def test_alias_is_the_owner_plans_rule():
    assert dmuon._extract_layer_id is extract_layer_id
    assert dmuon._extract_layer_id("blocks.11.attn.qkv.weight") == "blocks.11"
    assert dmuon._extract_layer_id("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    # The page's ViT pitfall: no layer index in the name → no layer key (one group for all).
    assert dmuon._extract_layer_id("vit.attn.qkv.weight") is None


def test_documented():
    api = (ROOT / "docs" / "api.md").read_text()
    assert "_extract_layer_id" in api and "layer_id_fn" in api


def test_control_a_missing_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute '_extract_layer_idx'"):
        dmuon._extract_layer_idx  # noqa: B018 - the access is the test
