"""The contract between the performance models and their users (the tuner, the CLI).

A predictor takes a *config frame*: one row per (model, parallel config, hardware) with the
columns of :data:`CONFIG_COLUMNS` (the same names as a measurement row, see
:meth:`paratune.Measurement.to_row`), and returns a frame with one row per input row, in
order, holding the :data:`PREDICTION_COLUMNS`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CONFIG_COLUMNS",
    "MEMORY_FRACTION",
    "MIN_FEASIBLE_PROB",
    "MODEL_COLUMNS",
    "PARALLEL_COLUMNS",
    "PREDICTION_COLUMNS",
    "PRED_FEASIBLE_PROB",
    "PRED_PEAK_MEM_GB",
    "PRED_STEP_TIME_S",
    "PRED_TOKENS_EXPECTED",
    "PRED_TOKENS_PER_SEC_PER_GPU",
    "Predictor",
    "config_frame",
    "predicted_to_run",
    "running_weight",
    "throughput_quantile_columns",
]

MODEL_COLUMNS: tuple[str, ...] = ("model_name",) + tuple(
    f.name for f in dataclasses.fields(ModelSpec) if f.name not in ("name", "extra"))
PARALLEL_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ParallelConfig))
CONFIG_COLUMNS: tuple[str, ...] = (MODEL_COLUMNS + PARALLEL_COLUMNS
                                   + ("world_size", "num_microbatches", "hardware",
                                      "devices_per_node"))

PRED_STEP_TIME_S = "pred_step_time_s"
PRED_TOKENS_PER_SEC_PER_GPU = "pred_tokens_per_sec_per_gpu"
PRED_FEASIBLE_PROB = "pred_feasible_prob"
MIN_FEASIBLE_PROB = 0.5
"""The predicted probability of running from which a config counts as feasible: the tuner's
default, which ranks such configs before the others; ``evaluate`` chooses as it does."""
MEMORY_FRACTION = 0.95
"""The share of device memory a config's predicted peak may take to count as feasible (the
tuner's default where no memory limit is given)."""
PRED_PEAK_MEM_GB = "pred_peak_mem_gb"
PRED_TOKENS_EXPECTED = f"{PRED_TOKENS_PER_SEC_PER_GPU}_expected"
"""Optional: the throughput of the expected step time where a run may fall into more than one
regime (e.g. a stalled pipeline); the tuner ranks by it when a predictor gives it."""
PREDICTION_COLUMNS = (PRED_STEP_TIME_S, PRED_TOKENS_PER_SEC_PER_GPU, PRED_FEASIBLE_PROB,
                      PRED_PEAK_MEM_GB)


def throughput_quantile_columns(columns: Iterable[Any]) -> list[str]:
    """The predicted throughput quantiles among ``columns``
    (``pred_tokens_per_sec_per_gpu_qNN``), lowest first: ``_q10`` and ``_q90`` from a
    model with the default quantiles, others from one fitted with other quantiles."""
    pattern = re.compile(rf"{PRED_TOKENS_PER_SEC_PER_GPU}_q\d\d")
    return sorted(str(c) for c in columns if pattern.fullmatch(str(c)))


@runtime_checkable
class Predictor(Protocol):
    """Anything that maps a config frame to predictions.

    ``predict`` may add further columns (quantiles such as
    ``pred_tokens_per_sec_per_gpu_q10``, the expected throughput
    :data:`PRED_TOKENS_EXPECTED`, an analytical estimate, ...).
    """

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame: ...


def config_frame(model: ModelSpec, configs: Iterable[ParallelConfig],
                 hardware: HardwareSpec | str, *,
                 devices_per_node: int | None = None) -> pd.DataFrame:
    """Build a config frame for ``configs`` of ``model`` on ``hardware`` (the frame of
    :meth:`paratune.batch.ConfigBatch.from_configs`).

    Args:
        model: The model.
        configs: Layouts to describe (not validated here).
        hardware: Catalogue entry or its name.
        devices_per_node: Overrides the catalogue's node size.
    """
    from paratune.batch import ConfigBatch

    return ConfigBatch.from_configs(model, configs, hardware,
                                    devices_per_node=devices_per_node).to_frame()


def predicted_to_run(prob: Any, peak_mem_gb: Any = None, limit_gb: Any = math.inf, *,
                     min_prob: float = MIN_FEASIBLE_PROB) -> Any:
    """Which configs a prediction calls feasible, the rule the tuner ranks by: a probability
    of running that is a number of at least ``min_prob`` and, under a finite memory limit
    (per config or one for all), a predicted peak memory that is a number within it
    (``peak_mem_gb`` ``None``: a predictor without memory is not held to the limit); a
    boolean array."""
    import numpy as np

    prob = np.asarray(prob, dtype=float)
    runs = np.isfinite(prob) & (prob >= min_prob)
    if peak_mem_gb is None:
        return runs
    mem = np.asarray(peak_mem_gb, dtype=float)
    limit = np.asarray(limit_gb, dtype=float)
    # a NaN peak is within no finite limit
    return runs & ((mem <= limit) | ~np.isfinite(limit))


def running_weight(prob: Any) -> Any:
    """What the tuner weighs a config's throughput by: its predicted probability of running
    (a run that fails delivers nothing), clipped to [0, 1]; one where the probability is not
    a number (such a config is not feasible, :func:`predicted_to_run`, and ranks after every
    feasible one whatever its weight)."""
    import numpy as np

    prob = np.asarray(prob, dtype=float)
    return np.where(np.isfinite(prob), np.clip(prob, 0.0, 1.0), 1.0)
