"""Grouped cross-validation of predictors on measurements, and the figures it reports.

Splits:

* ``random``: five folds over configurations (a configuration's repeated or ok-and-failed
  records stay in one fold);
* ``cluster``: within each source, the largest cluster size is held out and the model is
  trained on everything else (can it extrapolate to more devices?);
* ``model``: each model in turn is held out (can it extrapolate to another model?);
* ``larger-model``, ``larger-cluster``, ``family``, ``multi-node``: the extrapolation splits
  of :mod:`paratune.models._splits` (fit on a small corner of the data, predict far outside).

Figures, per source and per held-out group: MAPE and median absolute percentage error of
tokens per second per device (= of step time inverted; both are reported), Spearman rank
correlation, top-1 regret per (model, cluster) group (the share of the measured best's
throughput that the predicted-best held-out configuration loses, among the same held-out
configurations of that group and fold: :func:`throughput_regret`; the predicted best of those
predicted to run, as ``paratune tune`` recommends), top-5 regret (the same
for the best measured among the five predicted best), the share of runs whose throughput
lies between the predicted 10th and 90th percentiles, and feasibility accuracy over
configurations (a configuration that ran at least once is feasible).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError, DatasetError
from paratune.models import features as F
from paratune.models._data import (
    config_identity,
    feasibility_table,
    measured_memory_gb,
    measured_step_time,
)
from paratune.models._evaluate_report import (
    EXTRAPOLATION_COLUMNS,
    _family,
    extrapolation_table,
    plot_predictions,
    summary_table,
)
from paratune.models._splits import EXTRAPOLATION_SPLITS, extrapolation_split
from paratune.predictor import (
    MEMORY_FRACTION,
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_TOKENS_EXPECTED,
    predicted_to_run,
    running_weight,
    throughput_quantile_columns,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ANATOMY_GROUPS", "EXTRAPOLATION_COLUMNS", "RISK_AWARE_WITHIN", "SPLITS",
           "EvaluationResult", "choice_orders", "choice_throughputs", "cross_validate",
           "error_anatomy", "extrapolation_table", "metrics", "plot_predictions",
           "predicted_to_run_rows", "risk_aware_candidates", "risk_aware_order",
           "risk_aware_throughput", "throughput_regret"]

SPLITS = ("random", "cluster", "model", *EXTRAPOLATION_SPLITS)
_GROUP = ("model_name", "world_size", "hardware")


def _train_test_folds(frame: pd.DataFrame, split: str, *, n_splits: int, random_state: int
                      ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(label, train mask, test mask)`` per fold."""
    if split in EXTRAPOLATION_SPLITS:
        return [(f.label, f.train, f.test) for f in extrapolation_split(frame, split).folds]
    return [(label, ~test, test) for label, test in cv_folds(
        frame, split, n_splits=n_splits, random_state=random_state)]


def cv_folds(frame: pd.DataFrame, split: str, *, n_splits: int, random_state: int
           ) -> list[tuple[str, np.ndarray]]:
    """``(label, test mask)`` per fold of a cross-validation split (trained on the rest)."""
    from sklearn.model_selection import GroupKFold

    family = _family(frame).to_numpy()
    if split == "random":
        identity = config_identity(frame).to_numpy()
        n = min(n_splits, len(np.unique(identity)))
        if n < 2:
            raise DatasetError("random split needs at least two configurations")
        folds = GroupKFold(n_splits=n, shuffle=True, random_state=random_state)
        out = []
        for i, (_, test) in enumerate(folds.split(frame, groups=identity)):
            mask = np.zeros(len(frame), dtype=bool)
            mask[test] = True
            out.append((f"fold{i + 1}", mask))
        return out
    world = np.asarray(frame["world_size"], dtype=float)
    if split == "cluster":
        mask = np.zeros(len(frame), dtype=bool)
        for fam in np.unique(family):
            sel = family == fam
            if len(np.unique(world[sel])) > 1:
                mask |= sel & (world == world[sel].max())
        if not mask.any():
            raise DatasetError("cluster split needs more than one cluster size in a source")
        return [("largest cluster per source", mask)]
    if split == "model":
        names = frame["model_name"].astype(str).to_numpy()
        out = []
        for fam in np.unique(family):
            models = np.unique(names[family == fam])
            if len(models) < 2:
                continue
            out.extend((f"{fam}:{m}", (family == fam) & (names == m)) for m in models)
        if not out:
            raise DatasetError("model split needs more than one model in a source")
        return out
    raise ConfigError("split", split, f"must be one of {', '.join(SPLITS)}")


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(spearmanr(a, b).statistic)


