"""Train paratune's workload under one parallel configuration: the job a recommendation
launches.

Run it with torchrun (one process per device), e.g.::

    torchrun --standalone --nproc-per-node=4 -m paratune.profiler.train \\
        --model tiny --seq-len 128 --config '{"dp": 2, "tp": 2, "global_batch_size": 8}' \\
        --steps 50

A whole training-phase plan runs in one launch with ``--plan launch.json`` (the file
``paratune plan --output DIR`` writes) in place of ``--config``: each phase trains its steps
under its config and learning rate, and where the config changes the run switches through a
``torch.distributed.checkpoint`` hand-over (``--checkpoint-dir``), keeping its data position.

Without torchrun's environment it runs as a single process. It trains on real text (the
byte-level corpus of Python's own sources) or on random tokens, and prints the loss and the
throughput every ``--log-every`` steps on rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TrainOptions", "TrainReport", "main", "parse_args", "resolve_model", "train",
           "train_plan"]


@dataclass
class TrainReport:
    """What a training run did (the same on every rank)."""

    steps: int
    final_loss: float
    mean_step_time_s: float
    tokens_per_s: float
    global_batch_size: int
    """Sequences per step."""
    seq_len: int
    """Tokens per sequence."""


def resolve_model(model_name: str, seq_len: int | None = None):  # -> ModelSpec (lazy import)
    """The model trained: a preset by name or a Hugging Face ``config.json`` path, at
    ``seq_len`` tokens per sequence (default: the preset's, or the ``config.json``'s
    ``max_position_embeddings``).

    Raises:
        ConfigError: an unknown preset, an unreadable ``config.json`` or a bad ``seq_len``.
    """
    from paratune.spec import get_model

    return get_model(model_name, seq_len=seq_len)


@dataclass(frozen=True)
class TrainOptions:
    """How :func:`train` trains, besides the model, the layout and the steps; checked when
    built."""

    seq_len: int | None = None
    """Tokens per sequence (``None``: the model's, see :func:`resolve_model`)."""
    data: str = "text"
    """``"text"`` (real text) or ``"synthetic"`` (uniform random tokens)."""
    seed: int = 0
    """Initialisation and data seed."""
    lr: float = 3e-4
    """AdamW learning rate."""
    log_every: int = 10
    """Print every this many steps on rank 0 (0: never)."""

    def __post_init__(self) -> None:
        from paratune.errors import ConfigError

        if self.data not in ("text", "synthetic"):
            raise ConfigError("data", self.data, "must be text or synthetic")
        if not (isinstance(self.lr, int | float) and 0 < self.lr < math.inf):
            raise ConfigError("lr", self.lr, "must be a positive, finite learning rate")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) \
                or self.log_every < 0:
            raise ConfigError("log_every", self.log_every, "must be an integer >= 0")


def train(model_name: str, config_json: str, *, steps: int,
          options: TrainOptions | None = None, out: object = None) -> TrainReport:
    """Train inside an initialised process group of ``config.world_size`` ranks.

    Args:
        model_name: A preset name or a Hugging Face ``config.json`` path.
        config_json: The :class:`~paratune.ParallelConfig` as JSON.
        steps: Optimizer steps to run.
        options: Sequence length, data, seed, learning rate and logging (see
            :class:`TrainOptions`; default: its defaults).
        out: Where rank 0 prints (default: stdout).

    Returns:
        A :class:`TrainReport`.

    Raises:
        ConfigError: a bad model, config or argument (named in the message).
    """
    import torch
    import torch.distributed as dist

    from paratune.errors import ConfigError
    from paratune.parallel import ParallelConfig
    from paratune.profiler.measure import _synchronize
    from paratune.profiler.trainer import Trainer, synthetic_batch

    options = options if options is not None else TrainOptions()
    seq_len, data, seed, log_every = (options.seq_len, options.data, options.seed,
                                      options.log_every)
    if steps < 1:
        raise ConfigError("steps", steps, "must be a positive integer")
    spec = resolve_model(model_name, seq_len)
    try:
        config = ParallelConfig.from_dict(json.loads(config_json))
    except json.JSONDecodeError as exc:
        raise ConfigError("config", config_json, f"is not valid JSON ({exc})") from None
    device = _device()
    trainer = Trainer(spec, config, device=device, seed=seed, lr=options.lr)
    corpus = None
    if data == "text":
        from paratune.profiler.corpus import TextCorpus

        corpus = TextCorpus.from_stdlib()
        if spec.vocab_size < corpus.vocab_size:
            raise ConfigError("model", spec.name, f"vocab_size={spec.vocab_size} is smaller than "
                              f"the byte-level corpus' {corpus.vocab_size}")
    rank = dist.get_rank()
    stream = out if out is not None else sys.stdout
    tokens_per_step = config.global_batch_size * spec.seq_len
    times: list[float] = []
    loss = float("nan")
    for step in range(steps):
        if corpus is not None:
            batch = corpus.batch(step, config.global_batch_size, spec.seq_len, seed=seed)
        else:
            batch = synthetic_batch(spec, config.global_batch_size, step=step, seed=seed)
        _synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        local_loss = trainer.train_step(batch)  # no loss reduction inside the timed step
        _synchronize(device)
        # On the trainer's device: NCCL reduces CUDA tensors only.
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64,
                               device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        logged = bool(log_every) and (step + 1) % log_every == 0
        if logged or step == steps - 1:  # the same on every rank: global_loss is collective
            loss = trainer.global_loss(local_loss)
        if rank == 0 and logged:
            print(f"step {step + 1:>6}  loss {loss:.4f}  step {times[-1]:.3f} s  "
                  f"{tokens_per_step / times[-1]:,.0f} tokens/s", file=stream, flush=True)
    timed = times[1:] or times  # the first step pays one-off costs
    mean = sum(timed) / len(timed)
    return TrainReport(steps=steps, final_loss=loss, mean_step_time_s=mean,
                       tokens_per_s=tokens_per_step / mean,
                       global_batch_size=config.global_batch_size, seq_len=spec.seq_len)


