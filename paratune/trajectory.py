"""The gradient-noise-scale trajectory record: one row per measured step.

``paratune gns`` (:mod:`paratune.profiler.gns`) writes these columns, in this order, and the
tuner (:mod:`paratune.tuner.gns_trajectory`) reads them back; both take them from here.
"""

from __future__ import annotations

__all__ = ["LEGACY_TRAJECTORY_COLUMNS", "OPTIONAL_TRAJECTORY_COLUMNS",
           "REQUIRED_TRAJECTORY_COLUMNS", "TRAJECTORY_COLUMNS"]

TRAJECTORY_COLUMNS = ("step", "tokens", "loss", "b_simple", "g2", "trace", "g2_ema",
                      "trace_ema", "small_sqnorm", "big_sqnorm", "b_small", "b_big",
                      "elapsed_s", "seq_len")
"""Columns of the trajectory CSV: ``step, tokens, loss, b_simple`` (what the tuner reads;
``b_simple`` in sequences) followed by the estimator's parts and ``seq_len``, the measuring
run's tokens per sequence (the same on every row; last, so that a row cut short while being
written lacks it)."""

LEGACY_TRAJECTORY_COLUMNS = TRAJECTORY_COLUMNS[:-1]
"""Columns of trajectories written before ``seq_len`` was recorded; a resume upgrades them."""

REQUIRED_TRAJECTORY_COLUMNS = ("step", "tokens", "b_simple")
"""Columns every trajectory a reader accepts must have."""

OPTIONAL_TRAJECTORY_COLUMNS = ("loss", "seq_len", "g2_ema", "trace_ema")
"""Columns a reader uses where a file has them: the loss, the measuring run's ``seq_len``
and the smoothed parts of the estimate (which rebuild or bound a ``b_simple`` that is not a
positive number)."""
