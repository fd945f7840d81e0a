"""Closing the loop: profile the recommended configs for real, refit, compare.

``verify_top_k`` runs each of the top-K configs of a tuning result as a one-config profiling
campaign (:func:`paratune.profiler.campaign.run_campaign`) on this machine, adds the
measurements to the training data, refits the performance model and reports, for every
verified config, the prediction before, the measurement and the prediction after the refit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Schedule
from paratune.space import ConfigSpace

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
    "check_verify_here",
    "pinned_space",
    "risk_aware_ranking",
    "trainer_runnable",
    "verification_order",
    "verify_list",
    "verify_on_cluster",
    "verify_top_k",
]

logger = logging.getLogger(__name__)


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


LAYOUT_COLUMNS = ("tp", "pp")
"""What makes two configs of one job different layouts (the data-parallel degree follows from
them on a given device count); micro-batch size, sharding, recomputation and schedule are
variants of a layout."""


LAYOUT_DISCOUNT = 0.95
"""How much less a layout's second config counts than its first in the verification order
(its third config ``0.95**2``, ...). Chosen on the extrapolation splits of the public data
(``experiments/verify_budget.py``): 0.95 needed the fewest verified runs of 0, 0.5, 0.8,
0.9, 0.95 and 1 (no diversity)."""

RISK_QUANTILE = "q10"
"""The lower throughput quantile of the risk-aware ranking (:func:`risk_aware_ranking`)."""


def risk_aware_ranking(ranked: pd.DataFrame, *, quantile: str = RISK_QUANTILE
                       ) -> pd.DataFrame:
    """Re-rank by the risk-aware expectation, for a search where the model extrapolates.

    Each config's objective is scaled by ``sqrt(q / t)``, ``t`` its ranked throughput (the
    expected, stall-weighted one) and ``q`` its lower ``quantile``: under the throughput
    objective the geometric mean of the expected throughput and its lower quantile, under
    goodput the same times the statistical efficiency. A config the model is unsure of (a
    wide interval: a regime or a layout it saw little of) ranks below one predicted as fast
    with confidence; where the model is sure the order is the expected one. Feasible
    configs stay first; ``rank`` and ``vs_best`` are recomputed.

    Args:
        ranked: A ranking with ``objective``, ``ranked_tokens_per_s``, ``world_size``,
            ``feasible`` and the predictor's ``pred_tokens_per_sec_per_gpu_<quantile>``.
        quantile: The lower quantile (``q10``).

    Returns:
        The re-ranked frame (unchanged where the predictor gives no such quantile): its
        ``objective`` and ``ranked_tokens_per_s`` are the risk-aware ones,
        ``objective_expected`` and ``expected_tokens_per_s`` the ones before.
    """
    import numpy as np

    from paratune.tuner._search import rank

    column = f"pred_tokens_per_sec_per_gpu_{quantile}"
    if ranked.empty or column not in ranked.columns:
        return ranked
    low = ranked[column].to_numpy(dtype=float) * ranked["world_size"].to_numpy(dtype=float)
    expected = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(low / expected, 0.0, 1.0)
    # no quantile (NaN) or no throughput: the expected objective stands
    share = np.where(np.isfinite(share), share, 1.0)
    factor = np.sqrt(share)
    objective = ranked["objective"].to_numpy(dtype=float)
    out = ranked.drop(columns=["rank", "vs_best"], errors="ignore").assign(
        objective_expected=objective, objective=objective * factor,
        expected_tokens_per_s=expected, ranked_tokens_per_s=expected * factor)
    return rank(out)


def verification_order(ranked: pd.DataFrame, *, discount: float = LAYOUT_DISCOUNT
                       ) -> list[int]:
    """The order in which to verify a ranking's configs on the target cluster.

    The ranked quantity (``objective``) of the ``n``-th best config of each layout
    (:data:`LAYOUT_COLUMNS`) is discounted by ``discount**n`` before sorting, feasible configs
    first: a layout whose best config is predicted nearly as good as another layout's second
    is verified before it, so a model that is wrong about a layout (an extrapolation: a
    stalled pipeline it did not see, tensor parallelism across a link it never measured)
    costs one verified run, not one per micro-batch variant of that layout; a layout
    predicted far behind still waits. ``discount=1`` is the rank order itself; ``0`` takes
    the best config of every layout before a second of any.

    Args:
        ranked: A ranking (:attr:`paratune.tuner.SearchResult.ranked`, best first), with
            the layout columns and ``objective``.
        discount: In ``[0, 1]``.

    Returns:
        Every position of ``ranked`` (``0`` = rank 1), in verification order.

    Raises:
        ConfigError: ``discount`` is outside ``[0, 1]``.
    """
    import numpy as np

    if not (isinstance(discount, (int, float)) and 0.0 <= discount <= 1.0):
        raise ConfigError("discount", discount, "must be in [0, 1]")
    if ranked.empty or discount == 1.0:
        return list(range(len(ranked)))
    layouts = ranked[list(LAYOUT_COLUMNS)].astype(int).astype(str).agg("|".join, axis=1)
    rounds = layouts.groupby(layouts).cumcount().to_numpy()
    score = np.nan_to_num(ranked["objective"].to_numpy(dtype=float), nan=0.0)
    weight = np.where(rounds == 0, 1.0, float(discount) ** rounds)
    feasible = (ranked["feasible"].to_numpy(dtype=bool) if "feasible" in ranked.columns
                else np.ones(len(ranked), dtype=bool))
    # ties (a discount of 0) go by round, then by rank
    return sorted(range(len(ranked)),
                  key=lambda i: (not feasible[i], -score[i] * weight[i], rounds[i], i))


def verify_list(ranked: pd.DataFrame, k: int, *, discount: float = LAYOUT_DISCOUNT
                ) -> list[int]:
    """The first ``k`` positions of :func:`verification_order`: the short list of configs to
    verify on the target cluster (feasible ones first, as the ranking puts them).

    Raises:
        ConfigError: ``k`` is not a positive integer (field ``verify``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError("verify", k, "must be a positive number of configs")
    return verification_order(ranked, discount=discount)[:k]


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
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError("verify", k, "must be a positive number of configs")
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
    from paratune.profiler._memory import cpu_process_memory_gb, physical_memory_bytes

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


def trainer_runnable(configs: Sequence[ParallelConfig], model: ModelSpec, k: int
                     ) -> list[int]:
    """Positions of the first ``k`` of ``configs`` that paratune's trainer can run (it
    measures them); the ones it skips are logged with the reason."""
    out = []
    for position, cfg in enumerate(configs):
        if len(out) == k:
            break
        try:
            cfg.check_trainer(model)
        except ConfigError as exc:
            logger.info("not verified: %s (%s)", cfg.key(), exc)
            continue
        out.append(position)
    return out


def verify_top_k(result: TuneResult, k: int, *,
                 dataset: str | Path | Sequence[str | Path] | None = None,
                 out_dir: str | Path | None = None, refit_dir: str | Path | None = None,
                 warmup_steps: int = 2, measured_steps: int = 5, timeout_s: float = 300.0,
                 model_factory: Any = None) -> pd.DataFrame:
    """Profile the top ``k`` configs of ``result`` here, refit, and compare.

    Args:
        result: A tuning result whose hardware is this machine's.
        k: Configs to profile: the first ``k`` of :func:`verification_order` (the ranking,
            a layout's second config after another layout nearly as good) that paratune's
            trainer can run (see :meth:`paratune.ParallelConfig.check_trainer`).
        dataset: Measurements the predictor was fitted on (dataset directories, public CSVs
            or parquet files); the new measurements are added to them for the refit. Without
            it the refit uses the new measurements alone.
        out_dir: Where the verification campaigns go (default: ``verify/`` beside the
            recommendation, or a temporary directory).
        refit_dir: Where the refitted model is saved (default: ``out_dir/refit``).
        warmup_steps: Warm-up steps per config.
        measured_steps: Timed steps per config.
        timeout_s: Per-config timeout.
        model_factory: Callable returning an unfitted model with ``fit``/``save``
            (default: :class:`paratune.models.PerformanceModel`).

    Returns:
        One row per verified config: ``config``, ``status``, ``pred_tokens_per_s`` (before),
        ``measured_tokens_per_s``, ``error_pct`` (prediction vs measurement),
        ``refit_tokens_per_s`` and ``refit_error_pct``.

    Raises:
        ConfigError: ``k`` is not positive, the job's hardware is not on this machine, or
            it cannot run the job's processes (see :func:`check_verify_here`).
    """
    from paratune.profiler.campaign import CampaignSpec, run_campaign

    space = result.search.space
    device = check_verify_here(space, k)
    base = Path(out_dir) if out_dir is not None else (
        result.outputs["json"].parent / "verify" if result.outputs else None)
    if base is None:
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="paratune-verify-"))
    ranked_configs = result.search.configs()
    picked = _verify_positions(result.search.ranked, ranked_configs, space.model, k)
    if not picked:
        raise ConfigError("verify", k, "none of the ranked configs can run in paratune's "
                          "trainer (see ParallelConfig.check_trainer): nothing to measure")
    configs = [ranked_configs[i] for i in picked]
    ranked = result.search.ranked.iloc[picked]  # each verified config's own prediction
    frames = []
    for cfg in configs:
        spec = CampaignSpec(model=space.model, world_sizes=(cfg.world_size,),
                            space=pinned_space(cfg), warmup_steps=warmup_steps,
                            measured_steps=measured_steps, timeout_s=timeout_s, device=device,
                            hardware=space.hardware.name,
                            devices_per_node=space.devices_per_node)
        target = base / cfg.key()
        resume = (target / "campaign.json").exists()
        campaign = run_campaign(spec, target, resume=resume, track=False, progress=False)
        frames.append(campaign.dataset.frame)
    predicted = [float(ranked["tokens_per_s"].iloc[i]) for i in range(len(configs))]
    refit_path = Path(refit_dir) if refit_dir is not None else base / "refit"
    return _refit_and_compare(result, configs, frames, predicted, dataset=dataset,
                              refit_path=refit_path, model_factory=model_factory)


