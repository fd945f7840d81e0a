"""torchtitan 0.3: a registered config (or a small config module) and command-line overrides.

torchtitan 0.3's config is a registered Python function (``--module llama3 --config
llama3_70b``) with overrides such as ``--parallelism.tensor_parallel_degree 2``; where no
registered config has the model's shape, :func:`torchtitan_config_module` writes a small
Python config module to name by ``--module``. The data-parallel mapping, the pipeline's
module names and the notes are shared with the v0.2.x TOML export
(:mod:`paratune.tuner._export_titan_toml`).
"""

from __future__ import annotations

from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding, stage_layer_counts
from paratune.spec import MODEL_PRESETS, ModelSpec
from paratune.tuner._export_torchrun import shell_line, torchrun_prefix

__all__ = ["TITAN_SCHEDULES", "TORCHTITAN_CONFIG_MODULE", "stage_fqns", "titan_data_parallel",
           "titan_flavor", "titan_local_batch", "torchtitan_args", "torchtitan_command",
           "torchtitan_config_module", "torchtitan_notes"]

TORCHTITAN_CONFIG_MODULE = "torchtitan_config"
"""Name of the Python config module written for torchtitan 0.3 where no registered config
has the model's shape (``--module torchtitan_config --config paratune_job``)."""


TITAN_SCHEDULES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B",
                    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B"}

# paratune preset -> torchtitan llama3 flavor; 0.2.x has only 8B, 70B and 405B
_TITAN_FLAVORS = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "llama3-8b": "8B",
                  "llama3-70b": "70B", "llama3-405b": "405B"}
_TITAN_V02_FLAVORS = ("8B", "70B", "405B")
# torchtitan 0.3's registered llama3 trainer configs (models/llama3/config_registry.py) that
# train in bf16 as measured; its llama3_405b converts the linears to float8 (torchao) and is
# left out: the 405B flavor goes through a config module like the other shapes
_TITAN_REGISTERED = {"8B": "llama3_8b", "70B": "llama3_70b"}


def _preset(model: ModelSpec) -> str | None:
    """Name of the preset of ``model``'s shape (any name, any sequence length), or None."""
    for name, preset in MODEL_PRESETS.items():
        if preset.replace(name=model.name, seq_len=model.seq_len) == model:
            return name
    return None


def titan_flavor(model: ModelSpec, *, version: str = "0.3") -> str | None:
    """torchtitan's llama3 flavor of ``model``'s shape, or None where it has none."""
    flavor = _TITAN_FLAVORS.get(_preset(model) or "")
    if version == "0.2" and flavor not in _TITAN_V02_FLAVORS:
        return None
    return flavor


def titan_data_parallel(config: ParallelConfig) -> tuple[int, int, str | None, list[str]]:
    """``(replicate, shard, fsdp_reshard_after_forward or None, notes)`` of torchtitan."""
    notes = []
    reshard = None  # FSDP2's reshard_after_forward; None: no sharding (DDP or no dp)
    if config.dp_group_size > 1:  # dp * cp: torchtitan shards over the cp ranks too
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
    if config.cp > 1 and reshard is None:
        # parallel_dims: fsdp_enabled = dp_shard_enabled or cp_enabled
        notes.append(f"torchtitan shards the parameters over the context-parallel ranks "
                     f"(FSDP2 over cp={config.cp}, replicated over dp={config.dp}) whatever the "
                     f"sharding asked ({config.sharding.value}): more traffic per step, less "
                     f"memory than predicted")
    return replicate, shard, reshard, notes


def titan_local_batch(config: ParallelConfig) -> int:
    """torchtitan's ``training.local_batch_size`` for ``config``.

    torchtitan runs ``global_batch_size // (local_batch_size * dp)`` gradient-accumulation
    steps of ``local_batch_size`` sequences; with pp > 1 the pipeline schedule splits each
    of them into micro-batches of ``pipeline_parallel_microbatch_size``.
    """
    return config.micro_batch_size if config.pp == 1 else config.local_batch_size


def stage_fqns(counts: list[int], *, output: str = "output") -> list[list[str]]:
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
             *titan_data_parallel(config)[3]]
    if model.mlp != "swiglu":
        notes.append(f"torchtitan's llama3 blocks have a SwiGLU MLP; this model's {model.mlp} "
                     f"MLP has no torchtitan llama3 equivalent (a third MLP matrix: more "
                     f"parameters, memory and time than predicted)")
    if version == "0.2" and titan_flavor(model, version="0.2") is None:
        notes.append(_titan_v02_custom_model_note(model))
    if config.dp_group_size == 1 and (config.tp_enabled or config.pp_enabled):
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
                     f"memory model's activation term assumes; paratune's own trainer runs "
                     f"tensor parallelism without it, so activation memory per GPU will be "
                     f"lower than in paratune's own runs of it")
    if config.recompute is Recompute.SELECTIVE:
        notes.append("selective recompute: paratune recomputes the attention half of each "
                     "block (norm, QKV, rotary, attention, output projection) and keeps the "
                     "MLP's activations; torchtitan has no attention-only option. Its per-op "
                     "selective AC (the closest) saves the attention (SDPA) outputs and "
                     "matmul results and recomputes the other ops, nearly the opposite: "
                     "activation memory and step time will differ from what was measured and "
                     "predicted")
    if config.pp_enabled and len(set(stage_layer_counts(model.num_layers,
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
    flavor = titan_flavor(model)
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
    flavor = titan_flavor(model)
    if flavor in _TITAN_REGISTERED:
        args = ["--module", "llama3", "--config", _TITAN_REGISTERED[flavor]]
    else:
        args = ["--module", config_module, "--config", "paratune_job"]
    replicate, shard, reshard, _ = titan_data_parallel(config)
    par = "--parallelism."
    args += [par + "data_parallel_replicate_degree", str(replicate),
             par + "data_parallel_shard_degree", str(shard)]
    if reshard is not None:
        args += [par + "fsdp_reshard_after_forward", reshard]
    args += [par + "tensor_parallel_degree", str(config.tp),
             par + "pipeline_parallel_degree", str(config.pp)]
    if config.cp > 1:
        args += [par + "context_parallel_degree", str(config.cp)]
    if config.pp > 1:
        counts = stage_layer_counts(model.num_layers, config.num_stages)
        args += [par + "pipeline_parallel_schedule", TITAN_SCHEDULES[config.schedule],
                 par + "pipeline_parallel_microbatch_size", str(config.micro_batch_size),
                 # one argument per stage, its modules joined by commas (torchtitan's
                 # list[str] rule); the stage count is then the list's length
                 par + "module_fqns_per_model_part",
                 *(",".join(stage) for stage in stage_fqns(counts, output="lm_head")),
                 "--training.disable_cuda_graphs"]
    args += ["--training.local_batch_size", str(titan_local_batch(config)),
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
    prefix = torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    return shell_line([*prefix, "-m", "torchtitan.train", *torchtitan_args(model, config)])
