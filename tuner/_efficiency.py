"""Statistical efficiency of the global batch size, from the gradient noise scale.

Two views of the same empirical law, both driven by the gradient noise scale ``B_noise``
(in sequences, the unit of every batch size in paratune):

* **Pollux** (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
  Learning", OSDI 2021, section 3.1): the statistical efficiency of batch ``B`` relative to a
  reference batch ``B0`` is ``E(B) = (B_noise + B0) / (B_noise + B)``; goodput is
  throughput times ``E(B)``: the training progress per second measured in ``B0``-batch
  examples. ``E`` is 1 at ``B0`` and below 1 above it, so goodputs compare across the batch
  sizes of one search (one ``B0``); across searches with different ``B0`` they differ by the
  constant factor ``B_noise + B0``.
* **McCandlish et al.** ("An Empirical Model of Large-Batch Training", arXiv 1812.06162,
  eqs. 2.11 and 2.12): reaching a fixed loss takes ``S(B) = S_min (1 + B_crit / B)``
  optimizer steps or ``E(B) = E_min (1 + B / B_crit)`` examples, with
  ``B_crit = E_min / S_min``. The paper finds ``B_crit`` close to the noise scale; paratune
  measures the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` and uses it for
  ``B_crit`` (and for Pollux's ``B_noise``). The time to the target is
  ``S(B) * step_time(B)``.

The learning rate moves with the batch (:func:`lr_scale`): the square-root rule for Adam
(Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"), the
linear rule for SGD (Goyal et al. 2017), or AdaScale's gain (Johnson et al. 2020), which
Pollux uses: ``r = (B / B0) E(B)`` with ``E`` the Pollux efficiency above.

For a fixed ``B_noise`` the two rank configurations identically: goodput is proportional
to ``B / ((B_noise + B) * step_time)``, the inverse of the time to target. Pollux gives a
dimensionless rate; McCandlish an absolute time once ``S_min`` (or ``E_min``) is known.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike

from paratune.errors import ConfigError

__all__ = ["LR_RULES", "check_lr_rule", "examples_to_target", "lr_scale", "pollux_efficiency",
           "positive_int", "steps_to_target", "time_to_target"]


def _positive(name: str, value: object, rule: str, *, zero: bool = False) -> float:
    """``value`` as a float when it is a positive (or, with ``zero``, non-negative), finite
    real number (not a bool)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ConfigError(name, value, rule)
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise ConfigError(name, value, rule)
    return number


