"""Fixtures of the whole suite."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _mlflow_store_does_not_leak():
    """A test that points MLflow's process-wide tracking URI at its own store must not
    leave it there for the tests after it (which read ``MLFLOW_TRACKING_URI``)."""
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.is_tracking_uri_set():
        mlflow.set_tracking_uri(None)


from tests.servers import (  # noqa: E402, F401  (real servers)
    mlflow_server,
    postgres_cluster,
    postgres_url,
)
