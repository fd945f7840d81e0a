"""Public measurement rows to paratune records: the model shape a row states or its family
implies (:data:`MODEL_FAMILIES`), its layout and hardware, and its metrics, each checked;
a row that cannot be mapped raises :class:`_Unmappable` with the reason."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.measurement import Measurement, Status
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding, degrees_product
from paratune.scalars import plain
from paratune.spec import ModelSpec

__all__ = ["GPT_DEFAULT", "MODEL_FAMILIES", "SHAPE_COLUMNS", "config_from_public",
           "model_spec_from_public", "precision_problem", "public_row_config",
           "public_row_devices_per_node", "public_row_layout", "step_problem"]

_STATUS_WORDS = {"ok": Status.OK, "success": Status.OK, "oom": Status.OOM,
                 "failed": Status.ERROR, "error": Status.ERROR, "crashed": Status.ERROR,
                 "timeout": Status.TIMEOUT}
# Relative disagreement tolerated between two stated values of the same quantity (rounding).
_TOLERANCE = 0.02
# Precisions whose matrix products run at another peak than a device's dense 16-bit one,
# however a source spells them ("FP8-CS", "float8_e4m3", "torch.float32", "32-true"); any
# other text (bf16, "bf16-mixed", "mixed precision (bf16)") is 16-bit mixed precision.
_OTHER_PEAK = re.compile(r"(?<![a-z0-9])(fp8|float8|e4m3|e5m2|int8|fp6|fp4|nvfp4|mxfp\d*"
                         r"|fp32|float32|tf32|32)(?![a-z0-9])")


@dataclass(frozen=True)
class _Family:
    """Shape assumptions for a family of public models (what the CSV does not state)."""

    mlp: str
    vocab_size: int
    tie_embeddings: bool
    ffn_by_shape: dict[tuple[int, int], int]
    """``(layers, hidden) -> ffn_hidden_size`` of the configurations the source used."""
    ffn_default_ratio: float | None
    """``ffn = ratio * hidden`` when the shape is not in ``ffn_by_shape``."""
    default_recompute: Recompute
    note: str


MODEL_FAMILIES: dict[str, _Family] = {
    # nanotron scaling_benchmarks model_configs, multi-head attention, vocabulary 131072.
    # Shapes checked against the source: FLOPs per token with these MLP widths reproduce the
    # reported MFU / tokens-per-second ratio of the pp=1 rows (1B, 3B; 8B with the vocabulary
    # counted twice, as nanotron's MFU does for untied models).
    "ultrascale": _Family(
        mlp="swiglu", vocab_size=131072, tie_embeddings=False,
        ffn_by_shape={(16, 2048): 8192, (28, 3072): 8192, (32, 4096): 14336,
                      (80, 8192): 28672},
        ffn_default_ratio=None, default_recompute=Recompute.NONE,
        note="Llama-style (SwiGLU, MHA), vocab 131072, untied; MLP width from nanotron's "
             "scaling_benchmarks model_configs, else solved from params_b; not stated by the "
             "source and taken as: recompute none where the recompute cell is empty, sharding "
             "none where zero_stage is empty, 1F1B for pipelines, gpu_mem_gb as the peak "
             "reserved memory"),
    # Megatron GPT: GeLU MLP of 4x hidden, GPT-2 vocabulary padded to 51200 (divisible by
    # 128 * tp for every tp up to 8), tied input/output embeddings.
    "gpt": _Family(
        mlp="gelu", vocab_size=51200, tie_embeddings=True, ffn_by_shape={},
        ffn_default_ratio=4.0, default_recompute=Recompute.FULL,
        note="Megatron GPT (GeLU, ffn 4x hidden), vocab 50257 padded to 51200, tied "
             "embeddings; not stated by the source and taken as: full recompute where the "
             "recompute cell is empty, sharding none where zero_stage is empty (Megatron-"
             "DeepSpeed without ZeRO), 1F1B for pipelines, an A100 of 80 GB"),
}


def _family_for(source: str, model: str) -> str:
    """The :data:`MODEL_FAMILIES` key of a row: the model's name decides where it names an
    architecture (a Llama measured with Megatron-LM is still a Llama), else the source."""
    model = model.lower()
    if "llama" in model:
        return "ultrascale"
    if "gpt" in model:
        return "gpt"
    source = source.lower()
    if "vtrain" in source or "gpt" in source or "megatron" in source:
        return "gpt"
    return "ultrascale"


class _Unmappable(ValueError):
    """A row's values cannot be mapped to a record; the message is the reason."""


