"""The two-batch estimator of the gradient noise scale (McCandlish et al. 2018, appendix A.1).

With ``|g_small|^2`` the squared norm of a gradient averaged over ``B_small`` examples and
``|g_big|^2`` that over ``B_big``, ``E|g_B|^2 = |G|^2 + tr(Sigma) / B`` gives the unbiased
estimates

* ``|G|^2    = (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)``
* ``tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)``.

Each is noisy step to step, so each is smoothed with a bias-corrected exponential moving
average before the ratio is taken (a ratio of averages, not an average of ratios). Plain
arithmetic: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from paratune.errors import ConfigError


def unbiased_norms(small_sqnorm: float, big_sqnorm: float, b_small: float,
                   b_big: float) -> tuple[float, float]:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from a small- and a big-batch squared norm.

    Args:
        small_sqnorm: ``|g|^2`` of a gradient averaged over ``b_small`` examples (or the mean
            of several such squared norms, which is still unbiased and less noisy).
        big_sqnorm: ``|g|^2`` of the gradient averaged over ``b_big`` examples.
        b_small: Small batch size.
        b_big: Big batch size, larger than ``b_small``.

    Returns:
        ``(g2, trace)``: estimates of ``|G|^2`` and ``tr(Sigma)`` (either may be negative on a
        single step; their averages are not).

    Raises:
        ConfigError: ``b_small`` is not positive or ``b_big <= b_small``.
    """
    if not b_small > 0:
        raise ConfigError("b_small", b_small, "must be positive")
    if not b_big > b_small:
        raise ConfigError("b_big", b_big, f"must be larger than b_small={b_small} (the "
                          "two-batch estimator needs two different batch sizes)")
    g2 = (b_big * big_sqnorm - b_small * small_sqnorm) / (b_big - b_small)
    trace = (small_sqnorm - big_sqnorm) / (1.0 / b_small - 1.0 / b_big)
    return float(g2), float(trace)


@dataclass(frozen=True)
class GNSEstimate:
    """One update of :class:`GradientNoiseScale`."""

    g2: float
    """This step's unbiased estimate of ``|G|^2``."""
    trace: float
    """This step's unbiased estimate of ``tr(Sigma)``."""
    g2_ema: float
    """Bias-corrected moving average of ``g2``."""
    trace_ema: float
    """Bias-corrected moving average of ``trace``."""
    b_simple: float
    """``trace_ema / g2_ema`` in examples (NaN while ``g2_ema <= 0``)."""
    num_updates: int
    """Updates so far, this one included."""


class GradientNoiseScale:
    """Moving averages of ``|G|^2`` and ``tr(Sigma)`` and their ratio ``B_simple``.

    Args:
        beta: Decay of the exponential moving averages (``0 <= beta < 1``); the estimate
            averages over roughly ``1 / (1 - beta)`` steps.
    """

    def __init__(self, *, beta: float = 0.95) -> None:
        if not 0.0 <= beta < 1.0:
            raise ConfigError("beta", beta, "must be in [0, 1)")
        self.beta = beta
        self.g2_avg_ = 0.0
        self.trace_avg_ = 0.0
        self.num_updates_ = 0

    def update(self, small_sqnorm: float, big_sqnorm: float, b_small: float,
               b_big: float) -> GNSEstimate:
        """Fold in one step's squared norms.

        Args:
            small_sqnorm: Mean squared norm of the small-batch gradients.
            big_sqnorm: Squared norm of the big-batch (full) gradient.
            b_small: Examples per small batch.
            b_big: Examples in the big batch.

        Returns:
            The updated estimate.

        Raises:
            ConfigError: on bad batch sizes (see :func:`unbiased_norms`) or a non-finite norm.
        """
        for name, value in (("small_sqnorm", small_sqnorm), ("big_sqnorm", big_sqnorm)):
            if not math.isfinite(value):
                raise ConfigError(name, value, "must be finite")
        g2, trace = unbiased_norms(small_sqnorm, big_sqnorm, b_small, b_big)
        self.g2_avg_ = self.beta * self.g2_avg_ + (1.0 - self.beta) * g2
        self.trace_avg_ = self.beta * self.trace_avg_ + (1.0 - self.beta) * trace
        self.num_updates_ += 1
        return self.estimate(g2=g2, trace=trace)

    def estimate(self, *, g2: float = math.nan, trace: float = math.nan) -> GNSEstimate:
        """The current smoothed estimate (``g2``/``trace`` fill the per-step fields)."""
        if self.num_updates_ == 0:
            return GNSEstimate(g2, trace, math.nan, math.nan, math.nan, 0)
        correction = 1.0 - self.beta ** self.num_updates_
        g2_ema = self.g2_avg_ / correction
        trace_ema = self.trace_avg_ / correction
        b_simple = trace_ema / g2_ema if g2_ema > 0 else math.nan
        return GNSEstimate(g2, trace, g2_ema, trace_ema, b_simple, self.num_updates_)

    @property
    def b_simple(self) -> float:
        return self.estimate().b_simple

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, so a resumed or reconfigured run keeps its averages."""
        return {"beta": self.beta, "g2_avg": self.g2_avg_, "trace_avg": self.trace_avg_,
                "num_updates": self.num_updates_}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.g2_avg_ = float(state["g2_avg"])
        self.trace_avg_ = float(state["trace_avg"])
        self.num_updates_ = int(state["num_updates"])


def estimate_dict(estimate: GNSEstimate) -> dict[str, float]:
    """A flat dict of an estimate (for tables and MLflow metrics)."""
    return {k: float(v) for k, v in asdict(estimate).items()}
