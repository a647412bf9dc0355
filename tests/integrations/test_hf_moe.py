"""A tiny HF transformers Qwen3-MoE through accelerate's FSDP2 prepare and the HF ``Trainer``
with ``dmuon.Muon``, on 2 gloo ranks.

transformers 5.x builds Qwen3-MoE's experts fused (``Qwen3MoeExperts``, marked by
``use_experts_implementation``): per layer a ``gate_up_proj`` stack ``(E, 2·I, H)`` (gate and
up halves concatenated) and a ``down_proj`` stack ``(E, H, I)``; the router is ``mlp.gate``
(``Qwen3MoeTopKRouter``).

- accelerate: ``integrations.accelerate.dedicate_params`` (default predicate: the dense
  matrices are dedicated, the expert stacks stay with FSDP2, ``Shard(0)``: each rank holds two
  whole experts), ``dmuon.Muon(model)``, ``accelerator.prepare``. The expert stacks are Muon
  parameters with the experts layout (``gate_up_proj`` split in its two halves, ``"chunk"``),
  the routers are AdamW. The losses (causal-LM cross-entropy) equal one process training the
  same initial weights on the global batch with ``dmuon.Muon(model)`` (per-expert
  Newton–Schulz there too) within rtol 1e-4, the final weights within 5e-5 (measured:
  3e-7 and 1.3e-5).
- Every step, the second rank's rows are one repeated token: every position has the same
  hidden state, so its tokens reach only two of the four experts in each layer (recorded by a
  hook on the routers and asserted): its other experts' local gradients are zero there.
- The HF ``Trainer`` with ``optimizer_cls_and_kwargs=(MuonFactory, ...)`` (the
  test_hf_trainer.py set-up, gradient clipping on and acting) trains like a one-process
  ``Trainer``: the same gradient norms (rtol 1e-4) and weights (5e-5).
- Control: the one-process run with each expert stack orthogonalised as one flattened
  matrix (the predicate returns ``Layout.conv()`` for 3-D weights) ends 0.03 to 0.08 away from
  the distributed run, far beyond the tolerance: the comparison tells per-expert from
  flattened updates.

accelerate's prepare replaces every optimizer parameter (by FSDP2's, found by name): the Muon
must keep each slot's layout for the parameter that replaces it. Before, the expert stacks
lost theirs (``Muon._layouts`` is keyed by the built parameters' ids) and the first step raised
``ValueError: ... has shape (4, 32, 32) ... its module (unknown) does not say what its matrices
are``.

fp32 throughout (``NewtonSchulz(kernel="cublas", work_dtype=float32)``).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.distributed.harness import full_state, run_ranks  # noqa: E402
from tests.integrations.test_accelerate import fsdp2_accelerator  # noqa: E402
from tests.integrations.test_hf_trainer import trainer_classes  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD, STEPS, BATCH, SEQ, VOCAB, EXPERTS = 2, 3, 4, 12, 64, 4
HYPER = {"lr": 0.02, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
LAYERS = 2


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(config)


def global_batches() -> list[torch.Tensor]:
    """``STEPS`` global batches ``(BATCH, SEQ)``: the first rank's rows random tokens, the
    second rank's rows one token repeated (a new one each step)."""
    gen = torch.Generator().manual_seed(5)
    half = BATCH // WORLD
    out = []
    for step in range(STEPS):
        rand = torch.randint(0, VOCAB, (half, SEQ), generator=gen)
        out.append(torch.cat([rand, torch.full((half, SEQ), 7 + step)]))
    return out


def record_routing(model) -> list[list[int]]:
    """A hook on every router: each forward appends the sorted experts its tokens reached."""
    reached: list[list[int]] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(
                lambda _m, _args, out: reached.append(sorted(out[2].unique().tolist()))
            )
    return reached


def _global_mean(loss: torch.Tensor) -> float:
    summed = loss.detach().clone()
    torch.distributed.all_reduce(summed)
    return summed.item() / torch.distributed.get_world_size()


def train_prepared(rank: int, world: int) -> dict:
    """dedicate_params, Muon(model), accelerator.prepare, STEPS steps on this rank's rows."""
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import accelerate as dmuon_accelerate

    accelerator = fsdp2_accelerator(world)
    model = tiny_qwen3_moe()
    reached = record_routing(model)
    owners = dmuon_accelerate.dedicate_params(accelerator, model)
    model, opt = accelerator.prepare(model, dmuon.Muon(model, ns_backend=_ns(), **HYPER))
    muon = opt.optimizer
    groups = {
        muon.param_name(p): str(muon._layout(p)) if g["use_muon"] else "adamw"
        for g in muon.param_groups
        for p in g["params"]
    }
    placements = {  # (kind, dim) of each expert stack's placements
        n: [(type(pl).__name__, getattr(pl, "dim", None)) for pl in p.placements]
        for n, p in model.named_parameters()
        if p.ndim == 3
    }
    per = BATCH // world
    losses = []
    for x in global_batches():
        mine = x[rank * per : (rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(loss))
    return {
        "owners": owners,
        "groups": groups,
        "placements": placements,
        "reached": reached,
        "losses": losses,
        "state": {n: t.cpu() for n, t in full_state(model).items()},
    }


def trainer_dataset():
    return [{"input_ids": row, "labels": row.clone()} for x in global_batches() for row in x]


def train_with_trainer(world: int, out_dir: str, fsdp2: bool) -> dict:
    """The HF ``Trainer`` with ``optimizer_cls_and_kwargs=(MuonFactory, ...)``; on 2 ranks
    accelerate deals out each global batch of ``BATCH`` rows in order, as ``global_batches``."""
    from transformers import TrainingArguments

    from dmuon_compile.integrations.accelerate import MuonFactory

    cpu_trainer, _ = trainer_classes(fsdp2)
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // world,
        learning_rate=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,  # the log holds each step's gradient norm (before clipping)
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    kwargs = {**HYPER, "ns_backend": _ns()}
    trainer = cpu_trainer(
        model=tiny_qwen3_moe(),
        args=args,
        train_dataset=trainer_dataset(),
        optimizer_cls_and_kwargs=(MuonFactory, kwargs),
    )
    trainer.train()
    model = trainer.model
    names = {id(p): n for n, p in model.named_parameters()}
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    groups = [sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups]
    if fsdp2:
        state = {n: t.cpu() for n, t in full_state(model).items()}
    else:
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"groups": groups, "state": state, "grad_norms": norms}


