"""Turning a recommended config into something a trainer runs.

* a ``torchrun`` command for paratune's own workload,
* a torchtitan TOML job config (``[parallelism]``, ``[training]``, ``[activation_checkpoint]``)
  for torchtitan v0.2.x up to v0.2.2, the last releases that read TOML job files (later
  torchtitan builds its config from registered Python dataclasses and takes settings as
  command-line overrides such as ``--parallelism.tensor_parallel_degree 2``),
* Megatron-LM arguments.

Where a framework cannot express an option exactly, the closest working setting is emitted
with a note saying so: a comment in the TOML (torchtitan has no ZeRO-1, no DDP combined with
tensor or pipeline parallelism, no attention-only recompute), an entry of
``launch.notes`` for Megatron-LM (no GPipe schedule; its selective recompute leaves out the
attention projections). Pipeline stages hold the layers as paratune's workload splits them
(the split its predictions were measured on): an even split as a layer count per stage, an
uneven one spelled out stage by stage.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path
from typing import Any

from paratune._io import atomic_write_text
from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding
from paratune.spec import MODEL_PRESETS, ModelSpec, get_model

__all__ = ["megatron_args", "recommendation", "torchrun_command", "torchtitan_toml",
           "trainer_model_args", "write_recommendation"]

PROFILER_MODULE = "paratune.profiler.train"
"""Module torchrun starts for paratune's own workload (one training job, one config)."""

TORCHTITAN_TOML_HEADER = (
    "torchtitan job config (TOML, read with --job.config_file) for torchtitan v0.2.x up to "
    "v0.2.2. Later torchtitan (after its config refactor, pytorch/torchtitan#2386) reads no "
    "TOML: pass these settings as command-line overrides of a registered config, e.g. "
    "--parallelism.tensor_parallel_degree 2 for [parallelism] tensor_parallel_degree = 2 "
    "(some names have changed since; check that version's config)."
)
"""First comment of the exported TOML: the torchtitan versions it is for."""

MEGATRON_SELECTIVE_MODULES = ("core_attn", "layernorm")
"""``--recompute-modules`` for paratune's selective recompute: the closest Megatron-LM choices
(its choices: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)."""

_TITAN_SCHEDULES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B",
                    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B"}


def _stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Transformer layers of each pipeline stage, in stage order.

    The split of paratune's workload (``paratune.profiler.pipeline.layer_ranges``), which
    is what the predictions were measured on: as even as possible, the earlier stages
    taking one layer more where ``num_stages`` does not divide ``num_layers``.

    Raises:
        ConfigError: fewer layers than stages.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError("pp", num_stages, f"{num_stages} pipeline stages need at least as "
                          f"many layers (num_layers={num_layers})")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def _launch_shape(world_size: int, devices_per_node: int) -> tuple[int, int]:
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
    nodes, per_node = _launch_shape(config.world_size,
                                    devices_per_node or hardware.devices_per_node)
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    if nodes > 1:
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500",
                 "--rdzv-id=paratune"]
    else:
        args += ["--standalone"]
    args += ["-m", module, *model_args,
             "--hardware", hardware.name, "--steps", str(steps),
             "--config", json.dumps(config.to_dict(), sort_keys=True)]
    return " ".join(a if a.startswith(("--rdzv-endpoint", "$")) else shlex.quote(a)
                    for a in args)