def _refit_and_compare(result: TuneResult, configs: list[ParallelConfig],
                       frames: list[pd.DataFrame], predicted: list[float], *,
                       dataset: str | Path | Sequence[str | Path] | None, refit_path: Path,
                       model_factory: Any) -> pd.DataFrame:
    """Refit on ``dataset`` plus the verified runs (``frames``, one per config) and tabulate
    each config's prediction before, measurement and prediction after."""
    import pandas as pd

    from paratune.tuner._search import config_from_row, evaluate

    space = result.search.space
    measured = pd.concat(frames, ignore_index=True)

    from paratune.models import load_measurements

    training = [measured]
    if dataset is not None:
        paths = [dataset] if isinstance(dataset, (str, Path)) else list(dataset)
        training.insert(0, load_measurements(paths))
    frame = pd.concat(training, ignore_index=True)
    if model_factory is None:
        from paratune.models import PerformanceModel

        model_factory = PerformanceModel
    if (frame["status"] == "ok").any():
        refit = model_factory().fit(frame)
        if hasattr(refit, "save"):
            refit.save(refit_path)
        after = evaluate(refit, space, configs, result.search.objective)["tokens_per_s"]
    else:
        logger.warning("no verified config ran (statuses: %s); nothing to refit on",
                       ", ".join(measured["status"].astype(str)))
        after = pd.Series([math.nan] * len(configs))

    rows = []
    for i, (cfg, own) in enumerate(zip(configs, frames)):
        # each config's measurement comes from its own campaign, matched on the whole
        # config: configs that differ only in sharding, recomputation or schedule share
        # their degrees and batch sizes
        match = own.iloc[[j for j, (_, row) in enumerate(own.iterrows())
                          if config_from_row(row) == cfg]]
        status = str(match["status"].iloc[0]) if len(match) else "missing"
        got = float(match["tokens_per_s"].iloc[0]) if len(match) and status == "ok" else math.nan
        pred = predicted[i]
        new = float(after.iloc[i])
        rows.append({"config": cfg.key(), "status": status, "pred_tokens_per_s": pred,
                     "measured_tokens_per_s": got,
                     "error_pct": 100 * (pred - got) / got if got > 0 else math.nan,
                     "refit_tokens_per_s": new,
                     "refit_error_pct": 100 * (new - got) / got if got > 0 else math.nan})
    logger.info("verified %d configs; refitted model saved to %s", len(rows), refit_path)
    return pd.DataFrame(rows)


