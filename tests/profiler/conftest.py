from __future__ import annotations

import pytest

from tests.profiler._dist import one_process_group


@pytest.fixture
def world_one(tmp_path):
    """A real one-process gloo group (file store), destroyed afterwards."""
    with one_process_group(tmp_path):
        yield
