"""Reading a gradient-noise-scale trajectory: ``B_noise`` over training progress.

The measurement (``paratune gns``) writes one row per measurement point with the columns
``step, tokens, loss, b_simple`` (then the estimator's parts and, from the current format on,
``seq_len``): the optimizer step and tokens seen so far in the reference run, the training
loss there, and the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al.
2018, eq. 2.8) in sequences *of the run that measured it*, whose tokens per sequence the
``seq_len`` column records. CSV, JSON (a list of records, a mapping of column -> list, or
``{"rows": [...]}``), JSON lines and parquet are accepted.

Units: the noise scale is taken to be a number of tokens (an "example" is a token, so
``B_noise`` in tokens does not depend on how the tokens are cut into sequences). A value
measured in sequences of ``seq_len_measured`` tokens is therefore worth
``b_simple * seq_len_measured / seq_len_target`` sequences of a model trained with
``seq_len_target`` tokens per sequence (:meth:`Trajectory.b_noise_in`). A file without a
``seq_len`` column cannot be converted until the measuring run's ``seq_len`` is given.

The record's columns are defined once, for the writer and this reader, in
:mod:`paratune.trajectory`; the :class:`Trajectory` type is in
:mod:`~paratune.tuner._trajectory`, the published critical-batch laws (a trajectory without a
measurement) in :mod:`~paratune.tuner._noise_laws`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from paratune.errors import ConfigError
from paratune.trajectory import OPTIONAL_TRAJECTORY_COLUMNS, REQUIRED_TRAJECTORY_COLUMNS
from paratune.tuner._efficiency import positive_int
from paratune.tuner._noise_laws import (
    CHINCHILLA,
    NOISE_LAWS,
    LossCurve,
    NoiseLaw,
    chinchilla_loss_curve,
    get_law,
    law_trajectory,
    load_loss_curve,
)
from paratune.tuner._trajectory import Trajectory, read_table

__all__ = ["CHINCHILLA", "NOISE_LAWS", "REQUIRED_COLUMNS", "LossCurve", "NoiseLaw", "Trajectory",
           "chinchilla_loss_curve", "get_law", "law_trajectory", "load_loss_curve",
           "load_trajectory"]

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = REQUIRED_TRAJECTORY_COLUMNS
"""Columns every trajectory must have; ``loss``, ``seq_len`` and the estimator's parts
``g2_ema, trace_ema`` are optional."""


def _check_seq_len(seq_len: Any) -> int | None:
    if seq_len is None:
        return None
    return positive_int("seq_len", seq_len, "must be a positive integer (tokens per sequence "
                        "of the run that measured the trajectory)")


def _file_seq_len(frame: Any, path: Path) -> int:
    values = frame["seq_len"].to_numpy(dtype=float)
    first = values[0] if len(values) else math.nan
    if (not np.all(np.isfinite(values)) or not np.all(values == first) or first < 1
            or first != round(first)):
        shown = ", ".join(f"{v:g}" for v in np.unique(values)[:5])
        raise ConfigError("trajectory", str(path),
                          f"seq_len column must hold one positive integer on every row "
                          f"(found {shown})")
    return int(first)


def _nearest_valid_max(values: np.ndarray, good: np.ndarray,
                       tokens: np.ndarray) -> np.ndarray:
    """Per row, the larger of ``values`` at the nearest ``good`` rows before and after it in
    token order (the one that exists where the other does not; ``good`` must hold a row)."""
    order = np.argsort(tokens, kind="stable")
    n = len(order)
    pos = np.arange(n)
    valid = good[order]
    before = np.maximum.accumulate(np.where(valid, pos, -1))
    after = np.minimum.accumulate(np.where(valid, pos, n)[::-1])[::-1]
    ranked = values[order]
    bound = np.maximum(np.where(before >= 0, ranked[np.maximum(before, 0)], -np.inf),
                       np.where(after < n, ranked[np.minimum(after, n - 1)], -np.inf))
    out = np.empty(n)
    out[order] = bound
    return out


def _clamp(frame: Any, path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """``b_simple`` with non-positive or NaN values replaced; rows to keep; rows replaced.

    A row whose ``b_simple`` is NaN, infinite or ``<= 0`` is an estimate where one of the
    smoothed parts was not positive, not an absent measurement. Where the parts
    ``g2_ema, trace_ema`` are recorded they say which: ``|G|^2 <= 0`` means the noise
    dominates (adaptdl floors ``|G|^2``, making ``B_noise`` large), ``tr(Sigma) <= 0`` with a
    positive ``|G|^2`` means the signal does (``B_noise`` small), and two positive parts
    rebuild the ratio. The large case takes the larger value (measured or rebuilt) of the
    nearest valid rows before and after it in token order, a lower bound where the noise
    dominates: ``B_noise`` grows over a run by orders of magnitude, so the file's largest
    value, usually from its end, would put an early row far above anything measured near
    it. The small case takes the smallest value of the file, a finite bound within what the
    run resolved that errs towards small batches. Without the parts a NaN or infinite value
    is read as noise-dominated (``paratune gns`` writes NaN exactly when ``g2_ema <= 0``)
    and a finite value ``<= 0`` as signal-dominated (a negative trace). A row with parts
    recorded but NaN is incomplete and dropped.
    """
    b = frame["b_simple"].to_numpy(dtype=float)
    out = b.copy()
    bad = ~(np.isfinite(b) & (b > 0))
    keep = np.ones(len(b), dtype=bool)
    if not bad.any():
        return out, keep, 0
    parts = "g2_ema" in frame.columns and "trace_ema" in frame.columns
    if parts:
        g2 = frame["g2_ema"].to_numpy(dtype=float)
        tr = frame["trace_ema"].to_numpy(dtype=float)
        known = np.isfinite(g2) & np.isfinite(tr)
        ratio = bad & known & (g2 > 0) & (tr > 0)
        out[ratio] = tr[ratio] / g2[ratio]
        noisy = bad & known & (g2 <= 0)
        quiet = bad & known & (g2 > 0) & (tr <= 0)
        keep &= ~(bad & ~known)
    else:
        # gns writes NaN where |G|^2 <= 0 (noise-dominated); a finite value <= 0 comes from a
        # negative trace with a positive |G|^2 (signal-dominated)
        ratio = np.zeros(len(b), dtype=bool)
        noisy, quiet = bad & ~np.isfinite(b), bad & np.isfinite(b)
    good = ~bad | ratio
    if not good.any():
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    low = float(out[good].min())
    if noisy.any():
        out[noisy] = _nearest_valid_max(out, good, frame["tokens"].to_numpy(dtype=float))[noisy]
    out[quiet] = low
    num_high, num_low, num_rebuilt = int(noisy.sum()), int(quiet.sum()), int(ratio.sum())
    dropped = int((~keep).sum())
    clamped = num_high + num_low + num_rebuilt
    if clamped or dropped:
        ends = [f"{out[noisy].min():g}", f"{out[noisy].max():g}"] if num_high else ["none"]
        high = " to ".join(dict.fromkeys(ends))
        logger.warning("trajectory %s: %d of %d rows had a b_simple that is not a positive "
                       "number: %d noise-dominated clamped up to the larger of the nearest "
                       "valid rows before and after (%s), %d signal-dominated clamped down "
                       "to %g, %d rebuilt from g2_ema/trace_ema, %d incomplete dropped",
                       path, int(bad.sum()), len(b), num_high, high, num_low, low,
                       num_rebuilt, dropped)
    return out, keep, clamped


def load_trajectory(path: str | Path, *, smooth: int = 1,
                    seq_len: int | None = None) -> Trajectory:
    """Read a ``B_noise`` trajectory file.

    ``b_simple`` is in sequences of the run that measured it; the noise scale is assumed to
    be a number of tokens, so it converts to another sequence length as
    ``b_simple * seq_len_measured / seq_len_target`` (:meth:`Trajectory.b_noise_in`). The
    measuring run's ``seq_len`` comes from the file's ``seq_len`` column or, for files
    written before that column existed, from ``seq_len``; without either the trajectory
    still loads, but converting it (planning, goodput) raises.

    Args:
        path: CSV, JSON, JSONL or parquet file with columns ``step, tokens, b_simple``
            (and optionally ``loss``, ``seq_len``, ``g2_ema``, ``trace_ema``).
        smooth: Window (in points) of a centred running median applied to ``b_simple``;
            the per-step estimate is noisy. ``1`` keeps the raw values.
        seq_len: Tokens per sequence of the measuring run, for a file without a ``seq_len``
            column (with one, it must agree).

    Returns:
        The trajectory, sorted by ``tokens``. Rows whose ``b_simple`` is NaN, infinite or
        ``<= 0`` (one of the smoothed parts was not positive) are kept with a clamped value
        rather than dropped, which would bias ``B_noise`` low where the noise dominates;
        :attr:`Trajectory.num_clamped` counts them and a warning is logged. Rows with no
        finite ``step`` or ``tokens`` are dropped.

    Raises:
        ConfigError: the file is missing, unreadable, lacks a column, has no usable row, has
            an inconsistent ``seq_len`` column, ``seq_len`` is not a positive integer or
            disagrees with the file's, or ``smooth`` is not a positive integer.
    """
    seq_len = _check_seq_len(seq_len)
    smooth = positive_int("smooth", smooth, "must be a positive integer (points in the running "
                          "median; 1 keeps the raw values)")
    frame = _complete_rows(path)
    if "seq_len" in frame.columns:
        in_file = _file_seq_len(frame, path)
        if seq_len is not None and seq_len != in_file:
            raise ConfigError("seq_len", seq_len,
                              f"disagrees with the seq_len column of {path} ({in_file})")
        seq_len = in_file
    b, keep, clamped = _clamp(frame, path)
    frame = frame.assign(b_simple=b)[keep]
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    frame = frame.sort_values("tokens", kind="stable").reset_index(drop=True)
    b = frame["b_simple"].to_numpy(dtype=float)
    if smooth > 1:
        b = frame["b_simple"].rolling(smooth, center=True, min_periods=1).median().to_numpy()
    return Trajectory(step=frame["step"].to_numpy(dtype=float),
                      tokens=frame["tokens"].to_numpy(dtype=float), b_noise=b,
                      loss=frame["loss"].to_numpy(dtype=float), source=str(path),
                      seq_len=seq_len, num_clamped=clamped)


def _complete_rows(path: str | Path) -> Any:
    """The trajectory columns of ``path`` as numbers, the rows with a ``step`` and ``tokens``
    (and ``seq_len`` where the file records it) kept, ``loss`` NaN where it has none.

    Raises:
        ConfigError: the file is missing, unreadable or lacks a column, or no row is left.
    """
    import pandas as pd

    frame = read_table(path, field="trajectory", required=REQUIRED_COLUMNS,
                       hint=f" (needs {', '.join(REQUIRED_COLUMNS)}; optional loss, seq_len)")
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no rows (a gns run stopped before its "
                          "first measured step leaves only the header): measure for longer")
    if "loss" not in frame.columns:
        frame["loss"] = np.nan
    columns = list(REQUIRED_COLUMNS) + [c for c in OPTIONAL_TRAJECTORY_COLUMNS
                                        if c in frame.columns]
    frame = frame[columns].apply(pd.to_numeric, errors="coerce")
    complete = np.isfinite(frame["tokens"]) & np.isfinite(frame["step"])
    if "seq_len" in frame.columns and np.isfinite(frame["seq_len"]).any():
        # the last column: NaN there is a row cut short while being written
        complete &= np.isfinite(frame["seq_len"])
    frame = frame[complete].reset_index(drop=True)
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    return frame
