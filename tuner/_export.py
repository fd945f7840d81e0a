"""Turning a recommended config into something a trainer runs.

* a ``torchrun`` command for paratune's own workload,
* torchtitan 0.3 (the current release): its config is a registered Python function
  (``--module llama3 --config llama3_70b``) with command-line overrides such as
  ``--parallelism.tensor_parallel_degree 2``; where no registered config has the model's
  shape, a small Python config module is written beside it and named by ``--module``,
* a torchtitan TOML job config (``[model]``, ``[parallelism]``, ``[training]``,
  ``[activation_checkpoint]``) for torchtitan v0.2.x up to v0.2.2, the last releases that read
  TOML job files,
* Megatron-LM arguments (the model's shape, its parallelism, batch and recompute) as a list,
  with the environment they need (``CUDA_DEVICE_MAX_CONNECTIONS``).

Each target has one public function taking the model, the parallel config, the hardware and
keyword options, returning text or an argument list, so that one config or each phase of a
plan is exported the same way. Where a framework cannot express an option exactly, the
closest working setting is emitted with a note saying so: a comment in the TOML, an entry of
``launch.notes``. Pipeline stages hold the layers as paratune's workload splits them (the
split its predictions were measured on): an even split as a layer count per stage, an uneven
one spelled out stage by stage.

Each target has its module: :mod:`~paratune.tuner._export_torchrun` (paratune's trainer and
the launch shape every target shares), :mod:`~paratune.tuner._export_titan` (torchtitan
0.3), :mod:`~paratune.tuner._export_titan_toml` (torchtitan v0.2.x) and
:mod:`~paratune.tuner._export_megatron` (Megatron-LM); this one gathers them into the
recommendation and its launch files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text
from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec
from paratune.tuner._export_megatron import (
    MEGATRON_ENTRY,
    MEGATRON_SELECTIVE_MODULES,
    megatron_args,
    megatron_command,
    megatron_env,
    megatron_notes,
)
from paratune.tuner._export_titan import (
    TORCHTITAN_CONFIG_MODULE,
    torchtitan_args,
    torchtitan_command,
    torchtitan_config_module,
    torchtitan_notes,
)
from paratune.tuner._export_titan_toml import TORCHTITAN_TOML_HEADER, torchtitan_toml
from paratune.tuner._export_torchrun import (
    PROFILER_MODULE,
    argument_lines,
    launch_shape,
    torchrun_command,
    trainer_model_args,
)

__all__ = ["MEGATRON_ENTRY", "MEGATRON_SELECTIVE_MODULES", "PROFILER_MODULE",
           "TORCHTITAN_CONFIG_MODULE", "TORCHTITAN_TOML_HEADER", "infeasible_reason",
           "megatron_args", "megatron_command", "megatron_env", "megatron_notes",
           "recommendation", "torchrun_command", "torchtitan_args", "torchtitan_command",
           "torchtitan_config_module", "torchtitan_notes", "torchtitan_toml",
           "trainer_model_args", "write_recommendation"]


def infeasible_reason(predicted: dict[str, Any] | None) -> str | None:
    """Why a winner with these predictions is not to be launched as if it ran, or None.

    A winner is infeasible when its prediction says so (``feasible`` false: over the memory
    limit, under the minimum probability of running, or no throughput predicted).
    """
    if not predicted or predicted.get("feasible") is not False:
        return None
    parts = []
    if predicted.get("peak_mem_gb") is not None:
        parts.append(f"{predicted['peak_mem_gb']:,.0f} GB per GPU predicted")
    if predicted.get("feasible_prob") is not None:
        parts.append(f"p(run) {predicted['feasible_prob']:.4f}")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"the winner is predicted not to run{detail}"


def recommendation(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                   devices_per_node: int | None = None,
                   predicted: dict[str, Any] | None = None,
                   objective: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything about the winner as one JSON-able mapping.

    ``launch`` holds each target's export: ``torchrun`` (paratune's trainer),
    ``torchtitan`` (a torchtitan 0.3 command), ``torchtitan_args`` (its arguments),
    ``torchtitan_config_module`` (the Python config it names, or None),
    ``torchtitan_toml`` (torchtitan v0.2.x), ``megatron`` (a command),
    ``megatron_args`` (a list of arguments), ``megatron_env``, ``notes``, and
    ``infeasible``: why the winner is predicted not to run, or None (see
    :func:`infeasible_reason`; :func:`write_recommendation` then writes no launch files
    unless asked to).

    Where the job cannot be launched by one ``torchrun`` command (see
    :func:`torchrun_command`) or paratune's trainer cannot run the layout (see
    :meth:`paratune.ParallelConfig.check_trainer`; Megatron-LM and torchtitan can),
    ``launch.torchrun`` is ``None`` and a note says why.
    """
    per_node = devices_per_node or hardware.devices_per_node
    notes = megatron_notes(model, config, hardware)
    notes += [f"torchtitan: {note}" for note in torchtitan_notes(model, config)]
    if config.pp > 1 and model.num_layers % config.num_stages:
        notes.append(f"{model.num_layers} layers do not divide evenly over "
                     f"{config.num_stages} pipeline stages; the exports name each stage's "
                     f"layers as measured (torchtitan module_fqns_per_model_part, Megatron-LM "
                     f"--pipeline-model-parallel-layout).")
    try:
        config.check_trainer(model)  # the torchrun command launches paratune's trainer
        torchrun: str | None = torchrun_command(model, config, hardware,
                                                devices_per_node=devices_per_node)
    except ConfigError as exc:
        torchrun = None
        notes.append(f"no torchrun command: {exc}")
    else:
        launched = launch_shape(config.world_size, per_node)[1]
        if launched < per_node and launched % config.tp:
            # the prediction placed ranks per_node to a node; this launch does not
            notes.append(f"torchrun places {launched} ranks on each node, so some "
                         f"tensor-parallel groups of {config.tp} span two nodes, which the "
                         f"prediction (ranks {per_node} to a node) did not assume.")
    try:
        titan: str | None = torchtitan_command(model, config, hardware,
                                               devices_per_node=devices_per_node)
        megatron: str | None = megatron_command(model, config, hardware,
                                                devices_per_node=devices_per_node)
    except ConfigError as exc:  # the ranks do not spread evenly over the nodes
        titan = megatron = None
        notes.append(f"no torchrun command for torchtitan or Megatron-LM: {exc}")
    return {
        "model": model.to_dict(), "hardware": hardware.name, "world_size": config.world_size,
        "devices_per_node": per_node,
        "config": config.to_dict(), "config_key": config.key(),
        "num_microbatches": config.num_microbatches,
        "predicted": predicted or {}, "objective": objective or {},
        "launch": {
            "infeasible": infeasible_reason(predicted),
            "torchrun": torchrun,
            "torchtitan": titan,
            "torchtitan_args": torchtitan_args(model, config, hardware),
            "torchtitan_config_module": torchtitan_config_module(model),
            "torchtitan_toml": torchtitan_toml(model, config, hardware),
            "megatron": megatron,
            "megatron_args": megatron_args(model, config, hardware),
            "megatron_env": megatron_env(config, hardware),
            "notes": notes,
        },
    }


