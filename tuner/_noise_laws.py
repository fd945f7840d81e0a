"""Published critical-batch laws and the loss curves they are read along: a ``B_noise``
trajectory without a measurement (``--law``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratune.errors import ConfigError
from paratune.tuner._efficiency import positive_int
from paratune.tuner._trajectory import Trajectory, read_table

__all__ = ["CHINCHILLA", "NOISE_LAWS", "LossCurve", "NoiseLaw", "chinchilla_loss_curve",
           "get_law", "law_trajectory", "load_loss_curve"]


@dataclass(frozen=True)
class NoiseLaw:
    """A published critical-batch law ``B_crit(L) = b_star_tokens / L**exponent`` (tokens).

    The planner uses ``B_crit`` for ``B_noise`` (McCandlish et al. 2018 find the two close).
    """

    name: str
    """Option name (``--law``)."""
    b_star_tokens: float
    """``B*``: the critical batch, in tokens, at a loss of 1 nat per token."""
    exponent: float
    """Power of the loss: ``0`` for a constant."""
    source: str
    """Where the law and its constants come from."""
    uncertainty: float = 2.0
    """Multiplicative band taken around ``B_crit`` for intervals: the law holds within a
    factor ``uncertainty`` either way."""

    def b_crit_tokens(self, loss: Any) -> np.ndarray:
        """``B_crit`` in tokens at each ``loss`` (nats per token, positive)."""
        loss = np.asarray(loss, dtype=float)
        if not np.all(np.isfinite(loss) & (loss > 0)):
            raise ConfigError("loss", loss.tolist()[:5], "must be positive, finite nats per "
                              "token for a critical-batch law")
        return self.b_star_tokens / loss ** self.exponent

    def scaled(self, factor: float) -> NoiseLaw:
        """The same law with ``B*`` multiplied by ``factor`` (an interval's end)."""
        return NoiseLaw(name=f"{self.name}x{factor:g}", b_star_tokens=self.b_star_tokens * factor,
                        exponent=self.exponent, source=self.source,
                        uncertainty=self.uncertainty)

    def describe(self) -> str:
        if self.exponent == 0:
            return f"{self.name}: B_crit = {self.b_star_tokens:.4g} tokens ({self.source})"
        return (f"{self.name}: B_crit = {self.b_star_tokens:.4g} tokens / L^{self.exponent:.4g} "
                f"({self.source})")


NOISE_LAWS: dict[str, NoiseLaw] = {
    "kaplan2020": NoiseLaw(
        name="kaplan2020", b_star_tokens=2e8, exponent=1 / 0.21,
        source="Kaplan et al. 2020, Scaling Laws for Neural Language Models, eq. 5.3: "
               "B_crit(L) = B* / L^(1/alpha_B), B* ~ 2e8 tokens, alpha_B ~ 0.21 (WebText2, "
               "loss in nats per token)"),
    "minicpm2024": NoiseLaw(
        name="minicpm2024", b_star_tokens=1.21e9, exponent=6.24,
        source="Hu et al. 2024, MiniCPM (arXiv 2404.06395), sec. 4.2: optimal batch "
               "bs = 1.21e9 / L^6.24 tokens"),
}
"""The named critical-batch laws; ``constant:TOKENS`` is the third kind (:func:`get_law`)."""

CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
"""Hoffmann et al. 2022 (Chinchilla), approach 3: ``L(N, D) = E + A / N^alpha + B / D^beta``
(N parameters, D tokens, loss in nats per token)."""


def get_law(text: str | NoiseLaw) -> NoiseLaw:
    """A law by name: ``kaplan2020``, ``minicpm2024`` or ``constant:TOKENS``.

    Raises:
        ConfigError: an unknown name, or a constant that is not a positive number of tokens.
    """
    if isinstance(text, NoiseLaw):
        return text
    name = str(text).strip().lower()
    if name in NOISE_LAWS:
        return NOISE_LAWS[name]
    if name.startswith("constant:"):
        try:
            value = float(name.split(":", 1)[1])
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError("law", text, "constant:TOKENS needs a positive number of tokens, "
                              "e.g. constant:4e6")
        return NoiseLaw(name=f"constant:{value:g}", b_star_tokens=value, exponent=0.0,
                        source="a constant critical batch given by the user")
    raise ConfigError("law", text, f"must be one of {', '.join(NOISE_LAWS)} or "
                      "constant:TOKENS")


@dataclass(frozen=True)
class LossCurve:
    """Loss (nats per token) against tokens seen, of a run at a batch well below ``B_crit``
    (so that its tokens are McCandlish's minimal examples)."""

    tokens: np.ndarray
    loss: np.ndarray
    source: str = ""

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=float)
        loss = np.asarray(self.loss, dtype=float)
        if len(tokens) < 2 or len(tokens) != len(loss):
            raise ConfigError("loss_curve", self.source, "needs at least two (tokens, loss) "
                              "points of equal count")
        if not (np.all(np.isfinite(tokens)) and np.all(np.diff(tokens) > 0) and tokens[0] >= 0):
            raise ConfigError("loss_curve", self.source, "tokens must be finite, >= 0 and "
                              "increasing")
        if not np.all(np.isfinite(loss) & (loss > 0)):
            raise ConfigError("loss_curve", self.source, "loss must be positive and finite")

    def loss_at(self, tokens: Any) -> np.ndarray:
        return np.interp(np.asarray(tokens, dtype=float), self.tokens, self.loss)


