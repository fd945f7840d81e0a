"""``plan``: the library function behind ``paratune plan``.

It takes the :class:`~paratune.tuner.TuneJob` ``tune`` takes, the :class:`PlanOptions` of a
phase plan and an :class:`~paratune.tuner.OutputOptions`: it reads the noise-scale
trajectory (measured, or a published law along a loss curve), binds the space, schedules the
phases against a fitted predictor (:func:`~paratune.tuner.plan_phases`), writes the plan and
its launch files, and records the run in MLflow.
"""

# ruff: noqa: RUF009 (the fields are dataclasses.field()s made by option(), not shared defaults)
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.predictor import Predictor
from paratune.tuner._requests import OutputOptions, TuneJob, option, request_params

if TYPE_CHECKING:
    from paratune.spec import ModelSpec
    from paratune.tuner._plan import Plan, ScheduleOptions
    from paratune.tuner._space import SearchSpace
    from paratune.tuner.gns_trajectory import Trajectory

__all__ = ["PlanOptions", "PlanOutcome", "plan"]

logger = logging.getLogger("paratune.tuner")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Where the noise scale comes from and how phases are scheduled."""

    trajectory: str | Path | None = option(
        None, flag="--trajectory", type=Path, param=False,
        help="B_noise trajectory (CSV/JSON with step, tokens, b_simple in the measuring "
             "run's sequences, seq_len)")
    law: str | None = option(
        None, flag="--law", metavar="NAME", param=False,
        help="a published critical-batch law instead of a measured trajectory: kaplan2020 "
             "(B_crit = 2e8 tokens / L^(1/0.21)), minicpm2024 (1.21e9 tokens / L^6.24) or "
             "constant:TOKENS, along --loss-curve")
    loss_curve: str = option(
        "chinchilla", flag="--loss-curve", metavar="FILE|chinchilla", param=False,
        help="with --law: loss against tokens, a CSV/JSON file with tokens, loss, or "
             "chinchilla (Hoffmann et al. 2022's fit for MODEL's parameters) "
             "(default: %(default)s)")
    tokens: str = option(
        "2e8:2e11", flag="--tokens", metavar="FROM:TO", param=False,
        help="with --law and the chinchilla curve: the stretch of training planned, in "
             "tokens (default: %(default)s)")
    lr_rule: str = option(
        "sqrt", flag="--lr-rule", choices=("sqrt", "linear", "adascale", "none"),
        help="how the learning rate follows the batch: sqrt (Adam, default), linear (SGD), "
             "adascale (AdaScale's gain, as Pollux), none")
    base_lr: float = option(3e-4, flag="--base-lr", type=float,
                            help="learning rate at --base-batch (default: %(default)s)")
    base_batch: float | None = option(
        None, flag="--base-batch", type=float, param=False,
        help="batch at which --base-lr holds (default: the first phase's)")
    trajectory_seq_len: int | None = option(
        None, flag="--trajectory-seq-len", type=int, metavar="TOKENS", param=False,
        help="tokens per sequence of the run that measured the trajectory, for files "
             "without a seq_len column (b_simple is in that run's sequences and is "
             "converted to MODEL's)")
    reconfig_cost_s: float = option(600.0, flag="--reconfig-cost-s", type=float,
                                    help="seconds lost to a change of parallelism")
    batch_change_cost_s: float = option(
        0.0, flag="--batch-change-cost-s", type=float,
        help="seconds lost to a change of the batch size alone")
    threshold: float = option(
        0.05, flag="--threshold", type=float,
        help="smallest relative goodput gain, where a switch happens, that allows it "
             "(default: %(default)s)")
    max_segments: int = option(
        32, flag="--segments", type=int,
        help="resolution along training: stretches of equal tokens (>= 1)")
    smooth: int = option(1, flag="--smooth", type="positive",
                         help="running-median window over the trajectory's b_simple")

    def __post_init__(self) -> None:
        from paratune.tuner._plan import check_plan_options

        check_plan_options(reconfig_cost_s=self.reconfig_cost_s,
                           batch_change_cost_s=self.batch_change_cost_s,
                           threshold=self.threshold, max_segments=self.max_segments)
        if (self.trajectory is None) == (self.law is None):
            raise ConfigError("trajectory", self.trajectory,
                              "give either a trajectory file or a critical-batch law")
        # each source's own options, refused off their defaults beside the other source
        # (they would do nothing)
        defaults = {item.name: item.default for item in fields(self)}
        own = {"law": (("loss_curve", "tokens"), "shapes a critical-batch law's trajectory "
                       "(--law), and this plan reads a trajectory file"),
               "trajectory": (("smooth", "trajectory_seq_len"), "reads a trajectory file "
                              "(--trajectory), and this plan follows a critical-batch law")}
        for source, (names, why) in own.items():
            given = [name for name in names if getattr(self, name) != defaults[name]]
            if getattr(self, source) is None and given:
                raise ConfigError(given[0], getattr(self, given[0]),
                                  f"only goes with a {source}: it {why}")

    def params(self) -> dict[str, Any]:
        return request_params(self)

    def schedule_options(self) -> ScheduleOptions:
        """The :class:`~paratune.tuner.ScheduleOptions` of these options: the fields they
        share (costs, threshold, resolution, learning-rate rule)."""
        from paratune.tuner._plan import ScheduleOptions

        shared = {item.name for item in fields(ScheduleOptions)} & {
            item.name for item in fields(self)}
        return ScheduleOptions(**{name: getattr(self, name) for name in shared})

    def load_trajectory(self, model: ModelSpec) -> Trajectory:
        """The ``B_noise`` trajectory: the file's, or the law's along the loss curve."""
        from paratune.tuner.gns_trajectory import load_trajectory

        if self.trajectory is not None:
            return load_trajectory(self.trajectory, smooth=self.smooth,
                                   seq_len=self.trajectory_seq_len)
        return law_trajectory_for(model, self.law, self.loss_curve, self.tokens)


@dataclass
class PlanOutcome:
    """What :func:`plan` scheduled and where it wrote it."""

    plan: Plan
    space: SearchSpace
    """The space the phases were chosen from (its global batch sizes)."""
    written: Path | None = None
    """The plan's JSON file (``None`` without an output)."""
    files: dict[str, Path] = field(default_factory=dict)
    """The launch files of every phase (with ``README``), where the output is a folder."""
    run_note: str | None = None
    """Where the MLflow run is, or why it is not (``None`` when tracking was off)."""


