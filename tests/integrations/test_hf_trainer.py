"""The HF ``Trainer`` with accelerate's FSDP2 and ``dmuon.Muon``, on 2 gloo ranks.

The README's ``MuonTrainer`` (a ``create_optimizer`` override) and
``optimizer_cls_and_kwargs=(MuonFactory, ...)`` train a tiny Llama like one process with the
whole batch (weights within 1e-5 after 3 steps, gradient clipping on). Before, the Trainer's
``accelerator.prepare`` raised ``KeyError`` on dedicated weights.
``optimizer_cls_and_kwargs=(dmuon.Muon, ...)`` gives Muon a flat parameter list: every
≥2-D weight, embeddings and head included, is a Muon matrix, which FSDP2 then shards; the
first step raises naming ``dedicate_params`` (before: a ``MuonStepError`` about a mixed
Tensor/DTensor add).

Test-only workarounds, in ``CPUTrainer``: accelerate selects FSDP on accelerators only (on the
CPU it would run DDP), so the Trainer's state is switched to FSDP2 after its ``Accelerator``
is built; batches are taken in order (no shuffle) so that one process sees the same samples.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.distributed.harness import full_state, run_ranks  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD, STEPS, BATCH, SEQ = 2, 3, 4, 16
MUON = {"lr": 0.01, "adamw_lr": 0.01, "weight_decay": 0.01}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def dataset():
    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer_classes(fsdp2: bool):
    from transformers import Trainer

    import dmuon_compile as dmuon
    from dmuon_compile.integrations import accelerate as dmuon_accelerate

    class CPUTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if fsdp2:  # accelerate picks FSDP on accelerators only: switch its state by hand
                from accelerate import PartialState
                from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

                # both shared states (AcceleratorState copies PartialState's type when built)
                PartialState().distributed_type = DistributedType.FSDP
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
                self.is_fsdp_enabled = True

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    class MuonTrainer(CPUTrainer):  # the README's example (there: a subclass of Trainer)
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                model = self.model if model is None else model
                if self.is_fsdp_enabled:  # FSDP2: dedicate before accelerate's fully_shard
                    dmuon_accelerate.dedicate_params(self.accelerator, model)
                self.optimizer = dmuon.Muon(
                    model,
                    lr=self.args.learning_rate,
                    adamw_lr=self.args.learning_rate,
                    weight_decay=self.args.weight_decay,
                )
            return self.optimizer

    return CPUTrainer, MuonTrainer


def train(world: int, out_dir: str, how: str, fsdp2: bool) -> dict:
    from transformers import TrainingArguments

    import dmuon_compile as dmuon
    from dmuon_compile.integrations.accelerate import MuonFactory

    cpu_trainer, muon_trainer = trainer_classes(fsdp2)
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // world,
        learning_rate=MUON["lr"],
        weight_decay=MUON["weight_decay"],
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    assert args.device.type == "cpu"  # its set-up resets accelerate's state: before the Trainer's
    common = dict(model=tiny_llama(), args=args, train_dataset=dataset())
    if how == "subclass":
        trainer = muon_trainer(**common)
    elif how == "factory":
        trainer = cpu_trainer(**common, optimizer_cls_and_kwargs=(MuonFactory, MUON))
    else:
        trainer = cpu_trainer(**common, optimizer_cls_and_kwargs=(dmuon.Muon, MUON))
    try:
        trainer.train()
    except ValueError as err:
        return {"error": str(err)}
    model = trainer.model
    names = {id(p): n for n, p in model.named_parameters()}
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    groups = [sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups]
    if fsdp2:
        state = {n: t.cpu() for n, t in full_state(model).items()}
    else:
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"groups": groups, "state": state}


def trainer_worker(rank: int, world: int, out_dir: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # accelerate's CPU state reads it
    return {how: train(world, out_dir, how, True) for how in ("subclass", "factory", "flat")}


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory):
    return run_ranks(trainer_worker, WORLD, str(tmp_path_factory.mktemp("fsdp2")), timeout=200)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(1, str(tmp_path_factory.mktemp("one")), "subclass", False)


@pytest.mark.parametrize("how", ["subclass", "factory"])
def test_trainer_fsdp2_trains_like_one_process(trainer_ranks, reference, how):
    muon, adamw = reference["groups"]
    assert "lm_head.weight" in adamw and "model.embed_tokens.weight" in adamw
    assert len(muon) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    start = dict(tiny_llama().named_parameters())
    for name, want in reference["state"].items():
        assert not torch.equal(want, start[name].detach()), name  # every weight moved
    for rank, out in enumerate(trainer_ranks):
        got = out[how]
        assert "error" not in got, got
        assert got["groups"] == reference["groups"], rank
        for name, want in reference["state"].items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_trainer_flat_muon_raises_at_first_step(trainer_ranks):
    for out in trainer_ranks:
        err = out["flat"].get("error")
        assert err is not None and "DTensor shard" in err and "dedicate_params" in err, out
