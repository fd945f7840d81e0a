"""Baselines :class:`~paratune.models.PerformanceModel` is compared with in ``paratune
evaluate``: the analytical estimate alone, XGBoost on raw config columns, and scikit-learn's
HistGradientBoosting on the analytical features."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import DatasetError
from paratune.models import features as F
from paratune.models._base import _Base, _memory_rule, _xgb_regressor
from paratune.models._data import feasibility_table, measured_memory_gb, measured_step_time

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["AnalyticalBaseline", "HistGradientBoostingBaseline", "RawConfigBaseline"]


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
    """scikit-learn HistGradientBoosting on the analytical features, learning the log ratio
    of measured step time and memory to the analytical estimate (no quantiles).

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

