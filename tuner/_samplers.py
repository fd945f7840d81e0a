"""Optuna samplers by name: a registry of factories, so that a new sampler is one entry."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError

if TYPE_CHECKING:
    import optuna

__all__ = ["SAMPLERS", "check_sampler", "make_sampler", "sampler_name"]


def _tpe(seed: int | None) -> optuna.samplers.BaseSampler:
    import optuna

    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                      n_startup_trials=20)


def _plain(name: str) -> Callable[[int | None], optuna.samplers.BaseSampler]:
    def make(seed: int | None) -> optuna.samplers.BaseSampler:
        import optuna

        return getattr(optuna.samplers, name)(seed=seed)

    return make


_REGISTRY: dict[str, Callable[[int | None], Any]] = {
    "tpe": _tpe,
    "random": _plain("RandomSampler"),
    "gp": _plain("GPSampler"),
    "qmc": _plain("QMCSampler"),
    "nsga2": _plain("NSGAIISampler"),
}
_ALIASES = {"nsgaii": "nsga2"}

SAMPLERS = tuple(_REGISTRY)
"""Optuna samplers selectable by name (``tpe`` is multivariate, grouped TPE)."""


def check_sampler(name: str) -> str:
    """The registry's name of sampler ``name`` (case-insensitive, aliases resolved).

    Raises:
        ConfigError: no sampler of that name.
    """
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ConfigError("sampler", name, f"must be one of {', '.join(SAMPLERS)}")
    return key


def sampler_name(sampler: Any) -> str:
    """How a sampler is named in a study's name and a run's params: its registry name, or
    the class name of a sampler given as an instance."""
    return check_sampler(sampler) if isinstance(sampler, str) else type(sampler).__name__


def make_sampler(sampler: Any, *, seed: int | None) -> optuna.samplers.BaseSampler:
    """An Optuna sampler from a name in :data:`SAMPLERS` (seeded with ``seed``), or the
    sampler instance given (used as it is; ``seed`` does not apply).

    Constraints reach the samplers that use them (TPE, GP, NSGA-II) through each trial's
    ``set_constraint`` values (predicted infeasibility and memory over the limit).

    Raises:
        ConfigError: an unknown name.
    """
    if not isinstance(sampler, str):
        if not hasattr(sampler, "sample_relative"):
            raise ConfigError("sampler", type(sampler).__name__,
                              f"must be an Optuna sampler or one of {', '.join(SAMPLERS)}")
        return sampler
    import optuna

    factory = _REGISTRY[check_sampler(sampler)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return factory(seed)
