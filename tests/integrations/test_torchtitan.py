"""``dmuon_compile.integrations.torchtitan`` with torchtitan's own pieces, on 2 gloo ranks.

torchtitan's Llama-3 debug model (2 of its layers), built on the meta device; its
``ParallelDims`` meshes (1-D FSDP); its ``parallelize_llama`` wrapped by ``dedicating``; its
``init_weights`` after ``to_empty``; ``MuonOptimizers`` built from its config; its DCP
``CheckpointManager`` saving and resuming mid-run. The losses match one process training the
same initial weights on the global batch with ``dmuon.Muon``, and the resumed step repeats the
step after the save exactly. Without torchtitan the tests that need it skip; the import error
and ``import dmuon_compile`` staying free of torchtitan are checked either way.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from distributed.harness import full_state, run_ranks

pytestmark = [pytest.mark.timeout(200)]

SEQ, PER_RANK, LAYERS, STEPS = 16, 2, 2, 3
VOCAB = 2048  # the debug model's


class CausalSDPA(torch.nn.Module):
    """Workaround for CPU: the debug model's FlexAttention has no backward on CPU, so each
    block's (parameter-free) inner attention is replaced by causal SDPA on the same layout."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


def build_debug_model():
    """torchtitan's Llama-3 debug model (first ``LAYERS`` layers) on the meta device."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:LAYERS]
    with torch.device("meta"):
        model = spec.model.build()
    for block in model.layers.values():
        block.attention.inner_attention = CausalSDPA()
    return spec, model


def tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (world * PER_RANK, SEQ + 1), generator=g)


def loss_of(model, batch, global_tokens: int):
    """torchtitan's loss: summed over this rank's tokens, divided by the global token count
    (FSDP2 then sums gradients: ``apply_fsdp_to_decoder`` disables its division)."""
    logits = model(batch[:, :-1])
    return (
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
        )
        / global_tokens
    )


def _train_torchtitan(rank, world, folder):
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    # Workaround for CPU: torchtitan names its device "cuda" when no accelerator is present.
    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    spec, model = build_debug_model()
    parallelize = dmuon_tt.dedicating(spec.parallelize_fn)
    model = parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=folder,
    )
    for m in model.modules():  # Workaround for gloo: it has no PREMUL_SUM (FSDP2's reduce op)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    initial = full_state(model)
    optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=[model])
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )

    def step(i):
        batch = tokens(i, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = loss_of(model, batch, world * PER_RANK * SEQ)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()

    losses = [step(i) for i in range(STEPS)]
    checkpointer.save(curr_step=STEPS)
    after_save = step(STEPS)
    assert checkpointer.load(step=STEPS)
    resumed = step(STEPS)
    groups = [(g["use_muon"], g["param_names"]) for opt in optimizers for g in opt.param_groups]
    return {
        "initial": initial,
        "losses": losses,
        "after_save": after_save,
        "resumed": resumed,
        "groups": groups,
    }


def _reference(initial, world):
    """One process: the same initial weights, the global batch, ``dmuon.Muon``."""
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    _, model = build_debug_model()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (rope); weights come from `initial`
    model.load_state_dict(initial, strict=False)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, predicate=dmuon_tt.default_predicate)
    losses = []
    for i in range(STEPS):
        loss = loss_of(model, tokens(i, world), world * PER_RANK * SEQ)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_torchtitan_llama_fsdp_trains_like_one_process_and_resumes(tmp_path):
    pytest.importorskip("torchtitan")
    results = run_ranks(_train_torchtitan, 2, str(tmp_path), timeout=180)
    r0 = results[0]
    muon = {name for use_muon, names in r0["groups"] if use_muon for name in names}
    assert muon and all(n.startswith("layers.") and n.endswith(".weight") for n in muon)
    assert len(muon) == 5 * LAYERS  # wqkv, wo, w1, w2, w3 of each block
    adamw = {name for use_muon, names in r0["groups"] if not use_muon for name in names}
    assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= adamw
    ref = _reference(r0["initial"], 2)
    assert ref[-1] < ref[0]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)
        # the checkpointer's resume repeats the step after the save
        assert r["resumed"] == pytest.approx(r["after_save"], rel=1e-6)
        assert r["after_save"] != pytest.approx(r["losses"][-1], rel=1e-4)


def test_import_error_names_the_extra_and_core_import_stays_free_of_torchtitan():
    code = (
        "import sys\n"
        "import dmuon_compile\n"
        "assert 'torchtitan' not in sys.modules, 'import dmuon_compile imported torchtitan'\n"
        "sys.modules['torchtitan'] = None  # as if not installed\n"
        "try:\n"
        "    import dmuon_compile.integrations.torchtitan\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert 'pip install "dmuon_compile[torchtitan]"' in out.stdout, out.stdout + out.stderr