def _plan_phases(launch: dict) -> list[tuple[object, int, float]]:
    """``(config, steps, lr)`` of every phase of a plan's ``launch.json``.

    Raises:
        ConfigError: no phase, a phase without a positive step count, or a phase the
            checkpoint hand-over cannot switch into or out of.
    """
    from paratune.errors import ConfigError
    from paratune.parallel import ParallelConfig
    from paratune.profiler.reconfigure import _check_supported

    phases = launch.get("phases") if isinstance(launch, dict) else None
    if not phases:
        raise ConfigError("plan", None, "has no phases (expected paratune plan's launch.json)")
    out = []
    for i, phase in enumerate(phases, 1):
        config = ParallelConfig.from_dict(phase["config"])
        steps = int(phase["end_step"]) - int(phase["start_step"])
        if steps < 1:
            raise ConfigError("plan", f"phase {i}", "must have at least one step")
        if len(phases) > 1:
            _check_supported(config)
        out.append((config, steps, float(phase["lr"])))
    return out


def train_plan(model_name: str, launch: dict, *, checkpoint_dir: str,
               seq_len: int | None = None, data: str = "text", seed: int = 0,
               log_every: int = 10, out: object = None) -> TrainReport:
    """Train every phase of a plan in one process group, switching layouts in between.

    Args:
        model_name: A preset name or a Hugging Face ``config.json`` path.
        launch: The plan's ``launch.json`` (:func:`paratune.tuner.plan_launch`).
        checkpoint_dir: Where the hand-over checkpoints are written.
        seq_len, data, seed, log_every, out: As for :func:`train`.

    Returns:
        A :class:`TrainReport` of the whole run (its batch: the last phase's).

    Raises:
        ConfigError: a bad model, plan or argument (named in the message).
    """
    import torch
    import torch.distributed as dist

    from paratune.profiler.measure import _synchronize
    from paratune.profiler.reconfigure import RunState, reconfigure
    from paratune.profiler.trainer import Trainer, synthetic_batch

    spec = resolve_model(model_name, seq_len)
    phases = _plan_phases(launch)
    device = _device()
    for config, _steps, _lr in phases:
        config.validate(spec, dist.get_world_size())
    corpus = None
    if data == "text":
        from paratune.profiler.corpus import TextCorpus

        corpus = TextCorpus.from_stdlib()
    config, _steps, lr = phases[0]
    trainer = Trainer(spec, config, device=device, seed=seed, lr=lr)
    state = RunState(config=config)
    stream = out if out is not None else sys.stdout
    rank = dist.get_rank()
    times: list[float] = []
    loss = float("nan")
    for number, (new, steps, lr) in enumerate(phases, 1):
        if new != state.config:
            trainer, state, _cost = reconfigure(
                trainer, state, new, checkpoint_dir=checkpoint_dir,
                build_trainer=lambda c, lr=lr: Trainer(spec, c, device=device, seed=seed,
                                                       lr=lr))
        for optimizer in trainer.optimizers:  # a checkpoint restores the old rate
            for group in optimizer.param_groups:
                group["lr"] = lr
        gb = new.global_batch_size
        if rank == 0:
            print(f"phase {number}: {new.key()}, lr {lr:.4g}, {steps} steps", file=stream,
                  flush=True)
        for _ in range(steps):
            if corpus is not None:
                batch = corpus.sequences(state.samples_seen, gb, spec.seq_len, seed=seed)
            else:
                batch = synthetic_batch(spec, gb, step=state.step, seed=seed)
            _synchronize(device)
            dist.barrier()
            started = time.perf_counter()
            local_loss = trainer.train_step(batch)
            _synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
            state.step += 1
            state.samples_seen += gb
            state.tokens_seen += gb * spec.seq_len
            logged = bool(log_every) and state.step % log_every == 0
            if logged or state.step == sum(p[1] for p in phases):
                loss = trainer.global_loss(local_loss)
            if rank == 0 and logged:
                print(f"step {state.step:>6}  loss {loss:.4f}  step {times[-1]:.3f} s",
                      file=stream, flush=True)
    trainer.close()
    timed = times[1:] or times
    mean = sum(timed) / len(timed)
    last = phases[-1][0].global_batch_size
    return TrainReport(steps=state.step, final_loss=loss, mean_step_time_s=mean,
                       tokens_per_s=state.tokens_seen / sum(times),
                       global_batch_size=last, seq_len=spec.seq_len)


