"""``paratune quickstart``: the whole loop on this machine, with no GPU and no data.

A short real profiling campaign of the ``tiny`` model on gloo, a performance model fitted on
it, a tuning run against that model, and the top recommendation profiled for real to check
the prediction; the campaign, the fit and the tuning (with its verification, as
``paratune tune --verify``) are MLflow runs in the local store. Then goodput: the tuned job's
processes profiled at two larger global batches, a short measurement of the gradient noise
scale on real text, a goodput recommendation over the three batch sizes and a phase plan
(batch and parallelism along the measured ``B_noise``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from paratune.profiler.campaign import CampaignResult
    from paratune.tuner import Plan, TuneResult

__all__ = ["QuickstartOptions", "QuickstartResult", "quickstart", "register"]


@dataclass
class QuickstartResult:
    """Where each stage of the quickstart left its output."""

    out: Path
    campaign: CampaignResult
    model_dir: Path
    tuning: TuneResult
    verification: pd.DataFrame | None
    timings_s: dict[str, float] = field(default_factory=dict)
    goodput: TuneResult | None = None
    """The goodput recommendation over several batch sizes (``None`` with ``goodput=False``)."""
    plan: Plan | None = None
    """The phase plan along the measured ``B_noise``."""


def _say(line: str) -> None:
    """Print a progress line at once (log records on stderr interleave with it in order)."""
    print(line, flush=True)


@dataclass(frozen=True)
class QuickstartOptions:
    """What the quickstart profiles, tunes and verifies; checked when built, so that a bad
    value costs no minutes of profiling."""

    world_sizes: tuple[int, ...] = (1, 2, 4)
    """Process counts to profile (gloo on this machine)."""
    gpus: int = 4
    """Processes the tuned job runs on (one of ``world_sizes`` so it can be verified)."""
    warmup_steps: int = 2
    """Warm-up steps per profiled config."""
    measured_steps: int = 5
    """Timed steps per profiled config."""
    verify: int = 1
    """Top configs to profile again after tuning (0 to skip)."""
    goodput: bool = True
    """Run the goodput stage (profile two larger batches on ``gpus`` processes, measure
    ``B_noise`` for ``gns_steps`` steps, recommend by goodput, plan phases)."""
    gns_steps: int = 24
    """Steps of the noise-scale measurement."""

    def __post_init__(self) -> None:
        from paratune.errors import ConfigError

        object.__setattr__(self, "world_sizes", tuple(self.world_sizes))
        verify, gpus = self.verify, self.gpus
        if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
            raise ConfigError("verify", verify, "must be a number of configs >= 0")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ConfigError("gpus", gpus, "must be a positive number of processes")
        if gpus not in self.world_sizes and verify:
            raise ConfigError("gpus", gpus, f"must be one of the profiled world sizes "
                              f"{list(self.world_sizes)} to verify the recommendation here")
        if self.goodput and any(batch % gpus for batch in GOODPUT_BATCHES):
            # the goodput stage's batches and its noise-scale run (one sequence per rank of a
            # batch of 8) split over the gpus data-parallel ranks; found out minutes later
            raise ConfigError("gpus", gpus, f"must divide the goodput stage's global batches "
                              f"{list(GOODPUT_BATCHES)} (or give --no-goodput)")


def quickstart(out: str | Path = "paratune-quickstart",
               options: QuickstartOptions | None = None, *, track: bool = True,
               progress: bool = True, log: Any = _say) -> QuickstartResult:
    """Profile ``tiny`` on this CPU, fit, tune for ``gpus`` processes, verify the winner.

    Re-running with the same ``out`` resumes the campaign (nothing measured is redone).

    Args:
        out: Directory for the campaign, the model and the recommendation.
        options: World sizes, the tuned job's processes, steps, verification and the
            goodput stage (see :class:`QuickstartOptions`; default: its defaults).
        track: Log every stage to MLflow.
        progress: Show progress bars.
        log: Where progress lines go.

    Returns:
        A :class:`QuickstartResult`.
    """
    from paratune.models import fit_model
    from paratune.profiler.campaign import CampaignSpec, run_campaign
    from paratune.spec import get_model
    from paratune.tuner import OutputOptions, SearchOptions, TuneJob, tune

    options = options if options is not None else QuickstartOptions()
    world_sizes, gpus, verify = options.world_sizes, options.gpus, options.verify
    warmup_steps, measured_steps = options.warmup_steps, options.measured_steps
    out = Path(out)
    model = get_model("tiny")
    timings: dict[str, float] = {}
    spec = CampaignSpec(model=model, world_sizes=tuple(world_sizes), warmup_steps=warmup_steps,
                        measured_steps=measured_steps)
    out.mkdir(parents=True, exist_ok=True)  # an --out that is a file is refused here

    log(f"[1/4] profiling {model.name} on world sizes {list(world_sizes)} (gloo, CPU)")
    started = time.monotonic()
    campaign_dir = out / "campaign"
    campaign = run_campaign(spec, campaign_dir, resume=(campaign_dir / "campaign.json").exists(),
                            track=track, progress=progress)
    timings["profile"] = time.monotonic() - started
    log(campaign.summary())

    log("[2/4] fitting the performance model on the measurements")
    started = time.monotonic()
    model_dir = out / "model"
    _predictor, summary = fit_model([campaign_dir], model_dir, n_estimators=300,
                                    experiment="paratune-fit" if track else None,
                                    force=True)  # a re-run refits on the resumed campaign
    timings["fit"] = time.monotonic() - started
    log(summary)

    log(f"[3/4] tuning {model.name} for {gpus} processes against the fitted model")
    started = time.monotonic()

    def ranked(result: TuneResult) -> None:
        nonlocal started
        timings["tune"] = time.monotonic() - started
        log(result.table(5))
        if verify:
            log(f"[4/4] profiling the top {verify} recommended config(s) again for real")
        started = time.monotonic()

    # The profiled grid is the space searched: the model interpolates between measurements.
    # The verification is the tune run's own (as with ``paratune tune --verify K``): its
    # params say verify=K and it holds verification.csv.
    tuning = tune(
        TuneJob(model=model, gpus=gpus, hardware="cpu", space=spec.space,
                global_batch_sizes=list(spec.space.global_batch_sizes)),
        search=SearchOptions(search="exhaustive", verify=verify, verify_options={
            "dataset": [campaign_dir], "warmup_steps": warmup_steps,
            "measured_steps": measured_steps}),
        output=OutputOptions(output_dir=out / "recommendation", track=track, on_ranked=ranked),
        predictor=model_dir)
    if verify:
        from paratune.table import format_table

        timings["verify"] = time.monotonic() - started
        log(format_table(tuning.verification.to_dict("records"), floatfmt=".4g"))
    result = QuickstartResult(out=out, campaign=campaign, model_dir=model_dir, tuning=tuning,
                              verification=tuning.verification, timings_s=timings)
    if options.goodput:
        _goodput_stage(result, spec, gpus=gpus, gns_steps=options.gns_steps, track=track,
                       progress=progress, log=log)
    return result


GOODPUT_BATCHES = (8, 16, 32)
"""Global batch sizes of the quickstart's goodput stage (the campaign's 8 and two more)."""


def _goodput_stage(result: QuickstartResult, spec: Any, *, gpus: int, gns_steps: int,
                   track: bool, progress: bool, log: Any) -> None:
    """Profile ``gpus`` processes at the larger batches, measure ``B_noise``, recommend by
    goodput over :data:`GOODPUT_BATCHES` and plan phases (resumable, as the rest)."""
    from dataclasses import replace

    from paratune.models import fit_model
    from paratune.parallel import ParallelConfig
    from paratune.profiler.campaign import run_campaign
    from paratune.profiler.gns import GNSJob, run_gns
    from paratune.tuner import (
        OutputOptions,
        ScheduleOptions,
        SearchOptions,
        SearchSpace,
        TuneJob,
        load_predictor,
        load_trajectory,
        plan_phases,
        tune,
    )

    out, model, timings = result.out, spec.model, result.timings_s
    # the options of the two best configs only: profiling every layout again at two more
    # batches would double the quickstart
    top = result.tuning.search.configs(2)
    options = spec.space.replace(
        tp_degrees=tuple(sorted({c.tp for c in top})),
        pp_degrees=tuple(sorted({c.pp for c in top})),
        schedules=tuple(dict.fromkeys(c.schedule for c in top)),
        shardings=tuple(dict.fromkeys(c.sharding for c in top)),
        recomputes=tuple(dict.fromkeys(c.recompute for c in top)),
        micro_batch_sizes=tuple(sorted({c.micro_batch_size for c in top})))
    log(f"[goodput 1/3] profiling the two best layouts on {gpus} processes at global "
        f"batches {list(GOODPUT_BATCHES[1:])}, measuring B_noise for {gns_steps} steps on "
        "real text")
    started = time.monotonic()
    space = options.replace(global_batch_sizes=GOODPUT_BATCHES[1:])
    batches_dir = out / "campaign-batches"
    run_campaign(replace(spec, world_sizes=(gpus,), space=space), batches_dir,
                 resume=(batches_dir / "campaign.json").exists(), track=track,
                 progress=progress)
    gns_path = out / "gns.csv"
    if not gns_path.exists() or len(gns_path.read_text().splitlines()) < gns_steps + 1:
        config = ParallelConfig(dp=gpus, micro_batch_size=1,
                                global_batch_size=GOODPUT_BATCHES[0])
        run_gns(GNSJob(model=model, config=config, steps=gns_steps, out=str(gns_path),
                       corpus_bytes=1 << 20, measure_every=1), progress=progress)
    model_dir = out / "model-goodput"
    fit_model([out / "campaign", batches_dir], model_dir, n_estimators=300,
              experiment="paratune-fit" if track else None, force=True)
    timings["goodput_measure"] = time.monotonic() - started

    log(f"[goodput 2/3] goodput over global batches {list(GOODPUT_BATCHES)} with the "
        "measured B_noise")
    started = time.monotonic()
    options = options.replace(global_batch_sizes=GOODPUT_BATCHES)
    result.goodput = tune(
        TuneJob(model=model, gpus=gpus, hardware="cpu", space=options,
                global_batch_sizes=list(GOODPUT_BATCHES)),
        search=SearchOptions(objective="goodput", gns=gns_path, search="exhaustive"),
        output=OutputOptions(output_dir=out / "recommendation-goodput", track=track),
        predictor=model_dir)
    log(result.goodput.table(5))
    log("[goodput 3/3] training phases along the measured B_noise")
    trajectory = load_trajectory(gns_path)
    search_space = SearchSpace.build(model, gpus, "cpu", space=options,
                                     global_batch_sizes=list(GOODPUT_BATCHES))
    result.plan = plan_phases(load_predictor(model_dir), search_space, trajectory,
                              ScheduleOptions(reconfig_cost_s=1.0, threshold=0.0, max_segments=8))
    log(result.plan.table())
    timings["goodput"] = time.monotonic() - started


def _run(args: argparse.Namespace) -> int:
    from paratune.tracking import ui_command

    options = QuickstartOptions(world_sizes=args.world_sizes, gpus=args.gpus,
                                warmup_steps=args.warmup, measured_steps=args.steps,
                                verify=args.verify, goodput=not args.no_goodput)
    result = quickstart(args.out, options, track=not args.no_track)
    rec = result.tuning.recommendation
    print()
    print(f"Recommendation for {rec.get('model', {}).get('name', 'tiny')} on {args.gpus} "
          f"processes: {result.tuning.best.key()}")
    for name, path in sorted(result.tuning.outputs.items()):
        print(f"  {name:<11} {path}")
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in result.timings_s.items())
    if result.goodput is not None:
        b_noise = result.goodput.recommendation.get("objective", {}).get("b_noise")
        shown = f" (B_noise {b_noise:.3g} sequences)" if b_noise else ""
        print(f"Goodput recommendation{shown}: {result.goodput.best.key()} "
              f"({result.goodput.outputs.get('json', '')})")
        plan = result.plan
        print(f"Phase plan: {len(plan.phases)} phase(s), "
              + " -> ".join(f"gb{p['config']['global_batch_size']}" for p in plan.phases)
              + f", {plan.speedup('fixed'):.3f}x the best fixed config")
    print(f"Stages: {timing}.")
    print(f"Dataset: paratune datasets show {result.campaign.out}")
    if not args.no_track:
        print(f"MLflow:  {ui_command()}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from paratune.cli import world_sizes
    from paratune.tracking import add_track_flag

    parser = subparsers.add_parser(
        "quickstart", help="profile, fit, tune and verify on this CPU (no GPU, no data)",
        description=__doc__)
    parser.add_argument("--out", default="paratune-quickstart",
                        help="output directory (re-run to resume; default: %(default)s)")
    parser.add_argument("--world-sizes", type=world_sizes, default=(1, 2, 4),
                        metavar="N,N,...", help="process counts to profile (default: 1,2,4)")
    parser.add_argument("--gpus", type=int, default=4,
                        help="processes of the tuned job (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per config")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config")
    parser.add_argument("--verify", type=int, default=1,
                        help="top configs to profile again after tuning (default: %(default)s)")
    parser.add_argument("--no-goodput", action="store_true",
                        help="stop after the throughput recommendation (no batch-size "
                             "profiling, noise-scale measurement, goodput or phase plan)")
    add_track_flag(parser)
    parser.set_defaults(func=_run, field_flags={"warmup_steps": "--warmup",
                                                "measured_steps": "--steps",
                                                "verify": "--verify", "gpus": "--gpus"})
