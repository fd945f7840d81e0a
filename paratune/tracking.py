"""MLflow tracking: the only module that imports mlflow.

Every campaign, fit, tuning run and experiment is one MLflow run. The store is
``MLFLOW_TRACKING_URI`` when set, else a local SQLite file ``mlflow.db`` in the working
directory; ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows it. With a local
SQLite store, the experiments paratune creates keep their artifacts beside the database, in
``mlartifacts/<experiment>/<run id>/artifacts/`` (other stores choose their own location;
an experiment keeps the location it was created with).

A command ``paratune <command>`` logs to the experiment ``paratune-<command>``; a script
``experiments/<name>.py`` logs to :data:`EXPERIMENTS` with the run name ``<name>`` (see
:func:`start_script_run`). ``docs/tracking.md`` lists the params, tags and metrics of each.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EXPERIMENTS", "TRACKING_WAIT_S", "TrackedRun", "add_no_track_argument",
           "add_track_flag", "artifact_root", "default_tracking_uri", "end_status", "run_note",
           "source_tags", "start_run", "start_script_run", "ui_command", "unended_runs_file",
           "unreachable"]

_MAX_PARAM_LEN = 6000

EXPERIMENTS = "paratune-experiments"
"""The MLflow experiment of every ``experiments/*.py`` script (run name: the script's name)."""


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<cwd>/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def artifact_root(uri: str | None = None) -> Path | None:
    """Where experiments created in a local SQLite store keep their artifacts.

    Args:
        uri: Tracking URI; defaults to :func:`default_tracking_uri`.

    Returns:
        ``mlartifacts/`` beside the database file for ``sqlite:///PATH`` stores; ``None``
        for any other store (MLflow's own default applies there).
    """
    database = _sqlite_file(uri or default_tracking_uri())
    return None if database is None else database.resolve().parent / "mlartifacts"


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` tracking URI (``None``: another store)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri == prefix or ":memory:" in uri:
        return None
    return Path(uri[len(prefix):].split("?", 1)[0])


_STORE_LOCK_WAIT_S = 120.0
"""How long a process waits for another one to create the schema of a new SQLite store."""


@contextlib.contextmanager
def _store_opening(uri: str) -> Iterator[None]:
    """Let one process at a time open a local SQLite store while the block runs.

    MLflow creates the tables of a new SQLite store (its schema migrations) the first time a
    process opens it; two processes doing that at once (``paratune tune`` workers sharing one
    study, each tracked to ./mlflow.db) break each other's migration. The lock
    (``<database>.lock`` beside it) makes the others wait until the first has done it; it is
    released when the block ends, an error included. Other stores are not locked.

    Raises:
        ConfigError: another process held the lock for over :data:`_STORE_LOCK_WAIT_S`
            (field ``tracking_uri``).
    """
    database = _sqlite_file(uri)
    if database is None:
        yield
        return
    from paratune._io import exclusive_lock

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(
                database.with_name(database.name + ".lock"), field="tracking_uri", value=uri,
                what="opening this MLflow tracking store", wait_s=_STORE_LOCK_WAIT_S))
        except OSError as exc:  # no lock file possible there: MLflow says what it cannot do
            logging.getLogger(__name__).warning(
                "%s: cannot lock the store (%s); processes opening it at once may fail", uri,
                exc.strerror or exc)
        yield


def _experiment_dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"


def _ensure_experiment(mlflow_module: Any, name: str, uri: str) -> None:
    """Create ``name`` with its artifacts under :func:`artifact_root` when the store is a
    local SQLite file and the experiment does not exist yet."""
    root = artifact_root(uri)
    if root is None:
        return
    client = mlflow_module.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(name) is not None:
        return
    location = (root / _experiment_dir_name(name)).as_uri()
    try:
        client.create_experiment(name, artifact_location=location)
    except mlflow_module.exceptions.MlflowException:
        if client.get_experiment_by_name(name) is None:  # not a concurrent creation
            raise


def ui_command(uri: str | None = None) -> str:
    """The command that opens the MLflow UI on this store."""
    from paratune._redact import redact

    uri = redact(uri or default_tracking_uri())
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri}"


def run_note(run: TrackedRun) -> str:
    """The closing line of a tracked command: the run and how to open it, or what was not
    tracked (the store could not be reached, or went away meanwhile)."""
    uri = _shown(run._uri)
    if run.run_id is None:
        return f"not tracked: the MLflow store {uri} could not be reached ({run.lost})"
    if run.lost is not None:
        return (f"MLflow run {run.run_id} is incomplete: the store {uri} went away "
                f"({run.lost}); the next command tracked there ends it FAILED")
    return f"MLflow run {run.run_id}: {ui_command(run._uri)}"


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
        from paratune._redact import redact

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
        from paratune._redact import redact

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
    from paratune._redact import redact

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


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def _git_commit() -> str | None:
    """The commit of the git checkout paratune's sources are in (``None`` when they are not
    in one of their own, or git is not installed)."""
    if shutil.which("git") is None:
        return None
    root = Path(__file__).resolve().parent.parent  # the directory holding paratune/
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # installed inside another repository
        return None
    return _git(root, "rev-parse", "HEAD") or None


def source_tags() -> dict[str, str]:
    """``paratune.version`` and, where paratune runs from a git checkout,
    ``mlflow.source.git.commit`` (what :func:`start_run` tags every new run with)."""
    from paratune import __version__

    tags = {"paratune.version": __version__}
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


@contextlib.contextmanager
def start_run(experiment: str, *, run_name: str | None = None,
              params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
              tracking_uri: str | None = None, run_id: str | None = None) -> Iterator[TrackedRun]:
    """Open an MLflow run in ``experiment``; ends it on exit with the status
    :func:`end_status` gives: ``FINISHED``, ``KILLED`` (interrupt, SIGTERM) or ``FAILED``.

    A new run is tagged with :func:`source_tags` (``paratune.version``, and the git commit
    where there is one); a resumed one keeps the tags it was created with. MLflow's
    process-wide tracking URI (and ``MLFLOW_TRACKING_URI``) point at the store only while the
    run is open: on exit they are what they were before, so a run's store does not leak into
    whatever runs next in the process.

    A store that cannot be reached costs a bounded wait (:data:`TRACKING_WAIT_S` per call,
    HTTP retries included), then the block runs untracked: when it cannot be reached to open
    the run, the handle's ``run_id`` is ``None``; when it goes away meanwhile, the calls
    after that do nothing (see :class:`TrackedRun`) and the run is ended ``FAILED`` (or
    ``KILLED``), tagged ``paratune.tracking_lost``, on exit or, if the store is still away
    then, by the next :func:`start_run` on that store (the run is remembered in
    :func:`unended_runs_file`). Other errors of the store are raised.

    Args:
        experiment: Experiment name (created if missing).
        run_name: Display name of the run.
        params: Parameters to log at the start.
        tags: Tags to set at the start.
        tracking_uri: Store to use; defaults to :func:`default_tracking_uri`.
        run_id: Resume this existing run instead of creating one.

    Yields:
        A :class:`TrackedRun`.
    """
    import mlflow

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # its retries against a server that is gone: the one warning of TrackedRun says it
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    from paratune._dburl import missing_driver, with_installed_driver

    # postgresql:// where only psycopg2 is installed (SQLAlchemy's default is psycopg 3)
    uri = with_installed_driver(tracking_uri or default_tracking_uri())
    with _tracking_uri_set(mlflow, uri), _bounded_waits():
        _end_unended_runs(mlflow, uri)
        try:
            # the first access creates the schema of a new store: one process at a time
            with _store_opening(uri):
                if run_id is None:
                    _ensure_experiment(mlflow, experiment, uri)
                    mlflow.set_experiment(experiment)
                    active = mlflow.start_run(run_name=run_name, tags=source_tags())
                else:
                    active = mlflow.start_run(run_id=run_id)
        except ImportError as exc:  # the store's database driver
            from paratune.errors import ConfigError

            raise ConfigError("tracking_uri", _shown(uri), f"needs {missing_driver(uri, exc)} "
                              "(or give --no-track)") from exc
        except Exception as exc:
            reason = unreachable(exc)
            if reason is None:
                raise
            logging.getLogger(__name__).warning(
                "MLflow tracking store %s cannot be reached (%s): this command runs untracked "
                "(its results and files are written as usual)", _shown(uri), reason)
            untracked = TrackedRun(mlflow, None, uri=uri)
            untracked.lost = reason
            yield untracked
            return
        tracked = TrackedRun(mlflow, active, uri=uri)
        error: BaseException | None = None
        try:
            if params:
                tracked.log_params(params)
            if tags:
                tracked.set_tags(tags)
            yield tracked
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end_run(mlflow, tracked, end_status(error))


TRACKING_WAIT_S = 10
"""Seconds one call to an HTTP tracking server may wait before it counts as gone: a
``MLFLOW_HTTP_REQUEST_TIMEOUT`` of 3 s and 2 retries, 1 s and 2 s apart (unless those
variables are set); after the first call that fails, a command makes no more."""

_BOUNDED_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}


@contextlib.contextmanager
def _bounded_waits() -> Iterator[None]:
    """MLflow's HTTP timeout and retries bounded (:data:`TRACKING_WAIT_S`) while the block
    runs, where the user has not set them: its defaults wait minutes for a server that is
    gone."""
    added = [name for name in _BOUNDED_HTTP if name not in os.environ]
    for name in added:
        os.environ[name] = _BOUNDED_HTTP[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


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
    from paratune._redact import redact

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
    from paratune._io import append_jsonl

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
    from paratune._io import atomic_write_text, read_jsonl

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


_URI_VARIABLE = "MLFLOW_TRACKING_URI"


@contextlib.contextmanager
def _tracking_uri_set(mlflow_module: Any, uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking URI at ``uri`` while the block runs, then put back
    what was there: the URI set before (``mlflow.set_tracking_uri``), if any, and the
    ``MLFLOW_TRACKING_URI`` environment variable (which ``set_tracking_uri`` also changes, for
    subprocesses), so that one run's store does not become the next one's default."""
    env = os.environ.get(_URI_VARIABLE)
    current = mlflow_module.get_tracking_uri()
    # set explicitly (not merely read from the environment): restore it as it was
    explicit = current if mlflow_module.is_tracking_uri_set() and current != env else None
    mlflow_module.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow_module.set_tracking_uri(explicit)  # None: back to the environment or default
        if env is None:
            os.environ.pop(_URI_VARIABLE, None)
        else:
            os.environ[_URI_VARIABLE] = env


def add_track_flag(parser: Any, help: str = "do not log to MLflow") -> None:
    """The ``--no-track`` flag of a ``paratune`` command, stored as ``no_track``;
    ``--no-mlflow`` (as in the ``experiments/`` scripts) is an alias."""
    parser.add_argument("--no-track", "--no-mlflow", dest="no_track", action="store_true",
                        help=f"{help} (--no-mlflow is an alias)")


def add_no_track_argument(parser: Any) -> None:
    """The ``--no-mlflow`` flag of an ``experiments/`` script (``--no-track`` as in every
    command), stored as ``no_mlflow``."""
    parser.add_argument("--no-mlflow", "--no-track", dest="no_mlflow", action="store_true",
                        help="do not log an MLflow run (--no-track is an alias)")


def start_script_run(script: str | Path, **kwargs: Any
                     ) -> contextlib.AbstractContextManager[TrackedRun]:
    """:func:`start_run` for an ``experiments/`` script: experiment :data:`EXPERIMENTS`, run
    name the script's file name without ``.py``.

    Args:
        script: The script's path (its ``__file__``).
        **kwargs: Passed to :func:`start_run` (``params``, ``tags``, ...).
    """
    return start_run(EXPERIMENTS, run_name=Path(script).stem, **kwargs)
