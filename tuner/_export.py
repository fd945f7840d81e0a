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

__all__ = ["infeasible_reason", "megatron_args", "megatron_command", "megatron_env",
           "megatron_notes", "recommendation", "torchrun_command", "torchtitan_args",
           "torchtitan_command", "torchtitan_config_module", "torchtitan_notes",
           "torchtitan_toml", "trainer_model_args", "write_recommendation"]

PROFILER_MODULE = "paratune.profiler.train"
"""Module torchrun starts for paratune's own workload (one training job, one config)."""

TORCHTITAN_TOML_HEADER = (
    "torchtitan job config (TOML, read with --job.config_file) for torchtitan v0.2.x up to "
    "v0.2.2. Later torchtitan (0.3 and on, after its config refactor) reads no TOML: "
    "torchtitan.sh beside this file launches the same job on 0.3 with --module/--config and "
    "command-line overrides such as --parallelism.tensor_parallel_degree 2."
)
"""First comment of the exported TOML: the torchtitan versions it is for."""

TORCHTITAN_CONFIG_MODULE = "torchtitan_config"
"""Name of the Python config module written for torchtitan 0.3 where no registered config
has the model's shape (``--module torchtitan_config --config paratune_job``)."""

MEGATRON_SELECTIVE_MODULES = ("core_attn", "layernorm")
"""``--recompute-modules`` for paratune's selective recompute: the closest Megatron-LM choices
(its choices: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)."""

MEGATRON_ENTRY = "pretrain_gpt.py"
"""Megatron-LM's GPT pre-training script (the root of its repository)."""

_TITAN_SCHEDULES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B",
                    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B"}

# paratune preset -> torchtitan llama3 flavor; 0.2.x has only 8B, 70B and 405B
_TITAN_FLAVORS = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "llama3-8b": "8B",
                  "llama3-70b": "70B", "llama3-405b": "405B"}
_TITAN_V02_FLAVORS = ("8B", "70B", "405B")
# torchtitan 0.3's registered llama3 trainer configs (models/llama3/config_registry.py) that
# train in bf16 as measured; its llama3_405b converts the linears to float8 (torchao) and is
# left out: the 405B flavor goes through a config module like the other shapes
_TITAN_REGISTERED = {"8B": "llama3_8b", "70B": "llama3_70b"}

# CUDA compute capability (major) by hardware name prefix; Megatron-LM asks for
# CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism before Blackwell (major 10)
_CUDA_MAJOR = {"A100": 8, "H100": 9, "H200": 9, "B200": 10, "B300": 10, "GB200": 10}


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


def _torchrun_prefix(world_size: int, devices_per_node: int) -> list[str]:
    """``torchrun`` and its rendezvous arguments for a job of ``world_size`` ranks."""
    nodes, per_node = _launch_shape(world_size, devices_per_node)
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
    if nodes > 1:
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500",
                 "--rdzv-id=paratune"]
    else:
        args += ["--standalone"]
    return args


def _shell(args: list[str]) -> str:
    """``args`` as one shell command line (``$MASTER_ADDR`` left to the shell)."""
    return " ".join(a if a.startswith(("--rdzv-endpoint", "$")) else shlex.quote(a)
                    for a in args)


def _preset(model: ModelSpec) -> str | None:
    """Name of the preset of ``model``'s shape (any name, any sequence length), or None."""
    for name, preset in MODEL_PRESETS.items():
        if preset.replace(name=model.name, seq_len=model.seq_len) == model:
            return name
    return None


def _titan_flavor(model: ModelSpec, *, version: str = "0.3") -> str | None:
    """torchtitan's llama3 flavor of ``model``'s shape, or None where it has none."""
    flavor = _TITAN_FLAVORS.get(_preset(model) or "")
    if version == "0.2" and flavor not in _TITAN_V02_FLAVORS:
        return None
    return flavor


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
    args = _torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    args += ["-m", module, *model_args,
             "--hardware", hardware.name, "--steps", str(steps),
             "--config", json.dumps(config.to_dict(), sort_keys=True)]
    return _shell(args)


# ---------------------------------------------------------------------------- torchtitan


def _titan_data_parallel(config: ParallelConfig) -> tuple[int, int, str | None, list[str]]:
    """``(replicate, shard, fsdp_reshard_after_forward or None, notes)`` of torchtitan."""
    notes = []
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
    return replicate, shard, reshard, notes


