"""paratune's own trainer under ``torchrun``, and what every launch shares.

The rendezvous arguments and the node shape of a job (:func:`torchrun_prefix`), a command
line from its arguments, and the command that starts paratune's trainer on a recommended
config (:func:`torchrun_command`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig
from paratune.spec import MODEL_PRESETS, ModelSpec, get_model

__all__ = ["PROFILER_MODULE", "argument_lines", "launch_shape", "shell_line",
           "torchrun_command", "torchrun_prefix", "trainer_model_args"]

PROFILER_MODULE = "paratune.profiler.train"
"""Module torchrun starts for paratune's own workload (one training job, one config)."""


def launch_shape(world_size: int, devices_per_node: int) -> tuple[int, int]:
    """``(nodes, processes per node)`` of a job: as few nodes as hold it, the same number
    of processes on each (torchrun starts ``--nproc-per-node`` on every node)."""
    per_node = min(world_size, devices_per_node)
    nodes = -(-world_size // per_node)
    if world_size % nodes:
        raise ConfigError("devices_per_node", devices_per_node,
                          f"a job of {world_size} ranks needs {nodes} nodes, and torchrun "
                          f"starts the same number of processes on every node: "
                          f"{world_size} is not divisible by {nodes} (choose a world size "
                          f"that fills the nodes evenly)")
    return nodes, world_size // nodes


def torchrun_prefix(world_size: int, devices_per_node: int) -> list[str]:
    """``torchrun`` and its rendezvous arguments for a job of ``world_size`` ranks."""
    nodes, per_node = launch_shape(world_size, devices_per_node)
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    if nodes > 1:
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500",
                 "--rdzv-id=paratune"]
    else:
        args += ["--standalone"]
    return args


def shell_line(args: list[str]) -> str:
    """``args`` as one shell command line (``$MASTER_ADDR`` left to the shell)."""
    return " ".join(a if a.startswith(("--rdzv-endpoint", "$")) else shlex.quote(a)
                    for a in args)


def argument_lines(args: list[str]) -> list[str]:
    """``args`` shell-quoted, one flag and its values to a line."""
    lines: list[str] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append(shlex.quote(arg))
        else:
            lines[-1] += " " + shlex.quote(arg)
    return lines



def trainer_model_args(model: ModelSpec) -> list[str]:
    """``--model`` and ``--seq-len`` with which paratune's trainer builds ``model``.

    ``--model`` is the Hugging Face ``config.json`` the spec was read from (as an absolute
    path), else the preset's name; ``--seq-len`` is the spec's sequence length, which a
    preset or a ``config.json`` does not carry (a preset has its own, a ``config.json`` its
    ``max_position_embeddings``). The pair is checked by resolving it as the trainer does.

    Raises:
        ConfigError: ``model``: neither a preset nor read from a ``config.json``, or of
            another shape than the one the pair resolves to (changed since it was read, or
            its ``config.json`` changed), so no ``--model`` of the trainer names it;
            ``model`` or ``path``: its ``config.json`` is gone or no longer reads.
    """
    source = model.extra.get("hf_config")
    if source is not None:
        source = str(Path(source).resolve())
    elif model.name.lower() in MODEL_PRESETS:
        source = model.name
    else:
        raise ConfigError("model", model.name, "is neither a preset nor read from a "
                          "config.json, so paratune's trainer (--model) cannot build it")
    resolved = get_model(source, seq_len=model.seq_len)
    if resolved.replace(name=model.name) != model:  # the name is a label only
        raise ConfigError("model", model.name, f"differs in shape from what --model {source} "
                          f"builds, so paratune's trainer (--model) cannot build it")
    return ["--model", source, "--seq-len", str(model.seq_len)]


def torchrun_command(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                     devices_per_node: int | None = None, steps: int = 20,
                     module: str = PROFILER_MODULE) -> str:
    """A ``torchrun`` command that trains ``model`` under ``config`` with paratune's workload.

    The job takes as few nodes as hold it, with the same number of processes on each (12
    ranks on nodes of 8 devices: 2 nodes of 6). Multi-node jobs need ``MASTER_ADDR`` set and
    the command run on every node (``NODE_RANK`` is read by torchrun's c10d rendezvous).

    The trainer builds the model from ``--model`` and ``--seq-len`` (see
    :func:`trainer_model_args`).

    Raises:
        ConfigError: ``devices_per_node``: the ranks cannot be spread evenly over the fewest
            nodes that hold them (e.g. 5 ranks on nodes of 4); ``model`` or ``path``: the
            trainer cannot build the model (see :func:`trainer_model_args`).
    """
    model_args = trainer_model_args(model)
    args = torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    args += ["-m", module, *model_args,
             "--hardware", hardware.name, "--steps", str(steps),
             "--config", json.dumps(config.to_dict(), sort_keys=True)]
    return shell_line(args)
