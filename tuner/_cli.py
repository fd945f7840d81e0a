"""``paratune tune`` and ``paratune plan`` (argparse only here; work happens in handlers)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from paratune.cli import StoreWithAliases, at_least
from paratune.tracking import add_track_flag

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


def _add_job(parser: argparse.ArgumentParser, *, default_batch: str) -> None:
    parser.add_argument("--model", required=True,
                        help="model preset (llama3-8b, ...) or a Hugging Face config.json")
    parser.add_argument("--seq-len", type=at_least(1), default=None, metavar="TOKENS",
                        help="training sequence length (default: the preset's, or a "
                             "config.json's max_position_embeddings, with a warning)")
    parser.add_argument("--gpus", type=int, required=True, help="devices in the job")
    parser.add_argument("--gpu", "--hardware", dest="hardware", required=True, metavar="NAME",
                        action=StoreWithAliases,
                        help="hardware catalogue name of the devices (H100, A100, cpu, ...); "
                             "--hardware is the same flag, spelt as in paratune profile")
    parser.add_argument("--predictor", required=True, type=Path,
                        help="directory of a fitted performance model (paratune fit)")
    parser.add_argument("--global-batch", dest="global_batch", default=None,
                        help="global batch sizes in sequences: 512, 256,512,1024, or a range "
                             "256:4096 (powers of two), 256:4096:x2, 256:1024:256; at most "
                             f"64 sizes (default: {default_batch})")
    parser.add_argument("--space", type=Path, default=None,
                        help="YAML/TOML/JSON file of the options to search (ConfigSpace fields)")
    parser.add_argument("--devices-per-node", type=at_least(1), default=None,
                        help="devices per node (default: the device kind's catalogue value)")
    parser.add_argument("--tp-across-nodes", action="store_true",
                        help="allow tensor parallelism across nodes (off by default)")
    parser.add_argument("--min-feasible-prob", type=float, default=0.5,
                        help="feasibility threshold on the predicted probability of running")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="memory limit per device (default 95%% of the device's)")
    add_track_flag(parser, "do not record an MLflow run")


def _add_trajectory_seq_len(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trajectory-seq-len", dest="trajectory_seq_len", type=int,
                        default=None, metavar="TOKENS",
                        help="tokens per sequence of the run that measured the trajectory, "
                             "for files without a seq_len column (b_simple is in that run's "
                             "sequences and is converted to MODEL's)")


def register(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser(
        "tune", help="search global batch size and parallelism against a fitted model",
        description="Rank configs of MODEL on GPUS devices by predicted throughput or goodput; "
                    "write the winner as YAML/JSON with torchrun, torchtitan and Megatron-LM "
                    "settings. Several processes given the same --storage and --study-name "
                    "share one study (give each its own --seed, or workers that start "
                    "together draw the same configs); rerunning a killed command resumes "
                    "it.")
    _add_job(tune, default_batch="about 2**20 tokens; with --objective goodput and --gns, "
                                 "the powers of two around B_noise")
    tune.add_argument("--objective", choices=("throughput", "goodput"), default="throughput",
                      help="throughput: tokens/s at one global batch; goodput: tokens/s times "
                           "statistical efficiency (needs --gns) (default: %(default)s)")
    tune.add_argument("--gns", default=None,
                      help="gradient noise scale B_noise in sequences of MODEL, a "
                           "trajectory file (CSV/JSON with step, tokens, b_simple in the "
                           "measuring run's sequences, seq_len), or a critical-batch law "
                           "(kaplan2020, minicpm2024, constant:TOKENS) along MODEL's "
                           "Chinchilla loss curve")
    _add_trajectory_seq_len(tune)
    tune.add_argument("--b0", type=float, default=None,
                      help="reference batch of the Pollux efficiency (default: smallest batch)")
    tune.add_argument("--risk", default=None, metavar="QUANTILE",
                      help="rank by a lower quantile of predicted throughput, e.g. q10")
    tune.add_argument("--search", choices=("optuna", "exhaustive"), default="optuna",
                      help="optuna: sample --trials configs; exhaustive: predict every valid "
                           "config (default: %(default)s)")
    tune.add_argument("--trials", type=int, default=200,
                      help="finished trials the study should hold (all workers together)")
    tune.add_argument("--sampler", default="tpe", help="tpe (default), random, gp, qmc, nsga2")
    tune.add_argument("--seed", type=int, default=0,
                      help="sampler seed (default: %(default)s)")
    tune.add_argument("--storage", default=None,
                      help="Optuna storage: a journal file path, or an RDB URL such as "
                           "sqlite:///study.db or postgresql://user@host/db "
                           "(default: OUTPUT/study.journal)")
    tune.add_argument("--study-name", default=None,
                      help="study to create or join (default: derived from the problem)")
    tune.add_argument("--batch-size", type=int, default=8,
                      help="trials asked and predicted together")
    tune.add_argument("--top-k", type=at_least(1), default=10,
                      help="configs shown and kept in the recommendation (default: %(default)s)")
    tune.add_argument("--output", type=Path, default=None,
                      help="output directory (default: tune-MODEL-GPUSxGPU)")
    tune.add_argument("--verify", type=int, default=0, metavar="K",
                      help="verify K configs for real (different layouts first), add them "
                           "to the dataset, refit and report predicted vs measured: profiled "
                           "here where this machine has the job's hardware, else their "
                           "torchrun and SLURM commands are printed and written under "
                           "OUTPUT/verify, and the same command run again after them reads "
                           "their results and refits")
    tune.add_argument("--verify-on", dest="verify_on", choices=("auto", "here", "cluster"),
                      default="auto",
                      help="where --verify measures: auto (here if this machine has the "
                           "job's hardware, else the cluster), here, or cluster "
                           "(default: %(default)s)")
    tune.add_argument("--dataset", type=Path, action="append", default=None,
                      help="measurements the predictor was fitted on, refitted with what "
                           "--verify measures (a dataset directory or a public CSV; repeat "
                           "for several)")
    tune.add_argument("--export-infeasible", action="store_true",
                      help="write the launch files even when the winner is predicted not to run "
                           "(each then opens with a line saying so); without it such a winner "
                           "gets only recommendation.json/.yaml and the exit status is 1")
    tune.add_argument("--no-progress", action="store_true",
                      help="no progress bar of the trials (on stderr)")
    tune.set_defaults(func=_tune, field_flags={**_JOB_FIELD_FLAGS, "risk_quantile": "--risk",
                                               "batch_size": "--batch-size",
                                               "n_trials": "--trials", "verify": "--verify",
                                               "verify_on": "--verify-on",
                                               "trajectory": "--gns",
                                               "study_name": "--study-name",
                                               "storage": "--storage", "b0": "--b0",
                                               "gns": "--gns", "sampler": "--sampler"})

    plan = subparsers.add_parser(
        "plan", help="schedule training phases (batch, parallelism) from a B_noise trajectory",
        description="Split training into phases whose global batch and parallelism follow the "
                    "gradient noise scale: the schedule with the least predicted time to "
                    "target, switch costs included, among those whose switches each gain "
                    "more than the threshold; compare with a fixed batch and with a batch "
                    "that follows B_noise under one fixed parallelism.")
    _add_job(plan, default_batch="from the smallest batch that keeps every device busy "
                                 "under some layout (dp x micro-batch) up in factors of two "
                                 "to twice the largest B_noise")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--trajectory", type=Path, default=None,
                        help="B_noise trajectory (CSV/JSON with step, tokens, b_simple in the "
                             "measuring run's sequences, seq_len)")
    source.add_argument("--law", default=None, metavar="NAME",
                        help="a published critical-batch law instead of a measured "
                             "trajectory: kaplan2020 (B_crit = 2e8 tokens / L^(1/0.21)), "
                             "minicpm2024 (1.21e9 tokens / L^6.24) or constant:TOKENS, "
                             "along --loss-curve")
    plan.add_argument("--loss-curve", dest="loss_curve", default="chinchilla",
                      metavar="FILE|chinchilla",
                      help="with --law: loss against tokens, a CSV/JSON file with tokens, "
                           "loss, or chinchilla (Hoffmann et al. 2022's fit for MODEL's "
                           "parameters) (default: %(default)s)")
    plan.add_argument("--tokens", default="2e8:2e11", metavar="FROM:TO",
                      help="with --law and the chinchilla curve: the stretch of training "
                           "planned, in tokens (default: %(default)s)")
    plan.add_argument("--lr-rule", dest="lr_rule", default="sqrt",
                      choices=("sqrt", "linear", "adascale", "none"),
                      help="how the learning rate follows the batch: sqrt (Adam, default), "
                           "linear (SGD), adascale (AdaScale's gain, as Pollux), none")
    plan.add_argument("--base-lr", dest="base_lr", type=float, default=3e-4,
                      help="learning rate at --base-batch (default: %(default)s)")
    plan.add_argument("--base-batch", dest="base_batch", type=float, default=None,
                      help="batch at which --base-lr holds (default: the first phase's)")
    _add_trajectory_seq_len(plan)
    plan.add_argument("--reconfig-cost-s", type=float, default=600.0,
                      help="seconds lost to a change of parallelism")
    plan.add_argument("--batch-change-cost-s", type=float, default=0.0,
                      help="seconds lost to a change of the batch size alone")
    plan.add_argument("--threshold", type=float, default=0.05,
                      help="smallest relative goodput gain, where a switch happens, that "
                           "allows it (default: %(default)s)")
    plan.add_argument("--segments", type=int, default=32,
                      help="resolution along training: stretches of equal tokens (>= 1)")
    plan.add_argument("--smooth", type=at_least(1), default=1,
                      help="running-median window over the trajectory's b_simple")
    plan.add_argument("--output", type=Path, default=None, metavar="PATH",
                      help="write the plan as JSON: PATH itself if it ends in .json, else "
                           "PATH/plan.json with the launch files of every phase beside it "
                           "(torchtitan TOML and Megatron-LM arguments per phase, Megatron's "
                           "batch schedule per layout, paratune's trainer for the whole plan)")
    plan.set_defaults(func=_plan, field_flags={
        **_JOB_FIELD_FLAGS, "max_segments": "--segments", "threshold": "--threshold",
        "reconfig_cost_s": "--reconfig-cost-s", "batch_change_cost_s": "--batch-change-cost-s",
        "trajectory": "--trajectory", "law": "--law", "loss_curve": "--loss-curve",
        "tokens": "--tokens", "lr_rule": "--lr-rule", "base_lr": "--base-lr",
        "base_batch": "--base-batch"})


def _space(args: argparse.Namespace):
    """The space file's options (``None`` without one: the library defaults apply).

    ``--tp-across-nodes`` travels as ``tp_within_node`` rather than being folded in here: the
    space stays the file's (``tune`` and ``plan`` pick the global batches where neither
    ``--global-batch`` nor the file gives them).
    """
    from paratune.space import ConfigSpace

    return ConfigSpace.from_file(args.space) if args.space else None


def _tp_within_node(args: argparse.Namespace) -> bool | None:
    """``False`` under ``--tp-across-nodes``; ``None`` leaves the space's setting."""
    return False if args.tp_across_nodes else None


