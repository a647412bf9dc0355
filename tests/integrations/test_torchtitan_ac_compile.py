"""``dedicating`` with torchtitan's activation checkpointing and per-block compile, on 2 gloo ranks.

torchtitan's ``parallelize_llama`` wraps each block in its AC (``FullAC``, or the per-op
``SelectiveAC``; torchtitan has no layer-selective mode) and then compiles it
(``CompileConfig(enable=True, components=["model"])``: ``block.compile(fullgraph=True)``) before
its FSDP2 step, so ``dedicate_params`` runs on blocks that are already wrapped and compiled.
The debug model on 1-D FSDP (``partial_dtensor``) with (a) full AC, (b) selective AC, (c)
compile and (d) AC + compile: each trains like one process without AC or compile (the
criteria of ``test_torchtitan.py``), and its first gradients (every parameter) equal
torchtitan's own FSDP2 path with the same AC and compile. Compile uses the ``aot_eager``
backend (CompileConfig's ``backend``) for CPU time; Dynamo must have compiled the blocks in
whole graphs. The control halves the dedicated gradients (the dedicated reduce averaging over
the ranks where torchtitan's FSDP2 sums): the losses alone would not show it, Muon's update
being invariant to the gradient's scale, and the gradient comparison must.
"""

from __future__ import annotations

import pytest
import torch
from distributed.harness import full_state, run_ranks

from integrations.test_torchtitan import (
    PER_RANK,
    SEQ,
    _check_against_one_process,
    build_debug_model,
    loss_of,
    parallelize_on_cpu,
    tokens,
)
from integrations.test_torchtitan_spmd import _same_grads, _whole_grads

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3
CASES = {  # label: (activation checkpointing, compile)
    "full_ac": ("full", False),
    "selective_ac": ("selective", False),
    "compile": (None, True),
    "full_ac_compile": ("full", True),
    "selective_ac_compile": ("selective", True),
}
GROUPS = 2  # one hook group per block


def _canonical(state: dict) -> dict:
    """Names without the AC wrapper's segment, as the reference model (and the checkpointer)
    name them."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    return {canonical_fqn(k): v for k, v in state.items()}


def _ac_config(mode):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    # torchtitan's defaults (preserve_rng_state on, as a job's config has it)
    return None if mode is None else {"full": FullAC, "selective": SelectiveAC}[mode].Config()


def _train(
    rank, world, folder, ac=None, compile=False, plain=None, halve=False, backend="aot_eager"
):
    """``STEPS`` steps of the debug model through ``dedicating`` with torchtitan's AC ``ac``
    and per-block ``compile``; ``plain`` (initial weights): torchtitan's own
    ``parallelize_llama`` with the same AC and compile, one backward, its gradients. ``halve``:
    the control, the dedicated reduce divides by the ranks (the mean) instead of following
    torchtitan's FSDP2, which sums."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from dmuon_compile.distributed import dedicated_runtime
    from dmuon_compile.distributed._runtime.group import DedicatedGroup
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallel_dims_module.device_type = "cpu"  # Workaround for CPU (see test_torchtitan.py)
    torch._dynamo.reset()
    counters.clear()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    dp, dp_rank = world, dist.get_rank()
    spec, model = build_debug_model()
    parallelize = (
        spec.parallelize_fn if plain is not None else dmuon_tt.dedicating(spec.parallelize_fn)
    )
    model = parallelize_on_cpu(
        parallelize,
        model,
        dims,
        ParallelismConfig(spmd_backend="partial_dtensor"),
        folder,
        compile_config=CompileConfig(enable=compile, components=["model"], backend=backend),
        ac_config=_ac_config(ac),
    )
    blocks = list(model.layers.values())
    wrapped = [isinstance(b, CheckpointWrapper) for b in blocks]
    compiled = [b._compiled_call_impl is not None for b in blocks]
    global_tokens = dp * PER_RANK * SEQ

    def batch_of(i):
        return tokens(i, dp)[dp_rank * PER_RANK : (dp_rank + 1) * PER_RANK]

    out = {"wrapped": wrapped, "compiled": compiled}
    if plain is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        whole = {k: v.clone() for k, v in plain.items()}  # the loader replaces the values
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
        loss_of(model, batch_of(0), global_tokens).backward()
        out["grads"] = _canonical(_whole_grads(model))
        return out
    if halve:
        follow = DedicatedGroup.follow_fsdp
        DedicatedGroup.follow_fsdp = lambda g, _factor, dtype: follow(g, None, dtype)
    unshards = []  # per step: recomputation must not unshard again
    issue = DedicatedGroup._issue_unshard

    def counting(group, prefetch):
        unshards[-1] += 1
        return issue(group, prefetch)

    DedicatedGroup._issue_unshard = counting
    try:
        dedicated_runtime(model).publish(wait=True)
        out["initial"] = _canonical(full_state(model))
        optimizers = dmuon_tt.MuonOptimizers.Config(lr=0.02, adamw_lr=3e-3).build(
            model_parts=[model]
        )

        def step(i):
            unshards.append(0)
            loss = loss_of(model, batch_of(i), global_tokens)
            loss.backward()
            if i == 0:
                out["grads"] = _canonical(_whole_grads(model))
            optimizers.step()
            optimizers.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            return total.item()

        out["losses"] = [step(i) for i in range(STEPS)]
    finally:
        DedicatedGroup._issue_unshard = issue
        if halve:
            DedicatedGroup.follow_fsdp = follow
    out["unshards"] = unshards
    out["groups"] = [g.name for g in dedicated_runtime(model).groups]
    out["dedicated"] = sorted(_canonical(dict.fromkeys(dedicated_runtime(model).param_names())))
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["breaks"] = sum(counters["graph_break"].values())
    return out