def _titan_local_batch(config: ParallelConfig) -> int:
    """torchtitan's ``training.local_batch_size`` for ``config``.

    torchtitan runs ``global_batch_size // (local_batch_size * dp)`` gradient-accumulation
    steps of ``local_batch_size`` sequences; with pp > 1 the pipeline schedule splits each
    of them into micro-batches of ``pipeline_parallel_microbatch_size``.
    """
    return config.micro_batch_size if config.pp == 1 else config.local_batch_size


def _stage_fqns(counts: list[int], *, output: str = "output") -> list[list[str]]:
    """torchtitan module names of each stage (embedding first, norm and output last;
    torchtitan 0.3 names the output projection ``lm_head``, 0.2.x ``output``)."""
    stages, start = [], 0
    for stage, count in enumerate(counts):
        names = [f"layers.{i}" for i in range(start, start + count)]
        start += count
        if stage == 0:
            names.insert(0, "tok_embeddings")
        if stage == len(counts) - 1:
            names += ["norm", output]
        stages.append(names)
    return stages


def torchtitan_notes(model: ModelSpec, config: ParallelConfig, *,
                     version: str = "0.3") -> list[str]:
    """Where torchtitan ``version`` (``"0.3"`` or ``"0.2"``) runs ``config`` otherwise than
    measured, or needs something the export cannot give."""
    where = "--hf_assets_path DIR" if version == "0.3" else "[model] hf_assets_path"
    notes = [f"torchtitan reads the tokenizer from {where} and the data of its dataloader "
             f"settings: point them at yours",
             *_titan_data_parallel(config)[3]]
    if model.mlp != "swiglu":
        notes.append(f"torchtitan's llama3 blocks have a SwiGLU MLP; this model's {model.mlp} "
                     f"MLP has no torchtitan llama3 equivalent (a third MLP matrix: more "
                     f"parameters, memory and time than predicted)")
    if version == "0.2" and _titan_flavor(model, version="0.2") is None:
        notes.append(_titan_v02_custom_model_note(model))
    if config.dp == 1 and (config.tp_enabled or config.pp_enabled):
        # distributed/utils.py maybe_enable_amp: mixed precision only through FSDP when
        # tp or pp is on; there is no FSDP with one data-parallel rank
        notes.append("torchtitan runs this layout in fp32: with tensor or pipeline "
                     "parallelism its mixed precision comes only from FSDP, and one "
                     "data-parallel rank has none (training.dtype = bfloat16 trains in pure "
                     "bf16 instead, without fp32 master weights); memory and step time will "
                     "differ from the bf16 mixed precision predicted")
    if config.tp_enabled:
        notes.append(f"torchtitan's tensor parallelism (tp={config.tp}) adds sequence "
                     f"parallelism (norms and dropout split over the sequence), as the "
                     f"memory model's activation term assumes; paratune's trainer measured "
                     f"tensor parallelism without it, so activation memory per GPU will be "
                     f"lower than measured")
    if config.recompute is Recompute.SELECTIVE:
        notes.append("selective recompute: paratune recomputes the attention half of each "
                     "block (norm, QKV, rotary, attention, output projection) and keeps the "
                     "MLP's activations; torchtitan has no attention-only option. Its per-op "
                     "selective AC (the closest) saves the attention (SDPA) outputs and "
                     "matmul results and recomputes the other ops, nearly the opposite: "
                     "activation memory and step time will differ from what was measured and "
                     "predicted")
    if config.pp_enabled and len(set(_stage_layer_counts(model.num_layers,
                                                         config.num_stages))) > 1:
        notes.append(f"{model.num_layers} layers over {config.num_stages} pipeline "
                     f"stages: the earlier stages take one layer more, as measured")
    return notes


