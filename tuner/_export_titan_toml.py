"""torchtitan v0.2.x (up to v0.2.2, the last releases that read TOML job files): a TOML job
config with ``[model]``, ``[parallelism]``, ``[training]`` and ``[activation_checkpoint]``."""

from __future__ import annotations

import json
import textwrap

from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig, Recompute, Schedule, stage_layer_counts
from paratune.spec import ModelSpec
from paratune.tuner._export_titan import (
    TITAN_SCHEDULES,
    stage_fqns,
    titan_data_parallel,
    titan_flavor,
    titan_local_batch,
    torchtitan_notes,
)

__all__ = ["TORCHTITAN_TOML_HEADER", "torchtitan_toml"]

TORCHTITAN_TOML_HEADER = (
    "torchtitan job config (TOML, read with --job.config_file) for torchtitan v0.2.x up to "
    "v0.2.2. Later torchtitan (0.3 and on, after its config refactor) reads no TOML: "
    "torchtitan.sh beside this file launches the same job on 0.3 with --module/--config and "
    "command-line overrides such as --parallelism.tensor_parallel_degree 2."
)
"""First comment of the exported TOML: the torchtitan versions it is for."""



def torchtitan_toml(model: ModelSpec, config: ParallelConfig,
                    hardware: HardwareSpec | None = None) -> str:
    """A torchtitan v0.2.x job config (TOML) that trains ``model`` under ``config``.

    ``[model]`` names the llama3 flavor of the model's shape (8B, 70B, 405B; for other shapes
    a comment gives the ``TransformerModelArgs`` to register). torchtitan takes
    ``global_batch_size // (local_batch_size * dp)`` gradient-accumulation steps of
    ``local_batch_size`` sequences per data-parallel rank, and a pipeline splits each into
    ``local_batch_size // pipeline_parallel_microbatch_size`` micro-batches. So without
    pipelining ``local_batch_size`` is the micro-batch and accumulation runs the
    micro-batches; with pipelining ``local_batch_size`` is the rank's whole batch and the
    schedule runs them (one accumulation step).

    The text is a job config for torchtitan v0.2.x up to v0.2.2 (its first comment says so,
    see :data:`TORCHTITAN_TOML_HEADER`). Comments after it name each setting that differs
    from the layout measured (:func:`torchtitan_notes`): FSDP2 without resharding for ZeRO-1
    and for plain data parallelism combined with tensor or pipeline parallelism (torchtitan's
    DDP runs only on its own), per-op selective recompute for paratune's attention-only one,
    sequence parallelism with tensor parallelism, fp32 with one data-parallel rank.

    Args:
        model: The model trained.
        config: The parallel config.
        hardware: The devices (unused by torchtitan's TOML; taken for a uniform signature).

    Returns:
        The TOML text.
    """
    del hardware
    replicate, shard, reshard, _ = titan_data_parallel(config)
    flavor = titan_flavor(model, version="0.2")
    lines = ["[model]", 'name = "llama3"', f'flavor = "{flavor or "custom"}"', "",
             "[parallelism]",
             f"data_parallel_replicate_degree = {replicate}",
             f"data_parallel_shard_degree = {shard}"]
    if reshard is not None:
        lines.append(f'fsdp_reshard_after_forward = "{reshard}"')
    lines.append(f"tensor_parallel_degree = {config.tp}")
    lines.append(f"pipeline_parallel_degree = {config.pp}")
    if config.cp > 1:
        lines.append(f"context_parallel_degree = {config.cp}")
    if config.pp > 1:
        lines.append(f'pipeline_parallel_schedule = "{TITAN_SCHEDULES[config.schedule]}"')
        lines.append(f"pipeline_parallel_microbatch_size = {config.micro_batch_size}")
        counts = stage_layer_counts(model.num_layers, config.num_stages)
        if len(set(counts)) > 1:
            # uneven: name each stage's modules (torchtitan's own split would weigh the
            # embedding and the output as layers and differ from the one measured)
            lines.append("module_fqns_per_model_part = [")
            lines += [f"  {json.dumps(stage)}," for stage in stage_fqns(counts)]
            lines.append("]")
        else:
            # torchtitan's own split counts the embedding and the output as a layer each
            # unless told otherwise; without them it splits as measured
            lines.append("pipeline_parallel_first_stage_less_layers = 0")
            lines.append("pipeline_parallel_last_stage_less_layers = 0")
            if config.schedule is Schedule.INTERLEAVED_1F1B:
                lines.append(f"pipeline_parallel_layers_per_stage = {counts[0]}")
    lines += ["", "[training]",
              f"local_batch_size = {titan_local_batch(config)}",
              f"global_batch_size = {config.global_batch_size}",
              f"seq_len = {model.seq_len}",
              'mixed_precision_param = "bfloat16"', "",
              "[activation_checkpoint]", f'mode = "{config.recompute.value}"']
    if config.recompute is Recompute.SELECTIVE:
        lines.append('selective_ac_option = "op"')
    notes = [TORCHTITAN_TOML_HEADER, *torchtitan_notes(model, config, version="0.2")]
    comments = [line for note in notes for line in _toml_comment(note)]
    return "\n".join(comments + lines) + "\n"


def _toml_comment(text: str) -> list[str]:
    """``text`` as TOML comment lines of at most 100 characters."""
    return ["# " + line for line in textwrap.wrap(text, width=98, break_long_words=False,
                                                  break_on_hyphens=False)]
