"""Nested hook groups: a dedicated weight on a module whose forward runs other hook groups.

With the default predicate a ViT's 2-D ``pos_embed`` on the root module makes the root a hook
group whose forward encloses every block's; a CNN's root-level 3-D parameter (and root-level
stem conv) does the same next to dedicated conv blocks. Backward reaches the root's output
first, so the blocks' backward is *not* done there: their reduces must wait for their
gradients. The same holds for two forwards before one backward (every group's forward span
then encloses the other groups' second forward). Each case trains like one process (plain
model, same init, the whole batch), on 1 and 2 ranks; a control with the old rule ("every
group after this one in forward order is done") proves the test sees the zero gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon_compile.distributed._runtime.group import GroupState

from . import models
from .harness import full_state, local_device, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

STEPS = 3
HYPER = {"lr": 0.02, "adamw_lr": 1e-2, "compile": False}
IMG, PATCH, CLASSES = 8, 4, 10


class PatchEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, PATCH, stride=PATCH)  # 4-D: dedicated, group patch_embed

    def forward(self, img):
        return self.proj(img).flatten(2).transpose(1, 2)


class TinyViT(nn.Module):
    """Patch embedding, a 2-D ``pos_embed`` on the root, blocks, a classifier head."""

    def __init__(self, dim: int = models.D, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.pos_embed = nn.Parameter(0.1 * torch.randn((IMG // PATCH) ** 2, dim))
        self.blocks = nn.ModuleList(models.Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, img):
        x = self.patch_embed(img) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + F.silu(self.conv(x))


class TinyConvNet(nn.Module):
    """A root-level stem conv and 3-D ``channel_scale`` (used last) around conv blocks."""

    def __init__(self, channels: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.channel_scale = nn.Parameter(1 + 0.1 * torch.randn(channels, 1, 1))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, img):
        x = self.stem(img)
        for block in self.blocks:
            x = block(x)
        return self.head((x * self.channel_scale).mean((2, 3)))


class TwoForwards(nn.Module):
    """The Llama-like stack run on two inputs before one backward (``x`` stacks both)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = models.build_llama()

    def forward(self, x):
        a, b = x.unbind(1)
        return torch.stack([self.inner(a), self.inner(b)], 1)


CASES = {
    "vit": (TinyViT, lambda g, n: torch.randn(n, 3, IMG, IMG, generator=g)),
    "conv": (TinyConvNet, lambda g, n: torch.randn(n, 3, IMG, IMG, generator=g)),
    "two_forwards": (TwoForwards, lambda g, n: torch.randn(n, 2, 8, models.D, generator=g)),
}
# the groups each case must have: a group whose forward encloses others, and its blocks
ENCLOSED = {"vit": "blocks.", "conv": "blocks.", "two_forwards": "inner.layers."}
GROUPS = {
    "vit": ["<root>", "patch_embed", "blocks.0", "blocks.1", "blocks.2"],
    "conv": ["<root>", "blocks.0", "blocks.1", "blocks.2"],
    "two_forwards": ["inner.layers.0", "inner.layers.1", "inner.layers.2"],
}


def _build(case: str):
    torch.manual_seed(0)
    return CASES[case][0]()


def _batches(case: str, world: int):
    g = torch.Generator().manual_seed(5)
    return [CASES[case][1](g, 2 * world) for _ in range(STEPS)]


def _loss(out):
    return out.square().mean()


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def reference(case: str, world: int, device: str = "cpu"):
    """One process: the plain model, the whole batch, default routing (results on the CPU)."""
    import dmuon_compile as dmuon

    model = _build(case).to(device)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    grads = None
    for x in _batches(case, world):
        _loss(model(x.to(device))).backward()
        if grads is None:
            grads = {n: p.grad.cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def old_rule(runtime, group) -> int:
    """The rule before nesting was handled: every group after ``group`` in forward order is
    done when backward reaches ``group``'s output (false for a group enclosing others)."""
    i = runtime._index[id(group)]
    return sum(1 for g in runtime.forward_order[i + 1 :] if g.ran_forward)


def _train(rank: int, world: int, case: str, steps: int, device: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon_compile as dmuon
    from dmuon_compile.distributed import dedicated_runtime

    if device == "cuda":  # full fp32 convolutions, as the reference's
        torch.backends.cudnn.allow_tf32 = False
    dev = local_device(device)
    mesh = init_device_mesh(device, (world,))
    model = _build(case).to(dev)
    owners = dmuon.dedicate_params(model, mesh)  # the default predicate
    blocks = model.inner.layers if case == "two_forwards" else model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    runtime = dedicated_runtime(model)
    grads, states = None, []
    for x in _batches(case, world)[:steps]:
        per = x.shape[0] // world
        _loss(model(x[rank * per : (rank + 1) * per].to(dev))).backward()
        states.append(sorted({g.state for g in runtime.groups}, key=str))
        if grads is None:  # the owner holds the full gradient averaged over the ranks
            grads = {n: g.clone() for n, g in models.owned_grads(model).items()}
        opt.step()
        opt.zero_grad()
    return {
        "owners": owners,
        "groups": [g.name for g in runtime.forward_order],
        "grads": grads,
        "states": states,
        "state": full_state(model),
    }


def _cases(rank: int, world: int, device: str = "cpu"):
    from dmuon_compile.distributed._runtime.runtime import DedicatedRuntime

    out = {case: _train(rank, world, case, STEPS, device) for case in CASES}
    fixed = DedicatedRuntime._finished_before
    DedicatedRuntime._finished_before = old_rule  # control: one backward with the old rule
    try:
        out["control"] = {case: _train(rank, world, case, 1, device)["grads"] for case in CASES}
    finally:
        DedicatedRuntime._finished_before = fixed
    return out


def _grad_mismatches(got: dict, ref: dict) -> list[str]:
    return [n for n, g in got.items() if not torch.allclose(g, ref[n], rtol=1e-4, atol=1e-6)]


@pytest.mark.parametrize("world", [1, 2])
def test_nested_groups_train_like_one_process(world):
    refs = {case: reference(case, world) for case in CASES}
    check_nested(run_ranks(_cases, world, timeout=120), refs)


def check_nested(results: list[dict], refs: dict) -> None:
    """Each case's groups, gradients and weights equal one process's; the controls miss."""
    for case, (ref_grads, ref_state) in refs.items():
        seen = set()
        for r in results:
            got = r[case]
            assert got["groups"] == GROUPS[case], case
            assert got["states"] == [[GroupState.SHARDED]] * STEPS, case  # nothing left unsharded
            assert not _grad_mismatches(got["grads"], ref_grads), (case, got["grads"].keys())
            seen |= set(got["grads"])
        assert seen == set(results[0][case]["owners"]), case  # every dedicated weight checked
        for name, ref in ref_state.items():
            torch.testing.assert_close(
                results[0][case]["state"][name],
                ref,
                rtol=0,
                atol=2e-4,
                msg=lambda m, name=name, case=case: f"{case} {name}: {m}",
            )
    # control: the old rule reduces the enclosed groups before their gradients exist
    for case, (ref_grads, _) in refs.items():
        control = {n: g for r in results for n, g in r["control"][case].items()}
        wrong = _grad_mismatches(control, ref_grads)
        assert wrong, f"{case}: the control did not detect the early reduces"
        # the enclosed blocks' reduces went out before their gradients: exactly zero
        assert any(n.startswith(ENCLOSED[case]) and not control[n].any() for n in wrong), wrong