def _titan_v02_custom_model_note(model: ModelSpec) -> str:
    """What to add to torchtitan v0.2.x for a shape it has no flavor of."""
    return (f"torchtitan v0.2.x has no llama3 flavor of this shape: add one to llama3_args "
            f"(torchtitan/models/llama3/__init__.py) as TransformerModelArgs(dim="
            f"{model.hidden_size}, n_layers={model.num_layers}, n_heads={model.num_heads}, "
            f"n_kv_heads={model.num_kv_heads}, vocab_size={model.vocab_size}, "
            f"multiple_of={model.ffn_hidden_size}, norm_eps={model.norm_eps}, "
            f"rope_theta={model.rope_theta:g}) (multiple_of = ffn_hidden_size gives an MLP "
            f"of exactly {model.ffn_hidden_size}) and set [model] flavor to its name")


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
    replicate, shard, reshard, _ = _titan_data_parallel(config)
    flavor = _titan_flavor(model, version="0.2")
    lines = ["[model]", 'name = "llama3"', f'flavor = "{flavor or "custom"}"', "",
             "[parallelism]",
             f"data_parallel_replicate_degree = {replicate}",
             f"data_parallel_shard_degree = {shard}"]
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
    lines += ["", "[training]",
              f"local_batch_size = {_titan_local_batch(config)}",
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


def torchtitan_config_module(model: ModelSpec) -> str | None:
    """A torchtitan 0.3 config module for ``model``, or None where a registered config has
    its shape (the 8B and 70B llama3 presets; torchtitan's 405B job trains in float8).

    The module defines ``paratune_job()``, a torchtitan ``Trainer.Config``: torchtitan's
    registered ``llama3_8b`` job (optimizer, data, loss) with the model replaced by the
    llama3 flavor of the shape (1B, 3B, 405B, in bf16) or, for other shapes, a llama3 model
    built from torchtitan's own blocks with the shape's dimensions. Saved as
    ``torchtitan_config.py`` it is named by ``--module torchtitan_config --config
    paratune_job`` (see :func:`torchtitan_args`), with its directory on ``PYTHONPATH``.
    """
    flavor = _titan_flavor(model)
    if flavor in _TITAN_REGISTERED:
        return None
    doc = (f'"""torchtitan 0.3 config of {model.name} (written by paratune): '
           f'--module {TORCHTITAN_CONFIG_MODULE} --config paratune_job."""')
    if flavor is not None:
        head = [doc, "",
                "from torchtitan.models.common.config_utils import decoder_vocab_size",
                "from torchtitan.models.llama3 import model_registry",
                "from torchtitan.models.llama3.config_registry import llama3_8b", ""]
        build = [f'    model_spec = model_registry("{flavor}")']
    else:
        head = [doc, "", "import dataclasses", "from functools import partial", "",
                "import torch.nn as nn",
                "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
                "from torchtitan.models.common.config_utils import (",
                "    decoder_vocab_size,", "    get_attention_config,", "    make_ffn_config,",
                "    make_gqa_config,", ")",
                "from torchtitan.models.llama3 import Llama3Model, model_registry",
                "from torchtitan.models.llama3.config_registry import llama3_8b",
                "from torchtitan.models.llama3.model import Llama3TransformerBlock", ""]
        build = _titan_custom_model_lines(model)
    body = ["", "def paratune_job():",
            '    """torchtitan\'s llama3_8b job with the model of the recommendation."""',
            *build,
            "    config = llama3_8b()",
            "    config.model_spec = model_spec",
            "    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(model_spec)",
            "    return config", ""]
    return "\n".join(head + body)


def _titan_custom_model_lines(model: ModelSpec) -> list[str]:
    """Body lines building a llama3 ``ModelSpec`` of ``model``'s shape (torchtitan 0.3)."""
    tied = model.tie_embeddings
    vocab, dim = model.vocab_size, model.hidden_size
    norm = f"RMSNorm.Config(normalized_shape={dim}, eps={model.norm_eps!r}, param_init=norm_init)"
    return [
        '    init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}',
        '    norm_init = {"weight": nn.init.ones_}',
        f"    rope = ComplexRoPE.Config(dim={dim // model.num_heads}, max_seq_len={model.seq_len}, "
        f"theta={model.rope_theta!r}, scaling=\"none\")",
        "    layers = [",
        "        Llama3TransformerBlock.Config(",
        f"            attention_norm={norm},",
        f"            ffn_norm={norm},",
        f"            attention=make_gqa_config(dim={dim}, n_heads={model.num_heads}, "
        f"n_kv_heads={model.num_kv_heads}, wqkv_param_init=init, wo_param_init=init, "
        "inner_attention=get_attention_config(\"flex\"), fuse_qkv=True, rope=rope),",
        f"            feed_forward=make_ffn_config(dim={dim}, hidden_dim={model.ffn_hidden_size}, "
        "w1_param_init=init, w2w3_param_init=init),",
        "        )",
        f"        for _ in range({model.num_layers})",
        "    ]",
        "    model = Llama3Model.Config(",
        f"        dim={dim}, vocab_size={vocab}, enable_weight_tying={tied},",
        f"        tok_embeddings=Embedding.Config(num_embeddings={vocab}, embedding_dim={dim}, "
        "param_init={\"weight\": partial(nn.init.normal_, std=1.0)}),",
        f"        norm={norm},",
        f"        lm_head=Linear.Config(in_features={dim}, out_features={vocab}, param_init=init),",
        "        layers=layers,",
        "    )",
        f"    model_spec = dataclasses.replace(model_registry(\"8B\"), flavor={model.name!r}, "
        "model=model)",
    ]


def torchtitan_args(model: ModelSpec, config: ParallelConfig,
                    hardware: HardwareSpec | None = None, *,
                    config_module: str = TORCHTITAN_CONFIG_MODULE) -> list[str]:
    """torchtitan 0.3 arguments (of ``torchtitan.train``) that train ``model`` under ``config``.

    ``--module llama3 --config llama3_8b`` (or ``llama3_70b``) for the presets torchtitan
    registers a bf16 job of; for other shapes ``--module config_module --config paratune_job``,
    the module :func:`torchtitan_config_module` writes. Then the overrides: degrees, the
    pipeline (its schedule, micro-batch, each stage's modules as one comma-joined argument,
    CUDA graphs off as torchtitan requires with pipelining), the batch, the sequence length,
    bf16 mixed precision and, last, the activation-checkpointing policy (a subcommand:
    ``activation-checkpoint:full``, ``:selective`` or ``:none``). Batch semantics are those
    of :func:`torchtitan_toml`.
    """
    del hardware
    flavor = _titan_flavor(model)
    if flavor in _TITAN_REGISTERED:
        args = ["--module", "llama3", "--config", _TITAN_REGISTERED[flavor]]
    else:
        args = ["--module", config_module, "--config", "paratune_job"]
    replicate, shard, reshard, _ = _titan_data_parallel(config)
    par = "--parallelism."
    args += [par + "data_parallel_replicate_degree", str(replicate),
             par + "data_parallel_shard_degree", str(shard)]
    if reshard is not None:
        args += [par + "fsdp_reshard_after_forward", reshard]
    args += [par + "tensor_parallel_degree", str(config.tp),
             par + "pipeline_parallel_degree", str(config.pp)]
    if config.pp > 1:
        counts = _stage_layer_counts(model.num_layers, config.num_stages)
        args += [par + "pipeline_parallel_schedule", _TITAN_SCHEDULES[config.schedule],
                 par + "pipeline_parallel_microbatch_size", str(config.micro_batch_size),
                 # one argument per stage, its modules joined by commas (torchtitan's
                 # list[str] rule); the stage count is then the list's length
                 par + "module_fqns_per_model_part",
                 *(",".join(stage) for stage in _stage_fqns(counts, output="lm_head")),
                 "--training.disable_cuda_graphs"]
    args += ["--training.local_batch_size", str(_titan_local_batch(config)),
             "--training.global_batch_size", str(config.global_batch_size),
             "--training.seq_len", str(model.seq_len),
             "--training.mixed_precision_param", "bfloat16",
             f"activation-checkpoint:{config.recompute.value}"]
    return args


def torchtitan_command(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                       devices_per_node: int | None = None) -> str:
    """A ``torchrun`` command that trains ``model`` under ``config`` with torchtitan 0.3
    (``-m torchtitan.train`` and :func:`torchtitan_args`).

    Raises:
        ConfigError: ``devices_per_node``: the ranks cannot be spread evenly over the nodes.
    """
    prefix = _torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    return _shell([*prefix, "-m", "torchtitan.train", *torchtitan_args(model, config)])


# ---------------------------------------------------------------------------- Megatron-LM


def _cuda_major(hardware: HardwareSpec | None) -> int | None:
    """CUDA compute capability (major) of ``hardware``, None where unknown."""
    if hardware is None:
        return None
    for prefix, major in _CUDA_MAJOR.items():
        if hardware.name.upper().startswith(prefix):
            return major
    return None


def _megatron_fsdp(config: ParallelConfig) -> bool:
    return config.dp_enabled and config.sharding in (Sharding.ZERO2, Sharding.ZERO3)


def _vocab_divisor(vocab_size: int, tp: int) -> int:
    """``--make-vocab-size-divisible-by``: Megatron-LM pads the vocabulary to a multiple of
    it times tp; the largest power of two up to 128 that keeps ``vocab_size`` as it is
    (1 where tp does not divide it: the padding is then the least possible)."""
    if vocab_size % tp:
        return 1
    divisor = 128
    while (vocab_size // tp) % divisor:
        divisor //= 2
    return divisor


def megatron_args(model: ModelSpec, config: ParallelConfig,
                  hardware: HardwareSpec | None = None) -> list[str]:
    """Megatron-LM command-line arguments (of ``pretrain_gpt.py``) for ``model`` under
    ``config``, as a list of separate arguments.

    The model's shape (layers, width, heads and query groups, MLP size and SwiGLU, RMSNorm
    and its epsilon, rotary embeddings and their base, no biases, untied embeddings where
    the model does not tie them, the vocabulary and its padding), bf16, the degrees and batch,
    sequence parallelism with tensor parallelism (the memory model's activations assume it),
    the pipeline's layer split, the sharding and the recompute.

    ZeRO-1 is the distributed optimizer; ZeRO-2 and ZeRO-3 are Megatron-FSDP with the flags
    it requires (``fsdp_dtensor`` checkpoints, no gradient-accumulation fusion). With one
    data-parallel rank no sharding flag is given (there is nothing to shard). Selective
    recompute names the closest ``--recompute-modules`` (:data:`MEGATRON_SELECTIVE_MODULES`);
    :func:`megatron_notes` says where these differ from the layout measured and
    :func:`megatron_env` gives the environment they need.
    """
    del hardware
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--num-attention-heads", str(model.num_heads)]
    if model.num_kv_heads != model.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_kv_heads)]
    args += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    if model.mlp == "swiglu":
        args.append("--swiglu")
    args += ["--normalization", "RMSNorm", "--norm-epsilon", repr(model.norm_eps),
             "--position-embedding-type", "rope",
             "--rotary-base", str(round(model.rope_theta)),
             "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--vocab-size", str(model.vocab_size),
             "--make-vocab-size-divisible-by", str(_vocab_divisor(model.vocab_size, config.tp)),
             "--seq-length", str(model.seq_len),
             "--max-position-embeddings", str(model.seq_len), "--bf16",
             "--tensor-model-parallel-size", str(config.tp),
             "--pipeline-model-parallel-size", str(config.pp),
             "--micro-batch-size", str(config.micro_batch_size),
             "--global-batch-size", str(config.global_batch_size)]
    if config.tp_enabled:
        args.append("--sequence-parallel")
    counts = _stage_layer_counts(model.num_layers, config.num_stages) if config.pp > 1 else []
    if len(set(counts)) > 1:
        # uneven: Megatron-LM splits the layers evenly unless a layout names every
        # (virtual) stage, in the order stage = virtual index * pp + pipeline rank
        args += ["--pipeline-model-parallel-layout", _megatron_layout(counts)]
    elif config.schedule is Schedule.INTERLEAVED_1F1B and counts:
        args += ["--num-layers-per-virtual-pipeline-stage", str(counts[0])]
    if config.dp_enabled:  # one data-parallel rank has nothing to shard
        if config.sharding is Sharding.ZERO1:
            args.append("--use-distributed-optimizer")
        elif _megatron_fsdp(config):
            strategy = ("optim_grads" if config.sharding is Sharding.ZERO2
                        else "optim_grads_params")
            # Megatron-FSDP's required flags: validate_args asserts the fsdp_dtensor
            # checkpoint format (the default, torch_dist, fails at launch)
            args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                     "--no-gradient-accumulation-fusion", "--use-distributed-optimizer",
                     "--ckpt-format", "fsdp_dtensor"]
    if config.recompute is Recompute.FULL:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    elif config.recompute is Recompute.SELECTIVE:
        args += ["--recompute-granularity", "selective",
                 "--recompute-modules", *MEGATRON_SELECTIVE_MODULES]
    return args


