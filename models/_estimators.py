"""Predictors of step time, throughput, memory and feasibility.

:class:`PerformanceModel` is the one the tuner uses: XGBoost learns the ratio of measured to
analytical step time (and memory) from the features of :mod:`paratune.models.features`, so
its predictions scale with the analytical estimate where the configuration leaves the range
of the training data. The baselines are kept for comparison in ``paratune evaluate``.

All follow scikit-learn conventions: ``__init__`` stores keyword arguments, ``fit(frame)``
returns ``self``, learned state ends in ``_``. ``predict(frame)`` returns one row per input
row with :data:`paratune.predictor.PREDICTION_COLUMNS`, the throughput quantiles and
``pred_error`` (empty where the row was predicted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn.base import BaseEstimator

from paratune import __version__
from paratune._io import atomic_write_text, exclusive_lock
from paratune.errors import DatasetError, ModelFormatError
from paratune.models import features as F
from paratune.models._data import (
    canonical_order,
    feasibility_table,
    measured_memory_gb,
    measured_step_time,
    training_fingerprint,
)
from paratune.predictor import (
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_STEP_TIME_S,
    PRED_TOKENS_EXPECTED,
    PRED_TOKENS_PER_SEC_PER_GPU,
    PREDICTION_COLUMNS,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "PRED_ERROR",
    "PRED_EXTRAPOLATION",
    "PRED_STALL_PROB",
    "PRED_TOKENS_EXPECTED",
    "PRED_TOKENS_Q10",
    "PRED_TOKENS_Q90",
    "PRED_WARNING",
    "SCHEMA_VERSION",
    "AnalyticalBaseline",
    "HistGradientBoostingBaseline",
    "PerformanceModel",
    "RawConfigBaseline",
    "estimator_factories",
    "load_model",
    "source_family",
]

SCHEMA_VERSION = 12
"""Version of the saved-model directory format; loading another version fails (2: the
layer-passes feature; 3: the data-parallel ring latency in the analytical estimate; 4: the
step-time models for models not in the training data; 5: the stalled-pipeline regime; 6:
model keys with every digit of the shapes, hardware names in their catalogue spelling; 7: the
analytical estimate's per-micro-batch ZeRO-2/3 traffic and latency, recompute working set
and FLOPs, GPipe's last rank, largest-chunk pipeline fill and node-crossing tp groups, and the
training ranges; 8: the memory correction on its own features, with monotone directions; 9:
the families whose pipelines never stalled, kept out of the stalled regime; 10: the models
each family's step-time model has seen, and family names fit for file names; 11: the
training ranges per family, the interval's widening with distance from them and the
few-shot calibration of families; 12: the stall classifier for models not in the
training data on the regime's physics, see :func:`~paratune.models.features.stall_features`).
A
model learns corrections to the analytical estimate, so one fitted on another version's
estimate would apply them to a different baseline."""
PRED_TOKENS_Q10 = f"{PRED_TOKENS_PER_SEC_PER_GPU}_q10"
PRED_TOKENS_Q90 = f"{PRED_TOKENS_PER_SEC_PER_GPU}_q90"
PRED_STALL_PROB = "pred_stall_prob"
PRED_ERROR = "pred_error"
PRED_EXTRAPOLATION = "pred_extrapolation_doublings"
"""How many doublings of model size, cluster size and tokens per step (summed) a row lies
outside the ranges the model was fitted on (0 inside; NaN from predictors that do not say)."""
PRED_WARNING = "pred_warning"
"""Why a prediction is less sure than the model's in-range ones (empty where it is not)."""
OUTPUT_COLUMNS = (*PREDICTION_COLUMNS, PRED_TOKENS_Q10, PRED_TOKENS_Q90, PRED_TOKENS_EXPECTED,
                  PRED_STALL_PROB, "analytical_step_time_s", PRED_EXTRAPOLATION, PRED_WARNING,
                  PRED_ERROR)
_MANIFEST = "model.json"
_LOCK_FILE = ".model.lock"
_LOCK_WAIT_S = 60.0
_TIME_COMPONENTS = ("throughput", "throughput_refine", "throughput_quantiles")
_STALL_COMPONENTS = ("stall_classifier", "stall_time", "stall_time_quantiles")
_COMPONENT_FILE = re.compile(  # a booster file save writes (transfer and family ones by prefix)
    rf"^({'|'.join((*_TIME_COMPONENTS, 'memory', 'feasibility', *_STALL_COMPONENTS))}"
    r"|transfer-.+|family-.+)\.json$")
_TRANSFER_COLUMNS = np.asarray([F.FEATURE_NAMES.index(name) for name in F.TRANSFER_FEATURE_NAMES])
_MEMORY_COLUMNS = np.asarray([F.FEATURE_NAMES.index(name) for name in F.MEMORY_FEATURE_NAMES])
_STALL_MONOTONE = "({})".format(",".join(str(F.STALL_MONOTONE.get(name, 0))
                                           for name in F.STALL_FEATURE_NAMES))
_MEMORY_MONOTONE = "({})".format(",".join(str(F.MEMORY_MONOTONE.get(name, 0))
                                          for name in F.MEMORY_FEATURE_NAMES))


def _catalogue_names(names: Any) -> np.ndarray:
    """Hardware names in their catalogue spelling (``h100`` -> ``H100-80GB``); names the
    catalogue does not know are kept as they are."""
    from paratune.errors import ConfigError
    from paratune.hardware import get_hardware

    def canonical(name: Any) -> str:
        try:
            return get_hardware(str(name)).name
        except ConfigError:
            return str(name)

    return F._lookup(names, canonical, dtype=object)


def training_ranges(frame: pd.DataFrame) -> dict[str, dict[str, list[int]]]:
    """Per device kind (catalogue name), the smallest and largest ``world_size``,
    ``global_batch_size`` and tokens per step (global batch x sequence length) among the
    runs that measured a step time: where a model's predictions interpolate."""
    step = measured_step_time(frame)
    timed = frame[np.isfinite(step)]
    if timed.empty:
        return {}
    hardware = _catalogue_names(timed["hardware"].to_numpy())
    world = (timed["world_size"] if "world_size" in timed.columns
             else timed["dp"] * timed["tp"] * timed["pp"])
    values = {"world_size": world.to_numpy(dtype=float),
              "global_batch_size": timed["global_batch_size"].to_numpy(dtype=float),
              "tokens_per_step": (timed["global_batch_size"].to_numpy(dtype=float)
                                  * timed["seq_len"].to_numpy(dtype=float))}
    out: dict[str, dict[str, list[int]]] = {}
    for name in sorted(set(hardware)):
        rows = hardware == name
        out[str(name)] = {key: [int(np.nanmin(v[rows])), int(np.nanmax(v[rows]))]
                          for key, v in values.items()}
    return out


def source_family(frame: pd.DataFrame, *, missing: str = "paratune") -> np.ndarray:
    """The measurement family of each row: the first ``_``-separated word of its source,
    lower case, any run of characters other than letters, digits, ``.`` and ``-`` made one
    ``-`` (``vtrain_ground_truth_single_node`` and ``vtrain_ground_truth_multi_node`` are one
    family, ``vtrain``; a family names files of a saved model); ``missing`` where no source
    is recorded (paratune's own measurements name theirs)."""
    import pandas as pd

    if "source" not in frame.columns:
        return np.full(len(frame), missing, dtype=object)
    # once per distinct source: a frame of 100,000 rows holds a handful
    source = frame["source"]
    codes, sources = pd.factorize(source.astype(object).where(source.notna(), "").astype(str))
    text = pd.Series(sources, dtype=object).str.strip().str.lower()
    family = (text.str.split("_").str[0].str.replace(r"[^a-z0-9.\-]+", "-", regex=True)
              .str.strip("-").replace("", missing))
    return np.asarray(family, dtype=object)[codes]


def _memory_rule(mem_gb: np.ndarray, capacity_gb: np.ndarray) -> np.ndarray:
    """Probability of fitting in memory from a memory estimate alone (a soft threshold).

    Hardware without a catalogued capacity (the CPU: 0 GB) sets no limit: probability 1.
    """
    mem_gb = np.asarray(mem_gb, dtype=float)
    capacity_gb = np.broadcast_to(np.asarray(capacity_gb, dtype=float), mem_gb.shape)
    known = capacity_gb > 0
    fraction = np.divide(mem_gb, capacity_gb, out=np.zeros_like(mem_gb), where=known)
    with np.errstate(over="ignore", invalid="ignore"):
        prob = 1.0 / (1.0 + np.exp((fraction - 0.95) / 0.03))
    return np.where(known, prob, 1.0)


class _Base(BaseEstimator):
    """Shared prediction assembly: subclasses return arrays, this builds the frame."""

    def _check_fitted(self) -> None:
        if not hasattr(self, "num_train_rows_"):
            raise ModelFormatError(f"{type(self).__name__} is not fitted: call fit() or load()")

    def _predict_arrays(self, frame: pd.DataFrame, c: F.Columns, X: np.ndarray,
                        analytical: dict[str, Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _quantile_columns(self) -> tuple[str, str]:
        """Names of the lower and upper throughput quantile columns."""
        return PRED_TOKENS_Q10, PRED_TOKENS_Q90

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Predict every row of a config frame.

        Args:
            frame: Config frame (:data:`paratune.predictor.CONFIG_COLUMNS`).

        Returns:
            A frame with the input's index and :data:`OUTPUT_COLUMNS`; rows that cannot be
            predicted (unknown hardware, impossible values) have NaN predictions and a
            ``pred_error`` message. ``pred_step_time_s`` is the most likely step time;
            ``pred_tokens_per_sec_per_gpu_expected`` the throughput of the expected step
            time over the regimes a run may fall into, and ``pred_stall_prob`` the
            probability of the stalled-pipeline regime (NaN from predictors that do not
            model it, whose expected throughput is their point prediction).
        """
        import pandas as pd

        self._check_fitted()
        # the columns once: building them (hardware lookups over every row) is a good part
        # of predicting 100,000 configurations
        c = F.Columns(frame)
        X, analytical = F.compute_features(c)
        out = self._predict_arrays(frame, c, X, analytical)
        step = out["step"]
        tokens = c.global_batch * c.seq
        with np.errstate(divide="ignore", invalid="ignore"):
            per_gpu = tokens / (step * c.world)
            q10 = tokens / (out.get("step_hi", step) * c.world)
            q90 = tokens / (out.get("step_lo", step) * c.world)
            expected = tokens / (out.get("step_expected", step) * c.world)
        errors = np.asarray(analytical["error"], dtype=object).copy()
        bad_values = ~(np.isfinite(analytical["step_time_s"]) & (analytical["step_time_s"] > 0))
        errors = np.where((errors == "") & bad_values,
                          "configuration values give no finite analytical estimate "
                          "(check degrees, batch sizes and model shape)", errors)
        failed = errors != ""
        result = pd.DataFrame({
            PRED_STEP_TIME_S: step,
            PRED_TOKENS_PER_SEC_PER_GPU: per_gpu,
            PRED_FEASIBLE_PROB: out["feasible"],
            PRED_PEAK_MEM_GB: out["memory"],
            self._quantile_columns()[0]: q10,
            self._quantile_columns()[1]: q90,
            PRED_TOKENS_EXPECTED: expected,
            PRED_STALL_PROB: out.get("stall_prob", np.full(len(frame), np.nan)),
            "analytical_step_time_s": analytical["step_time_s"],
            PRED_EXTRAPOLATION: out.get("distance", np.full(len(frame), np.nan)),
            PRED_WARNING: np.where(failed, "", out.get("warning", "")).astype(object),
            PRED_ERROR: errors,
        }, index=frame.index)
        numeric = [c for c in result.columns if c not in (PRED_ERROR, PRED_WARNING)]
        result.loc[failed, numeric] = np.nan
        return result


def _xgb_regressor(params: dict[str, Any], **extra: Any) -> Any:
    import xgboost as xgb

    return xgb.XGBRegressor(tree_method="hist", **params, **extra)


class PerformanceModel(_Base):
    """XGBoost on analytical features, predicting measured / analytical ratios.

    * step time: ``analytical * exp(g(x))``, ``g`` fitted to ``log(measured / analytical)``:
      half the trees with an absolute-error objective (the median ratio, robust to the
      pathological runs public sweeps contain), then half with a squared-error objective on
      the remaining residuals clipped to ``refine_clip`` (a Huber-like refinement that fits
      clean data closely without chasing outliers); 10th / 90th percentile models beside;
      fitted on all rows and, where the data mixes measurement families (sources of one
      framework and cluster), once per family; a row uses its family's model (by its
      ``source`` column, else by its hardware when that was measured in one family only),
      else the model fitted on all rows; each of these step-time models comes twice: on all
      features for configurations of models in the training data, and on
      :data:`~paratune.models.features.TRANSFER_FEATURE_NAMES` (no feature that tells the
      trained-on models apart by size) for models it has not seen, which a tree would
      otherwise treat as whichever trained-on model their size falls next to;
    * stalled pipelines (see :func:`~paratune.models.features.stalled_pipeline`): where the
      training data holds at least ``min_stall_rows`` of them, the step-time models above
      learn from the other runs only, and three smaller boosters learn the stalled regime: a
      classifier of the probability that a pipeline configuration stalls, and the median and
      quantiles of a stalled run's time per micro-batch (a fixed cost per micro-batch,
      whatever the model's size). The point prediction is the more likely regime's time;
      the expected step time weighs the two by the probability (the tuner ranks by it); the
      upper time quantile is the stalled time where the probability exceeds the upper
      quantile's tail. All three come on all features for the models trained on, and on the
      regime's physics (:func:`~paratune.models.features.stall_features`: compute per device
      per step and per micro-batch, nodes) for the others, the classifier never rising with
      the compute, so a larger model's layouts with seconds of compute per device are not
      given the small models' stalls. Where the normal regime's step already takes longer
      than the learned stalled one, the fixed cost hides behind the compute and the
      probability is 0. Stalling belongs to how a framework runs its pipelines: a
      measurement family with at least ``min_stall_rows`` pipeline runs, none of them
      stalled, keeps a stall probability of 0 (``stall_free_families_``, by a row's source,
      else by its hardware) also on layouts it was not measured on;
    * peak memory: ``analytical * exp(m(x))`` where memory was measured, ``m`` on the
      features of :data:`~paratune.models.features.MEMORY_FEATURE_NAMES` and held to the
      directions of :data:`~paratune.models.features.MEMORY_MONOTONE` (a larger micro-batch
      does not need less memory, nor ZeRO-1 more than no sharding; the absolute-error
      objective refits leaf values after the constrained split, and the memory fraction
      moves with the micro-batch too, which can bend that by a few percent);
    * beyond the training data (see :mod:`paratune.models._extrapolation`): each row's
      distance, the doublings of model size, cluster size and tokens per step outside its
      family's fitted ranges, shrinks the learned prediction toward the calibrated
      analytical core (:mod:`paratune.models._calibration`, constants per family) at a rate
      per family, and widens the interval by margins per doubling; rate and margins are
      chosen on nested extrapolation splits of the training rows. A family without
      measurements is flagged (``pred_warning``) and its interval widened;
      :meth:`calibrate` refits a family's efficiency factor from a few of its runs;
    * feasibility: an XGBoost classifier on the features and the predicted memory fraction,
      trained on successful and failed runs (a configuration that ran at least once is
      feasible); without failed runs in the data, a soft threshold on predicted memory.

    Args:
        n_estimators: Trees of the step-time model (half median, half refinement).
        max_depth: Tree depth.
        learning_rate: Shrinkage of the step-time booster.
        aux_estimators: Boosting rounds of the quantile, memory and feasibility boosters
            (smaller, so that predicting 100,000 configurations stays well under a second).
        aux_learning_rate: Their shrinkage.
        refine_clip: Residuals (in log ratio) are clipped to this for the refinement.
        min_family_rows: Timed rows a measurement family (see :func:`source_family`) needs
            for its own step-time model when the data mixes families.
        min_stall_rows: Stalled pipeline runs the data needs for the stalled regime to be
            learned (with fewer, they train the step-time model like any other run); also
            the pipeline runs, none stalled, that tell a family free of the regime.
        subsample: Row subsampling per tree.
        colsample_bytree: Feature subsampling per tree.
        min_child_weight: Minimum hessian in a leaf.
        quantiles: Lower and upper step-time quantiles to predict, in whole percent
            (``(0.1, 0.9)``: the throughput columns ``..._q10`` and ``..._q90``, the
            throughput the step time's 90th and 10th percentiles give).
        n_jobs: Threads (``None``: XGBoost's default).
        random_state: Seed.
        nested_intervals: Widen the interval with the distance from the training ranges by
            margins calibrated on nested extrapolation splits of the training rows (see
            :mod:`paratune.models._extrapolation`; a few more fits).
    """

    def __init__(self, *, n_estimators: int = 500, max_depth: int = 3,
                 learning_rate: float = 0.075, aux_estimators: int = 100,
                 aux_learning_rate: float = 0.15, refine_clip: float = 0.2,
                 min_family_rows: int = 200, min_stall_rows: int = 30,
                 subsample: float = 0.8,
                 colsample_bytree: float = 0.8, min_child_weight: float = 5.0,
                 quantiles: tuple[float, float] = (0.1, 0.9), n_jobs: int | None = None,
                 random_state: int = 0, nested_intervals: bool = True) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.aux_estimators = aux_estimators
        self.aux_learning_rate = aux_learning_rate
        self.refine_clip = refine_clip
        self.min_family_rows = min_family_rows
        self.min_stall_rows = min_stall_rows
        self.subsample = subsample
        self.colsample_bytree = colsample_bytree
        self.min_child_weight = min_child_weight
        self.quantiles = quantiles
        self.n_jobs = n_jobs
        self.random_state = random_state
        self.nested_intervals = nested_intervals

    def _quantile_columns(self) -> tuple[str, str]:
        # the slow end of throughput is the step time's upper quantile
        lower, upper = self.quantiles
        return (f"{PRED_TOKENS_PER_SEC_PER_GPU}_q{round(100 * (1 - upper)):02d}",
                f"{PRED_TOKENS_PER_SEC_PER_GPU}_q{round(100 * (1 - lower)):02d}")

    def _check_quantiles(self) -> None:
        from paratune.errors import ConfigError

        q = self.quantiles
        ok = (isinstance(q, tuple | list) and len(q) == 2
              and all(isinstance(v, int | float) for v in q) and 0 < q[0] < 0.5 < q[1] < 1
              and all(abs(100 * v - round(100 * v)) < 1e-9 for v in q))
        if not ok:
            raise ConfigError("quantiles", q, "must be two probabilities lower < 0.5 < upper "
                                              "in whole percent, e.g. (0.1, 0.9)")

    def _booster_params(self, *, aux: bool = False, rate: float | None = None
                        ) -> dict[str, Any]:
        return {"n_estimators": self.aux_estimators if aux else max(self.n_estimators // 2, 1),
                "max_depth": self.max_depth,
                "learning_rate": rate or (self.aux_learning_rate if aux else self.learning_rate),
                "subsample": self.subsample,
                "colsample_bytree": self.colsample_bytree,
                "min_child_weight": self.min_child_weight, "n_jobs": self.n_jobs,
                "random_state": self.random_state}

    def _classifier_params(self, labels: np.ndarray) -> dict[str, Any]:
        """A classifier's booster parameters: ``min_child_weight`` counts rows for the
        regressors (each weighs 1), but a row weighs ``p (1 - p)`` to a logistic booster, so
        here it is scaled by that weight at the labels' base rate. Unscaled, a few failed
        runs among many that ran (a small campaign: 17 out-of-memory configs in 180) could
        share no leaf, and the classifier gave every config the base rate."""
        rate = float(np.mean(labels))
        return {**self._booster_params(aux=True),
                "min_child_weight": self.min_child_weight * rate * (1.0 - rate)}

    # ------------------------------------------------------------------ fit
    def fit(self, frame: pd.DataFrame) -> PerformanceModel:
        """Fit on measurement rows (:meth:`paratune.Measurement.to_row` columns).

        Args:
            frame: Successful and failed measurements, in any order: the rows are put in a
                canonical order first, so the same rows (the same fingerprint) give the same
                model whichever files they came from, in whichever order.

        Returns:
            ``self``.

        Raises:
            DatasetError: no successful measurement with a step time to learn from.
            ConfigError: ``quantiles`` is not a pair of probabilities around the median.
        """
        import xgboost as xgb

        self._check_quantiles()
        frame = canonical_order(frame)
        c = F.Columns(frame)
        X, analytical = F.compute_features(c)
        usable = np.asarray(analytical["error"] == "") & np.isfinite(
            analytical["step_time_s"]) & (analytical["step_time_s"] > 0)
        step = measured_step_time(frame)
        has_time = usable & np.isfinite(step)
        if not has_time.any():
            raise DatasetError("no successful measurement with a step time on known hardware")
        y = np.log(step / analytical["step_time_s"])
        keys = F.model_keys(c)
        self.seen_models_ = sorted(str(k) for k in np.unique(keys[has_time]))
        transfer = _TRANSFER_COLUMNS
        # Stalled pipeline runs are a regime of their own (a fixed cost per micro-batch); the
        # step-time models learn the normal regime without them where there are enough to
        # learn the stalled one apart.
        stalled = has_time & F.stalled_pipeline(c, step)
        pipeline = has_time & (c.pp > 1) & c.accelerator
        families = source_family(frame)
        hardware = _catalogue_names(frame["hardware"])
        timed = has_time  # has_time is rebound below, never changed in place
        self.stall_ = self.stall_transfer_ = None
        # the classifier needs pipeline runs of both regimes; the step-time models some
        # runs that did not stall
        if (stalled.sum() >= self.min_stall_rows and (pipeline & ~stalled).any()
                and (has_time & ~stalled).any()):
            per_micro = np.log(step / F.num_microbatches(c))
            self.stall_ = self._fit_stall(X, pipeline, stalled, per_micro)
            # for a model not trained on, the regime's physics alone (compute per device
            # per step and per micro-batch, nodes): nothing that names a model size
            self.stall_transfer_ = self._fit_stall(
                F.stall_features(c), pipeline, stalled, per_micro,
                monotone=_STALL_MONOTONE)
            has_time = has_time & ~stalled
        self.num_stall_rows_ = int(stalled.sum()) if self.stall_ is not None else 0
        # Stalling is a property of how a framework runs its pipelines (of nanotron's in the
        # public H100 sweep), not of pipelines as such: a family (see :func:`source_family`)
        # with enough pipeline runs and not one stalled does not show the regime, and its
        # configurations are not given another family's stall probability where they leave
        # the layouts it was measured on (more nodes, deeper pipelines).
        self.pipeline_runs_ = {str(f): [int((pipeline & (families == f)).sum()),
                                        int((stalled & (families == f)).sum())]
                               for f in np.unique(families[pipeline])}
        self.stall_free_families_ = sorted(
            f for f, (runs, stalls) in self.pipeline_runs_.items()
            if self.stall_ is not None and runs >= self.min_stall_rows and stalls == 0)
        # a row without a source: by its hardware, where every run on it is of such a family
        self.stall_free_hardware_ = sorted(
            str(name) for name in np.unique(hardware[timed])
            if np.isin(families[timed & (hardware == name)], self.stall_free_families_).all())
        self.throughput_, self.refine_, self.quantile_ = self._fit_time(X[has_time],
                                                                        y[has_time])
        self.transfer_ = self._fit_time(X[has_time][:, transfer], y[has_time])
        # One step-time model per measurement family (framework and cluster of a source) with
        # enough rows: a family's quirks (e.g. one framework's pathological pipeline runs)
        # must not leak into another's extrapolation, which the analytical estimate carries.
        self.families_ = {}
        self.family_transfer_ = {}
        # a family's model has seen the models measured in that family only: another
        # family's shape goes to its transfer model, as an unseen model does
        self.family_seen_ = {}
        if len(np.unique(families[has_time])) > 1:
            for family in np.unique(families[has_time]):
                rows = has_time & (families == family)
                if rows.sum() >= self.min_family_rows:
                    self.families_[str(family)] = self._fit_time(X[rows], y[rows])
                    self.family_seen_[str(family)] = sorted(
                        str(k) for k in np.unique(keys[rows]))
                    self.family_transfer_[str(family)] = self._fit_time(X[rows][:, transfer],
                                                                        y[rows])
        self.hardware_family_ = {}
        for name in np.unique(hardware[has_time]):
            seen = np.unique(families[has_time & (hardware == name)])
            if len(seen) == 1 and str(seen[0]) in self.families_:
                self.hardware_family_[str(name)] = str(seen[0])

        mem = measured_memory_gb(frame)
        has_mem = usable & np.isfinite(mem)
        self.memory_ = None
        if has_mem.sum() >= 10:
            y_mem = np.log(mem[has_mem] / analytical["memory_gb"][has_mem])
            self.memory_ = _xgb_regressor(
                self._booster_params(aux=True), objective="reg:absoluteerror",
                monotone_constraints=_MEMORY_MONOTONE).fit(X[has_mem][:, _MEMORY_COLUMNS], y_mem)

        table = feasibility_table(frame[usable].reset_index(drop=True))
        labels = table["feasible"].to_numpy()
        self.feasibility_ = None
        if len(np.unique(labels)) == 2:
            Xf = self._feasibility_matrix(table)
            self.feasibility_ = xgb.XGBClassifier(
                tree_method="hist", objective="binary:logistic",
                **self._classifier_params(labels)).fit(Xf, labels)
        self.num_train_rows_ = len(frame)
        self.num_time_rows_ = int(has_time.sum()) + self.num_stall_rows_
        self.num_memory_rows_ = int(has_mem.sum())
        self.num_feasibility_rows_ = len(table)
        self.fingerprint_ = training_fingerprint(frame)
        self.training_ranges_ = training_ranges(frame)
        sources = frame["source"].astype(str) if "source" in frame.columns else None
        self.sources_ = sorted(sources.unique().tolist()) if sources is not None else []
        self.family_offsets_ = {}
        self._fit_core(c, analytical, families, has_time, step)
        self._fit_widening(frame, families, timed, step)
        return self

    def _fit_core(self, c: F.Columns, analytical: dict[str, Any], families: np.ndarray,
                  rows: np.ndarray, step: np.ndarray) -> None:
        """The calibrated analytical core's constants per family with enough ``rows`` (see
        :mod:`paratune.models._calibration`)."""
        from paratune.models._calibration import MIN_ROWS, core_parts, fit_constants

        parts = core_parts(c, analytical)
        usable = rows & np.all(np.isfinite(parts), axis=1)
        self.core_constants_ = {}
        for family in np.unique(families[usable]):
            sel = usable & (families == family)
            if sel.sum() >= MIN_ROWS:
                self.core_constants_[str(family)] = [
                    float(v) for v in fit_constants(parts[sel], step[sel])]

    def _core_step(self, frame: pd.DataFrame, c: F.Columns, analytical: dict[str, Any],
                   families: np.ndarray | None = None) -> np.ndarray:
        """The calibrated core's step time per row: its family's constants, the defaults of
        a well-tuned framework for a family without them."""
        from paratune.models._calibration import (
            CONSTANT_NAMES,
            DEFAULT_CONSTANTS,
            core_parts,
            predict_core,
        )

        families = self._families(frame) if families is None else families
        constants = np.tile([DEFAULT_CONSTANTS[k] for k in CONSTANT_NAMES], (c.n, 1))
        for family, values in self.core_constants_.items():
            constants[families == family] = values
        return predict_core(core_parts(c, analytical), constants)

    def _fit_widening(self, frame: pd.DataFrame, families: np.ndarray, timed: np.ndarray,
                      step: np.ndarray) -> None:
        """The training ranges per family and the interval's widening with distance from
        them, calibrated on nested extrapolation splits of ``frame`` (the training rows)."""
        from paratune.models._extrapolation import (
            AXES,
            axis_values,
            calibrate_widening,
            fit_ranges,
        )

        self.extrapolation_ranges_ = fit_ranges(axis_values(frame), families, timed)
        self.interval_widening_ = {"": {
            **{f"{side}_{axis}": 0.0 for side in ("hi", "lo") for axis in AXES},
            "hi_family": 0.0, "lo_family": 0.0, "nested_rows": 0.0}}
        if not self.nested_intervals:
            return
        lower, upper = self._quantile_columns()

        def fit_predict(train: pd.DataFrame, test: pd.DataFrame) -> dict[str, np.ndarray]:
            inner = PerformanceModel(**{**self.get_params(), "nested_intervals": False})
            inner.fit(train)
            pred = inner.predict(test)
            _, per_axis, unknown = inner._distance(test)
            c_test = F.Columns(test)
            _, analytical_test = F.compute_features(c_test)
            core = inner._core_step(test, c_test, analytical_test)
            prob = pred[PRED_STALL_PROB].to_numpy(float)
            tokens = (test["global_batch_size"].to_numpy(float)
                      * test["seq_len"].to_numpy(float))
            world = np.asarray(F.Columns(test).world)
            with np.errstate(divide="ignore", invalid="ignore"):
                return {"step_hi": tokens / (pred[lower].to_numpy(float) * world),
                        "step_lo": tokens / (pred[upper].to_numpy(float) * world),
                        "unknown_family": unknown,
                        "step": pred["pred_step_time_s"].to_numpy(float), "core": core,
                        "blendable": ~(prob > 0.5),
                        **{f"distance_{axis}": per_axis[axis] for axis in AXES}}

        self.interval_widening_ = calibrate_widening(
            frame, fit_predict, families=families, timed=timed, step=step,
            coverage=self.quantiles[1] - self.quantiles[0])

    def calibrate(self, frame: pd.DataFrame) -> PerformanceModel:
        """Few-shot calibration: a family's own measurements (a handful: one node's campaign)
        move its predictions without a refit.

        Per measurement family of ``frame`` (see :func:`source_family`), the median log ratio
        of its measured to predicted step times becomes the family's efficiency factor,
        shrunk toward 1 by ``n / (n + 1)`` for ``n`` rows; the family's interval margin
        becomes the spread of those rows around it (the 90th percentile of the absolute log
        residual), in place of the margin of a family without measurements. Calibrating
        again with more rows of a family replaces its factor.

        Args:
            frame: Measurement rows; those without a measured step time are not used.

        Returns:
            ``self``.

        Raises:
            DatasetError: no row of ``frame`` has a measured step time and a prediction.
        """
        self._check_fitted()
        step = measured_step_time(frame)
        families = self._families(frame)  # as predict tells them apart
        saved, self.family_offsets_ = self.family_offsets_, {
            f: v for f, v in self.family_offsets_.items() if f not in set(families)}
        try:
            pred = self.predict(frame)["pred_step_time_s"].to_numpy(float)
        except BaseException:
            self.family_offsets_ = saved
            raise
        with np.errstate(divide="ignore", invalid="ignore"):
            log_ratio = np.log(step / pred)
        usable = np.isfinite(log_ratio)
        if not usable.any():
            self.family_offsets_ = saved
            raise DatasetError("calibrate: no row with a measured step time and a prediction")
        for family in np.unique(families[usable]):
            r = log_ratio[usable & (families == family)]
            n = len(r)
            offset = float(np.median(r)) * n / (n + 1.0)
            spread = float(np.quantile(np.abs(r - offset), 0.9)) if n > 1 else abs(offset)
            self.family_offsets_[str(family)] = {"log_factor": offset, "margin": spread,
                                                 "rows": n}
        return self

    def _fit_time(self, X: np.ndarray, y: np.ndarray) -> tuple[Any, Any, Any]:
        """Median booster, clipped refinement and quantile booster of the log time ratio."""
        median = _xgb_regressor(self._booster_params(),
                                objective="reg:absoluteerror").fit(X, y)
        residual = np.clip(y - median.predict(X), -self.refine_clip, self.refine_clip)
        refine = _xgb_regressor(self._booster_params(rate=0.1), base_score=0.0,
                                objective="reg:squarederror").fit(X, residual)
        quantile = _xgb_regressor(self._booster_params(aux=True), objective="reg:quantileerror",
                                  quantile_alpha=np.asarray(self.quantiles, dtype=float)
                                  ).fit(X, y)
        return median, refine, quantile

    def _fit_stall(self, X: np.ndarray, pipeline: np.ndarray, stalled: np.ndarray,
                   per_micro: np.ndarray, *, monotone: str | None = None
                   ) -> tuple[Any, Any, Any]:
        """Classifier of stalling among pipeline runs (keeping the ``monotone`` directions
        where given), then the median and quantile boosters of a stalled run's log time per
        micro-batch."""
        import xgboost as xgb

        extra = {"monotone_constraints": monotone} if monotone else {}
        classifier = xgb.XGBClassifier(tree_method="hist", objective="binary:logistic",
                                       **self._classifier_params(stalled[pipeline]), **extra
                                       ).fit(X[pipeline], stalled[pipeline])
        median = _xgb_regressor(self._booster_params(aux=True), objective="reg:absoluteerror"
                                ).fit(X[stalled], per_micro[stalled])
        quantile = _xgb_regressor(self._booster_params(aux=True), objective="reg:quantileerror",
                                  quantile_alpha=np.asarray(self.quantiles, dtype=float)
                                  ).fit(X[stalled], per_micro[stalled])
        return classifier, median, quantile

    @staticmethod
    def _origin(frame: pd.DataFrame) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Each row's hardware (catalogue spelling) and source family (``""`` for a row
        without a source, which goes by its hardware), ``None`` where the frame has no such
        column: what :meth:`_route` and :meth:`_stall_free` go by."""
        hardware = _catalogue_names(frame["hardware"]) if "hardware" in frame.columns else None
        families = (source_family(frame, missing="") if "source" in frame.columns
                    else None)
        return hardware, families

    def _route(self, n: int, hardware: np.ndarray | None, families: np.ndarray | None
               ) -> np.ndarray:
        """Family model per row (see :meth:`_origin`): its source's family, else the one
        family its hardware was measured in; ``""`` (the model fitted on everything)
        otherwise."""
        import pandas as pd

        out = np.full(n, "", dtype=object)
        if not self.families_:
            return out
        if hardware is not None:
            out = pd.Series(hardware, dtype=object).map(self.hardware_family_).fillna(
                "").to_numpy(dtype=object)
        if families is not None:
            known = np.isin(families, list(self.families_))
            out = np.where(known, families, out)
        return out

    def _stall_free(self, n: int, hardware: np.ndarray | None, families: np.ndarray | None
                    ) -> np.ndarray:
        """Which rows (see :meth:`_origin`) belong to a family whose pipelines did not stall
        in the training data: by the row's source where its family was in the training
        data, else by its hardware (see ``stall_free_hardware_``)."""
        out = np.zeros(n, dtype=bool)
        if not self.stall_free_families_:
            return out
        if hardware is not None:
            out = np.isin(hardware, self.stall_free_hardware_)
        if families is not None:
            known = np.isin(families, list(self.pipeline_runs_))
            out = np.where(known, np.isin(families, self.stall_free_families_), out)
        return out

    def _memory_gb(self, X: np.ndarray, analytical: dict[str, Any]) -> np.ndarray:
        if self.memory_ is None:
            return analytical["memory_gb"]
        return analytical["memory_gb"] * np.exp(self.memory_.predict(X[:, _MEMORY_COLUMNS]))

    def _feasibility_matrix(self, frame: pd.DataFrame) -> np.ndarray:
        c = F.Columns(frame)
        X, analytical = F.compute_features(c)
        return self._augment(X, self._memory_gb(X, analytical), c.memory_gb)

    @staticmethod
    def _augment(X: np.ndarray, memory_gb: np.ndarray, capacity: np.ndarray) -> np.ndarray:
        """The feasibility classifier's matrix: the features and the log2 predicted memory
        fraction."""
        with np.errstate(divide="ignore", invalid="ignore"):
            fraction = np.log2(memory_gb / capacity)
        # no catalogued memory (the CPU: 0 GB) is a missing value to the trees, as in X
        fraction[~np.isfinite(fraction)] = np.nan
        return np.column_stack([X, fraction]).astype(np.float32)

    # ------------------------------------------------------------------ predict
    def _predict_arrays(self, frame: pd.DataFrame, c: F.Columns, X: np.ndarray,
                        analytical: dict[str, Any]) -> dict[str, np.ndarray]:
        import pandas as pd

        base = analytical["step_time_s"]
        ratio = np.zeros(len(X))
        bounds = np.zeros((len(X), 2))
        # a model of one family, with none held free of stalls, goes by neither
        origin = (self._origin(frame) if self.families_ or self.stall_free_families_
                  else (None, None))
        route = self._route(len(X), *origin)
        # configurations of a model in the training data (of any family, for the stalled
        # regime; of the row's family, for its family's step-time model)
        keys = F.model_keys(c)
        seen = pd.Series(keys).isin(self.seen_models_).to_numpy()
        for family in np.unique(route):
            in_family = (seen if not family
                         else pd.Series(keys).isin(self.family_seen_[family]).to_numpy())
            for known in (True, False):
                rows = (route == family) & (in_family == known)
                if not rows.any():
                    continue
                if known:
                    boosters = (self.families_[family] if family else
                                (self.throughput_, self.refine_, self.quantile_))
                    Xr = X[rows]
                else:
                    boosters = self.family_transfer_[family] if family else self.transfer_
                    Xr = X[rows][:, _TRANSFER_COLUMNS]
                median, refine, quantile = boosters
                ratio[rows] = median.predict(Xr) + refine.predict(Xr)
                q = np.asarray(quantile.predict(Xr)).reshape(int(rows.sum()), -1)
                bounds[rows] = q[:, [0, -1]]
        step = base * np.exp(ratio)
        lo = base * np.exp(np.minimum(bounds[:, 0], ratio))
        # the learned lower bound knows no physics: no step on an accelerator is faster than
        # its model FLOPs at the device's peak (100% MFU)
        lo = np.minimum(np.maximum(lo, np.where(c.accelerator, F.step_time_at_mfu(c), 0.0)),
                        step)
        hi = base * np.exp(np.maximum(bounds[:, -1], ratio))
        expected = step
        # each row's family and doublings beyond the training ranges, once
        where = self._distance(frame, c)
        # without a learned stalled regime the model cannot tell its probability: NaN, as
        # from predictors that do not model it (not 0, which would claim it never stalls)
        prob = np.full(len(X), np.nan)
        if self.stall_ is not None:
            prob, stall, stall_lo, stall_hi = self._stall(
                c, X, F.stall_features(c), seen,
                self._stall_free(len(X), *origin))
            # the stall is a fixed cost per micro-batch: where the normal regime's step
            # already takes longer than the learned stalled one, that cost hides behind the
            # compute and the regime vanishes
            prob = np.where(stall <= step, 0.0, prob)
            # a stalled run is by definition slower than the stall thresholds, and no faster
            # than the same configuration not stalling: for a model larger than any trained
            # on, the learned cost per micro-batch alone can fall below its normal step
            floor = np.maximum(F.stall_floor_s(c), step)
            stall, stall_lo, stall_hi = (np.maximum(t, floor)
                                         for t in (stall, stall_lo, stall_hi))
            # the more likely regime is the point prediction; the expected time weighs both
            expected = np.where(prob > 0, (1.0 - prob) * step + prob * stall, step)
            lower, upper = self.quantiles[0], self.quantiles[-1]
            # where stalling is likelier than the upper quantile's tail, that quantile of the
            # step time lies in the stalled regime (and the lower one where it is likelier
            # than the lower quantile's complement)
            # beyond the fitted ranges the classifier's probability is no guide (it has
            # called deep pipelines of larger models both ways): the slow end of the interval
            # holds the stalled regime wherever the family stalls at all
            unsure = (sum(where[1].values()) > 0) & (prob > 0)
            hi = np.where((prob > 1.0 - upper) | unsure, np.maximum(hi, stall_hi), hi)
            lo = np.where(prob > 1.0 - lower, np.minimum(lo, stall_lo), lo)
            step = np.where(prob > 0.5, stall, step)
            lo, hi = np.minimum(lo, step), np.maximum(hi, step)
        step, lo, hi, expected, distance, warning = self._extrapolate(
            frame, c, analytical, step, lo, hi, expected, prob, where)
        memory = self._memory_gb(X, analytical)
        capacity = c.memory_gb
        known = np.isfinite(capacity) & (capacity > 0)
        if self.feasibility_ is not None:
            # the classifier learned from devices with a memory size; where none is
            # catalogued (the CPU) no memory limit is known, as without a classifier
            learned = self.feasibility_.predict_proba(self._augment(X, memory,
                                                                    capacity))[:, 1]
            feasible = np.where(known, learned, 1.0)
        else:
            # no failed runs to learn from: the memory estimate alone; no memory limit is
            # known for uncatalogued device memory (the CPU)
            feasible = np.where(known, _memory_rule(memory, capacity), 1.0)
        return {"step": step, "step_lo": lo, "step_hi": hi, "step_expected": expected,
                "stall_prob": prob, "memory": memory, "feasible": feasible,
                "distance": distance, "warning": warning}

    def _distance(self, frame: pd.DataFrame, c: F.Columns | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Each row's family, doublings outside the training ranges per axis and whether its
        family is unmeasured (see :func:`paratune.models._extrapolation.distance`)."""
        from paratune.models._extrapolation import axis_values, distance

        families = self._families(frame)
        per_axis, unknown = distance(axis_values(frame, c), families,
                                     self.extrapolation_ranges_)
        return families, per_axis, unknown

    def _families(self, frame: pd.DataFrame) -> np.ndarray:
        """Each row's family as the step-time models route it: by its source, else the one
        family its hardware was measured in, else ``""`` (no family: the overall ranges and
        the default core constants)."""
        import pandas as pd

        families = (source_family(frame, missing="") if "source" in frame.columns
                    else np.full(len(frame), "", dtype=object))
        if "hardware" in frame.columns and (families == "").any():
            by_hardware = pd.Series(_catalogue_names(frame["hardware"]), dtype=object).map(
                self.hardware_family_).fillna("").to_numpy(dtype=object)
            families = np.where(families == "", by_hardware, families)
        return families

    def _extrapolate(self, frame: pd.DataFrame, c: F.Columns, analytical: dict[str, Any],
                     step: np.ndarray, lo: np.ndarray, hi: np.ndarray, expected: np.ndarray,
                     prob: np.ndarray, where: tuple[np.ndarray, dict[str, np.ndarray],
                                                    np.ndarray]
                     ) -> tuple[np.ndarray, ...]:
        """Each row's distance from the training ranges; the learned prediction shrunk
        toward the calibrated core with it, its family's few-shot factor, and the interval
        widened by the calibrated margins (see :meth:`_fit_widening`)."""
        from paratune.models._extrapolation import _distinct, blend_factor

        families, per_axis, unknown = where
        dist = sum(per_axis.values())
        entries = [self.interval_widening_.get(str(f), self.interval_widening_[""])
                   for f in _distinct(families)]
        if any(e.get("shrink_per_doubling", 0.0) or e.get("core_weight_family", 0.0)
               for e in entries):
            rate, weight = np.zeros(len(step)), np.zeros(len(step))
            for family in _distinct(families):
                entry = self.interval_widening_.get(str(family), self.interval_widening_[""])
                rate[families == family] = entry.get("shrink_per_doubling", 0.0)
                weight[families == family] = entry.get("core_weight_family", 0.0)
            # the point in the stalled regime is the stall's time, not the core's business
            core = self._core_step(frame, c, analytical, families)
            shrink = blend_factor(step, core, dist, unknown,
                                  ~(prob > 0.5), rate=rate, family_weight=weight)
            step, lo, hi, expected = step * shrink, lo * shrink, hi * shrink, expected * shrink
        keys = [f"{side}_{axis}" for side in ("hi", "lo") for axis in per_axis]
        margins = {key: np.zeros(len(step)) for key in (*keys, "hi_family", "lo_family")}
        for family in _distinct(families):
            rows = families == family
            entry = self.interval_widening_.get(str(family), self.interval_widening_[""])
            for key, values in margins.items():
                values[rows] = entry[key]
        # the margin per doubling of each axis, times the doublings beyond its range
        beyond = {side: sum(margins[f"{side}_{axis}"] * d for axis, d in per_axis.items())
                  for side in ("hi", "lo")}
        hi_margin = beyond["hi"] + margins["hi_family"] * unknown
        lo_margin = beyond["lo"] + margins["lo_family"] * unknown
        factor = np.ones(len(step))
        calibrated = np.zeros(len(step), dtype=bool)
        for family, entry in self.family_offsets_.items():
            rows = families == family
            if not rows.any():
                continue
            calibrated |= rows
            factor[rows] = np.exp(entry["log_factor"])
            # its own rows' spread, in place of an unmeasured family's margin
            hi_margin[rows] = beyond["hi"][rows] + entry["margin"]
            lo_margin[rows] = beyond["lo"][rows] + entry["margin"]
        step, expected = step * factor, expected * factor
        hi = hi * factor * np.exp(hi_margin)
        # no faster than the model FLOPs at the device's peak, as the learned bound
        floor = np.where(c.accelerator, F.step_time_at_mfu(c), 0.0)
        lo = np.minimum(np.maximum(lo * factor * np.exp(-lo_margin),
                                   np.fmin(floor, lo * factor)), step)
        # the texts once per distinct value (100,000 rows hold a few dozen)
        warning = np.full(len(step), "", dtype=object)
        beyond = dist > 0
        if beyond.any():
            warning[beyond] = F._lookup(
                np.round(dist[beyond], 1),
                lambda d: "" if d is None else (
                    f"beyond the fitted model, cluster and batch sizes by {d:.1f} "
                    "doublings: interval widened"), dtype=object)
        fresh = unknown & ~calibrated
        if fresh.any():
            warning[fresh] = F._lookup(
                families[fresh],
                lambda f: "" if f is None else (
                    f"no measurement of family {f}: predicted from other families' runs, "
                    "interval widened"), dtype=object)
        return step, lo, hi, expected, dist, warning

    def _stall(self, c: F.Columns, X: np.ndarray, X_stall: np.ndarray, seen: np.ndarray,
               stall_free: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Probability of the stalled regime, and the median, lower and upper quantiles of
        the step time in it (zero probability and NaN times off pipelines and on the
        ``stall_free`` rows): from the features ``X`` for the models trained on, from the
        regime's physics ``X_stall`` (:func:`~paratune.models.features.stall_features`) for
        the others."""
        n = len(X)
        prob = np.zeros(n)
        per_micro = np.full((n, 3), np.nan)
        pipeline = (c.pp > 1) & c.accelerator & ~stall_free
        for known in (True, False):
            rows = pipeline & (seen == known)
            if not rows.any():
                continue
            classifier, median, quantile = self.stall_ if known else self.stall_transfer_
            Xr = X[rows] if known else X_stall[rows]
            prob[rows] = classifier.predict_proba(Xr)[:, 1]
            q = np.asarray(quantile.predict(Xr)).reshape(int(rows.sum()), -1)
            per_micro[rows] = np.column_stack([median.predict(Xr), q[:, 0], q[:, -1]])
        times = F.num_microbatches(c)[:, None] * np.exp(per_micro)
        return prob, times[:, 0], times[:, 1], times[:, 2]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the model as a directory of XGBoost JSON files and a manifest.

        The manifest (``model.json``) holds the schema version, feature names, parameters,
        the training-data fingerprint, the component files and the SHA-256 of each. Written
        file by file with atomic replaces; a manifest already there goes first and the new one
        is written last, so a half-written directory (also one saved over another model) does
        not load. The save holds the directory's lock (``.model.lock``) throughout: saves into
        one directory take turns (the last one's model is what stays), and a :meth:`load`
        waits for the save to end.

        Args:
            path: Directory (created if missing).

        Returns:
            The directory.

        Raises:
            ConfigError: another process kept the directory locked for over a minute.
            OSError: the directory or its lock file cannot be written.
        """
        self._check_fitted()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        components = {"throughput": self.throughput_, "throughput_refine": self.refine_,
                      "throughput_quantiles": self.quantile_,
                      "memory": self.memory_, "feasibility": self.feasibility_}
        for name, booster in zip(_TIME_COMPONENTS, self.transfer_):
            components[f"transfer-{name}"] = booster
        if self.stall_ is not None:
            for name, booster in zip(_STALL_COMPONENTS, self.stall_):
                components[name] = booster
            for name, booster in zip(_STALL_COMPONENTS, self.stall_transfer_):
                components[f"transfer-{name}"] = booster
        for family, boosters in self.families_.items():
            for name, booster in zip(_TIME_COMPONENTS, boosters):
                components[f"family-{family}-{name}"] = booster
            for name, booster in zip(_TIME_COMPONENTS, self.family_transfer_[family]):
                components[f"family-{family}-transfer-{name}"] = booster
        params = self.get_params()
        params["quantiles"] = list(params["quantiles"])
        with _directory_lock(path, "saving"):
            # temporaries of a save killed part-way (not of one in flight where flock is
            # missing): the boosters' and the manifest's (paratune._io's atomic writes)
            for leftover in [*path.glob(".*.tmp.json"), *path.glob(f".{_MANIFEST}.*.tmp")]:
                with contextlib.suppress(OSError):
                    if leftover.stat().st_mtime < time.time() - 60:
                        leftover.unlink()
            # saving over another model: without its manifest the directory does not load
            # until this one's manifest is written, never as a mixture of the two models' files
            (path / _MANIFEST).unlink(missing_ok=True)
            files, digests = {}, {}
            for name, booster in components.items():
                if booster is None:
                    continue
                target = path / f"{name}.json"
                # a name of its own (XGBoost picks the format from the .json suffix)
                tmp = path / f".{name}.{secrets.token_hex(4)}.tmp.json"
                try:
                    booster.save_model(str(tmp))
                    with open(tmp, "rb") as handle:
                        digests[name] = hashlib.sha256(handle.read()).hexdigest()
                        os.fsync(handle.fileno())
                    tmp.replace(target)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                files[name] = target.name
            manifest = {
                "kind": "paratune.PerformanceModel",
                "schema_version": SCHEMA_VERSION,
                "paratune_version": __version__,
                "feature_names": list(F.FEATURE_NAMES),
                "feasibility_feature_names": [*F.FEATURE_NAMES, "log2_pred_mem_fraction"],
                "transfer_feature_names": list(F.TRANSFER_FEATURE_NAMES),
                "stall_transfer_feature_names": list(F.STALL_FEATURE_NAMES),
                "memory_feature_names": list(F.MEMORY_FEATURE_NAMES),
                "seen_models": self.seen_models_,
                "target": "log(measured_step_time_s / analytical_step_time_s)",
                "stall_target": "log(measured_step_time_s / num_microbatches) of stalled runs",
                "params": params,
                "components": files,
                "component_sha256": digests,
                "families": sorted(self.families_),
                "family_seen_models": self.family_seen_,
                "hardware_family": self.hardware_family_,
                "stall_free_families": self.stall_free_families_,
                "stall_free_hardware": self.stall_free_hardware_,
                "interval_widening": self.interval_widening_,
                "core_constants": self.core_constants_,
                "family_offsets": self.family_offsets_,
                "training": {"fingerprint_sha256": self.fingerprint_,
                             "num_rows": self.num_train_rows_,
                             "num_time_rows": self.num_time_rows_,
                             "num_memory_rows": self.num_memory_rows_,
                             "num_stall_rows": self.num_stall_rows_,
                             "pipeline_runs_and_stalls_by_family": self.pipeline_runs_,
                             "num_feasibility_configs": self.num_feasibility_rows_,
                             "sources": self.sources_, "ranges": self.training_ranges_,
                             "extrapolation_ranges": self.extrapolation_ranges_},
            }
            atomic_write_text(path / _MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            # the components of a model saved here before that this one lacks (a family, the
            # stall regime): the directory holds this model's files alone
            for file in path.glob("*.json"):
                if (file.name not in files.values() and file.name != _MANIFEST
                        and _COMPONENT_FILE.match(file.name)):
                    file.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | Path) -> PerformanceModel:
        """Load a directory written by :meth:`save`.

        Holds the directory's lock while it reads (waiting up to a minute for a save there to
        end), so a model being saved over loads as the old model or the new one. Where the
        lock cannot be taken (a read-only directory without the lock file) the files are read
        unlocked; either way each component must match the SHA-256 the manifest records, so
        files of two saves never load as one model.

        Raises:
            ModelFormatError: missing or corrupt files (or files another save changed), another
                schema version, or feature names that differ from this version's.
            ConfigError: another process kept the directory locked for over a minute.
        """
        path = Path(path)
        if not ((path / _MANIFEST).is_file() or (path / _LOCK_FILE).is_file()):
            # checked before locking: loading never creates a lock file where no model is
            raise ModelFormatError(f"{path}: not a saved performance model (no {_MANIFEST})")
        with contextlib.ExitStack() as stack:
            locked = False  # where the lock cannot be had, the files are checked twice
            # OSError: a read-only directory without the lock file (nor a save there), or
            # another user's private lock file
            with contextlib.suppress(OSError):
                locked = stack.enter_context(_directory_lock(path, "saving or loading"))
            try:
                return cls._load_files(path)
            except _ChangedError:
                if locked:
                    raise
            # unlocked, a save elsewhere may have rewritten a file since the manifest was
            # read: read the directory once more before calling it corrupt
            time.sleep(0.5)
            return cls._load_files(path)

    @classmethod
    def _load_files(cls, path: Path) -> PerformanceModel:
        """Read and check the manifest, then the model it describes."""
        manifest_path = path / _MANIFEST
        if not manifest_path.exists():
            raise ModelFormatError(f"{path}: not a saved performance model (no {_MANIFEST})")
        try:
            manifest = json.loads(_read_bounded(manifest_path, what="manifest",
                                                limit=_MAX_MANIFEST_BYTES))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{manifest_path}: corrupt manifest ({exc})") from None
        if not isinstance(manifest, dict):
            raise ModelFormatError(f"{manifest_path}: corrupt manifest (a JSON "
                                   f"{type(manifest).__name__}, not an object)")
        if manifest.get("kind") != "paratune.PerformanceModel":
            raise ModelFormatError(f"{manifest_path}: kind={manifest.get('kind')!r} is not "
                                   "paratune.PerformanceModel")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ModelFormatError(f"{manifest_path}: schema_version={version!r} but this "
                                   f"paratune reads schema_version={SCHEMA_VERSION}; refit it")
        if (manifest.get("feature_names") != list(F.FEATURE_NAMES)
                or manifest.get("transfer_feature_names") != list(F.TRANSFER_FEATURE_NAMES)
                or manifest.get("memory_feature_names") != list(F.MEMORY_FEATURE_NAMES)):
            raise ModelFormatError(f"{manifest_path}: feature_names differ from this paratune's "
                                   "features; refit the model")
        try:
            return cls._from_manifest(path, manifest)
        except ModelFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"{manifest_path}: corrupt manifest (bad or missing "
                                   f"entry {exc})") from None

    @classmethod
    def _from_manifest(cls, path: Path, manifest: dict[str, Any]) -> PerformanceModel:
        """The model a checked manifest describes (KeyError/TypeError where it is corrupt)."""
        import xgboost as xgb

        manifest_path = path / _MANIFEST
        params = dict(manifest["params"])
        params["quantiles"] = tuple(params["quantiles"])
        model = cls(**params)
        files = manifest["components"]
        # a model saved before the digests were recorded has none to check
        digests = manifest.get("component_sha256") or {}

        def booster(name: str, kind: type) -> Any:
            if name not in files:
                return None
            file = _component_file(path, name, files[name])
            try:
                data = _read_bounded(file, what=f"component {name!r}")
            except (FileNotFoundError, IsADirectoryError):
                raise _ChangedError(f"{file}: missing ({_MANIFEST} lists it as component "
                                    f"{name!r}); refit the model or restore the file"
                                    ) from None
            if name in digests and hashlib.sha256(data).hexdigest() != digests[name]:
                raise _ChangedError(f"{file}: corrupt: its content differs from the one "
                                    f"{_MANIFEST} records (SHA-256) for component {name!r}: "
                                    "changed after the save, or left by another save into "
                                    f"{path}; save or refit the model again")
            obj = kind()
            try:
                obj.load_model(bytearray(data))
            except (xgb.core.XGBoostError, OSError, ValueError, KeyError, TypeError) as exc:
                what = "classifier" if kind is xgb.XGBClassifier else "regressor"
                raise ModelFormatError(f"{file}: corrupt: not an XGBoost {what} "
                                       f"({_first_line(exc)}); refit the model") from None
            return obj

        def time_models(prefix: str) -> tuple[Any, Any, Any]:
            for name in _TIME_COMPONENTS:
                if prefix + name not in files:
                    raise ModelFormatError(f"{manifest_path}: component {prefix + name!r} "
                                           "missing")
            return tuple(booster(prefix + name, xgb.XGBRegressor) for name in _TIME_COMPONENTS)

        model.throughput_, model.refine_, model.quantile_ = time_models("")
        model.transfer_ = time_models("transfer-")
        model.seen_models_ = [str(k) for k in manifest.get("seen_models", [])]
        model.stall_ = model.stall_transfer_ = None
        if _STALL_COMPONENTS[0] in files:
            kinds = (xgb.XGBClassifier, xgb.XGBRegressor, xgb.XGBRegressor)

            def stall_models(prefix: str) -> tuple[Any, Any, Any]:
                for name in _STALL_COMPONENTS:
                    if prefix + name not in files:
                        raise ModelFormatError(f"{manifest_path}: component "
                                               f"{prefix + name!r} missing")
                return tuple(booster(prefix + name, kind)
                             for name, kind in zip(_STALL_COMPONENTS, kinds))

            model.stall_ = stall_models("")
            model.stall_transfer_ = stall_models("transfer-")
        model.memory_ = booster("memory", xgb.XGBRegressor)
        model.feasibility_ = booster("feasibility", xgb.XGBClassifier)
        model.families_ = {}
        model.family_transfer_ = {}
        for family in manifest.get("families", []):
            model.families_[family] = time_models(f"family-{family}-")
            model.family_transfer_[family] = time_models(f"family-{family}-transfer-")
        model.family_seen_ = {str(f): [str(k) for k in keys]
                              for f, keys in manifest["family_seen_models"].items()}
        model.hardware_family_ = dict(manifest.get("hardware_family", {}))
        model.stall_free_families_ = [str(f) for f in manifest["stall_free_families"]]
        model.stall_free_hardware_ = [str(h) for h in manifest["stall_free_hardware"]]
        training = manifest["training"]
        model.fingerprint_ = training["fingerprint_sha256"]
        model.num_train_rows_ = training["num_rows"]
        model.num_time_rows_ = training["num_time_rows"]
        model.num_memory_rows_ = training["num_memory_rows"]
        model.num_stall_rows_ = training["num_stall_rows"]
        model.pipeline_runs_ = {str(f): [int(n) for n in v] for f, v in
                                training["pipeline_runs_and_stalls_by_family"].items()}
        model.num_feasibility_rows_ = training["num_feasibility_configs"]
        model.sources_ = training["sources"]
        # a model saved before its training ranges were recorded has none
        model.training_ranges_ = training.get("ranges", {})
        model.extrapolation_ranges_ = {
            str(f): {str(a): [float(v) for v in r] for a, r in axes.items()}
            for f, axes in training["extrapolation_ranges"].items()}
        model.interval_widening_ = {
            str(f): {str(k): float(v) for k, v in margins.items()}
            for f, margins in manifest["interval_widening"].items()}
        model.core_constants_ = {str(f): [float(v) for v in values]
                                 for f, values in manifest["core_constants"].items()}
        model.family_offsets_ = {str(f): {"log_factor": float(e["log_factor"]),
                                          "margin": float(e["margin"]), "rows": int(e["rows"])}
                                 for f, e in manifest["family_offsets"].items()}
        return model


class _ChangedError(ModelFormatError):
    """A component file is missing or not the one the manifest records: another save may be
    rewriting the directory (see :meth:`PerformanceModel.load`)."""


def _directory_lock(path: Path, what: str) -> contextlib.AbstractContextManager[bool]:
    """The lock that saves into (and loads from) one model directory take turns on."""
    return exclusive_lock(path / _LOCK_FILE, field="path", value=str(path),
                          what=f"{what} a performance model there", wait_s=_LOCK_WAIT_S)


_XGB_LOCATION = re.compile(r"^\[[\d:]+\] [^:]*:\d+: ")


def _first_line(exc: BaseException) -> str:
    """The first line of an error without XGBoost's ``[time] source.cc:LINE:`` prefix (its
    messages go on with a C++ stack trace)."""
    lines = str(exc).strip().splitlines()
    return _XGB_LOCATION.sub("", lines[0]).strip() if lines else type(exc).__name__


_MAX_COMPONENT_BYTES = 1 << 30
"""The largest component file a model directory may hold (XGBoost JSON of a few MB)."""
_MAX_MANIFEST_BYTES = 16 << 20


def _component_file(path: Path, name: str, relative: Any) -> Path:
    """The file of component ``name``: a file name inside the model directory ``path``
    (neither a path elsewhere, absolute or through ``..``, nor a link out of it)."""
    if not isinstance(relative, str) or not relative or "/" in relative or "\\" in relative \
            or relative in (".", ".."):
        raise ModelFormatError(f"{path / _MANIFEST}: component {name!r} is {relative!r}, not "
                               f"the name of a file in {path}; refit the model")
    file = path / relative
    root = path.resolve()
    if file.resolve().parent != root:
        raise ModelFormatError(f"{file}: component {name!r} leads out of the model directory "
                               f"{path} (a link to {file.resolve()}); refit the model")
    return file


def _read_bounded(file: Path, *, what: str, limit: int | None = None) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes: a device, a FIFO or
    an oversized file is refused before it is read (it would hang or exhaust memory)."""
    import stat

    limit = _MAX_COMPONENT_BYTES if limit is None else limit
    info = os.stat(file)  # FileNotFoundError / IsADirectoryError: the caller's message
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(str(file))
    if not stat.S_ISREG(info.st_mode):
        raise ModelFormatError(f"{file}: the model's {what} is not a regular file (a device, "
                               "a FIFO or a socket); refit the model or restore the file")
    if info.st_size > limit:
        raise ModelFormatError(f"{file}: the model's {what} is {info.st_size} bytes, over the "
                               f"limit of {limit}; refit the model or restore the file")
    with open(file, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ModelFormatError(f"{file}: the model's {what} grew past {limit} bytes while "
                               "it was read")
    return data


def load_model(path: str | Path) -> PerformanceModel:
    """Load a :class:`PerformanceModel` saved with :meth:`PerformanceModel.save`."""
    return PerformanceModel.load(path)


# ---------------------------------------------------------------------------------- baselines
class AnalyticalBaseline(_Base):
    """The analytical estimate alone, scaled by one fitted efficiency (median measured /
    analytical ratio); feasibility and memory from the analytical memory estimate."""

    def fit(self, frame: pd.DataFrame) -> AnalyticalBaseline:
        _, analytical = F.compute_features(frame)
        step = measured_step_time(frame)
        ratio = step / analytical["step_time_s"]
        ratio = ratio[np.isfinite(ratio) & (ratio > 0)]
        if not len(ratio):
            raise DatasetError("no successful measurement with a step time on known hardware")
        self.scale_ = float(np.median(ratio))
        self.num_train_rows_ = len(frame)
        return self

    def _predict_arrays(self, frame: pd.DataFrame, c: F.Columns, X: np.ndarray,
                        analytical: dict[str, Any]) -> dict[str, np.ndarray]:
        memory = analytical["memory_gb"]
        return {"step": analytical["step_time_s"] * self.scale_, "memory": memory,
                "feasible": _memory_rule(memory, c.memory_gb)}


_RAW_NUMERIC = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
                "seq_len", "dp", "tp", "pp", "micro_batch_size", "global_batch_size",
                "world_size", "virtual_stages", "devices_per_node")


def _raw_matrix(frame: pd.DataFrame, c: F.Columns | None = None) -> np.ndarray:
    c = F.Columns(frame) if c is None else c
    cols = [np.asarray(frame[name], dtype=float) if name in frame.columns else np.full(c.n, np.nan)
            for name in _RAW_NUMERIC]
    cols += [c.sharding, c.recompute, c.schedule, c.mlp_matrices, c.peak_flops, c.memory_gb]
    return np.column_stack(cols).astype(np.float32)


class RawConfigBaseline(_Base):
    """XGBoost on the raw config columns, predicting log tokens per second per device, with a
    classifier for feasibility and a regressor for memory on the same columns.

    Args:
        n_estimators: Trees per booster.
        max_depth: Tree depth.
        learning_rate: Shrinkage.
        n_jobs: Threads.
        random_state: Seed.
    """

    def __init__(self, *, n_estimators: int = 400, max_depth: int = 6,
                 learning_rate: float = 0.05, n_jobs: int | None = None,
                 random_state: int = 0) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.n_jobs = n_jobs
        self.random_state = random_state

    def _params(self) -> dict[str, Any]:
        return {"n_estimators": self.n_estimators, "max_depth": self.max_depth,
                "learning_rate": self.learning_rate, "n_jobs": self.n_jobs,
                "random_state": self.random_state}

    def fit(self, frame: pd.DataFrame) -> RawConfigBaseline:
        import xgboost as xgb

        c = F.Columns(frame)
        X = _raw_matrix(frame, c)
        step = measured_step_time(frame)
        has_time = np.isfinite(step)
        if not has_time.any():
            raise DatasetError("no successful measurement with a step time")
        tps = c.global_batch * c.seq / (step * c.world)
        self.throughput_ = _xgb_regressor(self._params()).fit(X[has_time],
                                                               np.log(tps[has_time]))
        mem = measured_memory_gb(frame)
        self.memory_ = None
        if np.isfinite(mem).sum() >= 10:
            keep = np.isfinite(mem)
            self.memory_ = _xgb_regressor(self._params()).fit(X[keep], np.log(mem[keep]))
        table = feasibility_table(frame)
        self.feasibility_ = None
        if table["feasible"].nunique() == 2:
            self.feasibility_ = xgb.XGBClassifier(tree_method="hist", **self._params()).fit(
                _raw_matrix(table), table["feasible"].to_numpy())
        self.num_train_rows_ = len(frame)
        return self

    def _predict_arrays(self, frame: pd.DataFrame, c: F.Columns, X: np.ndarray,
                        analytical: dict[str, Any]) -> dict[str, np.ndarray]:
        raw = _raw_matrix(frame, c)
        tps = np.exp(self.throughput_.predict(raw))
        memory = (np.exp(self.memory_.predict(raw)) if self.memory_ is not None
                  else np.full(len(raw), np.nan))
        feasible = (self.feasibility_.predict_proba(raw)[:, 1] if self.feasibility_ is not None
                    else np.ones(len(raw)))
        return {"step": c.global_batch * c.seq / (tps * c.world), "memory": memory,
                "feasible": feasible}


class HistGradientBoostingBaseline(_Base):
    """scikit-learn HistGradientBoosting on the analytical features, same ratio targets as
    :class:`PerformanceModel` (no quantiles).

    Args:
        max_iter: Boosting iterations.
        learning_rate: Shrinkage.
        random_state: Seed.
    """

    def __init__(self, *, max_iter: int = 400, learning_rate: float = 0.05,
                 random_state: int = 0) -> None:
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.random_state = random_state

    def fit(self, frame: pd.DataFrame) -> HistGradientBoostingBaseline:
        from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

        X, analytical = F.compute_features(frame)
        step = measured_step_time(frame)
        has_time = np.isfinite(step) & np.isfinite(analytical["step_time_s"])
        if not has_time.any():
            raise DatasetError("no successful measurement with a step time on known hardware")
        kw = {"max_iter": self.max_iter, "learning_rate": self.learning_rate,
              "random_state": self.random_state}
        self.throughput_ = HistGradientBoostingRegressor(loss="absolute_error", **kw).fit(
            X[has_time], np.log(step[has_time] / analytical["step_time_s"][has_time]))
        mem = measured_memory_gb(frame)
        keep = np.isfinite(mem) & np.isfinite(analytical["memory_gb"])
        self.memory_ = None
        if keep.sum() >= 10:
            self.memory_ = HistGradientBoostingRegressor(loss="absolute_error", **kw).fit(
                X[keep], np.log(mem[keep] / analytical["memory_gb"][keep]))
        table = feasibility_table(frame)
        self.feasibility_ = None
        if table["feasible"].nunique() == 2:
            Xf, _ = F.compute_features(table)
            self.feasibility_ = HistGradientBoostingClassifier(**kw).fit(
                Xf, table["feasible"].to_numpy())
        self.num_train_rows_ = len(frame)
        return self

    def _predict_arrays(self, frame: pd.DataFrame, c: F.Columns, X: np.ndarray,
                        analytical: dict[str, Any]) -> dict[str, np.ndarray]:
        memory = analytical["memory_gb"] * (np.exp(self.memory_.predict(X))
                                            if self.memory_ is not None else 1.0)
        feasible = (self.feasibility_.predict_proba(X)[:, 1] if self.feasibility_ is not None
                    else _memory_rule(memory, c.memory_gb))
        return {"step": analytical["step_time_s"] * np.exp(self.throughput_.predict(X)),
                "memory": memory, "feasible": feasible}


def estimator_factories(*, n_estimators: int | None = None) -> dict[str, Any]:
    """Name -> zero-argument factory of every predictor ``paratune evaluate`` compares."""
    kw = {} if n_estimators is None else {"n_estimators": n_estimators}
    pm_kw = dict(kw)
    if n_estimators is not None:
        pm_kw["aux_estimators"] = min(100, max(n_estimators // 4, 10))
    hist_kw = {} if n_estimators is None else {"max_iter": n_estimators}
    return {
        "performance_model": lambda: PerformanceModel(**pm_kw),
        "analytical": AnalyticalBaseline,
        "xgb_raw_config": lambda: RawConfigBaseline(**kw),
        "hist_gradient_boosting": lambda: HistGradientBoostingBaseline(**hist_kw),
    }