def precision_problem(text: str, hardware: HardwareSpec) -> str | None:
    """Why a ``precision`` cell cannot go with a row on ``hardware`` (``None``: it can).

    On a device with a dense 16-bit peak a cell that names FP8, FP4, INT8 or 32 bits is
    refused (any other text is 16-bit mixed precision): the core prices the matrix
    products at that peak, so such a run, whose products run at another, would be
    predicted as a different job."""
    if hardware.peak_flops is not None and _OTHER_PEAK.search(text.lower()):
        return (f"precision={text!r} is not bf16 or fp16: on {hardware.name} the performance "
                "model prices 16-bit mixed precision only (FP8 and 32-bit matrix products "
                "run at other peaks)")
    return None


def step_problem(model: ModelSpec, hardware: HardwareSpec, tokens: int, num_gpus: int,
                 step: float | None) -> str | None:
    """Why a measured step of ``tokens`` tokens on ``num_gpus`` devices cannot have taken
    ``step`` seconds (``None``: it can): faster than the devices' peak computes the
    model's matrix products alone (six FLOPs per weight and token; attention, which
    sources count differently, left out, so the bound holds for any of them)."""
    if not step or hardware.peak_flops is None:
        return None
    utilisation = 6.0 * model.num_matmul_params * tokens / (step * num_gpus
                                                            * hardware.peak_flops)
    if utilisation <= 1:
        return None
    return (f"step_time_s={step:g} would be {utilisation:.3g} times the peak of {num_gpus} "
            f"{hardware.name} for this model's matrix products alone: check the units, the "
            "GPU count and the shape")


def _check_precision(raw: dict[str, str], hardware: HardwareSpec) -> None:
    problem = precision_problem(raw.get("precision", ""), hardware)
    if problem:
        raise _Unmappable(problem)


