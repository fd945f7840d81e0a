"""A training-phase plan as launch files: one launch per phase, resumed from the last.

Per phase (``phase_NN/``):

* ``torchtitan.toml``: the phase's layout and batch from the single-config export
  (:func:`~paratune.tuner.torchtitan_toml`), its learning rate (``[optimizer] lr``), the steps
  the run has taken by the phase's end (``[training] steps``, counted over the whole run, as
  torchtitan resumes its step count from the checkpoint) and the checkpoint to resume from
  (``[checkpoint]``: ``initial_load_path`` is the previous phase's last step under
  ``outputs/phase_NN``, each phase's ``[job] dump_folder``; its data loader state is not
  loaded, since the number of data-parallel ranks may change). Run every phase from the
  same working directory.
  torchtitan has no batch schedule, so every batch change is a phase of its own.
* ``megatron_args.txt`` / ``.json``: Megatron-LM arguments of the phase
  (:func:`~paratune.tuner.megatron_args`), with ``--train-samples`` at the phase's end
  (counted over the whole run), ``--lr`` and a ``torch_dist`` checkpoint in one
  ``--save``/``--load`` directory, which Megatron-LM reshards on load when tensor or
  pipeline parallelism changes; from the second phase on ``--override-opt_param-scheduler``
  makes the new learning rate take over the one saved in the checkpoint.

``run_plan.sh``: paratune's own trainer (``python -m paratune.profiler.train --plan
launch.json``) running the whole plan in one launch, switching layouts through a checkpoint.

Per layout (``megatron_layout_NN/``): the phases that share a layout as ONE Megatron-LM
launch with ``--step-batch-size-schedule "0:B0 T1:B1 ..."`` (thresholds in tokens consumed
by the run, Megatron-LM's format: ``THRESHOLD:BATCH`` pairs, the first at 0, suffixes K, M,
B, T; it excludes ``--global-batch-size`` and needs ``--train-samples``). A step schedule
keeps one ``--lr``: where the learning-rate rule moves it with the batch, the per-phase
launches are the exact form and the schedule's README line says so. The reconfiguration
points (layout changes) are where one layout's launch ends and the next starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text
from paratune.parallel import ParallelConfig
from paratune.tuner._export import (
    megatron_args,
    megatron_env,
    torchrun_command,
    torchtitan_toml,
)
from paratune.tuner._plan_schedule import layout_of

if TYPE_CHECKING:
    from paratune.hardware import HardwareSpec
    from paratune.spec import ModelSpec
    from paratune.tuner._plan import Plan

__all__ = ["megatron_step_schedule", "plan_launch", "write_plan_launch"]

CHECKPOINT_DIR = "checkpoints"
"""Checkpoint directory the launches share (relative to where they run)."""


def _flat(args: list[str]) -> list[str]:
    """An argument list of tokens, from tokens or from ``"--flag value"`` fragments."""
    out: list[str] = []
    for item in args:
        out.extend(shlex.split(item))
    return out


def _drop(tokens: list[str], flag: str) -> list[str]:
    """``tokens`` without ``flag`` and the values that follow it."""
    out, skip = [], False
    for tok in tokens:
        if tok == flag:
            skip = True
            continue
        if skip and not tok.startswith("--"):
            continue
        skip = False
        out.append(tok)
    return out


def _has(tokens: list[str], flag: str) -> bool:
    return flag in tokens


def _tokens_text(tokens: float) -> str:
    """Tokens in Megatron-LM's threshold spelling: exact integers, with a suffix where the
    value is a whole multiple of it (``250B``)."""
    value = round(tokens)
    for suffix, unit in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if value and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def _flag_value(args: list[str], flag: str) -> str:
    """The value after ``flag`` in a flat argument list."""
    return args[args.index(flag) + 1]


def megatron_step_schedule(entries: list[tuple[float, int]], *, seq_len: int) -> str:
    """``--step-batch-size-schedule`` text from ``(run tokens, global batch)`` pairs.

    Thresholds are rounded down to whole sequences (Megatron-LM divides them by
    ``--seq-length``), the first is 0, and a batch equal to the one before it is dropped.

    Raises:
        ConfigError: no entry, a threshold that does not increase, or a batch < 1.
    """
    if not entries:
        raise ConfigError("schedule", entries, "needs at least one (tokens, batch) entry")
    parts: list[str] = []
    last_samples, last_batch = -1, None
    for i, (tokens, batch) in enumerate(entries):
        if int(batch) < 1:
            raise ConfigError("global_batch_size", batch, "must be >= 1")
        samples = 0 if i == 0 else int(tokens // seq_len)
        if samples <= last_samples:
            raise ConfigError("schedule", entries, "thresholds must increase by at least one "
                              "sequence")
        if batch == last_batch:
            continue
        parts.append(f"{_tokens_text(samples * seq_len)}:{int(batch)}")
        last_samples, last_batch = samples, batch
    return " ".join(parts)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _toml_set(text: str, table: str, values: dict[str, Any]) -> str:
    """``text`` with ``values`` set in ``[table]`` (replacing a key already there, adding the
    table at the end where it is missing)."""
    lines = text.rstrip("\n").split("\n")
    header = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")
    start = next((i for i, line in enumerate(lines)
                  if (m := header.match(line)) and m.group(1).strip() == table), None)
    if start is None:
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        return "\n".join(lines) + "\n"
    end = next((i for i in range(start + 1, len(lines)) if header.match(lines[i])), len(lines))
    pending = dict(values)
    for i in range(start + 1, end):
        key = lines[i].split("=", 1)[0].strip()
        if "=" in lines[i] and key in pending:
            lines[i] = f"{key} = {_toml_value(pending.pop(key))}"
    insert = [f"{k} = {_toml_value(v)}" for k, v in pending.items()]
    lines[start + 1:start + 1] = insert
    return "\n".join(lines) + "\n"


def _phase_config(phase: dict[str, Any]) -> ParallelConfig:
    return ParallelConfig.from_dict(phase["config"])


def plan_launch(plan: Plan, model: ModelSpec, hardware: HardwareSpec, *,
                checkpoint_dir: str = CHECKPOINT_DIR,
                devices_per_node: int | None = None) -> dict[str, Any]:
    """The launch settings of every phase of ``plan`` and of every layout.

    Args:
        plan: A plan of :func:`~paratune.tuner.plan_phases`.
        model: The planned model.
        hardware: The device kind.
        checkpoint_dir: Checkpoint directory shared by the launches.
        devices_per_node: Node size of the trainer's torchrun command (default: the
            hardware's).

    Returns:
        ``{"phases": [...], "layouts": [...], "notes": [...]}``: per phase its batch,
        learning rate, sample and step range over the run, torchtitan TOML, Megatron-LM
        argument list and the checkpoint it resumes from; per layout the phases it holds,
        its Megatron-LM arguments with the step batch schedule and the run tokens where it
        starts (a reconfiguration point after the first).
    """
    phases = _phase_launches(plan, model, checkpoint_dir)
    layouts, notes = _layout_launches(phases, seq_len=model.seq_len, lr_rule=plan.lr_rule)
    for phase in phases:
        phase["megatron_env"] = megatron_env(ParallelConfig.from_dict(phase["config"]),
                                             hardware)
    for layout in layouts:  # its first phase's
        layout["megatron_env"] = phases[layout["phases"][0] - 1]["megatron_env"]
    notes += _checkpoint_format_notes(phases)
    if any(p["config"]["dp"] != phases[0]["config"]["dp"] for p in phases):
        notes.append("the data-parallel degree changes between phases: torchtitan resumes "
                     "without the data loader's state (exclude_from_loading), so each phase "
                     "reads its data from the start of its loader unless the dataset is "
                     "offset by the samples already consumed")
    refused = _trainer_refusal(model, [ParallelConfig.from_dict(p["config"]) for p in phases])
    trainer = None if refused else _trainer_command(
        model, ParallelConfig.from_dict(phases[0]["config"]), hardware,
        devices_per_node=devices_per_node)
    if refused:
        notes.append(f"paratune's trainer cannot run this plan ({refused}): no whole-plan "
                     "launch is written for it")
    elif trainer is None:
        notes.append("paratune's trainer cannot build this model (neither a preset nor read "
                     "from a config.json): no whole-plan launch is written for it")
    return {"model": model.name, "hardware": hardware.name, "seq_len": model.seq_len,
            "trainer_command": trainer,
            "lr_rule": plan.lr_rule, "base_lr": plan.base_lr, "base_batch": plan.base_batch,
            "phases": phases, "layouts": layouts, "notes": notes}


@dataclass(frozen=True)
class _PhaseSpan:
    """Where one phase of a plan sits in the run: its samples and steps, counted over the
    whole run (Megatron-LM and torchtitan both count from the run's start)."""

    index: int
    """The phase's position (0 first)."""
    config: ParallelConfig
    lr: float
    start_samples: int
    end_samples: int
    start_step: int
    end_step: int

    @property
    def num_steps(self) -> int:
        return self.end_step - self.start_step

    @property
    def previous(self) -> str | None:
        """The directory name of the phase it resumes from (None for the first)."""
        return f"phase_{self.index:02d}" if self.index else None


def _phase_launches(plan: Plan, model: ModelSpec, checkpoint_dir: str) -> list[dict[str, Any]]:
    """Each phase's launch settings: its span of the run, torchtitan TOML, Megatron-LM
    arguments and the checkpoint it resumes from."""
    phases: list[dict[str, Any]] = []
    samples = 0
    steps = 0
    for i, phase in enumerate(plan.phases):
        config = _phase_config(phase)
        num_steps = max(1, int(phase["steps"]))
        span = _PhaseSpan(index=i, config=config, lr=float(phase["lr"]),
                          start_samples=samples,
                          end_samples=samples + num_steps * config.global_batch_size,
                          start_step=steps, end_step=steps + num_steps)
        samples, steps = span.end_samples, span.end_step
        toml = _phase_toml(model, span, checkpoint_dir=checkpoint_dir)
        toml = (f"# phase {i + 1} of {len(plan.phases)}: global batch "
                f"{config.global_batch_size}, lr {span.lr:.4g} ({plan.lr_rule} rule), steps "
                f"{span.start_step + 1}-{span.end_step} of the run, "
                f"{phase['run_start_tokens']:.4g}-{phase['run_end_tokens']:.4g} tokens\n"
                + toml)
        phases.append({"phase": i + 1, "config": config.to_dict(),
                       "global_batch_size": config.global_batch_size, "lr": span.lr,
                       "start_samples": span.start_samples, "end_samples": span.end_samples,
                       "start_step": span.start_step, "end_step": span.end_step,
                       "run_start_tokens": float(phase["run_start_tokens"]),
                       "run_end_tokens": float(phase["run_end_tokens"]),
                       "resume_from": span.previous, "torchtitan_toml": toml,
                       "megatron_args": _phase_megatron_args(model, span, checkpoint_dir)})
    return phases


_SINGLE_LAUNCH = ("torchtitan.sh beside this file launches the same job on 0.3 with "
                  "--module/--config and command-line overrides")
_PHASE_LAUNCH = ("for 0.3, `paratune tune` at this phase's batch writes its layout's "
                 "torchtitan.sh, which takes this phase's --training.steps, --optimizer.lr, "
                 "--lr_scheduler.* and --checkpoint.* settings as command-line overrides")


def _phase_toml(model: ModelSpec, span: _PhaseSpan, *, checkpoint_dir: str) -> str:
    """The phase's torchtitan TOML: the config's, with its dump folder, last step, learning
    rate and checkpoint (resumed from the previous phase's last step)."""
    toml = torchtitan_toml(model, span.config)
    # no torchtitan.sh beside a phase's TOML: where torchtitan 0.3 finds this job instead
    toml = toml.replace(_SINGLE_LAUNCH, _PHASE_LAUNCH)
    toml = _toml_set(toml, "job", {"dump_folder": f"outputs/phase_{span.index + 1:02d}"})
    toml = _toml_set(toml, "training", {"steps": span.end_step})
    toml = _toml_set(toml, "optimizer", {"lr": span.lr})
    # the phase's learning rate throughout: torchtitan's default schedule warms up over 200
    # steps and decays to 0 by the last step
    toml = _toml_set(toml, "lr_scheduler", {"warmup_steps": 0, "decay_ratio": 0.0})
    checkpoint: dict[str, Any] = {"enable": True, "folder": checkpoint_dir,
                                  "interval": max(1, span.num_steps),
                                  "last_save_model_only": False}
    if span.previous is not None:
        # not the scheduler either: its state holds the previous phase's learning rate
        checkpoint.update({"initial_load_path": f"outputs/{span.previous}/{checkpoint_dir}"
                                                f"/step-{span.start_step}",
                           "initial_load_model_only": False,
                           "exclude_from_loading": ["dataloader", "lr_scheduler"]})
    return _toml_set(toml, "checkpoint", checkpoint)


def _phase_megatron_args(model: ModelSpec, span: _PhaseSpan, checkpoint_dir: str) -> list[str]:
    """The phase's Megatron-LM arguments: the config's, with its batch, the samples at its
    end, its learning rate and the shared checkpoint."""
    args = _drop(_flat(megatron_args(model, span.config)), "--global-batch-size")
    args += ["--global-batch-size", str(span.config.global_batch_size),
             "--train-samples", str(span.end_samples),
             # the phase's learning rate throughout (Megatron-LM decays linearly by default)
             "--lr", f"{span.lr:.6g}", "--lr-decay-style", "constant",
             "--save", checkpoint_dir, "--load", checkpoint_dir,
             # Megatron-LM refuses --save without an interval; the phase's last step saves
             "--save-interval", str(max(1, span.num_steps))]
    if not _has(args, "--ckpt-format"):
        args += ["--ckpt-format", "torch_dist"]
    if span.index:
        args.append("--override-opt_param-scheduler")
    return args


def _layout_launches(phases: list[dict[str, Any]], *, seq_len: int, lr_rule: str
                     ) -> tuple[list[dict[str, Any]], list[str]]:
    """The phases that share a layout as one Megatron-LM launch each (with a step batch
    schedule where the batch changes), and the notes on where one launch is not exact."""
    layouts: list[dict[str, Any]] = []
    for i, phase in enumerate(phases):
        key = layout_of(phase["config"])
        if layouts and layouts[-1]["layout"] == key:
            layouts[-1]["phases"].append(i + 1)
            continue
        layouts.append({"layout": key, "phases": [i + 1],
                        "start_tokens": phase["start_samples"] * seq_len})
    notes: list[str] = []
    for layout in layouts:
        members = [phases[p - 1] for p in layout["phases"]]
        first, last = members[0], members[-1]
        entries = [(m["start_samples"] * seq_len, m["global_batch_size"]) for m in members]
        schedule = megatron_step_schedule(entries, seq_len=seq_len)
        args = _drop(list(first["megatron_args"]), "--global-batch-size")
        args = _drop(args, "--train-samples")
        if len(set(m["global_batch_size"] for m in members)) > 1:
            args += ["--step-batch-size-schedule", schedule]
        else:
            args += ["--global-batch-size", str(first["global_batch_size"])]
        args += ["--train-samples", str(last["end_samples"])]
        layout["megatron_args"] = args
        layout["step_batch_size_schedule"] = schedule
        lrs = sorted({round(m["lr"], 12) for m in members})
        if len(lrs) > 1:
            notes.append(f"layout of phases {layout['phases']}: one Megatron-LM launch keeps "
                         f"one --lr ({first['lr']:.4g}); the {lr_rule} rule gives "
                         f"{', '.join(f'{x:.4g}' for x in lrs)} over its batches: launch its "
                         "phases one by one for the exact learning rates")
    return layouts, notes


def _trainer_refusal(model: ModelSpec, configs: list[ParallelConfig]) -> str | None:
    """Why paratune's trainer cannot run these phases in one launch (a layout it cannot run,
    or, between phases, one whose state the hand-over cannot reshard), or ``None``."""
    from paratune.profiler.reconfigure import _check_supported

    for i, config in enumerate(configs, 1):
        try:
            config.check_trainer(model)
            if len(configs) > 1:
                _check_supported(config)
        except ConfigError as exc:
            return f"phase {i}: {exc}"
    return None


def _checkpoint_format_notes(phases: list[dict[str, Any]]) -> list[str]:
    """Where a phase's Megatron-LM checkpoint format differs from the previous phase's."""
    notes = []
    for before, after in itertools.pairwise(phases):
        saved = _flag_value(before["megatron_args"], "--ckpt-format")
        loaded = _flag_value(after["megatron_args"], "--ckpt-format")
        if saved != loaded:
            notes.append(f"Megatron-LM: phase {before['phase']} saves {saved} checkpoints and "
                         f"phase {after['phase']} loads {loaded} ones, which Megatron-LM does "
                         "not convert between: convert the checkpoint, or keep both phases on "
                         "one format")
    return notes


def _trainer_command(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                     devices_per_node: int | None = None) -> str | None:
    """``torchrun ... -m paratune.profiler.train ... --plan launch.json``: paratune's own
    trainer running the whole plan in one launch (``None`` where it cannot build ``model``)."""
    try:
        command = torchrun_command(model, config, hardware, steps=1,
                                   devices_per_node=devices_per_node)
    except ConfigError:
        return None
    cut = command.find(" --steps ")
    if cut < 0:
        return None
    return command[:cut] + f" --plan launch.json --checkpoint-dir {CHECKPOINT_DIR}-trainer"


def _readme(launch: dict[str, Any]) -> str:
    lines = [f"Launch files of a {len(launch['phases'])}-phase plan for {launch['model']} on "
             f"{launch['hardware']} ({launch['seq_len']} tokens per sequence); learning rate "
             f"by the {launch['lr_rule']} rule, {launch['base_lr']:.4g} at batch "
             f"{launch['base_batch']:g}.", "",
             "Run the phases in order from one working directory; each resumes from the "
             "checkpoint the previous one wrote.", ""]
    for phase in launch["phases"]:
        cfg = phase["config"]
        lines.append(f"phase {phase['phase']:02d}: batch {phase['global_batch_size']}, "
                     f"dp{cfg['dp']}-tp{cfg['tp']}-pp{cfg['pp']}, lr {phase['lr']:.4g}, steps "
                     f"{phase['start_step'] + 1}-{phase['end_step']}, samples to "
                     f"{phase['end_samples']}"
                     + "".join(f"; Megatron-LM with {k}={v}"
                               for k, v in phase["megatron_env"].items()))
    lines += ["", "Each phase runs at its learning rate throughout (no warm-up, no decay): "
                  "add a warm-up to the first phase where the run starts from scratch, and a "
                  "decay to the last.", ""]
    for i, layout in enumerate(launch["layouts"], 1):
        where = ("start" if i == 1 else
                 f"reconfigure at {layout['start_tokens']:.6g} tokens")
        args = layout["megatron_args"]
        batch = (f"--step-batch-size-schedule \"{layout['step_batch_size_schedule']}\""
                 if "--step-batch-size-schedule" in args else
                 f"--global-batch-size {_flag_value(args, '--global-batch-size')}")
        lines.append(f"megatron_layout_{i:02d} ({where}): phases {layout['phases']}, {batch}"
                     + "".join(f", with {k}={v}" for k, v in layout["megatron_env"].items()))
    if launch.get("trainer_command"):
        lines += ["", "paratune's own trainer, the whole plan in one launch (run_plan.sh):",
                  launch["trainer_command"]]
    for note in launch["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


_PLAN_FILES = ("torchtitan.toml", "megatron_args.txt", "megatron_args.json")
"""The files :func:`write_plan_launch` writes into a phase's or a layout's folder."""


def write_plan_launch(plan: Plan, model: ModelSpec, hardware: HardwareSpec,
                      directory: str | Path, *, devices_per_node: int | None = None
                      ) -> dict[str, Path]:
    """Write :func:`plan_launch`'s files under ``directory`` (``devices_per_node`` as there).

    Returns:
        The written paths by name (``README``, ``launch.json``, ``phase_NN/...``,
        ``megatron_layout_NN/...``).

    Raises:
        ConfigError: the plan has no phase.
    """
    if not plan.phases:
        raise ConfigError("plan", 0, "has no phase to launch")
    launch = plan_launch(plan, model, hardware, devices_per_node=devices_per_node)
    directory = Path(directory)
    written: dict[str, Path] = {}
    # the files of an earlier, longer plan written here would be run as this one's: they
    # go (only those paratune writes; a folder is removed only where that leaves it empty)
    for stale in [*directory.glob("phase_[0-9][0-9]"),
                  *directory.glob("megatron_layout_[0-9][0-9]")]:
        index = int(stale.name[-2:])
        count = len(launch["phases"] if stale.name.startswith("phase") else launch["layouts"])
        if index > count and stale.is_dir():
            for name in _PLAN_FILES:
                (stale / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                stale.rmdir()
    if not launch.get("trainer_command"):
        (directory / "run_plan.sh").unlink(missing_ok=True)

    def put(name: str, text: str) -> None:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        written[name] = path

    for phase in launch["phases"]:
        base = f"phase_{phase['phase']:02d}"
        put(f"{base}/torchtitan.toml", phase["torchtitan_toml"])
        put(f"{base}/megatron_args.txt", shlex.join(phase["megatron_args"]) + "\n")
        put(f"{base}/megatron_args.json", json.dumps(phase["megatron_args"], indent=1) + "\n")
    for i, layout in enumerate(launch["layouts"], 1):
        base = f"megatron_layout_{i:02d}"
        put(f"{base}/megatron_args.txt", shlex.join(layout["megatron_args"]) + "\n")
        put(f"{base}/megatron_args.json", json.dumps(layout["megatron_args"], indent=1) + "\n")
    put("launch.json", json.dumps(launch, indent=2, default=_plain) + "\n")
    if launch.get("trainer_command"):
        put("run_plan.sh", "#!/bin/sh\n# every phase of the plan with paratune's trainer, run "
                           "from this directory\n" + launch["trainer_command"] + "\n")
    put("README", _readme(launch))
    return written


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return float(value)
