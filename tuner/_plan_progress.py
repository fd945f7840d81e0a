"""What a training-phase plan is cut into and the batches it weighs.

The reference run's progress, cut into stretches of one ``B_noise`` each, in minimal
examples (:func:`progress_segments`; the units are those of :mod:`paratune.tuner._plan`),
the single ``B_noise`` that ranks fixed configs as the whole run does
(:func:`effective_b_noise`), and the global batches of a plan that names none
(:func:`default_batch_range`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.tuner._efficiency import positive_int
from paratune.tuner._space_params import MAX_BATCH_SIZES, check_gpus
from paratune.tuner.gns_trajectory import Trajectory

if TYPE_CHECKING:
    from paratune.space import ConfigSpace
    from paratune.spec import ModelSpec

__all__ = ["Segment", "check_max_segments", "default_batch_range", "effective_b_noise",
           "progress_segments", "smallest_busy_batch"]


@dataclass
class Segment:
    """A stretch of training with one ``B_noise``."""

    start_tokens: float
    """Reference-run tokens where the stretch starts: the trajectory point that opens its
    first interval."""
    end_tokens: float
    """Reference-run tokens where it ends: the point that closes its last interval."""
    b_noise: float
    """``B_noise`` in sequences of the planned model (``seq_len`` given to
    :func:`progress_segments`)."""
    e_min: float
    """Minimal-batch sequences (of the planned model) this stretch is worth."""


def check_max_segments(max_segments: Any) -> int:
    """``max_segments`` as an ``int`` when it is an integer >= 1."""
    return positive_int("max_segments", max_segments, "must be an integer >= 1")


def progress_segments(trajectory: Trajectory, *, seq_len: int,
                      max_segments: int = 32, spacing: str = "auto") -> list[Segment]:
    """Cut the reference run into at most ``max_segments`` stretches of about equal tokens.

    Each interval between trajectory points takes the mean ``B_noise`` of its ends and goes
    whole to the stretch, of ``max_segments`` equal cuts of the run's tokens, that holds its
    midpoint; a stretch aggregates its intervals with the ``E_min``-weighted harmonic mean
    (the value that leaves the time of any fixed config unchanged). A stretch's
    ``start_tokens`` and ``end_tokens`` are the trajectory points that bound its intervals,
    the tokens its ``E_min`` covers (with unevenly spaced points, not the cut's edges), so
    the stretches follow one another without gap and cover the whole run.

    The trajectory's ``B_noise`` is in sequences of the measuring run; the noise scale is
    assumed to be a number of tokens, so it, the reference batch (the measuring run's tokens
    per step) and the progress are taken in tokens and returned in sequences of ``seq_len``
    tokens: ``B_noise = b_simple * seq_len_measured / seq_len``.

    Args:
        trajectory: ``B_noise`` along the reference run, with its ``seq_len`` known.
        seq_len: Tokens per sequence of the planned model.
        max_segments: Most stretches returned (>= 1).
        spacing: ``"linear"``: cuts of equal tokens; ``"log"``: cuts of equal ratio of
            tokens (a run that spans decades, such as a law's curve from 0.2B to 200B
            tokens, keeps its early training, where ``B_noise`` moves fastest, resolved);
            ``"auto"``: ``log`` where the trajectory starts above 0 tokens and spans at
            least a factor of 100, else ``linear``.

    Returns:
        The stretches, in order, in sequences of ``seq_len`` tokens.

    Raises:
        ConfigError: ``max_segments`` or ``seq_len`` is not a positive integer, the
            trajectory has fewer than two points, or its ``seq_len`` is unknown or does not
            divide its tokens per step.
    """
    max_segments = check_max_segments(max_segments)
    seq_len = positive_int("seq_len", seq_len)
    if len(trajectory) < 2:
        raise ConfigError("trajectory", trajectory.source, "needs at least two points")
    # in tokens, with the measuring run's own seq_len
    b_ref = trajectory.reference_batch() * trajectory.measured_seq_len()
    b_tok = trajectory.b_noise_tokens()
    tokens = trajectory.tokens
    b_mid_tok = 0.5 * (b_tok[1:] + b_tok[:-1])
    d_min_tok = np.diff(tokens) / (1.0 + b_ref / b_mid_tok)
    # in sequences of the planned model
    b_mid = b_mid_tok / seq_len
    d_min = d_min_tok / seq_len
    if spacing not in ("auto", "linear", "log"):
        raise ConfigError("spacing", spacing, "must be auto, linear or log")
    if spacing == "auto":
        spacing = "log" if tokens[0] > 0 and tokens[-1] >= 100 * tokens[0] else "linear"
    count = min(max_segments, len(d_min)) + 1
    if spacing == "log":
        if tokens[0] <= 0:
            raise ConfigError("spacing", spacing, "log spacing needs a trajectory that starts "
                              "above 0 tokens")
        edges = np.geomspace(tokens[0], tokens[-1], count)
        mids = np.sqrt(tokens[1:] * tokens[:-1])
    else:
        edges = np.linspace(tokens[0], tokens[-1], count)
        mids = 0.5 * (tokens[1:] + tokens[:-1])
    which = np.clip(np.searchsorted(edges, mids) - 1, 0, len(edges) - 2)
    segments = []
    for k in range(len(edges) - 1):
        # the midpoints increase, so a stretch's intervals are consecutive
        inside = np.flatnonzero(which == k)
        if not len(inside) or d_min[inside].sum() <= 0:
            continue
        e_min = float(d_min[inside].sum())
        b_noise = e_min / float((d_min[inside] / b_mid[inside]).sum())
        segments.append(Segment(float(tokens[inside[0]]), float(tokens[inside[-1] + 1]),
                                b_noise, e_min))
    return segments


def effective_b_noise(trajectory: Trajectory, *, seq_len: int) -> float:
    """The single ``B_noise`` that ranks fixed configs as the whole trajectory does.

    Args:
        trajectory: ``B_noise`` along the reference run, with its ``seq_len`` known.
        seq_len: Tokens per sequence of the planned model.

    Returns:
        ``B_noise`` in sequences of ``seq_len`` tokens (the noise scale is assumed to be a
        number of tokens; see :func:`progress_segments`).
    """
    segs = progress_segments(trajectory, seq_len=seq_len, max_segments=10**9)
    return sum(s.e_min for s in segs) / sum(s.e_min / s.b_noise for s in segs)


def smallest_busy_batch(model: ModelSpec, gpus: int, *, space: ConfigSpace | None = None,
                        devices_per_node: int = 8) -> int:
    """The smallest global batch with which some layout keeps every device busy.

    A layout ``(dp, tp, pp)`` runs at least one micro-batch on each data-parallel replica, so
    its smallest batch is ``dp * min(micro_batch_sizes)``; the smallest over the layouts the
    space allows (tp dividing the heads and the node, pp fitting the layers) is the batch
    range's floor. It is not the device count: on 4,096 devices a tp=8, pp=32 layout runs
    batch 16.

    Raises:
        ConfigError: ``gpus`` is not a positive integer, or no layout is valid.
    """
    from paratune.space import ConfigSpace

    gpus = check_gpus(gpus)
    options = space or ConfigSpace()
    mbs = min(options.micro_batch_sizes)
    best = None
    for (dp, tp, pp), reason in options.degrees(gpus, devices_per_node=devices_per_node):
        if reason is not None:
            continue
        probe = ParallelConfig(dp=dp, tp=tp, pp=pp, global_batch_size=dp * mbs,
                               micro_batch_size=mbs, schedule="gpipe")
        if probe.is_valid(model, gpus) and (best is None or dp * mbs < best):
            best = dp * mbs
    if best is None:
        raise ConfigError("gpus", gpus, f"no (dp, tp, pp) layout of {gpus} devices is valid for "
                          f"{model.name}")
    return int(best)


def default_batch_range(model: ModelSpec, gpus: int, b_noise: Any, *,
                        space: ConfigSpace | None = None, devices_per_node: int = 8
                        ) -> list[int]:
    """Global batch sizes of a plan that names none.

    From :func:`smallest_busy_batch` upwards in factors of two, to the first size at or above
    twice the largest ``B_noise`` (at most :data:`MAX_BATCH_SIZES` sizes): every batch the
    noise scale may ask for, down to the small batches of high tensor and pipeline
    parallelism.

    Args:
        model: The planned model.
        gpus: Devices in the job.
        b_noise: ``B_noise`` along training, in sequences of ``model.seq_len``.
        space: Options (micro-batch sizes, degree lists) of the search.
        devices_per_node: Node size (tensor parallelism stays inside a node).
    """
    low = smallest_busy_batch(model, gpus, space=space, devices_per_node=devices_per_node)
    top = 2.0 * float(np.max(np.asarray(b_noise, dtype=float)))
    batches = [low]
    while batches[-1] < top and len(batches) < MAX_BATCH_SIZES:
        batches.append(batches[-1] * 2)
    return batches
