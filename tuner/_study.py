"""Optuna studies of a search: storages (journal files and databases), creating or joining
the study of a problem, and what a storage that stops recording means."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.tuner._objective import Objective
from paratune.tuner._samplers import make_sampler, sampler_name

if TYPE_CHECKING:
    import optuna

    from paratune.tuner._space import SearchSpace

__all__ = ["DB_CONNECT_TIMEOUT_S", "HEARTBEAT_GRACE_S", "HEARTBEAT_INTERVAL_S",
           "StudyNotRecorded", "default_study_name", "open_study", "predictor_identity",
           "resolve_storage", "storage_text"]

CONFIG_ATTR = "config"
"""The user attribute of a complete trial that holds its config."""
_PROBLEM_ATTR = "problem"  # the space and objective a study searches


def resolve_storage(storage: str | Path | None, default_dir: str | Path | None
                    ) -> tuple[Any, str | None]:
    """An Optuna storage from a URL or a path.

    ``None`` means a journal file ``study.journal`` in ``default_dir`` (or in-memory when
    that is ``None`` too); a string with ``://`` is an RDB URL (``sqlite:///x.db``,
    ``postgresql://...``); any other string is a journal file path (safe for several
    processes on one machine or a shared file system).

    Returns:
        The storage object (or URL) and a printable description.
    """
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if storage is None and default_dir is None:
        return None, None
    if storage is None:
        Path(default_dir).mkdir(parents=True, exist_ok=True)
        storage = Path(default_dir) / "study.journal"
    text = str(storage)
    if "://" in text:
        from paratune.dburl import missing_driver, with_installed_driver

        url = with_installed_driver(text)  # postgresql:// where only psycopg2 is installed
        try:
            return _rdb_storage(url), _without_password(text)
        except ImportError as exc:  # a driver that is not installed (psycopg2, pymysql)
            said = str(exc.__cause__ or exc).replace(url, text).splitlines()  # as given
            raise ConfigError("storage", _without_password(text),
                              f"needs {missing_driver(url, exc)}"
                              + (f": {_masked(said[0], text)}" if said else "")) from exc
        except Exception as exc:  # SQLAlchemy: unknown dialect, unreachable server
            from paratune.tracking import unreachable

            first = _masked(str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                            text)
            if (down := unreachable(exc)) is not None:
                raise ConfigError("storage", _without_password(text),
                                  f"cannot be reached ({_masked(down, text)}): start the "
                                  "database server, or give another --storage") from exc
            raise ConfigError("storage", _without_password(text),
                              f"is not a usable database URL ({first}); "
                              "give sqlite:///FILE.db, another SQLAlchemy URL, or a "
                              "journal file path") from exc
    journal = Path(text)
    if journal.exists() and not journal.is_file():  # /dev/null, a directory, a FIFO
        raise ConfigError("storage", text, "is not a regular file: give a journal file path "
                          "(created if absent) or a database URL such as sqlite:///study.db")
    journal.parent.mkdir(parents=True, exist_ok=True)
    # the absolute path: the journal's lock is a symbolic link to the journal, and a relative
    # target would resolve from the link's own folder (nowhere): a lock left by a killed
    # process could then never be found stale, and the next run would wait forever
    return JournalStorage(JournalFileBackend(str(Path(text).resolve()))), text


DB_CONNECT_TIMEOUT_S = 10
"""Seconds a connection to a study's database server may take before it counts as down."""
HEARTBEAT_INTERVAL_S = 10
"""How often a worker records that its trials in a database study are still running."""
HEARTBEAT_GRACE_S = 60
"""A running trial whose worker recorded no heartbeat for this long is failed by the next
worker (its worker was killed)."""


