"""What every predictor of :mod:`paratune.models` shares: the prediction frame's columns, the
assembly of a predictor's arrays into that frame, measurement families and training ranges.

All predictors follow scikit-learn conventions: ``__init__`` stores keyword arguments,
``fit(frame)`` returns ``self``, learned state ends in ``_``. ``predict(frame)`` returns one
row per input row with :data:`paratune.predictor.PREDICTION_COLUMNS`, the throughput
quantiles and ``pred_error`` (empty where the row was predicted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn.base import BaseEstimator

from paratune.errors import ModelFormatError
from paratune.measurement import family_of
from paratune.models import features as F
from paratune.models._data import measured_step_time
from paratune.models._feature_columns import _lookup
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

__all__ = ["MEMORY_OOM_FLOOR", "MEMORY_RULE_THRESHOLD", "MEMORY_RULE_WIDTH", "OUTPUT_COLUMNS",
           "PRED_ERROR", "PRED_EXTRAPOLATION", "PRED_STALL_PROB", "PRED_TOKENS_Q10",
           "PRED_TOKENS_Q90", "PRED_WARNING", "memory_threshold", "source_family",
           "training_ranges"]

PRED_TOKENS_Q10 = f"{PRED_TOKENS_PER_SEC_PER_GPU}_q10"
PRED_TOKENS_Q90 = f"{PRED_TOKENS_PER_SEC_PER_GPU}_q90"
PRED_STALL_PROB = "pred_stall_prob"
PRED_ERROR = "pred_error"
PRED_EXTRAPOLATION = "pred_extrapolation_doublings"
"""How many doublings (summed over model size, cluster size, tokens per step, the nodes its
groups span, its data-parallel regime and its context-parallel degree: see
:data:`paratune.models._extrapolation.AXES`) a row lies outside the ranges the model was
fitted on (0 inside; NaN from predictors that do not say)."""
PRED_WARNING = "pred_warning"
"""Why a prediction is less sure than the model's in-range ones (empty where it is not)."""
OUTPUT_COLUMNS = (*PREDICTION_COLUMNS, PRED_TOKENS_Q10, PRED_TOKENS_Q90, PRED_TOKENS_EXPECTED,
                  PRED_STALL_PROB, "analytical_step_time_s", PRED_EXTRAPOLATION, PRED_WARNING,
                  PRED_ERROR)


def hardware_families(hardware: np.ndarray, families: np.ndarray, known: Any
                      ) -> dict[str, str]:
    """Each hardware name (catalogue spelling) measured in one family only, of those in
    ``known``, mapped to that family."""
    out: dict[str, str] = {}
    for name in np.unique(hardware):
        seen = np.unique(families[hardware == name])
        if len(seen) == 1 and str(seen[0]) in known:
            out[str(name)] = str(seen[0])
    return out


def _family_by_hardware(hardware: Any, hardware_family: dict[str, str]) -> np.ndarray:
    """Each hardware name's one measured family (``hardware_family``), ``""`` for the others
    (an object array; a plain ``fillna("")`` would fill the float column an empty mapping
    gives, which newer pandas refuses)."""
    import pandas as pd

    # each distinct name once (a frame of 100,000 configs holds a few)
    codes, names = pd.factorize(pd.Series(hardware, dtype=object))
    mapped = np.array([hardware_family.get(str(name), "") for name in names] + [""],
                      dtype=object)
    return mapped[codes]  # a missing name (code -1) gets the last, ""


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

    return _lookup(names, canonical, dtype=object)


