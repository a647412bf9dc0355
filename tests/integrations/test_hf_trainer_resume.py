"""The HF ``Trainer`` with FSDP2 and ``dmuon.Muon`` saves and resumes with its default FSDP
checkpoint type (``FULL_STATE_DICT``), on 2 gloo ranks.

A run of 4 steps saves a checkpoint at step 2; a second Trainer, on a model with other initial
weights, resumes from it (``train(resume_from_checkpoint=...)``) and ends with the same weights
as the uninterrupted run, with the same losses on steps 3 and 4. The checkpoint goes through
torch's full-state functions (``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``
with ``full_state_dict=True``, ``cpu_offload`` and ``broadcast_from_rank0``), which before
raised on dedicated weights, so the resume crashed.

The test-only workarounds of ``test_hf_trainer.py`` apply (FSDP2 switched on by hand on the
CPU, batches in order); the plugin is built with ``state_dict_type="FULL_STATE_DICT"``, what
the Trainer's ``fsdp_config`` gives by default.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.distributed.harness import full_state, run_ranks  # noqa: E402
from tests.integrations.test_hf_trainer import MUON, tiny_llama  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

WORLD, STEPS, SAVE_AT, BATCH, SEQ = 2, 4, 2, 4, 16


def dataset():
    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer_class():
    from transformers import Trainer

    from dmuon_compile.integrations.accelerate import MuonFactory

    class FullStateTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            from accelerate import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            # accelerate picks FSDP on accelerators only: switch both shared states by hand
            PartialState().distributed_type = DistributedType.FSDP
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2, state_dict_type="FULL_STATE_DICT"
            )
            self.is_fsdp_enabled = True

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return FullStateTrainer, MuonFactory


def train(world: int, out_dir: str, resume_from: str | None) -> dict:
    from transformers import TrainingArguments

    trainer_cls, factory = trainer_class()
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // world,
        learning_rate=MUON["lr"],
        weight_decay=MUON["weight_decay"],
        lr_scheduler_type="linear",  # the resumed run must pick the schedule up where it was
        max_grad_norm=1.0,
        save_strategy="no" if resume_from else "steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    assert args.device.type == "cpu"
    model = tiny_llama()
    if resume_from:  # other initial weights: the resume must replace them all
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(factory, MUON),
    )
    assert "FULL_STATE_DICT" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
    trainer.train(resume_from_checkpoint=resume_from)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    state = {n: t.cpu() for n, t in full_state(trainer.model).items()}
    return {"losses": losses, "state": state}


def resume_worker(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # accelerate's CPU state reads it
    first = os.path.join(out_dir, "uninterrupted")
    whole = train(world, first, None)
    dist.barrier()
    resumed = train(world, os.path.join(out_dir, "resumed"), f"{first}/checkpoint-{SAVE_AT}")
    return {"whole": whole, "resumed": resumed}


def test_trainer_full_state_checkpoint_resumes_exactly(tmp_path):
    results = run_ranks(resume_worker, WORLD, str(tmp_path), timeout=200)
    start = dict(tiny_llama().named_parameters())
    for rank, r in enumerate(results):
        whole, resumed = r["whole"], r["resumed"]
        # the checkpoint's log (steps 1, 2) and the resumed steps 3, 4
        assert sorted(resumed["losses"]) == list(range(1, STEPS + 1)), resumed["losses"]
        for step, loss in resumed["losses"].items():
            assert loss == whole["losses"][step], (rank, step)
        for name, want in whole["state"].items():
            assert not torch.equal(want, start[name].detach()), name  # every weight moved
            assert torch.equal(resumed["state"][name], want), (rank, name)
