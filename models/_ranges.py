"""Beyond the training data, for :class:`~paratune.models.PerformanceModel`: the calibrated
analytical core per family, each row's distance from the fitted ranges, the shrinkage toward
the core and the widened interval (see :mod:`paratune.models._extrapolation`), and few-shot
calibration of a family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import DatasetError
from paratune.measurement import Status
from paratune.models import features as F
from paratune.models._base import (
    MEMORY_OOM_FLOOR,
    PRED_STALL_PROB,
    _catalogue_names,
    _family_by_hardware,
    hardware_families,
    memory_threshold,
    source_family,
)
from paratune.models._data import calibrated_fingerprint, measured_step_time, run_status
from paratune.models._feature_columns import _lookup
from paratune.predictor import PRED_PEAK_MEM_GB

if TYPE_CHECKING:
    import pandas as pd

    from paratune.models._estimators import PerformanceModel

__all__: list[str] = []


@dataclass
class _StepTimes:
    """A prediction's step times per row: the point, the interval around it and the
    expectation over the regimes a run may fall into."""

    step: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    expected: np.ndarray


class _Ranges:
    """The calibrated core, distances, shrinkage, widening and few-shot calibration (a mix-in
    of :class:`~paratune.models.PerformanceModel`)."""

    def _fit_core(self, c: F.Columns, analytical: dict[str, Any], families: np.ndarray,
                  rows: np.ndarray, step: np.ndarray, hardware: np.ndarray) -> None:
        """The calibrated analytical core's constants per family with enough ``rows`` (see
        :mod:`paratune.models._calibration`), and the one such family each hardware
        (catalogue spelling) was measured in, where one."""
        from paratune.models._calibration import (
            MIN_ROWS,
            constants_per_family,
            core_parts,
            fit_constants,
        )

        parts = core_parts(c, analytical)
        usable = rows & np.all(np.isfinite(parts), axis=1)
        self.core_constants_ = constants_per_family(
            families, usable, MIN_ROWS, lambda sel: fit_constants(parts[sel], step[sel]))
        self.core_hardware_family_ = hardware_families(hardware[rows], families[rows],
                                                       self.core_constants_)

    def _core_families(self, frame: pd.DataFrame, families: np.ndarray) -> np.ndarray:
        """Each row's family for the calibrated core: its own; for a row of no family
        (``""``) the one family a model was fitted on, else the one family with constants
        measured on its hardware, else still ``""`` (a well-tuned framework's defaults)."""
        if len(self.core_constants_) == 1:
            (only,) = self.core_constants_
            return np.where(families == "", only, families)
        if (families == "").any() and "hardware" in frame.columns:
            by_hardware = _family_by_hardware(_catalogue_names(frame["hardware"]),
                                              self.core_hardware_family_)
            families = np.where(families == "", by_hardware, families)
        return families

    def _core_step(self, frame: pd.DataFrame, c: F.Columns, analytical: dict[str, Any],
                   families: np.ndarray | None = None) -> np.ndarray:
        """The calibrated core's step time per row: its family's constants (see
        :meth:`_core_families` for a row of no family), the defaults of a well-tuned
        framework for a family without them."""
        from paratune.models._calibration import (
            core_parts,
            default_constants,
            predict_core,
            rows_constants,
        )

        families = self._families(frame) if families is None else families
        families = self._core_families(frame, families)
        constants = rows_constants(default_constants(c), self.core_constants_, families)
        well_tuned = ~np.isin(families, list(self.core_constants_))
        return predict_core(core_parts(c, analytical, well_tuned), constants)

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
            inner = type(self)(**{**self.get_params(), "nested_intervals": False})
            inner.fit(train)
            pred = inner.predict(test)
            _, per_axis, unknown = inner._distance(test)
            c_test = F.Columns(test)
            X_test, analytical_test = F.compute_features(c_test)
            core = inner._core_step(test, c_test, analytical_test)
            prob = pred[PRED_STALL_PROB].to_numpy(float)
            # the cross-family model's interval for the same rows (on the analytical
            # estimate): how it extrapolates is not how the family's own models do
            ratio, bounds = inner.step_time_.cross_family_.predict(X_test)
            base = analytical_test["step_time_s"]
            tokens = (test["global_batch_size"].to_numpy(float)
                      * test["seq_len"].to_numpy(float))
            world = np.asarray(c_test.world)
            with np.errstate(divide="ignore", invalid="ignore"):
                return {"step_hi": tokens / (pred[lower].to_numpy(float) * world),
                        "step_lo": tokens / (pred[upper].to_numpy(float) * world),
                        "unknown_family": unknown,
                        "step": pred["pred_step_time_s"].to_numpy(float), "core": core,
                        "step_hi_cross": base * np.exp(np.maximum(bounds[:, -1], ratio)),
                        "step_lo_cross": base * np.exp(np.minimum(bounds[:, 0], ratio)),
                        "blendable": ~(prob > 0.5),
                        **{f"distance_{axis}": per_axis[axis] for axis in AXES}}

        self.interval_widening_ = calibrate_widening(
            frame, fit_predict, families=families, timed=timed, step=step,
            coverage=self.quantiles[1] - self.quantiles[0])

    def calibrate(self, frame: pd.DataFrame) -> PerformanceModel:
        """Few-shot calibration: a family's own measurements (a handful: one node's campaign)
        move its predictions without a refit.

        Per measurement family of ``frame`` (see :func:`source_family`):

        * a family the model has no measurement of, with at least
          :data:`~paratune.models._calibration.FEW_SHOT_MIN_ROWS` runs, is predicted from its
          own two constants (:func:`~paratune.models._calibration.fit_few_shot`: an
          efficiency on the analytical step time and a fixed cost per layer pass) instead of
          another family's learned correction. Fitted without vTrain, 10 of its 2-GPU runs
          give its other runs a median APE of 9.3% this way, against 17.1% with a factor;
          Ultra-Scale from 10 of its one-node runs 34.9% against 39.6%. Beyond the ranges
          of those runs its interval widens at the prior rate per doubling;
        * otherwise the median log ratio of its measured to predicted step times becomes the
          family's efficiency factor, shrunk toward 1 by ``n / (n + 1)`` for ``n`` rows.

        The family's interval margin becomes the spread of its rows around the calibrated
        prediction (the 90th percentile of the absolute log residual; for its own two
        constants the prediction interval of a new run,
        :func:`~paratune.models._calibration.few_shot_margin`), in place of the margin of a
        family without measurements. Like a measured family's, its pipelines across nodes
        keep the stalled regime's threshold in their slow end until one of its calibrated
        runs is such a pipeline (``node_pipeline_families_``). A family whose
        runs ran out of memory, and whose feasibility the memory rule decides (not the
        feasibility classifier), gets the rule's threshold where its runs that ran and that
        ran out of memory part at the predicted memory
        (:func:`~paratune.models._base.memory_threshold`): configurations like the ones a
        verification saw fail are not recommended again. A run out of memory under
        :data:`~paratune.models._base.MEMORY_OOM_FLOOR` of device memory as predicted does
        not move it (:meth:`out_of_memory_left_out` names such runs). Calibrating again
        with more rows of a family replaces its calibration.

        Args:
            frame: Measurement rows; those with neither a measured step time nor the status
                ``oom`` are not used.

        Returns:
            ``self``.

        Raises:
            DatasetError: no row of ``frame`` has a measured step time and a prediction, nor
                ran out of memory at the floor or above.
        """
        from paratune.models._calibration import (
            FEW_SHOT_MIN_ROWS,
            few_shot_margin,
            few_shot_parts,
            fit_few_shot,
        )
        from paratune.models._extrapolation import axis_values, fit_ranges
        from paratune.models._stall_regime import _node_pipeline_families

        self._check_fitted()
        step = measured_step_time(frame)
        families = self._families(frame)  # as predict tells them apart
        timed_families = set(families[np.isfinite(step)])
        saved, self.family_offsets_ = self.family_offsets_, {
            f: v for f, v in self.family_offsets_.items() if f not in timed_families}
        try:
            predicted = self.predict(frame)
        except BaseException:
            self.family_offsets_ = saved
            raise
        pred = predicted["pred_step_time_s"].to_numpy(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_ratio = np.log(step / pred)
        usable = np.isfinite(log_ratio)
        c = F.Columns(frame)
        thresholds = self._memory_thresholds(frame, c, families, predicted)
        if not usable.any() and not thresholds:
            self.family_offsets_ = saved
            low = ((run_status(frame) == Status.OOM.value)
                   & ~np.isin(families, list(self.feasibility_families_))
                   & (_memory_shares(c, predicted) < MEMORY_OOM_FLOOR)).any()
            raise DatasetError("calibrate: no row with a measured step time and a prediction, "
                               "nor one that ran out of memory" + (
                                   f" at {100 * MEMORY_OOM_FLOOR:.0f}% of device memory or "
                                   "more as predicted (one under it says more of its status "
                                   "or device than of the memory)" if low else ""))
        # a family's runs replace its threshold (without an out-of-memory run: the default)
        self.memory_thresholds_ = {
            **{f: v for f, v in self.memory_thresholds_.items() if f not in set(families)},
            **thresholds}
        # and the devices it ran on, which a row of no family on them is then predicted as
        hardware = _catalogue_names(frame["hardware"])
        calibrated = set(families[usable]) | set(thresholds)
        self.calibrated_hardware_ = {
            **{f: v for f, v in self.calibrated_hardware_.items() if f not in calibrated},
            **{str(f): sorted({str(h) for h in hardware[families == f]}) for f in calibrated}}
        # and whether its pipelines ran across nodes (see _unmeasured_pipeline_slow_end)
        self.node_pipeline_families_ = sorted({*self.node_pipeline_families_,
                                               *_node_pipeline_families(
                                                   c, usable & (c.pp > 1) & c.accelerator,
                                                   families)})
        _, analytical = F.compute_features(c)
        parts = few_shot_parts(c, analytical)
        values = axis_values(frame, c)
        unmeasured = self._distance(frame, c)[2]
        for family in np.unique(families[usable]):
            rows = usable & (families == family)
            r = log_ratio[rows]
            n = len(r)
            shots = rows & np.all(np.isfinite(parts) & (parts > 0), axis=1)
            if shots.sum() >= FEW_SHOT_MIN_ROWS and unmeasured[rows].all():
                efficiency, pass_s = fit_few_shot(parts[shots], step[shots])
                r = np.log(step[shots] / (parts[shots] @ [efficiency, pass_s]))
                self.family_offsets_[str(family)] = {
                    "log_factor": 0.0, "margin": few_shot_margin(r, self.quantiles[-1]),
                    "rows": n, "efficiency": float(efficiency), "layer_pass_s": float(pass_s),
                    "ranges": fit_ranges(values, families, shots)[str(family)]}
                continue
            offset = float(np.median(r)) * n / (n + 1.0)
            spread = float(np.quantile(np.abs(r - offset), 0.9)) if n > 1 else abs(offset)
            self.family_offsets_[str(family)] = {"log_factor": offset, "margin": spread,
                                                 "rows": n}
        # another model's values than the fitted one's, whatever the rows fitted on
        self.fingerprint_ = calibrated_fingerprint(self.fingerprint_, frame)
        return self

    def _memory_thresholds(self, frame: pd.DataFrame, c: F.Columns, families: np.ndarray,
                           predicted: pd.DataFrame) -> dict[str, float]:
        """The memory rule's threshold per family of ``frame`` (columns ``c``) that ran out
        of memory there and that the rule decides for (not the feasibility classifier): where
        its runs that ran and ran out of memory part at the predicted memory
        (:func:`memory_threshold`)."""
        share, status = _memory_shares(c, predicted), run_status(frame)
        known = np.isfinite(share)
        out = {}
        for family in np.unique(families):
            rows = known & (families == family)
            oom = rows & (status == Status.OOM.value) & (share >= MEMORY_OOM_FLOOR)
            if oom.any() and str(family) not in self.feasibility_families_:
                out[str(family)] = memory_threshold(share[rows & (status == Status.OK.value)],
                                                    share[oom])
        return out

    def out_of_memory_left_out(self, frame: pd.DataFrame) -> dict[str, list[float]]:
        """Per family of ``frame``, the predicted shares of device memory of its runs out
        of memory that :meth:`calibrate` leaves out of its memory threshold (under
        :data:`~paratune.models._base.MEMORY_OOM_FLOOR`)."""
        families = self._families(frame)
        # a family whose feasibility the classifier decides has no threshold to leave out of
        oom = (run_status(frame) == Status.OOM.value) & ~np.isin(
            families, list(self.feasibility_families_))
        if not oom.any():
            return {}
        share = _memory_shares(F.Columns(frame), self.predict(frame))
        low = oom & (share < MEMORY_OOM_FLOOR)
        return {str(f): sorted(float(v) for v in share[low & (families == f)])
                for f in np.unique(families[low])}

    def _distance(self, frame: pd.DataFrame, c: F.Columns | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Each row's family, doublings outside the training ranges per axis and whether its
        family is unmeasured (see :func:`paratune.models._extrapolation.distance`)."""
        from paratune.models._extrapolation import axis_values, distance

        families = self._families(frame)
        values = axis_values(frame, c)
        per_axis, unknown = distance(values, families, self.extrapolation_ranges_)
        # a family predicted from its own few-shot constants is as sure as those runs reach
        for family, entry in self.family_offsets_.items():
            rows = families == family
            if "ranges" in entry and rows.any():
                own, _ = distance({axis: v[rows] for axis, v in values.items()},
                                  families[rows], {family: entry["ranges"]})
                for axis, doublings in own.items():
                    per_axis[axis][rows] = doublings
        return families, per_axis, unknown

    @property
    def measured_families_(self) -> list[str]:
        """The measurement families the model knows: those it was fitted on and those a
        few-shot calibration gave constants of their own. A row of another family (by its
        source) is predicted as a well-tuned framework."""
        fitted = {str(f) for f in getattr(self, "extrapolation_ranges_", {}) if f}
        return sorted(fitted | {str(f) for f in getattr(self, "family_offsets_", {})})

    def _families(self, frame: pd.DataFrame) -> np.ndarray:
        """Each row's family as the step-time models route it: by its source, else the one
        family its hardware was measured in, else ``""`` (no family: the overall ranges and
        the default core constants)."""
        families = (source_family(frame, missing="") if "source" in frame.columns
                    else np.full(len(frame), "", dtype=object))
        if "hardware" in frame.columns and (families == "").any():
            by_hardware = _family_by_hardware(_catalogue_names(frame["hardware"]),
                                              self._source_less_families())
            families = np.where(families == "", by_hardware, families)
        return families

    def _source_less_families(self) -> dict[str, str]:
        """The family a row without a source (a config ``tune`` ranks) is predicted as, by
        its hardware: the one family calibrated on it, whose runs are of the cluster at
        hand (a verification's, of paratune's trainer on the target cluster), else the one
        family fitted on it (:attr:`hardware_family_`)."""
        calibrated: dict[str, set[str]] = {}
        for family, names in self.calibrated_hardware_.items():
            for name in names:
                calibrated.setdefault(name, set()).add(family)
        return {**self.hardware_family_,
                **{name: next(iter(fams)) for name, fams in calibrated.items()
                   if len(fams) == 1}}

    def _extrapolate(self, frame: pd.DataFrame, c: F.Columns, analytical: dict[str, Any],
                     times: _StepTimes, prob: np.ndarray,
                     where: tuple[np.ndarray, dict[str, np.ndarray], np.ndarray],
                     cross: np.ndarray) -> tuple[_StepTimes, np.ndarray, np.ndarray]:
        """Each row's distance from the training ranges; the learned prediction shrunk
        toward the calibrated core with it, its family's few-shot factor, and the interval
        widened by the calibrated margins (see :meth:`_fit_widening`; the ``cross`` rows,
        those of the cross-family model, by that model's own margins per doubling).

        Returns:
            The step times, the doublings beyond the training ranges and a warning per row.
        """
        from paratune.models._extrapolation import _distinct, blend_distances, blend_factor

        step, lo, hi, expected = times.step, times.lo, times.hi, times.expected
        families, per_axis, unknown = where
        dist = sum(per_axis.values())
        rated, link, regime = blend_distances(per_axis)
        entries = [self.interval_widening_.get(str(f), self.interval_widening_[""])
                   for f in _distinct(families)]
        shrinks = any(e.get("shrink_per_doubling", 0.0) or e.get("core_weight_family", 0.0)
                      for e in entries)
        if shrinks or (link > 0).any() or (regime > 0).any():
            rate, weight = np.zeros(len(step)), np.zeros(len(step))
            for family in _distinct(families):
                entry = self.interval_widening_.get(str(family), self.interval_widening_[""])
                rate[families == family] = entry.get("shrink_per_doubling", 0.0)
                weight[families == family] = entry.get("core_weight_family", 0.0)
            # the point in the stalled regime is the stall's time, not the core's business
            core = self._core_step(frame, c, analytical, families)
            shrink = blend_factor(step, core, rated, unknown,
                                  ~(prob > 0.5), rate=rate, family_weight=weight, link=link,
                                  regime=regime)
            # the interval spans both the learned prediction and the one moved toward the
            # core: where they disagree, the data has not said which is right
            lo, hi = np.minimum(lo * shrink, lo), np.maximum(hi * shrink, hi)
            step, expected = step * shrink, expected * shrink
        keys = [f"{side}_{axis}" for side in ("hi", "lo") for axis in per_axis]
        margins = {key: np.zeros(len(step)) for key in (*keys, "hi_family", "lo_family")}
        for family in _distinct(families):
            rows = families == family
            entry = self.interval_widening_.get(str(family), self.interval_widening_[""])
            for key, values in margins.items():
                values[rows] = entry[key]
        # rows of the cross-family model: its own margins per doubling
        pooled = self.interval_widening_[""]
        for key in keys:
            side, axis = key.split("_", 1)
            margins[key] = np.where(cross, pooled.get(f"{side}_cross_{axis}", pooled[key]),
                                    margins[key])
        # the margin per doubling of each axis, times the doublings beyond its range
        beyond = {side: sum(margins[f"{side}_{axis}"] * d for axis, d in per_axis.items())
                  for side in ("hi", "lo")}
        hi_margin = beyond["hi"] + margins["hi_family"] * unknown
        lo_margin = beyond["lo"] + margins["lo_family"] * unknown
        factor = np.ones(len(step))
        calibrated = np.zeros(len(step), dtype=bool)
        # a family calibrated with its own two constants: their step, not the learned one
        few_shot = np.full(len(step), np.nan)
        shot_parts = None
        for family, entry in self.family_offsets_.items():
            rows = families == family
            if not rows.any():
                continue
            calibrated |= rows
            factor[rows] = np.exp(entry["log_factor"])
            # its own rows' spread, in place of an unmeasured family's margin
            hi_margin[rows] = beyond["hi"][rows] + entry["margin"]
            lo_margin[rows] = beyond["lo"][rows] + entry["margin"]
            if "efficiency" in entry:
                from paratune.models._calibration import few_shot_parts
                from paratune.models._extrapolation import PRIOR_MARGIN_PER_DOUBLING

                if shot_parts is None:
                    shot_parts = few_shot_parts(c, analytical)
                few_shot[rows] = shot_parts[rows] @ [entry["efficiency"], entry["layer_pass_s"]]
                # beyond its runs, no data of this family (the other families' widening
                # says how their models extrapolate, not how this one does): the prior
                prior = entry["margin"] + PRIOR_MARGIN_PER_DOUBLING * dist[rows]
                hi_margin[rows] = lo_margin[rows] = prior
        step, expected = step * factor, expected * factor
        own = np.isfinite(few_shot)
        step, expected = np.where(own, few_shot, step), np.where(own, few_shot, expected)
        lo, hi = np.where(own, few_shot, lo), np.where(own, few_shot, hi)
        hi = hi * factor * np.exp(hi_margin)
        # no faster than the model FLOPs at the device's peak: the point (a learned ratio far
        # from its data, e.g. a model too large for its devices, can put it there) and the
        # learned bound
        floor = np.where(c.accelerator, F.step_time_at_mfu(c), 0.0)
        step, expected = np.maximum(step, floor), np.maximum(expected, floor)
        hi = np.maximum(hi, step)
        lo = np.minimum(np.maximum(lo * factor * np.exp(-lo_margin),
                                   np.fmin(floor, lo * factor)), step)
        # beyond the fitted cluster sizes the data-parallel reduction's cost extrapolates
        # least surely (frameworks hide much of it behind the backward pass, nanotron at 32
        # nodes most of it): the fast end of the interval allows all of it hidden
        wider = per_axis["world_size"] > 0
        if wider.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.clip(np.nan_to_num(analytical["dp_s"] / analytical["step_time_s"]),
                                0.0, 1.0)
            hidden = np.maximum(step * (1.0 - share), floor)
            lo = np.where(wider, np.minimum(lo, hidden), lo)
        warning = _extrapolation_warnings(per_axis, unknown & ~calibrated, families)
        return _StepTimes(step, lo, hi, expected), dist, warning


_AXIS_WORDS = {"model_params": "model sizes", "world_size": "cluster sizes",
               "tokens_per_step": "tokens per step", "tp_nodes": "tensor-parallel node spans",
               "dp_nodes": "data-parallel node spans", "dp_regime": "data-parallel regimes",
               "cp": "context-parallel degrees"}
"""How a warning names each axis of :data:`~paratune.models._extrapolation.AXES`."""


def _distinct_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first row of each distinct row of ``values`` and each row's index among them:
    ``np.unique(axis=0)``'s result, from one integer key per row where the columns' distinct
    values allow (a tenth of its time on 100,000 rows)."""
    import pandas as pd

    codes, sizes = [], []
    for column in values.T:
        code, uniques = pd.factorize(column)
        codes.append(code)
        sizes.append(len(uniques))
    if float(np.prod(np.asarray(sizes, dtype=float))) >= 2.0 ** 62:
        _, first, inverse = np.unique(values, axis=0, return_index=True, return_inverse=True)
        return first, inverse.ravel()
    key = np.zeros(len(values), dtype=np.int64)
    for code, size in zip(codes, sizes, strict=True):
        key = key * size + code
    inverse, _ = pd.factorize(key)
    first = np.full(inverse.max() + 1 if len(inverse) else 0, -1, dtype=np.int64)
    first[inverse[::-1]] = np.arange(len(inverse))[::-1]
    return first, inverse


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _extrapolation_warnings(per_axis: dict[str, np.ndarray], fresh: np.ndarray,
                            families: np.ndarray) -> np.ndarray:
    """Why each row's prediction is less sure: the doublings beyond the fitted ranges, axis
    by axis (``beyond the fitted model sizes by 3.0 and cluster sizes by 1.0 doublings``),
    or a family with no measurement (``fresh``) and no few-shot calibration."""
    axes = list(per_axis)
    raw = np.column_stack([np.asarray(per_axis[a], dtype=float) for a in axes])
    # a tenth of a doubling at the least where a row is beyond an axis at all
    rounded = np.where(raw > 0, np.maximum(np.round(raw, 1), 0.1), 0.0)
    warning = np.full(len(rounded), "", dtype=object)
    beyond = (raw > 0).any(axis=1)
    if beyond.any():
        # the texts once per distinct combination (100,000 rows hold a few dozen)
        first, inverse = _distinct_rows(rounded[beyond])
        texts = np.asarray([f"beyond the fitted {_and(row)} doublings" for row in (
            [f"{_AXIS_WORDS.get(a, a)} by {d:.1f}" for a, d in zip(axes, values, strict=True)
             if d > 0] for values in rounded[beyond][first])], dtype=object)
        warning[beyond] = texts[inverse]
        # a fresh family's own text says the interval is widened
        alone = beyond & ~fresh
        warning[alone] = warning[alone] + ": interval widened"
    if fresh.any():
        family = _lookup(
            families[fresh],
            lambda f: "" if f is None else (
                f"no measurement of {f'family {f}' if f else 'any family on its hardware'}: "
                "predicted from other families' runs "
                "moved toward a well-tuned framework on its hardware (`paratune calibrate` "
                "on a few of its runs moves it), interval widened, memory and whether it "
                "fits by the analytical estimate"), dtype=object)
        # both where both hold: the family first, then how far beyond the fitted runs
        warning[fresh] = [f"{f}; {w}" if w else f
                          for f, w in zip(family, warning[fresh], strict=True)]
    return warning


def _memory_shares(c: F.Columns, predicted: pd.DataFrame) -> np.ndarray:
    """Each row's predicted peak memory as a share of its device's (NaN where either is
    unknown)."""
    capacity = np.asarray(c.memory_gb, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = predicted[PRED_PEAK_MEM_GB].to_numpy(float) / capacity
    return np.where(capacity > 0, share, np.nan)