def _scenarios(rank, world, folder, scenarios):
    """Several configurations in one set of rank processes; ``plain_of``: torchtitan's own path
    from another scenario's initial weights."""
    out = {}
    for label, kw in scenarios.items():
        kw = dict(kw)
        if "plain_of" in kw:
            kw["plain"] = out[kw.pop("plain_of")]["initial"]
        out[label] = _train(rank, world, f"{folder}/{label}", **kw)
    return out


def _check_case(results: list[dict], label: str, ac, compile) -> None:
    r0 = results[0][label]
    assert r0["wrapped"] == [ac is not None] * len(r0["wrapped"]), r0["wrapped"]
    assert r0["compiled"] == [compile] * len(r0["compiled"]), r0["compiled"]
    if compile:
        assert r0["graphs"] >= 1 and r0["breaks"] == 0, (r0["graphs"], r0["breaks"])
    # The hook groups are the blocks as torchtitan left them (the AC wrapper, outside the
    # recomputation and Dynamo's graph); as without AC: one unshard per group in forward and
    # in backward, the last group kept over the turn (2·G − 1 once the order is known).
    assert r0["groups"] == [f"layers.{i}" for i in range(GROUPS)], r0["groups"]
    assert r0["unshards"] == [2 * GROUPS] + [2 * GROUPS - 1] * (STEPS - 1), r0["unshards"]
    dedicated = set(r0["dedicated"])
    assert len(dedicated) == 10 and all(n.startswith("layers.") for n in dedicated), dedicated
    # The reference loads these by name: they must be the plain model's names.
    _, reference_model = build_debug_model()
    assert r0["initial"].keys() == dict(reference_model.named_parameters()).keys()
    _check_against_one_process([r[label] for r in results], 2)
    want = results[0][f"{label}_plain"]["grads"]
    assert r0["grads"].keys() == want.keys()
    assert not _same_grads(r0["grads"], want, want), label


def _run(tmp_path, cases: dict, control: bool = False) -> list[dict]:
    scenarios = {}
    for label, (ac, compile) in cases.items():
        scenarios[label] = {"ac": ac, "compile": compile}
        scenarios[f"{label}_plain"] = {"ac": ac, "compile": compile, "plain_of": label}
    if control:
        scenarios["halved"] = {"ac": "full", "compile": True, "halve": True}
    return run_ranks(_scenarios, 2, str(tmp_path), scenarios, timeout=220)


def test_torchtitan_ac_and_block_compile_train_like_one_process_with_fsdp2s_gradients(tmp_path):
    """(a) full AC, (b) selective AC, (c) per-block compile, (d) full AC + compile: each equal
    to one process within 1e-4 over 3 steps, with the first gradients of torchtitan's own FSDP2
    path under the same AC and compile. Control: the dedicated gradients halved (mean instead
    of torchtitan's sum) still train like one process (Muon is scale invariant) but miss
    torchtitan's gradients by a factor 2."""
    pytest.importorskip("torchtitan")
    results = _run(tmp_path, CASES, control=True)
    failed = []
    for label, (ac, compile) in CASES.items():  # report every case's mismatch
        try:
            _check_case(results, label, ac, compile)
        except AssertionError as exc:
            failed.append(f"{label}: {exc}")
    assert not failed, "\n".join(failed)
    halved = results[0]["halved"]
    _check_against_one_process([r["halved"] for r in results], 2)
    want = results[0]["full_ac_compile_plain"]["grads"]
    dedicated = halved["dedicated"]
    wrong = _same_grads(halved["grads"], want, dedicated)
    assert len(wrong) == len(dedicated), wrong
    for name in dedicated:
        ratio = halved["grads"][name].norm() / want[name].norm()
        assert ratio == pytest.approx(0.5, rel=0.05), (name, ratio)
