"""Measuring the verified configs and refitting on them: each config a one-config campaign
(:func:`pinned_space`), then the model refitted on the old data plus the new runs, and each
config's prediction before, measurement and prediction after, side by side."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Schedule
from paratune.space import ConfigSpace

if TYPE_CHECKING:
    import pandas as pd

    from paratune.profiler.campaign import CampaignSpec
    from paratune.tuner._space import SearchSpace
    from paratune.tuner._tune import TuneResult

__all__ = ["VerifyOptions", "VerifyRuns", "pinned_space", "refit_and_compare"]

# the verification's modules log under one name, the one users and their filters know
logger = logging.getLogger("paratune.tuner._verify")


def pinned_space(config: ParallelConfig) -> ConfigSpace:
    """The :class:`ConfigSpace` whose only valid config on ``config.world_size`` devices is
    ``config``."""
    interleaved = config.schedule is Schedule.INTERLEAVED_1F1B
    return ConfigSpace(global_batch_sizes=(config.global_batch_size,),
                       micro_batch_sizes=(config.micro_batch_size,),
                       schedules=(config.schedule,),
                       virtual_stages=(config.virtual_stages if interleaved else 2,),
                       shardings=(config.sharding,), recomputes=(config.recompute,),
                       tp_degrees=(config.tp,), pp_degrees=(config.pp,), tp_within_node=False)


@dataclass(frozen=True)
class VerifyRuns:
    """How each verified config is measured (the same here and on the cluster)."""

    warmup_steps: int = 2
    """Warm-up steps per config."""
    measured_steps: int = 5
    """Timed steps per config."""
    timeout_s: float = 300.0
    """Per-config timeout."""

    @staticmethod
    def directory_name(space: SearchSpace, config: ParallelConfig) -> str:
        """The folder of ``config``'s campaign: its key and a digest of the job (the model
        with its sequence length, the hardware, the devices per node), so that the same
        layout of another job is a campaign of its own, not a resume refused for the job."""
        import hashlib
        import json

        job = json.dumps([space.model.to_dict(), space.hardware.name, space.devices_per_node],
                         sort_keys=True, default=str)
        return f"{config.key()}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"

    def campaign(self, space: SearchSpace, config: ParallelConfig, *,
                 device: str) -> CampaignSpec:
        """The one-config profiling campaign that measures ``config`` of ``space``'s job, on
        the space's devices per node (those torchrun starts where the job spreads over
        nodes it does not fill, see :meth:`SearchSpace.build`)."""
        from paratune.profiler.campaign import CampaignSpec

        return CampaignSpec(model=space.model, world_sizes=(config.world_size,),
                            space=pinned_space(config), warmup_steps=self.warmup_steps,
                            measured_steps=self.measured_steps, timeout_s=self.timeout_s,
                            device=device, hardware=space.hardware.name,
                            devices_per_node=space.devices_per_node)


_RUN_FIELDS = ("warmup_steps", "measured_steps", "timeout_s")


@dataclass(frozen=True)
class VerifyOptions:
    """How a verification measures, refits and where it writes (here and on the cluster)."""

    dataset: str | Path | Sequence[str | Path] | None = None
    """Measurements the predictor was fitted on (dataset directories, public CSVs or parquet
    files), refitted with the verified runs; ``None``: the refit uses those runs alone."""
    out_dir: str | Path | None = None
    """Where the verification campaigns go (``None``: ``verify/`` beside the recommendation)."""
    refit_dir: str | Path | None = None
    """Where the refitted model is saved (``None``: ``out_dir/refit``)."""
    runs: VerifyRuns = field(default_factory=VerifyRuns)
    """Warm-up and timed steps and the timeout of each verified config."""
    model_factory: Any = None
    """Callable returning an unfitted model with ``fit``/``save`` (``None``:
    :class:`paratune.models.PerformanceModel`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.runs, VerifyRuns):
            raise ConfigError("runs", self.runs, "must be a VerifyRuns")
        if self.model_factory is not None and not callable(self.model_factory):
            raise ConfigError("model_factory", self.model_factory, "must be callable")

    @classmethod
    def build(cls, options: VerifyOptions | None = None, **overrides: Any) -> VerifyOptions:
        """``options`` (default: the defaults) with ``overrides`` by field name; the fields of
        :class:`VerifyRuns` (``warmup_steps``, ``measured_steps``, ``timeout_s``) are taken
        by their own names too, as a dict given as ``SearchOptions.verify_options`` names
        them.

        Raises:
            ConfigError: an override that is no field of either (field ``verify_options``).
        """
        options = options if options is not None else cls()
        own = {f.name for f in fields(cls)} - {"runs"}
        unknown = sorted(set(overrides) - own - set(_RUN_FIELDS) - {"runs"})
        if unknown:
            raise ConfigError("verify_options", unknown[0], "is not one of "
                              f"{', '.join(sorted(own | set(_RUN_FIELDS)))}")
        runs = overrides.pop("runs", options.runs)
        run_fields = {name: overrides.pop(name) for name in _RUN_FIELDS if name in overrides}
        if run_fields:
            runs = replace(runs, **run_fields)
        return replace(options, runs=runs, **overrides)


