"""The demo's GPT: shapes, causality, the matrix predicate, config errors."""

import itertools

import pytest
import torch

from dmuon_compile.train.model import GPT, GPTConfig, is_matrix_param


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"seq_len": 16, "d_model": 32, "layers": 2, "heads": 4, **kw})).eval()


def test_logits_shape_and_finite():
    model = _model()
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    assert torch.isfinite(logits).all()
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    assert (
        abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.5
    )  # near-uniform at init


def test_future_tokens_do_not_change_past_logits():
    model = _model()
    idx = torch.randint(0, 256, (2, 16))
    base = model(idx)
    t = 9
    changed = idx.clone()
    changed[:, t:] = (changed[:, t:] + 17) % 256
    out = model(changed)
    torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
    assert (out[:, t] - base[:, t]).abs().max() > 1e-4  # the changed position itself does change


def test_predicate_selects_exactly_the_projection_matrices():
    model = _model(layers=3)
    chosen = [n for n, p in model.named_parameters() if is_matrix_param(n, p)]
    assert len(chosen) == 3 * 7
    assert all(model.get_parameter(n).ndim == 2 for n in chosen)
    assert not any(n.startswith(("embed", "pos_embed", "lm_head")) or "norm" in n for n in chosen)
    assert "blocks.2.mlp.down_proj.weight" in chosen


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="not divisible by heads"):
        GPTConfig(d_model=30, heads=4)
    with pytest.raises(ValueError, match="seq_len must be > 0"):
        GPTConfig(seq_len=0)
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        _model()(torch.zeros(1, 17, dtype=torch.long))


def test_same_seed_same_weights():
    a, b = _model(), _model()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    from dmuon_compile.train.loop import lr_lambda

    f = lr_lambda(100)
    values = [f(s) for s in range(100)]
    assert values[0] == pytest.approx(0.2) and max(values) == pytest.approx(1.0)
    assert all(a <= b for a, b in itertools.pairwise(values[:6]))  # warm-up: 5 steps
    assert all(a >= b for a, b in itertools.pairwise(values[5:]))
    assert values[-1] == pytest.approx(0.1, abs=0.01) and min(values) >= 0.1 - 1e-9


def test_flops_per_token_counts_the_models_matmul_weights():
    """``matmul_params`` is the model's own Linear weights (not a formula that can drift from
    the model): 6 N + 12 layers seq_len d_model."""
    cfg = GPTConfig(seq_len=16, d_model=32, layers=3, heads=2)
    model = GPT(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert cfg.matmul_params == linear
    assert cfg.flops_per_token() == 6 * linear + 12 * 3 * 16 * 32
    # GPT-2-small-like preset: about 85M matmul weights (12 x 7.1M per block + the head)
    big = GPTConfig(seq_len=1024, d_model=768, layers=12, heads=12)
    assert 84e6 < big.matmul_params < 86e6
