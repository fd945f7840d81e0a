"""``tune``: the library function behind ``paratune tune``.

One call answers "this model on N devices of this kind: how should I run it?": it binds the
space to the job, searches it against a fitted predictor (Optuna or exhaustive), ranks what
it found, writes the winner with launch settings, and records the run in MLflow. It takes
three requests (:class:`TuneJob`, :class:`SearchOptions`, :class:`OutputOptions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec
from paratune.predictor import Predictor
from paratune.spec import ModelSpec
from paratune.tuner._export import recommendation, write_recommendation
from paratune.tuner._objective import Objective, ObjectiveKind
from paratune.tuner._requests import SEARCH_MODES, OutputOptions, SearchOptions, TuneJob
from paratune.tuner._search import SearchResult, StudyNotRecorded, exhaustive, optuna_search
from paratune.tuner._space import SearchSpace
from paratune.tuner._tune_inputs import (
    _plain,
    default_global_batch,
    extrapolation_warnings,
    goodput_global_batches,
    load_predictor,
    predictor_params,
    resolve_gns,
)

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from paratune.parallel import ParallelConfig
    from paratune.tuner._verify import ClusterVerification

__all__ = ["SEARCH_MODES", "TuneResult", "default_global_batch", "extrapolation_warnings",
           "goodput_global_batches", "load_predictor", "predictor_params", "requests_from",
           "resolve_gns", "tune"]

logger = logging.getLogger(__name__)


@dataclass
class TuneResult:
    """What :func:`tune` found and where it wrote it."""

    search: SearchResult
    """Ranked configs and search statistics."""
    recommendation: dict[str, Any]
    """The winner: config, predictions and launch settings (see ``recommendation.json``)."""
    outputs: dict[str, Path] = field(default_factory=dict)
    """Files written (``json``, ``yaml``, ``torchrun``, ``torchtitan``, ``megatron``)."""
    run_id: str | None = None
    """MLflow run id (``None`` when tracking was off)."""
    study: optuna.Study | None = None
    """The Optuna study (``None`` for an exhaustive search)."""
    verification: pd.DataFrame | None = None
    """Predicted vs measured for verified configs (``tune(verify=K)``)."""
    cluster_verification: ClusterVerification | None = None
    """The verification on the target cluster: its configs, commands and, once measured,
    results (``tune(verify=K)`` where it does not measure here)."""

    @property
    def best(self) -> ParallelConfig:
        return self.search.best

    @property
    def ranked(self) -> pd.DataFrame:
        return self.search.ranked

    def table(self, k: int = 10) -> str:
        return self.search.table(k)


def requests_from(model: ModelSpec | str, gpus: int, gpu: HardwareSpec | str,
                  predictor: Predictor | str | Path | None = None, **keywords: Any
                  ) -> tuple[TuneJob, SearchOptions, OutputOptions, Any]:
    """The requests of the keyword spelling ``tune(model, gpus, gpu, predictor, **kw)``:
    each keyword is a field of :class:`TuneJob`, :class:`SearchOptions` or
    :class:`OutputOptions` (``search`` names :attr:`SearchOptions.search`).

    Raises:
        TypeError: a keyword that is no request's field.
    """
    job = {"model": model, "gpus": gpus, "hardware": gpu}
    parts: dict[type, dict[str, Any]] = {TuneJob: job, SearchOptions: {}, OutputOptions: {}}
    for name, value in keywords.items():
        owner = next((cls for cls in parts
                      if name in {f.name for f in dataclasses.fields(cls)}), None)
        if owner is None:
            raise TypeError(f"tune() got an unexpected keyword argument {name!r}")
        parts[owner][name] = value
    # the job first, as the checks ran before: its devices, then the search's options
    return (TuneJob(**job), SearchOptions(**parts[SearchOptions]),
            OutputOptions(**parts[OutputOptions]), predictor)


def tune(job: TuneJob | ModelSpec | str, *args: Any, search: SearchOptions | None = None,
         output: OutputOptions | None = None, predictor: Predictor | str | Path | None = None,
         **keywords: Any) -> TuneResult:
    """Find how to run a model on a number of devices of one kind.

    ``tune(TuneJob(...), search=SearchOptions(...), output=OutputOptions(...),
    predictor=...)``; the keyword spelling ``tune(model, gpus, gpu, predictor, **fields)``
    (see :func:`requests_from`) builds the same requests.

    Args:
        job: The job (model, devices, space, batches, what fits).
        search: What to maximise and how to search (default :class:`SearchOptions`).
        output: What to write, show and track (default :class:`OutputOptions`).
        predictor: A fitted predictor or the directory of a saved one.

    Where neither the job's ``global_batch_sizes`` nor its space gives the batches, the
    batch is :func:`default_global_batch`, or for ``goodput`` with a ``gns`` the range of
    :func:`goodput_global_batches`. ``search.verify`` configs of the ranking are verified
    for real and the model refitted: here (:func:`paratune.tuner.verify_top_k`) or on the
    cluster (:func:`paratune.tuner.verify_on_cluster`); ``search.risk_aware`` ``None`` ranks
    by the risk-aware expectation where the search asks the model beyond its training data
    (:func:`extrapolation_warnings`, or a ranked config the model predicts beyond its fitted
    ranges: a larger model too) and no ``risk_quantile`` is given.

    Returns:
        A :class:`TuneResult`.

    Raises:
        StudyNotRecorded: the study's storage stopped recording mid-search; the configs
            evaluated were ranked and the recommendation written first (``on_ranked`` was
            called, the MLflow run ends ``FAILED``, no verification ran), and the exception's
            ``result`` is the :class:`TuneResult`.
        ConfigError: a bad argument (the message names it and the rule), e.g. ``gpus``
            that is not a positive integer.
    """
    if not isinstance(job, TuneJob):
        if output is not None or not (search is None or isinstance(search, str)):
            raise TypeError("tune(model, gpus, gpu, ...) takes its options as keywords; "
                            "give a TuneJob to pass requests")
        if search is not None:  # the keyword spelling's search mode
            keywords["search"] = search
        if predictor is not None:
            keywords["predictor"] = predictor
        job, search, output, predictor = requests_from(job, *args, **keywords)
    elif args or keywords or not (search is None or isinstance(search, SearchOptions)):
        raise TypeError("tune(job, ...) takes its options as search= and output= requests "
                        "(SearchOptions, OutputOptions)")
    search = search if search is not None else SearchOptions()
    output = output if output is not None else OutputOptions()
    if predictor is None:
        raise ConfigError("predictor", None, "a fitted predictor or the directory of a saved "
                          "one is needed")
    problem = _Problem.build(job, search, output)
    journal = None  # a journal file this call creates: removed if it is refused unused
    out_dir = output.path
    if search.search != "exhaustive":
        storage = search.storage
        candidate = (Path(storage) if storage is not None and "://" not in str(storage)
                     else out_dir / "study.journal" if storage is None and out_dir is not None
                     else None)
        journal = candidate if candidate is not None and not candidate.exists() else None
    new_output = out_dir is not None and not out_dir.exists()
    try:
        return _run(problem, predictor)
    except StudyNotRecorded:  # its files are written: nothing to remove
        raise
    except ConfigError:
        _remove_unused(journal, out_dir if new_output else None)
        raise


@dataclass
class _Problem:
    """A tuning's requests resolved: the space searched, the objective, where ``verify``
    measures."""

    job: TuneJob
    search: SearchOptions
    output: OutputOptions
    spec: ModelSpec
    space: SearchSpace
    objective: Objective
    verify_where: str = "here"

    @classmethod
    def build(cls, job: TuneJob, search: SearchOptions, output: OutputOptions) -> _Problem:
        """Resolve and check everything that can be checked before a run or a study opens."""
        spec = job.spec()
        hw = job.device()
        b_noise = resolve_gns(search.gns, seq_len=spec.seq_len,
                              trajectory_seq_len=search.trajectory_seq_len,
                              num_params=spec.num_params)
        if b_noise is not None and search.objective != "goodput":
            logger.warning("the gradient noise scale (--gns) weighs nothing under the %s "
                           "objective: it ranks one batch's configs by tokens/s; "
                           "--objective goodput trades them against the batch's statistical "
                           "efficiency", search.objective)
        if search.b0 is not None and search.objective != "goodput":
            logger.warning("the reference batch (--b0) weighs nothing under the %s "
                           "objective: it is the statistical efficiency's, which only "
                           "--objective goodput counts", search.objective)
        options = job.config_space()
        batches = job.global_batch_sizes
        if batches is None and not (options is not None and options.global_batch_sizes_given):
            # goodput trades throughput against statistical efficiency over the batch:
            # search a range around B_noise; otherwise one batch of about 2**20 tokens
            batches = (goodput_global_batches(spec, job.gpus, b_noise)
                       if search.objective == "goodput" and b_noise is not None
                       else default_global_batch(spec, job.gpus))
        space = SearchSpace.build(spec, job.gpus, hw, space=options,
                                  global_batch_sizes=batches,
                                  devices_per_node=job.devices_per_node,
                                  framework=job.framework)
        where = _verify_where(search, space, output)
        kind = (ObjectiveKind(search.objective)
                if search.objective in ("throughput", "goodput") else search.objective)
        objective = Objective(kind=kind, b_noise=b_noise, b0=search.b0,
                              risk_quantile=search.risk_quantile,
                              min_feasible_prob=job.min_feasible_prob,
                              memory_limit_gb=job.memory_limit_gb)
        objective.check(space)
        return cls(job, search, output, spec, space, objective, where)


def _verify_where(search: SearchOptions, space: SearchSpace, output: OutputOptions) -> str:
    """Where ``search.verify`` configs are measured, refused before the search where it
    cannot run (it would write its files, then fail)."""
    if not search.verify:
        return "here"
    if space.framework:
        raise ConfigError("framework", space.framework,
                          "cannot be verified with --verify, whose runs are paratune's own "
                          "trainer; measure a few of the framework's runs and calibrate "
                          "with them instead (paratune calibrate RUNS.csv --model MODEL_DIR, "
                          "the runs in the public CSV format with a source naming the "
                          "framework)")
    from paratune.tuner._verify import check_verify_here, verify_location

    where = verify_location(space, search.verify_on)
    if where == "here":
        check_verify_here(space, search.verify)
    elif output.output_dir is None and not (search.verify_options is not None
                                            and search.verify_options.out_dir):
        raise ConfigError("verify", search.verify, "verifying on the cluster needs an output "
                          "directory (the campaigns and their commands go there)")
    return where


def _remove_unused(journal: Path | None, output: Path | None) -> None:
    """After a refusal: remove the journal file the call created where it holds no finished
    trial, then the output directory it created where nothing else is in it."""
    if journal is not None and journal.is_file():
        from optuna.storages.journal import JournalFileBackend, JournalStorage
        from optuna.trial import TrialState

        try:
            store = JournalStorage(JournalFileBackend(str(journal.resolve())))
            finished = [t for study in store.get_all_studies() for t in store.get_all_trials(
                study._study_id, deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))]
        except Exception:  # not a journal Optuna reads: not ours to remove
            return
        if finished:
            return
        journal.unlink(missing_ok=True)
    if output is not None and output.is_dir() and not any(output.iterdir()):
        output.rmdir()


def _run(problem: _Problem, predictor: Predictor | str | Path) -> TuneResult:
    """The body of :func:`tune` once its requests are checked."""
    from paratune.tuner._tune_run import log_outcome, open_run

    search, output = problem.search, problem.output
    with contextlib.ExitStack() as stack:
        pred = load_predictor(predictor)  # a predictor that does not load opens no run
        beyond = extrapolation_warnings(pred, problem.space)
        for message in beyond:
            logger.warning(message)
        study = _open_study(problem, pred)  # once: the run's params and the search share it
        run = None
        if output.track:  # opened before the work, so a failure or an interrupt leaves it
            run = open_run(stack, problem.space, problem.objective,
                           predictor_params(predictor, pred), search=search, output=output,
                           study=study, tracking_uri=output.tracking_uri)
        result, study, lost = _search(problem, pred, study)
        _rerank(problem, result, risk_aware=search.risk_aware, beyond=bool(beyond))
        out = _write(problem, result, study)
        if run is not None:
            log_outcome(run, out, problem.space, problem.objective, top_k=output.top_k)
            # a store that went away is reported by the run itself; no run to open then
            out.run_id = run.run_id if run.lost is None else None
        if output.on_ranked is not None:
            output.on_ranked(out)
        if lost is not None:  # the files are written; the run ends FAILED, verification waits
            files = ", ".join(str(p) for p in out.outputs.values())
            kept = (f"the {len(result.ranked)} configs this search evaluated are ranked"
                    + (f" and its recommendation written ({files})" if files else ""))
            raise StudyNotRecorded(lost.where, done=lost.done, reason=lost.reason, result=out,
                                   kept=kept) from lost
        _verify(problem, out)
        if run is not None and out.verification is not None:
            run.log_table(out.verification, "verification.csv")
    return out


def _open_study(problem: _Problem, predictor: Predictor) -> optuna.Study | None:
    """The Optuna study of the problem (``None`` for an exhaustive search)."""
    if problem.search.search == "exhaustive":
        return None
    from paratune.tuner._study import open_study, predictor_identity

    search = problem.search
    return open_study(problem.space, problem.objective, sampler=search.sampler,
                      seed=search.seed, storage=search.storage, study_name=search.study_name,
                      storage_dir=problem.output.output_dir,
                      predictor_fingerprint=predictor_identity(predictor))


def _search(problem: _Problem, predictor: Predictor, study: optuna.Study | None
            ) -> tuple[SearchResult, optuna.Study | None, StudyNotRecorded | None]:
    """Search; a storage that stopped recording leaves the ranking of what was evaluated
    (and no study to read)."""
    search = problem.search
    if study is None:
        result = exhaustive(predictor, problem.space, problem.objective)
    else:
        try:
            result, study = optuna_search(
                predictor, problem.space, problem.objective, search,
                storage_dir=problem.output.output_dir, progress=problem.output.progress,
                study=study)
        except StudyNotRecorded as exc:  # finish the work with what was evaluated
            return exc.result, None, exc
    if result.ranked.empty:
        raise ConfigError("space", problem.space.model.name,
                          "the search evaluated no valid config (every sample broke a rule)")
    return result, study, None


def _extrapolates(ranked: pd.DataFrame) -> bool:
    """Whether the model predicts any ranked config beyond the ranges it was fitted on
    (a larger model, more devices, more tokens per step, groups over more nodes, another
    data-parallel regime: ``pred_extrapolation_doublings``)."""
    column = "pred_extrapolation_doublings"
    return column in ranked.columns and bool((ranked[column].fillna(0.0) > 0).any())


def _rerank(problem: _Problem, result: SearchResult, *, risk_aware: bool | None,
            beyond: bool) -> None:
    if risk_aware is None:
        risk_aware = ((beyond or _extrapolates(result.ranked))
                      and problem.search.risk_quantile is None)
    if risk_aware:
        from paratune.models import RISK_AWARE_WITHIN
        from paratune.tuner._verify import risk_aware_ranking

        reranked = risk_aware_ranking(result.ranked)
        if reranked is not result.ranked:
            result.ranked, result.risk_aware = reranked, True
            then = ("calibrate it with a few of the framework's runs (paratune calibrate)"
                    if problem.space.framework else
                    "verify a few on the cluster (--verify K) and refit")
            logger.warning("the performance model extrapolates here: configs are ranked "
                           "by the risk-aware expectation (the geometric mean of the "
                           "expected throughput and its 10th percentile, times the "
                           "probability of running, among the configs within %.0f%% of the "
                           "best expected); %s",
                           100 * RISK_AWARE_WITHIN, then)
    if not result.best_feasible:
        logger.warning("no evaluated config is predicted feasible; the top one is "
                       "predicted not to run (over the memory limit, under the minimum "
                       "probability of running, or its throughput could not be predicted)")


def _write(problem: _Problem, result: SearchResult, study: optuna.Study | None) -> TuneResult:
    """The recommendation of the winner, written where the output says."""
    best, top_k = result.best_row, problem.output.top_k
    # the point prediction, the throughput ranked by (expected, a quantile or risk-aware)
    # and, where risk-aware, the expected one it was moved from
    predicted = {k: _plain(best[k]) for k in (
        "tokens_per_s", "ranked_tokens_per_s", "expected_tokens_per_s", "step_time_s",
        "peak_mem_gb", "feasible_prob", "efficiency", "goodput", "goodput_expected",
        "objective", "feasible", "pred_stall_prob") if k in best}
    space = problem.space
    if space.framework:  # whose runs the figures are of
        predicted["framework"] = space.framework
    rec = recommendation(problem.spec, result.best, space.hardware,
                         devices_per_node=space.devices_per_node, predicted=predicted,
                         objective=problem.objective.to_dict())
    top = result.top(top_k)
    rec["top"] = [{**c.to_dict(), "objective": float(o), "vs_best": float(v)}
                  for c, o, v in zip(result.configs(top_k), top["objective"], top["vs_best"])]
    out_dir = problem.output.path
    outputs = (write_recommendation(rec, out_dir,
                                    allow_infeasible=problem.output.export_infeasible)
               if out_dir is not None else {})
    return TuneResult(search=result, recommendation=rec, outputs=outputs, study=study)


def _verify(problem: _Problem, out: TuneResult) -> None:
    verify, options = problem.search.verify, problem.search.verify_options
    if verify and problem.verify_where == "here":
        from paratune.tuner._verify import verify_top_k

        out.verification = verify_top_k(out, verify, options)
    elif verify:
        from paratune.tuner._verify import verify_on_cluster

        out.cluster_verification = verify_on_cluster(out, verify, options)
        out.verification = out.cluster_verification.verification
