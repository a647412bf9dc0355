"""The dry run of ``Muon(offload="state")`` (``--offload state``): against ``offload="momentum"``
each owner keeps its masters' compute-dtype copies on the GPU instead of the masters, which go to
host memory, cross the host link twice per step and sit on the GPU during the step; and the
layouts ``Muon`` refuses are refused."""

from __future__ import annotations

import pytest
import torch
from test_dry_run_kept_momentum import _owned_numel  # tests/ is on sys.path

from dmuon_compile.plan import ModelConfig, build_model, dry_run, main
from dmuon_compile.plan.momentum import HOST_LINK_GBPS

DENSE = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50)


def test_offloaded_masters_move_to_host_memory_and_back_on_the_step():
    """fp32 masters, bf16 compute: per owned value 4 B leave the GPU's columns for host memory
    and 2 B of compute copy stay; the link moves 8 B more. All at once the step holds the 4 B
    again, its copy-in under Newton-Schulz; streamed (the default) only the masters of the
    buckets in flight, as many bytes as their working momentum, their copy-in after NS."""
    model = build_model(DENSE)[1]
    owned = None
    for in_flight in (None, 2):
        kw = dict(advise=False, momentum_in_flight=in_flight)
        momentum = dry_run(model, 2, offload="momentum", **kw)
        state = dry_run(model, 2, offload="state", **kw)
        owned = owned or _owned_numel(model, momentum)
        assert all(owned.values())
        for a, b in zip(momentum.rows, state.rows):
            n = owned[a.rank]
            assert a.dedicated_bytes - b.dedicated_bytes == (4 - 2) * n
            assert b.host_bytes - a.host_bytes == 4 * n
            assert b.host_link_bytes - a.host_link_bytes == 8 * n
            extra = b.step_extra_bytes - a.step_extra_bytes
            if in_flight is None:
                assert extra == 4 * n
            else:  # fp32 masters: as many bytes as the fp32 working momentum held
                assert extra == a._momentum_step_bytes < 4 * n
                link = HOST_LINK_GBPS * 1e9
                assert b.step_ms - a.step_ms == pytest.approx(4 * n / link * 1e3, rel=1e-6)
            # the compute copies (2 B) for the masters (4 B), plus the masters in the step
            assert b.peak_bytes - a.peak_bytes == extra - 2 * n
        assert b.step_ms >= a.step_ms and b.ns_ms == a.ns_ms
    assert "offload=state" in state.table()
    assert "offload='state': rank" in state.notes[-1]
    assert "offload='state'" not in momentum.notes[-1]  # control


def test_offloaded_masters_are_refused_where_muon_refuses_them():
    words = "compute in their master's dtype"
    with pytest.raises(ValueError, match=f"offload='state' is not available with .*{words}"):
        dry_run("tiny", 4, offload="state", param_dtype=torch.float32)
    # control: the momentum alone
    dry_run("tiny", 4, advise=False, offload="momentum", param_dtype=torch.float32)


@pytest.mark.parametrize("kw", [{"split_size": 2}, {"tp_size": 2}], ids=["split", "tp"])
def test_tp_and_split_offload_the_masters(kw):
    """Planned as ``Muon`` takes them; TP's stage takes its matrices, so their masters come in
    all at once (the step holds all of them), as with ``momentum_in_flight=None``."""
    momentum = dry_run("tiny", 4, advise=False, offload="momentum", **kw)
    state = dry_run("tiny", 4, advise=False, offload="state", **kw)
    whole = dry_run("tiny", 4, advise=False, offload="state", momentum_in_flight=None, **kw)
    for a, b, c in zip(momentum.rows, state.rows, whole.rows):
        assert b.host_bytes - a.host_bytes == 2 * (a.dedicated_bytes - b.dedicated_bytes)
        if "tp_size" in kw:
            assert b.step_extra_bytes == c.step_extra_bytes  # all at once either way
    assert sum(b.host_bytes - a.host_bytes for a, b in zip(momentum.rows, state.rows)) > 0


def test_hsdp_offloads_the_global_owners_masters():
    """2 replicas of 2 shards: each global owner's masters go to host memory; its column
    buffer for the publish stays (in ``replica``) and is its compute copy: the masters leave
    the GPU whole (bf16 compute, fp32 masters)."""
    momentum = dry_run("tiny", 4, advise=False, replicate_size=2, offload="momentum")
    state = dry_run("tiny", 4, advise=False, replicate_size=2, offload="state")
    for a, b in zip(momentum.rows, state.rows):
        assert b.host_bytes - a.host_bytes == a.dedicated_bytes - b.dedicated_bytes
        assert b.replica_bytes == a.replica_bytes
    assert sum(b.host_bytes - a.host_bytes for a, b in zip(momentum.rows, state.rows)) > 0


def test_offload_state_on_the_command_line(capsys):
    assert main(["--model", "tiny", "--gpus", "2", "--offload", "state"]) == 0
    assert "offload=state (pinned host memory" in capsys.readouterr().out
