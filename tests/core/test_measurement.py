from __future__ import annotations

import math

import pytest

from paratune import (
    HARDWARE,
    ConfigError,
    Measurement,
    ParallelConfig,
    Status,
    get_hardware,
    get_model,
)


def test_summary_statistics_from_step_times():
    m = Measurement(model=get_model("tiny"), config=ParallelConfig(dp=2, global_batch_size=8),
                    hardware="cpu", step_times_s=[0.4, 0.1, 0.2, 0.3])
    assert m.step_time_s == pytest.approx(0.25)
    assert m.step_time_mean_s == pytest.approx(0.25)
    assert m.step_time_p10_s == pytest.approx(0.13)
    assert m.tokens_per_s == pytest.approx(8 * 128 / 0.25)
    assert m.tokens_per_s_per_device == pytest.approx(8 * 128 / 0.25 / 2)


def test_row_roundtrip_keeps_config_status_and_fingerprint():
    m = Measurement(model=get_model("tiny"), config=ParallelConfig(tp=2, global_batch_size=4),
                    hardware="cpu", status=Status.OOM, error="CUDA out of memory",
                    fingerprint={"torch_version": "2.x", "device_name": "cpu"})
    back = Measurement.from_row(m.to_row())
    assert back.config == m.config and back.model == m.model
    assert back.status is Status.OOM and back.error == "CUDA out of memory"
    assert back.fingerprint["torch_version"] == "2.x"
    assert math.isnan(back.step_time_s)


def test_hardware_catalogue_aliases_and_errors():
    assert get_hardware("h100") is HARDWARE["H100-80GB"]
    assert get_hardware("A100").memory_gb == 80
    assert get_hardware("H100").num_nodes(64) == 8
    with pytest.raises(ConfigError, match="gpu='TPU'"):
        get_hardware("TPU")


def test_unknown_status_names_the_field():
    with pytest.raises(ConfigError, match=r"status='finished': must be one of ok, "):
        Measurement(model=get_model("tiny"), config=ParallelConfig(), hardware="cpu",
                    status="finished")
