"""Searching a space against a predictor: exhaustively (vectorised) or with Optuna."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune._table import format_table
from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import Predictor, config_frame
from paratune.tuner._objective import Objective

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from paratune.tuner._space import SearchSpace

__all__ = ["SAMPLERS", "SearchResult", "evaluate", "exhaustive", "make_sampler",
           "open_study", "optuna_search"]

logger = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random", "gp", "qmc", "nsga2")
"""Optuna samplers selectable by name (``tpe`` is multivariate, grouped TPE)."""

_CONFIG_ATTR = "config"
_PROBLEM_ATTR = "problem"  # the space and objective a study searches
_REASON_ATTR = "pruned_reason"


@dataclass
class SearchResult:
    """Ranked, scored configs from one search."""

    ranked: pd.DataFrame
    """One row per distinct config evaluated: config columns, predictions, scores, ``rank``
    (1 = best; feasible configs first, then by objective) and ``vs_best`` (objective as a
    fraction of the best's)."""
    space: SearchSpace
    objective: Objective
    mode: str
    """``"exhaustive"`` or the sampler's name."""
    num_trials: int = 0
    """Trials in the study (all workers, all sessions) or configs enumerated."""
    num_pruned: int = 0
    """Trials pruned because the sampled config broke a rule."""
    wall_time_s: float = 0.0
    """Seconds this call spent searching."""
    study_name: str | None = None
    storage: str | None = None
    skipped: list[tuple[ParallelConfig, str]] = field(default_factory=list)
    """Configs left out of an exhaustive search, with the rule each breaks."""
    risk_aware: bool = False
    """Whether ``ranked`` is by the risk-aware expectation (see
    :func:`paratune.tuner.risk_aware_ranking`), as where the model extrapolates."""
    storage_lost: str | None = None
    """Why the study's storage stopped recording mid-search (``None`` where it did not): the
    ranking then covers the configs this search evaluated, and the study holds only the
    trials told before."""

    @property
    def best(self) -> ParallelConfig:
        """The top-ranked config."""
        if self.ranked.empty:
            raise ConfigError("space", self.space.model.name, "no config was evaluated")
        return config_from_row(self.ranked.iloc[0])

    @property
    def best_row(self) -> pd.Series:
        return self.ranked.iloc[0]

    @property
    def best_feasible(self) -> bool:
        return bool(not self.ranked.empty and self.ranked.iloc[0]["feasible"])

    def top(self, k: int = 10) -> pd.DataFrame:
        return self.ranked.head(k)

    def configs(self, k: int | None = None) -> list[ParallelConfig]:
        frame = self.ranked if k is None else self.ranked.head(k)
        return [config_from_row(row) for _, row in frame.iterrows()]

    def ranked_quantity(self) -> tuple[str, str]:
        """What the ranking maximises: a short column label and a description.

        ``ranked_tokens_per_s`` is the predicted throughput itself, its lower quantile
        (``risk_quantile``) or, where the predictor gives one, the throughput of the expected
        step time (a pipeline likely to stall counted at its stalled speed); under the goodput
        objective it is multiplied by the statistical efficiency.
        """
        risk = self.objective.risk_quantile
        if self.risk_aware:
            label, words = "risk tok/s", ("the risk-aware expectation (geometric mean of the "
                                          "expected tokens/s and its q10: the model "
                                          "extrapolates)")
        elif risk:
            label, words = f"{risk} tok/s", f"the {risk} quantile of predicted tokens/s"
        elif self._expected_differs():
            label, words = "exp tok/s", "expected tokens/s (stall-weighted)"
        else:
            label, words = "tok/s", "predicted tokens/s"
        if self.objective.kind.value == "goodput":
            return "goodput", f"goodput = {label} x eff ({words} x statistical efficiency)"
        return label, words

    def _expected_differs(self) -> bool:
        """Whether the ranked throughput differs from the predicted one anywhere."""
        import numpy as np

        if self.ranked.empty or "ranked_tokens_per_s" not in self.ranked.columns:
            return False
        ranked = self.ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
        plain = self.ranked["tokens_per_s"].to_numpy(dtype=float)
        return not bool(np.allclose(ranked, plain, rtol=1e-9, equal_nan=True))

    def table(self, k: int = 10) -> str:
        """The top ``k`` as a terminal table.

        Columns show what they hold: ``tok/s`` is the predicted throughput; where the
        ranking uses another throughput (a quantile, or the stall-weighted expected one) it
        is shown beside it; ``eff`` and ``goodput`` only under the goodput objective;
        ``vs_best`` (the ranked quantity as a share of rank 1's) only for configs predicted
        feasible, since the others rank below every feasible config whatever their value.
        """
        rows = []
        # the probability of a stalled pipeline, where the predictor learned that regime
        stall = ("pred_stall_prob" in self.ranked.columns
                 and bool((self.top(k)["pred_stall_prob"].fillna(0) > 0).any()))
        goodput = self.objective.kind.value == "goodput"
        label, words = self.ranked_quantity()
        ranked_label = ("risk tok/s" if self.risk_aware
                        else f"{self.objective.risk_quantile} tok/s"
                        if self.objective.risk_quantile
                        else "exp tok/s" if self._expected_differs() else None)
        infeasible = False
        for _, row in self.top(k).iterrows():
            feasible = bool(row["feasible"])
            infeasible |= not feasible
            rows.append({
                "rank": int(row["rank"]), "gbs": int(row["global_batch_size"]),
                "dp": int(row["dp"]), "tp": int(row["tp"]), "pp": int(row["pp"]),
                "mbs": int(row["micro_batch_size"]),
                "schedule": (row["schedule"] if row["pp"] > 1 else "-")
                + (f"/v{int(row['virtual_stages'])}" if row["virtual_stages"] > 1 else ""),
                "sharding": row["sharding"], "recompute": row["recompute"],
                "tok/s": float(row["tokens_per_s"]),
                **({ranked_label: float(row["ranked_tokens_per_s"])} if ranked_label else {}),
                "tok/s/gpu": float(row["tokens_per_s"]) / float(row["world_size"]),
                "step_s": float(row["step_time_s"]), "mem_gb": float(row["peak_mem_gb"]),
                "p_ok": float(row["feasible_prob"]),
                **({"p_stall": float(row["pred_stall_prob"])} if stall else {}),
                **({"eff": float(row["efficiency"]), "goodput": float(row["goodput"])}
                   if goodput else {}),
                "vs_best": f"{100 * float(row['vs_best']):.1f}%" if feasible else "-",
                "ok": "yes" if feasible else "NO",
            })
        model = self.space.model
        title = (f"{model.name} ({model.seq_len} tokens per sequence) on "
                 f"{self.space.world_size} x {self.space.hardware.name}: top {len(rows)} by "
                 f"{label} ({self.mode}, {self.num_trials} trials/configs)")
        notes = [f"ranked by {words}, feasible configs first; vs_best: {label} as a share "
                 "of the best feasible config's"]
        if infeasible:
            notes.append("ok NO: predicted not to run (probability of running below the "
                         "threshold, or memory over the limit); ranked after every feasible "
                         "config, no vs_best")
        if self.storage_lost is not None:
            notes.append(f"the study was not fully recorded ({self.storage_lost}): ranked "
                         f"here are the {len(self.ranked)} configs this search evaluated")
        return "\n".join([format_table(rows, title=title, floatfmt=".4g"), *notes])


def config_from_row(row: Any) -> ParallelConfig:
    """The :class:`ParallelConfig` of a config-frame (or ranked) row."""
    return ParallelConfig(
        dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]),
        micro_batch_size=int(row["micro_batch_size"]),
        global_batch_size=int(row["global_batch_size"]), schedule=str(row["schedule"]),
        virtual_stages=int(row["virtual_stages"]), sharding=str(row["sharding"]),
        recompute=str(row["recompute"]))