def _rdb_storage(url: str, *, attempts: int = 5) -> Any:
    """Optuna's ``RDBStorage`` of ``url``. Workers that open a new database at once each
    create its tables; the ones that lose that race (a duplicate-key or already-exists
    error of the database) open it again once the winner has created them."""
    import optuna

    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, **_rdb_options(url))
        except Exception as exc:
            text = str(exc).lower()
            racing = "duplicate key" in text or "already exists" in text or (
                type(exc).__name__ == "IntegrityError")
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")  # the loop returns or raises


def _rdb_options(url: str) -> dict[str, Any]:
    """Keyword arguments of Optuna's ``RDBStorage`` for ``url``: heartbeats (a killed
    worker's trials are failed by the next worker), and a bounded connection wait."""
    options: dict[str, Any] = {"heartbeat_interval": HEARTBEAT_INTERVAL_S,
                               "grace_period": HEARTBEAT_GRACE_S}
    if url.lower().startswith(("postgresql", "postgres", "mysql")):
        options["engine_kwargs"] = {"connect_args": {"connect_timeout": DB_CONNECT_TIMEOUT_S},
                                    "pool_pre_ping": True}
    return options


def storage_text(storage: str | Path | None, storage_dir: str | Path | None) -> str | None:
    """Where :func:`resolve_storage` puts a study, as it may be printed and logged (a
    database password masked); ``None`` for a study in memory."""
    if storage is None and storage_dir is None:
        return None
    text = str(storage if storage is not None else Path(storage_dir) / "study.journal")
    return _without_password(text) if "://" in text else text


def _without_password(url: str) -> str:
    """A database URL as it may be printed and logged: any password masked (in the userinfo
    and in the query, see :func:`paratune.redact.redact`)."""
    from paratune.redact import redact

    return redact(url)


def _masked(message: str, url: str) -> str:
    """A driver's ``message`` about ``url`` with the URL's password masked wherever it
    appears (in a URL or on its own)."""
    from paratune.redact import redact

    if password := _password_of(url):
        message = message.replace(password, "***")
    return redact(message)