def moe_worker(rank: int, world: int, out_dir: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # accelerate's CPU state reads it
    return {
        "accelerate": train_prepared(rank, world),
        "trainer": train_with_trainer(world, out_dir, fsdp2=True),
    }


@pytest.fixture(scope="module")
def moe_ranks(tmp_path_factory):
    return run_ranks(moe_worker, WORLD, str(tmp_path_factory.mktemp("moe")), timeout=200)


def reference(flattened: bool = False) -> tuple[list[float], dict]:
    """One process, the same initial weights, the global batches, ``dmuon.Muon(model)``.
    ``flattened`` (the control): each expert stack as one flattened matrix."""
    import dmuon_compile as dmuon

    predicate = None
    if flattened:

        def predicate(name, p):
            if p.ndim == 3:
                return dmuon.Layout.conv()
            return dmuon.default_muon_predicate(name, p)

    model = tiny_qwen3_moe()
    opt = dmuon.Muon(model, ns_backend=_ns(), predicate=predicate, **HYPER)
    losses = []
    for x in global_batches():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stack_names() -> list[str]:
    return [f"model.layers.{i}.{s}" for i in range(LAYERS) for s in STACKS]


def test_qwen3_moe_prepare_trains_like_one_process(moe_ranks):
    ref_losses, ref_state = reference()
    start = {n: p.detach() for n, p in tiny_qwen3_moe().named_parameters()}
    assert start["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 32, 32)
    assert start["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # a router, initialised
    assert all(not torch.equal(ref_state[n], start[n]) for n in ref_state)  # every weight moved
    for rank, out in enumerate(moe_ranks):
        got = out["accelerate"]
        owners, groups = got["owners"], got["groups"]
        for name in _stack_names():  # expert stacks: FSDP2's Shard(0), Muon per expert
            assert name not in owners, name
            assert got["placements"][name] == [("Shard", 0)], got["placements"]
            split = "'chunk'" if name.endswith("gate_up_proj") else "None"
            assert groups[name].startswith(f"Layout(kind='experts', split={split}"), groups[name]
        assert "model.layers.0.self_attn.q_proj.weight" in owners  # dense matrices: dedicated
        assert groups["model.layers.0.self_attn.q_proj.weight"].startswith("Layout(kind='matrix'")
        for i in range(LAYERS):  # the routers: AdamW, not dedicated
            assert groups[f"model.layers.{i}.mlp.gate.weight"] == "adamw"
            assert f"model.layers.{i}.mlp.gate.weight" not in owners
        assert groups["lm_head.weight"] == groups["model.embed_tokens.weight"] == "adamw"
        assert set(owners.values()) == set(range(WORLD)), rank
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=0
        )
        for name, want in ref_state.items():
            torch.testing.assert_close(got["state"][name], want, rtol=0, atol=5e-5, msg=name)


def test_an_expert_gets_no_token_on_a_rank(moe_ranks):
    """The second rank's repeated token reaches 2 of the 4 experts in each layer, each step;
    the first rank's random tokens reach all of them."""
    reached = [out["accelerate"]["reached"] for out in moe_ranks]
    assert len(reached[1]) == STEPS * LAYERS
    assert all(len(r) == 2 for r in reached[1]), reached[1]
    assert all(r == list(range(EXPERTS)) for r in reached[0]), reached[0]


def test_flattened_expert_stacks_end_elsewhere(moe_ranks):
    """Control: orthogonalising each stack as one flattened matrix moves the experts
    measurably away from the distributed (per-expert) run."""
    _, flat_state = reference(flattened=True)
    state = moe_ranks[0]["accelerate"]["state"]
    for name in _stack_names():
        gap = (flat_state[name] - state[name]).abs().max()
        assert gap > 1e-2, (name, gap)  # 200x the tolerance above (measured: 0.03 to 0.08)


def test_qwen3_moe_trainer_trains_like_one_process(moe_ranks, tmp_path):
    ref = train_with_trainer(1, str(tmp_path), fsdp2=False)
    muon, adamw = ref["groups"]
    assert set(_stack_names()) <= set(muon)
    assert "model.layers.0.mlp.gate.weight" in adamw and "lm_head.weight" in adamw
    assert len(ref["grad_norms"]) == STEPS and min(ref["grad_norms"]) > 1.0  # clipping acts
    start = dict(tiny_qwen3_moe().named_parameters())
    for name, want in ref["state"].items():
        assert not torch.equal(want, start[name].detach()), name  # every weight moved
    for rank, out in enumerate(moe_ranks):
        got = out["trainer"]
        assert got["groups"] == ref["groups"], rank
        # the global norm over dedicated matrices, expert shards and FSDP2's other shards
        torch.testing.assert_close(
            torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=0
        )
        for name, want in ref["state"].items():
            torch.testing.assert_close(got["state"][name], want, rtol=0, atol=5e-5, msg=name)
