"""Features and thresholds of the stalled regime of pipeline-parallel training (a roughly fixed
second or so per micro-batch, whatever the model's size)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paratune.models._feature_columns import Columns, _cols, num_microbatches
from paratune.models._step_time import step_time_at_mfu

if TYPE_CHECKING:
    import pandas as pd

STALL_MIN_SECONDS_PER_MICROBATCH = 0.5
"""A pipeline run on accelerators is *stalled* when a micro-batch takes longer than this..."""
STALL_MAX_MFU = 0.10
"""... while the step reaches less than this model-FLOPs utilisation."""


def stalled_pipeline(frame: pd.DataFrame | Columns, step_time_s: np.ndarray) -> np.ndarray:
    """Which measured runs fell into the stalled regime of pipeline-parallel training.

    Public GPU sweeps show it: about a third of their pipeline runs on more than one node take
    a roughly fixed second or so per micro-batch (0.5-3 s, whatever the model's size), 3-300x
    the analytical estimate, at a few percent of peak FLOP/s. It is a regime of its own, not
    a slower version of the normal step: a run either stalls or it does not, and twin
    layouts may land on either side. Such a run is a pipeline run (``pp > 1``) on an
    accelerator whose measured step spends more than :data:`STALL_MIN_SECONDS_PER_MICROBATCH`
    per micro-batch at under :data:`STALL_MAX_MFU` model-FLOPs utilisation. On a CPU, half a
    second per micro-batch is ordinary, so CPU runs never count.

    Args:
        frame: Config frame of the measurements.
        step_time_s: Their measured step times (NaN where a run has none).

    Returns:
        A boolean per row.
    """
    c = _cols(frame)
    # over the floor means both over the seconds per micro-batch and under the MFU
    slow = np.asarray(step_time_s, dtype=float) > stall_floor_s(c)  # NaN: not stalled
    return c.accelerator & (c.pp > 1) & slow


def stall_floor_s(frame: pd.DataFrame | Columns) -> np.ndarray:
    """The step time above which :func:`stalled_pipeline` counts a pipeline run as stalled:
    over :data:`STALL_MIN_SECONDS_PER_MICROBATCH` per micro-batch and under
    :data:`STALL_MAX_MFU` (NaN where the hardware is unknown)."""
    c = _cols(frame)
    return np.maximum(STALL_MIN_SECONDS_PER_MICROBATCH * num_microbatches(c),
                      step_time_at_mfu(c, STALL_MAX_MFU))


STALL_FEATURE_NAMES: tuple[str, ...] = (
    "log10_compute_s_per_step", "log10_compute_s_per_micro", "log2_nodes")
"""Columns of :func:`stall_features`: the physics of the stalled regime, free of model size.
A stalled micro-batch costs about a fixed second whatever the model; that cost matters where
it is large next to the compute per device (runs spread thin over many nodes) and vanishes
where the compute is large. In the public H100 sweep no pipeline run with three seconds or
more of model FLOPs per device per step stalled. The memory fraction and which axes cross
nodes are left out: within the sweep they follow the model's size (larger models stalled
more often at the same compute), and a classifier on them called nearly every deep pipeline
of a ten-times larger model stalled."""

STALL_MONOTONE: dict[str, int] = {"log10_compute_s_per_step": -1,
                                  "log10_compute_s_per_micro": -1}
"""Directions the stall probability for an unseen model keeps: never rising with the compute
per device, so a larger model's layouts are no likelier to stall than the ones measured."""


def stall_features(frame: pd.DataFrame | Columns) -> np.ndarray:
    """The stall classifier's matrix for models not in the training data
    (:data:`STALL_FEATURE_NAMES`): log model-FLOPs seconds at peak per device per step and
    per micro-batch, and log2 nodes."""
    c = _cols(frame)
    compute = step_time_at_mfu(c)
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = {
            "log10_compute_s_per_step": np.log10(compute),
            "log10_compute_s_per_micro": np.log10(compute / num_microbatches(c)),
            "log2_nodes": np.log2(np.ceil(c.world / c.per_node)),
        }
    matrix = np.column_stack([columns[name] for name in STALL_FEATURE_NAMES]).astype(
        np.float32)
    matrix[~np.isfinite(matrix)] = np.nan
    return matrix
