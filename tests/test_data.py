"""The text data pipeline: corpus, determinism, resume, row ranges, splits, baseline."""

from __future__ import annotations

import math
import sysconfig

import numpy as np
import pytest

from trainers.data import (
    DOC_SEPARATOR,
    VOCAB_SIZE,
    DataConfig,
    TextDataset,
    decode,
    encode,
    load_corpus,
    make_datasets,
    resolve_paths,
    stdlib_source_files,
    train_val_split,
    unigram_entropy,
)

MAX_BYTES = 200_000
SEQ, BATCH = 32, 8


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return load_corpus(max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def train_tokens(corpus) -> np.ndarray:
    return train_val_split(corpus)[0]


def _ds(tokens, **kw) -> TextDataset:
    kw.setdefault("seed", 0)
    return TextDataset(tokens, SEQ, kw.pop("batch_size", BATCH), **kw)


def _take(ds: TextDataset, n: int) -> list[np.ndarray]:
    return [next(ds)["tokens"] for _ in range(n)]


def test_corpus_is_real_stdlib_text(corpus):
    files = stdlib_source_files()
    assert len(files) > 100
    root = sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert not any("site-packages" in p or "__pycache__" in p for p in rel)
    assert corpus.dtype == np.uint8 and len(corpus) == MAX_BYTES
    assert not corpus.flags.writeable
    text = decode(corpus[:20_000])
    assert "def " in text and "import " in text
    assert DOC_SEPARATOR in corpus  # several files joined
    # Deterministic: loading again gives the same bytes.
    np.testing.assert_array_equal(load_corpus(max_bytes=MAX_BYTES), corpus)


def test_user_paths_and_globs(tmp_path):
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("héllo")
    tokens = load_corpus([str(tmp_path / "*.txt")])
    assert decode(tokens) == "héllo" + chr(DOC_SEPARATOR) + "world"
    assert [p.name for p in resolve_paths(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]
    with pytest.raises(FileNotFoundError):
        load_corpus([str(tmp_path / "missing*.txt")])
    np.testing.assert_array_equal(encode("héllo"), np.frombuffer("héllo".encode(), np.uint8))


def test_batches_shape_dtype_and_contents(train_tokens):
    ds = _ds(train_tokens)
    batch = next(ds)
    assert set(batch) == {"tokens"}
    toks = batch["tokens"]
    assert toks.shape == (BATCH, SEQ + 1) and toks.dtype == np.int32
    assert toks.min() >= 0 and toks.max() < VOCAB_SIZE
    # Every row is a contiguous window of the training tokens at a stride-aligned offset.
    starts = ds.global_window_starts(0)
    for row, s in zip(toks, starts):
        np.testing.assert_array_equal(row, train_tokens[s:s + SEQ + 1])
    offset = starts[0] % SEQ
    assert np.all(starts % SEQ == offset)
    assert len(set(starts.tolist())) == BATCH


def test_deterministic_from_seed(train_tokens):
    a, b = _take(_ds(train_tokens, seed=7), 5), _take(_ds(train_tokens, seed=7), 5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = _take(_ds(train_tokens, seed=8), 5)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_epochs_cover_windows_and_reshuffle(train_tokens):
    ds = _ds(train_tokens, batch_size=4)
    spe = ds.steps_per_epoch
    starts0 = np.concatenate([ds.global_window_starts(s) for s in range(spe)])
    assert len(np.unique(starts0)) == spe * 4  # no window repeats within an epoch
    starts1 = np.concatenate([ds.global_window_starts(s) for s in range(spe, 2 * spe)])
    assert not np.array_equal(starts0, starts1)
    assert ds.num_windows * SEQ + SEQ <= len(train_tokens)  # windows fit at any offset


def test_resume_from_saved_position(train_tokens):
    ds = _ds(train_tokens, seed=3)
    _take(ds, 4)
    state = ds.state_dict()
    expected = _take(ds, 3)
    resumed = _ds(train_tokens, seed=3)
    resumed.load_state_dict(dict(state))
    assert resumed.step == 4
    for x, y in zip(expected, _take(resumed, 3)):
        np.testing.assert_array_equal(x, y)
    # batch_at is a pure function of the step and does not move the position.
    np.testing.assert_array_equal(ds.batch_at(5)["tokens"], expected[1])
    # Resuming across an epoch boundary.
    far = _ds(train_tokens, seed=3)
    far.load_state_dict({**state, "step": ds.steps_per_epoch - 1})
    assert far.epoch == 0 and next(far) is not None and far.epoch == 1
    with pytest.raises(ValueError):
        _ds(train_tokens, seed=4).load_state_dict(state)


def test_row_ranges_partition_the_global_batch(train_tokens):
    """What a process reads (``rows_at``, see trainers.feed) are rows of the one global batch."""
    ds = _ds(train_tokens, seed=1)
    for step in range(3):
        whole = ds.batch_at(step)["tokens"]
        assert whole.shape == (BATCH, SEQ + 1)
        parts = [ds.rows_at(step, lo, lo + 2)["tokens"] for lo in range(0, BATCH, 2)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert ds.step == 0


def test_train_val_disjoint(corpus):
    train, val = train_val_split(corpus, 0.05)
    assert len(train) + len(val) == len(corpus)
    assert len(val) == round(0.05 * len(corpus))
    np.testing.assert_array_equal(np.concatenate([train, val]), corpus)
    tr, va, baseline = make_datasets(DataConfig(max_bytes=MAX_BYTES, seq_len=SEQ, batch_size=BATCH))
    assert len(tr.tokens) == len(train) and len(va.tokens) == len(val)
    assert not np.shares_memory(tr.tokens, va.tokens)
    # Validation is unshuffled: windows in order from offset 0, and stable.
    vb = list(va.epoch_batches(2))
    np.testing.assert_array_equal(vb[0]["tokens"][0], val[:SEQ + 1])
    np.testing.assert_array_equal(vb[1]["tokens"][0], val[BATCH * SEQ:BATCH * SEQ + SEQ + 1])
    assert va.step == 0
    assert 0 < baseline < math.log(VOCAB_SIZE)


def test_unigram_baseline(train_tokens, corpus):
    _, val = train_val_split(corpus)
    h_train = unigram_entropy(train_tokens)
    ce_val = unigram_entropy(train_tokens, val)
    assert 0.0 < h_train < math.log(VOCAB_SIZE)
    assert 0.0 < ce_val < math.log(VOCAB_SIZE)
    assert 2.5 < ce_val < 4.5  # source code bytes: ~3.5 nats
    uniform = np.arange(VOCAB_SIZE, dtype=np.uint8).repeat(4)
    assert unigram_entropy(uniform) == pytest.approx(math.log(VOCAB_SIZE))
    assert unigram_entropy(np.zeros(100, np.uint8)) == 0.0


def test_config_and_errors(train_tokens):
    cfg = DataConfig.from_dict({"paths": "stdlib", "seq_len": 16})
    assert cfg.paths == ("stdlib",) and cfg.seq_len == 16
    with pytest.raises(ValueError):
        DataConfig.from_dict({"seqlen": 16})
    with pytest.raises(ValueError):
        TextDataset(train_tokens[:100], SEQ, BATCH)  # too small for one batch
    with pytest.raises(ValueError):
        train_val_split(train_tokens, 0.0)


def test_the_validation_batch_is_a_multiple_of_the_batch_split():
    """A validation split of fewer windows than one batch gives a smaller validation batch, kept a multiple
    of the ways the step splits its batch (a batch that does not divide over them is refused)."""
    # 20,000 bytes, 5% held out: 1,000 validation bytes, 31 windows of 33 tokens.
    cfg = DataConfig(max_bytes=20_000, seq_len=32, batch_size=64)
    assert make_datasets(cfg, batch_size=8)[1].batch_size == 8  # enough windows: the full batch
    _, val, _ = make_datasets(cfg, batch_multiple=4)
    assert val.num_windows == 31 and val.batch_size == 28
    assert make_datasets(cfg, batch_multiple=1)[1].batch_size == 31
    with pytest.raises(ValueError, match="31 windows of 33, fewer than one batch of 32"):
        make_datasets(cfg, batch_multiple=32)