VERIFY_ON = ("auto", "here", "cluster")
"""Where ``tune(verify=K)`` measures: on this machine, on the target cluster (commands
printed, results read by a later ``tune``), or ``auto``: here when this machine has the
job's hardware, else on the cluster."""


@dataclass
class ClusterVerification:
    """The verification of a tuning result on its target cluster (see
    :func:`verify_on_cluster`)."""

    configs: list[ParallelConfig]
    """The configs to verify, in verification order."""
    directories: list[Path]
    """Each config's campaign directory (on a filesystem every node sees)."""
    torchrun: list[str]
    """Each config's torchrun command (run on every node; ``MASTER_ADDR`` the first)."""
    sbatch: list[Path]
    """Each config's SLURM batch script (``sbatch`` it; one ``srun`` of torchrun per node)."""
    finished: list[bool]
    """Whether each config's run is already measured (journaled)."""
    verification: pd.DataFrame | None = None
    """Predicted vs measured and the refit's prediction, once every config is measured."""
    refit_dir: Path | None = None
    """Where the model refitted on the verified runs was saved."""

    @property
    def pending(self) -> list[int]:
        return [i for i, done in enumerate(self.finished) if not done]

    def instructions(self, rerun: str = "the same tune command") -> str:
        """What to run on the cluster and how the results come back, as text."""
        lines = []
        for i in self.pending:
            cfg = self.configs[i]
            lines += [f"{cfg.key()} ({cfg.world_size} devices):",
                      f"  sbatch {self.sbatch[i]}",
                      f"  or on every node: {self.torchrun[i]}"]
        lines.append(f"then run {rerun} again (with --dataset, the data the predictor was "
                     "fitted on): it reads the verified runs, refits the model on them and "
                     "reports predicted vs measured; `paratune fit DATA "
                     + " ".join(str(d) for d in self.directories)
                     + "` fits on them too once they are read")
        return "\n".join(lines)