def evaluate(predictor: Predictor, space: SearchSpace, configs: Sequence[ParallelConfig],
             objective: Objective) -> pd.DataFrame:
    """Predict and score ``configs`` in one vectorised call.

    Returns:
        The config frame joined with the predictions and the objective's score columns,
        one row per config in the given order.
    """
    import pandas as pd

    frame = config_frame(space.model, configs, space.hardware,
                         devices_per_node=space.devices_per_node)
    if frame.empty:
        return frame
    preds = predictor.predict(frame)
    if len(preds) != len(frame):
        raise ConfigError("predictor", type(predictor).__name__,
                          f"returned {len(preds)} rows for {len(frame)} configs")
    scored = objective.score(frame, preds, space)
    extra = [c for c in scored.columns if c not in frame.columns]
    return pd.concat([frame.reset_index(drop=True), scored[extra]], axis=1)


def rank(scored: pd.DataFrame) -> pd.DataFrame:
    """Feasible first, then by objective (descending); adds ``rank`` and ``vs_best``."""
    if scored.empty:
        return scored.assign(rank=[], vs_best=[])
    ordered = scored.sort_values(["feasible", "objective"], ascending=[False, False],
                                 kind="stable").reset_index(drop=True)
    best = float(ordered["objective"].iloc[0])
    ordered["rank"] = range(1, len(ordered) + 1)
    ordered["vs_best"] = ordered["objective"] / best if best > 0 else math.nan
    return ordered


