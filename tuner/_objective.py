"""What the tuner maximises, and which predicted configs it accepts.

``throughput`` is tokens per second at one global batch size (what systems work optimises);
``goodput`` is throughput times the statistical efficiency of the global batch (see
:mod:`paratune.tuner._efficiency`), so that a larger batch is only worth its extra speed if
the gradient noise scale allows it. Memory is a constraint, not a penalty: a config is
feasible when the predicted probability that it runs is at least ``min_feasible_prob`` and
its predicted peak memory fits the device. Among feasible configs the objective is what a
launch is expected to deliver: the quantity times the probability of running, since a run
that fails delivers nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError
from paratune.predictor import (
    MEMORY_FRACTION,
    MIN_FEASIBLE_PROB,
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_STEP_TIME_S,
    PRED_TOKENS_EXPECTED,
    PRED_TOKENS_PER_SEC_PER_GPU,
    predicted_to_run,
    running_weight,
    throughput_quantile_columns,
)
from paratune.tuner._efficiency import _positive, pollux_efficiency

if TYPE_CHECKING:
    import pandas as pd

    from paratune.tuner._space import SearchSpace

__all__ = ["SCORE_COLUMNS", "Objective", "ObjectiveKind"]

SCORE_COLUMNS = ("tokens_per_s", "ranked_tokens_per_s", "step_time_s", "peak_mem_gb",
                 "feasible_prob", "efficiency", "goodput", "objective", "violation_feasible",
                 "violation_memory", "feasible")
"""Columns :meth:`Objective.score` adds to a prediction frame."""


class ObjectiveKind(StrEnum):
    """Quantity to maximise."""

    THROUGHPUT = "throughput"
    GOODPUT = "goodput"


@dataclass(frozen=True, kw_only=True)
class Objective:
    """The quantity to maximise and the feasibility constraint."""

    kind: ObjectiveKind = ObjectiveKind.THROUGHPUT
    """``throughput`` or ``goodput``."""
    b_noise: float | None = None
    """Gradient noise scale in sequences (needed by ``goodput``)."""
    b0: float | None = None
    """Reference batch of the Pollux efficiency; defaults to the smallest batch searched."""
    risk_quantile: str | None = None
    """Rank by this quantile of predicted throughput (e.g. ``"q10"``, the column
    ``pred_tokens_per_sec_per_gpu_q10``) instead of the expected throughput (the column
    ``pred_tokens_per_sec_per_gpu_expected`` where the predictor gives it, else its point
    prediction), either times the probability of running: risk-averse choices."""
    min_feasible_prob: float = MIN_FEASIBLE_PROB
    """Smallest predicted probability of running (not OOM) for a config to be feasible."""
    memory_limit_gb: float | None = None
    """Largest predicted peak memory per device; defaults to ``memory_fraction`` of the
    device's memory (no limit where the catalogue gives none, e.g. CPU)."""
    memory_fraction: float = MEMORY_FRACTION
    """Share of device memory usable when ``memory_limit_gb`` is not given."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ObjectiveKind(self.kind))
        except ValueError:
            raise ConfigError("objective", self.kind, "must be throughput or goodput") from None
        if self.kind is ObjectiveKind.GOODPUT and self.b_noise is None:
            raise ConfigError("gns", None, "objective=goodput needs the gradient noise scale "
                              "B_noise (a number of sequences, or a trajectory file)")
        if self.b_noise is not None:
            _positive("gns", self.b_noise, "must be a positive, finite number of sequences")
        if self.b0 is not None:
            _positive("b0", self.b0, "the reference batch must be a positive, finite number of "
                      "sequences")
        if not 0.0 <= self.min_feasible_prob <= 1.0:
            raise ConfigError("min_feasible_prob", self.min_feasible_prob,
                              "must be a probability in [0, 1]")
        if self.risk_quantile is not None:
            object.__setattr__(self, "risk_quantile", _lower_quantile(self.risk_quantile))
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError("memory_fraction", self.memory_fraction, "must be in (0, 1]")
        if self.memory_limit_gb is not None and not (
                math.isfinite(self.memory_limit_gb) and self.memory_limit_gb > 0):
            raise ConfigError("memory_limit_gb", self.memory_limit_gb,
                              "must be a positive number of GB")

    # ------------------------------------------------------------------
    def check(self, space: SearchSpace) -> None:
        """Raise if this objective cannot compare the configs of ``space``."""
        if self.kind is ObjectiveKind.THROUGHPUT and len(space.global_batch_sizes) > 1:
            raise ConfigError("global_batch_sizes", list(space.global_batch_sizes),
                              "objective=throughput compares configs at one global batch "
                              "size; use objective=goodput (with --gns) to search the batch")

    def memory_limit(self, space: SearchSpace) -> float:
        if self.memory_limit_gb is not None:
            return float(self.memory_limit_gb)
        if space.hardware.memory_gb > 0:
            return self.memory_fraction * space.hardware.memory_gb
        return math.inf

    def reference_batch(self, space: SearchSpace) -> float:
        return float(self.b0 if self.b0 is not None else min(space.global_batch_sizes))

    def score(self, configs: pd.DataFrame, predictions: pd.DataFrame,
              space: SearchSpace) -> pd.DataFrame:
        """Score predicted configs (vectorised).

        Args:
            configs: The config frame that was predicted.
            predictions: The predictor's output (same rows, same order).
            space: The search space (memory limit, reference batch).

        Returns:
            ``predictions`` with the :data:`SCORE_COLUMNS` added: cluster tokens/s, the
            tokens/s used for ranking (a quantile under ``risk_quantile``), efficiency,
            goodput, the objective (the ranked tokens/s, or the goodput, times the
            probability of running), constraint violations (``<= 0`` is satisfied) and
            ``feasible``. A config is feasible when its predicted throughput is a number, its
            predicted probability of running is a number of at least ``min_feasible_prob``
            and, under a memory limit, its predicted peak memory is a number within it; a
            failed (NaN) prediction of any of them makes it infeasible. A predictor without
            a peak-memory column is not held to the memory limit.

        Raises:
            ConfigError: ``risk_quantile`` names a column the predictor does not produce.
        """
        out = predictions.reset_index(drop=True).copy()
        world = configs["world_size"].to_numpy(dtype=float)
        batch = configs["global_batch_size"].to_numpy(dtype=float)
        seq = configs["seq_len"].to_numpy(dtype=float)
        per_gpu = out[PRED_TOKENS_PER_SEC_PER_GPU].to_numpy(dtype=float)
        out["tokens_per_s"] = per_gpu * world
        if self.risk_quantile:
            column = f"{PRED_TOKENS_PER_SEC_PER_GPU}_{self.risk_quantile}"
            if column not in out.columns:
                given = [c.rsplit("_", 1)[-1] for c in throughput_quantile_columns(out.columns)]
                raise ConfigError("risk_quantile", self.risk_quantile,
                                  f"the predictor gives no {column} column (its quantiles: "
                                  f"{', '.join(given) or 'none'})")
            out["ranked_tokens_per_s"] = out[column].to_numpy(dtype=float) * world
        elif PRED_TOKENS_EXPECTED in out.columns:
            # the throughput of the expected step time: a configuration likely to stall is
            # ranked by what it is likely to run at, not by its fast regime
            expected = out[PRED_TOKENS_EXPECTED].to_numpy(dtype=float) * world
            out["ranked_tokens_per_s"] = np.where(np.isfinite(expected), expected,
                                                  out["tokens_per_s"])
        else:
            out["ranked_tokens_per_s"] = out["tokens_per_s"]
        step = (out[PRED_STEP_TIME_S].to_numpy(dtype=float) if PRED_STEP_TIME_S in out
                else np.full(len(out), np.nan))
        out["step_time_s"] = np.where(np.isfinite(step), step, batch * seq / out["tokens_per_s"])
        mem = (out[PRED_PEAK_MEM_GB].to_numpy(dtype=float) if PRED_PEAK_MEM_GB in out
               else np.full(len(out), np.nan))
        prob = (out[PRED_FEASIBLE_PROB].to_numpy(dtype=float) if PRED_FEASIBLE_PROB in out
                else np.ones(len(out)))
        out["peak_mem_gb"] = mem
        out["feasible_prob"] = prob
        if self.kind is ObjectiveKind.GOODPUT:
            eff = pollux_efficiency(batch, self.b_noise, self.reference_batch(space))
        else:
            eff = np.ones(len(out))
        out["efficiency"] = eff
        out["goodput"] = out["ranked_tokens_per_s"].to_numpy() * eff
        objective = (out["goodput"] if self.kind is ObjectiveKind.GOODPUT
                     else out["ranked_tokens_per_s"]).to_numpy(dtype=float)
        # a run that fails (out of memory) delivers nothing: the objective is what a launch
        # is expected to deliver, the ranked throughput times the probability of running
        out["objective"] = objective * running_weight(prob)
        # A failed (NaN) throughput prediction ranks last and, like a failed probability
        # below, makes the config infeasible: nothing says how fast, or whether, it runs.
        predicted = np.isfinite(out["objective"].to_numpy(dtype=float))
        out["objective"] = out["objective"].fillna(0.0).clip(lower=0.0)
        # A prediction that failed (NaN) is not evidence that a config runs: it violates
        # the constraint (Optuna reads > 0 as violated) and the config is not feasible.
        out["violation_feasible"] = np.where(
            predicted, np.nan_to_num(self.min_feasible_prob - prob, nan=1.0), 1.0)
        limit = self.memory_limit(space)
        held = math.isfinite(limit) and PRED_PEAK_MEM_GB in out.columns
        out["violation_memory"] = (np.nan_to_num((mem - limit) / limit, nan=1.0) if held
                                   else 0.0)
        out["feasible"] = predicted_to_run(prob, mem if held else None, limit,
                                           min_prob=self.min_feasible_prob) & predicted
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "b_noise": self.b_noise, "b0": self.b0,
                "risk_quantile": self.risk_quantile,
                "min_feasible_prob": self.min_feasible_prob,
                "memory_limit_gb": self.memory_limit_gb,
                "memory_fraction": self.memory_fraction,
                # what the objective is multiplied by (a study stored before it was has
                # values of another problem, and is not resumed with these)
                "weighted_by": PRED_FEASIBLE_PROB}


def _lower_quantile(value: Any) -> str:
    """The name of a lower quantile of the predicted throughput (``q10``, ``q05``: the
    predictor's spelling) from such a name or a fraction (``0.1``).

    Raises:
        ConfigError: neither a quantile's name nor a fraction, or not below the median (an
            upper quantile would rank by the most optimistic throughput).
    """
    text = str(value).strip().lower()
    try:
        percent = float(text[1:]) if text.startswith("q") else 100 * float(text)
    except ValueError:
        percent = math.nan
    # a whole percent from 1 to 49: the predictor's quantiles are named so
    if not (math.isfinite(percent) and abs(percent - round(percent)) < 1e-6
            and 1 <= round(percent) <= 49):
        raise ConfigError("risk_quantile", value, "must name a lower quantile of the "
                          "predicted throughput, such as q10 (or 0.1): a whole percent below "
                          "the median, which ranks by the slow end")
    return f"q{round(percent):02d}"
