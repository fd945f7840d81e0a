"""Analytical features of a training step, computed from the model, the layout and the hardware.

Every function takes a *config frame* (the columns of :data:`paratune.predictor.CONFIG_COLUMNS`,
one row per configuration) and returns one numpy value per row, so 100,000 configurations are
computed in a few column operations. :func:`config_row` builds a one-row frame from a
:class:`~paratune.ModelSpec`, a :class:`~paratune.ParallelConfig` and a
:class:`~paratune.HardwareSpec` for scalar use.

Conventions (Megatron-LM / nanotron accounting; the learned model corrects what they miss):

* mesh order is (pp, dp, tp), tp innermost: a group crosses nodes when the ranks it spans
  do not fit in one node;
* bf16 activations and communication (2 bytes); mixed-precision Adam state of 18 bytes per
  parameter (2 bf16 weights, 4 fp32 gradient-accumulation buffer, 12 fp32 master weights and
  moments), sharded by ZeRO stage;
* activations per layer follow Korthikanti et al. (2022) with flash attention (no stored
  attention matrix) and sequence parallelism (everything split over tp):
  ``s*b*(18*h + 2*m*f) / tp`` bytes with ``m`` MLP matrices;
* step time = slowest pipeline stage's per-micro-batch time (compute at peak FLOP/s plus
  tensor-parallel collectives and pipeline transfers at link bandwidth) times
  ``num_microbatches`` plus the pipeline's fill and drain (``pp - 1`` passes of its largest
  chunk), plus the data-parallel gradient reduction (bytes at link bandwidth plus a ring
  latency per gradient bucket and node hop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.batch import option_codes
from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.parallel import max_stage_layers
from paratune.spec import block_params

if TYPE_CHECKING:
    import pandas as pd

    from paratune.parallel import ParallelConfig
    from paratune.spec import ModelSpec

__all__ = [
    "ACTIVATION_BYTES",
    "DP_BUCKET_BYTES",
    "DP_HOP_LATENCY_S",
    "FEATURE_NAMES",
    "MEMORY_FEATURE_NAMES",
    "MEMORY_MONOTONE",
    "MEMORY_OVERHEAD_GB",
    "MODEL_SIZE_FEATURES",
    "STALL_FEATURE_NAMES",
    "STALL_MAX_MFU",
    "STALL_MIN_SECONDS_PER_MICROBATCH",
    "STALL_MONOTONE",
    "TRANSFER_FEATURE_NAMES",
    "Columns",
    "activation_memory_bytes",
    "analytical_memory_gb",
    "analytical_step_time",
    "bubble_fraction",
    "compute_features",
    "config_row",
    "dp_crosses_nodes",
    "dp_latency_s",
    "dp_nodes",
    "dp_reduction_bytes",
    "gradient_memory_bytes",
    "hardware_columns",
    "model_flops_per_device",
    "model_keys",
    "num_microbatches",
    "optimizer_memory_bytes",
    "parameter_memory_bytes",
    "pp_crosses_nodes",
    "pp_p2p_bytes_per_microbatch",
    "stall_features",
    "stall_floor_s",
    "stalled_pipeline",
    "step_time_at_mfu",
    "tp_bytes_per_microbatch",
    "tp_crosses_nodes",
]

ACTIVATION_BYTES = 2.0
"""Bytes per activation / communicated element (bf16)."""
MEMORY_OVERHEAD_GB = 2.0
"""CUDA context, NCCL buffers and allocator slack added to every device's estimate."""
DP_BUCKET_BYTES = 25e6
"""Gradient bytes per data-parallel reduction call (PyTorch DDP's default bucket, 25 MB)."""
DP_HOP_LATENCY_S = 20e-6
"""Latency of one inter-node step of a ring collective (NIC, switch and NCCL proxy)."""
_SCHEDULES = option_codes("schedule")


