"""Running a campaign: lock, prepare, launch each world size, materialise, track."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratune.datasets.materialise import materialise, plan_keys, unfinished_configs
from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text, exclusive_lock
from paratune.measurement import Status
from paratune.profiler._journal import (
    CampaignPaths,
    journal_keys,
    read_journal_entries,
)
from paratune.profiler.campaign.launch import _await_earlier_launches, _run_world_size_torchrun
from paratune.profiler.campaign.plan import prepare_campaign
from paratune.profiler.campaign.results import CampaignResult, _counts, in_step_seconds
from paratune.profiler.campaign.spec import (
    _NO_CUDA,
    EXPERIMENT,
    CampaignSpec,
    _check_something_to_measure,
    enumerate_campaign,
)
from paratune.profiler.campaign.supervise import _Progress, _run_world_size

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _tracked(track: bool, meta: dict[str, Any], spec: CampaignSpec, paths: CampaignPaths,
             resume: bool) -> Iterator[Any]:
    if not track:
        yield None
        return
    from paratune.tracking import start_run

    params = {"model": spec.model.name, "model_spec": spec.model.to_dict(),
              "world_sizes": list(spec.world_sizes), "grid": spec.identity()["grid"],
              "warmup_steps": spec.warmup_steps, "measured_steps": spec.measured_steps,
              "timeout_s": spec.timeout_s, "device": spec.device, "hardware": spec.hardware,
              "devices_per_node": spec.devices_per_node, "token_source": spec.data,
              "seed": spec.seed, "campaign_id": meta["campaign_id"],
              "out": str(paths.root.resolve())}
    with contextlib.ExitStack() as stack:
        run = None
        if resume and meta.get("mlflow_run_id"):
            try:
                run = stack.enter_context(start_run(EXPERIMENT, run_id=meta["mlflow_run_id"]))
            except Exception as exc:  # not in this store (another tracking URI): a new run
                log.info("cannot reopen MLflow run %s (%s); starting a new one",
                         meta["mlflow_run_id"], exc)
        if run is None:
            run = stack.enter_context(start_run(EXPERIMENT, run_name=meta["campaign_id"],
                                                params=params,
                                                tags={"campaign_id": meta["campaign_id"]}))
            meta["mlflow_run_id"] = run.run_id
            atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")
        yield run


LAUNCHERS = ("local", "torchrun")
"""How a campaign starts its worker groups (see :class:`LaunchOptions`)."""


@dataclass(frozen=True)
class LaunchOptions:
    """How a campaign starts and supervises its worker groups, checked when built."""

    launcher: str = "local"
    """``"local"`` (worker groups supervised by this process) or ``"torchrun"``
    (``torchrun --standalone`` per world size: the cluster code path, on this machine; hangs
    and crashes are then handled by the workers' watchdog and torchrun's restarts)."""
    fail_grace_s: float = 3.0
    """After a rank reports a failure, seconds to wait for the others before the group is
    torn down."""
    startup_timeout_s: float | None = None
    """Seconds a new group may take to start its first config (``None``: the larger of
    120 s and the config timeout)."""
    extra_env: Mapping[str, str] | None = None
    """Extra environment variables for the workers."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError("launcher", self.launcher, "must be local or torchrun")
        if not (isinstance(self.fail_grace_s, int | float) and 0 <= self.fail_grace_s < math.inf):
            raise ConfigError("fail_grace_s", self.fail_grace_s,
                              "must be a finite number of seconds >= 0")
        if self.startup_timeout_s is not None and not (
                isinstance(self.startup_timeout_s, int | float)
                and 0 < self.startup_timeout_s < math.inf):
            raise ConfigError("startup_timeout_s", self.startup_timeout_s,
                              "must be a finite number of seconds > 0 (or None)")


