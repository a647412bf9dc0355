"""bench_step.py's peers that take expert stacks whole (issue 49): microsoft/dion's Muon
(``dion_muon``; skipped where dion is not installed, as in CI) and torchtitan's DistMuon on one
rank (``titan_distmuon``), on CPU: they run over model tiny_E, and one step of each is an
orthogonalised update per matrix and per expert at our learning-rate rule."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
from bench_scripts import load_benchmark  # tests/ is on sys.path

CPU = torch.device("cpu")


bench_step = load_benchmark("bench_step")


def _dion_available() -> bool:
    try:
        from dion import Muon  # noqa: F401
    except ImportError:
        return False
    return True


needs_dion = pytest.mark.skipif(not _dion_available(), reason="microsoft/dion not installed")


def _eager_stance():
    """dion compiles its NS and foreach updates (an Inductor CPU compile: minutes on CPU); the
    smoke runs its code eagerly."""
    return torch.compiler.set_stance("force_eager")


def _spread(rows, cols, gen, scale=1.0, cond=30.0):
    """A matrix with singular values spread log-evenly over [scale, scale·cond]."""
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    k = min(rows, cols)
    s = scale * torch.logspace(0, math.log10(cond), k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T


def _params():
    """A 2-D matrix and a 3-D expert stack whose experts differ 10⁴-fold in scale: only a
    per-expert normalisation orthogonalises the small one within 5 iterations."""
    gen = torch.Generator().manual_seed(0)
    grads = [
        _spread(24, 40, gen),
        torch.stack([_spread(16, 32, gen), _spread(16, 32, gen, scale=1e-4)]),
        torch.stack([_spread(32, 16, gen, scale=1e-4), _spread(32, 16, gen)]),
    ]
    params = []
    for g in grads:
        p = torch.nn.Parameter(0.02 * torch.randn(g.shape, generator=gen))
        p.grad = g.float()
        params.append(p)
    return params


@pytest.mark.parametrize(
    "config, band",
    [
        # Keller Jordan's coefficients: singular values land in about [0.68, 1.13].
        ("titan_distmuon", (0.6, 1.25)),
        pytest.param("dion_muon", (0.75, 1.2), marks=needs_dion),  # Polar Express, bf16
    ],
)
def test_peer_step_is_an_orthogonalised_update_per_matrix_and_expert(config, band):
    params = _params()
    before = [p.detach().clone() for p in params]
    raw = [torch.linalg.svdvals(g.double()) for g in (params[0].grad, *params[1].grad)]
    assert all(s.max() / s.min() > 25 for s in raw)  # the gradients are far from orthogonal
    try:
        with _eager_stance():
            opt = bench_step.build(config, params)
            opt.step()
    finally:
        bench_step.release_group()
    assert not dist.is_initialized()
    for p, p0 in zip(params, before):
        rows, cols = p.shape[-2:]
        lr = bench_step.LR * 0.2 * math.sqrt(max(rows, cols))  # match_rms_adamw / rms_norm
        update = ((p0 - p.detach()) / lr).double()
        for matrix in update if update.ndim == 3 else [update]:
            s = torch.linalg.svdvals(matrix)
            assert s.numel() == min(rows, cols)
            assert band[0] < s.min() and s.max() < band[1], (config, tuple(p.shape), s)


@pytest.mark.parametrize("config", ["titan_distmuon", pytest.param("dion_muon", marks=needs_dion)])
def test_peer_runs_model_tiny_e_on_cpu(config):
    with _eager_stance():
        row = bench_step.run_config(config, "tiny_E", CPU, warmup=1, repeats=2)
    assert row["config"] == config and row["finite"]
    assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0
    assert not dist.is_initialized()  # the benchmark closed the group it opened


def test_cli_prints_a_row_per_configuration(capsys):
    args = ["--quick", "--device", "cpu", "--model", "tiny_E", "--no-fresh-cache"]
    args += ["--configs", "titan_distmuon", "ours_eager", "dion_muon_triton"]
    args += ["--warmup", "0", "--repeats", "1"]
    assert bench_step.main(args) == 0
    out = capsys.readouterr().out
    assert "| tiny_E | titan_distmuon |" in out and "| tiny_E | ours_eager |" in out
    assert "dion_muon_triton" not in out  # CUDA only: left out on CPU


def test_titan_keeps_the_stacks_whole_and_the_storage_shared():
    params = bench_step.make_params(bench_step.matrix_shapes("tiny_E"), CPU)
    try:
        opt = bench_step.build("titan_distmuon", params)
        names = bench_step.titan_names(params)
        assert sum(n.startswith("experts.") for n in names) == 6  # 2 layers × w1, w3, w2
        for p, d in zip(params, opt.dtensor_params):
            assert d.to_local().data_ptr() == p.data_ptr()
            assert d.grad.to_local().data_ptr() == p.grad.data_ptr()
        compute = {c.fqn: c.global_compute_shape for c in opt._parameter_compute_layouts}
        assert compute["experts.7"] == (8, 32, 64)  # [E, R, C]: a batch of 8 expert matrices
        assert compute["matrices.0"] == (64, 64)
    finally:
        bench_step.release_group()


def test_dion_missing_names_the_wheel_and_the_others_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dion", None)  # import dion -> ImportError
    params = bench_step.make_params([(8, 16)], CPU)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps \.wheels/dion-\*\.whl"):
        bench_step.build("dion_muon", params)
    args = ["--quick", "--device", "cpu", "--model", "tiny_E", "--no-fresh-cache"]
    args += ["--configs", "dion_muon", "ours_eager", "--warmup", "0", "--repeats", "1"]
    assert bench_step.main(args) == 2  # a peer missing: not a silent success
    out = capsys.readouterr().out
    assert "dion_muon: NOT RUN: microsoft/dion is not installed" in out
    assert "| tiny_E | ours_eager |" in out and "| tiny_E | dion_muon |" not in out


bench_fsdp = load_benchmark("bench_fsdp")


@pytest.mark.parametrize(
    "config, band",
    [("titan_distmuon", (0.6, 1.25)), pytest.param("dion_muon", (0.75, 1.2), marks=needs_dion)],
)
def test_fsdp_peer_steps_the_matrices_with_muon_and_the_rest_with_adamw(config, band):
    """bench_fsdp.py's peers on FSDP2 (one gloo rank, model E's tiny MoE): one step moves each
    projection and each expert by an orthogonalised update at the AdamW-matched rule (its
    largest singular value in the NS band, its values uneven) and every other weight by AdamW's
    first step (±lr per value, the test's control of the matrices' check)."""
    import types

    args = types.SimpleNamespace(model="quick_E", moe_impl="dense")
    try:
        mesh = bench_step.one_rank_mesh(CPU)
        model, opt = bench_fsdp.build(config, args, (mesh, mesh, None, None), CPU)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 16, bench_fsdp.MODELS["quick_E"][0], generator=gen)
        model(x).float().square().mean().backward()
        before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        with _eager_stance():
            opt.step()
        # what Muon should step: the projections and the expert stacks (w1, w2, w3)
        muon = {n for n, p in model.named_parameters() if n.endswith("_proj.weight") or p.ndim == 3}
        assert sum(n.endswith(".experts.w1") for n in muon) == bench_fsdp.MODELS["quick_E"][2]
        for name, p in model.named_parameters():
            delta = (before[name] - p.full_tensor().detach()).double()
            if name not in muon:
                size = delta.abs()
                assert size.max() < 3e-4 * 1.01 and size.median() > 3e-4 * 0.99, name
                continue
            rows, cols = p.shape[-2:]
            scale = bench_step.LR * 0.2 * math.sqrt(max(rows, cols))
            for matrix in delta / scale if delta.ndim == 3 else [delta / scale]:
                top = torch.linalg.matrix_norm(matrix, ord=2)
                assert band[0] < top < band[1], (config, name, float(top))
                # not AdamW's first step, ±lr everywhere: an orthogonalised update's values vary
                assert matrix.abs().std() > 0.2 * matrix.abs().mean(), name
    finally:
        bench_step.release_group()