def torchtitan_toml(model: ModelSpec, config: ParallelConfig) -> str:
    """``[parallelism]``, ``[training]`` and ``[activation_checkpoint]`` TOML sections.

    torchtitan takes ``global_batch_size // (local_batch_size * dp)`` gradient-accumulation
    steps of ``local_batch_size`` sequences per data-parallel rank, and a pipeline splits
    each into ``local_batch_size // pipeline_parallel_microbatch_size`` micro-batches. So
    without pipelining ``local_batch_size`` is the micro-batch and accumulation runs the
    micro-batches; with pipelining ``local_batch_size`` is the rank's whole batch and the
    schedule runs them (one accumulation step).

    The text is a job config for torchtitan v0.2.x up to v0.2.2 (its first comment says so,
    see :data:`TORCHTITAN_TOML_HEADER`). Comments after it name each setting that differs
    from the layout measured: FSDP2 without resharding for ZeRO-1, and for plain data
    parallelism combined with tensor or pipeline parallelism (torchtitan's DDP runs only on
    its own); per-op selective recompute for paratune's attention-only one.

    Args:
        model: The model trained.
        config: The parallel config.

    Returns:
        The TOML text.
    """
    lines = ["[parallelism]"]
    notes = [TORCHTITAN_TOML_HEADER]
    reshard = None  # FSDP2's reshard_after_forward; None: no sharding (DDP or no dp)
    if config.dp_enabled:
        if config.sharding is Sharding.ZERO3:
            reshard = "always"
        elif config.sharding is not Sharding.NONE:
            reshard = "never"
            if config.sharding is Sharding.ZERO1:
                notes.append("torchtitan has no ZeRO-1; FSDP2 without resharding (ZeRO-2) is "
                             "the closest")
        elif config.tp_enabled or config.pp_enabled:
            # torchtitan's llama3 parallelize raises "DDP has not supported > 1D parallelism"
            # when data_parallel_replicate_degree is combined with tp or pp
            reshard = "never"
            notes.append(f"torchtitan's DDP (data_parallel_replicate_degree) cannot be combined "
                         f"with tensor or pipeline parallelism (tp={config.tp}, pp={config.pp});"
                         f" FSDP2 without resharding (ZeRO-2: gradients and optimizer state "
                         f"sharded over dp={config.dp}) is the closest to the plain data "
                         f"parallelism measured (less memory, a reduce-scatter and an "
                         f"all-gather in place of the all-reduce)")
    replicate, shard = (config.dp, 1) if reshard is None else (1, config.dp)
    lines.append(f"data_parallel_replicate_degree = {replicate}")
    lines.append(f"data_parallel_shard_degree = {shard}")
    if reshard is not None:
        lines.append(f'fsdp_reshard_after_forward = "{reshard}"')
    lines.append(f"tensor_parallel_degree = {config.tp}")
    lines.append(f"pipeline_parallel_degree = {config.pp}")
    if config.pp > 1:
        lines.append(f'pipeline_parallel_schedule = "{_TITAN_SCHEDULES[config.schedule]}"')
        lines.append(f"pipeline_parallel_microbatch_size = {config.micro_batch_size}")
        counts = _stage_layer_counts(model.num_layers, config.num_stages)
        if len(set(counts)) > 1:
            # uneven: name each stage's modules (torchtitan's own split would weigh the
            # embedding and the output as layers and differ from the one measured)
            notes.append(f"{model.num_layers} layers over {config.num_stages} pipeline "
                         f"stages: the earlier stages take one layer more, as measured")
            lines.append("module_fqns_per_model_part = [")
            lines += [f"  {json.dumps(stage)}," for stage in _stage_fqns(counts)]
            lines.append("]")
        else:
            # torchtitan's own split counts the embedding and the output as a layer each
            # unless told otherwise; without them it splits as measured
            lines.append("pipeline_parallel_first_stage_less_layers = 0")
            lines.append("pipeline_parallel_last_stage_less_layers = 0")
            if config.schedule is Schedule.INTERLEAVED_1F1B:
                lines.append(f"pipeline_parallel_layers_per_stage = {counts[0]}")
    # torchtitan runs global_batch_size // (local_batch_size * dp) gradient-accumulation
    # steps of local_batch_size sequences; with pp > 1 the pipeline schedule splits each of
    # them into micro-batches of pipeline_parallel_microbatch_size.
    local_batch_size = config.micro_batch_size if config.pp == 1 else config.local_batch_size
    lines += ["", "[training]",
              f"local_batch_size = {local_batch_size}",
              f"global_batch_size = {config.global_batch_size}",
              f"seq_len = {model.seq_len}", "",
              "[activation_checkpoint]", f'mode = "{config.recompute.value}"']
    if config.recompute is Recompute.SELECTIVE:
        lines.append('selective_ac_option = "op"')
        notes.append("selective recompute: paratune recomputes the attention half of each "
                     "block (norm, QKV, rotary, attention, output projection) and keeps the "
                     "MLP's activations; torchtitan has no attention-only option. Its per-op "
                     "selective AC (selective_ac_option = \"op\", the closest) saves the "
                     "attention (SDPA) outputs and matmul results and recomputes the other ops, "
                     "nearly the opposite: activation memory and step time will differ from "
                     "what was measured and predicted")
    comments = [line for note in notes for line in _toml_comment(note)]
    return "\n".join(comments + lines) + "\n"