def run_campaign(spec: CampaignSpec, out: str | Path, *, resume: bool = False,
                 track: bool = True, progress: bool = True,
                 launch: LaunchOptions | None = None,
                 on_record: Callable[[str], None] | None = None) -> CampaignResult:
    """Profile every valid config of ``spec`` for each world size, with local worker groups.

    Args:
        spec: What to profile.
        out: Campaign directory (journal, plans, logs, and the dataset at the end).
        resume: Continue the campaign already in ``out``, skipping finished configs.
        track: Log the campaign as an MLflow run (``MLFLOW_TRACKING_URI`` or ./mlflow.db).
        progress: Show a progress bar (configs done, failed, ETA) on stderr.
        launch: The launcher, failure grace, start-up timeout and extra environment of the
            worker groups (see :class:`LaunchOptions`; default: local groups).
        on_record: Called with each config key as it is journaled.

    Returns:
        The campaign's result, with the dataset materialised in ``out``.

    Raises:
        ConfigError: bad spec, ``out`` already holds a campaign (without ``resume``) or
            another process is profiling it, or processes of an earlier launch of it still
            run on this machine (resuming, once they had time to end),
            more CUDA devices are asked for than this machine has (unless resuming a
            campaign whose every config is journaled: that only writes the dataset), or on
            the CPU a config's processes cannot fit in this machine's memory (``model``;
            nothing is started).
        CampaignError: a worker group repeatedly fails to start.
    """
    import resource

    started = time.monotonic()
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launch = launch if launch is not None else LaunchOptions()
    # resuming a campaign whose every config is journaled (e.g. one run on a cluster with
    # the printed commands) only writes its dataset: it needs none of the devices
    finished = resume and CampaignPaths(Path(out)).campaign.exists() and not unfinished_configs(
        CampaignPaths(Path(out)), spec.world_sizes)
    if spec.device == "cuda" and not finished:
        import torch

        available = torch.cuda.device_count()
        if available == 0:
            raise ConfigError("device", spec.device, f"{_NO_CUDA} (use device cpu)")
        too_big = [w for w in spec.world_sizes if w > available]
        if too_big:
            raise ConfigError("world_sizes", too_big[0], f"needs more GPUs than the "
                              f"{available} on this machine (with either launcher): "
                              f"profile world sizes up to {available} here, and larger ones "
                              "on a cluster, with the commands that 'paratune profile "
                              "--print-command' prints")
    with _locked(spec, out, resume=resume) as prepared:
        paths, meta = prepare_campaign(spec, out, measure_here=not finished, **prepared)
        return _run_campaign(spec, paths, meta, _RunSettings(
            resume=resume, launch=launch, track=track, progress=progress,
            on_record=on_record, started=started, children_before=children_before))


@contextlib.contextmanager
def _locked(spec: CampaignSpec, out: str | Path, *, resume: bool
            ) -> Iterator[dict[str, Any]]:
    """Hold the campaign directory's lock (``out/.lock``) while the block prepares and runs
    it, so that a second process on the same campaign is refused before it rewrites a file.
    The refusals that need no lock come first and leave nothing behind: a grid without a
    valid config, a resume of nothing. Yields :func:`prepare_campaign`'s keyword arguments
    (the enumeration those checks computed)."""
    enumerations = enumerate_campaign(spec)
    _check_something_to_measure(spec, enumerations)
    if resume and not CampaignPaths(Path(out)).campaign.exists():
        raise ConfigError("resume", str(out), "holds no campaign.json: nothing to resume")
    with exclusive_lock(Path(out) / ".lock", field="out", value=str(out),
                        what="profiling this campaign"):
        yield {"resume": resume, "enumerations": enumerations}


@dataclass(frozen=True)
class _RunSettings:
    """How :func:`run_campaign` was asked to run (its keyword arguments) and when it began."""

    resume: bool
    launch: LaunchOptions
    track: bool
    progress: bool
    on_record: Callable[[str], None] | None
    started: float
    """``time.monotonic()`` when the run began."""
    children_before: Any
    """``getrusage(RUSAGE_CHILDREN)`` when the run began."""


