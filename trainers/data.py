"""Text data for the example transformer: a byte-level corpus found on the machine.

Corpus
    Nothing is downloaded. The default corpus is the Python standard library's
    own ``.py`` sources (``sysconfig.get_paths()['stdlib']``): every ``*.py``
    file, sorted by relative path, skipping ``site-packages``/``dist-packages``,
    ``__pycache__`` and the parts that distributions often package separately
    (``test``, ``tests``, ``idlelib``, ``tkinter``, ``turtledemo``, ``lib2to3``,
    ``ensurepip``), concatenated and capped at ``max_bytes`` (2 MB by default).
    The text is therefore identical on machines with the same Python version.
    Other text can be given as file paths or globs (``"stdlib"`` in the list
    stands for the default corpus). See ``trainers/corpus/README.md``.

Tokens
    Byte-level: one token per byte, ``VOCAB_SIZE = 256``; files are joined
    with the byte ``DOC_SEPARATOR`` (0, NUL, which source text does not use).
    No other special tokens; :func:`encode`/:func:`decode` convert text.

Splits
    The last ``val_fraction`` (5%) of the token stream is validation, the rest
    training: contiguous, deterministic, disjoint.

Batches
    A :class:`TextDataset` cuts its tokens into windows of ``seq_len + 1``
    tokens starting every ``seq_len`` tokens (inputs ``w[:-1]``, targets
    ``w[1:]``; see ``models.transformer.next_token_loss``). Each epoch draws,
    from ``numpy.random.default_rng([seed, epoch])``, a random start offset in
    ``[0, seq_len)`` and a permutation of the windows; step ``s`` of an epoch
    takes windows ``perm[s*B:(s+1)*B]`` (``B`` = global ``batch_size``; the
    remainder of an epoch is dropped). Batches are dicts
    ``{'tokens': int32 [B, seq_len + 1]}``; :meth:`TextDataset.rows_at` reads
    some rows only (a process's share, see ``trainers.feed``).

Position
    The only state is the global step, a pure function of which is every
    batch. :meth:`TextDataset.state_dict` / :meth:`TextDataset.load_state_dict`
    save and restore it (with the settings, checked on restore); the position is
    independent of the process count, so a run may resume on another one.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DOC_SEPARATOR",
    "VOCAB_SIZE",
    "DataConfig",
    "count_windows",
    "TextDataset",
    "decode",
    "encode",
    "ln_vocab",
    "load_corpus",
    "make_datasets",
    "resolve_paths",
    "stdlib_source_files",
    "train_val_split",
    "unigram_entropy",
]

VOCAB_SIZE = 256
DOC_SEPARATOR = 0
DEFAULT_MAX_BYTES = 2_000_000
STDLIB = "stdlib"

_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests",
    "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
})


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files in deterministic (sorted relative path) order."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(base).as_posix(), path))
    return [p for _, p in sorted(found)]


def resolve_paths(paths: str | Sequence[str] | None) -> list[Path]:
    """Expand files, globs and ``"stdlib"`` into an ordered list of files (globs sorted)."""
    if paths is None:
        return stdlib_source_files()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for item in paths:
        item = os.fspath(item)
        if item == STDLIB:
            files.extend(stdlib_source_files())
            continue
        matches = sorted(glob.glob(os.path.expanduser(item), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"no corpus file matches {item!r}")
        files.extend(Path(m) for m in matches)
    return files


@functools.lru_cache(maxsize=8)
def _load_corpus_cached(files: tuple[str, ...], max_bytes: int) -> np.ndarray:
    parts: list[bytes] = []
    total = 0
    for f in files:
        if total >= max_bytes:
            break
        data = Path(f).read_bytes()
        if parts:
            parts.append(bytes([DOC_SEPARATOR]))
            total += 1
        parts.append(data)
        total += len(data)
    tokens = np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8).copy()
    tokens.setflags(write=False)
    return tokens


def load_corpus(paths: str | Sequence[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Read the corpus as byte tokens (read-only ``uint8`` array of at most ``max_bytes``)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    files = tuple(str(p) for p in resolve_paths(paths))
    if not files:
        raise FileNotFoundError("the corpus is empty: no files found")
    return _load_corpus_cached(files, int(max_bytes))


def encode(text: str | bytes) -> np.ndarray:
    """Text (UTF-8) or bytes -> ``uint8`` byte tokens."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode(tokens: Any) -> str:
    """Byte tokens -> text (invalid UTF-8 replaced)."""
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Split the token stream: the last ``val_fraction`` is validation, the rest training."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(len(tokens) * val_fraction))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def count_windows(n_tokens: int, seq_len: int, *, shuffle: bool = True) -> int:
    """Windows of ``seq_len + 1`` tokens, every ``seq_len``, that ``n_tokens`` hold (with ``shuffle``: for any
    start offset in ``[0, seq_len)``)."""
    return max(0, (n_tokens - 1 - (seq_len - 1 if shuffle else 0)) // seq_len)


def unigram_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray | None = None,
                    vocab_size: int = VOCAB_SIZE, smoothing: float = 1.0) -> float:
    """Unigram baseline loss in nats.

    The cross-entropy, on ``val_tokens``, of the add-``smoothing`` unigram
    distribution estimated on ``train_tokens`` (with no ``val_tokens``: the
    entropy of the training distribution itself). A model that learns anything
    beyond byte frequencies goes below it; a uniform guess scores ``ln(vocab_size)``.
    """
    counts = np.bincount(np.asarray(train_tokens).ravel(), minlength=vocab_size).astype(np.float64)
    probs = (counts + smoothing) / (counts.sum() + smoothing * vocab_size)
    if val_tokens is None:
        p = counts / max(counts.sum(), 1.0)
        nz = p > 0
        return float(-(p[nz] * np.log(p[nz])).sum())
    return float(-np.mean(np.log(probs[np.asarray(val_tokens).ravel()])))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Data settings (e.g. the ``data:`` section of a trainer config).

    ``paths``: files/globs (``"stdlib"`` = the default corpus); ``None`` = stdlib.
    """

    paths: tuple[str, ...] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 8
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataConfig:
        """Build from a mapping; unknown keys are an error; a single path string is accepted."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DataConfig keys: {unknown}")
        d = dict(d)
        if isinstance(d.get("paths"), str):
            d["paths"] = (d["paths"],)
        elif d.get("paths") is not None:
            d["paths"] = tuple(d["paths"])
        return cls(**d)


