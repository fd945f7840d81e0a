"""The stalled-pipeline regime of :class:`~paratune.models.PerformanceModel`: its classifier
and stalled-time boosters, and which rows (by source family or hardware) may fall into it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.models import features as F
from paratune.models._base import _catalogue_names, source_family
from paratune.models._components import StallRegimeEstimator

if TYPE_CHECKING:
    import pandas as pd

__all__: list[str] = []

STALL_DECAY_PER_DOUBLING = 1.0
"""How fast the stall probability of a model larger than any fitted falls toward the
calibrated core's (which knows no stall), per doubling of parameters beyond them."""

_STALL_MONOTONE = "({})".format(",".join(str(F.STALL_MONOTONE.get(name, 0))
                                           for name in F.STALL_FEATURE_NAMES))


class _StallRegime:
    """Fitting and predicting the stalled regime (a mix-in of
    :class:`~paratune.models.PerformanceModel`)."""

    @staticmethod
    def _origin(frame: pd.DataFrame) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Each row's hardware (catalogue spelling) and source family (``""`` for a row
        without a source, which goes by its hardware), ``None`` where the frame has no such
        column: what :meth:`FamilyRouter.route` and :meth:`_stall_free` go by."""
        hardware = _catalogue_names(frame["hardware"]) if "hardware" in frame.columns else None
        families = (source_family(frame, missing="") if "source" in frame.columns
                    else None)
        return hardware, families

    def _stall_free(self, hardware: np.ndarray | None, families: np.ndarray | None,
                    unmeasured: np.ndarray) -> np.ndarray:
        """Which rows (see :meth:`_origin`) are free of the stalled regime: those of a family
        with no measurement (``unmeasured``: predicted as a well-tuned framework, since
        stalling is how one framework ran its pipelines, not a property of its hardware),
        and those of a family whose pipelines did not stall in the training data, by the
        row's source where its family has pipeline runs there, else by its hardware (see
        ``stall_free_hardware_``)."""
        out = np.zeros(len(unmeasured), dtype=bool)
        if self.stall_free_families_:
            if hardware is not None:
                out = np.isin(hardware, self.stall_free_hardware_)
            if families is not None:
                known = np.isin(families, list(self.pipeline_runs_))
                out = np.where(known, np.isin(families, self.stall_free_families_), out)
        return out | unmeasured

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
            regime = self.stall_ if known else self.stall_transfer_
            prob[rows], per_micro[rows] = regime.predict(X[rows] if known else X_stall[rows])
        times = F.num_microbatches(c)[:, None] * np.exp(per_micro)
        return prob, times[:, 0], times[:, 1], times[:, 2]

    def _fit_stall_regime(self, c: F.Columns, X: np.ndarray, step: np.ndarray,
                          timed: np.ndarray, families: np.ndarray, hardware: np.ndarray
                          ) -> np.ndarray:
        """Learn the stalled pipeline regime and which families and hardware are free of it.

        Returns:
            The rows the step-time models learn from: the timed runs, less the stalled ones
            where the regime is learned apart.
        """
        has_time = timed
        # Stalled pipeline runs are a regime of their own (a fixed cost per micro-batch); the
        # step-time models learn the normal regime without them where there are enough to
        # learn the stalled one apart.
        stalled = timed & F.stalled_pipeline(c, step)
        pipeline = timed & (c.pp > 1) & c.accelerator
        self.stall_ = self.stall_transfer_ = None
        # the classifier needs pipeline runs of both regimes; the step-time models some
        # runs that did not stall
        if (stalled.sum() >= self.min_stall_rows and (pipeline & ~stalled).any()
                and (timed & ~stalled).any()):
            per_micro = np.log(step / F.num_microbatches(c))
            params = self._booster_params(aux=True)
            self.stall_ = StallRegimeEstimator(params=params, quantiles=self.quantiles).fit(
                X, per_micro, pipeline=pipeline, stalled=stalled)
            # for a model not trained on, the regime's physics alone (compute per device
            # per step and per micro-batch, nodes): nothing that names a model size
            self.stall_transfer_ = StallRegimeEstimator(
                params=params, quantiles=self.quantiles, monotone=_STALL_MONOTONE,
            ).fit(F.stall_features(c), per_micro, pipeline=pipeline, stalled=stalled)
            has_time = timed & ~stalled
        self.num_stall_rows_ = int(stalled.sum()) if self.stall_ is not None else 0
        self.node_pipeline_families_ = _node_pipeline_families(c, pipeline, families)
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
        return has_time

    def _unmeasured_pipeline_slow_end(self, c: F.Columns, families: np.ndarray,
                                      unmeasured: np.ndarray, step: np.ndarray,
                                      hi: np.ndarray) -> np.ndarray:
        """The interval's slow end with the stalled regime's threshold for a pipeline that
        leaves the node where its family ran every pipeline measured (``families``: each
        row's measured family; ``unmeasured``: rows of a family without measurements,
        fitted or calibrated on, predicted as a well-tuned framework, kept as they are; a
        family calibrated on a node's runs of its own is not one of them).

        Nothing measured says whether such a family's pipelines stall across nodes: in the
        public H100 sweep a third of nanotron's pipelines on more than one node did (a
        second or so per micro-batch), and not one of its 33 one-node pipeline runs, so
        fitted on those the model ranked a two-node pipeline of 8B first that ran 8.6x
        slower than predicted. The point and the expected time stay the normal regime's,
        which is all a family's runs have shown; the slow end holds the least a stalled run
        takes (:func:`~paratune.models.features.stall_floor_s`), so that the risk-aware
        ranking, and the verification's list, weigh it."""
        new = (c.accelerator & (c.pp > 1) & (F.pp_crosses_nodes(c) > 0) & ~unmeasured
               & ~np.isin(families, self.node_pipeline_families_))
        if not new.any():
            return hi
        return np.where(new, np.maximum(hi, np.maximum(F.stall_floor_s(c), step)), hi)

    def _blend_stall(self, c: F.Columns, X: np.ndarray, seen: np.ndarray,
                     stall_free: np.ndarray, step: np.ndarray, lo: np.ndarray,
                     hi: np.ndarray, where: Any) -> tuple[np.ndarray, ...]:
        """The stalled regime's probability, and the step time, its interval and expectation
        with both regimes weighed in."""
        prob, stall, stall_lo, stall_hi = self._stall(c, X, F.stall_features(c), seen,
                                                      stall_free)
        # the stall is a fixed cost per micro-batch: where the normal regime's step
        # already takes longer than the learned stalled one, that cost hides behind the
        # compute and the regime vanishes
        prob = np.where(stall <= step, 0.0, prob)
        # the regime is learned like the step time's correction, and like it does not
        # dominate where it has no data: for a model larger than any fitted the
        # probability decays by e per doubling of parameters beyond them
        prob = prob * np.exp(-STALL_DECAY_PER_DOUBLING * where[1]["model_params"])
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
        return prob, step, lo, hi, expected


def _node_pipeline_families(c: F.Columns, pipeline: np.ndarray, families: np.ndarray
                            ) -> list[str]:
    """The families with a timed pipeline run (``pipeline``) whose stages sat in more than
    one node: those whose pipelines across nodes have been measured."""
    crossing = pipeline & (F.pp_crosses_nodes(c) > 0)
    return sorted({str(f) for f in families[crossing]})
