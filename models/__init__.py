"""paratune.models: analytical features and learned predictors of step time, memory and
feasibility.

Heavy imports (xgboost, scikit-learn, pandas) happen on first use of a predictor.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXTRAPOLATION_SPLITS",
    "AnalyticalBaseline",
    "Fold",
    "HistGradientBoostingBaseline",
    "PerformanceModel",
    "RawConfigBaseline",
    "Split",
    "cross_validate",
    "extrapolation_split",
    "load_measurements",
    "load_model",
]

_LAZY = {
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
