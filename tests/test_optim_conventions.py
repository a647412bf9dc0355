"""torch.optim conventions: named parameters, ``param_names`` in groups, ``add_param_group``.

``Muon`` takes what ``torch.optim.AdamW`` takes — ``model.named_parameters()``, groups of
``(name, parameter)`` pairs, groups with a ``param_names`` list (torchtitan's form) — and keeps
the names in each group's ``param_names`` (state_dict, DCP, torchtitan's checkpointer). Groups
added later are completed with Muon's defaults by the constructor's routing rule, or refused at
the call. Results are compared with the same optimizer built from plain parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon_compile as dmuon

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, idx):
        return self.head(self.down(torch.relu(self.up(self.embed(idx)))))


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 10, (4, 5), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    for idx in _batches():
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


# ------------------------------------------------------------------------ named parameters
def test_named_parameters_as_adamw_takes_them():
    model = _model()
    opt = dmuon.Muon(model.named_parameters(), lr=0.02, compile=False)
    names = dict(model.named_parameters())
    # torch's own AdamW on the same input: names kept in each group's param_names
    adamw = torch.optim.AdamW(model.named_parameters())
    assert adamw.param_groups[0]["param_names"] == list(names)
    for group in opt.param_groups:
        assert [names[n] for n in group["param_names"]] == group["params"]
    # routed by the default rule's names, as Muon(model) routes them
    by_model = dmuon.Muon(model, compile=False)
    assert [g["param_names"] for g in opt.param_groups] == [
        g["param_names"] for g in by_model.param_groups
    ]
    assert opt.param_groups[0]["param_names"] == ["up.weight", "down.weight"]
    assert opt.param_name(model.up.weight) == "up.weight"
    saved = opt.state_dict()
    assert [g["param_names"] for g in saved["param_groups"]] == [
        g["param_names"] for g in opt.param_groups
    ]
    # the same math as the optimizer built from the model
    named_result = _train(model, opt)
    ref_model = _model()
    ref = _train(ref_model, dmuon.Muon(ref_model, lr=0.02, compile=False))
    _assert_same(named_result, ref)


def test_groups_of_name_parameter_pairs_and_param_names_lists():
    model = _model()
    pairs = [(n, p) for n, p in model.named_parameters() if not n.startswith("embed")]
    opt = dmuon.Muon(
        [
            {"params": pairs, "lr": 0.01},
            {
                "params": [model.embed.weight],
                "param_names": ["embed.weight"],
                "use_muon": False,
            },
        ],
        compile=False,
    )
    by_name = dict(model.named_parameters())
    for group in opt.param_groups:
        assert [by_name[n] for n in group["param_names"]] == group["params"]
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert [n for g in muon for n in g["param_names"]] == ["up.weight", "down.weight"]  # no head
    assert all(float(g["lr"]) == 0.01 for g in opt.param_groups[:2])  # both halves of group 0
    _train(model, opt)


def test_muon_of_a_model_names_its_groups():
    model = _model()
    opt = dmuon.Muon(model, compile=False)
    by_name = dict(model.named_parameters())
    for group in opt.param_groups:
        assert [by_name[n] for n in group["param_names"]] == group["params"]
    assert opt.param_groups[0]["param_names"] == ["up.weight", "down.weight"]


def test_named_state_dict_round_trip_and_dcp():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model()
    opt = dmuon.Muon(model.named_parameters(), compile=False)
    _train(model, opt)
    other_model = _model(seed=1)
    other = dmuon.Muon(other_model.named_parameters(), compile=False)
    other.load_state_dict(opt.state_dict())
    for p, q in zip(model.parameters(), other_model.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, other.state[q][key])
    # torch.distributed.checkpoint's state dicts key the state by parameter name
    model_sd, optim_sd = get_state_dict(model, opt)
    assert "up.weight" in optim_sd["state"]
    dcp_model = _model(seed=2)
    dcp_opt = dmuon.Muon(dcp_model.named_parameters(), compile=False)
    set_state_dict(dcp_model, dcp_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for p, q in zip(model.parameters(), dcp_model.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, dcp_opt.state[q][key])


@pytest.mark.parametrize(
    "params, message",
    [
        (lambda m: [("up.weight", m.up.weight), m.down.weight], "name all or none"),
        (lambda m: [{"params": [m.up.weight], "param_names": ["a", "b"]}], "2 param_names"),
        (lambda m: [{"params": [m.up.bias], "use_muon": True}], "fewer than 2 dims"),
        (lambda m: [{"params": {m.up.weight}}], "a set"),
    ],
    ids=["mixed", "names_length", "vector_for_muon", "set"],
)
def test_bad_groups_raise_naming_the_fix(params, message):
    model = _model()
    with pytest.raises((ValueError, TypeError), match=message):
        dmuon.Muon(params(model), compile=False)


# ------------------------------------------------------------------------ add_param_group
def test_add_param_group_fills_defaults_and_equals_building_with_all():
    """Parameters added later get the constructor's rule and defaults: training equals an
    optimizer that had them from the start (same group order)."""
    model = _model()
    opt = dmuon.Muon([model.up.weight, model.down.weight], lr=0.02, adamw_lr=1e-2, compile=False)
    opt.add_param_group({"params": [model.head.weight, model.up.bias]})
    added = opt.param_groups[1:]
    assert [g["use_muon"] for g in added] == [True, False]  # ≥2-D → Muon, as the constructor
    assert all(k in added[0] for k in ("momentum", "nesterov", "adjust_lr_fn", "weight_decay"))
    assert all(k in added[1] for k in ("betas", "eps"))
    assert float(added[0]["lr"]) == 0.02 and float(added[1]["lr"]) == 1e-2
    assert all(isinstance(g["momentum"], torch.Tensor) for g in opt.param_groups)
    result = _train(model, opt)  # before: KeyError 'use_muon' at this step

    ref_model = _model()
    m = ref_model
    ref_opt = dmuon.Muon(
        [{"params": [m.up.weight, m.down.weight]}, {"params": [m.head.weight, m.up.bias]}],
        lr=0.02,
        adamw_lr=1e-2,
        compile=False,
    )
    assert [g["use_muon"] for g in ref_opt.param_groups] == [True, True, False]
    _assert_same(result, _train(ref_model, ref_opt))


def test_add_param_group_on_a_model_routes_like_the_constructor():
    """Unfrozen later: the embedding and head get AdamW by the model's rule (not ≥2-D), and
    the groups are named from the model, as the constructor's are."""
    model = _model()
    for p in [model.embed.weight, model.head.weight]:
        p.requires_grad_(False)
    opt = dmuon.Muon(model, compile=False)
    for p in [model.embed.weight, model.head.weight]:
        p.requires_grad_(True)
    opt.add_param_group({"params": [model.embed.weight, model.head.weight], "lr": 1e-3})
    group = opt.param_groups[-1]
    assert group["use_muon"] is False and group["param_names"] == ["embed.weight", "head.weight"]
    assert float(group["lr"]) == 1e-3 and group["betas"] == (0.9, 0.95)
    _train(model, opt)


def test_add_param_group_explicit_use_muon():
    model = _model()
    opt = dmuon.Muon([model.up.weight], compile=False, adamw_eps=1e-6)
    opt.add_param_group({"params": model.down.weight, "use_muon": False})
    assert opt.param_groups[-1]["use_muon"] is False and opt.param_groups[-1]["eps"] == 1e-6
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(
    "group, message",
    [
        (lambda m: {"params": [m.down.weight, m.up.weight]}, "already in a param group"),
        (lambda m: {"params": [m.down.weight, m.up.bias], "use_muon": True}, "fewer than 2"),
        (lambda m: {"params": []}, "no parameters"),
    ],
    ids=["duplicate", "vector_for_muon", "empty"],
)
def test_add_param_group_refuses_at_the_call(group, message):
    model = _model()
    opt = dmuon.Muon([model.up.weight], compile=False)
    before = len(opt.param_groups)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group(group(model))
    assert len(opt.param_groups) == before  # nothing added: the next step still runs
    model(_batches()[0]).square().mean().backward()
    opt.step()
