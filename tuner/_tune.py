"""``tune``: the library function behind ``paratune tune``.

One call answers "this model on N devices of this kind: how should I run it?": it binds the
space to the job, searches it against a fitted predictor (Optuna or exhaustive), ranks what
it found, writes the winner with launch settings, and records the run in MLflow.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.predictor import Predictor
from paratune.space import ConfigSpace
from paratune.spec import ModelSpec, get_model
from paratune.tuner._export import recommendation, write_recommendation
from paratune.tuner._objective import Objective, ObjectiveKind
from paratune.tuner._search import (
    SearchResult,
    StudyNotRecorded,
    exhaustive,
    optuna_search,
    predictor_identity,
)
from paratune.tuner._space import SearchSpace, check_gpus

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from paratune.parallel import ParallelConfig
    from paratune.tuner._verify import ClusterVerification

__all__ = ["TuneResult", "default_global_batch", "load_predictor", "resolve_gns", "tune"]

logger = logging.getLogger(__name__)

SEARCH_MODES = ("optuna", "exhaustive")


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


def default_global_batch(model: ModelSpec, gpus: int) -> int:
    """A global batch for a job that does not name one: about 2**20 tokens (the order of
    published Llama-scale recipes), rounded to a power of two and at least one sequence per
    device.

    Raises:
        ConfigError: ``gpus`` is not a positive integer.
    """
    gpus = check_gpus(gpus)
    sequences = max(1, 2**20 // model.seq_len)
    sequences = 1 << round(math.log2(sequences))
    return max(sequences, 1 << math.ceil(math.log2(gpus)))


def goodput_global_batches(model: ModelSpec, gpus: int, b_noise: float) -> list[int]:
    """Global batch sizes for a goodput search that names none: the powers of two from a
    quarter of the smaller to four times the larger of :func:`default_global_batch` and
    ``B_noise`` (where statistical efficiency trades against throughput; ``B_noise`` counts
    as at most 2**10 default batches), at most 12.

    Raises:
        ConfigError: ``gpus`` is not a positive integer, or ``b_noise`` is not positive.
    """
    if not (math.isfinite(b_noise) and b_noise > 0):
        raise ConfigError("gns", b_noise, "must be a positive number of sequences")
    center = default_global_batch(model, gpus)
    low = max(1.0, min(center, b_noise) / 4)
    # a B_noise far beyond any batch a job runs (efficiency ~1 everywhere) does not send the
    # search to absurd batches: at most 2**10 times the default batch (~2**30 tokens)
    high = min(max(center, b_noise), center * 2**10) * 4
    batches = [1 << k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
    if len(batches) > 12:  # keep the 12 nearest B_noise (in log)
        batches = sorted(sorted(batches, key=lambda b: abs(math.log2(b / b_noise)))[:12])
    return batches


def extrapolation_warnings(predictor: Predictor, space: SearchSpace, *,
                           factor: float = 4.0) -> list[str]:
    """What a search asks of a performance model beyond the runs it was fitted on (by more
    than ``factor``): another device kind, more or fewer devices, larger or smaller steps
    in tokens. Its predictions there are extrapolations; empty where it interpolates or the
    predictor records no training ranges."""
    ranges = getattr(predictor, "training_ranges_", None)
    if not ranges:
        return []
    hardware = space.hardware.name
    if hardware not in ranges:
        return [f"the performance model has no measured runs on {hardware} (only "
                f"{', '.join(sorted(ranges))}): its predictions for {hardware} transfer from "
                "those devices"]
    seen = ranges[hardware]
    batches = space.global_batch_sizes
    asked = {"world_size": (space.world_size, space.world_size),
             "tokens_per_step": (min(batches) * space.model.seq_len,
                                 max(batches) * space.model.seq_len)}
    what = {"world_size": ("devices", "--gpus"),
            "tokens_per_step": ("tokens per step (global batch x sequence length)",
                                "--global-batch or --seq-len")}
    out = []
    for key, (low, high) in asked.items():
        if key not in seen:
            continue
        lo, hi = seen[key]
        if high > factor * hi or low * factor < lo:
            name, flags = what[key]
            shown = f"{low}" if low == high else f"{low} to {high}"
            out.append(f"this search asks for {shown} {name} on {hardware}; the performance "
                       f"model was fitted on {lo} to {hi}: its predictions there are "
                       f"extrapolations ({flags} to stay closer, or profile such runs and "
                       "refit)")
    return out


def load_predictor(predictor: Predictor | str | Path) -> Predictor:
    """A predictor object, or one loaded from a saved model directory."""
    if isinstance(predictor, (str, Path)):
        from paratune.models import load_model

        return load_model(predictor)
    if not hasattr(predictor, "predict"):
        raise ConfigError("predictor", type(predictor).__name__, "has no predict(frame) method")
    return predictor


def resolve_gns(gns: float | str | Path | None, *, seq_len: int,
                trajectory_seq_len: int | None = None,
                num_params: float | None = None) -> float | None:
    """``B_noise`` in sequences of the planned model, from a number or a trajectory file.

    A number is taken as already in sequences of ``seq_len`` tokens. A trajectory's
    ``b_simple`` is in sequences of the run that measured it; the noise scale is assumed to
    be a number of tokens, so it is converted as ``b_simple * seq_len_measured / seq_len``
    and then reduced to the single value that ranks fixed configs exactly as the whole run
    would (the progress-weighted harmonic mean, see
    :func:`paratune.tuner.effective_b_noise`).

    Args:
        gns: ``B_noise`` (number or numeric string), a trajectory file, or ``None``.
        seq_len: Tokens per sequence of the planned model.
        trajectory_seq_len: Tokens per sequence of the run that measured a trajectory file
            without a ``seq_len`` column.
        num_params: Parameters of the planned model, for a critical-batch law named as
            ``gns`` (``kaplan2020``, ``minicpm2024``, ``constant:TOKENS``): its ``B_noise``
            along the model's Chinchilla loss curve from 0.2B to 200B tokens, reduced like a
            trajectory's.

    Returns:
        ``B_noise`` in sequences of ``seq_len`` tokens, or ``None``.

    Raises:
        ConfigError: the trajectory is unreadable, or its measuring run's ``seq_len`` is
            neither in the file nor given.
    """
    if gns is None:
        return None
    if isinstance(gns, bool):  # an int to Python, not a noise scale
        raise ConfigError("gns", gns, "must be a number (B_noise) or a trajectory file")
    if isinstance(gns, (int, float)):
        return float(gns)
    if not isinstance(gns, Path):
        try:
            return float(gns)
        except ValueError:
            pass
    from paratune.tuner._plan import effective_b_noise
    from paratune.tuner.gns_trajectory import NOISE_LAWS

    text = str(gns).strip().lower()
    if not isinstance(gns, Path) and (text in NOISE_LAWS or text.startswith("constant:")):
        from paratune.tuner.gns_trajectory import chinchilla_loss_curve, law_trajectory

        if num_params is None:
            raise ConfigError("gns", gns, "a critical-batch law needs the model's parameter "
                              "count (num_params) for its Chinchilla loss curve")
        trajectory = law_trajectory(text, chinchilla_loss_curve(num_params), seq_len=seq_len)
        return effective_b_noise(trajectory, seq_len=seq_len)
    from paratune.tuner.gns_trajectory import load_trajectory

    trajectory = load_trajectory(gns, seq_len=trajectory_seq_len)
    return effective_b_noise(trajectory, seq_len=seq_len)


def tune(model: ModelSpec | str, gpus: int, gpu: HardwareSpec | str,
         predictor: Predictor | str | Path, *,
         objective: str = "throughput", gns: float | str | Path | None = None,
         b0: float | None = None, global_batch_sizes: Any = None,
         space: ConfigSpace | str | Path | None = None, devices_per_node: int | None = None,
         tp_within_node: bool | None = None, search: str = "optuna", n_trials: int = 200,
         sampler: str = "tpe", seed: int | None = 0, storage: str | Path | None = None,
         study_name: str | None = None, batch_size: int = 8,
         risk_quantile: str | None = None, min_feasible_prob: float = 0.5,
         memory_limit_gb: float | None = None, top_k: int = 10,
         output_dir: str | Path | None = None, track: bool = True,
         tracking_uri: str | None = None, verify: int = 0,
         verify_options: dict[str, Any] | None = None, verify_on: str = "auto",
         risk_aware: bool | None = None,
         trajectory_seq_len: int | None = None,
         on_ranked: Callable[[TuneResult], None] | None = None,
         progress: bool = False, export_infeasible: bool = False) -> TuneResult:
    """Find how to run ``model`` on ``gpus`` devices of kind ``gpu``.

    Args:
        model: A preset name, a ``config.json`` path or a :class:`ModelSpec`.
        gpus: Devices in the job.
        gpu: Device kind (catalogue name or :class:`HardwareSpec`).
        predictor: A fitted predictor or the directory of a saved one.
        objective: ``"throughput"`` (one global batch) or ``"goodput"`` (needs ``gns``).
        gns: Gradient noise scale ``B_noise`` in sequences of the model, or a trajectory
            file (its ``b_simple`` converted from the measuring run's sequences, see
            :func:`resolve_gns`).
        b0: Reference batch of the Pollux efficiency (default: smallest batch searched).
        global_batch_sizes: Batch list or range (``"256:2048"``); overrides the space's.
        space: A :class:`ConfigSpace` or a YAML/TOML/JSON file of one. Where neither
            ``global_batch_sizes`` nor the space gives the batches (no space, or one that
            leaves ``global_batch_sizes`` out) the batch is :func:`default_global_batch`, or
            for ``goodput`` with a ``gns`` the range of :func:`goodput_global_batches`.
        devices_per_node: Node size (default: the catalogue's).
        tp_within_node: Override the space's ``tp_within_node``.
        search: ``"optuna"`` or ``"exhaustive"``.
        n_trials: Finished trials the study should hold (Optuna).
        sampler: Optuna sampler name (``tpe``, ``random``, ``gp``, ``qmc``, ``nsga2``).
        seed: Sampler seed.
        storage: Optuna storage URL or journal file (default: ``study.journal`` in
            ``output_dir``; in memory without an ``output_dir``).
        study_name: Study to create or join (default derived from the problem).
        batch_size: Trials asked per predictor call.
        risk_quantile: Rank by this predicted quantile (e.g. ``"q10"``).
        min_feasible_prob: Feasibility threshold on the predicted probability of running.
        memory_limit_gb: Memory limit per device (default 95% of the device's).
        top_k: Configs kept in the recommendation and MLflow table.
        output_dir: Where the recommendation files (and default study) go.
        track: Record an MLflow run.
        tracking_uri: MLflow store (default: ``MLFLOW_TRACKING_URI`` or ``./mlflow.db``).
        verify: Verify this many configs of the ranking for real and refit: the first of
            :func:`paratune.tuner.verification_order` (different layouts before variants of
            one); ``0`` skips. Here they are profiled on this machine
            (:func:`paratune.tuner.verify_top_k`); on the cluster their campaigns are
            prepared with torchrun and SLURM commands, and a later call with the same
            output reads their results and refits
            (:func:`paratune.tuner.verify_on_cluster`).
        verify_options: Keyword arguments for either.
        verify_on: ``"here"``, ``"cluster"`` or ``"auto"`` (here where this machine has the
            job's hardware, else on the cluster).
        risk_aware: Rank by the risk-aware expectation
            (:func:`paratune.tuner.risk_aware_ranking`); ``None``: where the search asks the
            model beyond its training data (:func:`extrapolation_warnings`) and no
            ``risk_quantile`` is given.
        trajectory_seq_len: Tokens per sequence of the run that measured a ``gns``
            trajectory file without a ``seq_len`` column.
        on_ranked: Called with the result once the search is ranked, the recommendation
            written and the outcome logged, before any verification (to show the ranking
            while the top configs are profiled).
        progress: Show a progress bar of the Optuna trials on stderr.
        export_infeasible: Write the launch files of a winner predicted not to run too (each
            opening with a line saying so); by default such a winner gets only
            ``recommendation.json``/``.yaml`` (``launch.infeasible`` says why).

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
    gpus = check_gpus(gpus)
    spec = get_model(model) if isinstance(model, str) else model
    hw = get_hardware(gpu) if isinstance(gpu, str) else gpu
    b_noise = resolve_gns(gns, seq_len=spec.seq_len, trajectory_seq_len=trajectory_seq_len,
                          num_params=spec.num_params)
    if isinstance(space, (str, Path)):
        space = ConfigSpace.from_file(space)
    space = space or ConfigSpace()
    if global_batch_sizes is None and not space.global_batch_sizes_given:
        # goodput trades throughput against statistical efficiency over the batch: search a
        # range around B_noise; otherwise one batch of about 2**20 tokens
        global_batch_sizes = (goodput_global_batches(spec, gpus, b_noise)
                              if objective == "goodput" and b_noise is not None
                              else default_global_batch(spec, gpus))
    if tp_within_node is not None:
        space = space.replace(tp_within_node=tp_within_node)
    search_space = SearchSpace.build(spec, gpus, hw, space=space,
                                     global_batch_sizes=global_batch_sizes,
                                     devices_per_node=devices_per_node)
    if search not in SEARCH_MODES:
        raise ConfigError("search", search, f"must be one of {', '.join(SEARCH_MODES)}")
    # checked before a run or a study is opened (the search checks them again)
    for name, value in (("n_trials", n_trials), ("batch_size", batch_size)):
        if search != "exhaustive" and (isinstance(value, bool) or not isinstance(value, int)
                                       or value < 1):
            raise ConfigError(name, value, "must be a positive integer")
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ConfigError("verify", verify, "must be a number of configs >= 0")
    where = "here"
    if verify:  # refused before the search: it would write its files, then fail
        from paratune.tuner._verify import check_verify_here, verify_location

        where = verify_location(search_space, verify_on)
        if where == "here":
            check_verify_here(search_space, verify)
        elif output_dir is None and not (verify_options or {}).get("out_dir"):
            raise ConfigError("verify", verify, "verifying on the cluster needs an output "
                              "directory (the campaigns and their commands go there)")
    obj = Objective(kind=ObjectiveKind(objective) if objective in ("throughput", "goodput")
                    else objective, b_noise=b_noise, b0=b0, risk_quantile=risk_quantile,
                    min_feasible_prob=min_feasible_prob, memory_limit_gb=memory_limit_gb)
    obj.check(search_space)
    output = Path(output_dir) if output_dir is not None else None
    options = dict(search=search, sampler=sampler, seed=seed, n_trials=n_trials,
                   batch_size=batch_size, top_k=top_k, verify=verify)

    journal = None  # a journal file this call creates: removed if it is refused unused
    if search != "exhaustive":
        candidate = (Path(storage) if storage is not None and "://" not in str(storage)
                     else output / "study.journal" if storage is None and output is not None
                     else None)
        journal = candidate if candidate is not None and not candidate.exists() else None
    new_output = output is not None and not output.exists()
    try:
        return _tune(spec, hw, gpus, predictor, search_space, obj, options, b_noise=b_noise,
                     gns=gns, storage=storage, study_name=study_name, output=output,
                     track=track, tracking_uri=tracking_uri, verify_options=verify_options,
                     verify_where=where, risk_aware=risk_aware, risk_quantile=risk_quantile,
                     export_infeasible=export_infeasible, on_ranked=on_ranked,
                     progress=progress)
    except StudyNotRecorded:  # its files are written: nothing to remove
        raise
    except ConfigError:
        _remove_unused(journal, output if new_output else None)
        raise


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


def _tune(spec: ModelSpec, hw: HardwareSpec, gpus: int, predictor: Predictor | str | Path,
          search_space: SearchSpace, obj: Objective, options: dict[str, Any], *,
          b_noise: float | None, gns: Any, storage: str | Path | None, study_name: str | None,
          output: Path | None, track: bool, tracking_uri: str | None,
          verify_options: dict[str, Any] | None, verify_where: str,
          risk_aware: bool | None, risk_quantile: str | None, export_infeasible: bool,
          on_ranked: Callable[[TuneResult], None] | None, progress: bool) -> TuneResult:
    """The body of :func:`tune` once its arguments are checked (``verify_where``: where
    :func:`~paratune.tuner.verify_location` said the configs are verified)."""
    search, sampler, seed = options["search"], options["sampler"], options["seed"]
    n_trials, batch_size = options["n_trials"], options["batch_size"]
    top_k, verify = options["top_k"], options["verify"]
    with contextlib.ExitStack() as stack:
        run = None
        pred = load_predictor(predictor)  # a predictor that does not load opens no run
        beyond = extrapolation_warnings(pred, search_space)
        for message in beyond:
            logger.warning(message)
        if track:  # opened before the work, so a failure or an interrupt leaves its record
            run = _open_run(stack, search_space, obj, predictor_params(predictor, pred),
                            predictor_fingerprint=predictor_identity(pred),
                            gns=gns, storage=storage, study_name=study_name,
                            storage_dir=output, tracking_uri=tracking_uri, **options)
        study, lost = None, None
        if search == "exhaustive":
            result = exhaustive(pred, search_space, obj)
        else:
            try:
                result, study = optuna_search(pred, search_space, obj, n_trials=n_trials,
                                              sampler=sampler, seed=seed, storage=storage,
                                              study_name=study_name, storage_dir=output,
                                              batch_size=batch_size, progress=progress)
            except StudyNotRecorded as exc:  # finish the work with what was evaluated
                result, lost = exc.result, exc
        if result.ranked.empty:
            raise ConfigError("space", search_space.model.name,
                              "the search evaluated no valid config (every sample broke a rule)")
        if risk_aware is None:
            risk_aware = bool(beyond) and risk_quantile is None
        if risk_aware:
            from paratune.tuner._verify import risk_aware_ranking

            reranked = risk_aware_ranking(result.ranked)
            if reranked is not result.ranked:
                result.ranked, result.risk_aware = reranked, True
                logger.warning("the performance model extrapolates here: configs are ranked "
                               "by the risk-aware expectation (the geometric mean of the "
                               "expected throughput and its 10th percentile); verify a few "
                               "on the cluster (--verify K) and refit")
        if not result.best_feasible:
            logger.warning("no evaluated config is predicted feasible; the top one is "
                           "predicted not to run (over the memory limit, under the minimum "
                           "probability of running, or its throughput could not be predicted)")
        best = result.best_row
        predicted = {k: _plain(best[k]) for k in (
            "tokens_per_s", "ranked_tokens_per_s", "step_time_s", "peak_mem_gb",
            "feasible_prob", "efficiency", "goodput", "objective", "feasible",
            "pred_stall_prob") if k in best}
        rec = recommendation(spec, result.best, hw,
                             devices_per_node=search_space.devices_per_node,
                             predicted=predicted, objective=obj.to_dict())
        rec["top"] = [{**c.to_dict(), "objective": float(o), "vs_best": float(v)}
                      for c, o, v in zip(result.configs(top_k), result.top(top_k)["objective"],
                                         result.top(top_k)["vs_best"])]
        outputs = (write_recommendation(rec, output, allow_infeasible=export_infeasible)
                   if output is not None else {})
        out = TuneResult(search=result, recommendation=rec, outputs=outputs, study=study)
        if run is not None:
            _log_outcome(run, out, search_space, obj, top_k=top_k)
            # a store that went away is reported by the run itself; no run to open then
            out.run_id = run.run_id if run.lost is None else None
        if on_ranked is not None:
            on_ranked(out)
        if lost is not None:  # the files are written; the run ends FAILED, verification waits
            files = ", ".join(str(p) for p in outputs.values())
            kept = (f"the {len(result.ranked)} configs this search evaluated are ranked"
                    + (f" and its recommendation written ({files})" if files else ""))
            raise StudyNotRecorded(lost.where, done=lost.done, reason=lost.reason, result=out,
                                   kept=kept) from lost
        if verify and verify_where == "here":
            from paratune.tuner._verify import verify_top_k

            out.verification = verify_top_k(out, verify, **(verify_options or {}))
        elif verify:
            from paratune.tuner._verify import verify_on_cluster

            out.cluster_verification = verify_on_cluster(out, verify, **(verify_options or {}))
            out.verification = out.cluster_verification.verification
        if run is not None and out.verification is not None:
            run.log_table(out.verification, "verification.csv")
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def predictor_params(predictor: Predictor | str | Path, loaded: Predictor | None = None
                     ) -> dict[str, Any]:
    """What identifies the predictor: its directory (or class) and, for a performance model,
    the fingerprint of its training data (``loaded``: the predictor already loaded from
    ``predictor``, else ``predictor`` itself)."""
    loaded = predictor if loaded is None else loaded
    name = (str(Path(predictor).resolve()) if isinstance(predictor, (str, Path))
            else type(predictor).__name__)
    fingerprint = getattr(loaded, "fingerprint_", None)
    return {"predictor": name, **({"predictor_fingerprint": fingerprint} if fingerprint else {})}


def _open_run(stack: contextlib.ExitStack, space: SearchSpace, objective: Objective,
              predictor: dict[str, Any], *, predictor_fingerprint: str | None, gns: Any,
              search: str, sampler: str,
              seed: int | None, n_trials: int, batch_size: int, top_k: int, verify: int,
              storage: str | Path | None, study_name: str | None,
              storage_dir: Path | None, tracking_uri: str | None) -> Any:
    """Open the ``paratune-tune`` run with every input that decides the answer.

    For an Optuna search the study is opened first (as the search would): its name and
    storage are params, and the tag ``paratune.resumed`` says whether it already held
    finished trials (a rerun, or another worker's), counted in ``paratune.prior_trials``.
    """
    from paratune.tracking import start_run

    params = {"model": space.model.name, "seq_len": space.model.seq_len,
              "gpus": space.world_size,
              "hardware": space.hardware.name, "devices_per_node": space.devices_per_node,
              **predictor,
              "objective": objective.kind.value, "b_noise": objective.b_noise,
              "b0": objective.reference_batch(space), "risk_quantile": objective.risk_quantile,
              "min_feasible_prob": objective.min_feasible_prob,
              "memory_limit_gb": objective.memory_limit(space),
              "global_batch_sizes": list(space.global_batch_sizes),
              "search": search, "sampler": sampler if search == "optuna" else "",
              "seed": seed, "n_trials": n_trials, "batch_size": batch_size, "top_k": top_k,
              "verify": verify, "space": space.space.to_dict()}
    if isinstance(gns, (str, Path)) and not _is_number(gns):
        params["gns_trajectory"] = str(Path(gns).resolve())
    tags: dict[str, Any] = {}
    if search == "optuna":
        from paratune.tuner._search import _finished, open_study, storage_text

        study = open_study(space, objective, sampler=sampler, seed=seed, storage=storage,
                           study_name=study_name, storage_dir=storage_dir,
                           predictor_fingerprint=predictor_fingerprint)
        prior = len(_finished(study))
        params["study_name"] = study.study_name
        where = storage_text(storage, storage_dir)
        # a journal file by its absolute path, as predictor and data are logged: two tunings
        # started from different folders keep different studies
        params["storage"] = (where if where is None or "://" in where
                             else str(Path(where).resolve()))
        tags = {"paratune.resumed": str(prior > 0).lower(), "paratune.prior_trials": prior}
    name = f"tune-{space.model.name}-{space.world_size}x{space.hardware.name}"
    return stack.enter_context(start_run("paratune-tune", run_name=name, params=params,
                                         tags=tags, tracking_uri=tracking_uri))


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _log_outcome(run: Any, out: TuneResult, space: SearchSpace, objective: Objective, *,
                 top_k: int) -> None:
    """The search's metrics and artifacts on the run :func:`_open_run` opened."""
    result = out.search
    best = result.best_row
    run.log_metrics({
        "best_objective": best["objective"], "best_tokens_per_s": best["tokens_per_s"],
        "best_step_time_s": best["step_time_s"], "best_goodput": best["goodput"],
        "best_feasible": float(bool(best["feasible"])),
        "num_trials": result.num_trials, "num_pruned": result.num_pruned,
        "num_configs": len(result.ranked), "search_wall_time_s": result.wall_time_s,
        "risk_aware": float(result.risk_aware)})
    run.log_dict(space.to_dict(), "space.json")
    run.log_dict(objective.to_dict(), "objective.json")
    run.log_dict(out.recommendation, "recommendation.json")
    run.log_table(result.top(top_k), "best_configs.csv")
    if out.study is not None:
        run.log_table(out.study.trials_dataframe(), "trials.csv")
        for title, fig in _study_figures(out.study):
            run.log_figure(fig, f"plots/{title}.png")
    else:
        run.log_table(result.ranked, "trials.csv")
    for path in out.outputs.values():
        run.log_artifact(path, "recommendation")


def _study_figures(study: optuna.Study) -> list[tuple[str, Any]]:
    """Optuna's optimisation history and parameter importances (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    figures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # PED-ANOVA: importances in milliseconds where fANOVA's forest takes seconds.
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        for title, draw in (("optimization_history", ovm.plot_optimization_history),
                            ("param_importances", lambda s: ovm.plot_param_importances(
                                s, evaluator=evaluator))):
            try:
                ax = draw(study)
            except (ValueError, RuntimeError, ZeroDivisionError,
                    optuna.exceptions.OptunaError) as exc:
                logger.info("skipping the %s plot: %s", title, exc)
                continue
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            figures.append((title, fig))
    for _, fig in figures:
        plt.close(fig)
    return figures