def exhaustive(predictor: Predictor, space: SearchSpace, objective: Objective, *,
               chunk_size: int = 50_000) -> SearchResult:
    """Enumerate the whole space and predict every config (vectorised, in chunks).

    Args:
        predictor: Anything with ``predict(config_frame)``.
        space: The space.
        objective: What to maximise.
        chunk_size: Configs per ``predict`` call (bounds memory on huge spaces).
    """
    import pandas as pd

    objective.check(space)
    start = time.perf_counter()
    enum = space.enumerate()
    parts = [evaluate(predictor, space, enum.valid[i:i + chunk_size], objective)
             for i in range(0, len(enum.valid), chunk_size)]
    scored = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return SearchResult(ranked=rank(scored), space=space, objective=objective,
                        mode="exhaustive", num_trials=len(enum.valid),
                        wall_time_s=time.perf_counter() - start, skipped=enum.skipped)


# ---------------------------------------------------------------------- Optuna
def make_sampler(name: str, *, seed: int | None) -> optuna.samplers.BaseSampler:
    """An Optuna sampler by name (see :data:`SAMPLERS`).

    Constraints reach the samplers that use them (TPE, GP, NSGA-II) through each trial's
    ``set_constraint`` values (predicted infeasibility and memory over the limit).
    """
    import optuna

    name = name.lower()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                              n_startup_trials=20)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed)
        if name == "qmc":
            return optuna.samplers.QMCSampler(seed=seed)
        if name in ("nsga2", "nsgaii"):
            return optuna.samplers.NSGAIISampler(seed=seed)
    raise ConfigError("sampler", name, f"must be one of {', '.join(SAMPLERS)}")


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
        from paratune._dburl import missing_driver, with_installed_driver

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
    and in the query, see :func:`paratune._redact.redact`)."""
    from paratune._redact import redact

    return redact(url)


def _masked(message: str, url: str) -> str:
    """A driver's ``message`` about ``url`` with the URL's password masked wherever it
    appears (in a URL or on its own)."""
    from paratune._redact import redact

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


def open_study(space: SearchSpace, objective: Objective, *, sampler: str = "tpe",
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
        sampler: A name in :data:`SAMPLERS`.
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
    first_sampler = make_sampler(sampler, seed=seed)  # an unknown one refused before any file
    store, where = resolve_storage(storage, storage_dir)
    name = study_name or default_study_name(space, objective, sampler, seed,
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
    if num_trials and seed is not None and sampler.lower() != "qmc":
        # QMC draws its sequence by trial count and needs the seed of its scramble
        study.sampler = make_sampler(sampler, seed=_session_seed(seed, num_trials))
    return study


def _finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


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


def optuna_search(predictor: Predictor, space: SearchSpace, objective: Objective, *,
                  n_trials: int = 200, sampler: str = "tpe", seed: int | None = 0,
                  storage: str | Path | None = None, study_name: str | None = None,
                  storage_dir: str | Path | None = None, batch_size: int = 8,
                  refine_fraction: float = 0.5, refine_beam: int = 4,
                  timeout_s: float | None = None, progress: bool = False
                  ) -> tuple[SearchResult, optuna.Study]:
    """Search ``space`` with an Optuna sampler until the study holds ``n_trials`` trials.

    ``n_trials`` counts the finished trials of the whole study, so several processes
    sharing one storage split the work, and rerunning after a kill runs only what is
    left. A sampled config that breaks a rule is a pruned trial with the rule as its
    ``pruned_reason``; a config seen before is scored from the cache.

    Args:
        predictor: Anything with ``predict(config_frame)``.
        space: The space.
        objective: What to maximise.
        n_trials: Finished trials the study should hold.
        sampler: A name in :data:`SAMPLERS`.
        seed: Sampler seed (a fixed seed reproduces a single-process search).
        storage: Optuna storage URL or journal path; see :func:`resolve_storage`.
        study_name: Defaults to a name derived from the problem (so reruns resume).
        storage_dir: Where the default journal goes; ``None`` with no ``storage`` keeps
            the study in memory.
        batch_size: Trials asked (and predicted in one call) at a time.
        refine_fraction: Share of the trials, at the end, spent on a local search: first
            every layout with the knobs that need the least memory (see
            :meth:`SearchSpace.probes`), then the neighbours (one parameter changed, see
            :meth:`SearchSpace.neighbours`) of the best feasible config of each of the
            ``refine_beam`` best layouts, taken in turn and re-centred whenever the leaders
            change; at a local optimum the sampler takes over again. This guards against a
            model-based sampler settling in one region when the optimum is a lone config in
            a layout it seldom drew with the right knobs.
        refine_beam: How many of the best configs the local search starts from.
        timeout_s: Stop asking after this many seconds.
        progress: Show a progress bar on stderr (finished trials of the study, the best
            feasible objective so far, time left).

    Returns:
        The ranked result over every config in the study, and the study.
    """
    from optuna.trial import TrialState

    objective.check(space)
    if n_trials < 1:
        raise ConfigError("n_trials", n_trials, "must be a positive integer")
    if batch_size < 1:
        raise ConfigError("batch_size", batch_size, "must be a positive integer")
    if not 0.0 <= refine_fraction <= 1.0:
        raise ConfigError("refine_fraction", refine_fraction, "must be in [0, 1]")
    start = time.perf_counter()
    study = open_study(space, objective, sampler=sampler, seed=seed, storage=storage,
                       study_name=study_name, storage_dir=storage_dir,
                       predictor_fingerprint=predictor_identity(predictor))
    where = storage_text(storage, storage_dir)
    cache: dict[ParallelConfig, tuple[float, tuple[float, float]]] = {}
    params_of: dict[ParallelConfig, dict[str, Any]] = {}
    worker = f"{socket.gethostname()}:{os.getpid()}"
    try:  # what killed workers left running is failed first, whatever is left to do
        _absorb(_finished(study), cache, params_of)
        _fail_stale(study, study.get_trials(deepcopy=False), worker)
        done = len(_finished(study))
    except Exception as exc:
        _storage_error(exc, where, 0)
        raise
    refine_from = round(n_trials * (1.0 - refine_fraction))
    bar = _trial_bar(n_trials, done, study.study_name) if progress else None
    inflight: dict[int, Any] = {}  # asked, not yet told: failed if this process stops
    scored = _Scored()
    tally = {"done": done}
    heartbeat = _Heartbeat(study, inflight)
    lost: tuple[str, BaseException] | None = None
    try:
        heartbeat.start()
        _search_loop(study, predictor, space, objective, cache=cache, scored=scored,
                     params_of=params_of, worker=worker, refine_from=refine_from,
                     refine_beam=refine_beam, n_trials=n_trials, batch_size=batch_size,
                     timeout_s=timeout_s, start=start, tally=tally, bar=bar,
                     inflight=inflight)
        finished = _finished(study)
    except Exception as exc:
        reason = _storage_failure(exc)
        if reason is None:
            raise
        if not cache:  # nothing evaluated: nothing to rank
            _storage_error(exc, where, tally["done"])
            raise
        lost, finished = (reason, exc), []
    finally:
        heartbeat.stop()
        _fail_inflight(study, inflight)
        if bar is not None:
            bar.close()
    if lost is None:
        configs = list(dict.fromkeys(ParallelConfig.from_dict(t.user_attrs[_CONFIG_ATTR])
                                     for t in finished if t.state is TrialState.COMPLETE))
    else:  # every config evaluated: this worker's (told or not) and those read from others
        configs = list(cache)
    result = SearchResult(
        ranked=rank(scored.frame(predictor, space, objective, configs)), space=space,
        objective=objective, mode=sampler,
        num_trials=len(finished) if lost is None else tally["done"],
        num_pruned=sum(t.state is TrialState.PRUNED for t in finished),
        wall_time_s=time.perf_counter() - start, study_name=study.study_name,
        storage=where, storage_lost=None if lost is None else _masked(lost[0], where or ""))
    if lost is not None:
        raise StudyNotRecorded(where, done=tally["done"], reason=result.storage_lost,
                               result=result) from lost[1]
    return result, study


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
            f"stopped answering after {done} finished trials ({reason}): the study holds only "
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
    from paratune._progress import progress_bar

    return progress_bar(total=n_trials, initial=min(done, n_trials), unit="trial", desc="tuning",
                        enabled=True,
                        postfix=f"resumed {study_name} at {done} trials" if done else "")


def _search_loop(study: optuna.Study, predictor: Predictor, space: SearchSpace,
                 objective: Objective, *,
                 cache: dict[ParallelConfig, tuple[float, tuple[float, float]]],
                 scored: _Scored, params_of: dict[ParallelConfig, dict[str, Any]],
                 worker: str, refine_from: int, refine_beam: int, n_trials: int,
                 batch_size: int, timeout_s: float | None, start: float,
                 tally: dict[str, int], bar: Any, inflight: dict[int, Any]) -> None:
    """Ask, predict and tell batches of trials until the study holds ``n_trials`` finished
    ones (or ``timeout_s`` passes); ``tally["done"]`` follows the finished count (what a
    storage that stops answering leaves is known).

    ``n_trials`` holds for the whole study under concurrency: a batch asks only for what is
    left once the trials other workers are running are counted, and a trial that still
    finds ``n_trials`` trials ahead of it (finished or running; another worker asked at the
    same moment) is failed, marked ``over_budget``, not told. Configs other workers have
    finished meanwhile join the cache (scored from it, not predicted again), and trials of
    workers that died are failed (see :func:`_fail_stale`). ``inflight`` holds this
    worker's asked trials until they are told."""
    from optuna.trial import TrialState

    pending: list[tuple[ParallelConfig, dict[str, Any]]] = []
    queued: set[ParallelConfig] = set()
    centre: list[ParallelConfig] | None = None
    probes: list[tuple[ParallelConfig, dict[str, Any]]] | None = None
    probed: dict[ParallelConfig, dict[str, Any]] = {}
    while True:
        trials = study.get_trials(deepcopy=False)
        _absorb(trials, cache, params_of)
        done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        tally["done"] = done
        if done >= n_trials:
            break
        if timeout_s is not None and time.perf_counter() - start > timeout_s:
            break
        others = sum(t.state is TrialState.RUNNING and t.number not in inflight for t in trials)
        size = min(batch_size, n_trials - done - others)
        if size <= 0:  # the rest is being run by other workers: wait for them (or their end)
            _fail_stale(study, trials, worker)
            time.sleep(_WAIT_FOR_OTHERS_S)
            continue
        if done >= refine_from:
            if probes is None:
                # around the best feasible config, or, where none was found, the one nearest
                # to feasible: the probes (each layout with its least-memory knobs) are what
                # finds a feasible config where the sampler found none
                best = _leaders(cache, 1) or _least_violating(cache)
                probes = ([pair for pair in space.probes(params_of[best[0]])
                           if pair[0] not in cache] if best else [])
                probed = dict(probes)
            if not probes:
                leaders = _leaders(cache, refine_beam)
                if leaders and leaders != centre:
                    centre = leaders
                    # the leaders' neighbours in turn (one of each, then the next of each),
                    # so a runner-up layout's one-move improvement is not queued behind
                    # every neighbour of the best
                    lists = [space.neighbours(params_of[c]) for c in leaders]
                    pending = [pair for group in itertools.zip_longest(*lists)
                               for pair in group if pair is not None
                               and pair[0] not in cache and pair[0] not in queued]
            queue = probes or pending
            left = size
            while queue and left > 0:
                cfg, params = queue.pop(0)
                if cfg in cache or cfg in queued:
                    continue
                study.enqueue_trial(params, skip_if_exists=True)
                queued.add(cfg)
                left -= 1
        asked = _ask(study, size, worker, inflight, n_trials)
        drawn = [space.suggest(trial) for trial in asked]
        fresh = list(dict.fromkeys(cfg for cfg, _ in drawn
                                   if cfg is not None and cfg not in cache))
        if fresh:
            rows = evaluate(predictor, space, fresh, objective)
            scored.add(fresh, rows)
            for cfg, value, feasible, memory in zip(
                    fresh, rows["objective"].to_numpy(dtype=float),
                    rows["violation_feasible"].to_numpy(dtype=float),
                    rows["violation_memory"].to_numpy(dtype=float)):
                cache[cfg] = (float(value), (float(feasible), float(memory)))
        for trial, (cfg, reason) in zip(asked, drawn):
            if cfg is None:
                trial.set_user_attr(_REASON_ATTR, reason)
                study.tell(trial, state=TrialState.PRUNED)
                inflight.pop(trial.number, None)
                tally["done"] += 1
                continue
            value, violations = cache[cfg]
            params_of.setdefault(cfg, dict(trial.params))
            if cfg in probed and max(violations) > 0:
                # a probe that does not fit: the same config one sharding level up next
                up = space.more_sharding(probed.pop(cfg))
                if up is not None and up[0] not in cache and up[0] not in queued:
                    probes.append(up)
                    probed[up[0]] = up[1]
            trial.set_user_attr(_CONFIG_ATTR, cfg.to_dict())
            trial.set_constraint("feasible_prob", violations[0])
            trial.set_constraint("memory", violations[1])
            study.tell(trial, value)
            inflight.pop(trial.number, None)
            tally["done"] += 1
        now = len(_finished(study))
        if bar is not None:
            top = max((value for value, viol in cache.values() if max(viol) <= 0),
                      default=None)
            bar.set_postfix_str("best feasible " + (f"{top:.4g}" if top is not None
                                                    else "none yet"), refresh=False)
            bar.update(max(0, min(now, n_trials) - bar.n))
        tally["done"] = now


