"""A ``B_noise`` trajectory as the tuner holds it (:class:`Trajectory`), and the reading of
the tables it and a loss curve come from (CSV, JSON, JSON lines, parquet)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Trajectory", "read_table"]

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




def read_table(path: str | Path, *, field: str, required: Sequence[str],
               hint: str = "") -> pd.DataFrame:
    """The records of ``path`` as a frame with at least the ``required`` columns.

    Args:
        path: A CSV, JSON (a list of records, a mapping of column -> list, or
            ``{"rows": [...]}``), JSON lines or parquet file.
        field: The name errors give the file under (``trajectory``, ``loss_curve``).
        required: Columns the file must have.
        hint: Text after the missing columns in that error (what the file needs).

    Raises:
        ConfigError: the file is missing, cannot be parsed or lacks a required column.
    """
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise ConfigError(field, str(path), "no such file")
    try:
        frame = pd.DataFrame(_read_records(path))
    except (ValueError, json.JSONDecodeError, OSError) as exc:
        raise ConfigError(field, str(path), f"could not be parsed ({exc})") from None
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ConfigError(field, str(path), f"missing column(s) {', '.join(missing)}{hint}")
    return frame
