"""``MuonOptimizers.Config``'s ``momentum_dtype`` and ``per_head`` reach each model part's
``Muon``: a bf16 momentum and per-head layouts set before the optimizer reads them; a bad
dtype string is refused naming the choices. One process, no torchtitan trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")


class Attention(nn.Module):  # torchtitan's names: wq, wk, wv, wo, with head_dim
    def __init__(self, dim=8, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, nn.Linear(dim, dim, bias=False))


def _model():
    model = nn.Module()
    model.attention = Attention()
    return model


def test_momentum_dtype_and_per_head_reach_muon():
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    config = dmuon_tt.MuonOptimizers.Config(momentum_dtype="bf16", per_head=True, compile=False)
    optimizers = config.build(model_parts=[model])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers.step()
    (opt,) = optimizers.optimizers
    assert opt.momentum_dtype is torch.bfloat16
    assert opt.state[model.attention.wq.weight]["momentum_buffer"].dtype == torch.bfloat16
    assert dmuon.get_layout(model.attention.wq.weight) == dmuon.Layout.heads(4)
    assert dmuon.get_layout(model.attention.wo.weight) == dmuon.Layout.heads(4, dim=1)


def test_int8_momentum_and_offload_reach_muon():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    config = dmuon_tt.MuonOptimizers.Config(
        momentum_dtype="int8", offload="momentum", compile=False
    )
    (opt,) = config.build(model_parts=[model]).optimizers
    assert opt.momentum_dtype is torch.int8 and opt.offload == "momentum"


def test_normuon_and_qk_clip_reach_muon():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    config = dmuon_tt.MuonOptimizers.Config(normuon=True, qk_clip=50.0, compile=False)
    (opt,) = config.build(model_parts=[model]).optimizers
    assert opt.normuon is not None and opt.qk_clip.tau == 50.0


def test_keep_new_momentum_reaches_muon_and_its_conflicts_raise():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    config = dmuon_tt.MuonOptimizers.Config(keep_new_momentum=True, compile=False)
    (opt,) = config.build(model_parts=[model]).optimizers
    assert opt.keep_new_momentum is True
    (default,) = (
        dmuon_tt.MuonOptimizers.Config(compile=False).build(model_parts=[_model()]).optimizers
    )
    assert default.keep_new_momentum is False
    with pytest.raises(ValueError, match="keep_new_momentum"):
        dmuon_tt.MuonOptimizers.Config(keep_new_momentum=True, momentum_dtype="int8").build(
            model_parts=[_model()]
        )


def test_a_bad_offload_names_the_choices():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    with pytest.raises(ValueError, match="'momentum'"):
        dmuon_tt.MuonOptimizers.Config(offload="host").build(model_parts=[_model()])


def test_the_defaults_keep_fp32_and_whole_matrices():
    import dmuon_compile as dmuon
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    (opt,) = dmuon_tt.MuonOptimizers.Config(compile=False).build(model_parts=[model]).optimizers
    assert opt.momentum_dtype is None and dmuon.get_layout(model.attention.wq.weight) is None


def test_a_bad_momentum_dtype_names_the_choices():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    with pytest.raises(ValueError, match="bf16"):
        dmuon_tt.MuonOptimizers.Config(momentum_dtype="fp8").build(model_parts=[_model()])


def test_momentum_in_flight_reaches_muon_and_is_checked():
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    for value in (1, None):
        config = dmuon_tt.MuonOptimizers.Config(
            momentum_dtype="int8", momentum_in_flight=value, compile=False
        )
        (opt,) = config.build(model_parts=[_model()]).optimizers
        assert opt.momentum_in_flight == value
    with pytest.raises(ValueError, match="momentum_in_flight=0"):
        dmuon_tt.MuonOptimizers.Config(momentum_in_flight=0).build(model_parts=[_model()])


def test_a_checkpoint_before_the_first_step_with_gradients_set_raises_naming_zero_grad():
    """torchtitan's container skips creating the state while a gradient is set: the checkpoint
    would silently hold no momentum. After zero_grad the state (momentum included) is there."""
    from dmuon_compile.integrations import torchtitan as dmuon_tt

    model = _model()
    optimizers = dmuon_tt.MuonOptimizers.Config(compile=False).build(model_parts=[model])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for call in (optimizers.state_dict, lambda: optimizers.load_state_dict({})):
        with pytest.raises(RuntimeError, match=r"optimizers\.zero_grad\(\) first"):
            call()
    optimizers.zero_grad()
    state = optimizers.state_dict()
    assert any(k.startswith("state.") and k.endswith("momentum_buffer") for k in state), state
    optimizers.load_state_dict(state)


def test_cpu_offload_is_refused_before_anything_is_parallelised():
    """torchtitan's ``training.enable_cpu_offload`` builds the model in host memory, which
    dedicated weights cannot follow: ``dedicating`` refuses it first, naming the fix. Control:
    without it the call goes on into torchtitan's own parallelize function."""
    from types import SimpleNamespace

    from torchtitan.config import TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    from dmuon_compile.integrations import torchtitan as dmuon_tt

    parallelize = dmuon_tt.dedicating(parallelize_llama)
    dims = SimpleNamespace(pp_enabled=False, tp_enabled=False, cp_enabled=False)
    parallelism = SimpleNamespace(spmd_backend="partial_dtensor")
    with pytest.raises(ValueError, match="enable_cpu_offload") as refused:
        parallelize(
            None,
            parallel_dims=dims,
            parallelism=parallelism,
            training=TrainingConfig(enable_cpu_offload=True),
        )
    assert 'offload="momentum"' in str(refused.value)
    rest = dict(compile_config=None, ac_config=None, dump_folder="")
    with pytest.raises(AttributeError):  # torchtitan's own code runs, on the empty arguments
        parallelize(
            None, parallel_dims=dims, parallelism=parallelism, training=TrainingConfig(), **rest
        )
