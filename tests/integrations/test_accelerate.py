"""HF accelerate's FSDP2 prepare with dedicated weights and ``dmuon.Muon``, on 2 gloo ranks.

accelerate picks FSDP only on accelerators (on the CPU it runs DDP, ``MULTI_CPU``), so the
workers switch its state to FSDP2 by hand after building the ``Accelerator`` (the one
workaround kept here); everything else is accelerate's own code: ``accelerator.prepare``
(auto-wrap, ``fully_shard``, the optimizer's parameter swap), ``accelerator.backward``.

- ``accelerator.prepare(model, dmuon.Muon(model))`` after
  ``integrations.accelerate.dedicate_params`` trains like one process with the whole batch
  (weights within 1e-5 after 3 steps). Before, prepare raised ``KeyError: A parameter in the
  optimizer couldn't be switched to its sharded version``.
- The same with the model's parameters keyed as accelerate 1.10-1.12 keyed them (a dedicated
  weight by its ``data_ptr()``, 0, the optimizer's side by its local tensor's address): before,
  prepare raised accelerate's ``KeyError`` on each rank that holds a dedicated weight.
- Control: the optimizer's parameter lists right after accelerate's swap (before Muon puts
  its dedicated weights back, once, inside prepare) hold the wrong weights on a rank that owns
  some but not all: the swap alone is not enough, and the test would see it.
- A Muon matrix that accelerate shards (no ``dedicate_params``: ``Muon`` routed a plain weight,
  then ``fully_shard`` sharded it) raises a ``ValueError`` at the first step naming
  ``dedicate_params`` (before: a ``MuonStepError`` about a mixed Tensor/DTensor add).
- ``DistributedDataParallel`` of a model with dedicated weights raises at construction,
  naming FSDP2 (before: ``aten.cat.default got mixed torch.Tensor and DTensor`` inside DDP's
  first broadcast).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from tests.distributed import models  # noqa: E402
from tests.distributed.harness import full_state, run_ranks  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS, WORLD = 3, 2
HYPER = {"lr": 0.02, "adamw_lr": 1e-2, "weight_decay": 0.01, "compile": False}


def _ns():
    import dmuon_compile as dmuon

    return dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32)


def fsdp2_accelerator(world: int):
    """An ``Accelerator`` with accelerate's FSDP2 plugin, on this CPU rank."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # accelerate's CPU state reads it
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # accelerate selects FSDP on accelerators only (on the CPU: DDP). Its two shared states
    # (AcceleratorState copies PartialState's type whenever it is built) both say FSDP:
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def group_names(opt, model) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names.get(id(p), "<not the model's>") for p in g["params"]] for g in opt.param_groups]


def ddp_of_dedicated(world: int):
    """``DistributedDataParallel`` of a model with dedicated weights: its error (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import dmuon_compile as dmuon

    assert DistributedDataParallel(models.build_llama()) is not None  # control: plain model
    model = models.build_llama()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), models.proj_predicate)
    try:
        DistributedDataParallel(model)
    except RuntimeError as err:
        return str(err)
    return None


def sharded_muon_matrix(world: int):
    """prepare without dedicate_params: Muon routed the plain matrices, accelerate shards them.
    The first step's error (or None)."""
    import dmuon_compile as dmuon

    accelerator = fsdp2_accelerator(world)  # one model per FSDP2 prepare: a fresh one
    model = models.build_llama()
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    model, opt = accelerator.prepare(model, opt)
    model(models.batches(1, 1)[0]).square().mean().backward()
    try:
        opt.step()
    except ValueError as err:
        return str(err)
    return None


def train_prepared(rank: int, world: int, steps: int, accelerator) -> dict:
    """dedicate_params, Muon(model), accelerator.prepare, ``steps`` steps on this rank's rows."""
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import accelerate as dmuon_accelerate

    device = accelerator.device
    model = models.build_llama().to(device)
    owners = dmuon_accelerate.dedicate_params(accelerator, model, models.proj_predicate)
    opt = dmuon.Muon(model, ns_backend=_ns(), **HYPER)
    built = group_names(opt, model)
    swapped = []  # the lists as accelerate's swap left them, at each restore
    restore = opt.restore_dedicated

    def recording_restore():
        swapped.append(group_names(opt, model))
        restore()

    opt.restore_dedicated = recording_restore
    model, opt = accelerator.prepare(model, opt)
    per = models.batches(1, world)[0].shape[0] // world
    for x in models.batches(steps, world):
        loss = model(x[rank * per : (rank + 1) * per].to(device)).square().mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return {
        "owners": owners,
        "built": built,
        "swapped": swapped[0] if swapped else None,
        "restores": len(swapped),  # once, inside prepare: never in a step or zero_grad
        "kept": group_names(opt.optimizer, model),
        "state": {n: t.cpu() for n, t in full_state(model).items()},
    }