# ---------------------------------------------------------------------------------- columns
class Columns:
    """numpy views of a config frame's columns, resolved once (hardware looked up per name).

    Rows whose hardware is unknown get NaN hardware figures, and rows with an unknown
    schedule, sharding or recompute value a NaN code; :attr:`error` holds the message for
    them (empty string elsewhere).
    """

    def __init__(self, frame: pd.DataFrame) -> None:
        from paratune.batch import ConfigBatch

        batch = ConfigBatch.from_frame(frame, loose=True)
        self.n = len(batch)
        self.layers = batch.num_layers
        self.hidden = batch.hidden_size
        self.heads = batch.num_heads
        self.kv_heads = np.where(batch.num_kv_heads <= 0, self.heads, batch.num_kv_heads)
        self.ffn = batch.ffn_hidden_size
        self.vocab = batch.vocab_size
        self.seq = batch.seq_len
        self.tied = batch.tie_embeddings
        self.mlp_matrices = batch.mlp_matrices.astype(float)
        self.dp = batch.dp
        self.tp = batch.tp
        self.pp = batch.pp
        self.micro = batch.micro_batch_size
        self.global_batch = batch.global_batch_size
        self.virtual = np.maximum(batch.virtual_stages, 1.0)
        option_errors = np.full(self.n, "", dtype=object)

        def codes(name: str) -> np.ndarray:
            code = getattr(batch, name)
            bad = code < 0
            if bad.any():
                rule = f"must be one of {', '.join(option_codes(name))}"
                fresh = bad & (option_errors == "")
                option_errors[fresh] = [f"{name}={v!r} {rule}" for v in batch.unknown[name][fresh]]
            return np.where(bad, np.nan, code.astype(float))

        self.schedule = codes("schedule")
        # ZeRO-1 over a single data-parallel rank shards nothing: the same run as none (what
        # every framework does), and so the same features, not a rarely-seen category
        self.sharding = codes("sharding")
        self.sharding = np.where((self.sharding == 1) & (self.dp == 1), 0.0, self.sharding)
        self.recompute = codes("recompute")
        hw = hardware_columns(batch.hardware)
        self.peak_flops = hw["peak_flops"]
        self.memory_gb = hw["memory_gb"]
        self.intra_bw = hw["intra_node_bw"]
        self.inter_bw = hw["inter_node_bw"]
        per_node = batch.devices_per_node.astype(float)
        self.per_node = np.where(per_node < 1, hw["devices_per_node"], per_node)
        self.hardware_error = hw["error"]
        self.error = np.where(self.hardware_error != "", self.hardware_error, option_errors)
        self.accelerator = hw["accelerator"]
        self.world = self.dp * self.tp * self.pp

    # derived shapes
    @property
    def head_dim(self) -> np.ndarray:
        return self.hidden / self.heads

    @property
    def params_per_layer(self) -> np.ndarray:
        return block_params(self.hidden, self.kv_heads * self.head_dim, self.ffn,
                            self.mlp_matrices)

    @property
    def layers_per_stage(self) -> np.ndarray:
        """Layers on the fullest pipeline rank (at least one)."""
        return max_stage_layers(self.layers, self.pp)


def _lookup(values: Any, convert: Any, *, dtype: Any = float) -> np.ndarray:
    """``convert`` applied to each distinct value, spread back over the rows (vectorised)."""
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(np.asarray(values, dtype=object)), sort=False)
    table = np.asarray([convert(u) for u in uniques] + [convert(None)], dtype=dtype)
    return table[codes]  # code -1 (missing) picks the last entry


def hardware_columns(names: Any) -> dict[str, np.ndarray]:
    """Catalogue figures for each row's hardware name (unknown names: NaN and an error)."""
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(np.asarray(names, dtype=object)), sort=False)
    specs: list[HardwareSpec | None] = []
    errors: list[str] = []
    for name in [*uniques, None]:
        if name is None:
            specs.append(None)
            errors.append("hardware is missing")
            continue
        try:
            specs.append(get_hardware(str(name)))
            errors.append("")
        except ConfigError as exc:
            specs.append(None)
            # named after the config frame's column (the catalogue's own field is "gpu")
            errors.append(str(ConfigError("hardware", name, exc.rule)))
    out: dict[str, np.ndarray] = {}
    # "peak_flops" here is the compute speed the estimate assumes: the vendor peak, or the
    # catalogue's nominal figure where there is none (the CPU).
    for attr, source in (("peak_flops", "effective_flops"), ("memory_gb", "memory_gb"),
                         ("intra_node_bw", "intra_node_bw"), ("inter_node_bw", "inter_node_bw"),
                         ("devices_per_node", "devices_per_node")):
        table = np.asarray([float(getattr(s, source)) if s is not None
                            and getattr(s, source) is not None else np.nan for s in specs],
                           dtype=float)
        out[attr] = table[codes]
    out["accelerator"] = np.asarray([s is not None and s.device_type != "cpu" for s in specs],
                                    dtype=bool)[codes]
    out["error"] = np.asarray(errors, dtype=object)[codes]
    return out


