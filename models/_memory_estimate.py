"""The analytical peak-memory estimate per device: weights, gradients, optimizer state and
activations (mixed-precision Adam, sharded by ZeRO stage; activations after Korthikanti et al.),
and its calibrated form, a few constants per measurement family.

The calibrated memory core is

    memory = states * k_s + activations * k_a + logits * k_l + overhead_gb

on the fuller of a pipeline's first and last stage, with ``states`` the weights, gradients
and optimizer state, ``activations`` those of the layers and ``logits`` the loss's over the
vocabulary, which the last stage holds (:func:`memory_parts`, :func:`memory_core_gb`).

A framework keeps more than the formula counts in places of its own: nanotron kept 1.2-2.0x
the estimate on 1B configurations whose activations or logits dominate and 0.8-1.0x where
the optimizer state does (fp32 copies of the logits, buffers the formula has no term for).
A learned ratio over the whole estimate, fitted on a small model, carries the small model's
mix to a larger one, whose memory is mostly states: fitted on nanotron's 1B it read the 8B's
peaks 11% low in the median, and a configuration at 71.5 GB of 80 at 61. The constants
multiply each part apart, so a larger model moves the estimate the way its parts do. They
are fitted per family with :data:`MEMORY_MIN_ROWS` runs that report memory or more, by a
soft-L1 loss on the log peak (robust to the odd run, like the step time's core, see
:mod:`paratune.models._calibration`); a family without them keeps the analytical estimate
(:data:`DEFAULT_MEMORY_CONSTANTS`)."""

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
    """Peak activation bytes on the fullest device, the loss's logits included (the larger
    of the first and the last pipeline stage's, see :func:`_stage_activation_bytes`)."""
    (first_layers, first_logits), (last_layers, last_logits) = _stage_activation_bytes(
        _cols(frame))
    return np.maximum(first_layers + first_logits, last_layers + last_logits)


def _stage_activation_bytes(c: Columns) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The activation bytes of the first and the last pipeline stage (one and the same
    without a pipeline), each as its layers' and the loss's logits': ``((first_layers,
    first_logits), (last_layers, last_logits))``.

    Each micro-batch in flight *stores* its layers' activations (under full recomputation
    only each layer's input); full recomputation adds the *working set* of the one layer
    being recomputed, once whatever the micro-batches in flight. Micro-batches in flight:
    all of them under GPipe, ``min(pp, num_microbatches)`` on the first rank under 1F1B (a
    little more when interleaved). The last rank holds one micro-batch's activations and
    logits (fp32 for the loss: 4 bytes per vocabulary entry) under 1F1B, every micro-batch's
    under GPipe.
    """
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
    logit_bytes = tokens * c.vocab / c.tp * 4.0
    pipeline = c.pp > 1
    last_share = np.where(gpipe, n_micro, 1.0)
    first = (np.where(pipeline, stored * in_flight, stored) + working,
             np.where(pipeline, 0.0, logit_bytes))
    last = (np.where(pipeline, last_share * stored, stored) + working,
            np.where(pipeline, last_share, 1.0) * logit_bytes)
    return first, last


def analytical_memory_gb(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Estimated peak memory per device in GB: weights, gradients, optimizer, activations and
    :data:`MEMORY_OVERHEAD_GB` (:func:`memory_core_gb` at :data:`DEFAULT_MEMORY_CONSTANTS`)."""
    return memory_core_gb(memory_parts(frame))


MEMORY_CONSTANT_NAMES = ("states", "activations", "logits", "overhead_gb")
"""The calibrated memory core's constants: the multipliers of the model states, the layers'
activations and the loss's logits, and the GB every device holds besides."""
DEFAULT_MEMORY_CONSTANTS = {"states": 1.0, "activations": 1.0, "logits": 1.0,
                            "overhead_gb": MEMORY_OVERHEAD_GB}
"""The analytical estimate's constants, for a family without its own."""
MEMORY_MIN_ROWS = 20
"""Runs that report memory a family needs for its own memory constants (as many as its step
time's, :data:`~paratune.models._calibration.MIN_ROWS`, for four constants rather than
eleven: one node's campaign is enough)."""
_DEFAULTS = np.array([DEFAULT_MEMORY_CONSTANTS[name] for name in MEMORY_CONSTANT_NAMES])
_DEFAULTS.flags.writeable = False
_MEMORY_LOWER = np.array([0.5, 0.5, 0.5, 0.0])
_MEMORY_UPPER = np.array([4.0, 4.0, 4.0, 20.0])


def default_memory_constants() -> np.ndarray:
    """:data:`DEFAULT_MEMORY_CONSTANTS` in the order of :data:`MEMORY_CONSTANT_NAMES`."""
    return _DEFAULTS


def memory_parts(frame: pd.DataFrame | Columns) -> np.ndarray:
    """What the memory constants multiply, per row and pipeline stage, in GB: the model states
    (weights, gradients and optimizer state of the fullest stage), the layers' activations,
    the loss's logits and 1, on the first and on the last stage (``(n, 2, 4)``: rows, the
    two stages, :data:`MEMORY_CONSTANT_NAMES`). The peak is the fuller stage's
    (:func:`memory_core_gb`): the logits sit on the last stage of a pipeline, so a family
    that keeps more of them than the formula can peak there where the formula says the
    first stage."""
    c = _cols(frame)
    parts = np.empty((c.n, 2, 4))
    parts[:, :, 0] = ((parameter_memory_bytes(c) + gradient_memory_bytes(c)
                       + optimizer_memory_bytes(c)) / 1e9)[:, None]
    for stage, (layers, logits) in enumerate(_stage_activation_bytes(c)):
        parts[:, stage, 1] = layers / 1e9
        parts[:, stage, 2] = logits / 1e9
    parts[:, :, 3] = 1.0
    return parts


def memory_core_gb(parts: np.ndarray, constants: np.ndarray | None = None) -> np.ndarray:
    """The memory core's peak per row in GB: the fuller stage of :func:`memory_parts`
    ``parts`` times ``constants`` (one row of :data:`MEMORY_CONSTANT_NAMES` per row, one for
    all, or ``None``: the analytical estimate's)."""
    constants = _DEFAULTS if constants is None else np.asarray(constants, dtype=float)
    per_stage = (parts @ constants if constants.ndim == 1
                 else np.einsum("nsk,nk->ns", parts, constants))
    return per_stage.max(axis=1)


def fit_memory_constants(parts: np.ndarray, memory_gb: np.ndarray) -> np.ndarray:
    """The memory constants that fit the measured peaks ``memory_gb`` (finite, positive) of
    rows with :func:`memory_parts` ``parts`` (finite) best: soft-L1 on the log of the
    fuller stage's peak (:func:`memory_core_gb`), within bounds
    (each part at half to four times the formula, 0-20 GB besides), from the analytical
    estimate's. A part that is zero on every row keeps its default."""
    from scipy.optimize import least_squares

    used = np.any(parts > 0, axis=(0, 1))
    start = np.clip(_DEFAULTS, _MEMORY_LOWER + 1e-9, _MEMORY_UPPER - 1e-9)
    log_mem = np.log(memory_gb)

    def residual(theta: np.ndarray) -> np.ndarray:
        peak = memory_core_gb(parts, np.where(used, theta, start))
        return np.log(np.maximum(peak, 1e-9)) - log_mem

    result = least_squares(residual, start, loss="soft_l1", f_scale=0.1,
                           bounds=(_MEMORY_LOWER, _MEMORY_UPPER), max_nfev=200)
    return np.where(used, result.x, _DEFAULTS)
