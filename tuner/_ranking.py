"""Ranking predicted configs: scoring them in one vectorised call, the ranked result, and
the exhaustive search that predicts every config of a space."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paratune.batch import ConfigBatch
from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import Predictor, config_frame
from paratune.table import format_table
from paratune.tuner._objective import Objective

if TYPE_CHECKING:
    import pandas as pd

    from paratune.tuner._space import SearchSpace

__all__ = ["SearchResult", "evaluate", "exhaustive", "rank"]


@dataclass
class SearchResult:
    """Ranked, scored configs from one search: the rows (:attr:`ranked`) and, beside them,
    their configs (:attr:`batch`)."""

    ranked: pd.DataFrame
    """One row per distinct config evaluated: config columns, predictions (``pred_*``, as
    the predictor names them), scores, ``rank`` (1 = best; feasible configs first, then by
    objective) and ``vs_best`` (objective as a fraction of the best's)."""
    space: SearchSpace
    objective: Objective
    mode: str
    """``"exhaustive"`` or the sampler's name."""
    num_trials: int = 0
    """Trials in the study (all workers, all sessions) or configs enumerated."""
    num_pruned: int = 0
    """Trials pruned because the sampled config broke a rule."""
    wall_time_s: float = 0.0
    """Seconds this call spent searching."""
    study_name: str | None = None
    storage: str | None = None
    skipped: list[tuple[ParallelConfig, str]] = field(default_factory=list)
    """Configs left out of an exhaustive search, with the rule each breaks."""
    risk_aware: bool = False
    """Whether ``ranked`` is by the risk-aware expectation (see
    :func:`paratune.tuner.risk_aware_ranking`), as where the model extrapolates."""
    storage_lost: str | None = None
    """Why the study's storage stopped recording mid-search (``None`` where it did not): the
    ranking then covers the configs this search evaluated, and the study holds only the
    trials told before."""
    _batch: tuple[pd.DataFrame, ConfigBatch] | None = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def batch(self) -> ConfigBatch:
        """The configs of :attr:`ranked`'s rows, in its order (read once per ranking: a
        re-ranked result, e.g. by :func:`~paratune.tuner.risk_aware_ranking`, gets its own)."""
        if self._batch is None or self._batch[0] is not self.ranked:
            batch = (ConfigBatch.from_frame(self.ranked) if len(self.ranked)
                     else ConfigBatch.from_configs(self.space.model, [], self.space.hardware))
            self._batch = (self.ranked, batch)
        return self._batch[1]

    @property
    def best(self) -> ParallelConfig:
        """The top-ranked config."""
        if self.ranked.empty:
            raise ConfigError("space", self.space.model.name, "no config was evaluated")
        return self.batch.config_at(0)

    @property
    def best_row(self) -> pd.Series:
        return self.ranked.iloc[0]

    @property
    def best_feasible(self) -> bool:
        return bool(not self.ranked.empty and self.ranked.iloc[0]["feasible"])

    def top(self, k: int = 10) -> pd.DataFrame:
        return self.ranked.head(k)

    def configs(self, k: int | None = None) -> list[ParallelConfig]:
        """The ranked configs, best first (the first ``k``)."""
        return (self.batch if k is None else self.batch[:k]).configs()

    def ranked_quantity(self) -> tuple[str, str]:
        """What the ranking maximises: a short column label and a description.

        ``ranked_tokens_per_s`` is the predicted throughput itself, its lower quantile
        (``risk_quantile``) or, where the predictor gives one, the throughput of the expected
        step time (a pipeline likely to stall counted at its stalled speed); under the goodput
        objective it is multiplied by the statistical efficiency; where the predictor gives a
        probability of running below one, the objective is that times it (``x p_ok``).
        """
        label, words = self._throughput_quantity()
        if self.objective.kind.value == "goodput":
            label, words = "goodput", (f"goodput = {label} x eff ({words} x statistical "
                                       "efficiency)")
        if self._weighted_by_running():
            label, words = (f"{label} x p_ok", f"{words} x p_ok (the probability of running: "
                                                "a run that fails delivers nothing)")
        return label, words

    def _throughput_quantity(self) -> tuple[str, str]:
        """The throughput the ranking is by (``ranked_tokens_per_s``): its column label and a
        description; ``tok/s`` where it is the predicted throughput itself."""
        risk = self.objective.risk_quantile
        if self.risk_aware:
            return "risk tok/s", ("the risk-aware expectation (geometric mean of the "
                                  "expected tokens/s and its q10: the model extrapolates)")
        if risk:
            return f"{risk} tok/s", f"the {risk} quantile of predicted tokens/s"
        if self._expected_differs():
            return "exp tok/s", "expected tokens/s (stall-weighted)"
        return "tok/s", "predicted tokens/s"

    def _weighted_by_running(self) -> bool:
        """Whether the objective counts a probability of running below one anywhere."""
        import numpy as np

        if self.ranked.empty or "feasible_prob" not in self.ranked.columns:
            return False
        prob = self.ranked["feasible_prob"].to_numpy(dtype=float)
        return bool(np.any(np.isfinite(prob) & (prob < 1.0)))

    def _expected_differs(self) -> bool:
        """Whether the ranked throughput differs from the predicted one anywhere."""
        import numpy as np

        if self.ranked.empty or "ranked_tokens_per_s" not in self.ranked.columns:
            return False
        ranked = self.ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
        plain = self.ranked["tokens_per_s"].to_numpy(dtype=float)
        return not bool(np.allclose(ranked, plain, rtol=1e-9, equal_nan=True))

    def table(self, k: int = 10) -> str:
        """The top ``k`` as a terminal table.

        Columns show what they hold: ``tok/s`` is the predicted throughput; where the
        ranking uses another throughput (a quantile, or the stall-weighted expected one) it
        is shown beside it; ``eff`` and ``goodput`` only under the goodput objective;
        ``vs_best`` (the ranked quantity as a share of rank 1's) only for configs predicted
        feasible, since the others rank below every feasible config whatever their value.
        """
        import numpy as np

        rows = []
        # the probability of a stalled pipeline, where the predictor learned that regime
        stall = ("pred_stall_prob" in self.ranked.columns
                 and bool((self.top(k)["pred_stall_prob"].fillna(0) > 0).any()))
        goodput = self.objective.kind.value == "goodput"
        label, words = self.ranked_quantity()
        # the ranked throughput's own column, where it is not the predicted one (tok/s)
        ranked_label = self._throughput_quantity()[0]
        ranked_label = None if ranked_label == "tok/s" else ranked_label
        # under the risk-aware ranking the expected throughput decides which configs rank
        # first (those within RISK_AWARE_WITHIN of the best): shown where it is not tok/s
        expected = (self.risk_aware and "expected_tokens_per_s" in self.ranked.columns
                    and not np.allclose(self.ranked["expected_tokens_per_s"].to_numpy(float),
                                        self.ranked["tokens_per_s"].to_numpy(float),
                                        rtol=1e-9, equal_nan=True))
        # a CPU run's ranks are processes on a host's cores, not GPUs
        per_device = ("tok/s/gpu" if self.space.hardware.device_type == "cuda"
                      else f"tok/s/{self.space.hardware.device_type}")
        infeasible = False
        for _, row in self.top(k).iterrows():
            feasible = bool(row["feasible"])
            infeasible |= not feasible
            rows.append({
                "rank": int(row["rank"]), "gbs": int(row["global_batch_size"]),
                "dp": int(row["dp"]), "tp": int(row["tp"]), "pp": int(row["pp"]),
                "mbs": int(row["micro_batch_size"]),
                "schedule": (row["schedule"] if row["pp"] > 1 else "-")
                + (f"/v{int(row['virtual_stages'])}" if row["virtual_stages"] > 1 else ""),
                "sharding": row["sharding"], "recompute": row["recompute"],
                "tok/s": float(row["tokens_per_s"]),
                **({"exp tok/s": float(row["expected_tokens_per_s"])} if expected else {}),
                **({ranked_label: float(row["ranked_tokens_per_s"])} if ranked_label else {}),
                per_device: float(row["tokens_per_s"]) / float(row["world_size"]),
                "step_s": float(row["step_time_s"]), "mem_gb": float(row["peak_mem_gb"]),
                "p_ok": float(row["feasible_prob"]),
                **({"p_stall": float(row["pred_stall_prob"])} if stall else {}),
                **({"eff": float(row["efficiency"]), "goodput": float(row["goodput"])}
                   if goodput else {}),
                "vs_best": f"{100 * float(row['vs_best']):.1f}%" if feasible else "-",
                "ok": "yes" if feasible else "NO",
            })
        model = self.space.model
        title = (f"{model.name} ({model.seq_len} tokens per sequence) on "
                 f"{self.space.world_size} x {self.space.hardware.name}: top {len(rows)} by "
                 f"{label} ({self.mode}, {self.num_trials} trials/configs)")
        notes = [f"ranked by {words}, feasible configs first; vs_best: {label} as a share "
                 "of the best feasible config's"]
        if self.risk_aware:
            from paratune.models import RISK_AWARE_WITHIN

            expected = (("goodput" if goodput else "tokens/s")
                        + (" x p_ok" if self._weighted_by_running() else ""))
            notes.append(f"the configs within {RISK_AWARE_WITHIN:.0%} of the best expected "
                         f"{expected} rank first: safety is not bought with more")
        if infeasible:
            notes.append("ok NO: predicted not to run (probability of running below the "
                         "threshold, or memory over the limit); ranked after every feasible "
                         "config, no vs_best")
        if self.storage_lost is not None:
            notes.append(f"the study was not fully recorded: {self.storage_lost}; ranked "
                         f"here are the {len(self.ranked)} configs this search evaluated")
        return "\n".join([format_table(rows, title=title, floatfmt=".4g"), *notes])


def evaluate(predictor: Predictor, space: SearchSpace, configs: Sequence[ParallelConfig],
             objective: Objective) -> pd.DataFrame:
    """Predict and score ``configs`` in one vectorised call.

    Returns:
        The config frame joined with the predictions and the objective's score columns,
        one row per config in the given order.
    """
    import pandas as pd

    frame = config_frame(space.model, configs, space.hardware,
                         devices_per_node=space.devices_per_node)
    if frame.empty:
        return frame
    if space.framework:  # the runs of that framework (the model's family of that source)
        frame["source"] = space.framework
    preds = predictor.predict(frame)
    if len(preds) != len(frame):
        raise ConfigError("predictor", type(predictor).__name__,
                          f"returned {len(preds)} rows for {len(frame)} configs")
    scored = objective.score(frame, preds, space)
    extra = [c for c in scored.columns if c not in frame.columns]
    return pd.concat([frame.reset_index(drop=True), scored[extra]], axis=1)


def rank(scored: pd.DataFrame) -> pd.DataFrame:
    """Feasible first, then (after a risk-aware re-ranking) the configs it may choose
    (``risk_candidate``), then by objective (descending); adds ``rank`` and ``vs_best``."""
    if scored.empty:
        return scored.assign(rank=[], vs_best=[])
    keys = ["feasible", *(["risk_candidate"] if "risk_candidate" in scored.columns else []),
            "objective"]
    ordered = scored.sort_values(keys, ascending=[False] * len(keys),
                                 kind="stable").reset_index(drop=True)
    best = float(ordered["objective"].iloc[0])
    ordered["rank"] = range(1, len(ordered) + 1)
    ordered["vs_best"] = ordered["objective"] / best if best > 0 else math.nan
    return ordered


def exhaustive(predictor: Predictor, space: SearchSpace, objective: Objective, *,
               chunk_size: int = 50_000) -> SearchResult:
    """Enumerate the whole space and predict every config (vectorised, in chunks).

    Args:
        predictor: Anything with ``predict(config_frame)``.
        space: The space.
        objective: What to maximise.
        chunk_size: Configs per ``predict`` call (bounds memory on huge spaces).
    """
    import pandas as pd

    objective.check(space)
    start = time.perf_counter()
    enum = space.enumerate()
    parts = [evaluate(predictor, space, enum.valid[i:i + chunk_size], objective)
             for i in range(0, len(enum.valid), chunk_size)]
    scored = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return SearchResult(ranked=rank(scored), space=space, objective=objective,
                        mode="exhaustive", num_trials=len(enum.valid),
                        wall_time_s=time.perf_counter() - start, skipped=enum.skipped)
