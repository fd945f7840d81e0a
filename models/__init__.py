"""paratune.models: analytical features and learned predictors of step time, memory and
feasibility.

Heavy imports (xgboost, scikit-learn, pandas) happen on first use of a predictor.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXTRAPOLATION_SPLITS",
    "RISK_AWARE_WITHIN",
    "AnalyticalBaseline",
    "Fold",
    "HistGradientBoostingBaseline",
    "PerformanceModel",
    "RawConfigBaseline",
    "Split",
    "choice_orders",
    "choice_throughputs",
    "config_identity",
    "cross_validate",
    "cv_folds",
    "error_anatomy",
    "estimator_factories",
    "extrapolation_split",
    "extrapolation_table",
    "feasibility_table",
    "fit_model",
    "load_measurements",
    "load_model",
    "measured_memory_gb",
    "measured_step_time",
    "metrics",
    "plot_predictions",
    "predicted_to_run_rows",
    "risk_aware_candidates",
    "risk_aware_order",
    "risk_aware_throughput",
    "source_family",
    "throughput_regret",
]

_LAZY = {
    "cv_folds": "paratune.models._evaluate",
    "choice_orders": "paratune.models._evaluate",
    "choice_throughputs": "paratune.models._evaluate",
    "predicted_to_run_rows": "paratune.models._evaluate",
    "feasibility_table": "paratune.models._data",
    "measured_memory_gb": "paratune.models._data",
    "config_identity": "paratune.models._data",
    "source_family": "paratune.models._base",
    "risk_aware_throughput": "paratune.models._evaluate",
    "risk_aware_candidates": "paratune.models._evaluate",
    "risk_aware_order": "paratune.models._evaluate",
    "RISK_AWARE_WITHIN": "paratune.models._evaluate",
    "throughput_regret": "paratune.models._evaluate",
    "measured_step_time": "paratune.models._data",
    "error_anatomy": "paratune.models._evaluate",
    "extrapolation_table": "paratune.models._evaluate_report",
    "plot_predictions": "paratune.models._evaluate_report",
    "metrics": "paratune.models._evaluate",
    "estimator_factories": "paratune.models._estimators",
    "fit_model": "paratune.models._workflows",
    "AnalyticalBaseline": "paratune.models._estimators",
    "HistGradientBoostingBaseline": "paratune.models._estimators",
    "PerformanceModel": "paratune.models._estimators",
    "RawConfigBaseline": "paratune.models._estimators",
    "load_model": "paratune.models._estimators",
    "cross_validate": "paratune.models._evaluate",
    "EXTRAPOLATION_SPLITS": "paratune.models._splits",
    "Fold": "paratune.models._splits",
    "Split": "paratune.models._splits",
    "extrapolation_split": "paratune.models._splits",
    "load_measurements": "paratune.models._data",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paratune.models' has no attribute {name!r}")
