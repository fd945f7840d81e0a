"""Predictors of step time, throughput, memory and feasibility.

:class:`PerformanceModel` is the one the tuner uses: XGBoost learns the ratio of measured
step time and peak memory to its family's calibrated core (the analytical estimate with a
few constants fitted per family) from the features of :mod:`paratune.models.features`, so
its predictions scale with the physics where the configuration leaves the range of the
training data. The baselines are kept for comparison in ``paratune evaluate``.

All follow scikit-learn conventions: ``__init__`` stores keyword arguments, ``fit(frame)``
returns ``self``, learned state ends in ``_``. ``predict(frame)`` returns one row per input
row with :data:`paratune.predictor.PREDICTION_COLUMNS`, the throughput quantiles and
``pred_error`` (empty where the row was predicted).
"""


from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import DatasetError
from paratune.measurement import Status
from paratune.models import features as F
from paratune.models._base import (
    MEMORY_RULE_THRESHOLD,
    OUTPUT_COLUMNS,
    PRED_ERROR,
    PRED_EXTRAPOLATION,
    PRED_STALL_PROB,
    PRED_TOKENS_Q10,
    PRED_TOKENS_Q90,
    PRED_WARNING,
    _Base,
    _catalogue_names,
    _memory_rule,
    source_family,
    training_ranges,
)
from paratune.models._baselines import (
    AnalyticalBaseline,
    HistGradientBoostingBaseline,
    RawConfigBaseline,
)
from paratune.models._calibration import constants_per_family, rows_constants
from paratune.models._components import (
    FamilyRouter,
    FeasibilityEstimator,
    MemoryEstimator,
    StepTimeEstimator,
)
from paratune.models._data import (
    canonical_order,
    feasibility_table,
    measured_memory_gb,
    measured_step_time,
    run_status,
    training_fingerprint,
)
from paratune.models._memory_estimate import (
    MEMORY_MIN_ROWS,
    default_memory_constants,
    fit_memory_constants,
    memory_core_gb,
)
from paratune.models._persistence import SCHEMA_VERSION, _Persistence
from paratune.models._ranges import _Ranges, _StepTimes
from paratune.models._stall_regime import _StallRegime
from paratune.predictor import PRED_TOKENS_EXPECTED, PRED_TOKENS_PER_SEC_PER_GPU

if TYPE_CHECKING:
    from pathlib import Path

    import pandas as pd