def chinchilla_loss_curve(num_params: float, *, tokens_from: float = 2e8,
                          tokens_to: float = 2e11, points: int = 200,
                          constants: dict[str, float] | None = None) -> LossCurve:
    """The loss of a ``num_params`` model along :data:`CHINCHILLA`'s fit, from ``tokens_from``
    to ``tokens_to`` tokens (log-spaced points).

    Raises:
        ConfigError: a bound is not positive, or ``tokens_to <= tokens_from``.
    """
    c = {**CHINCHILLA, **(constants or {})}
    if not (num_params > 0 and tokens_from > 0 and tokens_to > tokens_from):
        raise ConfigError("tokens", f"{tokens_from:g}:{tokens_to:g}",
                          "needs 0 < tokens_from < tokens_to and a positive parameter count")
    tokens = np.geomspace(tokens_from, tokens_to, points)
    loss = c["E"] + c["A"] / num_params ** c["alpha"] + c["B"] / tokens ** c["beta"]
    return LossCurve(tokens=tokens, loss=loss,
                     source=f"chinchilla fit, N={num_params:.3g}, {tokens_from:.3g} to "
                            f"{tokens_to:.3g} tokens")


def load_loss_curve(path: str | Path) -> LossCurve:
    """A loss curve from a CSV/JSON/JSONL/parquet file with columns ``tokens, loss``.

    Raises:
        ConfigError: the file is missing or unreadable, lacks a column, or its points are not
            usable (see :class:`LossCurve`).
    """
    import pandas as pd

    frame = read_table(path, field="loss_curve", required=("tokens", "loss"))
    frame = frame[["tokens", "loss"]].apply(pd.to_numeric, errors="coerce").dropna()
    frame = frame.sort_values("tokens").drop_duplicates("tokens")
    return LossCurve(tokens=frame["tokens"].to_numpy(float), loss=frame["loss"].to_numpy(float),
                     source=str(path))


def law_trajectory(law: NoiseLaw | str, curve: LossCurve, *, seq_len: int) -> Trajectory:
    """The ``B_noise`` trajectory a law gives along a loss curve.

    ``B_noise`` at each point is ``B_crit(loss)`` in sequences of ``seq_len`` tokens; the
    curve is taken as that of a run at one sequence per step (far below ``B_crit``), so its
    tokens are minimal examples and the planner's progress is the curve's tokens.

    Raises:
        ConfigError: ``seq_len`` is not a positive integer, or the law or curve is invalid.
    """
    law = get_law(law)
    seq_len = positive_int("seq_len", seq_len)
    b_tokens = law.b_crit_tokens(curve.loss)
    tokens = np.asarray(curve.tokens, dtype=float)
    return Trajectory(step=tokens / seq_len, tokens=tokens, b_noise=b_tokens / seq_len,
                      loss=np.asarray(curve.loss, dtype=float),
                      source=f"{law.name} over {curve.source}", seq_len=int(seq_len))
