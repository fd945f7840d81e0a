"""The Optuna search: ask, predict and tell batches of trials, a local search around the
leaders at the end, and workers sharing one study (a study-wide trial budget, heartbeats,
failing what stopped or killed workers left running)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.parallel import ParallelConfig
from paratune.predictor import Predictor
from paratune.tuner._objective import Objective
from paratune.tuner._ranking import SearchResult, evaluate, rank
from paratune.tuner._requests import SearchOptions
from paratune.tuner._samplers import sampler_name
from paratune.tuner._study import (
    CONFIG_ATTR,
    StudyNotRecorded,
    _finished,
    _masked,
    _storage_error,
    _storage_failure,
    open_study,
    predictor_identity,
    storage_text,
)
from paratune.tuner._workers import (
    _WAIT_FOR_OTHERS_S,
    _absorb,
    _ask,
    _fail_inflight,
    _fail_stale,
    _Heartbeat,
)

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from paratune.tuner._space import SearchSpace

__all__ = ["optuna_search"]

logger = logging.getLogger(__name__)

_REASON_ATTR = "pruned_reason"


def _leaders(cache: dict[ParallelConfig, tuple[float, tuple[float, float]]], k: int
             ) -> list[ParallelConfig]:
    """The best feasible config of each of the ``k`` best layouts (dp, tp, pp), best first.

    One leader per layout keeps the local search from spending its whole budget around a
    single region when the runner-up region holds the optimum.
    """
    feasible = sorted(((value, cfg.key(), cfg) for cfg, (value, viol) in cache.items()
                       if max(viol) <= 0), key=lambda item: (-item[0], item[1]))
    leaders: dict[tuple[int, int, int], ParallelConfig] = {}
    for _, _, cfg in feasible:
        leaders.setdefault((cfg.dp, cfg.tp, cfg.pp), cfg)
        if len(leaders) == k:
            break
    return list(leaders.values())


def _least_violating(cache: dict[ParallelConfig, tuple[float, tuple[float, float]]]
                     ) -> list[ParallelConfig]:
    """The config whose worst constraint is broken the least (an empty list for an empty
    cache)."""
    if not cache:
        return []
    return [min(cache, key=lambda cfg: (max(cache[cfg][1]), cfg.key()))]


def optuna_search(predictor: Predictor, space: SearchSpace, objective: Objective,
                  options: SearchOptions | None = None, *,
                  storage_dir: str | Path | None = None, progress: bool = False,
                  study: optuna.Study | None = None) -> tuple[SearchResult, optuna.Study]:
    """Search ``space`` with an Optuna sampler until the study holds ``n_trials`` trials.

    ``n_trials`` counts the finished trials of the whole study, so several processes
    sharing one storage split the work, and rerunning after a kill runs only what is
    left. A sampled config that breaks a rule is a pruned trial with the rule as its
    ``pruned_reason``; a config seen before (by this worker or another) is scored from
    what was told, not predicted again, and each config is predicted once.

    ``options`` (:class:`SearchOptions`) gives the trial budget (``n_trials``, asked and
    predicted ``batch_size`` at a time, until ``timeout_s``), the ``sampler`` (a name in
    :data:`SAMPLERS` or an Optuna sampler) and its ``seed`` (a fixed seed reproduces a
    single-process search), the ``storage`` and ``study_name`` (see :func:`resolve_storage`;
    the default name is derived from the problem, so reruns resume) and the local search:
    the last ``refine_fraction`` of the trials go first to every layout with the knobs that
    need the least memory (:meth:`SearchSpace.probes`), then to the neighbours (one
    parameter changed, :meth:`SearchSpace.neighbours`) of the best feasible config of each
    of the ``refine_beam`` best layouts, taken in turn and re-centred whenever the leaders
    change; at a local optimum the sampler takes over again. This guards against a
    model-based sampler settling in one region when the optimum is a lone config in a
    layout it seldom drew with the right knobs.

    Args:
        predictor: Anything with ``predict(config_frame)``.
        space: The space.
        objective: What to maximise.
        options: How to search (default: :class:`SearchOptions`' defaults).
        storage_dir: Where the default journal goes; ``None`` with no ``storage`` keeps
            the study in memory.
        progress: Show a progress bar on stderr (finished trials of the study, the best
            feasible objective so far, time left).
        study: The study, where the caller opened it already (:func:`open_study` with the
            same arguments); else it is opened here.

    Returns:
        The ranked result over every config in the study, and the study.

    Raises:
        StudyNotRecorded: the storage stopped recording after configs were evaluated; its
            ``result`` ranks them.
    """
    objective.check(space)
    options = options if options is not None else SearchOptions()
    if options.search != "optuna":  # its trial counts are checked as an Optuna search's
        options = dataclasses.replace(options, search="optuna")
    n_trials = options.n_trials
    start = time.perf_counter()
    if study is None:
        study = open_study(space, objective, sampler=options.sampler, seed=options.seed,
                           storage=options.storage, study_name=options.study_name,
                           storage_dir=storage_dir,
                           predictor_fingerprint=predictor_identity(predictor))
    where = storage_text(options.storage, storage_dir)
    worker = _Worker(study, predictor, space, objective, n_trials=n_trials,
                     batch_size=options.batch_size, timeout_s=options.timeout_s, start=start)
    worker.local = _LocalSearch(
        space, refine_from=round(n_trials * (1.0 - options.refine_fraction)),
        beam=options.refine_beam)
    try:  # what killed workers left running is failed first, whatever is left to do
        worker.begin()
    except Exception as exc:
        _storage_error(exc, where, 0)
        raise
    bar = _trial_bar(n_trials, worker.done, study.study_name) if progress else None
    finished, lost = worker.run(bar, where)
    result = SearchResult(
        ranked=rank(worker.scored.frame(predictor, space, objective, worker.ranked(finished))),
        space=space, objective=objective, mode=sampler_name(options.sampler),
        num_trials=len(finished) if lost is None else worker.done,
        num_pruned=sum(t.state.name == "PRUNED" for t in finished),
        wall_time_s=time.perf_counter() - start, study_name=study.study_name,
        storage=where, storage_lost=None if lost is None else _masked(lost[0], where or ""))
    if lost is not None:
        raise StudyNotRecorded(where, done=worker.done, reason=result.storage_lost,
                               result=result) from lost[1]
    return result, study


class _LocalSearch:
    """The local search of the end of a search (see ``refine_fraction`` of
    :func:`optuna_search`): the probes around the best config, then the neighbours of the
    leaders, queued as trials for the sampler to replay."""

    def __init__(self, space: SearchSpace, *, refine_from: int, beam: int) -> None:
        self.space, self.refine_from, self.beam = space, refine_from, beam
        self.pending: list[tuple[ParallelConfig, dict[str, Any]]] = []
        self.queued: set[ParallelConfig] = set()
        self.centre: list[ParallelConfig] | None = None
        self.probes: list[tuple[ParallelConfig, dict[str, Any]]] | None = None
        self.probed: dict[ParallelConfig, dict[str, Any]] = {}

    def enqueue(self, study: optuna.Study, worker: _Worker, size: int) -> None:
        """Queue up to ``size`` configs none has evaluated, once ``refine_from`` trials
        are done."""
        if worker.done < self.refine_from:
            return
        cache, params_of = worker.cache, worker.params_of
        if self.probes is None:
            # around the best feasible config, or, where none was found, the one nearest
            # to feasible: the probes (each layout with its least-memory knobs) are what
            # finds a feasible config where the sampler found none
            best = _leaders(cache, 1) or _least_violating(cache)
            self.probes = ([pair for pair in self.space.probes(params_of[best[0]])
                            if pair[0] not in cache] if best else [])
            self.probed = dict(self.probes)
        if not self.probes:
            leaders = _leaders(cache, self.beam)
            if leaders and leaders != self.centre:
                self.centre = leaders
                # the leaders' neighbours in turn (one of each, then the next of each), so
                # a runner-up layout's one-move improvement is not queued behind every
                # neighbour of the best
                lists = [self.space.neighbours(params_of[c]) for c in leaders]
                self.pending = [pair for group in itertools.zip_longest(*lists)
                                for pair in group if pair is not None
                                and pair[0] not in cache and pair[0] not in self.queued]
        queue = self.probes or self.pending
        while queue and size > 0:
            cfg, params = queue.pop(0)
            if cfg in cache or cfg in self.queued:
                continue
            study.enqueue_trial(params, skip_if_exists=True)
            self.queued.add(cfg)
            size -= 1

    def told(self, cfg: ParallelConfig, violations: tuple[float, float],
             cache: dict[ParallelConfig, Any]) -> None:
        """A probe that does not fit: the same config one sharding level up next."""
        if cfg not in self.probed or max(violations) <= 0:
            return
        up = self.space.more_sharding(self.probed.pop(cfg))
        if up is not None and up[0] not in cache and up[0] not in self.queued:
            self.probes.append(up)
            self.probed[up[0]] = up[1]


class _Worker:
    """One process's part of a search of a (possibly shared) study: the configs evaluated
    (``cache``: objective and constraint violations; ``scored``: the predicted rows), the
    trials asked and not yet told (``inflight``, failed if it stops) and the study's
    finished count (``done``, known when the storage stops answering)."""

    def __init__(self, study: optuna.Study, predictor: Predictor, space: SearchSpace,
                 objective: Objective, *, n_trials: int, batch_size: int,
                 timeout_s: float | None, start: float) -> None:
        self.study, self.predictor, self.space, self.objective = (study, predictor, space,
                                                                  objective)
        self.n_trials, self.batch_size, self.timeout_s, self.start = (n_trials, batch_size,
                                                                      timeout_s, start)
        self.cache: dict[ParallelConfig, tuple[float, tuple[float, float]]] = {}
        self.params_of: dict[ParallelConfig, dict[str, Any]] = {}
        self.scored = _Scored()
        self.inflight: dict[int, Any] = {}
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.done = 0
        self.local: _LocalSearch | None = None

    def begin(self) -> None:
        """Read what the study holds and fail what killed workers left running."""
        _absorb(_finished(self.study), self.cache, self.params_of)
        _fail_stale(self.study, self.study.get_trials(deepcopy=False), self.name)
        self.done = len(_finished(self.study))

    def run(self, bar: Any, where: str | None
            ) -> tuple[list[Any], tuple[str, BaseException] | None]:
        """Search until the study holds ``n_trials``; returns the study's finished trials
        and, where its storage stopped recording, why (the finished trials are then
        unknown: empty)."""
        heartbeat = _Heartbeat(self.study, self.inflight)
        try:
            heartbeat.start()
            while self._step(bar):
                pass
            return _finished(self.study), None
        except Exception as exc:
            reason = _storage_failure(exc)
            if reason is None:
                raise
            if not self.cache:  # nothing evaluated: nothing to rank
                _storage_error(exc, where, self.done)
                raise
            return [], (reason, exc)
        finally:
            heartbeat.stop()
            _fail_inflight(self.study, self.inflight)
            if bar is not None:
                bar.close()

    def ranked(self, finished: list[Any]) -> list[ParallelConfig]:
        """The configs to rank: the study's complete ones, in its order; where the storage
        stopped recording, every config evaluated (told or not, and read from others)."""
        if not finished:
            return list(self.cache)
        return list(dict.fromkeys(ParallelConfig.from_dict(t.user_attrs[CONFIG_ATTR])
                                  for t in finished if t.state.name == "COMPLETE"))

    def _step(self, bar: Any) -> bool:
        """One batch: ask, predict what no one evaluated, tell. ``False`` once the study
        holds ``n_trials`` finished trials or ``timeout_s`` passed.

        ``n_trials`` holds for the whole study under concurrency: a batch asks only for
        what is left once the trials other workers are running are counted, and a trial
        that still finds ``n_trials`` trials ahead of it is failed, marked
        ``over_budget``, not told (see :func:`_ask`). Configs other workers have finished
        meanwhile join the cache, and trials of workers that died are failed (see
        :func:`_fail_stale`)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        _absorb(trials, self.cache, self.params_of)
        self.done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        if self.done >= self.n_trials:
            return False
        if self.timeout_s is not None and time.perf_counter() - self.start > self.timeout_s:
            return False
        others = sum(t.state is TrialState.RUNNING and t.number not in self.inflight
                     for t in trials)
        size = min(self.batch_size, self.n_trials - self.done - others)
        if size <= 0:  # the rest is being run by other workers: wait for them (or their end)
            _fail_stale(self.study, trials, self.name)
            time.sleep(_WAIT_FOR_OTHERS_S)
            return True
        if self.local is not None:
            self.local.enqueue(self.study, self, size)
        asked = _ask(self.study, size, self.name, self.inflight, self.n_trials)
        drawn = [self.space.suggest(trial) for trial in asked]
        self._predict(list(dict.fromkeys(cfg for cfg, _ in drawn
                                         if cfg is not None and cfg not in self.cache)))
        for trial, (cfg, reason) in zip(asked, drawn):
            self._tell(trial, cfg, reason)
        now = len(_finished(self.study))
        if bar is not None:
            top = max((value for value, viol in self.cache.values() if max(viol) <= 0),
                      default=None)
            bar.set_postfix_str("best feasible " + (f"{top:.4g}" if top is not None
                                                    else "none yet"), refresh=False)
            bar.update(max(0, min(now, self.n_trials) - bar.n))
        self.done = now
        return True

    def _predict(self, fresh: list[ParallelConfig]) -> None:
        if not fresh:
            return
        rows = evaluate(self.predictor, self.space, fresh, self.objective)
        self.scored.add(fresh, rows)
        for cfg, value, feasible, memory in zip(
                fresh, rows["objective"].to_numpy(dtype=float),
                rows["violation_feasible"].to_numpy(dtype=float),
                rows["violation_memory"].to_numpy(dtype=float)):
            self.cache[cfg] = (float(value), (float(feasible), float(memory)))

    def _tell(self, trial: Any, cfg: ParallelConfig | None, reason: str | None) -> None:
        from optuna.trial import TrialState

        if cfg is None:
            trial.set_user_attr(_REASON_ATTR, reason)
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            value, violations = self.cache[cfg]
            self.params_of.setdefault(cfg, dict(trial.params))
            if self.local is not None:
                self.local.told(cfg, violations, self.cache)
            trial.set_user_attr(CONFIG_ATTR, cfg.to_dict())
            trial.set_constraint("feasible_prob", violations[0])
            trial.set_constraint("memory", violations[1])
            self.study.tell(trial, value)
        self.inflight.pop(trial.number, None)
        self.done += 1


class _Scored:
    """The scored rows of the configs a search predicted, so that each is predicted once:
    in the search, and at the end only those other workers evaluated."""

    def __init__(self) -> None:
        self.frames: list[pd.DataFrame] = []
        self.where: dict[ParallelConfig, tuple[int, int]] = {}

    def __contains__(self, cfg: ParallelConfig) -> bool:
        return cfg in self.where

    def add(self, configs: Sequence[ParallelConfig], frame: pd.DataFrame) -> None:
        """``frame``: :func:`evaluate` of ``configs`` (one row each, in order)."""
        index = len(self.frames)
        self.frames.append(frame)
        for row, cfg in enumerate(configs):
            self.where.setdefault(cfg, (index, row))

    def frame(self, predictor: Predictor, space: SearchSpace, objective: Objective,
              configs: Sequence[ParallelConfig]) -> pd.DataFrame:
        """The scored rows of ``configs`` in order, predicting those not seen yet."""
        import pandas as pd

        missing = list(dict.fromkeys(c for c in configs if c not in self))
        if missing:
            self.add(missing, evaluate(predictor, space, missing, objective))
        if not configs:
            return pd.DataFrame()
        offsets = list(itertools.accumulate((len(f) for f in self.frames), initial=0))
        rows = [offsets[k] + i for k, i in (self.where[c] for c in configs)]
        return pd.concat(self.frames, ignore_index=True).iloc[rows].reset_index(drop=True)


def _trial_bar(n_trials: int, done: int, study_name: str) -> Any:
    """A progress bar of the study's finished trials (as ``paratune profile`` shows configs)."""
    from paratune.progress import progress_bar

    return progress_bar(total=n_trials, initial=min(done, n_trials), unit="trial", desc="tuning",
                        enabled=True,
                        postfix=f"resumed {study_name} at {done} trials" if done else "")
