"""Loading measurements for fitting and evaluation, and the targets derived from them."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from paratune.errors import DatasetError
from paratune.predictor import CONFIG_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["calibrated_fingerprint", "canonical_order", "check_distinct", "config_identity",
           "feasibility_table", "load_measurements", "measured_memory_gb", "measured_step_time",
           "run_status", "training_fingerprint"]

logger = logging.getLogger(__name__)

# Columns that identify a configuration (the measurement's model, layout and hardware).
IDENTITY_COLUMNS = tuple(c for c in CONFIG_COLUMNS if c not in ("model_name",))


def load_measurements(paths: Sequence[str | Path]) -> pd.DataFrame:
    """Measurement rows (the columns of :meth:`paratune.Measurement.to_row`) from datasets.

    Args:
        paths: paratune dataset directories, public-format CSVs (see
            :mod:`paratune.datasets.importers`), or CSV / parquet files of measurement rows.

    Returns:
        One frame of all rows, with a ``data_path`` column naming where each came from; a
        run that two of the files hold (a dataset and the CSV it was imported from) once,
        with a warning.

    Raises:
        DatasetError: a path is neither of these, or is given twice.
        FileNotFoundError: a path does not exist.
    """
    import pandas as pd

    from paratune.datasets.importers import first_problems, is_public_csv, parse_public_csv

    check_distinct(paths)
    frames = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such dataset: {path}")
        if path.is_dir():
            from paratune.datasets import read_dataset

            frame = read_dataset(path).frame.copy()
        elif path.suffix == ".parquet":
            frame = _read_parquet_rows(path)
        elif is_public_csv(path):
            records, problems = parse_public_csv(path)
            if not records:
                # a public CSV all of whose rows were left out is not another format
                raise DatasetError(f"{path}: no usable row" + (
                    f" (each was left out: {first_problems(problems)})" if problems
                    else " (nothing below its header)"))
            if problems:
                # the rows are left out, not guessed; say so where the fit or evaluation runs
                logger.warning("%s: %d %s not used: %s (`paratune datasets import` lists "
                               "each with its line and reason)", path, len(problems),
                               "row" if len(problems) == 1 else "rows",
                               first_problems(problems))
            frame = pd.DataFrame([m.to_row() for m in records])
        elif path.suffix == ".csv":
            from paratune.datasets.importers import header_and_body, public_header_problem

            header, _, header_line, _ = header_and_body(path)
            # a header with every measurement-row column is that format, whatever other
            # columns it has (one named like a public column, gpu or num_gpus, included)
            problem = (public_header_problem(header) if _missing_row_columns(header)
                       else None)
            if problem:
                raise DatasetError(f"{path}: {problem}")
            # from the header on: '#' lines above it are comments, as in a public CSV
            frame = pd.read_csv(path, comment=None, skiprows=header_line - 1)
        else:
            raise DatasetError(f"{path}: not a dataset directory, public CSV or parquet file")
        missing = _missing_row_columns(list(frame.columns))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                              if len(missing) > 5 else "")
            raise DatasetError(f"{path}: neither the public measurement format (a header "
                               f"with source, model, num_gpus, tp, pp, dp, ...) nor paratune "
                               f"measurement rows (missing {shown})")
        frame["data_path"] = str(path)
        frames.append(frame)
    if not frames:
        raise DatasetError("no data given")
    return _once(pd.concat(frames, ignore_index=True))


def _once(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` without the rows that are runs another of its files already holds, as a
    dataset and the public CSV it was imported from or exported to hold them: the same
    source, configuration, status and step time (to the six digits an export writes), and
    for a run without a step time (out of memory, failed) the same campaign and time of
    measurement too, so that two campaigns' failures of one configuration stay two. Each
    run counts once in a fit; repeated measurements within one file are kept."""
    import pandas as pd

    if frame["data_path"].nunique() < 2:
        return frame

    def text(column: str) -> pd.Series:
        if column not in frame.columns:
            return pd.Series("", index=frame.index, dtype=object)
        return frame[column].astype(object).where(frame[column].notna(), "").astype(str)

    step = pd.to_numeric(frame["step_time_s"], errors="coerce") if "step_time_s" in \
        frame.columns else pd.Series(np.nan, index=frame.index)
    timed = np.isfinite(step.to_numpy(float))
    key = (config_identity(frame) + "|" + text("source") + "|" + text("status") + "|"
           + pd.Series([f"{v:.6g}" for v in step], index=frame.index))
    key = key.where(timed, key + "|" + text("campaign_id") + "|" + text("timestamp"))
    first = frame["data_path"].groupby(key.to_numpy(), dropna=False).transform("first")
    again = (frame["data_path"] != first).to_numpy()
    if not again.any():
        return frame
    for path, rows in frame[again].groupby("data_path", sort=False):
        other = ", ".join(sorted({str(v) for v in first[
            again & (frame["data_path"] == path).to_numpy()]}))
        logger.warning("%s: %d %s already read from %s (the same source, configuration, "
                       "status and step time): counted once", path, len(rows),
                       "run" if len(rows) == 1 else "runs", other)
    return frame[~again].reset_index(drop=True)


