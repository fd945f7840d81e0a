"""Closing the loop: profile the recommended configs for real, refit, compare.

``verify_top_k`` runs each of the top-K configs of a tuning result as a one-config profiling
campaign (:func:`paratune.profiler.campaign.run_campaign`) on this machine, adds the
measurements to the training data, refits the performance model and reports, for every
verified config, the prediction before, the measurement and the prediction after the refit.
``verify_on_cluster`` prepares the same on the target cluster and reads it back.

The pieces: choosing the configs (:mod:`~paratune.tuner._verify_list`), measuring and
refitting (:mod:`~paratune.tuner._verify_refit`), the cluster's launch files
(:mod:`~paratune.tuner._verify_cluster`); this module checks what this machine can run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.tuner._verify_cluster import ClusterVerification, verify_on_cluster
from paratune.tuner._verify_list import (
    LAYOUT_COLUMNS,
    LAYOUT_DISCOUNT,
    RISK_QUANTILE,
    check_num_configs,
    risk_aware_ranking,
    trainer_runnable,
    verification_order,
    verify_list,
    verify_positions,
)
from paratune.tuner._verify_refit import (
    VerifyOptions,
    VerifyRuns,
    pinned_space,
    refit_and_compare,
)

if TYPE_CHECKING:
    import pandas as pd

    from paratune.spec import ModelSpec
    from paratune.tuner._space import SearchSpace
    from paratune.tuner._tune import TuneResult

__all__ = [
    "LAYOUT_COLUMNS",
    "LAYOUT_DISCOUNT",
    "RANKS_PER_CORE",
    "RISK_QUANTILE",
    "VERIFY_ON",
    "ClusterVerification",
    "VerifyOptions",
    "VerifyRuns",
    "check_verify_here",
    "pinned_space",
    "risk_aware_ranking",
    "trainer_runnable",
    "verification_order",
    "verify_list",
    "verify_location",
    "verify_on_cluster",
    "verify_top_k",
]

logger = logging.getLogger(__name__)


def _local_hardware() -> tuple[str, str]:
    from paratune.profiler.campaign import detect_device, detect_hardware

    device = detect_device()
    return device, detect_hardware(device)


RANKS_PER_CORE = 2
"""The most ranks per core a verification on the CPU starts. Every rank is a process on this
machine (it imports PyTorch and joins a gloo group) sharing its cores; two per core still
verify in time (the quickstart's default job, 4 ranks, on a 2-core machine), while far more
spend the per-config timeout starting up and are measured as timeouts."""


def check_verify_here(space: SearchSpace, k: int) -> str:
    """Refuse a verification this machine cannot run, before any search or file.

    Args:
        space: The job's search space (model, world size, device kind).
        k: Configs to verify.

    Returns:
        This machine's device (``"cuda"`` or ``"cpu"``), for the profiling campaigns.

    Raises:
        ConfigError: ``k`` is not positive (``verify``); the job's hardware is not on this
            machine (``verify``); on the CPU, the job's processes cannot fit in this
            machine's memory or are more than :data:`RANKS_PER_CORE` per core (``gpus``).
    """
    check_num_configs(k)
    device, local = _local_hardware()
    if local != space.hardware.name:
        raise ConfigError("verify", k, f"profiling needs the job's hardware here: this "
                          f"machine has {local}, the job asks for {space.hardware.name}")
    if device == "cpu":
        _check_cpu_fits(space.model, space.world_size, k)
    return device


def _check_cpu_fits(model: ModelSpec, world_size: int, k: int) -> None:
    """Refuse ``world_size`` CPU ranks that this machine cannot hold or run in time; warn
    where they share its cores."""
    import os

    from paratune.parallel import Sharding
    from paratune.profiler import cpu_process_memory_gb, physical_memory_bytes

    # every rank runs here; fully sharded over all of them, a rank holds the least it can
    # under any layout, so too little memory for this config is too little for every one
    least = ParallelConfig(dp=world_size, global_batch_size=world_size,
                           sharding=Sharding.ZERO3 if world_size > 1 else Sharding.NONE)
    per_process = cpu_process_memory_gb(model, least)
    total_gb = physical_memory_bytes() / 1e9
    if per_process * world_size > total_gb:
        raise ConfigError("gpus", world_size,
                          f"verifying runs all {world_size} processes on this machine's CPU, "
                          f"and {model.name} needs at least {per_process:.1f} GB per process "
                          f"under any layout (float32 weights, gradients and AdamW state, "
                          f"sharded over every process) x {world_size} = "
                          f"{per_process * world_size:.1f} GB, more than its "
                          f"{total_gb:.1f} GB of memory")
    cores = os.cpu_count() or 1
    if world_size > RANKS_PER_CORE * cores:
        raise ConfigError("gpus", world_size,
                          f"verifying runs all {world_size} processes on this machine's "
                          f"CPU, at most {RANKS_PER_CORE} per core: {RANKS_PER_CORE * cores} "
                          f"on its {cores} cores (verify a smaller job here, or on its "
                          f"hardware)")
    if world_size > cores:
        logger.warning("verify=%d: the %d processes share this machine's %d cores; steps "
                       "are slower than on a core each", k, world_size, cores)


def verify_top_k(result: TuneResult, k: int, options: VerifyOptions | None = None,
                 **overrides: Any) -> pd.DataFrame:
    """Profile the top ``k`` configs of ``result`` here, refit, and compare.

    Args:
        result: A tuning result whose hardware is this machine's.
        k: Configs to profile: the first ``k`` of :func:`verification_order` (the ranking,
            a layout's second config after another layout nearly as good) that paratune's
            trainer can run (see :meth:`paratune.ParallelConfig.check_trainer`).
        options: The dataset refitted on, the directories and how each config is measured
            (see :class:`VerifyOptions`; without ``out_dir``: ``verify/`` beside the
            recommendation, or a temporary directory).
        **overrides: Fields of :class:`VerifyOptions` (or of :class:`VerifyRuns`) by name,
            over ``options``.

    Returns:
        One row per verified config: ``config``, ``status``, ``pred_tokens_per_s`` (before),
        ``measured_tokens_per_s``, ``error_pct`` (prediction vs measurement),
        ``refit_tokens_per_s`` and ``refit_error_pct``.

    Raises:
        ConfigError: ``k`` is not positive, the job's hardware is not on this machine, it
            cannot run the job's processes (see :func:`check_verify_here`), or an override
            is no field of the options.
    """
    from paratune.profiler.campaign import run_campaign

    options = VerifyOptions.build(options, **overrides)
    out_dir = options.out_dir
    space = result.search.space
    device = check_verify_here(space, k)
    base = Path(out_dir) if out_dir is not None else (
        result.outputs["json"].parent / "verify" if result.outputs else None)
    if base is None:
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="paratune-verify-"))
    ranked_configs = result.search.configs()
    picked = verify_positions(result.search.ranked, ranked_configs, space.model, k)
    configs = [ranked_configs[i] for i in picked]
    ranked = result.search.ranked.iloc[picked]  # each verified config's own prediction
    frames = []
    for cfg, step_s in zip(configs, ranked["step_time_s"].to_numpy(dtype=float), strict=True):
        runs = _runs_for(options.runs, cfg, step_s)
        target = base / runs.directory_name(space, cfg)
        resume = (target / "campaign.json").exists()
        campaign = run_campaign(runs.campaign(space, cfg, device=device), target,
                                resume=resume, track=False, progress=False)
        frames.append(campaign.dataset.frame)
    predicted = [float(ranked["tokens_per_s"].iloc[i]) for i in range(len(configs))]
    refit_path = Path(options.refit_dir) if options.refit_dir is not None else base / "refit"
    return refit_and_compare(result, configs, frames, predicted, dataset=options.dataset,
                             refit_path=refit_path, model_factory=options.model_factory)


def _runs_for(runs: VerifyRuns, config: ParallelConfig, step_s: float) -> VerifyRuns:
    """How ``config`` is measured: with a timeout of at least twice the predicted time of its
    steps (``step_s`` each), so a config predicted slow is measured, not killed as hung."""
    predicted = step_s * (runs.warmup_steps + runs.measured_steps)
    if not (math.isfinite(predicted) and 2 * predicted > runs.timeout_s):
        return runs
    timeout = math.ceil(2 * predicted + 60)
    logger.warning("%s: predicted %.0f s for its %d steps; its timeout raised from %.0f s to "
                   "%d s", config.key(), predicted, runs.warmup_steps + runs.measured_steps,
                   runs.timeout_s, timeout)
    return replace(runs, timeout_s=float(timeout))


VERIFY_ON = ("auto", "here", "cluster")
"""Where ``tune(verify=K)`` measures: on this machine, on the target cluster (commands
printed, results read by a later ``tune``), or ``auto``: here when this machine has the
job's hardware, else on the cluster."""


def verify_location(space: SearchSpace, verify_on: str) -> str:
    """``"here"`` or ``"cluster"``: where a verification of ``space``'s job measures.

    Raises:
        ConfigError: ``verify_on`` is not one of :data:`VERIFY_ON`.
    """
    if verify_on not in VERIFY_ON:
        raise ConfigError("verify_on", verify_on, f"must be one of {', '.join(VERIFY_ON)}")
    if verify_on != "auto":
        return verify_on
    return "here" if _local_hardware()[1] == space.hardware.name else "cluster"