def _env(launch: LaunchOptions) -> dict[str, str] | None:
    return None if launch.extra_env is None else dict(launch.extra_env)


def _run_campaign(spec: CampaignSpec, paths: CampaignPaths, meta: dict[str, Any],
                  settings: _RunSettings) -> CampaignResult:
    """:func:`run_campaign` once the campaign is prepared and locked."""
    import resource

    left = unfinished_configs(paths, spec.world_sizes)
    if left and settings.resume:  # under the lock: no later run can start a launch meanwhile
        _await_earlier_launches(paths)
        # what the earlier launch journaled while this run waited is not this run's
        left = unfinished_configs(paths, spec.world_sizes)
    before = {ws: journal_keys(paths.journal(ws)) for ws in spec.world_sizes}
    with _tracked(settings.track, meta, spec, paths, settings.resume) as run:
        _launch_world_sizes(spec, paths, meta, left, before, settings)
        dataset = materialise(paths.root)
        new_entries = [e for ws in spec.world_sizes
                       for e in read_journal_entries(paths.journal(ws))
                       if e.key not in before[ws]]
        result = CampaignResult(
            out=paths.root, campaign_id=meta["campaign_id"], dataset=dataset,
            counts=_counts(paths, meta, spec.world_sizes),
            wall_s=time.monotonic() - settings.started, num_measured=len(new_entries),
            in_step_s=sum(in_step_seconds(e) for e in new_entries),
            run_id=run.run_id if run is not None and run.lost is None else None)
        children, earlier = resource.getrusage(resource.RUSAGE_CHILDREN), settings.children_before
        # never below zero (float rounding of equal totals, when no worker ran)
        result.worker_cpu_s = max(0.0, (children.ru_utime + children.ru_stime)
                                  - (earlier.ru_utime + earlier.ru_stime))
        if run is not None:
            _log_result(run, result, paths)
    return result


def _launch_world_sizes(spec: CampaignSpec, paths: CampaignPaths, meta: dict[str, Any],
                        left: dict[int, set[str] | None], before: dict[int, set[str]],
                        settings: _RunSettings) -> None:
    """Launch each world size with configs ``left`` to measure, under a progress bar, and
    materialise the dataset after each."""
    total = sum(int(meta["num_valid"][str(ws)]) - len(before[ws] & plan_keys(paths, ws))
                for ws in spec.world_sizes)
    bar = None
    if settings.progress:
        from paratune.progress import progress_bar

        # named after the first world size with configs left (a resume skips the others)
        first = next((ws for ws in spec.world_sizes if ws in left), spec.world_sizes[0])
        bar = progress_bar(total=total, unit="config", enabled=True,
                           desc=f"profiling ws={first}")
    state = _Progress(bar=bar)
    try:
        for world_size in spec.world_sizes:
            if world_size not in left:  # every config journaled: nothing to launch
                continue
            if bar is not None:
                bar.set_description(f"profiling ws={world_size}")
            hook = settings.on_record or (lambda key: None)
            if settings.launch.launcher == "torchrun":
                _run_world_size_torchrun(paths, world_size, state,
                                         extra_env=_env(settings.launch), on_entry_hook=hook)
            else:
                _run_world_size(paths, world_size, state, fail_grace_s=settings.launch.fail_grace_s,
                                startup_timeout_s=settings.launch.startup_timeout_s,
                                extra_env=_env(settings.launch), on_entry_hook=hook)
            if int(meta["num_valid"][str(world_size)]):  # else there may be no row yet
                materialise(paths.root)
    finally:
        if bar is not None:
            bar.close()