def keyed_as_accelerate_1_12(accelerator):
    """``accelerator`` keying the model's parameters as accelerate 1.10-1.12 did: a DTensor
    subclass (a dedicated weight) by its own ``data_ptr()``, which is 0 for every DTensor
    wrapper, while the optimizer's side has the local tensor's address (1.16 keys both so)."""
    from torch.distributed.tensor import DTensor

    named_parameters = accelerator._get_named_parameters

    def keys(*args, drop_refs=False):
        named = named_parameters(*args, drop_refs=drop_refs)
        if drop_refs:
            for model in (a for a in args if isinstance(a, torch.nn.Module)):
                for name, p in model.named_parameters():
                    if isinstance(p, DTensor) and type(p) is not DTensor:
                        named[name] = p.data_ptr()
        return named

    accelerator._get_named_parameters = keys
    return accelerator


def accelerate_worker(rank: int, world: int, steps: int):
    ddp_error = ddp_of_dedicated(world)
    out = train_prepared(rank, world, steps, fsdp2_accelerator(world))
    older = train_prepared(rank, world, steps, keyed_as_accelerate_1_12(fsdp2_accelerator(world)))
    return {
        **out,
        "older_keys": older,
        "ddp_error": ddp_error,
        "sharded_error": sharded_muon_matrix(world),
    }


def gpu_worker(rank: int, world: int, steps: int):
    """accelerate as launched on GPUs (``LOCAL_RANK`` set: its state picks FSDP by itself)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert accelerator.is_fsdp2 and accelerator.device.type == "cuda"
    return train_prepared(rank, world, steps, accelerator)


@pytest.fixture(scope="module")
def accelerate_ranks():
    return run_ranks(accelerate_worker, WORLD, STEPS, timeout=200)


def reference(world: int, steps: int) -> dict:
    import dmuon_compile as dmuon

    model = models.build_llama()
    opt = dmuon.Muon(model, predicate=models.proj_predicate, ns_backend=_ns(), **HYPER)
    for x in models.batches(steps, world):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_prepare_trains_like_one_process(accelerate_ranks):
    ref = reference(WORLD, STEPS)
    owners = accelerate_ranks[0]["owners"]
    assert sorted(owners) == sorted(n for n in ref if models.proj_predicate(n, None))
    assert set(owners.values()) == set(range(WORLD))  # both ranks own some
    start = {n: p.detach() for n, p in models.build_llama().named_parameters()}
    assert all(not torch.equal(ref[n], start[n]) for n in ref)  # the steps moved every weight
    for rank, out in enumerate(accelerate_ranks):
        # the optimizer holds the model's parameters, each where Muon(model) put it
        assert out["kept"] == out["built"], rank
        assert out["restores"] == 1, rank
        assert "lm_head.weight" in out["kept"][1]  # the head and the vectors: AdamW
        for name, want in ref.items():
            torch.testing.assert_close(out["state"][name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_prepare_with_older_accelerate_keys_trains_like_one_process(accelerate_ranks):
    """accelerate 1.10-1.12 key a dedicated weight differently on the model's side (its
    ``data_ptr()``, 0) and the optimizer's (its local tensor's address), so where it is held the
    swap finds nothing at its address: the integration leaves dedicated slots to
    ``Muon.restore_dedicated`` instead of failing with accelerate's ``KeyError``."""
    ref = reference(WORLD, STEPS)
    for rank, out in enumerate(accelerate_ranks):
        older = out["older_keys"]
        assert older["kept"] == older["built"] and older["restores"] == 1, rank
        for name, want in ref.items():
            torch.testing.assert_close(older["state"][name], want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_prepare_on_gpus_trains_like_one_process():
    """accelerate's own FSDP2 selection (no state switched by hand), NCCL, one GPU per rank."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results = run_ranks(gpu_worker, WORLD, STEPS, backend="nccl", timeout=300)
    ref = reference(WORLD, STEPS)
    for rank, out in enumerate(results):
        assert out["kept"] == out["built"], rank
        for name, want in ref.items():
            torch.testing.assert_close(out["state"][name], want, rtol=1e-4, atol=1e-4, msg=name)


def test_accelerate_swap_alone_mixes_up_dedicated_weights(accelerate_ranks):
    """Control: accelerate's swap maps every dedicated weight held by the other rank (no data
    here, address 0) to one and the same weight; ``Muon.restore_dedicated``, run right after
    the swap, puts them back (test above)."""
    for rank, out in enumerate(accelerate_ranks):
        swapped = out["swapped"][0]
        assert swapped != out["built"][0], rank
        assert len(set(swapped)) < len(swapped), rank


def test_sharded_muon_matrix_raises_at_first_step(accelerate_ranks):
    for out in accelerate_ranks:
        err = out["sharded_error"]
        assert err is not None and "DTensor shard" in err and "dedicate_params" in err, err


def test_ddp_of_dedicated_weights_raises_naming_fsdp2(accelerate_ranks):
    for out in accelerate_ranks:
        err = out["ddp_error"]
        assert err is not None and err.startswith("DistributedDataParallel cannot wrap"), err
        assert "fully_shard" in err and "FSDP2" in err


def test_dedicate_params_needs_fsdp2():
    """On one process (no FSDP plugin) the helper refuses, naming the FSDP2 plugin."""
    from accelerate import Accelerator

    from dmuon_compile.integrations import accelerate as dmuon_accelerate

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="fsdp_version=2"):
        dmuon_accelerate.dedicate_params(accelerator, models.build_llama())