def _toml_comment(text: str) -> list[str]:
    """``text`` as TOML comment lines of at most 100 characters."""
    return ["# " + line for line in textwrap.wrap(text, width=98, break_long_words=False,
                                                  break_on_hyphens=False)]


def megatron_args(model: ModelSpec, config: ParallelConfig) -> list[str]:
    """Megatron-LM command-line arguments for ``config``.

    ZeRO-1 is the distributed optimizer; ZeRO-2 and ZeRO-3 are Megatron-FSDP with the flags
    it requires (``fsdp_dtensor`` checkpoints, no gradient-accumulation fusion). With one
    data-parallel rank no sharding flag is given (there is nothing to shard). Selective
    recompute names the closest ``--recompute-modules`` (:data:`MEGATRON_SELECTIVE_MODULES`);
    :func:`recommendation` notes where these differ from the layout measured.
    """
    args = [f"--tensor-model-parallel-size {config.tp}",
            f"--pipeline-model-parallel-size {config.pp}",
            f"--micro-batch-size {config.micro_batch_size}",
            f"--global-batch-size {config.global_batch_size}",
            f"--seq-length {model.seq_len}"]
    counts = _stage_layer_counts(model.num_layers, config.num_stages) if config.pp > 1 else []
    if len(set(counts)) > 1:
        # uneven: Megatron-LM splits the layers evenly unless a layout names every
        # (virtual) stage, in the order stage = virtual index * pp + pipeline rank
        args.append("--pipeline-model-parallel-layout " + shlex.quote(_megatron_layout(counts)))
    elif config.schedule is Schedule.INTERLEAVED_1F1B and counts:
        args.append(f"--num-layers-per-virtual-pipeline-stage {counts[0]}")
    if config.dp_enabled:  # one data-parallel rank has nothing to shard
        if config.sharding is Sharding.ZERO1:
            args.append("--use-distributed-optimizer")
        elif config.sharding in (Sharding.ZERO2, Sharding.ZERO3):
            strategy = ("optim_grads" if config.sharding is Sharding.ZERO2
                        else "optim_grads_params")
            # Megatron-FSDP's required flags: validate_args asserts the fsdp_dtensor
            # checkpoint format (the default, torch_dist, fails at launch)
            args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}",
                     "--no-gradient-accumulation-fusion", "--use-distributed-optimizer",
                     "--ckpt-format fsdp_dtensor"]
    if config.recompute is Recompute.FULL:
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    elif config.recompute is Recompute.SELECTIVE:
        args += ["--recompute-granularity selective",
                 "--recompute-modules " + " ".join(MEGATRON_SELECTIVE_MODULES)]
    return args


