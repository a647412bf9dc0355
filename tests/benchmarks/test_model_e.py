"""Benchmark model E (DeepSeek-V3-like MoE at reduced width): bench_step.py's matrix set holds
the expert stacks as 3-D per-expert stacks, and its step orthogonalises each expert as a 2-D
matrix of its own; bench_fsdp.py's MoE layer (grouped-GEMM experts equal to the dense ones,
the routing of its parameters) and one FSDP2 iteration of the tiny model on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from bench_scripts import BENCHMARKS, load_benchmark  # tests/ is on sys.path
from native_crash import run_torchrun  # tests/ is on sys.path

import dmuon_compile as dmuon
from dmuon_compile import functional as F

bench_step = load_benchmark("bench_step")
bench_fsdp = load_benchmark("bench_fsdp")
CPU = torch.device("cpu")


def test_matrix_set_of_model_e_has_the_expert_stacks():
    shapes = bench_step.matrix_shapes("E")
    stacks = [s for s in shapes if len(s) == 3]
    assert len(shapes) == 40 and len(stacks) == 12  # 4 layers: 7 matrices and 3 stacks each
    assert stacks[:3] == [(64, 768, 2048), (64, 768, 2048), (64, 2048, 768)]
    assert shapes[:7] == [(2048, 2048)] * 4 + [(1536, 2048)] * 2 + [(2048, 1536)]
    assert sum(s[0] if len(s) == 3 else 1 for s in shapes) == 796
    # Tiny size: stacks declared per-expert for ours; 2-D experts for torch.optim.Muon.
    tiny = bench_step.matrix_shapes("tiny_E")
    params = bench_step.make_params(tiny, CPU)
    for p in params:
        want = dmuon.Layout.experts() if p.ndim == 3 else None
        assert dmuon.get_layout(p) == want
    split = bench_step.make_params(tiny, CPU, split_experts=True)
    assert all(p.ndim == 2 for p in split)
    assert len(split) == sum(s[0] if len(s) == 3 else 1 for s in tiny)
    torch.testing.assert_close(split[7], params[7][0].detach(), rtol=0, atol=0)
    torch.testing.assert_close(split[7].grad, params[7].grad[0], rtol=0, atol=0)


def test_step_of_model_e_is_newton_schulz_per_expert():
    shapes = bench_step.matrix_shapes("tiny_E")
    stacked = bench_step.make_params(shapes, CPU)
    before = [p.detach().clone() for p in stacked]
    split = bench_step.make_params(shapes, CPU, split_experts=True)
    bench_step.build("ours_eager", stacked).step()
    bench_step.build("ours_eager", split).step()  # every expert a 2-D parameter of its own
    ns = dmuon.NewtonSchulz()
    pieces = iter(split)
    for p, p0 in zip(stacked, before):
        ref = (
            torch.stack([next(pieces) for _ in range(p.shape[0])]) if p.ndim == 3 else next(pieces)
        )
        assert (p - p0).abs().max() > 1e-3  # the step moved the weights
        torch.testing.assert_close(p.detach(), ref.detach(), atol=2e-6, rtol=0)
        if p.ndim == 3:
            # The update is a loop of 2-D Newton–Schulz over the experts, at each expert's
            # learning-rate scale (first step: the Nesterov input is a multiple of the
            # gradient, which NS normalises away) ...
            loop = torch.stack([ns(g).float() for g in p.grad])
            scale = bench_step.LR * F.lr_scale(p.shape[-2:], "match_rms_adamw")
            torch.testing.assert_close((p0 - p).detach() / scale, loop, atol=2e-4, rtol=0)
            per_expert = F.orthogonalize([p.grad], ns, layouts=[dmuon.Layout.experts()])[0]
            torch.testing.assert_close(per_expert.float(), loop, atol=1e-6, rtol=0)
            # ... and not NS of the flattened stack (which mixes the experts).
            flat = ns(p.grad.reshape(-1, p.shape[-1])).float().reshape(p.shape)
            assert (flat - loop).abs().max() > 0.1
    assert next(pieces, None) is None


def test_grouped_experts_equal_the_dense_experts():
    """The grouped-GEMM path (GPU runs) against every expert on every token, weighted by the
    routing: forward and every gradient, with unused experts and uneven groups."""
    if bench_fsdp.grouped_mm_problem(CPU) is not None:
        pytest.skip(f"torch._grouped_mm on CPU: {bench_fsdp.grouped_mm_problem(CPU)}")
    gen = torch.Generator().manual_seed(3)
    tokens, dim, hidden, experts, k = 37, 32, 16, 6, 2
    x = torch.randn(tokens, dim, generator=gen)
    ws = [torch.randn(s, generator=gen) / s[-1] ** 0.5 for s in
          [(experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim)]]  # fmt: skip
    scores = torch.randn(tokens, experts, generator=gen)
    scores[:, 5] = -10  # expert 5 gets no token: an empty group
    idx = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen)
    outs = []
    for fn in (bench_fsdp.grouped_experts, bench_fsdp.dense_experts):
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        out = fn(leaves[0], idx, weights, *leaves[1:])
        out.square().sum().backward()
        outs.append([out.detach()] + [t.grad for t in leaves])
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert outs[0][2][5].abs().max() == 0  # the unused expert's w1 gradient is exactly zero


def test_model_e_routing_and_counts():
    dim, ffn, layers = bench_fsdp.MODELS["quick_E"]
    torch.manual_seed(0)
    model = bench_fsdp.Stack(dim, ffn, layers, 16, 1, bench_fsdp.MOE["quick_E"], "grouped_mm")
    opt = dmuon.Muon(model, compile=False)
    # Per layer: q, k, v, o and the shared expert's 3 matrices; 3 expert stacks (per expert);
    # AdamW: 2 norms and the router.
    assert bench_fsdp.routed(opt) == {"matrix": 14, "experts": 6, "adamw": 6}
    assert opt._layout(model.layers[0].moe.experts.w2) == dmuon.Layout.experts()
    assert not bench_fsdp.is_proj("layers.0.moe.router.weight", None)
    # Forward of the whole model through the grouped experts equals the dense ones.
    x = torch.randn(2, 8, dim)
    out = model(x)
    for block in model.layers:
        block.moe.experts.impl = "dense"
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    # FLOPs of model E (8×1024 tokens): 3 × forward matmuls, top-6 experts + shared + router.
    per_token = 2 * 2048 * 4 * 2048 + 2 * 1024 * 2048 + 6 * 2048 * (6 * 768 + 1536) + 2 * 2048 * 64
    assert bench_fsdp.iteration_flops("E", 8, 1024) == 3 * 4 * 8 * 1024 * per_token
    assert math.isclose(bench_fsdp.iteration_flops("E", 8, 1024) / 1e12, 11.158, rel_tol=1e-3)
    with pytest.raises(SystemExit, match="model E .mixture of experts. has no TP plan"):
        bench_fsdp.check_tp(2, 2, "E")


@pytest.mark.distributed
def test_bench_fsdp_model_e_one_iteration_on_cpu(tmp_path):
    """One FSDP2 iteration of the tiny model E per configuration (one gloo process), through
    the grouped-GEMM experts the GPU runs."""
    out = tmp_path / "e.json"
    args = ["--quick", "--device", "cpu", "--model", "E", "--moe-impl", "grouped_mm"]
    args += ["--configs", "adamw,naive_muon,ours_eager", "--iters", "1", "--warmup", "0"]
    script = str(BENCHMARKS / "bench_fsdp.py")
    proc = run_torchrun([script, *args, "--out", str(out)], 1, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["model"] == "quick_E"
    assert report["moe"] == {"experts": 8, "hidden": 32, "top_k": 2}
    assert report["moe_impl"] == "grouped_mm"
    res = report["results"]
    assert set(res) == {"adamw", "naive_muon", "ours_eager"}
    assert all(math.isfinite(r["iter_ms"]) and r["iter_ms"] > 0 for r in res.values())
    # The expert stacks stayed with FSDP2 and Muon orthogonalises them per expert.
    assert res["ours_eager"]["routed"] == {"matrix": 14, "experts": 6, "adamw": 6}
    assert "model quick_E:" in proc.stdout and "| ours_eager |" in proc.stdout


def test_the_products_roofline_bounds_model_e_above_its_flop_floor():
    """``ns_roofline_ms`` prices each NS product at the slower of its FLOPs and its fewest
    bytes: never below the FLOP floor, equal to it with unbounded bandwidth, and for model E
    well above it (its 768-row experts' Gram-space products do ~110 FLOPs per byte, half the
    GPU's ratio) while
    the dense models' large products stay compute-bound (within 5%)."""
    for model in ("S", "M", "E"):
        dim, ffn, layers = bench_fsdp.MODELS[model]
        args = (dim, ffn, layers, 1, bench_fsdp.KV_GROUPS.get(model, 1), bench_fsdp.MOE.get(model))
        floor = bench_fsdp.ns_floor_ms(*args)
        roof = bench_fsdp.ns_roofline_ms(*args)
        assert roof >= floor
        assert bench_fsdp.ns_roofline_ms(*args, bytes_per_s=math.inf) == pytest.approx(floor)
        if model == "E":
            assert roof > 1.3 * floor
        else:
            assert roof < 1.05 * floor
