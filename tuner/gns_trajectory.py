"""Reading a gradient-noise-scale trajectory: ``B_noise`` over training progress.

The measurement (``paratune gns``) writes one row per measurement point with the columns
``step, tokens, loss, b_simple`` (then the estimator's parts and, from the current format on,
``seq_len``): the optimizer step and tokens seen so far in the reference run, the training
loss there, and the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al.
2018, eq. 2.8) in sequences *of the run that measured it*, whose tokens per sequence the
``seq_len`` column records. CSV, JSON (a list of records, a mapping of column -> list, or
``{"rows": [...]}``), JSON lines and parquet are accepted.

Units: the noise scale is taken to be a number of tokens (an "example" is a token, so
``B_noise`` in tokens does not depend on how the tokens are cut into sequences). A value
measured in sequences of ``seq_len_measured`` tokens is therefore worth
``b_simple * seq_len_measured / seq_len_target`` sequences of a model trained with
``seq_len_target`` tokens per sequence (:meth:`Trajectory.b_noise_in`). A file without a
``seq_len`` column cannot be converted until the measuring run's ``seq_len`` is given.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratune.errors import ConfigError

__all__ = ["CHINCHILLA", "NOISE_LAWS", "REQUIRED_COLUMNS", "LossCurve", "NoiseLaw", "Trajectory",
           "chinchilla_loss_curve", "get_law", "law_trajectory", "load_loss_curve",
           "load_trajectory"]

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("step", "tokens", "b_simple")
"""Columns every trajectory must have; ``loss``, ``seq_len`` and the estimator's parts
``g2_ema, trace_ema`` are optional."""

_WHOLE_BATCH_RTOL = 1e-6
_WHOLE_BATCH_ATOL = 1e-2
"""How far (relative, and at most in sequences) the reference run's sequences per step may
be from a whole number, for the rounding of token counts written as floats."""

_NEEDS_SEQ_LEN = ("needs a seq_len column or --trajectory-seq-len N: the tokens per sequence "
                  "of the run that measured it, to convert its b_simple (in that run's "
                  "sequences) to the planned model's sequences")


@dataclass(frozen=True)
class Trajectory:
    """``B_noise`` along a reference run, sorted by tokens seen."""

    step: np.ndarray
    """Optimizer step of each point."""
    tokens: np.ndarray
    """Tokens seen by the reference run at each point."""
    b_noise: np.ndarray
    """Gradient noise scale (``b_simple``) at each point, in sequences of the reference run
    (``seq_len`` tokens each); :meth:`b_noise_in` converts."""
    loss: np.ndarray
    """Training loss at each point (NaN where not recorded)."""
    source: str = ""
    """Where it was read from."""
    seq_len: int | None = None
    """Tokens per sequence of the reference run (``None``: unknown, and then nothing that
    needs sequences of another length can be derived)."""
    num_clamped: int = 0
    """Rows whose ``b_simple`` was not a positive number and took a clamped value (see
    :func:`load_trajectory`)."""

    def __post_init__(self) -> None:
        """Refuse points the planner cannot use (:func:`load_trajectory` clamps a file's
        non-positive ``b_simple`` before it gets here): a ``B_noise`` that is not a positive
        number would end as NaN or a silently wrong noise scale downstream."""
        where = self.source or "Trajectory"
        arrays = {"step": self.step, "tokens": self.tokens, "b_noise": self.b_noise,
                  "loss": self.loss}
        lengths = {name: len(np.atleast_1d(values)) for name, values in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError("trajectory", where, f"columns of different lengths {lengths}")
        b_noise = np.asarray(self.b_noise, dtype=float)
        bad = np.flatnonzero(~(np.isfinite(b_noise) & (b_noise > 0)))
        if len(bad):
            raise ConfigError("trajectory", where, f"b_noise must be a positive number at "
                                                   f"every point; point {int(bad[0])} is "
                                                   f"{float(b_noise[bad[0]])!r}")
        tokens = np.asarray(self.tokens, dtype=float)
        if not np.isfinite(tokens).all() or (np.diff(tokens) < 0).any():
            raise ConfigError("trajectory", where, "tokens must be finite and sorted "
                                                   "(non-decreasing)")

    def __len__(self) -> int:
        return len(self.tokens)

    def measured_seq_len(self) -> int:
        """The reference run's tokens per sequence.

        Raises:
            ConfigError: the trajectory does not record it.
        """
        if self.seq_len is None:
            raise ConfigError("trajectory", self.source, _NEEDS_SEQ_LEN)
        return int(self.seq_len)

    def b_noise_tokens(self) -> np.ndarray:
        """``B_noise`` at each point in tokens (the unit in which it is assumed to transfer
        between sequence lengths)."""
        return self.b_noise * self.measured_seq_len()

    def b_noise_in(self, seq_len: int) -> np.ndarray:
        """``B_noise`` at each point in sequences of ``seq_len`` tokens:
        ``b_simple * seq_len_measured / seq_len``."""
        return self.b_noise_tokens() / seq_len

    def reference_batch_tokens(self) -> float:
        """Tokens per optimizer step of the reference run (median over intervals)."""
        d_step = np.diff(self.step)
        d_tok = np.diff(self.tokens)
        ok = d_step > 0
        if not ok.any():
            raise ConfigError("trajectory", self.source,
                              "needs at least two points with increasing step")
        return float(np.median(d_tok[ok] / d_step[ok]))

    def reference_batch(self) -> float:
        """Sequences per optimizer step of the reference run, in its own sequences.

        Raises:
            ConfigError: ``seq_len`` is unknown, or the tokens per step are not a whole
                number of its sequences (the recorded ``seq_len`` cannot be the run's).
        """
        seq_len = self.measured_seq_len()
        per_step = self.reference_batch_tokens()
        batch = per_step / seq_len
        # Only rounding noise of the written token counts is forgiven: a millionth of the
        # batch, and at most a hundredth of a sequence, so no real remainder passes.
        tolerance = min(_WHOLE_BATCH_RTOL * max(1.0, batch), _WHOLE_BATCH_ATOL)
        if batch < 1 - tolerance or abs(batch - round(batch)) > tolerance:
            raise ConfigError("seq_len", seq_len,
                              f"must divide the {per_step:.10g} tokens per step of trajectory "
                              f"{self.source!r} into whole sequences ({per_step:.10g} / "
                              f"{seq_len} = {batch:.10g}; is it the measuring run's tokens "
                              "per sequence?)")
        return batch

    def to_rows(self) -> list[dict[str, float]]:
        extra = {} if self.seq_len is None else {"seq_len": int(self.seq_len)}
        return [{"step": int(s), "tokens": float(t), "loss": float(x), "b_simple": float(b),
                 **extra}
                for s, t, x, b in zip(self.step, self.tokens, self.loss, self.b_noise)]


def _read_records(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        import pandas as pd

        return pd.read_csv(path, comment="#")
    if suffix in (".parquet", ".pq"):
        import pandas as pd

        return pd.read_parquet(path)
    text = path.read_text()
    if suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict) and "rows" in data:
        data = data["rows"]
    return data


def _check_seq_len(seq_len: Any) -> int | None:
    if seq_len is None:
        return None
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError("seq_len", seq_len,
                          "must be a positive integer (tokens per sequence of the run that "
                          "measured the trajectory)")
    return int(seq_len)


def _file_seq_len(frame: Any, path: Path) -> int:
    values = frame["seq_len"].to_numpy(dtype=float)
    first = values[0] if len(values) else math.nan
    if (not np.all(np.isfinite(values)) or not np.all(values == first) or first < 1
            or first != round(first)):
        shown = ", ".join(f"{v:g}" for v in np.unique(values)[:5])
        raise ConfigError("trajectory", str(path),
                          f"seq_len column must hold one positive integer on every row "
                          f"(found {shown})")
    return int(first)


def _nearest_valid_max(values: np.ndarray, good: np.ndarray,
                       tokens: np.ndarray) -> np.ndarray:
    """Per row, the larger of ``values`` at the nearest ``good`` rows before and after it in
    token order (the one that exists where the other does not; ``good`` must hold a row)."""
    order = np.argsort(tokens, kind="stable")
    n = len(order)
    pos = np.arange(n)
    valid = good[order]
    before = np.maximum.accumulate(np.where(valid, pos, -1))
    after = np.minimum.accumulate(np.where(valid, pos, n)[::-1])[::-1]
    ranked = values[order]
    bound = np.maximum(np.where(before >= 0, ranked[np.maximum(before, 0)], -np.inf),
                       np.where(after < n, ranked[np.minimum(after, n - 1)], -np.inf))
    out = np.empty(n)
    out[order] = bound
    return out


def _clamp(frame: Any, path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """``b_simple`` with non-positive or NaN values replaced; rows to keep; rows replaced.

    A row whose ``b_simple`` is NaN, infinite or ``<= 0`` is an estimate where one of the
    smoothed parts was not positive, not an absent measurement. Where the parts
    ``g2_ema, trace_ema`` are recorded they say which: ``|G|^2 <= 0`` means the noise
    dominates (adaptdl floors ``|G|^2``, making ``B_noise`` large), ``tr(Sigma) <= 0`` with a
    positive ``|G|^2`` means the signal does (``B_noise`` small), and two positive parts
    rebuild the ratio. The large case takes the larger value (measured or rebuilt) of the
    nearest valid rows before and after it in token order, a lower bound where the noise
    dominates: ``B_noise`` grows over a run by orders of magnitude, so the file's largest
    value, usually from its end, would put an early row far above anything measured near
    it. The small case takes the smallest value of the file, a finite bound within what the
    run resolved that errs towards small batches. Without the parts a NaN or infinite value
    is read as noise-dominated (``paratune gns`` writes NaN exactly when ``g2_ema <= 0``)
    and a finite value ``<= 0`` as signal-dominated (a negative trace). A row with parts
    recorded but NaN is incomplete and dropped.
    """
    b = frame["b_simple"].to_numpy(dtype=float)
    out = b.copy()
    bad = ~(np.isfinite(b) & (b > 0))
    keep = np.ones(len(b), dtype=bool)
    if not bad.any():
        return out, keep, 0
    parts = "g2_ema" in frame.columns and "trace_ema" in frame.columns
    if parts:
        g2 = frame["g2_ema"].to_numpy(dtype=float)
        tr = frame["trace_ema"].to_numpy(dtype=float)
        known = np.isfinite(g2) & np.isfinite(tr)
        ratio = bad & known & (g2 > 0) & (tr > 0)
        out[ratio] = tr[ratio] / g2[ratio]
        noisy = bad & known & (g2 <= 0)
        quiet = bad & known & (g2 > 0) & (tr <= 0)
        keep &= ~(bad & ~known)
    else:
        # gns writes NaN where |G|^2 <= 0 (noise-dominated); a finite value <= 0 comes from a
        # negative trace with a positive |G|^2 (signal-dominated)
        ratio = np.zeros(len(b), dtype=bool)
        noisy, quiet = bad & ~np.isfinite(b), bad & np.isfinite(b)
    good = ~bad | ratio
    if not good.any():
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    low = float(out[good].min())
    if noisy.any():
        out[noisy] = _nearest_valid_max(out, good, frame["tokens"].to_numpy(dtype=float))[noisy]
    out[quiet] = low
    num_high, num_low, num_rebuilt = int(noisy.sum()), int(quiet.sum()), int(ratio.sum())
    dropped = int((~keep).sum())
    clamped = num_high + num_low + num_rebuilt
    if clamped or dropped:
        ends = [f"{out[noisy].min():g}", f"{out[noisy].max():g}"] if num_high else ["none"]
        high = " to ".join(dict.fromkeys(ends))
        logger.warning("trajectory %s: %d of %d rows had a b_simple that is not a positive "
                       "number: %d noise-dominated clamped up to the larger of the nearest "
                       "valid rows before and after (%s), %d signal-dominated clamped down "
                       "to %g, %d rebuilt from g2_ema/trace_ema, %d incomplete dropped",
                       path, int(bad.sum()), len(b), num_high, high, num_low, low,
                       num_rebuilt, dropped)
    return out, keep, clamped


def load_trajectory(path: str | Path, *, smooth: int = 1,
                    seq_len: int | None = None) -> Trajectory:
    """Read a ``B_noise`` trajectory file.

    ``b_simple`` is in sequences of the run that measured it; the noise scale is assumed to
    be a number of tokens, so it converts to another sequence length as
    ``b_simple * seq_len_measured / seq_len_target`` (:meth:`Trajectory.b_noise_in`). The
    measuring run's ``seq_len`` comes from the file's ``seq_len`` column or, for files
    written before that column existed, from ``seq_len``; without either the trajectory
    still loads, but converting it (planning, goodput) raises.

    Args:
        path: CSV, JSON, JSONL or parquet file with columns ``step, tokens, b_simple``
            (and optionally ``loss``, ``seq_len``, ``g2_ema``, ``trace_ema``).
        smooth: Window (in points) of a centred running median applied to ``b_simple``;
            the per-step estimate is noisy. ``1`` keeps the raw values.
        seq_len: Tokens per sequence of the measuring run, for a file without a ``seq_len``
            column (with one, it must agree).

    Returns:
        The trajectory, sorted by ``tokens``. Rows whose ``b_simple`` is NaN, infinite or
        ``<= 0`` (one of the smoothed parts was not positive) are kept with a clamped value
        rather than dropped, which would bias ``B_noise`` low where the noise dominates;
        :attr:`Trajectory.num_clamped` counts them and a warning is logged. Rows with no
        finite ``step`` or ``tokens`` are dropped.

    Raises:
        ConfigError: the file is missing, unreadable, lacks a column, has no usable row, has
            an inconsistent ``seq_len`` column, ``seq_len`` is not a positive integer or
            disagrees with the file's, or ``smooth`` is not a positive integer.
    """
    import pandas as pd

    seq_len = _check_seq_len(seq_len)
    if isinstance(smooth, bool) or not isinstance(smooth, (int, np.integer)) or smooth < 1:
        raise ConfigError("smooth", smooth, "must be a positive integer (points in the running "
                          "median; 1 keeps the raw values)")
    path = Path(path)
    if not path.exists():
        raise ConfigError("trajectory", str(path), "no such file")
    try:
        frame = pd.DataFrame(_read_records(path))
    except (ValueError, json.JSONDecodeError, OSError) as exc:
        raise ConfigError("trajectory", str(path), f"could not be parsed ({exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError("trajectory", str(path),
                          f"missing column(s) {', '.join(missing)} (needs "
                          f"{', '.join(REQUIRED_COLUMNS)}; optional loss, seq_len)")
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no rows (a gns run stopped before its "
                          "first measured step leaves only the header): measure for longer")
    if "loss" not in frame.columns:
        frame["loss"] = np.nan
    columns = list(REQUIRED_COLUMNS) + ["loss"] + [
        c for c in ("seq_len", "g2_ema", "trace_ema") if c in frame.columns]
    frame = frame[columns].apply(pd.to_numeric, errors="coerce")
    complete = np.isfinite(frame["tokens"]) & np.isfinite(frame["step"])
    if "seq_len" in frame.columns and np.isfinite(frame["seq_len"]).any():
        # the last column: NaN there is a row cut short while being written
        complete &= np.isfinite(frame["seq_len"])
    frame = frame[complete].reset_index(drop=True)
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    if "seq_len" in frame.columns:
        in_file = _file_seq_len(frame, path)
        if seq_len is not None and seq_len != in_file:
            raise ConfigError("seq_len", seq_len,
                              f"disagrees with the seq_len column of {path} ({in_file})")
        seq_len = in_file
    b, keep, clamped = _clamp(frame, path)
    frame = frame.assign(b_simple=b)[keep]
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    frame = frame.sort_values("tokens", kind="stable").reset_index(drop=True)
    b = frame["b_simple"].to_numpy(dtype=float)
    if smooth > 1:
        b = frame["b_simple"].rolling(smooth, center=True, min_periods=1).median().to_numpy()
    return Trajectory(step=frame["step"].to_numpy(dtype=float),
                      tokens=frame["tokens"].to_numpy(dtype=float), b_noise=b,
                      loss=frame["loss"].to_numpy(dtype=float), source=str(path),
                      seq_len=seq_len, num_clamped=clamped)


# ---------------------------------------------------------------------- published laws
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

    path = Path(path)
    if not path.exists():
        raise ConfigError("loss_curve", str(path), "no such file")
    try:
        frame = pd.DataFrame(_read_records(path))
    except (ValueError, json.JSONDecodeError, OSError) as exc:
        raise ConfigError("loss_curve", str(path), f"could not be parsed ({exc})") from None
    missing = [c for c in ("tokens", "loss") if c not in frame.columns]
    if missing:
        raise ConfigError("loss_curve", str(path), f"missing column(s) {', '.join(missing)}")
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
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "must be a positive integer")
    b_tokens = law.b_crit_tokens(curve.loss)
    tokens = np.asarray(curve.tokens, dtype=float)
    return Trajectory(step=tokens / seq_len, tokens=tokens, b_noise=b_tokens / seq_len,
                      loss=np.asarray(curve.loss, dtype=float),
                      source=f"{law.name} over {curve.source}", seq_len=int(seq_len))