def _number(raw: dict[str, str], key: str) -> float | None:
    text = raw.get(key, "")
    if text == "" or text.lower() in ("nan", "none", "null"):
        return None
    try:
        if "_" in text:  # float() reads '1_024' as 1024: a typo more often than a number
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise _Unmappable(f"{key}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise _Unmappable(f"{key}={text!r} must be a finite number (leave the cell empty where "
                          f"the source states no value)")
    return value


# Measured or stated quantities: (column, rule, check). Empty cells are values not stated.
_METRIC_RULES: tuple[tuple[str, str, Any], ...] = (
    ("mfu", "must be a fraction in [0, 1] (0.43 = 43%)", lambda v: 0 <= v <= 1),
    ("tokens_per_sec", "must be positive", lambda v: v > 0),
    ("tokens_per_sec_per_gpu", "must be positive", lambda v: v > 0),
    ("step_time_s", "must be positive", lambda v: v > 0),
    ("tflops_per_gpu", "must be positive", lambda v: v > 0),
    ("gpu_mem_gb", "must be positive", lambda v: v > 0),
    ("params_b", "must be positive", lambda v: v > 0),
)
_STEP_METRICS = ("mfu", "tokens_per_sec", "tokens_per_sec_per_gpu", "step_time_s",
                 "tflops_per_gpu")


def _check_metrics(raw: dict[str, str]) -> None:
    for key, rule, check in _METRIC_RULES:
        value = _number(raw, key)
        if value is not None and not check(value):
            raise _Unmappable(f"{key}={raw[key]!r} {rule}")


def _integer(raw: dict[str, str], key: str, *, required: bool = True) -> int | None:
    value = _number(raw, key)
    if value is None:
        if required:
            raise _Unmappable(f"missing {key}")
        return None
    if value != int(value) or value < 1:
        raise _Unmappable(f"{key}={raw[key]!r} must be a positive integer")
    return int(value)


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= _TOLERANCE * max(abs(a), abs(b))


# Optional public columns that state the model's shape where the family's assumption (the
# vocabulary, the MLP, multi-head attention, tying) does not hold; each overrides it.
SHAPE_COLUMNS = ("vocab_size", "ffn_hidden_size", "num_kv_heads", "mlp", "tie_embeddings")
# The shape taken where the family's cannot be (no params_b, or a params_b smaller than the
# family's vocabulary allows): a GPT-style model, as in GPT-2/GPT-3 and Megatron-LM's defaults.
GPT_DEFAULT = "gpt"


def _shape_cell(raw: dict[str, str], key: str) -> str:
    text = raw.get(key, "").strip()
    return "" if text.lower() in ("nan", "none", "null") else text


def _stated_shape(raw: dict[str, str]) -> dict[str, Any]:
    """The shape columns a row states, checked (a one-line reason naming the column if not)."""
    stated: dict[str, Any] = {}
    for key in ("vocab_size", "ffn_hidden_size", "num_kv_heads"):
        value = _integer(raw, key, required=False)
        if value is not None:
            stated[key] = value
    mlp = _shape_cell(raw, "mlp").lower()
    if mlp:
        if mlp not in ("swiglu", "gelu"):
            raise _Unmappable(f"mlp={raw['mlp']!r} must be swiglu or gelu")
        stated["mlp"] = mlp
    tie = _shape_cell(raw, "tie_embeddings").lower()
    if tie:
        if tie not in ("true", "1", "yes", "false", "0", "no"):
            raise _Unmappable(f"tie_embeddings={raw['tie_embeddings']!r} must be true or false "
                              "(or 1/0, yes/no)")
        stated["tie_embeddings"] = tie in ("true", "1", "yes")
    return stated


def _default_ffn(hidden: int, mlp: str) -> int:
    """The GPT-style MLP width: 4x hidden for GeLU; for SwiGLU the same FLOPs, 8/3 x hidden
    rounded up to a multiple of 256 (Llama's and Megatron-LM's rule)."""
    if mlp == "gelu":
        return 4 * hidden
    return -(-int(8 * hidden / 3) // 256) * 256


def model_spec_from_public(raw: dict[str, str]) -> ModelSpec:
    """The :class:`ModelSpec` of a public row.

    The shape is what the row states (``layers, hidden, heads, seq_len`` and the optional
    :data:`SHAPE_COLUMNS`); what it does not state comes from its family in
    :data:`MODEL_FAMILIES`: a known shape's MLP width, else the MLP width solved from
    ``params_b``, else (no ``params_b``, or one too small for the family's vocabulary) the
    GPT-style default: 4x hidden GeLU MLP, vocabulary 51200, tied embeddings. The assumptions
    taken are named in the spec's ``extra["assumptions"]`` (empty where the row states every
    shape column).

    Raises:
        _Unmappable: a shape cell is missing or breaks its column's rule.
        ConfigError: the shape breaks a :class:`ModelSpec` rule.
    """
    label = raw.get("model", "") or "model"
    family_name = _family_for(raw.get("source", ""), label)
    layers = _integer(raw, "layers")
    hidden = _integer(raw, "hidden")
    heads = _integer(raw, "heads")
    seq_len = _integer(raw, "seq_len")
    stated = _stated_shape(raw)
    family = MODEL_FAMILIES[family_name]
    shape = _family_shape(family, stated)
    kv_heads = stated.get("num_kv_heads", heads)
    solved = _ffn_from_params(raw, layers=layers, hidden=hidden,
                              kv_dim=hidden * kv_heads // heads, **shape)
    ffn = stated.get("ffn_hidden_size")
    if ffn is None and shape == _family_shape(family, {}):
        ffn = family.ffn_by_shape.get((layers, hidden))
    if ffn is None and family.ffn_default_ratio and shape["mlp"] == family.mlp:
        ffn = int(family.ffn_default_ratio * hidden)
    note = family.note
    too_small = solved is None and _number(raw, "params_b") is not None
    if (ffn is None and solved is None) or (too_small and not {"vocab_size", "tie_embeddings"}
                                            <= stated.keys()):
        # the family's shape cannot be the model's (params_b is too small for its
        # vocabulary, or nothing gives the MLP width): the GPT-style default for what the row
        # does not state
        family_name = GPT_DEFAULT
        shape = _family_shape(MODEL_FAMILIES[GPT_DEFAULT], stated)
        solved = None
        if ffn is None or "ffn_hidden_size" not in stated:
            ffn = _default_ffn(hidden, shape["mlp"])
        note = ("GPT-style default shape, the row's params_b being "
                + ("too small for the source family's vocabulary" if too_small else "missing")
                + ": GeLU MLP of 4x hidden (SwiGLU of 8/3x where mlp=swiglu is stated), vocab "
                "51200, tied embeddings, multi-head attention, for what the row does not state")
    if ffn is None:
        ffn = solved
    if set(SHAPE_COLUMNS) <= stated.keys():
        note = ""  # the row states the whole shape: nothing was assumed of it
    elif stated:
        note += "; stated by the row: " + ", ".join(f"{k}={v}" for k, v in stated.items())
    name = label if family_name == "ultrascale" else f"{label}-{layers}L-{hidden}H"
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv_heads, ffn_hidden_size=ffn,
                     seq_len=seq_len, extra={"assumptions": note}, **shape)


def _family_shape(family: _Family, stated: dict[str, Any]) -> dict[str, Any]:
    """``mlp, vocab_size, tie_embeddings``: the stated ones, else the family's."""
    return {"mlp": stated.get("mlp", family.mlp),
            "vocab_size": stated.get("vocab_size", family.vocab_size),
            "tie_embeddings": stated.get("tie_embeddings", family.tie_embeddings)}


def _ffn_from_params(raw: dict[str, str], *, layers: int, hidden: int, kv_dim: int, mlp: str,
                     vocab_size: int, tie_embeddings: bool) -> int | None:
    """The MLP width that makes the model ``params_b`` (multiple of 256), or ``None`` where
    ``params_b`` is not stated or too small for this vocabulary and depth."""
    params_b = _number(raw, "params_b")
    if params_b is None:
        return None
    if params_b <= 0:
        raise _Unmappable(f"params_b={raw['params_b']!r} must be positive")
    embeddings = hidden * vocab_size * (1 if tie_embeddings else 2)
    matrices = 3 if mlp == "swiglu" else 2
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim  # q, o and k, v
    rest = params_b * 1e9 - embeddings - layers * (attention + 2 * hidden) - hidden
    ffn = round(rest / (matrices * hidden * layers) / 256) * 256
    return int(ffn) if ffn >= hidden else None


def config_from_public(raw: dict[str, str], *, check_grad_accum: bool = True
                       ) -> tuple[ParallelConfig, int]:
    """The :class:`ParallelConfig` of a public row and its stated GPU count.

    Args:
        raw: The row's cells.
        check_grad_accum: Require ``dp * micro_batch * grad_accum == global_batch`` where
            both are stated (a record needs it; a prediction uses ``global_batch``, and
            ``grad_accum`` only where ``micro_batch`` is empty).

    Raises:
        _Unmappable: a degree is missing or stated values contradict each other.
    """
    num_gpus, (tp, pp, dp, cp) = _degrees(raw)
    if dp * tp * pp * cp != num_gpus:
        raise _Unmappable(f"{degrees_product(dp, tp, pp, cp)} contradicts num_gpus={num_gpus}")
    global_batch = _integer(raw, "global_batch")
    grad_accum = _integer(raw, "grad_accum", required=False)
    micro = _integer(raw, "micro_batch", required=grad_accum is None)
    if micro is None:  # what the stated micro-batches per step leave to each
        micro = global_batch // (dp * grad_accum)
        if micro < 1 or micro * dp * grad_accum != global_batch:
            raise _Unmappable(f"micro_batch is empty and global_batch={global_batch} is not a "
                              f"multiple of dp*grad_accum = {dp}*{grad_accum}")
    if global_batch % (dp * micro):
        raise _Unmappable(f"global_batch={global_batch} is not a multiple of dp*micro_batch = "
                          f"{dp}*{micro}")
    if check_grad_accum and grad_accum is not None and dp * micro * grad_accum != global_batch:
        raise _Unmappable(f"dp*micro_batch*grad_accum = {dp}*{micro}*{grad_accum} = "
                          f"{dp * micro * grad_accum} contradicts global_batch={global_batch}")
    zero = _number(raw, "zero_stage")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise _Unmappable(f"zero_stage={raw['zero_stage']!r} must be 0, 1, 2 or 3")
    recompute_text = raw.get("recompute", "").lower()
    family = MODEL_FAMILIES[_family_for(raw.get("source", ""), raw.get("model", ""))]
    if not recompute_text:
        recompute = family.default_recompute
    elif recompute_text.startswith("full"):
        recompute = Recompute.FULL
    elif recompute_text.startswith("selective"):
        recompute = Recompute.SELECTIVE
    elif recompute_text in ("none", "no", "false", "0"):
        recompute = Recompute.NONE
    elif recompute_text in ("yes", "true", "1"):
        recompute = Recompute.FULL
    else:
        raise _Unmappable(f"recompute={raw['recompute']!r} is not none, full or selective")
    schedule, virtual = _schedule(raw, pp)
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                            global_batch_size=global_batch, schedule=schedule,
                            virtual_stages=virtual, cp=cp,
                            sharding=Sharding.from_stage(int(zero or 0)), recompute=recompute)
    try:  # the layout's own rules (a pipeline schedule's among them)
        config.validate(runnable=False)
    except ConfigError as exc:
        raise _Unmappable(f"{_PUBLIC_NAMES.get(exc.field, exc.field)}="
                          f"{exc.value!r}: {exc.rule}") from None
    return config, num_gpus


def _degrees(raw: dict[str, str]) -> tuple[int, tuple[int, int, int, int]]:
    """``num_gpus`` and ``(tp, pp, dp, cp)`` of a public row (``cp`` 1 where empty).
    Published tables often leave one of the first four to arithmetic (the data-parallel
    degree of a table that gives the GPUs, tensor and pipeline degrees): one empty cell among
    them is what the others imply."""
    names = ("tp", "pp", "dp")
    num_gpus = _integer(raw, "num_gpus", required=False)
    cp = _integer(raw, "cp", required=False) or 1
    degrees = [_integer(raw, k, required=False) for k in names]
    empty = [k for k, v in zip(names, degrees, strict=True) if v is None]
    missing = ["num_gpus"] * (num_gpus is None) + empty
    if len(missing) > 1:
        raise _Unmappable(f"missing {' and '.join(missing)} (one of num_gpus, tp, pp and dp may "
                          "be left empty, no more)")
    if num_gpus is None:
        num_gpus = math.prod(degrees) * cp
    elif empty:
        stated = [(k, v) for k, v in zip(names, degrees, strict=True) if v is not None]
        stated += [("cp", cp)] * (cp > 1)
        product = math.prod(v for _, v in stated)
        if num_gpus % product:
            raise _Unmappable(f"{empty[0]} is empty and num_gpus={num_gpus} is not a multiple "
                              f"of {'*'.join(k for k, _ in stated)} = {product}")
        degrees[names.index(empty[0])] = num_gpus // product
    return num_gpus, (degrees[0], degrees[1], degrees[2], cp)


_SCHEDULES = {"1f1b": Schedule.ONE_F_ONE_B, "interleaved": Schedule.INTERLEAVED_1F1B,
              "interleaved_1f1b": Schedule.INTERLEAVED_1F1B, "gpipe": Schedule.GPIPE}
"""The ``schedule`` cells the public format takes (``-`` and ``_`` alike)."""

_PUBLIC_NAMES = {"global_batch_size": "global_batch", "micro_batch_size": "micro_batch"}


def _check_shape(model: ModelSpec, config: ParallelConfig) -> None:
    """The layout's rules against the model that any framework needs (``tp`` divides the
    heads, the key-value heads and the MLP width; ``2*cp`` divides the sequence): a layout
    no framework can run gets no record and no prediction. (A width a row leaves to its
    family's default does not break them where ``tp`` divides the heads: the defaults have
    as many key-value heads as heads, and MLP widths of 4x the hidden size or multiples of
    256.)"""
    try:
        config.validate(model, runnable=False)
    except ConfigError as exc:
        raise _Unmappable(f"{_PUBLIC_NAMES.get(exc.field, exc.field)}={exc.value!r}: "
                          f"{exc.rule}") from None


def _schedule(raw: dict[str, str], pp: int) -> tuple[Schedule, int]:
    """The pipeline schedule and model chunks per pipeline rank of a public row: the stated
    ``schedule`` (empty: 1F1B, or interleaved where ``virtual_stages`` > 1) and
    ``virtual_stages`` (empty: 1; an interleaved schedule must state it, it is not
    guessed). Without a pipeline (``pp`` 1) a stated 1F1B or GPipe is moot: 1F1B. The
    layout's own rules (an interleaved schedule needs pp >= 2, one chunk per rank
    otherwise) are :meth:`ParallelConfig.validate`'s."""
    text = raw.get("schedule", "").strip().lower().replace("-", "_")
    virtual = _integer(raw, "virtual_stages", required=False)
    if text and text not in _SCHEDULES:
        raise _Unmappable(f"schedule={raw['schedule']!r} is not 1f1b, interleaved_1f1b "
                          f"or gpipe")
    schedule = _SCHEDULES.get(text) or (Schedule.INTERLEAVED_1F1B if (virtual or 1) > 1
                                        else Schedule.ONE_F_ONE_B)
    if schedule is Schedule.INTERLEAVED_1F1B and virtual is None:
        raise _Unmappable("virtual_stages='': an interleaved schedule needs its model chunks "
                          "per pipeline rank, an integer >= 2")
    if schedule is Schedule.GPIPE and pp == 1:
        schedule = Schedule.ONE_F_ONE_B
    return schedule, virtual or 1


def public_row_layout(raw: dict[str, str]) -> tuple[ModelSpec, ParallelConfig, HardwareSpec]:
    """The model, layout and hardware of a public row, as a prediction needs them.

    Only the configuration is checked (not the metrics, nor a stated ``grad_accum`` that
    contradicts ``global_batch``).

    Raises:
        ValueError: the configuration cannot be mapped (missing degrees, contradictions, a
            ``gpu`` the catalogue does not know, a layout that breaks the model's rules, a
            ``precision`` the model does not price there); the message is the reason.
    """
    try:
        model = model_spec_from_public(raw)
        config, _ = config_from_public(raw, check_grad_accum=False)
    except ConfigError as exc:
        raise ValueError(f"invalid {exc.field}={exc.value!r}: {exc.rule}") from None
    try:
        hardware = get_hardware(raw.get("gpu", ""))
    except ConfigError as exc:
        raise ValueError(f"gpu={raw.get('gpu', '')!r} {exc.rule}") from None
    try:
        _check_shape(model, config)
        _check_precision(raw, hardware)
        _devices_per_node(raw, hardware, config.world_size)
    except _Unmappable as exc:
        raise ValueError(str(exc)) from None
    return model, config, hardware


def public_row_devices_per_node(raw: dict[str, str]) -> int | None:
    """The row's ``gpus_per_node`` where it states one (``None``: the catalogue's node size
    of its ``gpu``); :func:`public_row_layout` checks it.

    Raises:
        ValueError: the cell is not a positive integer.
    """
    try:
        return _integer(raw, "gpus_per_node", required=False)
    except _Unmappable as exc:
        raise ValueError(str(exc)) from None


def _devices_per_node(raw: dict[str, str], hardware: HardwareSpec, num_gpus: int) -> int:
    """Devices per node of a row: its ``gpus_per_node``, else its device's in the catalogue;
    a stated ``nodes`` must agree with ``num_gpus`` on nodes of that size."""
    per_node = _integer(raw, "gpus_per_node", required=False) or hardware.devices_per_node
    nodes = _integer(raw, "nodes", required=False)
    if nodes is not None and -(-num_gpus // per_node) != nodes:
        raise _Unmappable(f"nodes={nodes} contradicts num_gpus={num_gpus} on "
                          f"{per_node}-GPU nodes")
    return per_node


def public_row_config(raw: dict[str, str]) -> dict[str, Any]:
    """A config-frame row (:data:`paratune.predictor.CONFIG_COLUMNS`) for a public row.

    Raises:
        ValueError: as :func:`public_row_layout`.
    """
    from paratune.batch import ConfigBatch

    model, config, hardware = public_row_layout(raw)
    frame = ConfigBatch.from_configs(model, [config], hardware, devices_per_node=[
        public_row_devices_per_node(raw)]).to_frame()
    return {k: plain(v) for k, v in frame.iloc[0].items()}


def _row_to_measurement(raw: dict[str, str]) -> Measurement:
    notes = raw.get("notes", "")
    flag = re.search(r"FLAG=([^;]*)", notes)
    model = model_spec_from_public(raw)
    config, num_gpus = config_from_public(raw)
    _check_shape(model, config)
    try:
        hardware = get_hardware(raw["gpu"])
    except ConfigError:
        raise _Unmappable(f"gpu={raw['gpu']!r} is not a known device") from None
    _check_precision(raw, hardware)
    per_node = _devices_per_node(raw, hardware, num_gpus)
    if flag:
        raise _Unmappable(f"the source flags contradictory values (FLAG={flag.group(1)})")
    _check_metrics(raw)

    tokens = config.global_batch_size * model.seq_len
    step = _number(raw, "step_time_s")
    cluster_tps = _number(raw, "tokens_per_sec")
    per_gpu_tps = _number(raw, "tokens_per_sec_per_gpu")
    if cluster_tps is not None and per_gpu_tps is not None and not _agree(
            cluster_tps, per_gpu_tps * num_gpus):
        raise _Unmappable(f"tokens_per_sec={cluster_tps:g} contradicts tokens_per_sec_per_gpu*"
                          f"num_gpus = {per_gpu_tps * num_gpus:g}")
    if cluster_tps is None and per_gpu_tps is not None:
        cluster_tps = per_gpu_tps * num_gpus
    if step is None and cluster_tps:
        step = tokens / cluster_tps
    elif step is not None and cluster_tps and not _agree(step, tokens / cluster_tps):
        raise _Unmappable(f"step_time_s={step:g} contradicts global_batch*seq_len/tokens_per_sec "
                          f"= {tokens / cluster_tps:g}")
    if cluster_tps is None and step:
        cluster_tps = tokens / step
    problem = step_problem(model, hardware, tokens, num_gpus, step)
    if problem:
        raise _Unmappable(problem)

    status_text = raw.get("status", "").lower()
    if status_text:
        if status_text not in _STATUS_WORDS:
            raise _Unmappable(f"status={raw['status']!r} is not one of "
                              f"{', '.join(sorted(_STATUS_WORDS))}")
        status = _STATUS_WORDS[status_text]
    elif step:
        status = Status.OK
    else:
        raise _Unmappable("no status and no step_time_s or tokens_per_sec: neither a "
                          "measurement nor a stated failure")
    if status is Status.OK and not step:
        raise _Unmappable("status ok but neither step_time_s nor tokens_per_sec is stated")
    error = ""
    if status is not Status.OK:
        stated = [k for k in _STEP_METRICS if _number(raw, k) is not None]
        if stated:
            raise _Unmappable(f"status={raw['status']!r} contradicts the stated "
                              f"{', '.join(stated)}: a run that did not finish has no step "
                              f"metrics")
        error = f"{raw.get('status') or 'failed'}: the source reports no metrics (crashed or " \
                "out of memory)"
        step = cluster_tps = None

    mem = _number(raw, "gpu_mem_gb")
    mfu = _number(raw, "mfu")
    return Measurement(
        model=model, config=config, hardware=hardware.name, devices_per_node=per_node,
        status=status, error=error,
        step_time_s=step if step is not None else math.nan,
        tokens_per_s=cluster_tps if cluster_tps is not None else math.nan,
        peak_mem_reserved_gb=mem if mem is not None else math.nan,
        mfu=mfu if mfu is not None and status is Status.OK else math.nan,
        source=raw.get("source", "") or "public", campaign_id=raw.get("model", ""),
        fingerprint={"device_name": hardware.name, "device_count": num_gpus},
        timestamp=0.0,
    )
