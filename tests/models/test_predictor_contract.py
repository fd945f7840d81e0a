"""The predictor contract (:mod:`tests.models.predictor_contract`) run on every predictor
paratune ships: the performance model, fitted and loaded back, and the baselines."""

from __future__ import annotations

from paratune.models import (
    AnalyticalBaseline,
    HistGradientBoostingBaseline,
    PerformanceModel,
    RawConfigBaseline,
    load_model,
)
from paratune.models._base import OUTPUT_COLUMNS, PRED_TOKENS_Q10, PRED_TOKENS_Q90
from tests.models.predictor_contract import PredictorContract


class TestPerformanceModel(PredictorContract):
    output_columns = OUTPUT_COLUMNS
    quantiles = (PRED_TOKENS_Q10, PRED_TOKENS_Q90)
    saves = True

    def make_predictor(self):
        return PerformanceModel(n_estimators=40, aux_estimators=20, n_jobs=1,
                                min_stall_rows=5)

    def load_path(self, path):
        return load_model(path)

    def test_the_contract_covers_the_stalled_regime(self, fitted, predictions):
        # the training rows stall, and the model learns the regime apart: the contract's
        # checks then hold for the blended predictions too
        assert fitted.stall_ is not None
        assert (predictions["pred_stall_prob"] > 0.5).any()


class TestPerformanceModelOtherQuantiles(PredictorContract):
    """Quantiles other than the default name their columns after themselves."""

    output_columns = tuple(
        {PRED_TOKENS_Q10: "pred_tokens_per_sec_per_gpu_q25",
         PRED_TOKENS_Q90: "pred_tokens_per_sec_per_gpu_q75"}.get(c, c) for c in OUTPUT_COLUMNS)
    quantiles = ("pred_tokens_per_sec_per_gpu_q25", "pred_tokens_per_sec_per_gpu_q75")
    saves = True

    def make_predictor(self):
        return PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1,
                                quantiles=(0.25, 0.75), nested_intervals=False)

    def load_path(self, path):
        return load_model(path)


class TestAnalyticalBaseline(PredictorContract):
    output_columns = OUTPUT_COLUMNS
    quantiles = (PRED_TOKENS_Q10, PRED_TOKENS_Q90)

    def make_predictor(self):
        return AnalyticalBaseline()


class TestRawConfigBaseline(PredictorContract):
    output_columns = OUTPUT_COLUMNS
    quantiles = (PRED_TOKENS_Q10, PRED_TOKENS_Q90)

    def make_predictor(self):
        return RawConfigBaseline(n_estimators=30, n_jobs=1)


class TestHistGradientBoostingBaseline(PredictorContract):
    output_columns = OUTPUT_COLUMNS
    quantiles = (PRED_TOKENS_Q10, PRED_TOKENS_Q90)

    def make_predictor(self):
        return HistGradientBoostingBaseline(max_iter=30)