def plan(job: TuneJob, options: PlanOptions, *, predictor: Predictor | str | Path,
         output: OutputOptions | None = None) -> PlanOutcome:
    """Schedule training phases (global batch and parallelism) for ``job``.

    Where neither the job's ``global_batch_sizes`` nor its space gives the batches, they
    are :func:`~paratune.tuner.default_batch_range` of the trajectory. ``output.output_dir``
    ending in ``.json`` is the plan's file; any other is a folder that gets ``plan.json`` and
    the launch files of every phase. The MLflow run is opened before the work, so that a
    failed or interrupted plan leaves its record.

    Returns:
        A :class:`PlanOutcome`.

    Raises:
        ConfigError: a bad input (the message names it and the rule).
    """
    from paratune.tuner import _tune  # its load_predictor, looked up at call time
    from paratune.tuner._objective import Objective
    from paratune.tuner._space import SearchSpace

    output = output if output is not None else OutputOptions()
    model = job.spec()
    trajectory = options.load_trajectory(model)
    space_options = job.config_space()
    batches = job.global_batch_sizes
    if batches is None and not (space_options is not None
                                and space_options.global_batch_sizes_given):
        from paratune.tuner._plan import default_batch_range

        node = job.devices_per_node or job.device().devices_per_node
        batches = default_batch_range(model, job.gpus, trajectory.b_noise_in(model.seq_len),
                                      space=space_options, devices_per_node=node)
    space = SearchSpace.build(model, job.gpus, job.device(), space=space_options,
                              global_batch_sizes=batches,
                              devices_per_node=job.devices_per_node,
                              framework=job.framework)
    objective = Objective(min_feasible_prob=job.min_feasible_prob,
                          memory_limit_gb=job.memory_limit_gb)
    loaded = _tune.load_predictor(predictor)  # a predictor that does not load opens no run
    for message in _tune.extrapolation_warnings(loaded, space):
        logger.warning(message)
    with contextlib.ExitStack() as stack:
        run = None
        if output.track:
            run = _open_run(stack, space, objective, options, trajectory,
                            _tune.predictor_params(predictor, loaded), output)
        outcome = _schedule(loaded, space, trajectory, options, objective, output)
        if run is not None:
            run.log_metrics({"total_time_s": outcome.plan.total_time_s,
                             "num_switches": outcome.plan.num_switches,
                             "speedup_vs_fixed": outcome.plan.speedup("fixed"),
                             "speedup_vs_follow_critical":
                                 outcome.plan.speedup("follow_critical")})
            run.log_dict(outcome.plan.to_dict(), "plan.json")
    if run is not None:
        from paratune.tracking import run_note

        outcome.run_note = run_note(run)
    return outcome


