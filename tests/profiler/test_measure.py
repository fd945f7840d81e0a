"""A measured config carries its timing as a record (as well as in ``details``)."""

from __future__ import annotations

import math

import pytest
import torch

from paratune import ConfigError, Measurement, ParallelConfig, get_model
from paratune.profiler.measure import MeasureOptions, measure_config

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


def test_measure_options_by_object_or_keyword_and_each_bad_one_named(world_one):
    config, cpu = ParallelConfig(global_batch_size=2), torch.device("cpu")
    options = MeasureOptions(warmup_steps=1, measured_steps=3, seed=1, devices_per_node=5)
    m = measure_config(SPEC, config, hardware="cpu", device=cpu, options=options)
    assert len(m.step_times_s) == 3 and m.warmup_steps == 1 and m.devices_per_node == 5
    # a keyword over the object wins
    m = measure_config(SPEC, config, hardware="cpu", device=cpu, options=options,
                       measured_steps=2)
    assert len(m.step_times_s) == 2 and m.devices_per_node == 5
    for bad, field in (({"measured_steps": 0}, "measured_steps"),
                       ({"warmup_steps": -1}, "warmup_steps"), ({"data": "web"}, "data")):
        with pytest.raises(ConfigError) as info:
            MeasureOptions(**bad)
        assert info.value.field == field
    with pytest.raises(ConfigError, match=r"measure_options='steps'.*is not one of"):
        measure_config(SPEC, config, hardware="cpu", device=cpu, steps=2)
