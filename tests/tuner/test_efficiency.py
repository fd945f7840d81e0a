from __future__ import annotations

import numpy as np
import pytest

from paratune import ConfigError
from paratune.tuner import (
    Objective,
    examples_to_target,
    pollux_efficiency,
    steps_to_target,
    time_to_target,
)


def test_pollux_efficiency_is_one_at_reference_and_falls_with_batch():
    eff = pollux_efficiency([256, 512, 1024, 4096], b_noise=1000, b0=256)
    assert eff[0] == pytest.approx(1.0)
    assert eff[1] == pytest.approx(1256 / 1512)
    assert np.all(np.diff(eff) < 0)


def test_mccandlish_steps_and_examples_trade_off():
    b = np.array([10.0, 100.0, 1000.0])
    steps = steps_to_target(b, b_noise=100, s_min=50)
    examples = examples_to_target(b, b_noise=100, e_min=5000)
    assert steps == pytest.approx([550, 100, 55])
    assert examples == pytest.approx([5500, 10000, 55000])
    # E = S * B on the same curve when E_min = S_min * B_noise.
    assert examples == pytest.approx(steps * b)


def test_pollux_and_time_to_target_rank_configs_the_same():
    rng = np.random.default_rng(0)
    batch = rng.choice([64, 128, 256, 512, 1024], size=50).astype(float)
    step = rng.uniform(0.5, 5.0, size=50)
    throughput = batch / step
    goodput = throughput * pollux_efficiency(batch, 300, 64)
    ttt = time_to_target(batch, step, 300, e_min=1e6)
    assert np.array_equal(np.argsort(-goodput), np.argsort(ttt))


@pytest.mark.parametrize("bad", [0, -5, float("nan")])
def test_bad_noise_scale_names_the_field(bad):
    with pytest.raises(ConfigError, match="gns"):
        pollux_efficiency([1], b_noise=bad, b0=1)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), True, "300"])
def test_bad_reference_batch_names_the_field(bad):
    """A NaN ``b0`` used to pass ``b0 <= 0`` and turn every goodput into NaN, then 0."""
    with pytest.raises(ConfigError, match="b0"):
        pollux_efficiency([256], b_noise=1000, b0=bad)
    with pytest.raises(ConfigError, match="b0"):
        Objective(kind="goodput", b_noise=1000, b0=bad)


@pytest.mark.parametrize("bad", [float("inf"), True, "300"])
def test_noise_scale_must_be_a_finite_real_number(bad):
    with pytest.raises(ConfigError, match="gns"):
        pollux_efficiency([1], b_noise=bad, b0=1)
    with pytest.raises(ConfigError, match="gns"):
        Objective(kind="goodput", b_noise=bad)


@pytest.mark.parametrize("batch", [[0, 64], [-8], [float("nan")]])
def test_batch_sizes_must_be_positive(batch):
    for call in (lambda: pollux_efficiency(batch, 100, 1), lambda: steps_to_target(batch, 100, 1),
                 lambda: examples_to_target(batch, 100, 1),
                 lambda: time_to_target(batch, [1.0] * len(batch), 100, 1)):
        with pytest.raises(ConfigError, match="global_batch_size"):
            call()


def test_extreme_noise_scales_stay_finite():
    batch = [64, 128, 1024]
    # B_noise >> B: every batch is as efficient as the reference; B_noise << B: E = B0 / B
    np.testing.assert_allclose(pollux_efficiency(batch, 1e300, 64), 1.0)
    np.testing.assert_allclose(pollux_efficiency(batch, 1e-300, 64), [1.0, 0.5, 1 / 16])


def test_learning_rate_rules():
    from paratune.tuner import lr_scale

    np.testing.assert_allclose(lr_scale([64, 256], 64), [1.0, 2.0])
    np.testing.assert_allclose(lr_scale([64, 256], 64, "linear"), [1.0, 4.0])
    np.testing.assert_allclose(lr_scale([256], 64, "none"), [1.0])
    # AdaScale's gain: linear far below B_noise, flat far above it
    assert lr_scale([256], 64, "adascale", b_noise=1e9)[0] == pytest.approx(4.0, rel=1e-6)
    assert lr_scale([1e6], 64, "adascale", b_noise=10.0)[0] == pytest.approx(74 / 64, rel=1e-3)
    with pytest.raises(ConfigError, match="b_noise"):
        lr_scale([256], 64, "adascale")
    with pytest.raises(ConfigError, match="lr_rule"):
        lr_scale([256], 64, "cubic")