__all__ = [
    "OUTPUT_COLUMNS",
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
"""``OUTPUT_COLUMNS`` and ``PRED_*`` are defined in :mod:`paratune.models._base`, the saved
format and :data:`SCHEMA_VERSION` in :mod:`paratune.models._persistence`, the stalled regime
in :mod:`paratune.models._stall_regime`, what happens beyond the training data in
:mod:`paratune.models._ranges` and the baselines in :mod:`paratune.models._baselines`; they are
importable from here as before."""

_TRANSFER_COLUMNS = [F.FEATURE_NAMES.index(name) for name in F.TRANSFER_FEATURE_NAMES]
_MEMORY_COLUMNS = [F.FEATURE_NAMES.index(name) for name in F.MEMORY_FEATURE_NAMES]
_MEMORY_MONOTONE = "({})".format(",".join(str(F.MEMORY_MONOTONE.get(name, 0))
                                          for name in F.MEMORY_FEATURE_NAMES))

MIN_FEASIBILITY_CONFIGS = 5
"""Configurations that ran and that failed a measurement family needs, each, for the
feasibility classifier to decide for its rows (else the memory threshold decides)."""


def _few_shot_rows(families: np.ndarray, timed: np.ndarray) -> np.ndarray:
    """The rows of a family with fewer timed runs than its own core constants need
    (:data:`~paratune.models._calibration.MIN_ROWS`), where another family has them: a
    handful of a new framework's runs beside the measured frameworks'. Fitted on, they made
    their family a measured one, predicted by the others' learned correction on a
    well-tuned framework's core (two of vTrain's runs beside Ultra-Scale's read its other
    runs 2.3x too slow, median APE 126%); calibrated on, their family is predicted as a
    well-tuned framework moved by them (15.1%). ``families``: each row's
    (:func:`source_family`); ``timed``: whether it has a measured step time."""
    from paratune.models._calibration import MIN_ROWS

    counts = {f: int((timed & (families == f)).sum()) for f in np.unique(families)}
    if max(counts.values(), default=0) < MIN_ROWS:
        return np.zeros(len(families), dtype=bool)
    return np.isin(families, [f for f, n in counts.items() if n < MIN_ROWS])


class PerformanceModel(_Persistence, _StallRegime, _Ranges, _Base):
    """XGBoost on analytical features, predicting measured step times as residuals of
    the calibrated analytical core.

    * step time: ``core * exp(g(x))``, ``g`` fitted to ``log(measured / core)``, ``core`` the
      calibrated analytical core of the row's measurement family
      (:mod:`paratune.models._calibration`: the physics with a few efficiency constants
      fitted per family, collectives across nodes reduced hierarchically, a fixed cost per
      layer pass), so the trees learn what the physics misses rather than the physics
      itself, and a larger model or cluster moves the prediction the way the core does; a
      row of a family without measurements on the overall model's route goes to the
      cross-family model, fitted to ``log(measured / analytical)`` (the analytical estimate
      at peak: what carries across frameworks is a correction of the bare physics, not of
      another framework's fitted constants). Fitted on the bare analytical estimate, the
      trees had to learn each family's fixed cost per layer pass as a ratio: from
      Ultra-Scale's 1B, a 16-way tensor-parallel group over two nodes at 3x the estimate,
      carried to its 8B, which has twice the layer passes but four times the estimate's
      traffic, 1.7x too slow. Ultra-Scale 1B -> 8B, median APE over seeds 0-4: 26.7% ->
      21.1% (with the core's shares as features, see
      :data:`~paratune.models.features.FEATURE_NAMES`). ``g``: half the trees with an
      absolute-error objective (the median ratio, robust to the pathological runs public
      sweeps contain), then half with a squared-error objective on
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
      given the small models' stalls, and beyond the fitted model sizes falling by e per
      doubling of parameters (like the learned step-time correction, the regime does not
      dominate where it has no data; the interval's slow end still holds it). Where the
      normal regime's step already takes longer than the learned stalled one, the fixed
      cost hides behind the compute and the probability is 0. Stalling belongs to how a
      framework runs its pipelines: a measurement family with at least ``min_stall_rows``
      pipeline runs, none of them stalled, keeps a stall probability of 0
      (``stall_free_families_``, by a row's source, else by its hardware) also on layouts
      it was not measured on. A pipeline across nodes of a family none of whose measured
      pipelines crossed one (``node_pipeline_families_``) keeps the stall threshold in its
      interval's slow end: a regime the family never ran;
    * peak memory: ``core * exp(m(x))`` where memory was measured, ``core`` the family's
      calibrated memory core (``memory_constants_``, see
      :mod:`paratune.models._memory_estimate`; the analytical estimate for a family with
      fewer than 20 runs that report memory), ``m`` on the
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
      chosen on nested extrapolation splits of the training rows (the margins so that
      each nested split covers the target share). Beyond the fitted cluster sizes the
      interval's fast end allows the data-parallel reduction hidden behind the backward
      pass. A family without measurements is flagged (``pred_warning``) and its interval
      widened;
      :meth:`calibrate` refits a family's efficiency factor from a few of its runs;
    * feasibility: an XGBoost classifier on the features and the predicted memory fraction,
      trained on successful and failed runs (a configuration that ran at least once is
      feasible), for the rows of a family that showed both outcomes
      (:data:`MIN_FEASIBILITY_CONFIGS` configurations of each, ``feasibility_families_``);
      a soft threshold on predicted memory for the others (a family without failed runs,
      or with a handful: two failed verification runs of a new family had the classifier
      call its configurations that run infeasible by their hardware alone). A family
      without measurements is priced as a well-tuned framework: the analytical memory
      estimate and the threshold.

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

    def _booster_params(self, *, aux: bool = False) -> dict[str, Any]:
        return {"n_estimators": self.aux_estimators if aux else max(self.n_estimators // 2, 1),
                "max_depth": self.max_depth,
                "learning_rate": self.aux_learning_rate if aux else self.learning_rate,
                "subsample": self.subsample,
                "colsample_bytree": self.colsample_bytree,
                "min_child_weight": self.min_child_weight, "n_jobs": self.n_jobs,
                "random_state": self.random_state}

    # read-only views of the step-time router's parts, under their earlier names
    @property
    def throughput_(self) -> Any:
        """The overall step-time model's median booster."""
        return self.step_time_.overall_.median_

    @property
    def refine_(self) -> Any:
        """The overall step-time model's refinement booster."""
        return self.step_time_.overall_.refine_

    @property
    def quantile_(self) -> Any:
        """The overall step-time model's quantile booster."""
        return self.step_time_.overall_.quantile_

    @property
    def transfer_(self) -> tuple[Any, Any, Any]:
        """The boosters of the overall step-time model for models not trained on."""
        return self.step_time_.overall_transfer_.boosters

    @property
    def families_(self) -> dict[str, tuple[Any, Any, Any]]:
        """The boosters of each family's step-time model."""
        return {f: e.boosters for f, e in self.step_time_.families_.items()}

    @property
    def family_transfer_(self) -> dict[str, tuple[Any, Any, Any]]:
        """The boosters of each family's step-time model for models it did not measure."""
        return {f: e.boosters for f, e in self.step_time_.family_transfer_.items()}

    @property
    def hardware_family_(self) -> dict[str, str]:
        """The one family each hardware was measured in, where only one."""
        return self.step_time_.hardware_family_

    # ------------------------------------------------------------------ fit
    def fit(self, frame: pd.DataFrame) -> PerformanceModel:
        """Fit on measurement rows (:meth:`paratune.Measurement.to_row` columns).

        A family with fewer timed runs than its own core constants need, beside one that
        has them (a few verification runs of a new framework), is not fitted on: the model
        is fitted on the others and calibrated on its runs (:meth:`calibrate`), so it is
        predicted as a well-tuned framework moved by them.

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
        self._check_quantiles()
        frame = canonical_order(frame)
        timed = np.isfinite(measured_step_time(frame))
        families = source_family(frame)
        few = _few_shot_rows(families, timed)
        self._fit_rows(frame[~few].reset_index(drop=True) if few.any() else frame)
        # the model names every row it was given, the calibrated ones too
        self.num_train_rows_ = len(frame)
        self.sources_ = (sorted(frame["source"].dropna().astype(str).unique().tolist())
                         if "source" in frame.columns else [])
        self.fingerprint_ = training_fingerprint(frame)
        shots = few & (timed | (run_status(frame) == Status.OOM.value))
        if shots.any():
            # a handful of a new framework's runs beside the measured frameworks' (a
            # verification's): calibrated on, as `calibrate` does, not fitted on, its runs
            # out of memory too; under the family fit gave them (a run without a source is
            # paratune's own, where `calibrate`, like `predict`, would take it for its
            # hardware's family)
            # where none of them moves anything (runs out of memory far under their
            # predicted memory, which fit_model names): fitted as if they were not there
            with contextlib.suppress(DatasetError):
                self.calibrate(frame[shots].assign(source=families[shots]))
            self.fingerprint_ = training_fingerprint(frame)  # the rows given, as any fit
        return self

    def _fit_rows(self, frame: pd.DataFrame) -> None:
        """:meth:`fit` on rows in canonical order, each family with runs enough of its own."""
        c = F.Columns(frame)
        X, analytical = F.compute_features(c)
        usable = np.asarray(analytical["error"] == "") & np.isfinite(
            analytical["step_time_s"]) & (analytical["step_time_s"] > 0)
        step = measured_step_time(frame)
        timed = usable & np.isfinite(step)
        if not timed.any():
            raise DatasetError("no successful measurement with a step time on known hardware")
        keys = F.model_keys(c)
        families = source_family(frame)
        hardware = _catalogue_names(frame["hardware"])
        # the runs of the normal regime (the timed ones, less the stalled where it is learned)
        has_time = self._fit_stall_regime(c, X, step, timed, families, hardware)
        # the learned correction is a residual of each row's family's calibrated core; the
        # cross-family model's, of the analytical estimate (see _predict_arrays)
        self._fit_core(c, analytical, families, has_time, step, hardware)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.log(step / self._core_step(frame, c, analytical, families))
            y_cross = np.log(step / analytical["step_time_s"])
        has_time &= np.isfinite(y)
        self.step_time_ = FamilyRouter(
            estimator=StepTimeEstimator(params=self._booster_params(),
                                        aux_params=self._booster_params(aux=True),
                                        refine_clip=self.refine_clip, quantiles=self.quantiles),
            transfer_columns=_TRANSFER_COLUMNS, min_family_rows=self.min_family_rows,
        ).fit(X[has_time], y[has_time], keys=keys[has_time], families=families[has_time],
              hardware=hardware[has_time], seen_models=np.unique(keys[timed]),
              y_cross=y_cross[has_time])
        has_mem = self._fit_memory(frame, X, analytical, families, usable)
        table = self._fit_feasibility(frame, usable)
        self.num_time_rows_ = int(has_time.sum()) + self.num_stall_rows_
        self.num_memory_rows_ = int(has_mem.sum())
        self.num_feasibility_rows_ = len(table)
        self.training_ranges_ = training_ranges(frame, c.world)
        self.family_offsets_ = {}
        self.memory_thresholds_ = {}
        self.calibrated_hardware_ = {}
        self._fit_widening(frame, families, timed, step)

    def _fit_memory(self, frame: pd.DataFrame, X: np.ndarray, analytical: dict[str, Any],
                    families: np.ndarray, usable: np.ndarray) -> np.ndarray:
        """The calibrated memory core's constants per family with enough runs that report
        memory (see :mod:`paratune.models._memory_estimate`), and the peak-memory correction
        over it (with ten runs or more); returns the rows it learned from."""
        mem = measured_memory_gb(frame)
        parts = analytical["memory_parts"]
        has_mem = usable & np.isfinite(mem) & (mem > 0) & np.isfinite(parts).all(axis=(1, 2))
        self.memory_constants_ = constants_per_family(
            families, has_mem, MEMORY_MIN_ROWS,
            lambda rows: fit_memory_constants(parts[rows], mem[rows]))
        self.memory_ = None
        if has_mem.sum() >= 10:
            y_mem = np.log(mem[has_mem] / self._memory_core(parts, families)[has_mem])
            self.memory_ = MemoryEstimator(
                params=self._booster_params(aux=True), columns=_MEMORY_COLUMNS,
                monotone=_MEMORY_MONOTONE).fit(X[has_mem], y_mem)
        return has_mem

    def _memory_core(self, parts: np.ndarray, families: np.ndarray) -> np.ndarray:
        """The calibrated memory core's peak per row in GB from its
        :func:`~paratune.models._memory_estimate.memory_parts`: its family's constants, the
        analytical estimate's for a family without them."""
        constants = rows_constants(np.tile(default_memory_constants(), (len(parts), 1)),
                                   self.memory_constants_, families)
        return memory_core_gb(parts, constants)

    def _fit_feasibility(self, frame: pd.DataFrame, usable: np.ndarray) -> pd.DataFrame:
        """The feasibility classifier (where configurations both ran and failed); returns the
        per-configuration table it learned from."""
        table = feasibility_table(frame[usable].reset_index(drop=True))
        labels = table["feasible"].to_numpy()
        self.feasibility_ = None
        self.feasibility_families_ = []
        if len(np.unique(labels)) == 2:
            Xf = self._feasibility_matrix(table)
            self.feasibility_ = FeasibilityEstimator(
                params=self._booster_params(aux=True)).fit(Xf, labels)
            families = source_family(table)
            self.feasibility_families_ = sorted(
                str(f) for f in np.unique(families)
                if min((labels[families == f] == 1).sum(), (labels[families == f] == 0).sum())
                >= MIN_FEASIBILITY_CONFIGS)
        return table

    def _memory_gb(self, X: np.ndarray, core_gb: np.ndarray) -> np.ndarray:
        """The predicted peak memory: the memory core's (:meth:`_memory_core`) times the
        learned correction."""
        if self.memory_ is None:
            return core_gb
        return core_gb * np.exp(self.memory_.predict(X))

    def _feasibility_matrix(self, frame: pd.DataFrame) -> np.ndarray:
        c = F.Columns(frame)
        X, analytical = F.compute_features(c)
        core = self._memory_core(analytical["memory_parts"], source_family(frame))
        return self._augment(X, self._memory_gb(X, core), c.memory_gb)

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
        # a model of one family, with none held free of stalls, goes by neither
        router = self.step_time_
        origin = (self._origin(frame) if router.families_ or self.stall_free_families_
                  else (None, None))
        # configurations of a model in the training data (of any family, for the stalled
        # regime; of the row's family, for its family's step-time model)
        keys = F.model_keys(c)
        seen = router.seen(keys)
        # each row's family and doublings beyond the training ranges, once
        where = self._distance(frame, c)
        route = router.route(len(X), *origin)
        # the family whose core the learned ratio multiplies: its route's, else its own; a
        # row of no known family on the overall route is the cross-family model's, like one
        # of a family without measurements (no core of its framework to correct)
        core_family = self._core_families(frame, np.where(route != "", route, where[0]))
        unmeasured = where[2] | (core_family == "")
        # a row of no family on hardware no family was measured on is such a row too: its
        # interval widened and its warning given as for a family without measurements
        where = (where[0], where[1], unmeasured)
        cross = router.cross(route, unmeasured)
        ratio, bounds = router.predict(X, keys, route, seen, unmeasured=cross)
        base = np.where(cross, analytical["step_time_s"],
                        self._core_step(frame, c, analytical, core_family))
        # the learned ratio knows no physics: no step on an accelerator is faster than its
        # model FLOPs at the device's peak (100% MFU), neither the point (far from the data,
        # e.g. a model too large for its devices, the ratio can put it there) nor the bound
        floor = np.where(c.accelerator, F.step_time_at_mfu(c), 0.0)
        step = np.maximum(base * np.exp(ratio), floor)
        lo = base * np.exp(np.minimum(bounds[:, 0], ratio))
        lo = np.minimum(np.maximum(lo, floor), step)
        hi = np.maximum(base * np.exp(np.maximum(bounds[:, -1], ratio)), step)
        expected = step
        # without a learned stalled regime the model cannot tell its probability: NaN, as
        # from predictors that do not model it (not 0, which would claim it never stalls)
        prob = np.full(len(X), np.nan)
        if self.stall_ is not None:
            prob, step, lo, hi, expected = self._blend_stall(
                c, X, seen, self._stall_free(*origin, unmeasured=unmeasured), step, lo, hi,
                where)
        times, distance, warning = self._extrapolate(
            frame, c, analytical, _StepTimes(step, lo, hi, expected), prob, where, cross)
        own = np.where(where[0] != "", where[0], core_family)
        # a family calibrated on runs of its own has measurements, as a fitted one has:
        # where its pipelines have not crossed nodes in them, nothing says they do not stall
        times.hi = self._unmeasured_pipeline_slow_end(
            c, own, ~np.isin(own, self.measured_families_), times.step, times.hi)
        # a framework without measurements is priced as a well-tuned one in memory too: the
        # analytical estimate, and whether it fits by the memory rule, not the overheads and
        # failures of the frameworks measured (learned from nanotron and Megatron-DeepSpeed,
        # they called 143 of llm-foundry's 191 published runs out of memory)
        memory = np.where(unmeasured, analytical["memory_gb"],
                          self._memory_gb(X, self._memory_core(analytical["memory_parts"],
                                                               own)))
        # at the family's own threshold where its out-of-memory runs set one (calibrate)
        threshold = np.full(len(X), MEMORY_RULE_THRESHOLD)
        for family, value in self.memory_thresholds_.items():
            threshold[where[0] == family] = value
        feasible = _memory_rule(memory, c.memory_gb, threshold)
        # the classifier decides for a measured family that showed it both outcomes
        learned = ~unmeasured & np.isin(own, self.feasibility_families_)
        if learned.any():
            feasible[learned] = self._classified(X[learned], memory[learned],
                                                 np.asarray(c.memory_gb)[learned])
        return {"step": times.step, "step_lo": times.lo, "step_hi": times.hi,
                "step_expected": times.expected,
                "stall_prob": prob, "memory": memory,
                "feasible": feasible,
                "distance": distance, "warning": warning}

    def _classified(self, X: np.ndarray, memory: np.ndarray, capacity: np.ndarray
                    ) -> np.ndarray:
        """The feasibility classifier's probability that each configuration runs."""
        known = np.isfinite(capacity) & (capacity > 0)
        # the classifier learned from devices with a memory size; where none is catalogued
        # (the CPU) no memory limit is known, as by the memory rule
        learned = self.feasibility_.predict_proba(self._augment(X, memory, capacity))
        return np.where(known, learned, 1.0)

def load_model(path: str | Path) -> PerformanceModel:
    """Load a :class:`PerformanceModel` saved with :meth:`PerformanceModel.save`."""
    return PerformanceModel.load(path)


def estimator_factories(*, n_estimators: int | None = None, random_state: int = 0
                        ) -> dict[str, Any]:
    """Name -> zero-argument factory of every predictor ``paratune evaluate`` compares
    (``random_state``: the seed of each learned one's row and feature subsampling)."""
    kw: dict[str, Any] = {"random_state": random_state}
    if n_estimators is not None:
        kw["n_estimators"] = n_estimators
    pm_kw = dict(kw)
    if n_estimators is not None:
        pm_kw["aux_estimators"] = min(100, max(n_estimators // 4, 10))
    hist_kw: dict[str, Any] = {"random_state": random_state}
    if n_estimators is not None:
        hist_kw["max_iter"] = n_estimators
    return {
        "performance_model": lambda: PerformanceModel(**pm_kw),
        "analytical": AnalyticalBaseline,
        "xgb_raw_config": lambda: RawConfigBaseline(**kw),
        "hist_gradient_boosting": lambda: HistGradientBoostingBaseline(**hist_kw),
    }