_WAIT_FOR_OTHERS_S = 0.5
"""How often a worker whose study's remaining trials are all run by others looks again."""
_OVER_BUDGET_ATTR = "over_budget"


def _ask(study: optuna.Study, size: int, worker: str, inflight: dict[int, Any],
         n_trials: int) -> list[Any]:
    """Ask ``size`` trials, each recorded as this ``worker``'s (and its heartbeat started);
    those beyond the study's ``n_trials`` (another worker asked at the same time) are failed
    as ``over_budget`` and left out."""
    import bisect

    from optuna.trial import TrialState

    asked = []
    with warnings.catch_warnings():
        # heartbeats are recorded here for ask-and-tell trials (see _Heartbeat)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
        for _ in range(size):
            trial = study.ask()
            inflight[trial.number] = trial
            trial.set_user_attr("worker", worker)
            _record_heartbeat(study, trial)
            asked.append(trial)
    ahead = sorted(t.number for t in study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))
    kept = []
    for trial in asked:
        if bisect.bisect_left(ahead, trial.number) >= n_trials:
            trial.set_user_attr(_OVER_BUDGET_ATTR, True)
            study.tell(trial, state=TrialState.FAIL)
            inflight.pop(trial.number, None)
        else:
            kept.append(trial)
    return kept


