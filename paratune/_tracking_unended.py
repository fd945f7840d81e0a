"""Ending a run whose store went away: now where it answers, else by the next command.

A run that could not be ended is remembered in :func:`unended_runs_file` (the store named by
a digest of its URI) and ended by the next :func:`paratune.tracking.start_run` on that store.
``mlflow`` is passed in; this module does not import it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from paratune._tracking_run import TrackedRun, _shown, unreachable

__all__ = ["unended_runs_file"]


def _end_run(mlflow_module: Any, tracked: TrackedRun, status: str) -> None:
    """End the run with ``status`` (``FAILED`` where the store was lost meanwhile and the
    command itself succeeded); where the store cannot be reached, remember the run so that
    the next :func:`start_run` on it ends it."""
    import io

    if tracked.lost is not None and status == "FINISHED":
        status = "FAILED"  # its record is incomplete
    captured = io.StringIO()
    try:
        if tracked.lost is not None:
            with contextlib.suppress(Exception):
                mlflow_module.set_tag("paratune.tracking_lost", tracked.lost)
        with contextlib.redirect_stdout(captured):  # MLflow prints the run's URL
            mlflow_module.end_run(status=status)
    except Exception as exc:
        reason = unreachable(exc)
        if reason is None:
            raise
        _remember_unended(tracked._uri, tracked.run_id, status)
        logging.getLogger(__name__).warning(
            "MLflow tracking store %s cannot be reached to end run %s (%s): the next command "
            "tracked there ends it %s", _shown(tracked._uri), tracked.run_id, reason, status)
    from paratune.redact import redact

    if captured.getvalue():
        sys.stdout.write(redact(captured.getvalue()))


def unended_runs_file() -> Path:
    """Where runs that could not be ended (their store gone) wait for the next command:
    ``$XDG_STATE_HOME/paratune/unended-runs.jsonl`` (``~/.local/state`` without it). A store
    is named there by a digest of its URI, never by the URI (which may hold a password)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "paratune" / "unended-runs.jsonl"


def _store_key(uri: str) -> str:
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()[:32]


def _remember_unended(uri: str, run_id: str | None, status: str) -> None:
    if run_id is None:
        return
    from paratune.fileio import append_jsonl

    try:
        # the reason quotes URLs of the store: kept out of the file, as the URI is
        append_jsonl(unended_runs_file(), {"store": _store_key(uri), "run_id": run_id,
                                           "status": status,
                                           "reason": "the tracking store went away during "
                                                     "the command that ran it"})
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot remember run %s to end it later (%s)",
                                            run_id, exc.strerror or exc)


def _end_unended_runs(mlflow_module: Any, uri: str) -> None:
    """End the runs an earlier command could not end on this store (see
    :func:`_remember_unended`); those it still cannot reach stay for the next command."""
    from paratune.fileio import atomic_write_text, read_jsonl

    path = unended_runs_file()
    if not path.exists():
        return
    entries = list(read_jsonl(path))
    key = _store_key(uri)
    mine = [e for e in entries if e.get("store") == key]
    if not mine:
        return
    client = mlflow_module.MlflowClient(tracking_uri=uri)
    left = [e for e in entries if e.get("store") != key]
    for entry in mine:
        try:
            client.set_tag(entry["run_id"], "paratune.tracking_lost", entry.get("reason", ""))
            client.set_terminated(entry["run_id"], status=entry.get("status", "FAILED"))
        except Exception as exc:
            if unreachable(exc) is None:  # a run the store no longer has: forget it
                logging.getLogger(__name__).warning("cannot end run %s: %s", entry["run_id"],
                                                    str(exc).splitlines()[0] if str(exc) else exc)
                continue
            left.append(entry)
            continue
        logging.getLogger(__name__).info("ended run %s (%s), left open by an earlier command "
                                         "whose tracking store went away", entry["run_id"],
                                         entry.get("status", "FAILED"))
    with contextlib.suppress(OSError):
        atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in left))
