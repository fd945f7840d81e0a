"""Reading a gradient-noise-scale trajectory: ``B_noise`` over training progress.

The measurement (``paratune gns``) writes one row per measurement point with the columns
``step, tokens, loss, b_simple``: the optimizer step and tokens seen so far in the reference
run, the training loss there, and the simple noise scale ``B_simple = tr(Sigma) / |G|^2``
(McCandlish et al. 2018, eq. 2.8) in sequences. CSV, JSON (a list of records, a mapping of
column -> list, or ``{"rows": [...]}``), JSON lines and parquet are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratune.errors import ConfigError

__all__ = ["REQUIRED_COLUMNS", "Trajectory", "load_trajectory"]

REQUIRED_COLUMNS = ("step", "tokens", "b_simple")
"""Columns every trajectory must have; ``loss`` is optional."""


@dataclass(frozen=True)
class Trajectory:
    """``B_noise`` along a reference run, sorted by tokens seen."""

    step: np.ndarray
    """Optimizer step of each point."""
    tokens: np.ndarray
    """Tokens seen by the reference run at each point."""
    b_noise: np.ndarray
    """Gradient noise scale (``b_simple``) at each point, in sequences."""
    loss: np.ndarray
    """Training loss at each point (NaN where not recorded)."""
    source: str = ""
    """Where it was read from."""

    def __len__(self) -> int:
        return len(self.tokens)

    def reference_batch_tokens(self) -> float:
        """Tokens per optimizer step of the reference run (median over intervals)."""
        d_step = np.diff(self.step)
        d_tok = np.diff(self.tokens)
        ok = d_step > 0
        if not ok.any():
            raise ConfigError("trajectory", self.source,
                              "needs at least two points with increasing step")
        return float(np.median(d_tok[ok] / d_step[ok]))

    def to_rows(self) -> list[dict[str, float]]:
        return [{"step": int(s), "tokens": float(t), "loss": float(x), "b_simple": float(b)}
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


def load_trajectory(path: str | Path, *, smooth: int = 1) -> Trajectory:
    """Read a ``B_noise`` trajectory file.

    Args:
        path: CSV, JSON, JSONL or parquet file with columns ``step, tokens, b_simple``
            (and optionally ``loss``).
        smooth: Window (in points) of a centred running median applied to ``b_simple``;
            the per-step estimate is noisy. ``1`` keeps the raw values.

    Returns:
        The trajectory, sorted by ``tokens``, rows with a non-finite or non-positive
        ``b_simple`` dropped (an estimate can be negative when the noise dominates).

    Raises:
        ConfigError: the file is missing, unreadable, lacks a column or has no usable row.
    """
    import pandas as pd

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
                          f"{', '.join(REQUIRED_COLUMNS)}; optional loss)")
    if "loss" not in frame.columns:
        frame["loss"] = np.nan
    frame = frame[list(REQUIRED_COLUMNS) + ["loss"]].apply(pd.to_numeric, errors="coerce")
    frame = frame[np.isfinite(frame["b_simple"]) & (frame["b_simple"] > 0)
                  & np.isfinite(frame["tokens"]) & np.isfinite(frame["step"])]
    if frame.empty:
        raise ConfigError("trajectory", str(path), "has no row with a positive b_simple")
    frame = frame.sort_values("tokens", kind="stable").reset_index(drop=True)
    b = frame["b_simple"].to_numpy(dtype=float)
    if smooth > 1:
        b = frame["b_simple"].rolling(smooth, center=True, min_periods=1).median().to_numpy()
    return Trajectory(step=frame["step"].to_numpy(dtype=float),
                      tokens=frame["tokens"].to_numpy(dtype=float), b_noise=b,
                      loss=frame["loss"].to_numpy(dtype=float), source=str(path))