def _megatron_notes(config: ParallelConfig) -> list[str]:
    """Where the Megatron-LM arguments of ``config`` differ from the layout measured, or
    need something outside the arguments."""
    notes = []
    if config.pp_enabled and config.schedule is Schedule.GPIPE:
        notes.append("Megatron-LM has no GPipe schedule; it runs 1F1B (same bubble, less "
                     "activation memory).")
    if config.dp_enabled and config.sharding in (Sharding.ZERO2, Sharding.ZERO3):
        notes.append("Megatron-FSDP (--use-megatron-fsdp) needs CUDA_DEVICE_MAX_CONNECTIONS "
                     "unset or above 1, and saves and loads checkpoints only as fsdp_dtensor.")
        if config.pp_enabled:
            notes.append(f"Megatron-FSDP documents support for tensor, context and expert "
                         f"parallelism, not pipeline parallelism (pp={config.pp}); should it "
                         f"fail, its flags can be replaced by --use-distributed-optimizer "
                         f"alone (ZeRO-1: more memory than measured).")
    if config.recompute is Recompute.SELECTIVE:
        notes.append("Megatron-LM's selective recompute (--recompute-modules "
                     + " ".join(MEGATRON_SELECTIVE_MODULES) + ") recomputes the core attention "
                     "and both layer norms (the MLP's too, which paratune keeps), but not the "
                     "QKV and output "
                     "projections or rotary embedding that paratune's selective recompute "
                     "also recomputes: more activation memory, less recompute time than "
                     "measured.")
    return notes


def _stage_fqns(counts: list[int]) -> list[list[str]]:
    """torchtitan module names of each stage (embedding first, norm and output last)."""
    stages, start = [], 0
    for stage, count in enumerate(counts):
        names = [f"layers.{i}" for i in range(start, start + count)]
        start += count
        if stage == 0:
            names.insert(0, "tok_embeddings")
        if stage == len(counts) - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages


def _megatron_layout(counts: list[int]) -> str:
    """A ``--pipeline-model-parallel-layout`` string: ``E`` embedding, ``t`` a transformer
    layer, ``L`` the loss, ``|`` between stages."""
    stages = [f"t*{count}" for count in counts]
    stages[0] = "E," + stages[0]
    stages[-1] += ",L"
    return "|".join(stages)


def recommendation(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                   devices_per_node: int | None = None,
                   predicted: dict[str, Any] | None = None,
                   objective: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything about the winner as one JSON-able mapping.

    Where the job cannot be launched by one ``torchrun`` command (see
    :func:`torchrun_command`) or paratune's trainer cannot run the layout (see
    :meth:`paratune.ParallelConfig.check_trainer`; Megatron-LM and torchtitan can),
    ``launch.torchrun`` is ``None`` and a note says why.
    """
    megatron = megatron_args(model, config)
    notes = _megatron_notes(config)
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
        per_node = devices_per_node or hardware.devices_per_node
        launched = _launch_shape(config.world_size, per_node)[1]
        if launched < per_node and launched % config.tp:
            # the prediction placed ranks per_node to a node; this launch does not
            notes.append(f"torchrun places {launched} ranks on each node, so some "
                         f"tensor-parallel groups of {config.tp} span two nodes, which the "
                         f"prediction (ranks {per_node} to a node) did not assume.")
    return {
        "model": model.to_dict(), "hardware": hardware.name, "world_size": config.world_size,
        "devices_per_node": devices_per_node or hardware.devices_per_node,
        "config": config.to_dict(), "config_key": config.key(),
        "num_microbatches": config.num_microbatches,
        "predicted": predicted or {}, "objective": objective or {},
        "launch": {
            "torchrun": torchrun,
            "torchtitan_toml": torchtitan_toml(model, config),
            "megatron_args": megatron,
            "notes": notes,
        },
    }


def write_recommendation(rec: dict[str, Any], directory: str | Path) -> dict[str, Path]:
    """Write ``recommendation.json``/``.yaml``, ``torchrun.sh``, ``torchtitan.toml`` and
    ``megatron_args.txt`` into ``directory`` (atomically); returns the paths by kind
    (no ``torchrun.sh`` where the recommendation has no torchrun command)."""
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
    if launch["torchrun"] is not None:
        atomic_write_text(paths["torchrun"], "#!/bin/sh\n" + launch["torchrun"] + "\n")
    else:  # and none left from an earlier winner written to the same directory
        paths.pop("torchrun").unlink(missing_ok=True)
    atomic_write_text(paths["torchtitan"], launch["torchtitan_toml"])
    atomic_write_text(paths["megatron"], " \\\n  ".join(launch["megatron_args"]) + "\n")
    return paths
