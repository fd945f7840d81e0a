"""The stalled-pipeline regime of :class:`~paratune.models.PerformanceModel`: its classifier
and stalled-time boosters, and which rows (by source family or hardware) may fall into it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.models import features as F
from paratune.models._base import _catalogue_names, _xgb_regressor, source_family

if TYPE_CHECKING:
    import pandas as pd

__all__: list[str] = []


class _StallRegime:
    """Fitting and predicting the stalled regime, and routing rows to family models (a
    mix-in of :class:`~paratune.models.PerformanceModel`)."""

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

