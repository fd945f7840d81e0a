"""paratune.models: analytical features and learned predictors of step time, memory and
feasibility.

Heavy imports (xgboost, scikit-learn, pandas) happen on first use of a predictor.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AnalyticalBaseline",
    "HistGradientBoostingBaseline",
    "PerformanceModel",
    "RawConfigBaseline",
    "cross_validate",
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
    "load_measurements": "paratune.models._data",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paratune.models' has no attribute {name!r}")