def refit_and_compare(result: TuneResult, configs: list[ParallelConfig],
                      frames: list[pd.DataFrame], predicted: list[float], *,
                      dataset: str | Path | Sequence[str | Path] | None, refit_path: Path,
                      model_factory: Any) -> pd.DataFrame:
    """Refit on ``dataset`` plus the verified runs (``frames``, one per config) and tabulate
    each config's prediction before, measurement and prediction after."""
    import pandas as pd

    measured = pd.concat(frames, ignore_index=True)
    after, refitted = _refit(result, configs, measured, dataset=dataset,
                             refit_path=refit_path, model_factory=model_factory)
    rows = [_comparison(cfg, own, predicted[i], float(after.iloc[i]))
            for i, (cfg, own) in enumerate(zip(configs, frames))]
    statuses = pd.Series([row["status"] for row in rows]).value_counts()
    ran = int(statuses.get("ok", 0))
    failed = ", ".join(f"{n} {s}" for s, n in statuses.items() if s != "ok")
    logger.info("measured %d config%s: %d ran%s; %s", len(rows), "" if len(rows) == 1 else "s",
                ran, f", {failed}" if failed else "",
                f"refitted model saved to {refit_path} (the ranking above is the predictor's "
                f"before these runs: --predictor {refit_path} ranks with them)"
                if refitted else "no refit saved")
    return pd.DataFrame(rows)


def _refit(result: TuneResult, configs: list[ParallelConfig], measured: pd.DataFrame, *,
           dataset: str | Path | Sequence[str | Path] | None, refit_path: Path,
           model_factory: Any) -> tuple[pd.Series, bool]:
    """The refitted model's throughput of each of ``configs`` (NaN where nothing ran), and
    whether a refit was saved."""
    import pandas as pd

    from paratune.models import load_measurements
    from paratune.tuner._search import evaluate

    training = [measured]
    if dataset is not None:
        paths = [dataset] if isinstance(dataset, (str, Path)) else list(dataset)
        training.insert(0, load_measurements(paths))
    else:
        logger.warning("refitting on the %d verified runs alone: without --dataset the "
                       "measurements the predictor was fitted on are not in the refit",
                       len(measured))
    frame = pd.concat(training, ignore_index=True)
    if model_factory is None:
        from paratune.models import PerformanceModel

        model_factory = PerformanceModel
    if not (frame["status"] == "ok").any():
        logger.warning("no verified config ran (statuses: %s); nothing to refit on",
                       ", ".join(measured["status"].astype(str)))
        return pd.Series([math.nan] * len(configs)), False
    refit = model_factory().fit(frame)
    saved = hasattr(refit, "save")
    if saved:
        refit.save(refit_path)
    return (evaluate(refit, result.search.space, configs,
                     result.search.objective)["tokens_per_s"], saved)


def _comparison(cfg: ParallelConfig, own: pd.DataFrame, pred: float, new: float
                ) -> dict[str, Any]:
    """One row of the comparison: ``cfg``'s prediction before, its measurement (from its own
    campaign ``own``) and the refit's prediction."""
    from paratune.batch import ConfigBatch

    # matched on the whole config: configs that differ only in sharding, recomputation or
    # schedule share their degrees and batch sizes
    match = own.iloc[[j for j, config in enumerate(ConfigBatch.from_frame(own).configs())
                      if config == cfg]]
    status = str(match["status"].iloc[0]) if len(match) else "missing"
    got = float(match["tokens_per_s"].iloc[0]) if len(match) and status == "ok" else math.nan
    return {"config": cfg.key(), "status": status, "pred_tokens_per_s": pred,
            "measured_tokens_per_s": got,
            "error_pct": 100 * (pred - got) / got if got > 0 else math.nan,
            "refit_tokens_per_s": new,
            "refit_error_pct": 100 * (new - got) / got if got > 0 else math.nan}
