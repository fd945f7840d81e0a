from __future__ import annotations

import numpy as np
import pytest
import torch

from paratune.errors import ConfigError
from paratune.profiler.corpus import TextCorpus, stdlib_files


@pytest.fixture(scope="module")
def corpus() -> TextCorpus:
    return TextCorpus.from_stdlib(max_bytes=1 << 20)


def test_stdlib_corpus_is_real_python_source(corpus):
    assert corpus.info["source"] == "python-stdlib"
    assert corpus.train.size > 500_000 and corpus.validation.size > 0
    text = corpus.train.tobytes()
    assert b"def " in text and b"import " in text and b"return" in text
    # Byte-level tokens of source code: mostly printable ASCII, a real (skewed) distribution.
    counts = np.bincount(corpus.train, minlength=256)
    assert counts[ord(" ")] > counts[ord("q")] > 0
    assert not any("site-packages" in p.parts for p in stdlib_files())


def test_split_is_deterministic_and_disjoint():
    a = TextCorpus.from_stdlib(max_bytes=1 << 19)
    b = TextCorpus.from_stdlib(max_bytes=1 << 19)
    assert a.info["sha256"] == b.info["sha256"]
    # A file's split depends on its path only, so a bigger corpus keeps the small one's files
    # on the same side: the small train stream is a prefix of the bigger one.
    big = TextCorpus.from_stdlib(max_bytes=1 << 20)
    assert big.train[: a.train.size].tobytes() == a.train.tobytes()
    assert big.validation[: a.validation.size].tobytes() == a.validation.tobytes()
    # No training document shows up in validation.
    val_docs = set(a.validation.tobytes().split(b"\x00")) - {b""}
    train_docs = set(big.train.tobytes().split(b"\x00"))
    assert val_docs and not (val_docs & train_docs)


def test_batches_are_addressed_by_position(corpus):
    seq = 32
    whole = corpus.sequences(0, 24, seq, seed=3)
    assert whole.shape == (24, seq + 1) and whole.dtype == torch.long
    assert int(whole.min()) >= 0 and int(whole.max()) < 256
    # A run that changes batch size mid-way (8, 8, then 4 + 4) reads the same sequences.
    parts = torch.cat([corpus.batch(0, 8, seq, seed=3), corpus.batch(1, 8, seq, seed=3),
                       corpus.sequences(16, 4, seq, seed=3), corpus.sequences(20, 4, seq, seed=3)])
    assert torch.equal(parts, whole)
    # A fresh corpus object (a resumed process) gives the same batch; another seed does not.
    again = TextCorpus.from_stdlib(max_bytes=1 << 20)
    assert torch.equal(again.batch(5, 4, seq, seed=3), corpus.batch(5, 4, seq, seed=3))
    assert not torch.equal(corpus.batch(5, 4, seq, seed=4), corpus.batch(5, 4, seq, seed=3))


def test_one_epoch_visits_every_window_once():
    # Ten windows of 10 bytes, each starting with its own digit (so all differ).
    corpus = TextCorpus.from_texts(["".join(f"{i}abcdefghi" for i in range(10))], ["xyz" * 20])
    seq = 9
    num = corpus.num_windows(seq)
    assert num == 101 // 10
    epoch = corpus.sequences(0, num, seq, seed=1)
    starts = sorted(bytes(row.tolist()) for row in epoch)
    stream = corpus.train.tobytes()
    assert starts == [f"{i}abcdefghi".encode() for i in range(num)]
    assert starts == sorted(stream[i * 10:(i + 1) * 10] for i in range(num))
    # The next epoch is another permutation of the same windows.
    nxt = corpus.sequences(num, num, seq, seed=1)
    assert sorted(bytes(r.tolist()) for r in nxt) == starts
    assert not torch.equal(nxt, epoch)
    assert corpus.sequences(0, 2, seq, split="validation").shape == (2, 10)


@pytest.mark.parametrize(("call", "field"), [
    (lambda c: c.sequences(-1, 2, 8), "start"),
    (lambda c: c.sequences(0, 0, 8), "count"),
    (lambda c: c.sequences(0, 2, 8, split="test"), "split"),
    (lambda c: c.sequences(0, 2, 10_000, split="validation"), "seq_len"),
    (lambda c: c.batch(-2, 2, 8), "step"),
])
def test_bad_requests_name_the_field(call, field):
    corpus = TextCorpus.from_texts(["a" * 1000], ["b" * 100])
    with pytest.raises(ConfigError) as info:
        call(corpus)
    assert info.value.field == field


def test_bad_construction_names_the_field():
    with pytest.raises(ConfigError, match="validation_fraction"):
        TextCorpus.from_stdlib(validation_fraction=0.9)
    with pytest.raises(ConfigError, match="max_bytes"):
        TextCorpus.from_stdlib(max_bytes=10)
