"""The ``paratune gns`` command: measure the gradient noise scale of a real training run."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from paratune.cli import at_least
from paratune.tracking import add_track_flag

__all__ = ["DEFAULT_CHECKPOINT_EVERY", "register"]

DEFAULT_CHECKPOINT_EVERY = 50
"""Steps between checkpoints unless ``--checkpoint-every`` says otherwise. A DCP save costs
about one training step of the tiny and small presets on a CPU (0.1 s and 0.2-0.8 s), so
about 2% of a run's time at 50 steps, for a resume that loses at most 50 steps."""

_CONFIG_KEYS = ("dp", "tp", "pp", "micro_batch_size", "global_batch_size", "schedule",
                "virtual_stages", "sharding", "recompute")
_ALIASES = {"mb": "micro_batch_size", "mbs": "micro_batch_size", "gb": "global_batch_size",
            "gbs": "global_batch_size", "v": "virtual_stages"}

# The library's name -> the flag, for values the library checks under another name (see
# paratune.cli.flag_message). The corpus size is checked in bytes (corpus_bytes), not in
# the MiB of --corpus-mb, so its lower bound is checked here instead.
_FIELD_FLAGS = {
    "path": "--model",  # a config.json that cannot be read
    "steps": "--steps",  # e.g. fewer than a resumed run has already made
    "out": "--out",  # e.g. another run is writing it
    "model.seq_len": "--seq-len",
    "data_seed": "--seed",
    "num_small_batches": "--small-batches",
    "beta": "--ema",
    "measure_every": "--measure-every",
}
_MIN_CORPUS_MB = 4096 / (1 << 20)  # TextCorpus.from_stdlib reads at least 4096 bytes


