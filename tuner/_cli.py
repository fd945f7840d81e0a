"""``paratune tune`` and ``paratune plan`` (argparse only here; work happens in handlers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paratune.tracking import add_track_flag
from paratune.tuner._requests import OutputOptions, SearchOptions, TuneJob, add_flags

__all__ = ["register"]

# The library's name -> the flag, for values the library checks under another name (see
# paratune.cli.flag_message).
_JOB_FIELD_FLAGS = {
    "path": "--model",  # a config.json that cannot be read
    "gpu": "--hardware",  # not in the hardware catalogue (named as typed: --gpu or --hardware)
    "global_batch_sizes": "--global-batch",
    "grid": "--space",
    "seq_len": "--trajectory-seq-len",
    "gpus": "--gpus",
    "min_feasible_prob": "--min-feasible-prob",
    "memory_limit_gb": "--memory-limit-gb",
}


def _add_job(parser: argparse.ArgumentParser, *, default_batch: str) -> dict[str, str]:
    """The job's flags (the fields of :class:`~paratune.tuner.TuneJob`), ``--predictor``
    and ``--no-track``; returns ``{field: flag}``."""
    named = add_flags(parser, TuneJob, help_values={"default_batch": default_batch})
    parser.add_argument("--predictor", required=True, type=Path,
                        help="directory of a fitted performance model (paratune fit)")
    add_track_flag(parser, "do not record an MLflow run")
    return named


def register(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser(
        "tune", help="search global batch size and parallelism against a fitted model",
        description="Rank configs of MODEL on GPUS devices by predicted throughput or goodput; "
                    "write the winner as YAML/JSON with torchrun, torchtitan and Megatron-LM "
                    "settings. Several processes given the same --storage and --study-name "
                    "share one study (give each its own --seed, or workers that start "
                    "together draw the same configs); rerunning a killed command resumes "
                    "it.")
    named = _add_job(tune, default_batch="about 2**20 tokens; with --objective goodput and "
                                         "--gns, the powers of two around B_noise")
    named.update(add_flags(tune, SearchOptions))
    named.update(add_flags(tune, OutputOptions))
    tune.add_argument("--dataset", type=Path, action="append", default=None,
                      help="measurements the predictor was fitted on, refitted with what "
                           "--verify measures (a dataset directory or a public CSV; repeat "
                           "for several)")
    tune.set_defaults(func=_tune, field_flags={**named, **_JOB_FIELD_FLAGS,
                                               "trajectory": "--gns", "dataset": "--dataset"})

    plan = subparsers.add_parser(
        "plan", help="schedule training phases (batch, parallelism) from a B_noise trajectory",
        description="Split training into phases whose global batch and parallelism follow the "
                    "gradient noise scale: the schedule with the least predicted time to "
                    "target, switch costs included, among those whose switches each gain "
                    "more than the threshold; compare with a fixed batch and with a batch "
                    "that follows B_noise under one fixed parallelism.")
    named = _add_job(plan, default_batch="from the smallest batch that keeps every device "
                                         "busy under some layout (dp x micro-batch) up in "
                                         "factors of two to twice the largest B_noise")
    from paratune.tuner._plan_job import PlanOptions

    source = plan.add_mutually_exclusive_group(required=True)
    named.update(add_flags(source, PlanOptions, only=("trajectory", "law")))
    named.update(add_flags(plan, PlanOptions, skip=("trajectory", "law")))
    plan.add_argument("--output", type=Path, default=None, metavar="PATH",
                      help="write the plan as JSON: PATH itself if it ends in .json, else "
                           "PATH/plan.json with the launch files of every phase beside it "
                           "(torchtitan TOML and Megatron-LM arguments per phase, Megatron's "
                           "batch schedule per layout, paratune's trainer for the whole plan)")
    plan.set_defaults(func=_plan, field_flags={**named, **_JOB_FIELD_FLAGS})


def _tune(args: argparse.Namespace) -> int:
    from paratune.spec import get_model
    from paratune.tracking import ui_command
    from paratune.tuner._requests import from_flags
    from paratune.tuner._tune import tune
    from paratune.tuner._verify_refit import VerifyOptions

    model = get_model(args.model, seq_len=args.seq_len)
    job = from_flags(TuneJob, args, model=model, seq_len=None)
    if args.dataset:
        _check_dataset(args.dataset)
    verify = VerifyOptions(dataset=args.dataset) if args.dataset else None
    search = from_flags(SearchOptions, args, verify_options=verify)
    output = from_flags(OutputOptions, args, track=not args.no_track,
                        output_dir=args.output or Path(
                            f"tune-{model.name}-{args.gpus}x{args.hardware}"),
                        on_ranked=lambda ranked: _print_ranking(ranked, args.top_k))
    result = tune(job, search=search, output=output, predictor=args.predictor)
    cluster = result.cluster_verification
    if cluster is not None and cluster.pending:
        print(f"\nverify on the cluster: {len(cluster.pending)} of {len(cluster.configs)} "
              "configs to run (campaigns in a folder every node must see):")
        print(cluster.instructions())
    if result.verification is not None:
        from paratune.table import format_table

        print()
        print(format_table(result.verification.to_dict("records"),
                           title="verification: predicted vs measured"))
    print(f"\nwrote {', '.join(str(p) for p in result.outputs.values())}")
    if result.run_id:
        print(f"MLflow run {result.run_id}: {ui_command()}")
    infeasible = result.recommendation["launch"]["infeasible"]
    if infeasible and not args.export_infeasible:
        print(f"paratune tune: error: {infeasible}: no launch files written (more devices, a "
              f"larger --memory-limit-gb or a lower --min-feasible-prob may find one that "
              f"runs; --export-infeasible writes them anyway)", file=sys.stderr)
        return 1
    return 0


def _check_dataset(paths: list[Path]) -> None:
    """Read ``--dataset`` before any search or verification: the refit after the verified
    runs reads it, and a path it cannot read would be found out only then, after the
    cluster time was spent."""
    from paratune.errors import ConfigError, DatasetError
    from paratune.models import load_measurements

    try:
        load_measurements(paths)
    except (DatasetError, OSError) as exc:
        raise ConfigError("dataset", ", ".join(map(str, paths)), f"{exc} (a dataset "
                          "directory or a public CSV per --dataset; repeat the flag for "
                          "several)") from None


def _print_ranking(result, top_k: int) -> None:
    """The ranking, the study and the winner's launch settings (shown before a verification
    starts profiling)."""
    print(result.table(top_k))
    search = result.search
    if search.study_name:
        print(f"\nstudy {search.study_name} in {search.storage}: {search.num_trials} trials "
              f"({search.num_pruned} pruned), {len(search.ranked)} distinct configs, "
              f"{search.wall_time_s:.1f} s")
    launch = result.recommendation["launch"]
    print(f"\nwinner: {result.best.key()}")
    if launch["infeasible"]:
        print(f"  PREDICTED NOT TO RUN: {launch['infeasible']}")
    if launch["torchrun"]:
        print(f"  torchrun:   {launch['torchrun']}")
    if launch["megatron"]:
        print(f"  Megatron-LM: {launch['megatron']}")
    if launch["torchtitan"]:
        print(f"  torchtitan 0.3: {launch['torchtitan']}")
    for note in launch["notes"]:
        print(f"  note: {note}")
    sys.stdout.flush()


def _plan(args: argparse.Namespace) -> int:
    from paratune.tuner._plan_job import PlanOptions, plan
    from paratune.tuner._requests import from_flags

    # everything that can be checked without the work is refused before a run is opened
    job = from_flags(TuneJob, args)
    options = from_flags(PlanOptions, args)
    outcome = plan(job, options, predictor=args.predictor,
                   output=OutputOptions(output_dir=args.output, track=not args.no_track))
    space = outcome.space
    print(f"{space.model.name} ({space.model.seq_len} tokens per sequence) on {args.gpus} x "
          f"{space.hardware.name}, global batch sizes "
          f"{_batches_text(space.global_batch_sizes)}")
    print(outcome.plan.table())
    if outcome.written is not None:
        print(f"\nwrote {outcome.written}")
    if outcome.files:
        print(f"wrote {len(outcome.files)} launch files under {args.output} "
              f"(see {outcome.files['README']})")
    if outcome.run_note is not None:
        print(outcome.run_note)
    return 0


def _batches_text(batches) -> str:
    """``64, 128, ..., 2048`` for a long list of global batch sizes."""
    batches = [int(b) for b in batches]
    if len(batches) <= 4:
        return ", ".join(map(str, batches))
    return f"{batches[0]}, {batches[1]}, ..., {batches[-1]} ({len(batches)} sizes)"


