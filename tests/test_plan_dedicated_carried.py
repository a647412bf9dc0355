"""``plan_dedicated`` / ``dedicate_params`` with ``base_loads``: the owner plan of a model over the
loads other models (the pipeline stages before it) already put on the same ranks. One process,
a meta-device model; ``tests/integrations/test_torchtitan_pp.py`` runs it under torchtitan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon_compile.distributed.dedicate import plan_dedicated
from dmuon_compile.distributed.owner_plan import plan_owners


class Block(nn.Module):
    """Five matrices no two ranks can split evenly: three 768×256, one 256×768, one 256×256."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(256, 768, bias=False)
        self.wo = nn.Linear(256, 256, bias=False)
        self.w1 = nn.Linear(256, 768, bias=False)
        self.w2 = nn.Linear(768, 256, bias=False)
        self.w3 = nn.Linear(256, 768, bias=False)

    def forward(self, x):
        return self.w2(self.w1(x) * self.w3(x)) + self.wo(self.wqkv(x)[..., :256])


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): Block()})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _stage(index: int) -> nn.Module:
    with torch.device("meta"):
        return Stage(index)


def test_plan_dedicated_plans_over_the_carried_loads():
    first = plan_dedicated(_stage(0), world_size=2).plan
    base = first.ns_loads()
    alone = plan_dedicated(_stage(2), world_size=2)
    together = plan_dedicated(_stage(2), world_size=2, base_loads=base)
    assert together.plan.digest() == plan_owners(together.specs, 2, base_loads=base).digest()
    # Control: alone, the second stage repeats the first one's uneven split.
    assert alone.plan.ns_loads() == base and base[0] != base[1]
    summed = [a + b for a, b in zip(base, together.plan.ns_loads())]
    assert summed[0] == summed[1]
    assert plan_dedicated(_stage(2), world_size=2, base_loads=[0.0, 0.0]).plan.digest() == (
        alone.plan.digest()
    )


def test_plan_dedicated_carried_loads_with_hsdp_and_bad_arguments():
    # HSDP: one carried load per global owner slot (replicate × shard).
    planned = plan_dedicated(
        _stage(0), world_size=2, replicate_size=2, base_loads=[9e12, 9e12, 0, 0]
    )
    assert set(planned.owners().values()) == {2, 3}
    with pytest.raises(ValueError, match="base_loads has 2 values for world_size=4"):
        plan_dedicated(_stage(0), world_size=2, replicate_size=2, base_loads=[0.0, 0.0])
    with pytest.raises(NotImplementedError, match="base_loads with TP"):
        plan_dedicated(_stage(0), world_size=2, tp_size=2, base_loads=[0.0, 0.0])
