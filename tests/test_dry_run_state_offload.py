"""The dry run of ``Muon(offload="state")`` (``--offload state``): against ``offload="momentum"``
each owner keeps its masters' compute-dtype copies on the GPU instead of the masters, which go to
host memory, cross the host link twice per step and sit on the GPU during the step; and the
layouts ``Muon`` refuses are refused."""

from __future__ import annotations

import pytest
import torch
from test_dry_run_kept_momentum import _owned_numel  # tests/ is on sys.path

from dmuon_compile.plan import ModelConfig, build_model, dry_run, main

DENSE = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50)


def test_offloaded_masters_move_to_host_memory_and_back_on_the_step():
    """fp32 masters, bf16 compute: per owned value 4 B leave the GPU's columns for host memory
    and 2 B of compute copy stay; the step holds the 4 B again; the link moves 8 B more."""
    model = build_model(DENSE)[1]
    momentum = dry_run(model, 2, advise=False, offload="momentum")
    state = dry_run(model, 2, advise=False, offload="state")
    owned = _owned_numel(model, momentum)
    assert all(owned.values())
    for a, b in zip(momentum.rows, state.rows):
        n = owned[a.rank]
        assert a.dedicated_bytes - b.dedicated_bytes == (4 - 2) * n
        assert b.host_bytes - a.host_bytes == 4 * n
        assert b.host_link_bytes - a.host_link_bytes == 8 * n
        assert b.step_extra_bytes - a.step_extra_bytes == 4 * n
        assert b.peak_bytes - a.peak_bytes == 2 * n  # the compute copies beside the masters
        assert b.step_ms >= a.step_ms and b.ns_ms == a.ns_ms
    assert "offload=state" in state.table()
    assert "offload='state': rank" in state.notes[-1]
    assert "offload='state'" not in momentum.notes[-1]  # control


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"split_size": 2}, "split Newton-Schulz"),
        ({"tp_size": 2}, "tensor parallelism"),
        ({"param_dtype": torch.float32}, "compute in their master's dtype"),
    ],
)
def test_offloaded_masters_are_refused_where_muon_refuses_them(kw, words):
    with pytest.raises(ValueError, match=f"offload='state' is not available with .*{words}"):
        dry_run("tiny", 4, offload="state", **kw)
    dry_run("tiny", 4, advise=False, offload="momentum", **kw)  # control: the momentum alone


def test_hsdp_offloads_the_global_owners_masters():
    """2 replicas of 2 shards: each global owner's masters go to host memory (its column buffer
    for the publish stays, in ``replica``)."""
    momentum = dry_run("tiny", 4, advise=False, replicate_size=2, offload="momentum")
    state = dry_run("tiny", 4, advise=False, replicate_size=2, offload="state")
    for a, b in zip(momentum.rows, state.rows):
        assert b.host_bytes - a.host_bytes == 2 * (a.dedicated_bytes - b.dedicated_bytes)
        assert b.replica_bytes == a.replica_bytes
    assert sum(b.host_bytes - a.host_bytes for a, b in zip(momentum.rows, state.rows)) > 0


def test_offload_state_on_the_command_line(capsys):
    assert main(["--model", "tiny", "--gpus", "2", "--offload", "state"]) == 0
    assert "offload=state (pinned host memory" in capsys.readouterr().out
