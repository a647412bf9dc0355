"""Bad input fails at construction with the argument, the value and the fix; the tied-embedding
routing rule is the same with and without ``dedicate_params``; the autotune cache survives a
bad path or a garbage verdict."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from dmuon_compile.kernels import autotune, syrk
from dmuon_compile.kernels.lower_tiles import TileConfig
from torch import nn

import dmuon_compile as dmuon
from dmuon_compile.distributed.dedicate import _call_predicate, _check_boundary_runs


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 4))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"adamw_eps": -1.0}, "adamw_eps"),
        ({"lr": math.inf}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": -0.1}, "lr"),
        ({"adamw_lr": math.inf}, "adamw_lr"),
        ({"weight_decay": math.nan}, "weight_decay"),
    ],
)
def test_muon_rejects_bad_hyperparameters(kwargs, needle):
    with pytest.raises(ValueError, match=rf"{needle} must be a finite number >= 0"):
        dmuon.Muon(_model(), **kwargs)


def test_muon_accepts_good_hyperparameters():
    # The control: the same checks pass ordinary values (0 included).
    opt = dmuon.Muon(_model(), lr=0.02, adamw_eps=0.0, weight_decay=0.0)
    assert float(opt.param_groups[0]["lr"]) == 0.02
    assert opt.param_groups[-1]["eps"] == 0.0


@pytest.mark.parametrize("arg", ["predicate", "hook_boundary_predicate", "layer_id_fn"])
def test_dedicate_params_rejects_a_non_callable(arg):
    with pytest.raises(TypeError, match=rf"{arg} must be a callable or None, got str"):
        dmuon.dedicate_params(_model(), None, **{arg: "proj"})


def test_dedicate_params_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout must be a positive datetime.timedelta"):
        dmuon.dedicate_params(_model(), None, timeout=30)


def test_a_container_that_never_runs_forward_is_refused_as_hook_boundary():
    experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    with pytest.raises(ValueError, match="ModuleList, which never runs forward"):
        _check_boundary_runs("experts.0.weight", "experts", experts)
    _check_boundary_runs("experts.0.weight", "experts.0", experts[0])  # a Linear runs: fine


class TiedLM(nn.Module):
    """GPT-2's layout: the output head shares the token embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.mlp = nn.Linear(8, 8, bias=False)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.mlp(self.wte(idx)))


def test_tied_embedding_gets_adamw_with_and_without_dedicate_params():
    model = TiedLM()
    opt = dmuon.Muon(model)
    routed = {id(p): g["use_muon"] for g in opt.param_groups for p in g["params"]}
    assert routed[id(model.wte.weight)] is False
    assert routed[id(model.mlp.weight)] is True
    # dedicate_params asks the same rule with every module that holds the weight.
    holders = [model.wte, model.lm_head]
    assert not _call_predicate(None, "wte.weight", model.wte.weight, holders)
    assert not _call_predicate(None, "wte.weight", model.wte.weight, holders[::-1])
    assert _call_predicate(None, "mlp.weight", model.mlp.weight, [model.mlp])


# ---------------------------------------------------------------------- autotune cache
def test_a_directory_in_place_of_the_cache_file_warns_once_and_leaves_nothing(cache_dir):
    path = autotune.cache_path("Fake GPU")
    path.mkdir(parents=True)
    cache = autotune.verdict_cache("Fake GPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            cache.put(f"key{i}", {"choice": autotune.CUBLAS, "config": None})
    writes = [w for w in caught if "could not write" in str(w.message)]
    assert len(writes) == 1
    assert sorted(p.name for p in cache_dir.iterdir()) == [path.name]  # no stray temp files
    assert cache.get("key2") == {"choice": autotune.CUBLAS, "config": None}  # kept in memory


def test_a_garbage_verdict_config_is_refused(cache_dir):
    good = TileConfig(128, 64, 8, 3)
    assert syrk._valid_verdict("k", {"choice": good.name, "config": good.to_dict()}, cache_dir)
    assert syrk._valid_verdict("k", {"choice": autotune.CUBLAS, "config": None}, cache_dir)
    bad = dict(good.to_dict(), block=7)
    for verdict in (
        {"choice": "b7_k64_w8_s3_p1", "config": bad},
        {"choice": good.name, "config": dict(good.to_dict(), num_warps=3)},
        {"choice": good.name, "config": {"block": "x"}},
        {"choice": "b64_k64_w8_s3_p1", "config": good.to_dict()},  # name and config disagree
        {"choice": good.name, "config": None},
    ):
        with pytest.warns(RuntimeWarning, match="ignoring the SYRK autotune verdict"):
            assert not syrk._valid_verdict("k", verdict, cache_dir), verdict
    json.dumps(bad)  # the case is one a JSON file can hold
