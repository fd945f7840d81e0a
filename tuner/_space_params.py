"""The sampled parameters of a search in text: the global batch sizes (a list or a range
expression), the device count, and the schedule labels (``interleaved_1f1b-v2``) a trial
draws."""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence

from paratune.errors import ConfigError
from paratune.parallel import MAX_DEVICES, MAX_GLOBAL_BATCH, Schedule, check_magnitude

__all__ = ["MAX_BATCH_SIZES", "MEMORY_KNOBS", "check_gpus", "parse_batch_sizes",
           "parse_schedule_label", "schedule_label"]

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*(?::\s*(x?)(\d+)\s*)?$")


def check_gpus(gpus: object) -> int:
    """``gpus`` as an ``int`` when it is a positive integer.

    Raises:
        ConfigError: ``gpus`` is not a positive integer (``0``, ``-8``, ``2.5``, ``True``).
    """
    if (isinstance(gpus, bool) or type(gpus).__name__ == "bool_"
            or not isinstance(gpus, numbers.Real | str)):
        raise ConfigError("gpus", gpus, "must be a positive integer")
    try:
        number = float(gpus)
    except ValueError:
        raise ConfigError("gpus", gpus, "must be a positive integer") from None
    if not number.is_integer() or number < 1:
        raise ConfigError("gpus", gpus, "must be a positive integer")
    return check_magnitude("gpus", int(number), MAX_DEVICES)


MAX_BATCH_SIZES = 64
"""The most global batch sizes one search takes."""


def parse_batch_sizes(text: str | int | Sequence[int]) -> tuple[int, ...]:
    """Global batch sizes from a list or a range expression.

    Accepted forms: ``512``; ``"256,512,1024"``; ``"256:2048"`` (the powers of two from the
    smallest one >= 256 up to 2048: ``"100:1000"`` is 128, 256, 512); ``"256:2048:x2"``
    (geometric from ``lo``, factor 2: ``"96:1024:x2"`` is 96, 192, 384, 768);
    ``"256:1024:256"`` (arithmetic step from ``lo``). At most :data:`MAX_BATCH_SIZES` sizes.

    Raises:
        ConfigError: ``global_batch_sizes`` is malformed, empty or longer than
            :data:`MAX_BATCH_SIZES`.
    """
    if isinstance(text, str):
        match = _RANGE.match(text)
        if match:
            values = _batch_range(text, match)
        else:
            try:
                values = [int(v) for v in text.replace(" ", "").split(",") if v]
            except ValueError:
                raise ConfigError("global_batch_sizes", text,
                                  "must be integers: '512', '256,512' or a range "
                                  "'256:2048[:x2|:step]'") from None
    else:
        items = [text] if isinstance(text, numbers.Real) else list(text)
        bad = [v for v in items if isinstance(v, bool) or type(v).__name__ == "bool_"
               or not isinstance(v, numbers.Real) or not float(v).is_integer()]
        if bad:
            raise ConfigError("global_batch_sizes", bad[0],
                              "batch sizes must be integers (sequences per step)")
        values = [int(v) for v in items]
    if not values:
        raise ConfigError("global_batch_sizes", text, "must list at least one batch size")
    if any(v < 1 for v in values):
        raise ConfigError("global_batch_sizes", text, "batch sizes must be positive")
    values = sorted(set(values))
    if len(values) > MAX_BATCH_SIZES:
        raise ConfigError("global_batch_sizes", text, _too_many(len(values)))
    if values[-1] > MAX_GLOBAL_BATCH:
        raise ConfigError("global_batch_sizes", text, f"batch size {values[-1]} is beyond the "
                          f"plausible range (at most {MAX_GLOBAL_BATCH} sequences)")
    return tuple(values)


def _too_many(count: int) -> str:
    return (f"gives {count} batch sizes; at most {MAX_BATCH_SIZES} are searched (narrow the "
            "range or take a larger step)")


def _batch_range(text: str, match: re.Match[str]) -> list[int]:
    """The sizes of a range ``lo:hi``, ``lo:hi:xF`` or ``lo:hi:STEP`` (see
    :func:`parse_batch_sizes`), counted before they are built."""
    lo, hi = int(match.group(1)), int(match.group(2))
    factor = match.group(3) == "x"
    step = int(match.group(4)) if match.group(4) is not None else None
    if lo < 1 or hi < lo or (step is not None and step < (2 if factor else 1)):
        raise ConfigError("global_batch_sizes", text,
                          "a range lo:hi[:step|:xfactor] needs 1 <= lo <= hi and "
                          "step >= 1 (factor >= 2)")
    if step is None:  # lo:hi: the powers of two in [lo, hi]
        first = 1 << (lo - 1).bit_length()
        if first > hi:
            raise ConfigError("global_batch_sizes", text,
                              f"a range lo:hi is the powers of two from lo to hi, and there "
                              f"is none between {lo} and {hi} (list the sizes instead)")
        count = hi.bit_length() - first.bit_length() + 1
        if count > MAX_BATCH_SIZES:
            raise ConfigError("global_batch_sizes", text, _too_many(count))
        return [first << i for i in range(count)]
    if not factor:  # lo:hi:STEP: arithmetic
        count = (hi - lo) // step + 1
        if count > MAX_BATCH_SIZES:
            raise ConfigError("global_batch_sizes", text, _too_many(count))
        return [lo + i * step for i in range(count)]
    values, v = [], lo  # lo:hi:xF: geometric from lo (at most log2(hi) terms)
    while v <= hi:
        values.append(v)
        v *= step
    if len(values) > MAX_BATCH_SIZES:
        raise ConfigError("global_batch_sizes", text, _too_many(len(values)))
    return values


MEMORY_KNOBS = ("micro_batch_size_index", "schedule", "sharding_index", "recompute_index")
"""The trial parameters that trade memory for speed (they also move in pairs)."""


def schedule_label(schedule: Schedule, virtual_stages: int) -> str:
    if schedule is Schedule.INTERLEAVED_1F1B:
        return f"{schedule.value}-v{virtual_stages}"
    return schedule.value


def parse_schedule_label(label: str) -> tuple[Schedule, int]:
    if label.startswith(Schedule.INTERLEAVED_1F1B.value):
        return Schedule.INTERLEAVED_1F1B, int(label.rsplit("-v", 1)[1])
    return Schedule(label), 1
