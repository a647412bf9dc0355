"""The demo's corpus: deterministic file order, disjoint split, windows in range, rank slices."""

from pathlib import Path

import pytest
import torch

from dmuon_compile.train import data


def _write_tree(root: Path, n: int = 40) -> None:
    for i in range(n):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * (i + 1))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("SHOULD_NOT_APPEAR = 1\n")
    (root / "notes.txt").write_text("not python")


def test_stdlib_listing_is_deterministic_and_skips_site_packages():
    a = data.list_source_files()
    b = data.list_source_files()
    assert a == b and len(a) > 50
    assert all(p.suffix == ".py" for p in a)
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in a)
    # Hash order, not alphabetical: a size cap takes a mix of modules.
    assert a != sorted(a)


def test_split_is_disjoint_deterministic_and_nonempty(tmp_path):
    _write_tree(tmp_path)
    files = data.list_source_files(tmp_path)
    assert len(files) == 40  # site-packages and the .txt file are skipped
    train, val = data.split_files(files, tmp_path, 0.2)
    assert set(train).isdisjoint(val)
    assert set(train) | set(val) == set(files)
    assert val and train
    assert (train, val) == data.split_files(files, tmp_path, 0.2)
    # A tiny fraction still gives validation one file.
    _, val_small = data.split_files(files, tmp_path, 1e-9)
    assert len(val_small) == 1


def test_split_rejects_bad_fraction(tmp_path):
    _write_tree(tmp_path, 4)
    files = data.list_source_files(tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_files(files, tmp_path, 1.0)


def test_load_corpus_reads_bytes_of_the_split_files(tmp_path):
    _write_tree(tmp_path)
    corpus = data.load_corpus(max_bytes=10_000, val_fraction=0.2, root=tmp_path)
    assert corpus.train.dtype == torch.uint8 and corpus.val.dtype == torch.uint8
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    expected = b"".join(p.read_bytes() + b"\n" for p in corpus.train_files)
    assert bytes(corpus.train.tolist()) == expected
    assert b"SHOULD_NOT_APPEAR" not in bytes(corpus.train.tolist()) + bytes(corpus.val.tolist())


def test_load_corpus_respects_the_cap():
    corpus = data.load_corpus(max_bytes=200_000)
    assert corpus.train.numel() + corpus.val.numel() <= 200_000
    assert corpus.val.numel() > 0 and corpus.train.numel() > 100_000
    assert "train files" in corpus.describe()


def test_empty_directory_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.py source files"):
        data.list_source_files(tmp_path)


def test_windows_in_range_shifted_and_reproducible():
    tokens = torch.arange(1000, dtype=torch.int64).to(torch.uint8)  # values wrap: still bytes
    stream = torch.arange(1000) % 256
    s = data.WindowSampler(stream.to(torch.uint8), seq_len=16, global_batch=8, seed=3)
    x, y = s.batch(5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    starts = s.starts(5)
    assert int(starts.min()) >= 0 and int(starts.max()) + 16 < 1000
    for row, st in zip(x, starts):
        assert torch.equal(row, stream[st : st + 16])
    x2, _ = s.batch(5)
    assert torch.equal(x, x2)
    x3, _ = s.batch(6)
    assert not torch.equal(x, x3)
    other_seed, _ = data.WindowSampler(tokens, 16, 8, seed=4).batch(5)
    assert not torch.equal(x, other_seed)


def test_ranks_read_different_slices_of_the_same_global_batch():
    stream = (torch.arange(5000) * 7 % 256).to(torch.uint8)
    whole, _ = data.WindowSampler(stream, 32, 8, seed=1).batch(2)
    parts = [
        data.WindowSampler(stream, 32, 8, seed=1, rank=r, world_size=2).batch(2)[0]
        for r in range(2)
    ]
    assert not torch.equal(parts[0], parts[1])
    assert torch.equal(torch.cat(parts), whole)


def test_sampler_rejects_bad_arguments():
    stream = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="seq_len must be > 0"):
        data.WindowSampler(stream, 0, 4, 0)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        data.WindowSampler(stream, 100, 4, 0)
    with pytest.raises(ValueError, match="divisible by world size"):
        data.WindowSampler(stream, 10, 3, 0, rank=0, world_size=2)
