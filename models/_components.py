"""The small estimators a :class:`~paratune.models.PerformanceModel` is composed of, and the
router that gives each row its measurement family's step-time model.

Each follows scikit-learn: ``__init__`` stores its keyword arguments, ``fit`` returns
``self``, learned state ends in ``_``. Their saved form is that of
:mod:`paratune.models._component_store` (XGBoost JSON per booster, the rest in the manifest).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import BaseEstimator

from paratune.models._base import _family_by_hardware, _xgb_regressor, hardware_families

__all__ = ["FamilyRouter", "FeasibilityEstimator", "MemoryEstimator", "StallRegimeEstimator",
           "StepTimeEstimator", "classifier_params"]


def classifier_params(params: dict[str, Any], labels: np.ndarray) -> dict[str, Any]:
    """A classifier's booster parameters: ``min_child_weight`` counts rows for the regressors
    (each weighs 1), but a row weighs ``p (1 - p)`` to a logistic booster, so here it is
    scaled by that weight at the labels' base rate. Unscaled, a few failed runs among many
    that ran (a small campaign: 17 out-of-memory configs in 180) could share no leaf, and the
    classifier gave every config the base rate."""
    rate = float(np.mean(labels))
    return {**params, "min_child_weight": params["min_child_weight"] * rate * (1.0 - rate)}


def _select(X: np.ndarray, columns: list[int] | None) -> np.ndarray:
    """The feature ``columns`` of ``X`` (``None``: all)."""
    return X if columns is None else X[:, columns]


def _quantile_alpha(quantiles: Any) -> np.ndarray:
    return np.asarray(quantiles, dtype=float)


class StepTimeEstimator(BaseEstimator):
    """The log ratio of measured to analytical step time: a median booster
    (absolute error), a refinement on its residuals clipped to ``refine_clip`` (squared
    error) and a booster of the lower and upper quantiles.

    Args:
        params: The median and refinement boosters' parameters (the refinement's learning
            rate is 0.1).
        aux_params: The quantile booster's parameters.
        refine_clip: Residuals (in log ratio) are clipped to this for the refinement.
        quantiles: The two quantiles of the log ratio to predict.
        columns: The feature columns it learns from (``None``: all).
    """

    def __init__(self, *, params: dict[str, Any] | None = None,
                 aux_params: dict[str, Any] | None = None, refine_clip: float = 0.2,
                 quantiles: tuple[float, float] = (0.1, 0.9),
                 columns: list[int] | None = None) -> None:
        self.params = params
        self.aux_params = aux_params
        self.refine_clip = refine_clip
        self.quantiles = quantiles
        self.columns = columns

    def fit(self, X: np.ndarray, y: np.ndarray) -> StepTimeEstimator:
        """Fit the three boosters on the features ``X`` and log ratios ``y``."""
        X = _select(X, self.columns)
        params, aux = dict(self.params or {}), dict(self.aux_params or {})
        self.median_ = _xgb_regressor(params, objective="reg:absoluteerror").fit(X, y)
        residual = np.clip(y - self.median_.predict(X), -self.refine_clip, self.refine_clip)
        self.refine_ = _xgb_regressor({**params, "learning_rate": 0.1}, base_score=0.0,
                                      objective="reg:squarederror").fit(X, residual)
        self.quantile_ = _xgb_regressor(aux, objective="reg:quantileerror",
                                        quantile_alpha=_quantile_alpha(self.quantiles)
                                        ).fit(X, y)
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The log ratio per row and its lower and upper quantiles (``(n, 2)``)."""
        X = _select(X, self.columns)
        ratio = self.median_.predict(X) + self.refine_.predict(X)
        q = np.asarray(self.quantile_.predict(X)).reshape(len(X), -1)
        return ratio, q[:, [0, -1]]

    @property
    def boosters(self) -> tuple[Any, Any, Any]:
        """The median, refinement and quantile boosters."""
        return self.median_, self.refine_, self.quantile_


