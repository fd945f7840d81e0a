"""Analytical features of a training step, computed from the model, the layout and the hardware.

Every function takes a *config frame* (the columns of :data:`paratune.predictor.CONFIG_COLUMNS`,
one row per configuration) and returns one numpy value per row, so 100,000 configurations are
computed in a few column operations. :func:`config_row` builds a one-row frame from a
:class:`~paratune.ModelSpec`, a :class:`~paratune.ParallelConfig` and a
:class:`~paratune.HardwareSpec` for scalar use.

Conventions (Megatron-LM / nanotron accounting; the learned model corrects what they miss):

* mesh order is (pp, dp, cp, tp), tp innermost (cp 1 but where a sequence is split): a
  group crosses nodes when the ranks it spans do not fit in one node;
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

from typing import TYPE_CHECKING

import numpy as np

from paratune.models._feature_columns import (
    Columns,
    _cols,
    config_row,
    hardware_columns,
    num_microbatches,
)
from paratune.models._memory_estimate import (
    DEFAULT_MEMORY_CONSTANTS,
    MEMORY_CONSTANT_NAMES,
    MEMORY_MIN_ROWS,
    MEMORY_OVERHEAD_GB,
    activation_memory_bytes,
    analytical_memory_gb,
    fit_memory_constants,
    gradient_memory_bytes,
    memory_core_gb,
    memory_parts,
    optimizer_memory_bytes,
    parameter_memory_bytes,
)
from paratune.models._stall_features import (
    STALL_FEATURE_NAMES,
    STALL_MAX_MFU,
    STALL_MIN_SECONDS_PER_MICROBATCH,
    STALL_MONOTONE,
    stall_features,
    stall_floor_s,
    stalled_pipeline,
)
from paratune.models._step_time import (
    ACTIVATION_BYTES,
    DP_BUCKET_BYTES,
    DP_HOP_LATENCY_S,
    _warmup_slots,
    analytical_step_time,
    bubble_fraction,
    cp_crosses_nodes,
    cp_s_per_microbatch,
    dp_crosses_nodes,
    dp_latency_s,
    dp_nodes,
    dp_reduction_bytes,
    dp_streams_every_microbatch,
    elementwise_s_per_microbatch,
    group_seconds_per_byte,
    hierarchical_dp_s,
    hierarchical_tp_s_per_microbatch,
    loss_s_per_microbatch,
    model_flops_per_device,
    pp_crosses_nodes,
    pp_p2p_bytes_per_microbatch,
    step_time_at_mfu,
    tp_bytes_per_microbatch,
    tp_crosses_nodes,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ACTIVATION_BYTES",
    "DEFAULT_MEMORY_CONSTANTS",
    "DP_BUCKET_BYTES",
    "DP_HOP_LATENCY_S",
    "FEATURE_NAMES",
    "MEMORY_CONSTANT_NAMES",
    "MEMORY_FEATURE_NAMES",
    "MEMORY_MIN_ROWS",
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
    "cp_crosses_nodes",
    "cp_s_per_microbatch",
    "dp_crosses_nodes",
    "dp_latency_s",
    "dp_nodes",
    "dp_reduction_bytes",
    "dp_streams_every_microbatch",
    "elementwise_s_per_microbatch",
    "fit_memory_constants",
    "gradient_memory_bytes",
    "group_seconds_per_byte",
    "hardware_columns",
    "hierarchical_dp_s",
    "hierarchical_tp_s_per_microbatch",
    "loss_s_per_microbatch",
    "memory_core_gb",
    "memory_parts",
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
that a model trained on them can extrapolate to larger clusters and models.

The shares of compute and of the tensor-, pipeline- and data-parallel traffic
(``frac_compute``, ``frac_tp``, ``frac_pp``, ``frac_dp``) are of the step as the calibrated
core splits it at a well-tuned framework's constants
(:func:`~paratune.models._calibration.core_shares`: collectives across nodes reduced
hierarchically), the step the learned correction is a residual of; the pipeline's fill
and drain (``frac_bubble``) is the analytical estimate's. The analytical estimate prices
every byte of a group across nodes at one network card's bandwidth, which reads a 16-way
tensor-parallel group over two nodes as 91-94% communication for a 1B and an 8B model
alike; with those shares, Ultra-Scale's 8B fitted on its 1B read a median APE of 26.5%
over seeds 0-4, with the core's 21.1% (``python experiments/extrapolation.py
--model-seeds 5``)."""

MODEL_SIZE_FEATURES: tuple[str, ...] = (
    "frac_dp", "log2_hidden_per_tp", "log2_ffn_per_tp", "log2_dp_mem_share", "mem_fraction")
"""Features that say which of the trained-on models a row belongs to: the hidden and FFN widths
per tensor-parallel device, the optimizer state's share of device memory and the share of
device memory a configuration fills follow the model's size, and the data-parallel share of
the step follows its gradient bytes. For configurations of a model in the training data they
separate that model's quirks (which layouts of it stall); for a model the predictor has not
seen, trees split on them as if on the name of a model it has, so
:data:`TRANSFER_FEATURE_NAMES` leaves them out. (With the memory share among the transfer
features, Ultra-Scale's 8B fitted on its 1B read a median APE of 33.3% over seeds 1-3, 23.3%
without it; vTrain fitted without its rows 21.8% over seeds 0-2, 17.9% without it: the memory
share also names the measured family's devices and carries its habits to another framework.)"""

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
        the parts of :func:`analytical_step_time`, ``core_parts`` and
        ``core_dp_well_tuned`` (the calibrated core's physics, see
        :func:`~paratune.models._calibration.core_parts`), ``memory_gb`` (analytical peak
        memory), ``memory_parts`` (what the memory core's constants multiply,
        :func:`memory_parts`),
        ``error`` (message per row: unknown hardware or option value; empty elsewhere) and
        ``hardware_error`` (its unknown-hardware part).
    """
    # the calibrated core's physics (imported here: it builds on this module)
    from paratune.models._calibration import core_parts, core_shares

    c = _cols(frame)
    times = analytical_step_time(c)
    total = times["step_time_s"]
    # the core's parts once per frame, for the shares below and the learned correction's base
    times["core_parts"] = core_parts(c, times)
    times["core_dp_well_tuned"] = hierarchical_dp_s(c, well_tuned=True)
    shares = core_shares(c, times)
    # the memory core's parts once per frame, for the estimate and each family's constants
    mem_parts = memory_parts(c)
    mem_gb = memory_core_gb(mem_parts)
    warmup = _warmup_slots(c)
    # Layer passes (one per layer of a stage and micro-batch slot) per analytical second: a
    # fixed cost per pass (kernel launches, per-micro-batch synchronisation) costs this
    # fraction of the step; it separates the slow regime of deep pipelines with many small
    # micro-batches from compute-bound configurations.
    layer_passes = c.layers_per_stage * (num_microbatches(c) + warmup)
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = {
            "frac_compute": shares["compute"],
            "frac_tp": shares["tp"],
            "frac_pp": shares["pp"],
            "frac_bubble": times["bubble_s"] / total,
            "frac_dp": shares["dp"],
            "log2_tokens_per_micro": np.log2(c.micro * c.seq_local),
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
    analytical["memory_parts"] = mem_parts
    analytical["error"] = c.error
    analytical["hardware_error"] = c.hardware_error  # the unknown-hardware part alone
    return matrix, analytical
