"""Turning a recommended config into something a trainer runs.

* a ``torchrun`` command for paratune's own workload,
* a torchtitan TOML fragment (``[parallelism]``, ``[training]``, ``[activation_checkpoint]``),
* Megatron-LM arguments.

Where a framework cannot express an option exactly, the closest setting is emitted with a
comment saying so (torchtitan has no ZeRO-1; Megatron-LM has no GPipe schedule).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from paratune._io import atomic_write_text
from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding
from paratune.spec import ModelSpec

__all__ = ["megatron_args", "recommendation", "torchrun_command", "torchtitan_toml",
           "write_recommendation"]

PROFILER_MODULE = "paratune.profiler.train"
"""Module torchrun starts for paratune's own workload (one training job, one config)."""

_TITAN_SCHEDULES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B",
                    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B"}


def torchrun_command(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                     devices_per_node: int | None = None, steps: int = 20,
                     module: str = PROFILER_MODULE) -> str:
    """A ``torchrun`` command that trains ``model`` under ``config`` with paratune's workload.

    Multi-node jobs need ``MASTER_ADDR`` set and the command run on every node (``NODE_RANK``
    is read by torchrun's c10d rendezvous).
    """
    per_node = min(config.world_size, devices_per_node or hardware.devices_per_node)
    nodes = -(-config.world_size // per_node)
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    if nodes > 1:
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500",
                 "--rdzv-id=paratune"]
    else:
        args += ["--standalone"]
    args += ["-m", module, "--model", model.name if model.name != "custom" else "custom",
             "--hardware", hardware.name, "--steps", str(steps),
             "--config", json.dumps(config.to_dict(), sort_keys=True)]
    return " ".join(a if a.startswith(("--rdzv-endpoint", "$")) else shlex.quote(a)
                    for a in args)


def torchtitan_toml(model: ModelSpec, config: ParallelConfig) -> str:
    """``[parallelism]``, ``[training]`` and ``[activation_checkpoint]`` TOML sections."""
    lines = ["[parallelism]"]
    notes = []
    if config.sharding is Sharding.NONE:
        replicate, shard = config.dp, 1
    else:
        replicate, shard = 1, config.dp
    lines.append(f"data_parallel_replicate_degree = {replicate}")
    lines.append(f"data_parallel_shard_degree = {shard}")
    if config.sharding is not Sharding.NONE:
        reshard = "always" if config.sharding is Sharding.ZERO3 else "never"
        lines.append(f'fsdp_reshard_after_forward = "{reshard}"')
        if config.sharding is Sharding.ZERO1:
            notes.append("# torchtitan has no ZeRO-1; FSDP2 without resharding (ZeRO-2) is "
                         "the closest")
    lines.append(f"tensor_parallel_degree = {config.tp}")
    lines.append(f"pipeline_parallel_degree = {config.pp}")
    if config.pp > 1:
        lines.append(f'pipeline_parallel_schedule = "{_TITAN_SCHEDULES[config.schedule]}"')
        lines.append(f"pipeline_parallel_microbatch_size = {config.micro_batch_size}")
        if config.schedule is Schedule.INTERLEAVED_1F1B:
            per_stage = max(1, model.num_layers // config.num_stages)
            lines.append(f"pipeline_parallel_layers_per_stage = {per_stage}")
    lines += ["", "[training]",
              f"local_batch_size = {config.local_batch_size}",
              f"global_batch_size = {config.global_batch_size}",
              f"seq_len = {model.seq_len}", "",
              "[activation_checkpoint]", f'mode = "{config.recompute.value}"']
    if config.recompute is Recompute.SELECTIVE:
        lines.append('selective_ac_option = "op"')
    return "\n".join(notes + lines) + "\n"


def megatron_args(model: ModelSpec, config: ParallelConfig) -> list[str]:
    """Megatron-LM command-line arguments for ``config``."""
    args = [f"--tensor-model-parallel-size {config.tp}",
            f"--pipeline-model-parallel-size {config.pp}",
            f"--micro-batch-size {config.micro_batch_size}",
            f"--global-batch-size {config.global_batch_size}",
            f"--seq-length {model.seq_len}"]
    if config.schedule is Schedule.INTERLEAVED_1F1B:
        per_stage = max(1, model.num_layers // config.num_stages)
        args.append(f"--num-layers-per-virtual-pipeline-stage {per_stage}")
    if config.sharding is Sharding.ZERO1:
        args.append("--use-distributed-optimizer")
    elif config.sharding is Sharding.ZERO2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads"]
    elif config.sharding is Sharding.ZERO3:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"]
    if config.recompute is Recompute.FULL:
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    elif config.recompute is Recompute.SELECTIVE:
        args.append("--recompute-granularity selective")
    return args


def recommendation(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                   devices_per_node: int | None = None,
                   predicted: dict[str, Any] | None = None,
                   objective: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything about the winner as one JSON-able mapping."""
    megatron = megatron_args(model, config)
    notes = []
    if config.pp > 1 and config.schedule is Schedule.GPIPE:
        notes.append("Megatron-LM has no GPipe schedule; it runs 1F1B (same bubble, less "
                     "activation memory).")
    return {
        "model": model.to_dict(), "hardware": hardware.name, "world_size": config.world_size,
        "devices_per_node": devices_per_node or hardware.devices_per_node,
        "config": config.to_dict(), "config_key": config.key(),
        "num_microbatches": config.num_microbatches,
        "predicted": predicted or {}, "objective": objective or {},
        "launch": {
            "torchrun": torchrun_command(model, config, hardware,
                                         devices_per_node=devices_per_node),
            "torchtitan_toml": torchtitan_toml(model, config),
            "megatron_args": megatron,
            "notes": notes,
        },
    }


def write_recommendation(rec: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """Write ``recommendation.json``/``.yaml``, ``torchrun.sh``, ``torchtitan.toml`` and
    ``megatron_args.txt`` into ``directory`` (atomically); returns the paths by kind."""
    import yaml

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    launch = rec["launch"]
    paths = {
        "json": directory / "recommendation.json", "yaml": directory / "recommendation.yaml",
        "torchrun": directory / "torchrun.sh", "torchtitan": directory / "torchtitan.toml",
        "megatron": directory / "megatron_args.txt",
    }
    atomic_write_text(paths["json"], json.dumps(rec, indent=2, sort_keys=True, default=float))
    atomic_write_text(paths["yaml"], yaml.safe_dump(json.loads(json.dumps(rec, default=float)),
                                                    sort_keys=False))
    atomic_write_text(paths["torchrun"], "#!/bin/sh\n" + launch["torchrun"] + "\n")
    atomic_write_text(paths["torchtitan"], launch["torchtitan_toml"])
    atomic_write_text(paths["megatron"], " \\\n  ".join(launch["megatron_args"]) + "\n")
    return paths
