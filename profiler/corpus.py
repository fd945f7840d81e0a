"""Real text with no download: the Python standard library's own source, byte-level tokenised.

Every machine that runs paratune has a Python installation, so its ``.py`` files are a text
corpus that needs no network, no tokenizer and no licence check. Bytes are tokens (the
``tiny`` and ``small`` presets have a 256-entry vocabulary); files are joined with a ``0``
byte (which source files do not contain) as the document separator.

Determinism is what makes a run resumable and reconfigurable:

* the file order and the train/validation split depend only on each file's path relative to
  the library root (a CRC-32 of the path), not on the file system's listing order;
* sequence ``i`` of the training stream depends only on ``(seed, i)``: the stream is cut into
  non-overlapping windows of ``seq_len + 1`` bytes, and each epoch visits them in a
  permutation drawn from ``(seed, epoch)``. A batch is a run of consecutive sequence indices,
  so the *data position* is simply the number of sequences consumed; it carries over when the
  batch size, the parallel layout or the process changes.
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["SPLITS", "TextCorpus", "stdlib_files"]

SPLITS = ("train", "validation")
_SEPARATOR = b"\x00"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library (third-party packages excluded).

    Args:
        root: Library directory; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        Paths sorted by their path relative to ``root``.

    Raises:
        ConfigError: ``root`` holds no ``.py`` files.
    """
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if not _SKIP_DIRS.intersection(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError("root", str(root), "must contain Python source files")
    return files


def _split_hash(relative: str) -> int:
    return zlib.crc32(relative.encode())


def _order_key(relative: str) -> bytes:
    # Independent of the split hash, so every prefix of the order mixes both splits.
    return hashlib.sha1(relative.encode()).digest()


@dataclass
class TextCorpus:
    """Byte-level train and validation streams with deterministic, position-addressed batches.

    Build one with :meth:`from_stdlib` (or :meth:`from_texts` for tests and other corpora).
    """

    train: np.ndarray
    """Training bytes (``uint8``)."""
    validation: np.ndarray
    """Validation bytes (``uint8``)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Provenance: source, file counts, bytes per split, content fingerprint."""
    _perm_cache: dict[tuple[int, int, int], np.ndarray] = field(
        default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_stdlib(cls, *, max_bytes: int | None = 8 << 20, validation_fraction: float = 0.05,
                    root: str | Path | None = None) -> TextCorpus:
        """Read the standard library's sources.

        Files are taken in the order of a hash of their relative path (a spread over the whole
        library rather than the alphabetically first modules) until ``max_bytes`` is reached.
        A file belongs to the validation split when a second, independent hash of its path
        falls in the first ``validation_fraction`` of the hash range, so the split never
        depends on ``max_bytes`` or on which other files exist. Files whose content repeats an
        earlier one (empty ``__init__.py`` files, copies) are skipped, so no validation
        document is also a training document.

        Args:
            max_bytes: Stop reading after this many bytes (``None``: the whole library).
            validation_fraction: Share of files held out, in ``(0, 0.5]``.
            root: Library directory; defaults to this interpreter's.

        Returns:
            The corpus.

        Raises:
            ConfigError: ``max_bytes`` or ``validation_fraction`` out of range.
        """
        if max_bytes is not None and max_bytes < 4096:
            raise ConfigError("max_bytes", max_bytes, "must be at least 4096 (or None for all)")
        if not 0.0 < validation_fraction <= 0.5:
            raise ConfigError("validation_fraction", validation_fraction, "must be in (0, 0.5]")
        root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        relatives = {p: p.relative_to(root).as_posix() for p in files}
        ordered = sorted(files, key=lambda p: (_order_key(relatives[p]), relatives[p]))
        threshold = validation_fraction * 2**32
        parts: dict[str, list[bytes]] = {"train": [], "validation": []}
        total = 0
        seen: set[bytes] = set()
        for path in ordered:
            data = path.read_bytes().replace(_SEPARATOR, b"")
            digest = hashlib.sha256(data).digest()
            if digest in seen:
                continue
            seen.add(digest)
            held_out = _split_hash(relatives[path]) < threshold
            parts["validation" if held_out else "train"].append(data)
            total += len(data) + 1
            if max_bytes is not None and total >= max_bytes:
                break
        corpus = cls._from_parts(parts["train"], parts["validation"])
        corpus.info.update(source="python-stdlib", root_name=root.name,
                           num_files_available=len(files),
                           num_files={"train": len(parts["train"]),
                                      "validation": len(parts["validation"])},
                           max_bytes=max_bytes, validation_fraction=validation_fraction)
        return corpus

    @classmethod
    def from_texts(cls, train: Iterable[str | bytes],
                   validation: Iterable[str | bytes]) -> TextCorpus:
        """A corpus from given documents (each joined with the separator byte).

        Args:
            train: Training documents.
            validation: Validation documents.
        """
        def as_bytes(docs: Iterable[str | bytes]) -> list[bytes]:
            return [d.encode() if isinstance(d, str) else bytes(d) for d in docs]

        corpus = cls._from_parts(as_bytes(train), as_bytes(validation))
        corpus.info["source"] = "texts"
        return corpus

    @classmethod
    def _from_parts(cls, train: list[bytes], validation: list[bytes]) -> TextCorpus:
        streams = {}
        for name, docs in (("train", train), ("validation", validation)):
            joined = _SEPARATOR.join(docs) + _SEPARATOR if docs else b""
            streams[name] = np.frombuffer(joined, dtype=np.uint8).copy()
        digest = hashlib.sha256(streams["train"].tobytes())
        digest.update(streams["validation"].tobytes())
        return cls(train=streams["train"], validation=streams["validation"],
                   info={"bytes": {k: int(v.size) for k, v in streams.items()},
                         "sha256": digest.hexdigest()})

    # ------------------------------------------------------------------ sampling
    @property
    def vocab_size(self) -> int:
        return 256

    def num_windows(self, seq_len: int, split: str = "train") -> int:
        """Non-overlapping windows of ``seq_len + 1`` bytes in ``split`` (sequences per epoch)."""
        return int(self._stream(split).size // (seq_len + 1))

    def _stream(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ConfigError("split", split, f"must be one of {', '.join(SPLITS)}")
        return self.train if split == "train" else self.validation

    def _permutation(self, num: int, seed: int, epoch: int) -> np.ndarray:
        key = (num, seed, epoch)
        perm = self._perm_cache.get(key)
        if perm is None:
            if len(self._perm_cache) > 8:
                self._perm_cache.clear()
            perm = np.random.default_rng([seed, epoch, num]).permutation(num)
            self._perm_cache[key] = perm
        return perm

    def sequences(self, start: int, count: int, seq_len: int, *, seed: int = 0,
                  split: str = "train") -> torch.Tensor:
        """Sequences ``start .. start + count - 1`` of the stream for ``seed``.

        Args:
            start: Index of the first sequence (the data position: sequences consumed so far).
            count: How many sequences.
            seq_len: Model sequence length; each row holds ``seq_len + 1`` tokens (inputs and
                the shifted targets).
            seed: Data-order seed.
            split: ``"train"`` or ``"validation"``.

        Returns:
            ``LongTensor [count, seq_len + 1]`` of byte values.

        Raises:
            ConfigError: a negative ``start``, a non-positive ``count`` or ``seq_len``, an
                unknown split, or a split too small for one window.
        """
        import torch

        if start < 0:
            raise ConfigError("start", start, "must be >= 0")
        if count < 1:
            raise ConfigError("count", count, "must be a positive integer")
        if seq_len < 1:
            raise ConfigError("seq_len", seq_len, "must be a positive integer")
        stream = self._stream(split)
        width = seq_len + 1
        num = self.num_windows(seq_len, split)
        if num < 1:
            raise ConfigError("seq_len", seq_len,
                              f"a window of seq_len+1 bytes must fit in the {split} split "
                              f"({stream.size} bytes)")
        index = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(index, num)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._permutation(num, seed, int(epoch))[within[mask]]
        offsets = windows[:, None] * width + np.arange(width)[None, :]
        return torch.from_numpy(stream[offsets].astype(np.int64))

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int = 0,
              split: str = "train") -> torch.Tensor:
        """The global batch of step ``step`` under a constant ``batch_size``.

        Equivalent to ``sequences(step * batch_size, batch_size, ...)``; a run whose batch size
        changes should track its data position and call :meth:`sequences` instead.
        """
        if step < 0:
            raise ConfigError("step", step, "must be >= 0")
        return self.sequences(step * batch_size, batch_size, seq_len, seed=seed, split=split)