RISK_AWARE_WITHIN = 0.3
"""How far below the best expected throughput of a job's configs the risk-aware choice may
go for safety (:func:`risk_aware_candidates`). About the model's median error where it
extrapolates (15-32% on the extrapolation splits): a config predicted further behind is
slower than the best beyond that error, and a choice there pays more than the uncertainty
says. On the public data's splits every top-1 risk-aware choice is the same for bounds from
0.25 to 0.5 as without a bound (0.2 loses 8B on 16 GPUs fitted on 1B: 8.8% -> 36.9% mean
regret); without it, an 80B model on 256 H100s chose tensor parallelism over 32 devices (13%
predicted MFU) over pipelines predicted at 31%, because the stalled regime a pipeline of the
measured family may fall into stays in every pipeline's slow end beyond the fitted sizes."""


def risk_aware_throughput(expected: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """The risk-aware expectation of each config's throughput: ``expected`` times
    ``sqrt(clip(lower / expected, 0, 1))``, the geometric mean of the expected throughput and
    its lower quantile (``expected`` where the quantile is missing). It is what
    :func:`paratune.tuner.risk_aware_ranking` ranks by under the throughput objective, among
    :func:`risk_aware_candidates`: a config the model is unsure of (a wide interval) ranks
    below one predicted nearly as fast with confidence."""
    expected = np.asarray(expected, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(np.asarray(lower, dtype=float) / expected, 0.0, 1.0)
    return expected * np.sqrt(np.where(np.isfinite(share), share, 1.0))


def risk_aware_candidates(expected: np.ndarray, *, within: float = RISK_AWARE_WITHIN
                          ) -> np.ndarray:
    """Which of one job's configs the risk-aware expectation ranks first: those whose
    ``expected`` throughput is at least ``1 - within`` of the best (all where none is
    finite). The others rank after them, whatever their slow end: safety is bought with at
    most ``within`` of the expected best's throughput (:data:`RISK_AWARE_WITHIN`)."""
    expected = np.asarray(expected, dtype=float)
    finite = np.isfinite(expected)
    if not finite.any():
        return np.ones(len(expected), dtype=bool)
    return finite & (expected >= (1.0 - within) * expected[finite].max())


def risk_aware_order(expected: np.ndarray, lower: np.ndarray, *,
                     within: float = RISK_AWARE_WITHIN) -> np.ndarray:
    """Positions of one job's configs, best first, as the risk-aware ranking orders them:
    :func:`risk_aware_candidates` first, each tier by :func:`risk_aware_throughput`."""
    risk = np.nan_to_num(risk_aware_throughput(expected, lower), nan=-np.inf)
    near = risk_aware_candidates(expected, within=within)
    return np.lexsort((-risk, ~near))


def throughput_regret(best: Any, chosen: Any) -> Any:
    """The regret of a choice: the share of the best throughput it loses, ``1 - chosen /
    best`` (0 for the best, 0.5 for a choice that runs at half its speed, at most 1). Every
    regret paratune reports is this one: a choice that stalled ten times slower reads 90%,
    not 900%, so a mean over groups says what a user loses on average.

    Args:
        best: The best throughput (a scalar or an array).
        chosen: The chosen configuration's throughput, in the same unit.
    """
    return 1.0 - np.asarray(chosen, dtype=float) / np.asarray(best, dtype=float)


def metrics(frame: pd.DataFrame, predictions: pd.DataFrame) -> dict[str, float]:
    """Accuracy figures of predictions against the measurements of the same rows.

    Args:
        frame: Measurement rows.
        predictions: The predictor's output for those rows (same index order).

    Returns:
        ``n``, ``mape``, ``mdape`` (of tokens/s per device, in fractions),
        ``mape_step``, ``mdape_step`` (of step time), ``spearman`` (over all successful
        rows), ``spearman_group`` (mean over (model, cluster) groups), ``regret_mean`` /
        ``regret_max`` / ``regret_median`` (top-1 regret over (model, cluster) groups,
        within each fold where the rows carry a ``fold`` column; the choice is by
        ``pred_tokens_per_sec_per_gpu_expected`` where predicted, else by
        ``pred_tokens_per_sec_per_gpu``, times ``pred_feasible_prob``
        (:func:`choice_throughputs`), among the configs predicted to run
        (``pred_feasible_prob`` at least :data:`~paratune.predictor.MIN_FEASIBLE_PROB`)
        before the others, as ``paratune tune`` ranks), ``regret_within_5pct``
        (the share of those groups whose choice is within 5% of their best),
        ``regret_q10_mean`` (the same for the choice by the 10th-percentile throughput,
        where predicted), ``regret_top5_mean`` (the best measured among the five predicted
        best of each group against the group's best), ``regret_risk_mean`` and
        ``regret_risk_top5_mean`` (top-1 and top-5 regret of the choice by
        :func:`risk_aware_throughput`, the ranking ``paratune tune`` switches to where it
        sees the model extrapolate; NaN without a lower quantile), ``coverage`` (the share
        of runs whose measured throughput lies between the predicted lower and upper
        quantile),
        ``ratio_median`` (median predicted / measured throughput), ``mdape_mem`` (median
        absolute percentage error of the predicted peak memory, over the runs that report
        one), ``feasibility_accuracy``, ``n_configs``, and where the predictor
        gives ``pred_stall_prob``: ``stall_share`` (the measured pipeline runs that stalled)
        and ``stall_accuracy`` (the share of them whose regime the probability called right,
        at 0.5; NaN otherwise).
    """
    step = measured_step_time(frame)
    pred_step = np.asarray(predictions["pred_step_time_s"], dtype=float)
    ok = np.isfinite(step) & np.isfinite(pred_step)
    out: dict[str, float] = {"n": float(ok.sum())}
    out.update(_error_figures(step[ok], pred_step[ok]))
    c_world = np.asarray(frame["world_size"], dtype=float)
    tokens = np.asarray(frame["global_batch_size"], dtype=float) * np.asarray(
        frame["seq_len"], dtype=float)
    measured_tps = tokens / (step * c_world)
    predicted_tps = tokens / (pred_step * c_world)
    out["spearman"] = _spearman(measured_tps[ok], predicted_tps[ok])
    choice, rhos = _choice_figures(frame, predictions, ok, measured_tps, predicted_tps)
    out.update(choice)
    out["ratio_median"] = (float(np.median(predicted_tps[ok] / measured_tps[ok])) if ok.any()
                           else np.nan)
    out["coverage"] = _coverage(predictions, ok, measured_tps[ok])
    out["spearman_group"] = float(np.nanmean(rhos)) if np.isfinite(rhos).any() else np.nan
    out["mdape_mem"] = _memory_mdape(frame, predictions)
    out.update(_feasibility_figures(frame, predictions))
    out.update(_stall_figures(frame, predictions, ok, step))
    return out


def _error_figures(step: np.ndarray, pred_step: np.ndarray) -> dict[str, float]:
    """MAPE and MdAPE of throughput and of step time over the timed rows."""
    # tokens/s per device is inversely proportional to step time for a given row
    ape = np.abs(step / pred_step - 1.0)
    ape_step = np.abs(pred_step / step - 1.0)
    some = len(step) > 0
    return {"mape": float(ape.mean()) if some else np.nan,
            "mdape": float(np.median(ape)) if some else np.nan,
            "mape_step": float(ape_step.mean()) if some else np.nan,
            "mdape_step": float(np.median(ape_step)) if some else np.nan}


def _choice_figures(frame: pd.DataFrame, predictions: pd.DataFrame, ok: np.ndarray,
                    measured_tps: np.ndarray, predicted_tps: np.ndarray
                    ) -> tuple[dict[str, float], list[float]]:
    """The regret figures of the top-1 / top-5 choices per group, and each group's Spearman."""
    # Candidates of a top-1 choice: the held-out configurations of one (model, cluster) group
    # in one fold, as a model choosing among configurations it has not seen would.
    group = [*_GROUP, "fold"] if "fold" in frame.columns else list(_GROUP)
    keys = frame.loc[ok, group].astype(str).agg("|".join, axis=1).to_numpy()
    m_ok = measured_tps[ok]
    expected, chosen, cautious = choice_throughputs(predictions, predicted_tps)
    p_ok, chosen = expected[ok], chosen[ok]
    cautious = None if cautious is None else cautious[ok]
    runs = predicted_to_run_rows(frame, predictions)[ok]
    regrets, rhos = [], []
    cautious_regrets, top5_regrets, risk_regrets, risk_top5 = [], [], [], []
    for key in np.unique(keys):
        sel = keys == key
        if sel.sum() < 2:
            continue
        m, p = m_ok[sel], p_ok[sel]
        best = m.max()
        orders = choice_orders(chosen[sel], None if cautious is None else cautious[sel],
                               runs[sel])
        regrets.append(throughput_regret(best, m[orders["expected"][0]]))
        top5_regrets.append(throughput_regret(best, m[orders["expected"][:5]].max()))
        rhos.append(_spearman(m, p))
        if cautious is not None:
            cautious_regrets.append(throughput_regret(best, m[orders["lower"][0]]))
            risk_regrets.append(throughput_regret(best, m[orders["risk-aware"][0]]))
            risk_top5.append(throughput_regret(best, m[orders["risk-aware"][:5]].max()))
    out: dict[str, float] = {}
    out["regret_mean"] = float(np.mean(regrets)) if regrets else np.nan
    out["regret_max"] = float(np.max(regrets)) if regrets else np.nan
    # a few choices that stalled 10x decide the mean; the median and the share of groups
    # whose choice is within 5% of the best say how the typical choice fares
    out["regret_median"] = float(np.median(regrets)) if regrets else np.nan
    out["regret_within_5pct"] = (float(np.mean(np.asarray(regrets) <= 0.05)) if regrets
                                 else np.nan)
    # the risk-averse choice (highest 10th-percentile throughput), as the tuner can make it
    out["regret_q10_mean"] = float(np.mean(cautious_regrets)) if cautious_regrets else np.nan
    out["regret_top5_mean"] = float(np.mean(top5_regrets)) if top5_regrets else np.nan
    # the ranking ``tune`` switches to where it sees the model extrapolate
    out["regret_risk_mean"] = float(np.mean(risk_regrets)) if risk_regrets else np.nan
    out["regret_risk_top5_mean"] = float(np.mean(risk_top5)) if risk_top5 else np.nan
    return out, rhos


def choice_throughputs(predictions: pd.DataFrame, predicted_tps: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What ``tune`` ranks a group's configs by, per row: the expected throughput (where the
    predictor gives one, else ``predicted_tps``: a configuration likely to stall is not
    picked for its fast regime's time), that times the probability of running (a run that
    fails delivers nothing, :func:`~paratune.predictor.running_weight`), and the lower
    throughput quantile (q10 by default; ``None`` without one) times it."""
    expected = np.asarray(predicted_tps, dtype=float)
    if PRED_TOKENS_EXPECTED in predictions.columns:
        given = np.asarray(predictions[PRED_TOKENS_EXPECTED], dtype=float)
        expected = np.where(np.isfinite(given), given, expected)
    weight = (running_weight(np.asarray(predictions[PRED_FEASIBLE_PROB], dtype=float))
              if PRED_FEASIBLE_PROB in predictions.columns else np.ones(len(expected)))
    lower = throughput_quantile_columns(predictions.columns)
    cautious = (np.asarray(predictions[lower[0]], dtype=float) * weight if lower else None)
    return expected, expected * weight, cautious


def predicted_to_run_rows(frame: pd.DataFrame, predictions: pd.DataFrame) -> np.ndarray:
    """Which rows the predictions call feasible, by the rule ``tune`` ranks by
    (:func:`~paratune.predictor.predicted_to_run`: a probability of running of at least
    :data:`~paratune.predictor.MIN_FEASIBLE_PROB`, and a peak memory within
    :data:`~paratune.predictor.MEMORY_FRACTION` of the device's); all rows where the
    predictor gives no probability."""
    if PRED_FEASIBLE_PROB not in predictions.columns:
        return np.ones(len(frame), dtype=bool)
    memory = None
    limit = np.inf
    if PRED_PEAK_MEM_GB in predictions.columns and "hardware" in frame.columns:
        from paratune.models._feature_columns import hardware_columns

        memory = np.asarray(predictions[PRED_PEAK_MEM_GB], dtype=float)
        # no memory in the catalogue (the CPU), or a device it does not know: no limit
        device = hardware_columns(frame["hardware"])["memory_gb"]
        limit = np.where(device > 0, MEMORY_FRACTION * device, np.inf)
    return predicted_to_run(np.asarray(predictions[PRED_FEASIBLE_PROB], dtype=float), memory,
                            limit)


def choice_orders(expected: np.ndarray, lower: np.ndarray | None, runs: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """The orders in which ``paratune tune`` would rank one job's configs (positions, best
    first): those predicted to run (``runs``) before the others, each part by ``expected``
    (the expected throughput times the probability of running,
    :func:`choice_throughputs`), by ``lower`` (its lower quantile, times the same) and by the
    risk-aware expectation of the two (:func:`risk_aware_order`); the last two only with
    ``lower``."""
    def first(order: np.ndarray) -> np.ndarray:
        return np.concatenate([order[runs[order]], order[~runs[order]]])

    out = {"expected": first(np.argsort(-np.nan_to_num(expected, nan=-np.inf),
                                        kind="stable"))}
    if lower is not None:
        out["lower"] = first(np.argsort(-np.nan_to_num(lower, nan=-np.inf), kind="stable"))
        out["risk-aware"] = np.concatenate([
            pool[risk_aware_order(expected[pool], lower[pool])]
            for pool in (np.flatnonzero(runs), np.flatnonzero(~runs)) if len(pool)])
    return out


def _coverage(predictions: pd.DataFrame, ok: np.ndarray, m_ok: np.ndarray) -> float:
    """The share of timed runs whose throughput lies between the lowest and highest predicted
    quantile (NaN without two quantiles)."""
    quantiles = throughput_quantile_columns(predictions.columns)
    if len(quantiles) < 2 or not ok.any():
        return np.nan
    lo_q = np.asarray(predictions[quantiles[0]], dtype=float)[ok]
    hi_q = np.asarray(predictions[quantiles[-1]], dtype=float)[ok]
    inside = (m_ok >= lo_q) & (m_ok <= hi_q)
    return float(np.mean(inside))


def _memory_mdape(frame: pd.DataFrame, predictions: pd.DataFrame) -> float:
    """Median absolute percentage error of peak memory, where both the run and the predictor
    say it."""
    mem = measured_memory_gb(frame)
    pred_mem = (np.asarray(predictions["pred_peak_mem_gb"], dtype=float)
                if "pred_peak_mem_gb" in predictions.columns else np.full(len(frame), np.nan))
    has_mem = np.isfinite(mem) & np.isfinite(pred_mem) & (mem > 0)
    return (float(np.median(np.abs(pred_mem[has_mem] / mem[has_mem] - 1.0)))
            if has_mem.any() else np.nan)


def _feasibility_figures(frame: pd.DataFrame, predictions: pd.DataFrame) -> dict[str, float]:
    """Feasibility accuracy over configurations (ran at least once: feasible), at 0.5."""
    prob = np.asarray(predictions["pred_feasible_prob"], dtype=float)
    table = feasibility_table(frame.assign(_prob=prob).reset_index(drop=True))
    known = np.isfinite(table["_prob"].to_numpy())
    correct = (table["_prob"].to_numpy()[known] >= 0.5).astype(int) == table[
        "feasible"].to_numpy()[known]
    return {"feasibility_accuracy": float(correct.mean()) if known.any() else np.nan,
            "n_configs": float(known.sum())}


def _stall_figures(frame: pd.DataFrame, predictions: pd.DataFrame, ok: np.ndarray,
                   step: np.ndarray) -> dict[str, float]:
    """How well the stalled-pipeline regime is told apart, where the predictor models it."""
    out = {"stall_share": np.nan, "stall_accuracy": np.nan}
    if "pred_stall_prob" in predictions.columns:
        stall_prob = np.asarray(predictions["pred_stall_prob"], dtype=float)
        pipeline = ok & (np.asarray(frame["pp"], dtype=float) > 1) & np.isfinite(stall_prob)
        if pipeline.any():
            stalled = F.stalled_pipeline(frame, step)[pipeline]
            out["stall_share"] = float(stalled.mean())
            out["stall_accuracy"] = float(np.mean((stall_prob[pipeline] > 0.5) == stalled))
    return out


@dataclass
class EvaluationResult:
    """Out-of-fold predictions and the figures computed from them."""

    split: str
    predictions: dict[str, pd.DataFrame] = field(default_factory=dict)
    """Estimator name -> measurement rows with ``fold`` and prediction columns."""
    summary: list[dict[str, Any]] = field(default_factory=list)
    """One row per (estimator, source): the :func:`metrics` figures."""
    by_fold: list[dict[str, Any]] = field(default_factory=list)
    """One row per (estimator, fold) for the ``model`` and ``cluster`` splits."""

    def table(self) -> str:
        """The summary as an aligned text table (percentages)."""
        return summary_table(self)


def cross_validate(frame: pd.DataFrame, *, split: str = "random",
                   estimators: Mapping[str, Callable[[], Any]] | None = None,
                   n_splits: int = 5, random_state: int = 0,
                   progress: bool | None = None) -> EvaluationResult:
    """Cross-validate predictors on measurement rows.

    Args:
        frame: Measurement rows (from :func:`paratune.models.load_measurements`).
        split: ``random``, ``cluster``, ``model`` or an extrapolation split (see the
            module docstring).
        estimators: Name -> factory of an unfitted predictor; defaults to the
            :class:`~paratune.models.PerformanceModel` alone.
        n_splits: Folds of the random split.
        random_state: Seed of the random split.
        progress: Show a progress bar of the fits (estimator, fold, time left) on stderr;
            ``None``: only when stderr is a terminal.

    Returns:
        An :class:`EvaluationResult`.

    Raises:
        ConfigError: unknown split.
        DatasetError: the data cannot be split that way.
    """
    from paratune.models._estimators import PerformanceModel

    if split not in SPLITS:
        raise ConfigError("split", split, f"must be one of {', '.join(SPLITS)}")
    estimators = dict(estimators or {"performance_model": PerformanceModel})
    frame = frame.reset_index(drop=True)
    folds = _train_test_folds(frame, split, n_splits=n_splits, random_state=random_state)
    result = EvaluationResult(split=split)
    from paratune.progress import ProgressOutput, progress_bar

    # in a log, a line per fit (each names its estimator and fold)
    bar = progress_bar(total=len(estimators) * len(folds), unit="fit", desc="cross-validating",
                       enabled=progress, output=ProgressOutput(interval_s=0.0))
    with bar:
        for name, factory in estimators.items():
            _validate_estimator(frame, split, name, factory, folds, result, bar)
    return result


def _validate_estimator(frame: pd.DataFrame, split: str, name: str,
                        factory: Callable[[], Any],
                        folds: list[tuple[str, np.ndarray, np.ndarray]],
                        result: EvaluationResult, bar: Any) -> None:
    """Fit and predict ``name`` on every fold; its figures go into ``result``."""
    collected = []
    for label, train, test in folds:
        bar.set_postfix_str(f"{name} {label}")
        model = factory().fit(frame[train])
        pred = model.predict(frame[test])
        part = frame[test].copy()
        for column in pred.columns:
            part[column] = pred[column].to_numpy()
        part["fold"] = label
        collected.append(part)
        bar.update(1)
        if split != "random":
            figures = metrics(frame[test], pred)
            result.by_fold.append({"estimator": name, "source": "", "held_out": label,
                                   **figures})
    import pandas as pd

    oof = pd.concat(collected).sort_index()
    result.predictions[name] = oof
    oof_family = _family(oof)
    for fam in sorted(oof_family.unique()):
        rows = oof[(oof_family == fam).to_numpy()]
        figures = metrics(rows, rows)
        result.summary.append({"estimator": name, "source": fam, "held_out": "", **figures})


ANATOMY_GROUPS = ("regime", "layout", "nodes")
"""What :func:`error_anatomy` breaks a fold's errors down by."""


def error_anatomy(predictions: pd.DataFrame) -> list[dict[str, Any]]:
    """Where a fold's errors come from: its timed runs grouped by regime (measured stalled or
    normal, see :func:`~paratune.models.features.stalled_pipeline`, against the predicted
    regime, ``pred_stall_prob`` over 0.5), by layout (no pipeline, pipeline without and
    with tensor parallelism across nodes) and by nodes.

    Args:
        predictions: Measurement rows with a ``fold`` column and the prediction columns
            (:attr:`EvaluationResult.predictions`).

    Returns:
        One row per (fold, grouping of :data:`ANATOMY_GROUPS`, group): ``n``, ``share`` of
        the fold's timed runs, ``mdape`` of tokens/s per device and ``log_bias`` (median log
        of predicted / measured throughput; positive: predicted too fast).
    """
    step = measured_step_time(predictions)
    pred = np.asarray(predictions["pred_step_time_s"], dtype=float)
    ok = np.isfinite(step) & np.isfinite(pred)
    part = predictions[ok]
    step, pred = step[ok], pred[ok]
    stalled = F.stalled_pipeline(part, step)
    prob = (np.asarray(part["pred_stall_prob"], dtype=float)
            if "pred_stall_prob" in part.columns else np.zeros(len(part)))
    called = prob > 0.5
    regime = np.where(stalled, "stalled", "normal").astype(object) + np.where(
        called, ", called stalled", ", called normal").astype(object)
    pp = np.asarray(part["pp"], dtype=float)
    crosses = F.tp_crosses_nodes(part) > 0
    layout = np.where(pp <= 1, "no pipeline", np.where(crosses, "pipeline, tp across nodes",
                                                       "pipeline, tp in a node"))
    c = F.Columns(part)
    nodes = np.ceil(c.world / c.per_node)
    groups = {"regime": regime, "layout": layout,
              "nodes": np.asarray([f"{n:g} nodes" for n in nodes], dtype=object)}
    log_ratio = np.log(step / pred)  # predicted / measured throughput
    ape = np.abs(step / pred - 1.0)
    folds = np.asarray(part["fold"], dtype=object) if "fold" in part.columns else np.full(
        len(part), "", dtype=object)
    out = []
    for fold in dict.fromkeys(folds):
        in_fold = folds == fold
        for by in ANATOMY_GROUPS:
            values = groups[by]
            labels = {str(v) for v in values[in_fold]}
            for group in sorted(labels, key=lambda g: (float(g.split()[0]), g)
                                if by == "nodes" else (0.0, g)):
                sel = in_fold & (values == group)
                out.append({"fold": fold, "by": by, "group": group, "n": int(sel.sum()),
                            "share": float(sel.sum() / in_fold.sum()),
                            "mdape": float(np.median(ape[sel])),
                            "log_bias": float(np.median(log_ratio[sel]))})
    return out