class TextDataset:
    """Deterministic, resumable batches of token windows.

    Args:
      tokens: 1-D byte tokens (e.g. the training split).
      seq_len: model sequence length; windows hold ``seq_len + 1`` tokens.
      batch_size: the *global* batch size (all processes together).
      seed: seeds the per-epoch offset and permutation.
      shuffle: ``False`` gives windows in order from offset 0 every epoch
        (for validation).

    Iterating yields ``{'tokens': int32 [batch_size, seq_len + 1]}`` forever,
    advancing :attr:`step`; :meth:`batch_at` is the same batch for any step
    without touching the position. With several processes, each reads only
    its rows (:meth:`rows_at`, through ``trainers.feed.Feed``).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        # Windows that fit for any start offset in [0, seq_len).
        self.num_windows = count_windows(len(tokens), self.seq_len, shuffle=shuffle)
        self.steps_per_epoch = self.num_windows // self.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens give {self.num_windows} windows of {self.seq_len + 1}: "
                f"fewer than one batch of {self.batch_size}"
            )
        self.step = 0
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None
        self._span = np.arange(self.seq_len + 1)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def _epoch_order(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                offset = int(rng.integers(self.seq_len))
                perm = rng.permutation(self.num_windows)
            else:
                offset, perm = 0, np.arange(self.num_windows)
            self._epoch_cache = (epoch, offset, perm)
        return self._epoch_cache[1], self._epoch_cache[2]

    def global_window_starts(self, step: int) -> np.ndarray:
        """Token offsets of the ``batch_size`` windows of global batch ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(int(step), self.steps_per_epoch)
        offset, perm = self._epoch_order(epoch)
        idx = perm[within * self.batch_size:(within + 1) * self.batch_size]
        return offset + idx * self.seq_len

    def rows_at(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start .. stop-1`` of global batch ``step`` (only those windows are read)."""
        starts = self.global_window_starts(step)[start:stop]
        return {"tokens": self.tokens[starts[:, None] + self._span].astype(np.int32)}

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The whole (global) batch of ``step``."""
        return self.rows_at(step, 0, self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def epoch_batches(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One pass over epoch 0 (e.g. validation), without moving :attr:`step`."""
        n = self.steps_per_epoch if max_batches is None else min(max_batches, self.steps_per_epoch)
        for s in range(n):
            yield self.batch_at(s)

    def state_dict(self) -> dict[str, int]:
        """The data position and the settings it depends on (plain ints, checkpointable)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (settings must match)."""
        for key in ("seed", "seq_len", "batch_size", "num_windows"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"data state mismatch: saved {key}={int(state[key])}, dataset has {getattr(self, key)}"
                )
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"bad saved step {step}")
        self.step = step


def make_datasets(config: DataConfig | None = None, *, batch_multiple: int = 1,
                  **overrides: Any) -> tuple[TextDataset, TextDataset, float]:
    """Load the corpus and build ``(train, validation, unigram_baseline_nats)``.

    ``overrides`` replace fields of ``config``. Validation is unshuffled; its
    batch size is capped to fit its split, and kept a multiple of
    ``batch_multiple`` (the ways a step splits its batch: a batch that does not
    divide over them is refused).
    """
    config = dataclasses.replace(config or DataConfig(), **overrides)
    tokens = load_corpus(config.paths, config.max_bytes)
    train_tokens, val_tokens = train_val_split(tokens, config.val_fraction)
    train = TextDataset(train_tokens, config.seq_len, config.batch_size, seed=config.seed)
    val_windows = count_windows(len(val_tokens), config.seq_len, shuffle=False)
    val_bs = min(config.batch_size, val_windows - val_windows % batch_multiple)
    if val_bs == 0:
        raise ValueError(
            f"validation split ({len(val_tokens)} tokens) holds {val_windows} windows of {config.seq_len + 1}, "
            f"fewer than one batch of {batch_multiple}; raise max_bytes or val_fraction"
        )
    val = TextDataset(val_tokens, config.seq_len, val_bs, seed=config.seed, shuffle=False)
    return train, val, unigram_entropy(train_tokens, val_tokens)


def ln_vocab(vocab_size: int = VOCAB_SIZE) -> float:
    """Loss of a uniform guess, ``ln(vocab_size)`` nats."""
    return math.log(vocab_size)