def _sbatch_script(command: str, *, nodes: int, per_node: int, name: str, gpus: bool) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    return "\n".join([*lines, "set -e", command, ""])


def _verify_positions(ranked: pd.DataFrame, configs: list[ParallelConfig], model: ModelSpec,
                      k: int) -> list[int]:
    """The first ``k`` positions of the verification order that paratune's trainer runs."""
    order = verification_order(ranked)
    runnable = trainer_runnable([configs[i] for i in order], model, k)
    return [order[j] for j in runnable]


def verify_on_cluster(result: TuneResult, k: int, *,
                      dataset: str | Path | Sequence[str | Path] | None = None,
                      out_dir: str | Path | None = None, refit_dir: str | Path | None = None,
                      warmup_steps: int = 2, measured_steps: int = 5, timeout_s: float = 300.0,
                      model_factory: Any = None) -> ClusterVerification:
    """Prepare the verification of ``result`` on its target cluster, or read it back.

    The ``k`` configs are the first of :func:`verification_order` that paratune's trainer
    runs (:func:`trainer_runnable`), each a one-config profiling campaign in
    ``out_dir/<config key>`` with its torchrun command and a SLURM batch script
    (``verify.sbatch`` inside it). The configs chosen are kept in ``out_dir/verify.json``,
    so a later call verifies exactly those. Once every campaign is measured, a later call
    reads them (writing each as a dataset), refits on ``dataset`` plus them and reports
    predicted vs measured as :func:`verify_top_k` does.

    Args:
        result: A tuning result (its hardware need not be this machine's).
        k: Configs to verify.
        dataset: Measurements the predictor was fitted on, refitted with the verified runs.
        out_dir: Where the campaigns go (default: ``verify/`` beside the recommendation);
            on a filesystem the cluster's nodes see.
        refit_dir: Where the refitted model is saved (default: ``out_dir/refit``).
        warmup_steps: Warm-up steps per config.
        measured_steps: Timed steps per config.
        timeout_s: Per-config timeout.
        model_factory: Callable returning an unfitted model with ``fit``/``save``
            (default: :class:`paratune.models.PerformanceModel`).

    Raises:
        ConfigError: ``k`` is not positive, no ranked config can run in paratune's trainer,
            or ``out_dir`` is unset and the result wrote no files.
    """
    import json

    from paratune._io import atomic_write_text
    from paratune.profiler.campaign import (
        CampaignSpec,
        campaign_progress,
        materialise,
        torchrun_commands,
    )

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError("verify", k, "must be a positive number of configs")
    space = result.search.space
    if out_dir is None and not result.outputs:
        raise ConfigError("verify", k, "verifying on the cluster needs an output directory "
                          "(the campaigns and their commands go there)")
    base = Path(out_dir) if out_dir is not None else result.outputs["json"].parent / "verify"
    base.mkdir(parents=True, exist_ok=True)
    ranked = result.search.ranked
    ranked_configs = result.search.configs()
    listing = base / "verify.json"
    identity = {"model": space.model.name, "world_size": space.world_size,
                "hardware": space.hardware.name}
    stored = json.loads(listing.read_text()) if listing.exists() else None
    if stored and stored.get("identity") == identity and len(stored["configs"]) >= k:
        # a later call verifies exactly the configs the first one named
        configs = [ParallelConfig.from_dict(c) for c in stored["configs"][:k]]
    else:
        picked = _verify_positions(ranked, ranked_configs, space.model, k)
        if not picked:
            raise ConfigError("verify", k, "none of the ranked configs can run in paratune's "
                              "trainer (see ParallelConfig.check_trainer): nothing to measure")
        configs = [ranked_configs[i] for i in picked]
        atomic_write_text(listing, json.dumps({"identity": identity, "configs": [
            c.to_dict() for c in configs]}, indent=2) + "\n")
    gpu = space.hardware.name.lower() != "cpu"
    per_node = min(space.devices_per_node, space.world_size)
    nodes = max(1, space.world_size // per_node)
    plan = ClusterVerification(configs=configs, directories=[], torchrun=[], sbatch=[],
                               finished=[])
    for cfg in configs:
        spec = CampaignSpec(model=space.model, world_sizes=(cfg.world_size,),
                            space=pinned_space(cfg), warmup_steps=warmup_steps,
                            measured_steps=measured_steps, timeout_s=timeout_s,
                            device="cuda" if gpu else "cpu", hardware=space.hardware.name,
                            devices_per_node=space.devices_per_node)
        target = (base / cfg.key()).resolve()
        (command,) = torchrun_commands(spec, target, nproc_per_node=per_node)
        (srun,) = torchrun_commands(spec, target, nproc_per_node=per_node, slurm=True)
        script = target / "verify.sbatch"
        atomic_write_text(script, _sbatch_script(srun, nodes=nodes, per_node=per_node,
                                                 name=f"paratune-verify-{cfg.key()}",
                                                 gpus=gpu))
        progress = campaign_progress(target)
        plan.directories.append(target)
        plan.torchrun.append(command)
        plan.sbatch.append(script)
        plan.finished.append(progress is not None and progress.finished
                             and progress.num_rows > 0)
    if plan.pending:
        logger.info("%d of %d verification runs not measured yet", len(plan.pending),
                    len(configs))
        return plan
    frames = [materialise(d).frame for d in plan.directories]
    position = {c.key(): i for i, c in reversed(list(enumerate(ranked_configs)))}
    predicted = [float(ranked["tokens_per_s"].iloc[position[c.key()]])
                 if c.key() in position else math.nan for c in configs]
    plan.refit_dir = Path(refit_dir) if refit_dir is not None else base / "refit"
    plan.verification = _refit_and_compare(result, configs, frames, predicted,
                                           dataset=dataset, refit_path=plan.refit_dir,
                                           model_factory=model_factory)
    return plan


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