def megatron_env(config: ParallelConfig, hardware: HardwareSpec | None = None) -> dict[str, str]:
    """Environment variables Megatron-LM needs for ``config`` on ``hardware``.

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tensor parallelism before Blackwell (its
    ``validate_args`` asserts it; on unknown hardware it is set too), except under
    Megatron-FSDP, which asserts the opposite (:func:`megatron_notes` says so).
    """
    major = _cuda_major(hardware)
    if config.tp_enabled and not _megatron_fsdp(config) and (major is None or major < 10):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def megatron_notes(model: ModelSpec, config: ParallelConfig,
                   hardware: HardwareSpec | None = None) -> list[str]:
    """Where the Megatron-LM arguments of ``config`` differ from the layout measured, or
    need something outside the arguments."""
    notes = ["Megatron-LM: add your data, tokenizer (e.g. --tokenizer-type "
             "HuggingFaceTokenizer --tokenizer-model PATH), optimizer and schedule arguments; "
             "the ones given fix the model, its parallelism and its batch."]
    if model.vocab_size % config.tp:
        notes.append(f"Megatron-LM pads the vocabulary to a multiple of tp={config.tp}: "
                     f"{model.vocab_size} entries become "
                     f"{-(-model.vocab_size // config.tp) * config.tp}.")
    if float(round(model.rope_theta)) != model.rope_theta:
        notes.append(f"Megatron-LM's --rotary-base is an integer: {model.rope_theta} is "
                     f"rounded to {round(model.rope_theta)}.")
    if config.pp_enabled and config.schedule is Schedule.GPIPE:
        notes.append("Megatron-LM has no GPipe schedule; it runs 1F1B (same bubble, less "
                     "activation memory).")
    if config.tp_enabled:
        notes.append(f"Megatron-LM runs tensor parallelism (tp={config.tp}) with sequence "
                     f"parallelism (--sequence-parallel), as the memory model's activation "
                     f"term assumes; paratune's trainer measured it without, so activation "
                     f"memory per GPU will be lower than measured.")
    if _megatron_fsdp(config):
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


