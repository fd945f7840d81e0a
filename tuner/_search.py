"""Searching a space against a predictor: exhaustively (vectorised) or with Optuna.

The implementation lives in :mod:`~paratune.tuner._ranking` (scoring and ranking),
:mod:`~paratune.tuner._samplers`, :mod:`~paratune.tuner._study` (storages and studies) and
:mod:`~paratune.tuner._optuna` (the search loop); this module gathers their names.
"""

from __future__ import annotations

from paratune.tuner._optuna import optuna_search
from paratune.tuner._ranking import SearchResult, evaluate, exhaustive, rank
from paratune.tuner._samplers import SAMPLERS, make_sampler
from paratune.tuner._study import (
    DB_CONNECT_TIMEOUT_S,
    HEARTBEAT_GRACE_S,
    HEARTBEAT_INTERVAL_S,
    StudyNotRecorded,
    _finished,
    _without_password,
    default_study_name,
    open_study,
    predictor_identity,
    resolve_storage,
    storage_text,
)

__all__ = ["DB_CONNECT_TIMEOUT_S", "HEARTBEAT_GRACE_S", "HEARTBEAT_INTERVAL_S", "SAMPLERS",
           "SearchResult", "StudyNotRecorded", "_finished", "_without_password",
           "default_study_name", "evaluate", "exhaustive", "make_sampler",
           "open_study", "optuna_search", "predictor_identity", "rank", "resolve_storage",
           "storage_text"]
