"""A measured config carries its timing as a record (as well as in ``details``)."""

from __future__ import annotations

import math

import torch

from paratune import Measurement, ParallelConfig, get_model
from paratune.profiler.measure import measure_config

SPEC = get_model("tiny").replace(seq_len=32)


def test_measure_config_records_its_timing(world_one):
    details: dict[str, float] = {}
    m = measure_config(SPEC, ParallelConfig(global_batch_size=2), hardware="cpu",
                       device=torch.device("cpu"), warmup_steps=1, measured_steps=2,
                       details=details)
    timing = m.timing
    assert (timing.build_s, timing.mesh_s, timing.teardown_s, timing.overhead_s) == (
        details["build_s"], details["mesh_s"], details["teardown_s"], details["overhead_s"])
    assert 0 <= timing.mesh_s <= timing.build_s <= timing.overhead_s
    assert math.isnan(timing.call_s)  # the worker that calls it times the whole call
    assert Measurement.from_row(m.to_row()).timing == timing
