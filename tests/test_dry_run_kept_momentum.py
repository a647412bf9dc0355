"""The dry run of ``Muon(keep_new_momentum=True)`` (``--keep-new-momentum``): buf′ of every Muon
matrix a rank steps itself adds its momentum's bytes to ``step extra`` and the peak, the
matrices a stage steps (TP, the expert reshard) add nothing, the commit's saved elementwise
bytes come off ``step ms``, and an 8-bit or offloaded momentum is refused as ``Muon`` refuses
it."""

from __future__ import annotations

import pytest
import torch

from dmuon_compile.ns_rates import H200
from dmuon_compile.plan import ModelConfig, build_model, dry_run, main
from dmuon_compile.plan.momentum import ELEMENTWISE_BYTES

DENSE = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50)
MOE = ModelConfig(40, 2, 4, 100, kv_heads=2, vocab=50, experts=4, expert_ffn=24, shared_ffn=30)
REFUSED = "keep_new_momentum=True keeps buf′ beside the momentum stored in place"


def _owned_numel(model, report) -> dict[int, int]:
    """Per data-parallel rank, the elements of the dedicated weights it owns."""
    numel = {n: p.numel() for n, p in model.named_parameters()}
    out = {r.rank: 0 for r in report.rows}
    for fqn, owner in report.owners.items():
        out[owner] += numel[fqn]
    return out


def _both(model, world, **kw):
    return (
        dry_run(model, world, advise=False, **kw),
        dry_run(model, world, advise=False, keep_new_momentum=True, **kw),
    )


@pytest.mark.parametrize("dtype, kept, saved", [(None, 4, 8), ("bf16", 2, 6)])
def test_keeping_buf_raises_each_owners_peak_by_its_momentum_and_saves_the_commits_bytes(
    dtype, kept, saved
):
    """fp32 weights: buf′ in the momentum's dtype (4 or 2 B per value) on top of the step;
    the commit's reads of momentum (4/2 B) and gradient (4 B) and write of the momentum, less
    buf′ written once, come off the elementwise time at its 44 B per element."""
    model = build_model(DENSE)[1]
    off, on = _both(model, 2, momentum_dtype=dtype)
    owned = _owned_numel(model, off)
    assert all(owned.values())
    for a, b in zip(off.rows, on.rows):
        n = owned[a.rank]
        assert b.step_extra_bytes - a.step_extra_bytes == kept * n
        assert b.peak_bytes - a.peak_bytes == kept * n
        assert (b.dedicated_bytes, b.grad_bytes, b.ns_ms) == (
            a.dedicated_bytes,
            a.grad_bytes,
            a.ns_ms,
        )
        less = H200.elementwise_ms(saved * n / ELEMENTWISE_BYTES)
        assert a.step_ms - b.step_ms == pytest.approx(less, rel=1e-9)
    assert "keep new momentum=True" in on.table()
    assert "keep new momentum" not in off.table()
    assert on.notes[-1].startswith("keep_new_momentum: ") and not off.notes


def test_matrices_a_stage_steps_keep_no_buf():
    """Control: TP 2 shards every dedicated matrix of the model (the TP stage steps them),
    an expert stack sharded inside its experts is stepped by the reshard; the same stacks'
    whole experts (Shard(0)) keep theirs where they lie."""
    off, on = _both(build_model(DENSE)[1], 4, tp_size=2)
    assert [r.step_extra_bytes for r in on.rows] == [r.step_extra_bytes for r in off.rows]
    assert "none of those a stage steps" in on.notes[-1]
    model = build_model(MOE)[1]
    stacks = [p.numel() for n, p in model.named_parameters() if ".experts." in n]
    assert len(stacks) == 6
    for dim, whole in ((1, False), (0, True)):
        off, on = _both(model, 8, ep=2, expert_shard_dim=dim)
        owned = _owned_numel(model, off)
        for a, b in zip(off.rows, on.rows):
            # Shard(0): 2 local experts over 4 expert-FSDP ranks, one each on ranks 0-3
            experts = sum(s // 4 for s in stacks) if whole and a.rank < 4 else 0
            assert b.step_extra_bytes - a.step_extra_bytes == 4 * (owned[a.rank] + experts)


def test_pipeline_stages_keep_one_stages_buf_at_a_time():
    """Two stages on one PP rank step in turn: the peak grows by what the kept buf′s add to
    the larger stage's step, less than both stages' momentum together."""
    model = build_model(DENSE)[1]
    off, on = _both(model, 2, pp=1, stages_per_rank=2)
    owned = _owned_numel(model, off)
    for a, b in zip(off.rows, on.rows):
        grown = b.peak_bytes - a.peak_bytes
        assert grown == b._kept_bytes and 0 < grown < 4 * owned[a.rank]


def test_a_peak_that_does_not_fit_is_told_to_drop_the_kept_buf():
    report = dry_run("tiny", 2, keep_new_momentum=True, gpu_memory_gib=1e-4)
    (note,) = [n for n in report.notes if "does not fit" in n]
    assert "keep_new_momentum=False (drop --keep-new-momentum): peak" in note
    assert report.notes[-1].startswith("keep_new_momentum: ")


@pytest.mark.parametrize("stored", [{"momentum_dtype": "int8"}, {"offload": "momentum"}])
def test_an_8bit_or_offloaded_momentum_with_a_kept_buf_is_refused(stored):
    with pytest.raises(ValueError, match=f"^dry_run: {REFUSED}"):
        dry_run("tiny", 2, keep_new_momentum=True, **stored)
    dry_run("tiny", 2, advise=False, **stored)  # control: each alone is fine
    with pytest.raises(ValueError, match="^dry_run: keep_new_momentum=1: give True or False"):
        dry_run("tiny", 2, keep_new_momentum=1)


@pytest.mark.parametrize("stored", [{"momentum_dtype": "int8"}, {"offload": "momentum"}])
def test_the_refusal_is_in_muons_words(stored):
    """The dry run and Muon run the one check (``momentum_storage.check_kept_momentum``): the
    same text after the dry run's ``dry_run: ``."""
    import dmuon_compile as dmuon

    with pytest.raises(ValueError) as muon:
        dmuon.Muon([torch.nn.Parameter(torch.zeros(4, 4))], keep_new_momentum=True, **stored)
    with pytest.raises(ValueError) as plan:
        dry_run("tiny", 2, keep_new_momentum=True, **stored)
    assert str(plan.value) == f"dry_run: {muon.value}"


@pytest.mark.parametrize("stored", [["--momentum-dtype", "int8"], ["--offload", "momentum"], []])
def test_keep_new_momentum_on_the_command_line(stored, capsys):
    argv = ["--model", "tiny", "--gpus", "2", "--keep-new-momentum", *stored]
    if stored:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert REFUSED in capsys.readouterr().err
        return
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "keep new momentum=True" in out and "note: keep_new_momentum: " in out