_LAUNCH_FILES = {"torchrun": "torchrun.sh", "torchtitan_sh": "torchtitan.sh",
                 "torchtitan_config": f"{TORCHTITAN_CONFIG_MODULE}.py",
                 "torchtitan": "torchtitan.toml", "megatron_sh": "megatron.sh",
                 "megatron": "megatron_args.txt"}
"""Launch files by the kind :func:`write_recommendation` returns their paths under."""


def _titan_with_overrides(launch: dict[str, Any]) -> str:
    """The torchtitan 0.3 command with the script's own arguments (``"$@"``) before its last
    one, the activation-checkpointing subcommand (``activation-checkpoint:none``): the
    parser takes what follows a subcommand as that subcommand's, and refuses the rest."""
    command, policy = launch["torchtitan"], launch["torchtitan_args"][-1]
    if policy.startswith("activation-checkpoint:") and command.endswith(f" {policy}"):
        return f'{command[:-len(policy)]}"$@" {policy}'
    return f'{command} "$@"'


def write_recommendation(rec: dict[str, Any], directory: str | Path, *,
                         allow_infeasible: bool = False) -> dict[str, Path]:
    """Write ``recommendation.json``/``.yaml`` and the launch files into ``directory``
    (atomically); returns the paths by kind (:data:`_LAUNCH_FILES`).

    Launch files: ``torchrun.sh`` (paratune's trainer; none where the recommendation has
    no torchrun command), ``torchtitan.sh`` (torchtitan 0.3) with ``torchtitan_config.py``
    where it names one, ``torchtitan.toml`` (torchtitan v0.2.x), ``megatron.sh`` and
    ``megatron_args.txt`` (Megatron-LM). A winner predicted not to run
    (``launch.infeasible``) gets only the two records, and launch files left from an earlier
    winner are removed, unless ``allow_infeasible``: then every launch file opens with a
    line saying it is predicted not to run, and why.
    """
    import yaml

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    launch = rec["launch"]
    paths = {"json": directory / "recommendation.json",
             "yaml": directory / "recommendation.yaml"}
    atomic_write_text(paths["json"], json.dumps(rec, indent=2, sort_keys=True, default=float))
    atomic_write_text(paths["yaml"], yaml.safe_dump(json.loads(json.dumps(rec, default=float)),
                                                    sort_keys=False))
    infeasible = launch.get("infeasible")
    texts: dict[str, str | None] = {kind: None for kind in _LAUNCH_FILES}
    if not infeasible or allow_infeasible:
        header = (f"# PREDICTED NOT TO RUN: {infeasible}; exported as asked, not as a "
                  f"tested launch\n" if infeasible else "")
        if launch.get("torchrun"):
            texts["torchrun"] = "#!/bin/sh\n" + header + launch["torchrun"] + "\n"
        if launch.get("torchtitan"):
            path_line = ('export PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}"\n'
                         if launch.get("torchtitan_config_module") else "")
            texts["torchtitan_sh"] = ("#!/bin/sh\n# torchtitan 0.3\n" + header + path_line
                                   + _titan_with_overrides(launch) + "\n")
        if launch.get("torchtitan_config_module"):
            texts["torchtitan_config"] = header + launch["torchtitan_config_module"]
        texts["torchtitan"] = header + launch["torchtitan_toml"]
        if launch.get("megatron"):
            texts["megatron_sh"] = ("#!/bin/sh\n# Megatron-LM, from the root of its repository\n"
                                 + header + launch["megatron"] + ' "$@"\n')
        texts["megatron"] = header + " \\\n  ".join(
            argument_lines(launch["megatron_args"])) + "\n"
    for kind, name in _LAUNCH_FILES.items():
        path = directory / name
        if texts[kind] is None:  # and none left from an earlier winner in the same directory
            path.unlink(missing_ok=True)
        else:
            atomic_write_text(path, texts[kind])
            paths[kind] = path
    return paths