def _tune(args: argparse.Namespace) -> int:
    from paratune.spec import get_model
    from paratune.tracking import ui_command
    from paratune.tuner._tune import tune

    model = get_model(args.model, seq_len=args.seq_len)
    output = args.output or Path(f"tune-{model.name}-{args.gpus}x{args.hardware}")
    verify_options = {"dataset": args.dataset} if args.dataset else None
    result = tune(model, args.gpus, args.hardware, args.predictor, objective=args.objective,
                  gns=args.gns, b0=args.b0, global_batch_sizes=args.global_batch,
                  space=_space(args), devices_per_node=args.devices_per_node,
                  tp_within_node=_tp_within_node(args), search=args.search,
                  n_trials=args.trials, sampler=args.sampler,
                  seed=args.seed, storage=args.storage, study_name=args.study_name,
                  batch_size=args.batch_size, risk_quantile=args.risk,
                  min_feasible_prob=args.min_feasible_prob,
                  memory_limit_gb=args.memory_limit_gb, top_k=args.top_k, output_dir=output,
                  track=not args.no_track, verify=args.verify, verify_options=verify_options,
                  verify_on=args.verify_on,
                  trajectory_seq_len=args.trajectory_seq_len,
                  on_ranked=lambda ranked: _print_ranking(ranked, args.top_k),
                  progress=not args.no_progress, export_infeasible=args.export_infeasible)
    cluster = result.cluster_verification
    if cluster is not None and cluster.pending:
        print(f"\nverify on the cluster: {len(cluster.pending)} of {len(cluster.configs)} "
              "configs to run (campaigns in a folder every node must see):")
        print(cluster.instructions())
    if result.verification is not None:
        from paratune._table import format_table

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
    import contextlib
    import json

    from paratune._io import atomic_write_text
    from paratune.space import ConfigSpace
    from paratune.spec import get_model
    from paratune.tuner._objective import Objective
    from paratune.tuner._plan import check_plan_options, plan_phases
    from paratune.tuner._space import SearchSpace, check_gpus
    from paratune.tuner._tune import extrapolation_warnings, load_predictor, predictor_params
    from paratune.tuner.gns_trajectory import load_trajectory

    # everything that can be checked without the work is refused before a run is opened
    check_gpus(args.gpus)
    check_plan_options(reconfig_cost_s=args.reconfig_cost_s,
                       batch_change_cost_s=args.batch_change_cost_s, threshold=args.threshold,
                       max_segments=args.segments)
    model = get_model(args.model, seq_len=args.seq_len)
    if args.trajectory is not None:
        trajectory = load_trajectory(args.trajectory, smooth=args.smooth,
                                     seq_len=args.trajectory_seq_len)
    else:
        trajectory = law_trajectory_for(model, args.law, args.loss_curve, args.tokens)
    options = _space(args)
    if args.tp_across_nodes:
        options = (options or ConfigSpace()).replace(tp_within_node=False)
    # --global-batch, else the space file's batches, else the range the trajectory spans
    batches = args.global_batch
    if batches is None and not (options is not None and options.global_batch_sizes_given):
        from paratune.hardware import get_hardware
        from paratune.tuner._plan import default_batch_range

        node = args.devices_per_node or get_hardware(args.hardware).devices_per_node
        batches = default_batch_range(model, args.gpus, trajectory.b_noise_in(model.seq_len),
                                      space=options, devices_per_node=node)
    space = SearchSpace.build(model, args.gpus, args.hardware, space=options,
                              global_batch_sizes=batches,
                              devices_per_node=args.devices_per_node)
    objective = Objective(min_feasible_prob=args.min_feasible_prob,
                          memory_limit_gb=args.memory_limit_gb)
    predictor = load_predictor(args.predictor)  # a predictor that does not load opens no run
    for message in extrapolation_warnings(predictor, space):
        logging.getLogger("paratune.tuner").warning(message)
    with contextlib.ExitStack() as stack:
        run = None
        if not args.no_track:  # opened before the work: a failed or killed run keeps its record
            from paratune.tracking import start_run

            name = f"plan-{model.name}-{args.gpus}x{space.hardware.name}"
            run = stack.enter_context(start_run("paratune-plan", run_name=name, params={
                "model": model.name, "seq_len": model.seq_len, "gpus": args.gpus,
                "hardware": space.hardware.name,
                "devices_per_node": space.devices_per_node,
                **predictor_params(args.predictor, predictor),
                "trajectory": (str(args.trajectory.resolve()) if args.trajectory
                               else trajectory.source),
                "lr_rule": args.lr_rule, "base_lr": args.base_lr,
                "trajectory_seq_len": trajectory.seq_len, "smooth": args.smooth,
                "reconfig_cost_s": args.reconfig_cost_s,
                "batch_change_cost_s": args.batch_change_cost_s,
                "threshold": args.threshold, "max_segments": args.segments,
                "min_feasible_prob": objective.min_feasible_prob,
                "memory_limit_gb": objective.memory_limit(space),
                "global_batch_sizes": list(space.global_batch_sizes),
                "space": space.space.to_dict()}))
        plan = plan_phases(predictor, space, trajectory,
                           reconfig_cost_s=args.reconfig_cost_s,
                           batch_change_cost_s=args.batch_change_cost_s,
                           threshold=args.threshold, max_segments=args.segments,
                           objective=objective, lr_rule=args.lr_rule, base_lr=args.base_lr,
                           base_batch=args.base_batch)
        print(f"{model.name} ({model.seq_len} tokens per sequence) on {args.gpus} x "
              f"{space.hardware.name}, global batch sizes "
              f"{_batches_text(space.global_batch_sizes)}")
        print(plan.table())
        if args.output:
            written = (args.output / "plan.json" if args.output.suffix != ".json"
                       else args.output)
            atomic_write_text(written, json.dumps(plan.to_dict(), indent=2, default=float))
            print(f"\nwrote {written}")
            if args.output.suffix != ".json":
                from paratune.tuner._plan_export import write_plan_launch

                files = write_plan_launch(plan, model, space.hardware, args.output,
                                          devices_per_node=space.devices_per_node)
                print(f"wrote {len(files)} launch files under {args.output} "
                      f"(see {files['README']})")
        if run is not None:
            run.log_metrics({"total_time_s": plan.total_time_s,
                             "num_switches": plan.num_switches,
                             "speedup_vs_fixed": plan.speedup("fixed"),
                             "speedup_vs_follow_critical": plan.speedup("follow_critical")})
            run.log_dict(plan.to_dict(), "plan.json")
    if run is not None:
        from paratune.tracking import run_note

        print(run_note(run))
    return 0


def _batches_text(batches) -> str:
    """``64, 128, ..., 2048`` for a long list of global batch sizes."""
    batches = [int(b) for b in batches]
    if len(batches) <= 4:
        return ", ".join(map(str, batches))
    return f"{batches[0]}, {batches[1]}, ..., {batches[-1]} ({len(batches)} sizes)"


def law_trajectory_for(model, law: str, loss_curve: str, tokens: str):
    """The ``B_noise`` trajectory of ``--law`` along ``--loss-curve`` for ``model``."""
    from paratune.errors import ConfigError
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