def megatron_command(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec, *,
                     devices_per_node: int | None = None) -> str:
    """A shell command that starts Megatron-LM's ``pretrain_gpt.py`` (from the root of its
    repository) with :func:`megatron_env` and :func:`megatron_args` under ``torchrun``.

    Raises:
        ConfigError: ``devices_per_node``: the ranks cannot be spread evenly over the nodes.
    """
    env = [f"{k}={shlex.quote(v)}" for k, v in megatron_env(config, hardware).items()]
    prefix = _torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    return " ".join([*env, _shell([*prefix, MEGATRON_ENTRY,
                                   *megatron_args(model, config, hardware)])])


def _megatron_layout(counts: list[int]) -> str:
    """A ``--pipeline-model-parallel-layout`` string: ``E`` embedding, ``t`` a transformer
    layer, ``L`` the loss, ``|`` between stages."""
    stages = [f"t*{count}" for count in counts]
    stages[0] = "E," + stages[0]
    stages[-1] += ",L"
    return "|".join(stages)


def _argument_lines(args: list[str]) -> list[str]:
    """``args`` shell-quoted, one flag and its values to a line."""
    lines: list[str] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append(shlex.quote(arg))
        else:
            lines[-1] += " " + shlex.quote(arg)
    return lines


# ---------------------------------------------------------------------------- the winner


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
        launched = _launch_shape(config.world_size, per_node)[1]
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
                                   + launch["torchtitan"] + ' "$@"\n')
        if launch.get("torchtitan_config_module"):
            texts["torchtitan_config"] = header + launch["torchtitan_config_module"]
        texts["torchtitan"] = header + launch["torchtitan_toml"]
        if launch.get("megatron"):
            texts["megatron_sh"] = ("#!/bin/sh\n# Megatron-LM, from the root of its repository\n"
                                 + header + launch["megatron"] + ' "$@"\n')
        texts["megatron"] = header + " \\\n  ".join(
            _argument_lines(launch["megatron_args"])) + "\n"
    for kind, name in _LAUNCH_FILES.items():
        path = directory / name
        if texts[kind] is None:  # and none left from an earlier winner in the same directory
            path.unlink(missing_ok=True)
        else:
            atomic_write_text(path, texts[kind])
            paths[kind] = path
    return paths
