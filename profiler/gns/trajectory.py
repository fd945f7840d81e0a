"""The trajectory CSV a noise-scale run appends to, and the lock that keeps it single-writer."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from paratune.trajectory import LEGACY_TRAJECTORY_COLUMNS as _LEGACY_TRAJECTORY_COLUMNS
from paratune.trajectory import TRAJECTORY_COLUMNS


def _append_row(path: str, row: dict[str, Any]) -> None:
    import os

    new = not os.path.exists(path) or os.path.getsize(path) == 0
    line = ",".join(repr(float(row[c])) if isinstance(row[c], float) else str(row[c])
                    for c in TRAJECTORY_COLUMNS)
    with open(path, "a", encoding="utf-8") as handle:
        if new:
            handle.write(",".join(TRAJECTORY_COLUMNS) + "\n")
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _read_trajectory(path: str | Path) -> tuple[tuple[str, ...], list[list[str]]]:
    """Header and complete data rows of a trajectory CSV (``((), [])`` when it is absent).

    A row is complete when it has as many fields as the header and an integer step; a line
    torn by a kill mid-write is left out. Works for the current columns and for trajectories
    written before ``seq_len`` was added.
    """
    file = Path(path)
    if not file.exists():
        return (), []
    lines = file.read_text(encoding="utf-8").splitlines()
    if not lines:
        return (), []
    header = tuple(lines[0].split(","))
    rows = [fields for fields in (line.split(",") for line in lines[1:])
            if len(fields) == len(header) and fields[0].isdigit()]
    return header, rows


def _truncate_rows(path: str, max_step: int, *, seq_len: int) -> None:
    """Keep the header and the rows with ``step <= max_step`` (a torn last line goes too).

    A trajectory written before ``seq_len`` was a column gets it, ``seq_len`` on every kept
    row (:func:`_check_resumable` has checked that its tokens agree), so the rows the resumed
    run appends match the header.
    """
    from paratune.fileio import atomic_write_text

    header, rows = _read_trajectory(path)
    if not header:
        return
    kept = [fields for fields in rows if int(fields[0]) <= max_step]
    if header == _LEGACY_TRAJECTORY_COLUMNS:
        header = TRAJECTORY_COLUMNS
        kept = [[*fields, str(seq_len)] for fields in kept]
    lines = [",".join(header)] + [",".join(fields) for fields in kept]
    atomic_write_text(path, "\n".join(lines) + "\n")


def _measured_rows(path: str) -> int:
    """Complete data rows in a trajectory CSV (0 when it does not exist)."""
    return len(_read_trajectory(path)[1])


def _lock_path(out: str | Path) -> Path:
    """The lock file of the trajectory ``out``: ``<out>.lock`` beside it."""
    path = Path(out).resolve()
    return path.with_name(path.name + ".lock")


def _locked_trajectory(out: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive lock on :func:`_lock_path` while the block runs, so that two runs
    never write one trajectory and its checkpoint (see :func:`paratune.fileio.exclusive_lock`:
    the kernel releases it when this process ends, however it ends).

    Raises:
        ConfigError: another process holds it (``out``, naming that process).
    """
    from paratune.fileio import exclusive_lock

    path = _lock_path(out)
    return exclusive_lock(path, field="out", value=str(out),
                          what=f"writing this trajectory (it holds {path})")