def parse_config(text: str):  # -> ParallelConfig (import kept lazy)
    """A ParallelConfig from ``dp=2,tp=2,gb=32,mb=4`` (or a ``ParallelConfig.key()`` such as
    ``dp2-tp2-pp1-mb4-gb32``).

    Raises:
        ConfigError: an unknown key or a bad value, named.
    """
    from paratune.errors import ConfigError
    from paratune.parallel import ParallelConfig

    values: dict[str, object] = {}
    if "=" in text:
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            key = _ALIASES.get(key.strip(), key.strip())
            if key not in _CONFIG_KEYS:
                raise ConfigError("config", part, f"unknown key (use {', '.join(_CONFIG_KEYS)}"
                                  " or mb, gb)")
            value = value.strip()
            values[key] = int(value) if value.isdigit() else value
    else:
        prefixes = (("dp", "dp"), ("tp", "tp"), ("pp", "pp"), ("mb", "micro_batch_size"),
                    ("gb", "global_batch_size"), ("v", "virtual_stages"))
        for part in filter(None, text.split("-")):
            for prefix, key in prefixes:
                if part.startswith(prefix) and part[len(prefix):].isdigit():
                    values[key] = int(part[len(prefix):])
                    break
            else:
                raise ConfigError("config", text, f"cannot read {part!r}: use dp=2,tp=2,gb=32 "
                                  "or dp2-tp2-gb32")
    return ParallelConfig.from_dict(values)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gns", help="measure the gradient noise scale (B_noise) of a real training run",
        description="Train MODEL on real text (the Python standard library's sources, "
                    "byte-level) under a parallel config on this machine and write the "
                    "B_noise trajectory (step, tokens, loss, b_simple, ...) as CSV, the "
                    "format 'paratune tune --gns' and 'paratune plan --trajectory' read. "
                    "Rows are written as they are measured and the model and optimizer are "
                    "checkpointed every 50 steps (--checkpoint-every) into OUT-checkpoint/; "
                    "rerunning the same command with --resume continues a killed run from "
                    "its last checkpoint (the steps after it are measured again). A run "
                    "without --resume starts afresh: where OUT exists it is refused unless "
                    "--force is given, which replaces OUT and that checkpoint. "
                    "A second run on the same OUT is refused while one runs (OUT.lock).")
    parser.add_argument("--model", default="tiny",
                        help="model preset with a byte-level vocabulary (tiny, small) or a "
                             "config.json path (default tiny)")
    parser.add_argument("--config", default="dp=1,gb=16", metavar="SPEC",
                        help="parallel config, e.g. dp=2,tp=2,gb=32,mb=4 (keys: dp tp pp mb gb "
                             "schedule virtual_stages sharding recompute); dp*tp*pp processes "
                             "are started (default dp=1,gb=16)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--out", type=Path, default=None,
                        help="trajectory CSV (default runs/gns-<model>-<config>.csv)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="override the model's sequence length")
    parser.add_argument("--lr", type=at_least(0.0, float), default=1e-3,
                        help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    parser.add_argument("--mode", choices=("auto", "dp", "accumulate"), default="auto",
                        help="small batches: per data-parallel rank before the all-reduce "
                             "(dp), gradient-accumulation chunks (accumulate), or dp where the "
                             "layout allows it (auto)")
    parser.add_argument("--small-batches", type=int, default=2,
                        help="chunks per step in accumulate mode (default 2)")
    parser.add_argument("--precondition", choices=("none", "adam"), default="none",
                        help="weight squared gradients by Adam's 1/sqrt(v) as Pollux does "
                             "(default none: plain Euclidean norms)")
    parser.add_argument("--ema", type=float, default=0.95,
                        help="decay of the moving averages of |G|^2 and tr(Sigma)")
    parser.add_argument("--measure-every", dest="measure_every", type=at_least(1), default=1,
                        metavar="K",
                        help="measure the noise scale on every K-th step only (one "
                             "trajectory row each); the steps between train as usual "
                             "(default: every step)")
    parser.add_argument("--corpus-mb", type=at_least(_MIN_CORPUS_MB, float), default=8.0,
                        help="MiB of standard-library source to read (default 8)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                        help=f"save model/optimizer state into OUT-checkpoint/ every STEPS "
                             f"steps and at the end (default {DEFAULT_CHECKPOINT_EVERY}; 0: "
                             "never, and --resume then cannot continue; layouts that cannot "
                             "be checkpointed, zero1 with dp > 1, default to 0)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a killed run from its last checkpoint in "
                             "OUT-checkpoint/; refused if that checkpoint was saved with other "
                             "settings (model, config, seed, lr, --mode, --small-batches, "
                             "--precondition, --ema, --corpus-mb)")
    parser.add_argument("--force", action="store_true",
                        help="without --resume, replace an existing OUT and its checkpoint "
                             "(refused otherwise)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device to train on (auto: cuda when available)")
    add_track_flag(parser)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (step, loss, latest b_simple, time left)")
    parser.set_defaults(func=_gns, field_flags=_FIELD_FLAGS)


def _gns(args: argparse.Namespace) -> int:
    import sys

    from paratune.errors import ConfigError, Terminated
    from paratune.profiler.gns import GNSJob, resume_hint, run_gns
    from paratune.profiler.reconfigure import _check_supported
    from paratune.spec import get_model

    model = get_model(args.model, seq_len=args.seq_len)
    config = parse_config(args.config)
    out = args.out or Path("runs") / f"gns-{model.name}-{config.key()}.csv"
    checkpoint_every = args.checkpoint_every
    if checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY
        try:
            _check_supported(config)
        except ConfigError:
            checkpoint_every = 0
            print(f"note: {config.key()} (zero1 with dp > 1) cannot be checkpointed; this run "
                  "saves no checkpoint and cannot be resumed", file=sys.stderr)
    # Always named, so that a fresh run clears an earlier run's checkpoint there.
    checkpoint_dir = str(out.with_suffix("")) + "-checkpoint"
    job = GNSJob(model=model, config=config, steps=args.steps, out=str(out), seed=args.seed,
                 data_seed=args.seed, lr=args.lr, mode=args.mode,
                 num_small_batches=args.small_batches, precondition=args.precondition,
                 beta=args.ema, measure_every=args.measure_every,
                 corpus_bytes=int(args.corpus_mb * (1 << 20)),
                 checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                 resume=args.resume, device=args.device)
    job.validate()  # a bad argument is refused before a run is opened
    if not args.resume and not args.force and out.is_file() and out.stat().st_size > 0:
        raise ConfigError("out", str(out), "exists: give --resume to continue its run, --force "
                          "to replace it (and its checkpoint), or another --out")
    with contextlib.ExitStack() as stack:
        run = None
        if not args.no_track:  # opened first: a failed or killed run still has its record
            from paratune.tracking import start_run

            run = stack.enter_context(start_run(
                "paratune-gns", run_name=f"gns-{model.name}-{config.key()}",
                params={"model": model.name, "seq_len": model.seq_len,
                        "config": config.key(), "steps": args.steps,
                        "lr": args.lr, "seed": args.seed, "mode": args.mode,
                        "precondition": args.precondition, "ema": args.ema,
                        "measure_every": args.measure_every}))
        try:
            path = run_gns(job, progress=not args.no_progress)
        except (KeyboardInterrupt, Terminated):
            # the workers have ended: say what the run left and how to go on
            print(f"paratune gns: stopped; {resume_hint(job)}", file=sys.stderr)
            raise
        frame = _report(path, model, config)
        if run is not None:
            every = max(1, len(frame) // 200)
            for row in frame.iloc[::every].to_dict("records"):
                run.log_metrics({k: row[k] for k in ("loss", "b_simple", "g2_ema",
                                                     "trace_ema", "tokens")},
                                step=int(row["step"]))
            run.log_artifact(path)
    if run is not None:
        from paratune.tracking import run_note

        print(run_note(run))
    return 0


def _report(path: Path, model: object, config: object) -> object:
    """Print a tenth of the trajectory's rows (and its last) and return the whole of it."""
    import pandas as pd

    from paratune.table import format_table

    frame = pd.read_csv(path)
    shown = frame.iloc[:: max(1, len(frame) // 10)]
    if shown.index[-1] != frame.index[-1]:
        shown = pd.concat([shown, frame.iloc[[-1]]])
    print(format_table(shown[["step", "tokens", "loss", "b_simple", "g2_ema", "trace_ema",
                              "elapsed_s"]].to_dict("records"),
                       title=f"B_noise of {model.name} under {config.key()}"))
    print(f"trajectory: {path} ({len(frame)} rows; b_simple in sequences)")
    return frame
