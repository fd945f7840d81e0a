"""The analytical peak-memory estimate per device: weights, gradients, optimizer state and
activations (mixed-precision Adam, sharded by ZeRO stage; activations after Korthikanti et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paratune.models._feature_columns import _SCHEDULES, Columns, _cols, num_microbatches
from paratune.models._step_time import ACTIVATION_BYTES, _stage_params

if TYPE_CHECKING:
    import pandas as pd

MEMORY_OVERHEAD_GB = 2.0
"""CUDA context, NCCL buffers and allocator slack added to every device's estimate."""


def parameter_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """bf16 weights on the fullest device (sharded over dp under ZeRO-3)."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 3, c.dp_group, 1.0)
    return _stage_params(c) / c.tp * 2.0 / shard


def gradient_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """fp32 gradient accumulation buffers on the fullest device (sharded over dp under ZeRO-2
    and -3)."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 2, c.dp_group, 1.0)
    return _stage_params(c) / c.tp * 4.0 / shard


def optimizer_memory_bytes(frame: pd.DataFrame | Columns) -> np.ndarray:
    """fp32 master weights and Adam moments (12 bytes/param), sharded over dp from ZeRO-1."""
    c = _cols(frame)
    shard = np.where(c.sharding >= 1, c.dp_group, 1.0)
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
    tokens = c.micro * c.seq_local
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
