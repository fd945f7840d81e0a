"""Workers sharing one study: asking within the study-wide trial budget, reading what
others finished, heartbeats of the trials in flight, and failing the trials of workers that
stopped or were killed."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from paratune.parallel import ParallelConfig
from paratune.tuner._study import CONFIG_ATTR, HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger("paratune.tuner._optuna")


_WAIT_FOR_OTHERS_S = 0.5
"""How often a worker whose study's remaining trials are all run by others looks again."""
_OVER_BUDGET_ATTR = "over_budget"


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (main thread, where Python's handlers
    run): a trial the storage has created is recorded as in flight before an interrupt can
    stop the worker, so the worker fails it as it exits rather than leaving it running.

    The handlers are swapped for one that notes the signal, and the noted signal goes to
    the handler that was there once the block ends. A signal mask would not do: it holds
    the signal for this thread only, and the kernel hands a process's signal to any thread
    that does not block it (the heartbeat's, a database driver's), whose note makes Python
    run the handler in the main thread at once, inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    if any(handler is None for handler in previous.values()):  # set outside Python: leave it
        yield
        return
    noted: list[int] = []
    for signum in previous:
        signal.signal(signum, lambda number, _frame: noted.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if noted:
            handler = previous[noted[0]]
            if callable(handler):
                handler(noted[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(noted[0])


def _ask(study: optuna.Study, size: int, worker: str, inflight: dict[int, Any],
         n_trials: int) -> list[Any]:
    """Ask ``size`` trials, each recorded as this ``worker``'s (and its heartbeat started);
    those beyond the study's ``n_trials`` (another worker asked at the same time, see
    :func:`_beyond_budget`) are failed as ``over_budget`` and left out."""
    from optuna.trial import TrialState

    asked = []
    with warnings.catch_warnings():
        # heartbeats are recorded here for ask-and-tell trials (see _Heartbeat)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
        for _ in range(size):
            with _interrupts_held():
                trial = study.ask()
                inflight[trial.number] = trial
            trial.set_user_attr("worker", worker)
            _record_heartbeat(study, trial)
            asked.append(trial)
    kept = []
    for trial, beyond in zip(asked, _beyond_budget(study, asked, n_trials), strict=True):
        if beyond:
            trial.set_user_attr(_OVER_BUDGET_ATTR, True)
            study.tell(trial, state=TrialState.FAIL)
            inflight.pop(trial.number, None)
        else:
            kept.append(trial)
    return kept


def _beyond_budget(study: optuna.Study, trials: Sequence[Any], n_trials: int) -> list[bool]:
    """Whether each of ``trials`` (just asked) finds ``n_trials`` trials ahead of it: those
    of a lower number that finished, run or wait. A waiting trial is one a worker enqueued
    (the local search's probes) and some worker's next ask will run; uncounted, a worker
    that asked past it while it waited and the worker that then asks it could each keep
    the study's last trial, and four workers asked for 40 finished 41."""
    import bisect

    from optuna.trial import TrialState

    ahead = sorted(t.number for t in study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING,
                                TrialState.WAITING)))
    return [bisect.bisect_left(ahead, trial.number) >= n_trials for trial in trials]


def _absorb(trials: Sequence[Any], cache: dict[ParallelConfig, tuple[float, tuple[float, float]]],
            params_of: dict[ParallelConfig, dict[str, Any]]) -> None:
    """Add the complete trials (this worker's or others') not yet in ``cache``."""
    from optuna.trial import TrialState

    for trial in trials:
        if trial.state is not TrialState.COMPLETE or CONFIG_ATTR not in trial.user_attrs:
            continue
        cfg = ParallelConfig.from_dict(trial.user_attrs[CONFIG_ATTR])
        if cfg not in cache:
            cache[cfg] = (float(trial.value), (trial.constraints.get("feasible_prob", 0.0),
                                               trial.constraints.get("memory", 0.0)))
            params_of.setdefault(cfg, dict(trial.params))


def _fail_stale(study: optuna.Study, trials: Sequence[Any], worker: str) -> None:
    """Fail the running trials of workers that are gone: on a database with heartbeats,
    those whose worker recorded none for :data:`HEARTBEAT_GRACE_S` (Optuna's
    ``fail_stale_trials``); on any storage, those of a worker process on this machine that
    no longer exists (a ``kill -9``), and those that name no worker though they started
    :data:`HEARTBEAT_GRACE_S` ago (their worker was killed between asking for the trial and
    recording itself, microseconds apart in a live one: no heartbeat would ever fail them)."""
    import datetime

    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    host = worker.rsplit(":", 1)[0]
    old = datetime.datetime.now() - datetime.timedelta(seconds=HEARTBEAT_GRACE_S)
    for trial in trials:
        owner = str(trial.user_attrs.get("worker", ""))
        if trial.state is not TrialState.RUNNING or owner == worker:
            continue
        if not owner:
            if trial.datetime_start is None or trial.datetime_start > old:
                continue
            pid = "unknown"
        else:
            their_host, _, pid = owner.rpartition(":")
            if their_host != host or not pid.isdigit() or _alive(int(pid)):
                continue
        try:
            study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker failed (or its worker told) it first
        else:
            logger.info("failed trial %d of %s: its worker (pid %s) is gone", trial.number,
                        study.study_name, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail_inflight(study: optuna.Study, inflight: dict[int, Any]) -> None:
    """Fail this worker's trials that were asked but not told (it is stopping: an error, an
    interrupt, SIGTERM), so that none stays running for ever; a storage that cannot be
    reached then leaves them to the next worker (see :func:`_fail_stale`)."""
    from optuna.trial import TrialState

    for number, trial in list(inflight.items()):
        try:
            study.tell(trial, state=TrialState.FAIL)
        except Exception as exc:  # the storage is gone (or the trial was failed meanwhile)
            logger.debug("could not fail trial %d: %s", number, exc)
        inflight.pop(number, None)


def _heartbeat_storage(study: optuna.Study) -> Any:
    from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

    storage = study._storage
    if isinstance(storage, BaseHeartbeat) and is_heartbeat_enabled(storage):
        return storage
    return None


def _record_heartbeat(study: optuna.Study, trial: Any) -> None:
    storage = _heartbeat_storage(study)
    if storage is not None:
        storage.record_heartbeat(trial._trial_id)


class _Heartbeat:
    """Records, every :data:`HEARTBEAT_INTERVAL_S`, that this worker's in-flight trials are
    still running (Optuna does so only inside ``Study.optimize``; the search asks and tells).
    Does nothing on a storage without heartbeats."""

    def __init__(self, study: optuna.Study, inflight: dict[int, Any]) -> None:
        import threading

        self.storage = _heartbeat_storage(study)
        self.inflight = inflight
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="paratune-heartbeat")

    def start(self) -> None:
        if self.storage is not None:
            self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(HEARTBEAT_INTERVAL_S):
            for trial in list(self.inflight.values()):
                try:
                    self.storage.record_heartbeat(trial._trial_id)
                except Exception as exc:  # the database is away: the main thread says so
                    logger.debug("heartbeat of trial %d failed: %s", trial.number, exc)

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