def _cols(frame: pd.DataFrame | Columns) -> Columns:
    return frame if isinstance(frame, Columns) else Columns(frame)


def config_row(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec | str, *,
               devices_per_node: int | None = None) -> pd.DataFrame:
    """A one-row config frame (for computing features of a single configuration)."""
    from paratune.predictor import config_frame

    return config_frame(model, [config], hardware, devices_per_node=devices_per_node)


# ---------------------------------------------------------------------------------- compute
def num_microbatches(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Micro-batches per step on each data-parallel rank: ``global / (dp * micro)``."""
    c = _cols(frame)
    return c.global_batch / (c.dp * c.micro)


STALL_MIN_SECONDS_PER_MICROBATCH = 0.5
"""A pipeline run on accelerators is *stalled* when a micro-batch takes longer than this..."""
STALL_MAX_MFU = 0.10
"""... while the step reaches less than this model-FLOPs utilisation."""


def stalled_pipeline(frame: pd.DataFrame | Columns, step_time_s: np.ndarray) -> np.ndarray:
    """Which measured runs fell into the stalled regime of pipeline-parallel training.

    Public GPU sweeps show it: about a third of their pipeline runs on more than one node take
    a roughly fixed second or so per micro-batch (0.5-3 s, whatever the model's size), 3-300x
    the analytical estimate, at a few percent of peak FLOP/s. It is a regime of its own, not
    a slower version of the normal step: a run either stalls or it does not, and twin
    layouts may land on either side. Such a run is a pipeline run (``pp > 1``) on an
    accelerator whose measured step spends more than :data:`STALL_MIN_SECONDS_PER_MICROBATCH`
    per micro-batch at under :data:`STALL_MAX_MFU` model-FLOPs utilisation. On a CPU, half a
    second per micro-batch is ordinary, so CPU runs never count.

    Args:
        frame: Config frame of the measurements.
        step_time_s: Their measured step times (NaN where a run has none).

    Returns:
        A boolean per row.
    """
    c = _cols(frame)
    # over the floor means both over the seconds per micro-batch and under the MFU
    slow = np.asarray(step_time_s, dtype=float) > stall_floor_s(c)  # NaN: not stalled
    return c.accelerator & (c.pp > 1) & slow


def stall_floor_s(frame: pd.DataFrame | Columns) -> np.ndarray:
    """The step time above which :func:`stalled_pipeline` counts a pipeline run as stalled:
    over :data:`STALL_MIN_SECONDS_PER_MICROBATCH` per micro-batch and under
    :data:`STALL_MAX_MFU` (NaN where the hardware is unknown)."""
    c = _cols(frame)
    return np.maximum(STALL_MIN_SECONDS_PER_MICROBATCH * num_microbatches(c),
                      step_time_at_mfu(c, STALL_MAX_MFU))


STALL_FEATURE_NAMES: tuple[str, ...] = (
    "log10_compute_s_per_step", "log10_compute_s_per_micro", "log2_nodes")
"""Columns of :func:`stall_features`: the physics of the stalled regime, free of model size.
A stalled micro-batch costs about a fixed second whatever the model; that cost matters where
it is large next to the compute per device (runs spread thin over many nodes) and vanishes
where the compute is large. In the public H100 sweep no pipeline run with three seconds or
more of model FLOPs per device per step stalled. The memory fraction and which axes cross
nodes are left out: within the sweep they follow the model's size (larger models stalled
more often at the same compute), and a classifier on them called nearly every deep pipeline
of a ten-times larger model stalled."""

STALL_MONOTONE: dict[str, int] = {"log10_compute_s_per_step": -1,
                                  "log10_compute_s_per_micro": -1}
"""Directions the stall probability for an unseen model keeps: never rising with the compute
per device, so a larger model's layouts are no likelier to stall than the ones measured."""


def stall_features(frame: pd.DataFrame | Columns) -> np.ndarray:
    """The stall classifier's matrix for models not in the training data
    (:data:`STALL_FEATURE_NAMES`): log model-FLOPs seconds at peak per device per step and
    per micro-batch, and log2 nodes."""
    c = _cols(frame)
    compute = step_time_at_mfu(c)
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = {
            "log10_compute_s_per_step": np.log10(compute),
            "log10_compute_s_per_micro": np.log10(compute / num_microbatches(c)),
            "log2_nodes": np.log2(np.ceil(c.world / c.per_node)),
        }
    matrix = np.column_stack([columns[name] for name in STALL_FEATURE_NAMES]).astype(
        np.float32)
    matrix[~np.isfinite(matrix)] = np.nan
    return matrix


def step_time_at_mfu(frame: pd.DataFrame | Columns, mfu: float = 1.0) -> np.ndarray:
    """The step time at which a run reaches ``mfu`` of its device's peak: its model FLOPs
    per device over ``mfu`` times the peak (1: no step can be faster; NaN where the hardware
    is unknown)."""
    c = _cols(frame)
    with np.errstate(divide="ignore", invalid="ignore"):
        return model_flops_per_device(c) / (mfu * c.peak_flops)


def _forward_flops_per_token(c: Columns, layers: np.ndarray, *, lm_head: np.ndarray | float
                             ) -> np.ndarray:
    """Forward FLOPs per token of ``layers`` blocks (plus the output projection if lm_head)."""
    # As ModelSpec.num_matmul_params: every block's weights and the output projection.
    matmul_params = layers * c.params_per_layer + lm_head * c.vocab * c.hidden
    return 2.0 * matmul_params + 4.0 * layers * c.seq * c.hidden


def model_flops_per_device(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Model FLOPs (MFU convention, no recomputation) per device per optimizer step."""
    c = _cols(frame)
    per_token = 3.0 * _forward_flops_per_token(c, c.layers, lm_head=1.0)
    return per_token * c.global_batch * c.seq / c.world


def _recompute_factor(c: Columns) -> np.ndarray:
    """Hardware FLOPs / model FLOPs of a block: full recomputation adds a forward (4/3)."""
    return np.where(c.recompute == 1, 4.0 / 3.0, np.where(c.recompute == 2, 1.02, 1.0))


def _warmup_slots(c: Columns) -> np.ndarray:
    """Micro-batch slots a pipeline spends filling and draining, in units of the fullest
    rank's per-micro-batch time.

    Filling takes ``pp - 1`` forward passes of one model chunk (``v`` chunks per rank with the
    interleaved schedule, else 1), and the largest chunk, ``ceil(L / (pp * v))`` layers, sets
    their pace: ``(pp-1) * ceil(L / (pp*v)) / ceil(L / pp)``, which is ``(pp-1)/v`` when the
    chunks are even.
    """
    chunks = np.where(c.schedule == _SCHEDULES["interleaved_1f1b"], c.virtual, 1.0)
    largest_chunk = np.maximum(np.ceil(c.layers / (c.pp * chunks)), 1.0)
    return (c.pp - 1.0) * largest_chunk / c.layers_per_stage


def bubble_fraction(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Idle fraction of the pipeline: ``w / (num_microbatches + w)`` with ``w`` the fill and
    drain slots (``(pp-1)/v`` for even chunks; see :func:`_warmup_slots`)."""
    c = _cols(frame)
    warmup = _warmup_slots(c)
    return warmup / (num_microbatches(c) + warmup)


# ---------------------------------------------------------------------------------- comms
def tp_crosses_nodes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Whether a tensor-parallel group spans more than one node (1.0 / 0.0): groups of
    consecutive ranks stay inside nodes only when ``tp`` divides the node size (tp=6 on
    8-device nodes puts its second group across two)."""
    c = _cols(frame)
    with np.errstate(invalid="ignore", divide="ignore"):
        crosses = (c.per_node > 0) & (np.mod(c.per_node, c.tp) != 0)
    return crosses.astype(float)


def dp_crosses_nodes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Whether a data-parallel group spans more than one node (1.0 / 0.0)."""
    c = _cols(frame)
    return ((c.dp > 1) & (c.dp * c.tp > c.per_node)).astype(float)


def pp_crosses_nodes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Fraction of pipeline boundaries whose two stages sit in different nodes."""
    c = _cols(frame)
    stride = c.dp * c.tp
    stages_per_node = np.maximum(c.per_node / stride, 1.0)
    boundaries = np.maximum(c.pp - 1.0, 1.0)
    crossing = np.where(stride >= c.per_node, c.pp - 1.0,
                        np.floor((c.pp - 1.0) / stages_per_node))
    return np.where(c.pp > 1, crossing / boundaries, 0.0)


def tp_bytes_per_microbatch(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Bytes each device moves in tensor-parallel collectives for one micro-batch on a stage.

    Two all-reduces of the ``micro * seq * hidden`` activation per block in the forward and two
    in the backward (two more under full recomputation), each ``2 (tp-1)/tp`` of the tensor.
    """
    c = _cols(frame)
    per_layer = np.where(c.recompute == 1, 6.0, 4.0)
    tensor = c.micro * c.seq * c.hidden * ACTIVATION_BYTES
    return c.layers_per_stage * per_layer * 2.0 * (c.tp - 1.0) / c.tp * tensor


def pp_p2p_bytes_per_microbatch(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Bytes a pipeline rank sends per micro-batch (activation forward, gradient backward)."""
    c = _cols(frame)
    tensor = c.micro * c.seq * c.hidden * ACTIVATION_BYTES
    return np.where(c.pp > 1, 2.0 * tensor * c.virtual, 0.0)


def _stage_params(c: Columns) -> np.ndarray:
    """Parameters held by the fullest pipeline rank before tensor-parallel splitting."""
    embed = c.vocab * c.hidden
    both_ends = np.where(c.tied, 1.0, 2.0)
    final_norm = c.hidden
    return (c.layers_per_stage * c.params_per_layer + embed * np.where(c.pp > 1, 1.0, both_ends)
            + final_norm)


def _stage_gradient_bytes(c: Columns) -> np.ndarray:
    """bf16 bytes of a device's gradients (its stage's share of the tp split): what sets the
    number of :data:`DP_BUCKET_BYTES` buckets of the reduction."""
    return _stage_params(c) / c.tp * ACTIVATION_BYTES


def dp_nodes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Nodes a data-parallel group spans (mesh order (pp, dp, tp): a group's ranks are
    ``tp`` apart)."""
    c = _cols(frame)
    spanned = np.where(c.tp >= c.per_node, c.dp, np.ceil(c.dp * c.tp / c.per_node))
    return np.maximum(spanned, 1.0)


def dp_latency_s(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Latency of the data-parallel gradient reduction per step, in seconds.

    The gradients go in :data:`DP_BUCKET_BYTES` buckets; a ring collective over ``n`` nodes
    takes ``2 (n - 1)`` inter-node steps per bucket, each :data:`DP_HOP_LATENCY_S`. Zero
    inside one node and without data parallelism. This is what makes the reduction slower
    than its bytes at link bandwidth as the cluster grows. Shardings that communicate every
    micro-batch (see :func:`dp_reduction_bytes`) pay it every micro-batch.
    """
    c = _cols(frame)
    buckets = np.ceil(_stage_gradient_bytes(c) / DP_BUCKET_BYTES)
    hops = 2.0 * (dp_nodes(c) - 1.0)
    per_micro = (c.sharding == 3) | ((c.sharding == 2) & (c.pp == 1))
    rounds = np.where(per_micro, num_microbatches(c), 1.0)
    return np.where(c.dp > 1, rounds * buckets * hops * DP_HOP_LATENCY_S, 0.0)


def dp_reduction_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Bytes each device moves per step over data parallelism, ``(dp-1)/dp`` times the
    following per parameter of its stage's tensor-parallel shard, with ``g`` bytes per
    reduced gradient and ``p = 2`` per gathered (bf16) parameter:

    * ``none``: an all-reduce of the gradients, ``2g``, once per step;
    * ``zero1``: a reduce-scatter of the gradients and an all-gather of the updated
      parameters, ``g + p``, once per step;
    * ``zero2``: the same, but without pipelining once per *micro-batch* (each micro-batch's
      gradients are reduce-scattered into the rank's shard, and the parameters, resharded
      after backward, gathered again for the next forward); with pipelining a stage's
      gradients accumulate unsharded over the micro-batches and are reduced once;
    * ``zero3``: the parameters gathered for the forward and again for the backward of every
      micro-batch, ``2p``, plus the gradients' reduce-scatter, ``g``, per micro-batch without
      pipelining and once per step with it.

    ``g`` is 2 (bf16 gradients). Frameworks that accumulate and reduce gradients in fp32
    (Megatron-LM, nanotron, paratune's trainer) move ``g = 4``, but counting that ranked the
    configurations of the public sweeps worse (top-1 regret), so the learned correction
    absorbs it.
    """
    c = _cols(frame)
    grad, param = ACTIVATION_BYTES, ACTIVATION_BYTES
    n_micro = num_microbatches(c)
    reductions = np.where(c.pp > 1, 1.0, n_micro)  # gradient reductions per step, ZeRO-2/3
    per_param = np.select(  # an unknown sharding (an error of its own) counts as none
        [c.sharding == 1, c.sharding == 2, c.sharding == 3],
        [np.full(c.n, grad + param), (grad + param) * reductions,
         2.0 * param * n_micro + grad * reductions],
        default=2.0 * grad)
    return per_param * (c.dp - 1.0) / c.dp * _stage_params(c) / c.tp


# ---------------------------------------------------------------------------------- memory
def parameter_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """bf16 weights on the fullest device (sharded over dp under ZeRO-3)."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 3, c.dp, 1.0)
    return _stage_params(c) / c.tp * 2.0 / shard


def gradient_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """fp32 gradient accumulation buffers on the fullest device (sharded over dp under ZeRO-2
    and -3)."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 2, c.dp, 1.0)
    return _stage_params(c) / c.tp * 4.0 / shard


def optimizer_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """fp32 master weights and Adam moments (12 bytes/param), sharded over dp from ZeRO-1."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 1, c.dp, 1.0)
    return _stage_params(c) / c.tp * 12.0 / shard


def activation_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Peak activation bytes on the fullest device.

    Each micro-batch in flight *stores* its layers' activations (under full recomputation
    only each layer's input); full recomputation adds the *working set* of the one layer
    being recomputed, once whatever the micro-batches in flight. Micro-batches in flight:
    all of them under GPipe, ``min(pp, num_microbatches)`` on the first rank under 1F1B (a
    little more when interleaved). The last rank holds one micro-batch's activations and
    logits (fp32 for the loss: 4 bytes per vocabulary entry) under 1F1B, every micro-batch's
    under GPipe.
    """
    c = _cols(frame)
    tokens = c.micro * c.seq
    per_layer = tokens * (18.0 * c.hidden + 2.0 * c.mlp_matrices * c.ffn) / c.tp
    layer_inputs = tokens * c.hidden * ACTIVATION_BYTES / c.tp
    full = c.recompute == 1
    stored = c.layers_per_stage * np.where(full, layer_inputs, per_layer)
    working = np.where(full, per_layer, 0.0)
    n_micro = num_microbatches(c)
    gpipe = c.schedule == _SCHEDULES["gpipe"]
    one_f_one_b = np.minimum(c.pp, n_micro) * np.where(
        c.schedule == _SCHEDULES["interleaved_1f1b"], 1.0 + (c.pp - 1.0) / (c.pp * c.virtual),
        1.0)
    in_flight = np.where(gpipe, n_micro, one_f_one_b)
    logits = tokens * c.vocab / c.tp * 4.0
    first_rank = stored * in_flight + working
    last_rank = np.where(gpipe, n_micro, 1.0) * (stored + logits) + working
    return np.where(c.pp <= 1, stored + working + logits, np.maximum(first_rank, last_rank))


def analytical_memory_gb(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Estimated peak memory per device in GB: weights, gradients, optimizer, activations and
    :data:`MEMORY_OVERHEAD_GB`."""
    c = _cols(frame)
    total = (parameter_memory_bytes(c) + gradient_memory_bytes(c) + optimizer_memory_bytes(c)
             + activation_memory_bytes(c))
    return total / 1e9 + MEMORY_OVERHEAD_GB


# ---------------------------------------------------------------------------------- time
def analytical_step_time(frame: pd.DataFrame | Columns) -> dict[str, np.ndarray]:
    """The analytical step time and its parts, in seconds.

    Returns:
        ``compute_s`` (slowest stage's FLOPs at peak over the step), ``tp_s``, ``pp_s``
        (communication over the step), ``bubble_s`` (pipeline idle), ``dp_s`` (gradient
        reduction: bytes at bandwidth plus :func:`dp_latency_s`) and ``step_time_s`` (their
        sum).
    """
    c = _cols(frame)
    stage_layers = c.layers_per_stage
    last_has_head = 1.0
    # Full recomputation repeats the blocks' forward only (ModelSpec.flops_per_token with
    # recompute=True); the factor here also scales the output projection. Counting it exactly
    # was measured (evaluate_predictor.py, holdout_regret.py): better vTrain and 256-GPU
    # figures, worse top-1 regret (holdout mean 6.3 -> 10.6%) and 8B hold-out, so the learned
    # correction keeps this baseline.
    per_token = 3.0 * _forward_flops_per_token(c, stage_layers, lm_head=last_has_head)
    per_token = per_token * _recompute_factor(c)
    tokens = c.micro * c.seq
    compute_mb = per_token * tokens / c.tp / c.peak_flops
    tp_bw = np.where(tp_crosses_nodes(c) > 0, c.inter_bw, c.intra_bw)
    tp_mb = tp_bytes_per_microbatch(c) / tp_bw
    pp_bw = np.where(pp_crosses_nodes(c) > 0, c.inter_bw, c.intra_bw)
    pp_mb = pp_p2p_bytes_per_microbatch(c) / pp_bw
    n_micro = num_microbatches(c)
    warmup = _warmup_slots(c)
    per_mb = compute_mb + tp_mb + pp_mb
    dp_bw = np.where(dp_crosses_nodes(c) > 0, c.inter_bw, c.intra_bw)
    dp_s = dp_reduction_bytes(c) / dp_bw + dp_latency_s(c)
    out = {
        "compute_s": compute_mb * n_micro,
        "tp_s": tp_mb * n_micro,
        "pp_s": pp_mb * n_micro,
        "bubble_s": per_mb * warmup,
        "dp_s": dp_s,
    }
    out["step_time_s"] = per_mb * (n_micro + warmup) + dp_s
    return out


# ---------------------------------------------------------------------------------- features
FEATURE_NAMES: tuple[str, ...] = (
    "frac_compute", "frac_tp", "frac_pp", "frac_bubble", "frac_dp",
    "log2_tokens_per_micro", "log2_hidden_per_tp", "log2_ffn_per_tp", "log2_head_dim",
    "log2_layers_per_stage", "log2_microbatches", "log2_tp", "log2_pp",
    "tp_crosses_nodes", "dp_crosses_nodes", "pp_crosses_nodes",
    "sharding", "recompute", "schedule", "mem_fraction", "log2_vocab_per_tp_over_hidden",
    "log10_flops_per_byte_inter", "log10_flops_per_byte_intra", "log2_dp_mem_share",
    "log10_layer_passes_per_s",
)
"""Columns of :func:`compute_features`: relative quantities (fractions, ratios, log sizes) so
that a model trained on them can extrapolate to larger clusters and models."""

MODEL_SIZE_FEATURES: tuple[str, ...] = (
    "frac_dp", "log2_hidden_per_tp", "log2_ffn_per_tp", "log2_dp_mem_share")
"""Features that say which of the trained-on models a row belongs to: the hidden and FFN widths
per tensor-parallel device and the optimizer state's share of device memory follow the model's
size, and the data-parallel share of the step follows its gradient bytes. For configurations
of a model in the training data they separate that model's quirks (which layouts of it
stall); for a model the predictor has not seen, trees split on them as if on the name of a
model it has, so :data:`TRANSFER_FEATURE_NAMES` leaves them out."""

TRANSFER_FEATURE_NAMES: tuple[str, ...] = tuple(
    name for name in FEATURE_NAMES if name not in MODEL_SIZE_FEATURES)
"""The features of the step-time model for models not in the training data."""

MEMORY_FEATURE_NAMES: tuple[str, ...] = tuple(
    name for name in FEATURE_NAMES
    if not name.startswith("frac_") and name not in (
        "log2_microbatches", "log10_layer_passes_per_s", "log10_flops_per_byte_inter",
        "log10_flops_per_byte_intra"))
"""The features of the peak-memory correction: sizes, shapes and layout, not the step's mix
of compute and communication or its micro-batches per step. Those move with the micro-batch
and let a learned correction fall faster than the memory it corrects rises (a larger
micro-batch predicted to need less memory)."""

MEMORY_MONOTONE: dict[str, int] = {"log2_tokens_per_micro": 1, "sharding": -1}
"""Directions the memory correction keeps (``+1``: never falls as the feature grows, ``-1``:
never rises): with the estimate it corrects, predicted memory grows with the micro-batch and
shrinks with sharding, whatever the few measurements near a layout say. (Holding the
memory-fraction and optimizer-share features too made the correction worse on a model
larger than any trained on.)"""


def model_keys(frame: pd.DataFrame | Columns) -> np.ndarray:
    """The architecture of each row as a string (layers, widths, heads, vocabulary): rows with
    one key are configurations of one model, whatever its name."""
    import pandas as pd

    c = _cols(frame)
    shapes = pd.DataFrame({"L": c.layers, "H": c.hidden, "A": c.heads, "KV": c.kv_heads,
                           "F": c.ffn, "V": c.vocab})
    if not len(shapes):
        return np.empty(0, dtype=object)
    group = shapes.groupby(list(shapes.columns), sort=False, dropna=False).ngroup().to_numpy()
    _, first = np.unique(group, return_index=True)
    labels = np.asarray(["L{:.0f}-H{:.0f}-A{:.0f}-KV{:.0f}-F{:.0f}-V{:.0f}".format(*row)
                         for row in shapes.to_numpy()[first]], dtype=object)
    return labels[group]


def compute_features(frame: pd.DataFrame | Columns) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The learned models' feature matrix and the analytical estimates it is relative to.

    Args:
        frame: A config frame.

    Returns:
        ``(X, analytical)``: an ``(n, len(FEATURE_NAMES))`` float32 matrix, and a dict with
        the parts of :func:`analytical_step_time`, ``memory_gb`` (analytical peak memory)
        ``error`` (message per row: unknown hardware or option value; empty elsewhere) and
        ``hardware_error`` (its unknown-hardware part).
    """
    c = _cols(frame)
    times = analytical_step_time(c)
    total = times["step_time_s"]
    mem_gb = analytical_memory_gb(c)
    warmup = _warmup_slots(c)
    # Layer passes (one per layer of a stage and micro-batch slot) per analytical second: a
    # fixed cost per pass (kernel launches, per-micro-batch synchronisation) costs this
    # fraction of the step; it separates the slow regime of deep pipelines with many small
    # micro-batches from compute-bound configurations.
    layer_passes = c.layers_per_stage * (num_microbatches(c) + warmup)
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = {
            "frac_compute": times["compute_s"] / total,
            "frac_tp": times["tp_s"] / total,
            "frac_pp": times["pp_s"] / total,
            "frac_bubble": times["bubble_s"] / total,
            "frac_dp": times["dp_s"] / total,
            "log2_tokens_per_micro": np.log2(c.micro * c.seq),
            "log2_hidden_per_tp": np.log2(c.hidden / c.tp),
            "log2_ffn_per_tp": np.log2(c.ffn / c.tp),
            "log2_head_dim": np.log2(c.head_dim),
            "log2_layers_per_stage": np.log2(c.layers / c.pp),
            "log2_microbatches": np.log2(num_microbatches(c)),
            "log2_tp": np.log2(c.tp),
            "log2_pp": np.log2(c.pp),
            "tp_crosses_nodes": tp_crosses_nodes(c),
            "dp_crosses_nodes": dp_crosses_nodes(c),
            "pp_crosses_nodes": pp_crosses_nodes(c),
            "sharding": c.sharding,
            "recompute": c.recompute,
            "schedule": c.schedule,
            "mem_fraction": mem_gb / c.memory_gb,
            "log2_vocab_per_tp_over_hidden": np.log2(c.vocab / c.tp / c.hidden),
            "log10_flops_per_byte_inter": np.log10(c.peak_flops / c.inter_bw),
            "log10_flops_per_byte_intra": np.log10(c.peak_flops / c.intra_bw),
            "log2_dp_mem_share": np.log2(optimizer_memory_bytes(c) / 1e9 / c.memory_gb),
            "log10_layer_passes_per_s": np.log10(layer_passes / total),
        }
    matrix = np.column_stack([columns[name] for name in FEATURE_NAMES]).astype(np.float32)
    matrix[~np.isfinite(matrix)] = np.nan
    analytical = dict(times)
    analytical["memory_gb"] = mem_gb
    analytical["error"] = c.error
    analytical["hardware_error"] = c.hardware_error  # the unknown-hardware part alone
    return matrix, analytical
