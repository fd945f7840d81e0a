"""The handle on an open MLflow run, and what says its store went away.

:class:`TrackedRun` logs params, metrics, tags and artifacts; a store that stops answering
(:func:`unreachable` recognises it) costs one warning, and the command goes on untracked.
``mlflow`` itself is passed in by :func:`paratune.tracking.start_run`, the one place that
imports it.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TrackedRun", "end_status", "unreachable"]

_MAX_PARAM_LEN = 6000


class TrackedRun:
    """A thin handle on an active MLflow run.

    A store that stops answering (a tracking server stopped, a database gone) does not stop
    the command: the first call that cannot reach it (after the bounded wait of
    :data:`TRACKING_WAIT_S`) logs one warning, and the calls after it do nothing
    (:attr:`lost` says why). The run is ended ``FAILED`` (or ``KILLED``) when :func:`start_run`
    closes it, or, where the store is still away then, by the next command that reaches it.
    """

    def __init__(self, mlflow_module: Any, run: Any, *, uri: str = "") -> None:
        self._mlflow = mlflow_module
        self._run = run
        self._uri = uri
        self.lost: str | None = None
        """Why the store stopped answering (``None`` while it answers)."""

    @property
    def run_id(self) -> str | None:
        """The run's id (``None`` where the store could not be reached to open it)."""
        return None if self._run is None else self._run.info.run_id

    @property
    def experiment_id(self) -> str | None:
        return None if self._run is None else self._run.info.experiment_id

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """``fn(*args, **kwargs)`` unless the store was lost; a store that cannot be reached
        is lost from then on (one warning), any other error is raised."""
        if self.lost is not None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            reason = unreachable(exc)
            if reason is None:
                raise
            self.lost = reason
            logging.getLogger(__name__).warning(
                "MLflow tracking store %s stopped answering while logging %s (%s): the command "
                "goes on untracked (its results and files are written as usual)%s",
                _shown(self._uri), what, reason,
                f"; run {self.run_id} is ended FAILED once the store answers again"
                if self.run_id else "")

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log parameters (nested values as JSON, long values truncated, passwords in URLs
        masked)."""
        from paratune.redact import redact

        flat = {}
        for key, value in params.items():
            if isinstance(value, (dict, list, tuple)):
                value = json.dumps(value, default=str, sort_keys=True)
            text = redact(value)
            flat[key] = text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 3] + "..."
        if flat:
            self._call("params", self._mlflow.log_params, flat)

    def log_metrics(self, metrics: Mapping[str, float], *, step: int | None = None) -> None:
        """Log numeric metrics; NaN and infinite values are left out."""
        clean = {}
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                clean[key] = number
        if clean:
            self._call("metrics", self._mlflow.log_metrics, clean, step=step)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from paratune.redact import redact

        self._call("tags", self._mlflow.set_tags, {k: redact(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file, or every file in a directory."""
        path = Path(path)
        if path.is_dir():
            self._call(f"artifacts {path}", self._mlflow.log_artifacts, str(path),
                       artifact_path=artifact_path)
        else:
            self._call(f"artifact {path}", self._mlflow.log_artifact, str(path),
                       artifact_path=artifact_path)

    def log_dict(self, data: Any, name: str) -> None:
        """Log a JSON (``.json``) or YAML (``.yaml``) artifact."""
        self._call(f"artifact {name}", self._mlflow.log_dict, data, name)

    def log_text(self, text: str, name: str) -> None:
        self._call(f"artifact {name}", self._mlflow.log_text, text, name)

    def log_table(self, frame: pd.DataFrame, name: str) -> None:
        """Log a DataFrame as a CSV artifact ``name`` (e.g. ``"trials.csv"``)."""
        if self.lost is not None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(name).name
            frame.to_csv(target, index=False)
            parent = str(Path(name).parent)
            self._call(f"artifact {name}", self._mlflow.log_artifact, str(target),
                       artifact_path=None if parent == "." else parent)

    def log_figure(self, figure: Any, name: str) -> None:
        """Log a matplotlib figure as an image artifact."""
        self._call(f"artifact {name}", self._mlflow.log_figure, figure, name)


def _shown(uri: str) -> str:
    from paratune.redact import redact

    return redact(uri)


# what says a store cannot be reached, in the messages of MLflow's REST client and of the
# database drivers (the exception types differ with the store and MLflow version)
_UNREACHABLE_WORDS = ("max retries exceeded", "connection refused", "failed to establish",
                      "timed out", "read timed out", "connection reset", "connection aborted",
                      "could not connect", "server closed the connection", "name or service",
                      "temporary failure in name resolution", "no route to host",
                      "remote end closed", "connection to server", "remotedisconnected",
                      "terminating connection", "is the server running")


def unreachable(exc: BaseException) -> str | None:
    """Why ``exc`` says the tracking store cannot be reached (a server down, a database
    stopped, a timeout), in one line; ``None`` for any other error.

    Args:
        exc: An exception raised by an MLflow call.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current).__name__
        module = type(current).__module__ or ""
        text = str(current)
        lowered = text.lower()
        if (isinstance(current, (ConnectionError, TimeoutError))
                or (module.startswith(("requests", "urllib3"))
                    and kind.endswith(("ConnectionError", "Timeout", "MaxRetryError")))
                or any(word in lowered for word in _UNREACHABLE_WORDS)):
            first = next((line.strip() for line in text.splitlines() if line.strip()), kind)
            return _shown(first[:200])
        current = current.__cause__ or current.__context__
    return None


def end_status(exc: BaseException | None) -> str:
    """The MLflow status of a run that ``exc`` ended (``None``: it ended normally).

    ``KILLED`` for an interrupt (``KeyboardInterrupt``) or a signal turned into
    ``SystemExit(128 + signal number)`` (how ``paratune`` ends on SIGTERM), ``FINISHED`` for
    ``SystemExit(0)``, ``FAILED`` for any other exception.
    """
    if exc is None:
        return "FINISHED"
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED"
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code == 0:
            return "FINISHED"
        if isinstance(exc.code, int) and exc.code > 128:
            return "KILLED"
    return "FAILED"