def positive_int(name: str, value: object, rule: str = "must be a positive integer") -> int:
    """``value`` as an ``int`` when it is an integer >= 1 (not a bool).

    Raises:
        ConfigError: naming ``name`` and ``rule`` otherwise.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(name, value, rule)
    return int(value)


def _check_noise(b_noise: float) -> float:
    return _positive("gns", b_noise, "the gradient noise scale B_noise must be a positive, "
                     "finite number of sequences")


def _check_batch(batch: ArrayLike) -> np.ndarray:
    batch = np.asarray(batch, dtype=float)
    if not np.all(np.isfinite(batch) & (batch > 0)):
        raise ConfigError("global_batch_size", batch.tolist(),
                          "batch sizes must be positive, finite numbers of sequences")
    return batch


def pollux_efficiency(batch: ArrayLike, b_noise: float, b0: float) -> np.ndarray:
    """Pollux statistical efficiency ``(B_noise + B0) / (B_noise + B)``.

    Args:
        batch: Global batch size(s) ``B`` in sequences.
        b_noise: Gradient noise scale in sequences.
        b0: Reference batch size ``B0`` (efficiency 1 there); the smallest batch considered
            is the usual choice.

    Returns:
        Efficiency per batch, in ``(0, 1]`` for ``B >= B0``.
    """
    b_noise = _check_noise(b_noise)
    b0 = _positive("b0", b0, "the reference batch size must be a positive, finite number of "
                   "sequences")
    return (b_noise + b0) / (b_noise + _check_batch(batch))


def steps_to_target(batch: ArrayLike, b_noise: float, s_min: float) -> np.ndarray:
    """McCandlish et al. optimizer steps to a target loss, ``S_min (1 + B_noise / B)``."""
    b_noise = _check_noise(b_noise)
    s_min = _positive("s_min", s_min, "must be a non-negative, finite number of steps",
                      zero=True)
    return s_min * (1.0 + b_noise / _check_batch(batch))


def examples_to_target(batch: ArrayLike, b_noise: float, e_min: float) -> np.ndarray:
    """McCandlish et al. examples (sequences) to a target loss, ``E_min (1 + B / B_noise)``."""
    b_noise = _check_noise(b_noise)
    e_min = _positive("e_min", e_min, "must be a non-negative, finite number of sequences",
                      zero=True)
    return e_min * (1.0 + _check_batch(batch) / b_noise)


def time_to_target(batch: ArrayLike, step_time_s: ArrayLike, b_noise: float,
                   e_min: float) -> np.ndarray:
    """Seconds to a target loss: ``S(B) * step_time(B)`` with ``S_min = E_min / B_noise``.

    Args:
        batch: Global batch size(s) in sequences.
        step_time_s: Step time at each batch (same shape).
        b_noise: Gradient noise scale in sequences.
        e_min: Sequences needed to reach the target at a vanishing batch size.
    """
    b_noise = _check_noise(b_noise)
    e_min = _positive("e_min", e_min, "must be a non-negative, finite number of sequences",
                      zero=True)
    steps = steps_to_target(batch, b_noise, e_min / b_noise)
    return steps * np.asarray(step_time_s, dtype=float)


LR_RULES = ("sqrt", "linear", "adascale", "none")
"""Learning-rate rules of :func:`lr_scale`."""


def check_lr_rule(rule: object) -> str:
    """``rule`` when it is one of :data:`LR_RULES`.

    Raises:
        ConfigError: ``lr_rule`` is not.
    """
    if rule not in LR_RULES:
        raise ConfigError("lr_rule", rule, f"must be one of {', '.join(LR_RULES)}")
    return str(rule)


def lr_scale(batch: ArrayLike, base_batch: float, rule: str = "sqrt", *,
             b_noise: float | None = None) -> np.ndarray:
    """Factor on the learning rate tuned at ``base_batch`` for a run at ``batch``.

    * ``sqrt``: ``sqrt(B / B0)``, the square-root scaling rule of Adam-type optimizers
      (Malladi et al. 2022); the default.
    * ``linear``: ``B / B0``, the linear rule of SGD (Goyal et al. 2017).
    * ``adascale``: AdaScale's gain ``(B / B0) (B_noise + B0) / (B_noise + B)`` (Johnson et
      al. 2020, as Pollux applies it): linear while ``B << B_noise``, flat above it; needs
      ``b_noise``.
    * ``none``: 1 (the learning rate does not follow the batch).

    Args:
        batch: Global batch size(s) in sequences.
        base_batch: Batch at which the base learning rate was tuned.
        rule: One of :data:`LR_RULES`.
        b_noise: Gradient noise scale in sequences (``adascale`` only).

    Raises:
        ConfigError: an unknown rule, a non-positive batch, or ``adascale`` without a
            positive ``b_noise``.
    """
    check_lr_rule(rule)
    batch = _check_batch(batch)
    base = _positive("base_batch", base_batch, "the batch the base learning rate was tuned at "
                     "must be a positive, finite number of sequences")
    ratio = batch / base
    if rule == "sqrt":
        return np.sqrt(ratio)
    if rule == "linear":
        return ratio
    if rule == "none":
        return np.ones_like(ratio)
    if b_noise is None:
        raise ConfigError("b_noise", None, "lr_rule=adascale needs the gradient noise scale")
    return ratio * pollux_efficiency(batch, b_noise, base)