def _password_of(url: str) -> str | None:
    """The password in a database URL, if it has one (to mask it in driver messages)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).password or None
    except Exception:  # not a URL SQLAlchemy parses
        return None


def predictor_identity(predictor: Any) -> str | None:
    """What makes a predictor's values its own, for a study to record: the training data's
    fingerprint, the estimator's class and parameters and the paratune version (a refit on
    the same data with other trees, or after an upgrade, values configs differently);
    ``None`` for a predictor without a training fingerprint."""
    fingerprint = getattr(predictor, "fingerprint_", None)
    if fingerprint is None:
        return None
    from paratune import __version__

    params = predictor.get_params() if hasattr(predictor, "get_params") else {}
    key = json.dumps({"fingerprint": fingerprint, "class": type(predictor).__name__,
                      "params": params, "version": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def default_study_name(space: SearchSpace, objective: Objective, sampler: str,
                       seed: int | None, predictor_fingerprint: str | None = None) -> str:
    """Same problem, same name: rerunning a command resumes its study, and a predictor
    refitted (another ``predictor_fingerprint``, see :func:`predictor_identity`) starts a new
    one."""
    problem = {"space": space.to_dict(), "objective": objective.to_dict(),
               "sampler": sampler, "seed": seed}
    if predictor_fingerprint is not None:
        problem["predictor_fingerprint"] = predictor_fingerprint
    key = json.dumps(problem, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return (f"{space.model.name}-{space.world_size}x{space.hardware.name}-"
            f"{objective.kind.value}-{digest}")


def _plain_json(value: Any) -> Any:
    """``value`` as a storage returns it (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _differences(stored: Any, current: Any, prefix: str = "") -> list[str]:
    """``name: stored -> current`` for every leaf where two JSON values differ."""
    if isinstance(stored, dict) and isinstance(current, dict):
        out: list[str] = []
        for key in sorted(set(stored) | set(current)):
            out += _differences(stored.get(key), current.get(key),
                                f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if stored == current else [f"{prefix}: {stored!r} -> {current!r}"]


def _session_seed(seed: int | None, num_trials: int) -> int | None:
    """The sampler seed of a session that opens a study already holding ``num_trials`` trials.

    A fresh study takes ``seed`` itself (a fixed seed reproduces a single-process search);
    a resumed one a seed derived from ``seed`` and its trial count, so that it does not
    replay the draws of the session it resumes (every seeded sampler but QMC would draw the
    same configurations again, and they would count as trials)."""
    if seed is None or num_trials == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{num_trials}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def open_study(space: SearchSpace, objective: Objective, *, sampler: Any = "tpe",
               seed: int | None = 0, storage: str | Path | None = None,
               study_name: str | None = None, storage_dir: str | Path | None = None,
               predictor_fingerprint: str | None = None) -> optuna.Study:
    """Create or load (resume) the study for this problem.

    The study records the space and objective it searches (and the training-data
    fingerprint of the predictor, where given); a study of another problem under the same
    name is refused rather than joined, since its trials' configs and values belong to that
    problem. A resumed study's sampler is seeded from ``seed`` and the trials already there
    (see :func:`_session_seed`).

    Args:
        space: The space searched.
        objective: The objective.
        sampler: A name in :data:`SAMPLERS`, or an Optuna sampler (used as given, not
            reseeded on resume).
        seed: Sampler seed.
        storage: Optuna storage URL or journal path; see :func:`resolve_storage`.
        study_name: Defaults to :func:`default_study_name`.
        storage_dir: Where the default journal goes.
        predictor_fingerprint: What identifies the predictor whose values the trials hold
            (:func:`predictor_identity`); ``None`` records and checks nothing.

    Raises:
        ConfigError: ``study_name`` names a study of another space, objective or predictor
            in this storage.
    """
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _quiet_fallback_notice()
    first_sampler = make_sampler(sampler, seed=seed)  # an unknown one refused before any file
    store, where = resolve_storage(storage, storage_dir)
    named = sampler if isinstance(sampler, str) else sampler_name(sampler)
    name = study_name or default_study_name(space, objective, named, seed,
                                            predictor_fingerprint)
    study = optuna.create_study(
        storage=store, study_name=name, direction="maximize", load_if_exists=True,
        sampler=first_sampler)
    problem = _plain_json({"space": space.to_dict(), "objective": objective.to_dict()})
    attrs = study.user_attrs
    # One attribute, written in one storage operation: a process that joins the study
    # while its creator is still recording it sees all of the problem or none of it.
    stored = attrs.get(_PROBLEM_ATTR)
    if stored is None and "space" in attrs and "objective" in attrs:  # earlier versions' two
        stored = {"space": attrs["space"], "objective": attrs["objective"]}
    if stored is None:
        study.set_user_attr(_PROBLEM_ATTR, problem)
    else:
        changed = _differences(stored, problem)
        if changed:
            shown = "; ".join(changed[:4]) + ("; ..." if len(changed) > 4 else "")
            raise ConfigError("study_name", name,
                              f"names a study of another problem in {where} ({shown}); its "
                              "trials would be mixed with this search's: give another "
                              "study_name or storage")
    if predictor_fingerprint is not None:
        known = attrs.get("predictor_fingerprint")
        if known is not None and known != predictor_fingerprint and _finished(study):
            raise ConfigError("study_name", name,
                              f"holds trials valued by another predictor (identity "
                              f"{str(known)[:16]}, this one's {predictor_fingerprint[:16]}) "
                              f"in {where}; resuming it would rank stale values: give "
                              "another study_name or storage")
        if known != predictor_fingerprint:
            study.set_user_attr("predictor_fingerprint", predictor_fingerprint)
    num_trials = len(study.get_trials(deepcopy=False, states=tuple(TrialState)))
    if (num_trials and seed is not None and isinstance(sampler, str)
            and sampler.lower() != "qmc"):
        # QMC draws its sequence by trial count and needs the seed of its scramble
        study.sampler = make_sampler(sampler, seed=_session_seed(seed, num_trials))
    return study


def _is_not_fallback_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Caught an error from sqlalchemy")


def _quiet_fallback_notice() -> None:
    """Leave out Optuna's "Caught an error from sqlalchemy ... Falling back to a slower
    alternative": its database storage says so whenever a read of the trials fails, a lost
    connection included, and then reads them another way. Either that way answers (nothing
    is lost) or it fails too, and the search ends with its own one-line error that names the
    storage and what to do; the notice was ten lines of SQL ahead of it."""
    logger = logging.getLogger("optuna.storages._rdb.storage")
    if _is_not_fallback_notice not in logger.filters:
        logger.addFilter(_is_not_fallback_notice)


def _finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


class StudyNotRecorded(ConfigError):
    """The study's storage stopped recording mid-search (a database server stopped, a journal
    or SQLite file that can no longer be written), after the search had evaluated configs.

    Args:
        where: The storage, as it may be printed (see :func:`storage_text`).
        done: Finished trials of the study when it stopped answering.
        reason: Why, in one line.
        result: What the search still produced: a :class:`SearchResult` ranking every config
            it evaluated (from :func:`optuna_search`), or the
            :class:`~paratune.tuner.TuneResult` whose files were written (from
            :func:`~paratune.tuner.tune`).
        kept: What was made of the evaluated configs, in words.
    """

    def __init__(self, where: str | None, *, done: int, reason: str | None, result: Any,
                 kept: str = "the configs this search evaluated are still ranked") -> None:
        self.where, self.done, self.reason, self.result = where, done, reason, result
        super().__init__("storage", where, (
            f"stopped answering after {done} finished trials: {reason}; the study holds only "
            f"the trials told before and was not fully recorded; {kept}; "
            f"{_resume_hint(where)} and rerun the same command to resume"))


def _resume_hint(where: str | None) -> str:
    """What to do before rerunning where the storage ``where`` stopped recording."""
    text = str(where or "")
    if text.lower().startswith("sqlite"):
        return "make the database file writable again (or give another storage)"
    if "://" in text:
        return "start the database again"
    return "make the journal file writable again (or give another storage)"


def _storage_failure(exc: BaseException) -> str | None:
    """Why ``exc``, raised inside Optuna's storage code, says the study's storage stopped
    recording, in one line: a database that cannot be reached, an error of the database
    (Optuna's ``StorageInternalError``: a read-only or vanished SQLite file too), or a file
    error (a journal file that can no longer be written); ``None`` for any other error."""
    import optuna

    from paratune.tracking import unreachable

    if not _raised_in_storage(exc):  # the predictor's own errors are its own
        return None
    reason = unreachable(exc)
    if reason is not None:
        return reason
    if isinstance(exc, optuna.exceptions.StorageInternalError):
        cause = exc.__cause__ or exc.__context__ or exc
        return next((line.strip() for line in str(cause).splitlines() if line.strip()),
                    type(cause).__name__)[:200]
    if isinstance(exc, OSError):
        said = exc.strerror or type(exc).__name__
        return f"{said}: {exc.filename}" if exc.filename else said
    return None


def _raised_in_storage(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside Optuna's storage code."""
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("optuna.storages"):
            return True
        tb = tb.tb_next
    return False


def _storage_error(exc: BaseException, where: str | None, done: int) -> None:
    """Raise a one-line :class:`ConfigError` where ``exc`` says the study's storage stopped
    answering (else return, and the caller re-raises ``exc``)."""
    reason = _storage_failure(exc)
    if reason is None:
        return
    raise ConfigError("storage", where, f"stopped answering after {done} finished trials "
                      f"({_masked(reason, where or '')}): the trials told are kept in the "
                      f"study; {_resume_hint(where)} and rerun the same command to resume"
                      ) from exc
