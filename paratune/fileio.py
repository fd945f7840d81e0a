"""Durable file writes: atomic replace and fsync'd appends."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratune.scalars import plain

__all__ = ["append_jsonl", "atomic_write_bytes", "atomic_write_text", "exclusive_lock",
           "fsync_dir", "read_jsonl"]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort where not supported)."""
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


def atomic_write_bytes(path: str | Path, data: bytes, *, executable: bool | None = None
                       ) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    The file gets the permissions a plain ``open(path, "w")`` gives a new file (``0o666``
    less the umask, so a dataset or model on a shared filesystem is as readable as any other
    file there), with the execute bits too (``0o777`` less the umask) for a script.

    Args:
        executable: Whether the file is a program; ``None``: when ``data`` starts with
            ``#!``.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: the file cannot be created or written (no such directory, no permission,
            a full disk), naming ``path``.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if executable is None:
        executable = data.startswith(b"#!")
    fd, tmp = _create_temporary(path, 0o777 if executable else 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, say: named after the file asked for
        tmp.unlink(missing_ok=True)
        raise _renamed(exc, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _renamed(exc: OSError, path: Path) -> OSError:
    """``exc`` about ``path`` (the file asked for) instead of its temporary; as it is where
    it carries no error number."""
    return OSError(exc.errno, exc.strerror, str(path)) if exc.errno is not None else exc


def _create_temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new, empty file beside ``path`` (``.NAME.XXXXXXXX.tmp``), open for writing, created
    with ``mode`` less the umask (as ``open`` creates files; ``tempfile.mkstemp`` makes every
    file ``0o600``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
        except OSError as exc:  # named after the file asked for, not its temporary
            raise _renamed(exc, path) from None
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def atomic_write_text(path: str | Path, text: str, *, executable: bool | None = None) -> None:
    """:func:`atomic_write_bytes` of ``text`` as UTF-8."""
    atomic_write_bytes(path, text.encode(), executable=executable)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync it: once this returns, the record survives a kill -9.

    A file whose last write was torn by a kill (no final newline) gets the newline first, so
    the torn fragment stays a line of its own (which :func:`read_jsonl` skips) instead of
    swallowing this record. One writer per file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=_default, allow_nan=True) + "\n"
    with open(path, "ab") as handle:
        if handle.tell() > 0:
            with open(path, "rb") as reader:
                reader.seek(-1, os.SEEK_END)
                if reader.read(1) != b"\n":
                    line = "\n" + line
        handle.write(line.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file, in order. Lines torn by a kill mid-write (the last line, or
    an earlier one that a later append closed) are skipped with a warning: they were never
    acknowledged as written."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = handle.readlines()
    torn = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn.append(number)
            continue
        if isinstance(record, dict):
            yield record
        else:
            torn.append(number)
    key = (str(path.resolve()), tuple(torn))
    if torn and key not in _WARNED:  # once per file and set of lines: readers poll journals
        import logging

        _WARNED.add(key)
        logging.getLogger(__name__).warning(
            "%s: skipped %d torn line(s) (line %s) left by a killed write", path, len(torn),
            ", ".join(map(str, torn[:5])) + (" ..." if len(torn) > 5 else ""))


_WARNED: set[tuple[str, tuple[int, ...]]] = set()


_UNLOCKABLE: set[str] = set()
"""Lock files this process found it cannot lock (it has warned about each)."""


@contextlib.contextmanager
def exclusive_lock(path: str | Path, *, field: str, value: str, what: str,
                   wait_s: float = 0.0) -> Iterator[bool]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) while the block runs.

    The lock (``flock``) belongs to this process and ends with it, killed or not, so a
    dead run never leaves a stale lock behind. Where ``flock`` does not exist (not POSIX,
    some network file systems) nothing is locked; the block is told so (``with ... as
    locked``), and a warning is logged, once per lock file in a process.

    Args:
        wait_s: How long to wait for another holder to let go before giving up (0: give up
            at once, for work that must not run twice; more for short writes that take turns).

    Raises:
        ConfigError: another process holds the lock (for over ``wait_s``); ``field``/``value``
            name the input that points at the shared files, ``what`` says what that process
            is doing.
        OSError: the lock file can be neither created nor read (a read-only directory,
            another user's private file).
    """
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform
        yield False
        return
    from paratune.errors import ConfigError

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0o666 less the umask, as the files it guards: a group-writable dataset stays writable
    # by the group; a lock file another user created (not writable here) is locked read-only
    writable = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
        writable = False
    try:
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
            raise ConfigError(field, value, f"is in use: another process (pid {holder}) is "
                              f"{what}{waited}; wait for it to end or stop it first") from None
        except OSError as exc:  # a filesystem without flock (some NFS, Lustre, FUSE mounts)
            import logging

            # once per lock file and process: a model loaded in a loop says it once
            if str(path) not in _UNLOCKABLE:
                _UNLOCKABLE.add(str(path))
                logging.getLogger(__name__).warning(
                    "%s: cannot lock (%s); nothing stops another process %s at the same "
                    "time", path, exc.strerror or exc, what)
            yield False
            return
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _default(value: Any) -> Any:
    unwrapped = plain(value)  # a numpy scalar
    if unwrapped is not value:
        return unwrapped
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