class StallRegimeEstimator(BaseEstimator):
    """The stalled-pipeline regime: a classifier of the probability that a pipeline run
    stalls (keeping the ``monotone`` directions where given), and the median and quantile
    boosters of a stalled run's log time per micro-batch.

    Args:
        params: The three boosters' parameters (the classifier's ``min_child_weight`` scaled
            by :func:`classifier_params`).
        quantiles: The two quantiles of the stalled time to predict.
        monotone: XGBoost monotone constraints of the classifier (``None``: none).
    """

    def __init__(self, *, params: dict[str, Any] | None = None,
                 quantiles: tuple[float, float] = (0.1, 0.9),
                 monotone: str | None = None) -> None:
        self.params = params
        self.quantiles = quantiles
        self.monotone = monotone

    def fit(self, X: np.ndarray, per_micro: np.ndarray, *, pipeline: np.ndarray,
            stalled: np.ndarray) -> StallRegimeEstimator:
        """Fit the classifier on the ``pipeline`` rows (labels ``stalled``) and the time
        boosters on the ``stalled`` rows' log time per micro-batch ``per_micro``."""
        import xgboost as xgb

        params = dict(self.params or {})
        extra = {"monotone_constraints": self.monotone} if self.monotone else {}
        self.classifier_ = xgb.XGBClassifier(
            tree_method="hist", objective="binary:logistic",
            **classifier_params(params, stalled[pipeline]), **extra
        ).fit(X[pipeline], stalled[pipeline])
        self.median_ = _xgb_regressor(params, objective="reg:absoluteerror"
                                      ).fit(X[stalled], per_micro[stalled])
        self.quantile_ = _xgb_regressor(params, objective="reg:quantileerror",
                                        quantile_alpha=_quantile_alpha(self.quantiles)
                                        ).fit(X[stalled], per_micro[stalled])
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The probability of stalling per row, and the median, lower and upper quantiles
        of the log time per micro-batch in the stalled regime (``(n, 3)``)."""
        prob = self.classifier_.predict_proba(X)[:, 1]
        q = np.asarray(self.quantile_.predict(X)).reshape(len(X), -1)
        return prob, np.column_stack([self.median_.predict(X), q[:, 0], q[:, -1]])


class MemoryEstimator(BaseEstimator):
    """The log ratio of measured peak memory to the family's calibrated memory core (the
    analytical estimate for a family without constants): one booster (absolute error) on
    the feature ``columns``, held to the ``monotone`` directions.

    Args:
        params: The booster's parameters.
        columns: The feature columns it learns from (``None``: all).
        monotone: XGBoost monotone constraints over those columns (``None``: none).
    """

    def __init__(self, *, params: dict[str, Any] | None = None,
                 columns: list[int] | None = None, monotone: str | None = None) -> None:
        self.params = params
        self.columns = columns
        self.monotone = monotone

    def fit(self, X: np.ndarray, y: np.ndarray) -> MemoryEstimator:
        """Fit on the features ``X`` and log memory ratios ``y``."""
        extra = {"monotone_constraints": self.monotone} if self.monotone else {}
        self.booster_ = _xgb_regressor(dict(self.params or {}), objective="reg:absoluteerror",
                                       **extra).fit(_select(X, self.columns), y)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        """The log memory ratio per row."""
        return self.booster_.predict(_select(X, self.columns))


class FeasibilityEstimator(BaseEstimator):
    """The probability that a configuration runs: a logistic booster on successful and
    failed configurations.

    Args:
        params: The booster's parameters (``min_child_weight`` scaled by
            :func:`classifier_params`).
    """

    def __init__(self, *, params: dict[str, Any] | None = None) -> None:
        self.params = params

    def fit(self, X: np.ndarray, labels: np.ndarray) -> FeasibilityEstimator:
        """Fit on the matrix ``X`` and the labels (1: ran)."""
        import xgboost as xgb

        self.classifier_ = xgb.XGBClassifier(
            tree_method="hist", objective="binary:logistic",
            **classifier_params(dict(self.params or {}), labels)).fit(X, labels)
        return self

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """The probability per row that the configuration runs."""
        return self.classifier_.predict_proba(X)[:, 1]


class FamilyRouter(BaseEstimator):
    """Step-time models per measurement family, and which row goes to which.

    One :class:`StepTimeEstimator` on all rows (``overall_``) and, where the data mixes
    families, one per family with ``min_family_rows`` rows (``families_``); each twice: on
    all features for the models (``keys``) it was trained on, and on the transfer columns
    for the others (``overall_transfer_``, ``family_transfer_``). A row goes to its
    family's model (see :meth:`route`), else to the overall one.

    A row of a family with no measurement that goes to the overall model goes to a third
    twin, ``cross_family_``: the transfer model with ``cross_family_trees`` of its trees, and
    its own target (``y_cross``: the ratio to the analytical estimate where the others learn
    the ratio to their family's calibrated core). What
    holds across frameworks is the coarse part of the correction; the finer trees learn the
    measured family's own habits, which another framework does not share. Fitted without
    vTrain and predicting it, half the trees gave a median APE of 22.7% against 24.7% (mean
    of three seeds), and Ultra-Scale from vTrain 37.8% against 38.0%.

    Args:
        estimator: The step-time estimator on all features, cloned for each fit.
        transfer_columns: The columns its twin for unseen models learns from.
        min_family_rows: Rows a family needs for models of its own.
        cross_family_trees: The share of the step-time trees of the model for families
            without measurements.
    """

    def __init__(self, *, estimator: StepTimeEstimator | None = None,
                 transfer_columns: list[int] | None = None, min_family_rows: int = 200,
                 cross_family_trees: float = 0.5) -> None:
        self.estimator = estimator
        self.transfer_columns = transfer_columns
        self.min_family_rows = min_family_rows
        self.cross_family_trees = cross_family_trees

    def _transfer(self, trees: float = 1.0) -> StepTimeEstimator:
        """An unfitted transfer twin of the estimator, with ``trees`` of its trees."""
        from sklearn.base import clone

        transfer = clone(self.estimator).set_params(columns=self.transfer_columns)
        if trees != 1.0:
            params = dict(transfer.params or {})
            params["n_estimators"] = max(round(params.get("n_estimators", 100) * trees), 1)
            transfer.set_params(params=params)
        return transfer

    def _fit_pair(self, X: np.ndarray, y: np.ndarray) -> tuple[StepTimeEstimator, ...]:
        from sklearn.base import clone

        return clone(self.estimator).fit(X, y), self._transfer().fit(X, y)

    def fit(self, X: np.ndarray, y: np.ndarray, *, keys: np.ndarray, families: np.ndarray,
            hardware: np.ndarray, seen_models: Any = None, y_cross: np.ndarray | None = None
            ) -> FamilyRouter:
        """Fit on the rows' features ``X`` and log ratios ``y``, given each row's model key,
        measurement family and hardware (catalogue spelling); ``seen_models``: the model
        keys the overall model counts as trained on (``None``: those of ``keys``);
        ``y_cross``: the log ratios ``cross_family_`` learns (``None``: ``y``)."""
        seen_models = np.unique(keys) if seen_models is None else seen_models
        self.seen_models_ = sorted(str(k) for k in seen_models)
        self.overall_, self.overall_transfer_ = self._fit_pair(X, y)
        self.cross_family_ = self._transfer(self.cross_family_trees).fit(
            X, y if y_cross is None else y_cross)
        # One step-time model per measurement family (framework and cluster of a source) with
        # enough rows: a family's quirks (e.g. one framework's pathological pipeline runs)
        # must not leak into another's extrapolation, which the analytical estimate carries.
        self.families_: dict[str, StepTimeEstimator] = {}
        self.family_transfer_: dict[str, StepTimeEstimator] = {}
        # a family's model has seen the models measured in that family only: another
        # family's shape goes to its transfer model, as an unseen model does
        self.family_seen_: dict[str, list[str]] = {}
        if len(np.unique(families)) > 1:
            for family in np.unique(families):
                rows = families == family
                if rows.sum() >= self.min_family_rows:
                    full, transfer = self._fit_pair(X[rows], y[rows])
                    self.families_[str(family)] = full
                    self.family_seen_[str(family)] = sorted(
                        str(k) for k in np.unique(keys[rows]))
                    self.family_transfer_[str(family)] = transfer
        self.hardware_family_ = hardware_families(hardware, families, self.families_)
        return self

    def seen(self, keys: np.ndarray, family: str = "") -> np.ndarray:
        """Which rows' model keys the family's model (``""``: the overall one) trained on."""
        import pandas as pd

        known = self.family_seen_[family] if family else self.seen_models_
        return pd.Series(keys, dtype=object).isin(known).to_numpy()

    def route(self, n: int, hardware: np.ndarray | None, families: np.ndarray | None
              ) -> np.ndarray:
        """Family model per row: its source's family (``families``, ``""`` where a row has
        none), else the one family its hardware was measured in; ``""`` (the overall
        model) otherwise; ``None``: the frame has no such column."""
        out = np.full(n, "", dtype=object)
        if not self.families_:
            return out
        if hardware is not None:
            out = _family_by_hardware(hardware, self.hardware_family_)
        if families is not None:
            known = np.isin(families, list(self.families_))
            out = np.where(known, families, out)
        return out

    @staticmethod
    def cross(route: np.ndarray, unmeasured: np.ndarray | None) -> np.ndarray:
        """The rows :meth:`predict` gives to ``cross_family_``: on the overall route, of a
        family without measurements."""
        if unmeasured is None:
            return np.zeros(len(route), dtype=bool)
        return (route == "") & np.asarray(unmeasured, dtype=bool)

    def predict(self, X: np.ndarray, keys: np.ndarray, route: np.ndarray,
                seen: np.ndarray | None = None, unmeasured: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """The log ratio per row and its quantile bounds (``(n, 2)``), each row by its
        ``route``'s model (see :meth:`route`), on all features for a model it trained on,
        else its transfer twin; ``cross_family_`` for a row of the overall model whose
        family has no measurement (``unmeasured``, where known), whatever its model: the
        features that name a model trained on would give it that model's habits in the
        measured family. ``seen``: :meth:`seen` of the overall model, where known."""
        import pandas as pd

        ratio = np.zeros(len(X))
        bounds = np.zeros((len(X), 2))
        # a row of a family without measurements, of any model, on the overall route
        cross = self.cross(route, unmeasured)
        if cross.any():
            ratio[cross], bounds[cross] = self.cross_family_.predict(X[cross])
        # the distinct routes by hashing (sorting 100,000 strings costs a tenth of a second)
        for family in pd.unique(pd.Series(route, dtype=object)):
            if family:
                in_family = self.seen(keys, family)
            else:
                in_family = self.seen(keys) if seen is None else seen
            for known in (True, False):
                rows = (route == family) & (in_family == known) & ~cross
                if not rows.any():
                    continue
                if known:
                    estimator = self.families_[family] if family else self.overall_
                else:
                    estimator = (self.family_transfer_[family] if family
                                 else self.overall_transfer_)
                ratio[rows], bounds[rows] = estimator.predict(X[rows])
        return ratio, bounds