def check_distinct(paths: Sequence[str | Path]) -> None:
    """Refuse a path given twice (also spelt differently, ``D/../D/f.csv``): its rows would
    count twice in the fit or evaluation.

    Raises:
        DatasetError: naming the path and its other spelling.
    """
    given: dict[Path, Path] = {}
    for path in map(Path, paths):
        resolved = path.resolve()
        if resolved in given:
            raise DatasetError(f"{path}: given twice (as {given[resolved]} too); every row "
                               "would be used twice")
        given[resolved] = path


def _missing_row_columns(columns: Sequence[str]) -> list[str]:
    """The columns of a measurement row (status, step time, config) that ``columns`` lacks."""
    return [c for c in ("status", "step_time_s", *CONFIG_COLUMNS) if c not in columns]


def _read_parquet_rows(path: Path) -> pd.DataFrame:
    """A parquet file's rows: a paratune dataset file (its embedded card, checksum and schema
    version checked by :func:`paratune.datasets.read_dataset`), else plain measurement rows."""
    import pyarrow.parquet as pq

    from paratune.datasets import CARD_METADATA_KEY, read_dataset

    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for a bad footer
        raise DatasetError(f"{path}: not a readable parquet file (truncated or corrupt: "
                           f"{exc})") from None
    if CARD_METADATA_KEY in metadata:
        return read_dataset(path).frame.copy()
    import pandas as pd

    return pd.read_parquet(path)


def config_identity(frame: pd.DataFrame) -> pd.Series:
    """A string per row identifying its configuration (model shape, layout, hardware)."""
    import pandas as pd

    cols = [c for c in IDENTITY_COLUMNS if c in frame.columns]
    if not cols:
        return pd.Series("", index=frame.index, dtype=object)
    def text(column: str) -> pd.Series:
        # an empty cell reads "nan" (pandas 3's str keeps it missing, and a missing part
        # would make the whole identity missing: such rows would drop out of every group)
        return frame[column].astype(str).fillna("nan").astype(object)

    # column by column: joining each row's values in Python costs seconds on a large frame
    out = text(cols[0])
    for column in cols[1:]:
        out = out + "|" + text(column)
    return out


def run_status(frame: pd.DataFrame) -> np.ndarray:
    """Each run's status as text (:class:`paratune.measurement.Status`: ``ok``, ``oom``...)."""
    return frame["status"].astype(str).to_numpy()


def measured_step_time(frame: pd.DataFrame) -> np.ndarray:
    """Measured step time in seconds; NaN where the run did not succeed."""
    step = np.asarray(frame["step_time_s"], dtype=float)
    return np.where((run_status(frame) == "ok") & (step > 0), step, np.nan)


def measured_memory_gb(frame: pd.DataFrame) -> np.ndarray:
    """Reported peak device memory (reserved, else allocated) in GB; NaN where unknown."""
    out = np.full(len(frame), np.nan)
    for column in ("peak_mem_allocated_gb", "peak_mem_reserved_gb"):
        if column in frame.columns:
            values = np.asarray(frame[column], dtype=float)
            out = np.where(np.isfinite(values) & (values > 0), values, out)
    hardware = frame["hardware"].astype(str).str.lower()
    return np.where((run_status(frame) == "ok") & np.asarray(hardware != "cpu"), out, np.nan)


def feasibility_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration with ``feasible`` = it ran successfully at least once.

    A configuration recorded both as successful and as failed (a crash on one attempt) is
    feasible: it can run. The first row of each configuration carries its config columns.
    """
    identity = config_identity(frame)
    ok = frame["status"].astype(str) == "ok"
    feasible = ok.groupby(identity).transform("any")
    table = frame.assign(feasible=feasible.astype(int), _identity=identity)
    return table.drop_duplicates("_identity").drop(columns="_identity").reset_index(drop=True)


_IDENTITY = (*CONFIG_COLUMNS, "status", "step_time_s", "peak_mem_reserved_gb",
             "peak_mem_allocated_gb")
"""The configuration columns and outcomes that identify a training row."""


def training_fingerprint(frame: pd.DataFrame) -> str:
    """SHA-256 of the configuration columns, outcomes and sources a model was fitted on (the
    source names a row's family, which the model predicts it by)."""
    cols = [c for c in (*_IDENTITY, "source") if c in frame.columns]
    text = frame[cols].astype(str).sort_values(cols).to_csv(index=False)
    return hashlib.sha256(text.encode()).hexdigest()


def calibrated_fingerprint(fingerprint: str, frame: pd.DataFrame) -> str:
    """The fingerprint of a model fitted on data of ``fingerprint`` and then calibrated on
    ``frame``: another model's values, so another study's (see
    :func:`paratune.tuner.predictor_identity`)."""
    text = f"{fingerprint}\ncalibrated on\n{training_fingerprint(frame)}"
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_order(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``frame`` in an order that does not depend on how they were given (which
    files, in which order): sorted by the columns of :func:`training_fingerprint`, then by
    source. Boosters that sample rows by position then fit the same model on the same data."""
    cols = [c for c in (*_IDENTITY, "source") if c in frame.columns]
    keys = frame[cols].astype(str).reset_index(drop=True)
    return frame.iloc[keys.sort_values(cols, kind="stable").index].reset_index(drop=True)
