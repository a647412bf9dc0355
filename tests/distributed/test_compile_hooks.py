"""The dedicated weights' hooks are transparent to ``torch.compile``, as FSDP2's are.

- per-block ``block.compile(fullgraph=True)`` trains with dedicated weights + FSDP2 and gives
  the losses and weights of the same run in eager;
- whole-model ``torch.compile(model)`` has no more graph breaks (Dynamo's counters) than the
  same model on FSDP2 alone.

Control: the same runs with the hooks traced by Dynamo (``_eager_hook`` made the identity)
must fail under ``fullgraph=True`` and add graph breaks to the whole-model compile, so the
tests see the thing they check.
"""

from __future__ import annotations

import pytest
import torch

from . import models
from .harness import full_state, run_ranks, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 3


def _trace_hooks() -> None:
    """The control: register the hooks without ``torch.compiler.disable``."""
    from dmuon_compile.distributed._runtime import runtime as _runtime

    _runtime._eager_hook = lambda fn: fn


def _train(model, rank: int, world: int, steps: int = STEPS):
    import dmuon_compile as dmuon

    opt = dmuon.Muon(
        model,
        lr=0.02,
        adamw_lr=1e-2,
        compile=False,
        predicate=models.proj_predicate,
        ns_backend=dmuon.NewtonSchulz(kernel="cublas", work_dtype=torch.float32),
    )
    losses = train_steps(model, opt, models.batches(steps, world), rank, world, mean=False)
    return torch.tensor(losses), full_state(model)


def _block_compile(rank, world, control: bool):
    from torch._dynamo.utils import counters

    if control:
        _trace_hooks()
    eager, _ = models.build_dedicated(world)
    eager_losses, eager_state = _train(eager, rank, world)
    compiled, _ = models.build_dedicated(world)
    for block in compiled.layers:
        block.compile(fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        losses, state = _train(compiled, rank, world)
    except torch._dynamo.exc.Unsupported as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return {
        "error": None,
        "eager_losses": eager_losses,
        "losses": losses,
        "eager_state": eager_state,
        "state": state,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


def test_block_compile_fullgraph_trains_equal_to_eager():
    for r in run_ranks(_block_compile, 2, False, timeout=240):
        assert r["error"] is None, r["error"]
        assert r["graphs"] >= 1 and r["breaks"] == 0  # compiled, in whole graphs
        torch.testing.assert_close(r["losses"], r["eager_losses"], rtol=1e-5, atol=1e-6)
        assert r["state"].keys() == r["eager_state"].keys()
        for name, value in r["state"].items():
            torch.testing.assert_close(value, r["eager_state"][name], rtol=1e-4, atol=1e-5)


def test_block_compile_control_traced_hooks_fail_fullgraph():
    for r in run_ranks(_block_compile, 2, True, timeout=240):
        assert r["error"] is not None and "Unsupported" in r["error"], r


def _model_compile_breaks(rank, world, dedicated: bool, control: bool):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if control:
        _trace_hooks()
    if dedicated:
        model, _ = models.build_dedicated(world)
    else:
        model = models.build_llama()
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    x = models.batches(1, world)[0]
    per = x.shape[0] // world
    x = x[rank * per : (rank + 1) * per]
    eager = model(x).square().mean()
    eager.backward()
    model.zero_grad()
    compiled = torch.compile(model)
    torch._dynamo.reset()
    counters.clear()
    losses = []
    try:
        for _ in range(2):  # the second iteration runs the compiled code without new breaks
            loss = compiled(x).square().mean()
            loss.backward()
            losses.append(loss.detach().clone())
    except torch._dynamo.exc.TorchDynamoException as exc:
        if not control:
            raise
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return {
        "error": None,
        "eager": eager.detach().clone(),
        "losses": torch.stack(losses),
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _breaks_of(dedicated: bool, control: bool = False) -> list[dict]:
    return run_ranks(_model_compile_breaks, 2, dedicated, control, timeout=240)


def test_model_compile_no_more_graph_breaks_than_fsdp2():
    fsdp = _breaks_of(dedicated=False)
    ours = _breaks_of(dedicated=True)
    for f, d in zip(fsdp, ours):
        assert d["graphs"] >= 1
        assert d["breaks"] <= f["breaks"], (d["breaks"], f["breaks"])
        torch.testing.assert_close(d["losses"], d["eager"].expand(2), rtol=1e-5, atol=1e-6)
    # The control has teeth: traced hooks break the graph more often, or fail to trace at all
    # (Dynamo cannot fake the collectives' process groups).
    traced = _breaks_of(dedicated=True, control=True)
    for f, t in zip(fsdp, traced):
        assert t["error"] is not None or t["breaks"] > f["breaks"], (t, f["breaks"])


def _user_compiled_step(rank, world):
    """Dedicated weights + FSDP2, ``opt.step = torch.compile(opt.step)``, LR changed every step."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import dmuon_compile as dmuon

    results = {}
    for form in ("eager", "compiled"):
        torch._dynamo.reset()
        model, _ = models.build_dedicated(world)
        opt = dmuon.Muon(
            model, lr=0.02, adamw_lr=1e-2, compile=False, predicate=models.proj_predicate
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        counter = CompileCounterWithBackend("aot_eager")
        if form == "compiled":
            opt.step = torch.compile(opt.step, backend=counter)
        frames = []
        for x in models.batches(STEPS, world):
            per = x.shape[0] // world
            model(x[rank * per : (rank + 1) * per]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            frames.append(counter.frame_count)
        results[form] = {"state": full_state(model), "frames": frames}
    return results


def test_user_compiled_step_with_dedicated_weights_and_fsdp2():
    for r in run_ranks(_user_compiled_step, 2, timeout=240):
        frames = r["compiled"]["frames"]
        assert frames[0] >= 1 and frames == [frames[0]] * STEPS  # compiled once, no recompile
        eager, compiled = r["eager"]["state"], r["compiled"]["state"]
        assert compiled.keys() == eager.keys()
        for name, value in compiled.items():
            torch.testing.assert_close(value, eager[name], rtol=1e-4, atol=1e-5)
