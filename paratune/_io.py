"""Durable file writes: atomic replace and fsync'd appends."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "atomic_write_bytes", "atomic_write_text", "read_jsonl"]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync it: once this returns, the record survives a kill -9."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=_default, allow_nan=True) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (from a kill mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        lines = handle.readlines()
    for i, line in enumerate(lines):
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return  # torn final write
            raise


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
