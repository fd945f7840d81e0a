"""MLflow tracking: the only module that imports mlflow.

The run's handle and the recognition of a store gone away are in ``_tracking_run.py``; the
ending of runs left open by a store gone away in ``_tracking_unended.py`` (both are passed
the ``mlflow`` module this one imports).

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
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from paratune._tracking_run import TrackedRun, _shown, end_status, unreachable
from paratune._tracking_unended import _end_run, _end_unended_runs, unended_runs_file

__all__ = ["EXPERIMENTS", "TRACKING_WAIT_S", "TrackedRun", "add_no_track_argument",
           "add_track_flag", "artifact_root", "default_tracking_uri", "end_status", "run_note",
           "source_tags", "start_run", "start_script_run", "ui_command", "unended_runs_file",
           "unreachable"]

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
    from paratune.fileio import exclusive_lock

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
    from paratune.redact import redact

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
    from paratune.dburl import missing_driver, with_installed_driver

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