def _log_result(run: Any, result: CampaignResult, paths: CampaignPaths) -> None:
    """The campaign's metrics (counts per world size and status, time) and its dataset as
    artifacts of its MLflow run."""
    metrics: dict[str, float] = {"wall_s": result.wall_s,
                                 "worker_cpu_s": result.worker_cpu_s,
                                 "num_measured": result.num_measured,
                                 "overhead_per_config_s": result.overhead_per_config_s}
    for world_size, counts in result.counts.items():
        for name, value in counts.items():
            metrics[f"ws{world_size}_{name}"] = value
        metrics[f"ws{world_size}_failed"] = sum(counts[s.value] for s in Status
                                                if s is not Status.OK)
    for name in ("valid", "skipped", *(s.value for s in Status)):
        metrics[name] = sum(c[name] for c in result.counts.values())
    metrics["failed"] = sum(c[s.value] for c in result.counts.values()
                            for s in Status if s is not Status.OK)
    run.log_metrics(metrics)
    run.log_artifact(paths.root / "card.json", "dataset")
    run.log_artifact(paths.root / result.dataset.card.data_file, "dataset")
    run.log_artifact(paths.skipped)


def torchrun_commands(spec: CampaignSpec, out: str | Path, *, nnodes: int | None = None,
                      nproc_per_node: int | None = None, rdzv_endpoint: str | None = None,
                      slurm: bool = False, resume: bool = False) -> list[str]:
    """Prepare ``out`` and return, per world size, the command that runs it on a cluster.

    Args:
        spec: What to profile.
        out: Campaign directory, on a filesystem every node sees.
        nnodes: Nodes per job; default ``world_size / nproc_per_node`` (at least 1).
        nproc_per_node: Processes (GPUs) per node; default ``spec.devices_per_node`` or
            the world size.
        rdzv_endpoint: ``host:port`` of the rendezvous (default ``$MASTER_ADDR:29500``).
        slurm: Return ``srun`` command lines for a SLURM allocation instead.
        resume: Reuse a campaign already prepared in ``out``.

    Returns:
        One shell command per world size. After they ran, ``paratune profile --resume``
        with the same options (or :func:`materialise`) writes the dataset.

    Raises:
        ConfigError: the nodes cannot hold a world size (``nproc_per_node``, or
            ``devices_per_node`` of ``spec``, does not divide it; ``nnodes`` times it is not
            it), checked before anything is written; or :func:`prepare_campaign` refuses.
    """
    from paratune.profiler.launcher import slurm_command, torchrun_command

    # the node layout is checked before anything is prepared: a refused one leaves no
    # campaign behind (whose devices_per_node a corrected command could not resume)
    layouts = {}
    for world_size in spec.world_sizes:
        per_node = nproc_per_node or spec.devices_per_node or world_size
        per_node = min(per_node, world_size)
        if world_size % per_node:  # named as given: the argument, or the spec's node size
            raise ConfigError("nproc_per_node" if nproc_per_node else "devices_per_node",
                              per_node, f"must divide the world size {world_size}")
        nodes = nnodes or world_size // per_node
        if nodes * per_node != world_size:
            raise ConfigError("nnodes", nodes, f"nnodes*nproc_per_node = {nodes}*{per_node} "
                              f"must equal the world size {world_size}")
        layouts[world_size] = (nodes, per_node)
    resume = resume or CampaignPaths(Path(out)).campaign.exists()
    with _locked(spec, out, resume=resume) as prepared:
        paths, meta = prepare_campaign(spec, out, measure_here=False, **prepared)
    commands = []
    for world_size in spec.world_sizes:
        nodes, per_node = layouts[world_size]
        rdzv_id = f"{meta['campaign_id']}-ws{world_size}"
        plan = paths.plan(world_size).resolve()
        if slurm:
            commands.append(slurm_command(plan, nnodes=nodes, nproc_per_node=per_node,
                                          rdzv_id=rdzv_id))
        else:
            commands.append(torchrun_command(
                plan, nproc_per_node=per_node, nnodes=nodes, rdzv_id=rdzv_id,
                rdzv_endpoint=rdzv_endpoint or ("localhost:29500" if nodes == 1
                                                else "$MASTER_ADDR:29500")))
    return commands
