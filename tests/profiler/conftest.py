from __future__ import annotations

import pytest

from tests.profiler._dist import one_process_group


@pytest.fixture
def world_one(tmp_path):
    """A real one-process gloo group (file store), destroyed afterwards."""
    with one_process_group(tmp_path):
        yield


@pytest.fixture
def one_thread(monkeypatch):
    """One OpenMP thread for the ranks a test starts (they share a two-core machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