def _absorb(trials: Sequence[Any], cache: dict[ParallelConfig, tuple[float, tuple[float, float]]],
            params_of: dict[ParallelConfig, dict[str, Any]]) -> None:
    """Add the complete trials (this worker's or others') not yet in ``cache``."""
    from optuna.trial import TrialState

    for trial in trials:
        if trial.state is not TrialState.COMPLETE or _CONFIG_ATTR not in trial.user_attrs:
            continue
        cfg = ParallelConfig.from_dict(trial.user_attrs[_CONFIG_ATTR])
        if cfg not in cache:
            cache[cfg] = (float(trial.value), (trial.constraints.get("feasible_prob", 0.0),
                                               trial.constraints.get("memory", 0.0)))
            params_of.setdefault(cfg, dict(trial.params))


def _fail_stale(study: optuna.Study, trials: Sequence[Any], worker: str) -> None:
    """Fail the running trials of workers that are gone: on a database with heartbeats,
    those whose worker recorded none for :data:`HEARTBEAT_GRACE_S` (Optuna's
    ``fail_stale_trials``); on any storage, those of a worker process on this machine that
    no longer exists (a ``kill -9``)."""
    import optuna
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    host = worker.rsplit(":", 1)[0]
    for trial in trials:
        owner = str(trial.user_attrs.get("worker", ""))
        if trial.state is not TrialState.RUNNING or owner == worker or ":" not in owner:
            continue
        their_host, pid = owner.rsplit(":", 1)
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