def training_ranges(frame: pd.DataFrame, world: np.ndarray) -> dict[str, dict[str, list[int]]]:
    """Per device kind (catalogue name), the smallest and largest ``world_size`` (``world``:
    each row's, as :class:`~paratune.models.features.Columns` has it), ``global_batch_size``
    and tokens per step (global batch x sequence length) among the runs that measured a step
    time: where a model's predictions interpolate."""
    timed_rows = np.isfinite(measured_step_time(frame))
    timed = frame[timed_rows]
    if timed.empty:
        return {}
    hardware = _catalogue_names(timed["hardware"].to_numpy())
    values = {"world_size": np.asarray(world, dtype=float)[timed_rows],
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
    """The measurement family of each row's source (:func:`paratune.measurement.family_of`);
    ``missing`` where no source is recorded (paratune's own measurements name theirs)."""
    import pandas as pd

    if "source" not in frame.columns:
        return np.full(len(frame), missing, dtype=object)
    # once per distinct source: a frame of 100,000 rows holds a handful
    source = frame["source"]
    codes, sources = pd.factorize(source.astype(object).where(source.notna(), "").astype(str))
    family = [family_of(text, missing=missing) for text in sources]
    return np.asarray(family, dtype=object)[codes]


MEMORY_RULE_THRESHOLD = 0.95
"""The share of device memory at which the memory rule (:func:`_memory_rule`) gives even odds
of fitting, where a family's own out-of-memory runs have not moved it (see
:func:`memory_threshold`)."""
MEMORY_RULE_WIDTH = 0.03
"""How sharp the memory rule is: the odds of fitting fall by e per this share of device
memory past the threshold."""
MEMORY_OOM_FLOOR = MEMORY_RULE_THRESHOLD / 4
"""The least predicted share of device memory at which a run out of memory moves its
family's threshold (:meth:`~paratune.models.PerformanceModel.calibrate`, which passes
:func:`memory_threshold` only the runs at or above it): one under it would need the memory
prediction four times too low, which says more of a mislabelled status or another device
than of where the family's memory runs out, and would have every configuration of a few GB
called unable to run."""


def _memory_rule(mem_gb: np.ndarray, capacity_gb: np.ndarray,
                 threshold: np.ndarray | float = MEMORY_RULE_THRESHOLD) -> np.ndarray:
    """Probability of fitting in memory from a memory estimate alone (a soft threshold at
    ``threshold`` of the device memory, per row or one for all).

    Hardware without a catalogued capacity (the CPU: 0 GB) sets no limit: probability 1.
    """
    mem_gb = np.asarray(mem_gb, dtype=float)
    capacity_gb = np.broadcast_to(np.asarray(capacity_gb, dtype=float), mem_gb.shape)
    known = capacity_gb > 0
    fraction = np.divide(mem_gb, capacity_gb, out=np.zeros_like(mem_gb), where=known)
    with np.errstate(over="ignore", invalid="ignore"):
        prob = 1.0 / (1.0 + np.exp((fraction - threshold) / MEMORY_RULE_WIDTH))
    return np.where(known, prob, 1.0)


def memory_threshold(ran: np.ndarray, out_of_memory: np.ndarray) -> float:
    """The memory rule's threshold (a share of device memory) that a family's own runs
    say: the one that puts the fewest of them on the wrong side (a run that ran at or
    above it, one out of memory below it), of :data:`MEMORY_RULE_THRESHOLD`, the midpoints
    between their shares and just past each (by :data:`MEMORY_RULE_WIDTH`), the nearest to
    :data:`MEMORY_RULE_THRESHOLD` among equals: a family that ran out of memory at 85% of
    it is told so from 82%, not from halfway to the runs that fit.

    Args:
        ran: The predicted memory shares of its runs that ran.
        out_of_memory: Those of its runs that ran out of memory.
    """
    ran, oom = np.asarray(ran, dtype=float), np.asarray(out_of_memory, dtype=float)
    shares = np.sort(np.concatenate([ran, oom]))
    candidates = np.concatenate([[MEMORY_RULE_THRESHOLD], (shares[1:] + shares[:-1]) / 2,
                                 oom - MEMORY_RULE_WIDTH, ran + MEMORY_RULE_WIDTH])
    wrong = np.array([(ran >= t).sum() + (oom < t).sum() for t in candidates])
    best = candidates[wrong == wrong.min()]
    return float(best[np.argmin(np.abs(best - MEMORY_RULE_THRESHOLD))])


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
            # object columns, as built: pandas' string type would copy 100,000 strings into
            # Arrow, a tenth of predicting that many configs
            PRED_WARNING: pd.Series(np.where(failed, "", out.get("warning", "")),
                                    index=frame.index, dtype=object),
            PRED_ERROR: pd.Series(errors, index=frame.index, dtype=object),
        }, index=frame.index)
        numeric = [c for c in result.columns if c not in (PRED_ERROR, PRED_WARNING)]
        result.loc[failed, numeric] = np.nan
        return result


def _xgb_regressor(params: dict[str, Any], **extra: Any) -> Any:
    import xgboost as xgb

    return xgb.XGBRegressor(tree_method="hist", **params, **extra)