def _device() -> object:
    import torch

    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_process_group() -> None:
    """Join the job's process group. On CUDA this rank's device is set first and given to
    NCCL (``device_id``), so the communicator is bound to it from the start (no guessing
    the device, eager initialisation); on CPU gloo needs neither."""
    import torch.distributed as dist

    from paratune.profiler.processes import init_process_group

    single = "WORLD_SIZE" not in os.environ
    if single:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = _device()  # on CUDA it sets the current device before NCCL starts
    if single:
        # A plain single process: an in-memory store, with no TCP server thread to race the
        # interpreter's exit.
        init_process_group(device, timeout_s=600.0, store=dist.HashStore(),
                           rank=0, world_size=1)
        return
    init_process_group(device, timeout_s=600.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The trainer's command line (``sys.argv[1:]`` by default); exits 2 naming a bad
    option."""
    from paratune.cli import at_least

    parser = argparse.ArgumentParser(prog="python -m paratune.profiler.train",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="preset name or config.json path")
    parser.add_argument("--seq-len", type=at_least(1), default=None, metavar="TOKENS",
                        help="tokens per sequence (default: the preset's, or a config.json's "
                             "max_position_embeddings, with a warning)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="ParallelConfig as JSON")
    source.add_argument("--plan", default=None, metavar="LAUNCH_JSON",
                        help="a training-phase plan's launch.json (paratune plan --output): "
                             "every phase in this one launch")
    parser.add_argument("--checkpoint-dir", default="plan-checkpoint",
                        help="with --plan: where layout switches hand over (default: "
                             "%(default)s)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", choices=("text", "synthetic"), default="text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--hardware", default=None,
                        help="device kind, recorded for reference (e.g. H100)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    from paratune.errors import ConfigError
    from paratune.profiler.mesh import closing_process_group

    _init_process_group()
    try:
        with closing_process_group():
            if args.plan is not None:
                try:
                    with open(args.plan) as handle:
                        launch = json.load(handle)
                except (OSError, json.JSONDecodeError) as exc:
                    raise ConfigError("plan", args.plan, f"could not be read ({exc})") \
                        from None
                report = train_plan(args.model, launch, checkpoint_dir=args.checkpoint_dir,
                                    seq_len=args.seq_len, data=args.data, seed=args.seed,
                                    log_every=args.log_every)
            else:
                options = TrainOptions(seq_len=args.seq_len, data=args.data, seed=args.seed,
                                       lr=args.lr, log_every=args.log_every)
                report = train(args.model, args.config, steps=args.steps, options=options)
    except ConfigError as exc:
        print(f"paratune.profiler.train: error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done: {report.steps} steps of {report.global_batch_size} x "
              f"{report.seq_len} tokens, final loss {report.final_loss:.4f}, "
              f"{report.tokens_per_s:,.0f} tokens/s (mean step {report.mean_step_time_s:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
