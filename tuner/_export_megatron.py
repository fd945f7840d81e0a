"""Megatron-LM: ``pretrain_gpt.py`` arguments (the model's shape, its parallelism, batch and
recompute) as a list, the environment they need (``CUDA_DEVICE_MAX_CONNECTIONS``), the notes
on where they differ from the layout measured, and a ``torchrun`` command."""

from __future__ import annotations

import shlex

from paratune.hardware import HardwareSpec
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding, stage_layer_counts
from paratune.spec import ModelSpec
from paratune.tuner._export_torchrun import shell_line, torchrun_prefix

__all__ = ["MEGATRON_ENTRY", "MEGATRON_SELECTIVE_MODULES", "megatron_args", "megatron_command",
           "megatron_env", "megatron_notes"]

MEGATRON_SELECTIVE_MODULES = ("core_attn", "layernorm")
"""``--recompute-modules`` for paratune's selective recompute: the closest Megatron-LM choices
(its choices: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)."""

MEGATRON_ENTRY = "pretrain_gpt.py"
"""Megatron-LM's GPT pre-training script (the root of its repository)."""


# CUDA compute capability (major) by hardware name prefix; Megatron-LM asks for
# CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism before Blackwell (major 10)
_CUDA_MAJOR = {"A100": 8, "H100": 9, "H200": 9, "B200": 10, "B300": 10, "GB200": 10}


def _cuda_major(hardware: HardwareSpec | None) -> int | None:
    """CUDA compute capability (major) of ``hardware``, None where unknown."""
    if hardware is None:
        return None
    for prefix, major in _CUDA_MAJOR.items():
        if hardware.name.upper().startswith(prefix):
            return major
    return None


def _megatron_fsdp(config: ParallelConfig) -> bool:
    return config.dp_group_size > 1 and config.sharding in (Sharding.ZERO2, Sharding.ZERO3)


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
    if config.cp > 1:
        args += ["--context-parallel-size", str(config.cp)]
    counts = stage_layer_counts(model.num_layers, config.num_stages) if config.pp > 1 else []
    if len(set(counts)) > 1:
        # uneven: Megatron-LM splits the layers evenly unless a layout names every
        # (virtual) stage, in the order stage = virtual index * pp + pipeline rank
        args += ["--pipeline-model-parallel-layout", _megatron_layout(counts)]
    elif config.schedule is Schedule.INTERLEAVED_1F1B and counts:
        args += ["--num-layers-per-virtual-pipeline-stage", str(counts[0])]
    if config.dp_group_size > 1:  # one rank of the parameters has nothing to shard (dp*cp)
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
                     f"term assumes; paratune's own trainer runs it without, so activation "
                     f"memory per GPU will be lower than in paratune's own runs of it.")
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
    prefix = torchrun_prefix(config.world_size, devices_per_node or hardware.devices_per_node)
    return " ".join([*env, shell_line([*prefix, MEGATRON_ENTRY,
                                   *megatron_args(model, config, hardware)])])


def _megatron_layout(counts: list[int]) -> str:
    """A ``--pipeline-model-parallel-layout`` string: ``E`` embedding, ``t`` a transformer
    layer, ``L`` the loss, ``|`` between stages."""
    stages = [f"t*{count}" for count in counts]
    stages[0] = "E," + stages[0]
    stages[-1] += ",L"
    return "|".join(stages)
