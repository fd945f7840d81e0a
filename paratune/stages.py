"""How a model's transformer layers split over pipeline stages.

One rule, for the workload that measures (:func:`paratune.profiler.pipeline.layer_ranges`)
and for the exports that launch (``tuner/_export*.py``): the predictions were measured on
this split, so a launch names the same one.
"""

from __future__ import annotations

from paratune.errors import ConfigError

__all__ = ["stage_layer_counts"]


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Transformer layers of each pipeline stage, in stage order: as even as possible, the
    earlier stages taking one layer more where ``num_stages`` does not divide ``num_layers``.

    Raises:
        ConfigError: fewer layers than stages.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError("pp", num_stages, f"{num_stages} pipeline stages need at least as "
                          f"many layers (num_layers={num_layers})")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]