def _open_run(stack: contextlib.ExitStack, space: SearchSpace, objective: Any,
              options: PlanOptions, trajectory: Trajectory, predictor: dict[str, Any],
              output: OutputOptions) -> Any:
    """The ``paratune-plan`` run, with every input that decides the plan."""
    from paratune.tracking import start_run

    model = space.model
    name = f"plan-{model.name}-{space.world_size}x{space.hardware.name}"
    return stack.enter_context(start_run("paratune-plan", run_name=name, params={
        "model": model.name, "seq_len": model.seq_len, "gpus": space.world_size,
        "hardware": space.hardware.name, "devices_per_node": space.devices_per_node,
        "framework": space.framework, **predictor,
        "trajectory": (str(Path(options.trajectory).resolve()) if options.trajectory
                       else trajectory.source),
        "trajectory_seq_len": trajectory.seq_len, **options.params(),
        "min_feasible_prob": objective.min_feasible_prob,
        "memory_limit_gb": objective.memory_limit(space),
        "global_batch_sizes": list(space.global_batch_sizes),
        "space": space.space.to_dict()}, tracking_uri=output.tracking_uri))


def _schedule(predictor: Predictor, space: SearchSpace, trajectory: Trajectory,
              options: PlanOptions, objective: Any, output: OutputOptions) -> PlanOutcome:
    """Plan the phases and write the plan (and its launch files) where the output says."""
    from paratune.fileio import atomic_write_text
    from paratune.tuner._plan import plan_phases

    phases = plan_phases(predictor, space, trajectory, options.schedule_options(),
                         objective=objective)
    outcome = PlanOutcome(plan=phases, space=space)
    target = output.path
    if target is None:
        return outcome
    outcome.written = target if target.suffix == ".json" else target / "plan.json"
    atomic_write_text(outcome.written, json.dumps(phases.to_dict(), indent=2, default=float))
    if target.suffix != ".json":
        from paratune.tuner._plan_export import write_plan_launch

        outcome.files = write_plan_launch(phases, space.model, space.hardware, target,
                                          devices_per_node=space.devices_per_node)
    return outcome


def law_trajectory_for(model: ModelSpec, law: str, loss_curve: str, tokens: str
                       ) -> Trajectory:
    """The ``B_noise`` trajectory of a critical-batch ``law`` along ``loss_curve`` (a file,
    or ``chinchilla`` over ``tokens``, ``FROM:TO``) for ``model``."""
    from paratune.tuner.gns_trajectory import (
        chinchilla_loss_curve,
        law_trajectory,
        load_loss_curve,
    )

    if str(loss_curve).lower() == "chinchilla":
        try:
            low, high = (float(x) for x in str(tokens).split(":"))
        except ValueError:
            raise ConfigError("tokens", tokens, "must be FROM:TO in tokens, e.g. 2e8:2e11") \
                from None
        curve = chinchilla_loss_curve(model.num_params, tokens_from=low, tokens_to=high)
    else:
        curve = load_loss_curve(loss_curve)
    return law_trajectory(law, curve, seq_len=model.seq_len)
