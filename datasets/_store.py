"""The dataset store: one parquet table of measurements plus a JSON card, written atomically.

Layout of a dataset directory::

    card.json                       the card (schema version, campaign, fingerprint, grid, ...)
    measurements-<id>.parquet       the rows; the card names it and carries its SHA-256
    .dataset.lock                   held (flock) by the process writing, if any

Writing puts a new, uniquely named parquet file in place first and then replaces
``card.json`` (an atomic rename) to point at it; only then are older parquet files removed.
A reader therefore sees the old dataset or the new one, never a mix, and a writer killed at
any moment leaves the previous dataset readable. The card is also embedded in the parquet
file's metadata, so a lone ``.parquet`` file is still a self-describing dataset.
Writers of one directory take turns (the lock): without it, one writer's removal of older
files could delete the file that another writer's card is about to name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune._io import atomic_write_bytes, atomic_write_text, exclusive_lock
from paratune.datasets.schema import (
    CARD_FILE,
    SCHEMA_VERSION,
    DatasetCard,
    arrow_schema,
    column_defaults,
    column_types,
    required_columns,
)
from paratune.errors import DatasetError, SchemaVersionError
from paratune.measurement import Measurement, Status

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = ["Dataset", "read_dataset", "read_datasets", "records_to_frame", "summarise_dataset",
           "write_dataset"]

_CARD_META_KEY = b"paratune.card"
_DATA_PREFIX = "measurements-"
LOCK_FILE = ".dataset.lock"
"""Lock file inside a dataset directory, held while a write replaces the data and card."""
_LOCK_TIMEOUT_S = 120.0


@dataclass
class Dataset:
    """A dataset read from disk (or just written)."""

    path: Path
    """The dataset directory (or the lone parquet file it was read from)."""
    frame: pd.DataFrame
    """One row per measurement; columns are the keys of :meth:`Measurement.to_row`."""
    card: DatasetCard
    """Provenance."""

    def __len__(self) -> int:
        return len(self.frame)

    def measurements(self) -> list[Measurement]:
        """The rows as :class:`~paratune.Measurement` records."""
        return [Measurement.from_row(row) for row in self.frame.to_dict("records")]


# ---------------------------------------------------------------------- frames
def records_to_frame(records: Iterable[Measurement | Mapping[str, Any]]) -> pd.DataFrame:
    """A frame of rows from measurements (or from ``to_row()`` dicts)."""
    import pandas as pd

    rows = [r.to_row() if isinstance(r, Measurement) else dict(r) for r in records]
    if not rows:
        return pd.DataFrame({name: [] for name in column_types()})
    return pd.DataFrame(rows)


def _fill_optional(frame: pd.DataFrame) -> None:
    """Add the optional columns ``frame`` lacks: derived from others where they can be (world
    size, micro-batches, key-value heads), else their defaults. In place."""
    import pandas as pd

    n = len(frame)
    derived = {
        "num_kv_heads": lambda f: f["num_heads"],
        "world_size": lambda f: f["dp"] * f["tp"] * f["pp"],
        "num_microbatches": lambda f: f["global_batch_size"] // (f["dp"] * f["micro_batch_size"]),
    }
    for name, default in column_defaults().items():
        if name in frame.columns:
            continue
        if name in derived:
            frame[name] = derived[name](frame)
        elif isinstance(default, list):
            frame[name] = pd.Series([[] for _ in range(n)], index=frame.index, dtype=object)
        else:
            frame[name] = pd.Series([default] * n, index=frame.index, dtype=object)


def _normalise(frame: pd.DataFrame, where: str) -> pa.Table:
    """Check ``frame`` against the schema, fill optional columns, and type it."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    frame = frame.reset_index(drop=True).copy()
    missing = [c for c in required_columns() if c not in frame.columns]
    if missing:
        raise DatasetError(f"{where}: column {missing[0]!r} is required "
                           f"(missing: {', '.join(missing)})")
    for name in required_columns():
        nulls = frame[name].isna()
        if nulls.any():
            raise DatasetError(f"{where}: column {name!r} must not be empty "
                               f"(row {int(np.flatnonzero(nulls.to_numpy())[0])})")
    bad_status = sorted(set(frame["status"].astype(str)) - {s.value for s in Status})
    if bad_status:
        raise DatasetError(f"{where}: status={bad_status[0]!r} must be one of "
                           f"{', '.join(s.value for s in Status)}")
    _fill_optional(frame)
    if "num_kv_heads" in frame.columns:  # a null means multi-head attention
        frame["num_kv_heads"] = frame["num_kv_heads"].fillna(frame["num_heads"])
    if frame["tokens_per_s_per_device"].isna().all():
        frame["tokens_per_s_per_device"] = frame["tokens_per_s"] / frame["world_size"]
    # an object column even without rows (a list assigned to an empty frame is float64)
    frame["step_times_s"] = pd.Series(
        [[] if v is None or (isinstance(v, float) and math.isnan(v)) else [float(t) for t in v]
         for v in frame["step_times_s"]], index=frame.index, dtype=object)
    for name, kind in column_types().items():  # "" for unknown numbers (as to_row writes it)
        # object or (pandas 3) str columns: "" is a missing number
        if kind in ("int64", "float64") and not pd.api.types.is_numeric_dtype(frame[name]):
            frame[name] = frame[name].astype(object).replace("", None)
    standard = list(column_types())
    extra_names = [c for c in frame.columns if c not in column_types()]
    extra_types: dict[str, pa.DataType] = {}
    for name in extra_names:
        try:
            extra_types[name] = pa.Table.from_pandas(frame[[name]], preserve_index=False
                                                     ).schema.field(name).type
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DatasetError(f"{where}: column {name!r} has no single type ({exc})") from None
    schema = arrow_schema(extra_types)
    try:
        return pa.Table.from_pandas(frame[standard + extra_names], schema=schema,
                                    preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        column = next((c for c in standard if c in str(exc)), None)
        for name in standard:  # find the offending column for a precise message
            try:
                pa.Table.from_pandas(frame[[name]], schema=pa.schema([schema.field(name)]),
                                     preserve_index=False)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                column = name
                break
        raise DatasetError(f"{where}: column {column!r} does not fit type "
                           f"{column_types().get(column or '', '?')} ({exc})") from None


# ---------------------------------------------------------------------- write
def write_dataset(path: str | Path, records_or_frame: Any, *,
                  card: DatasetCard | Mapping[str, Any] | None = None) -> Dataset:
    """Write measurements as a dataset directory, atomically.

    Args:
        path: The dataset directory (created if missing; other files in it are left alone).
        records_or_frame: :class:`~paratune.Measurement` records, ``to_row()`` dicts, or a
            DataFrame with those columns.
        card: Provenance (a :class:`DatasetCard` or a dict of its fields); ``num_rows``,
            ``data_file`` and the schema version are filled in here.

    Returns:
        The dataset as written.

    Raises:
        DatasetError: a required column is missing or empty, a status is unknown, or a value
            does not fit its column's type (the message names the column); or another
            process kept the directory's write lock too long.
        SchemaVersionError: ``path`` holds a dataset of a newer schema version.
    """
    import pandas as pd
    import pyarrow.parquet as pq

    path = Path(path)
    if path.suffix == ".parquet":
        raise DatasetError(f"{path}: a dataset is written to a directory, not a .parquet file")
    if path.exists() and not path.is_dir():
        raise DatasetError(f"{path}: exists and is not a directory")
    frame = (records_or_frame if isinstance(records_or_frame, pd.DataFrame)
             else records_to_frame(records_or_frame))
    table = _normalise(frame, str(path))
    if card is None:
        card = DatasetCard()
    elif not isinstance(card, DatasetCard):
        card = DatasetCard.from_dict({"schema_version": SCHEMA_VERSION, **dict(card)},
                                     where=f"{path} card")
    card.schema_version = SCHEMA_VERSION
    card.num_rows = table.num_rows
    card.data_file = f"{_DATA_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    card.data_sha256 = ""
    embedded = json.dumps(card.to_dict(), default=str, sort_keys=True).encode()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           _CARD_META_KEY: embedded})
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    card.data_sha256 = hashlib.sha256(data).hexdigest()
    # One writer at a time: a second writer's clean-up would otherwise delete the data file
    # that the first one's card is about to name.
    with _write_lock(path):
        _refuse_newer_dataset(path)
        _remove_stale_temporaries(path)
        atomic_write_bytes(path / card.data_file, data)
        atomic_write_text(path / CARD_FILE,
                          json.dumps(card.to_dict(), indent=2, default=str) + "\n")
        for old in path.glob(f"{_DATA_PREFIX}*.parquet"):
            if old.name != card.data_file:
                old.unlink(missing_ok=True)
    return Dataset(path=path, frame=_to_pandas(table), card=card)


@contextlib.contextmanager
def _write_lock(directory: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the dataset's write lock (:data:`LOCK_FILE`, see
    :func:`paratune._io.exclusive_lock`), waiting up to ``timeout_s`` for another writer."""
    from paratune.errors import ConfigError

    timeout_s = _LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        with exclusive_lock(directory / LOCK_FILE, field="dataset", value=str(directory),
                            what="writing this dataset", wait_s=timeout_s):
            yield
    except ConfigError as exc:
        if exc.field != "dataset" or exc.value != str(directory):
            raise
        raise DatasetError(f"{directory}: {exc.rule}") from None


def _refuse_newer_dataset(path: Path) -> None:
    """Refuse to replace a dataset written by a newer schema version (its layout may hold
    what this version cannot write back). A card that cannot be read is replaced."""
    try:
        existing = json.loads((path / CARD_FILE).read_text())
    except (OSError, ValueError):
        return
    version = existing.get("schema_version") if isinstance(existing, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path}: holds a dataset of schema_version={version}, newer than this paratune "
            f"writes ({SCHEMA_VERSION}); replacing it would lose what that version stores: "
            f"upgrade paratune or write to another directory")


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of writes killed before their rename (under the lock, so
    none belongs to a write in progress)."""
    for pattern in (f".{_DATA_PREFIX}*.parquet.*.tmp", f".{CARD_FILE}.*.tmp"):
        for stale in path.glob(pattern):
            stale.unlink(missing_ok=True)


# ---------------------------------------------------------------------- read
def _to_pandas(table: pa.Table) -> pd.DataFrame:
    import pandas as pd

    frame = table.replace_schema_metadata(None).to_pandas()
    # a file written before an optional column existed: derived or default values, typed
    # as a file that has the column reads
    missing = [c for c in column_types() if c not in frame.columns]
    _fill_optional(frame)
    for name in missing:
        kind = column_types()[name]
        if kind == "float64":
            frame[name] = pd.to_numeric(frame[name], errors="coerce").astype("float64")
        elif kind == "int64" and frame[name].notna().all():
            frame[name] = frame[name].astype("int64")
        elif kind == "bool":
            frame[name] = frame[name].astype(bool)
    frame["step_times_s"] = [v.tolist() if v is not None else [] for v in frame["step_times_s"]]
    # A nullable integer: plain ints and None rather than floats.
    frame["device_count"] = pd.Series(
        [None if v is None or v != v else int(v) for v in frame["device_count"]], dtype=object)
    return frame


def _read_parquet(file: Path, where: str) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file)
    except FileNotFoundError:
        raise DatasetError(f"{where}: data file {file.name} is missing") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: {file.name} is not a readable parquet file "
                           f"(truncated or corrupt: {exc})") from None


def _check_columns(table: pa.Table, where: str) -> None:
    missing = [c for c in required_columns() if c not in table.column_names]
    if missing:
        raise DatasetError(f"{where}: not a paratune dataset (column {missing[0]!r} missing)")


def read_dataset(path: str | Path) -> Dataset:
    """Read a dataset directory (or its ``card.json``, or a lone paratune parquet file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetError: it is not a paratune dataset, or is truncated or inconsistent.
        SchemaVersionError: it was written by a newer schema version.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset")
    if path.is_file() and path.suffix == ".parquet":
        return _read_lone_parquet(path)
    directory = path.parent if path.is_file() else path
    card_path = directory / CARD_FILE
    where = str(directory)
    if path.is_file() and path.name != CARD_FILE:
        raise DatasetError(f"{path}: not a paratune dataset (expected a directory with "
                           f"{CARD_FILE}, a {CARD_FILE}, or a .parquet file)")
    if not card_path.exists():
        orphans = sorted(p.name for p in directory.glob(f"{_DATA_PREFIX}*.parquet"))
        if orphans:
            raise DatasetError(
                f"{where}: not a paratune dataset (no {CARD_FILE}); it holds "
                f"{', '.join(orphans)}, each readable on its own (its card is embedded): "
                f"pass that file instead")
        raise DatasetError(f"{where}: not a paratune dataset (no {CARD_FILE})")
    for attempt in range(2):  # a concurrent rewrite may replace the data file under us
        try:
            card_data = json.loads(card_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{where}: {CARD_FILE} is not valid JSON (truncated or "
                               f"corrupt: {exc})") from None
        card = DatasetCard.from_dict(card_data, where=str(card_path))
        expected_sha = card.data_sha256
        if not card.data_file:
            raise DatasetError(f"{where}: {CARD_FILE} names no data_file")
        data_path = directory / card.data_file
        try:
            data = data_path.read_bytes()
        except FileNotFoundError:
            if attempt == 0:
                continue
            raise DatasetError(f"{where}: data file {card.data_file} named by {CARD_FILE} is "
                               f"missing") from None
        break
    if expected_sha and hashlib.sha256(data).hexdigest() != expected_sha:
        raise DatasetError(f"{where}: {card.data_file} does not match the SHA-256 in "
                           f"{CARD_FILE} (truncated or modified)")
    import pyarrow as pa

    table = _read_parquet_bytes(pa.py_buffer(data), data_path, where)
    _check_columns(table, where)
    if table.num_rows != card.num_rows:
        raise DatasetError(f"{where}: {card.data_file} has {table.num_rows} rows but the card "
                           f"says {card.num_rows} (truncated?)")
    return Dataset(path=directory, frame=_to_pandas(table), card=card)


def _read_parquet_bytes(buffer: Any, file: Path, where: str) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(pa.BufferReader(buffer))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: {file.name} is not a readable parquet file "
                           f"(truncated or corrupt: {exc})") from None


def _read_lone_parquet(path: Path) -> Dataset:
    import pyarrow.parquet as pq

    where = str(path)
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for a bad footer
        raise DatasetError(f"{where}: not a readable parquet file (truncated or corrupt: "
                           f"{exc})") from None
    if _CARD_META_KEY not in metadata:
        raise DatasetError(f"{where}: not a paratune dataset (no paratune card in its "
                           f"metadata)")
    try:
        card_data = json.loads(metadata[_CARD_META_KEY])
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: the embedded card is not valid JSON ({exc})") from None
    card = DatasetCard.from_dict(card_data, where=where)
    table = _read_parquet(path, where)
    _check_columns(table, where)
    return Dataset(path=path, frame=_to_pandas(table), card=card)


def read_datasets(paths: Sequence[str | Path] | str | Path, *,
                  label_column: str | None = None) -> pd.DataFrame:
    """Read several datasets and concatenate their rows.

    Args:
        paths: Dataset directories, cards or parquet files.
        label_column: If given, add a column of this name holding each row's dataset path.

    Raises:
        DatasetError: no paths, or one of them is not a readable dataset (its path is named).
    """
    import pandas as pd

    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DatasetError("read_datasets: no dataset paths given")
    frames = []
    for p in paths:
        frame = read_dataset(p).frame
        if label_column:
            frame[label_column] = str(p)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------- summary
def _config_key(row: Mapping[str, Any]) -> str:
    from paratune.parallel import ParallelConfig

    try:
        return ParallelConfig(**{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()
                                 if k in ("dp", "tp", "pp", "micro_batch_size",
                                          "global_batch_size", "schedule", "virtual_stages",
                                          "sharding", "recompute")}).key()
    except Exception:  # a public row with an unusual layout still gets summarised
        return f"dp{row.get('dp')}-tp{row.get('tp')}-pp{row.get('pp')}"


def summary_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (model, hardware, world size): counts by status and the fastest ok config."""
    rows = []
    if frame.empty:
        return rows
    for (model, hardware, world_size), group in frame.groupby(
            ["model_name", "hardware", "world_size"], sort=True):
        counts = group["status"].value_counts()
        row: dict[str, Any] = {"model": model, "hardware": hardware,
                               "world_size": int(world_size), "configs": len(group)}
        for status in Status:
            row[status.value] = int(counts.get(status.value, 0))
        ok = group[(group["status"] == "ok") & group["tokens_per_s"].notna()]
        if len(ok):
            best = ok.loc[ok["tokens_per_s"].idxmax()]
            row["best_tokens_per_s"] = float(best["tokens_per_s"])
            row["best_step_s"] = float(best["step_time_s"])
            row["best_config"] = _config_key(best.to_dict())
        rows.append(row)
    return rows


def summarise_dataset(dataset: Dataset) -> str:
    """A few lines about the card and a table of counts and best configs per world size."""
    from paratune._table import format_table

    card = dataset.card
    fp = card.fingerprint or {}
    lines = [f"dataset   {dataset.path}",
             f"campaign  {card.campaign_id or '-'}   source {card.source}   "
             f"created {card.created}   schema v{card.schema_version}",
             f"rows      {len(dataset)}"]
    if fp:
        lines.append("machine   " + ", ".join(f"{k}={fp[k]}" for k in (
            "device_name", "device_count", "cpu", "torch_version", "cuda_version",
            "nccl_version") if fp.get(k) not in (None, "")))
    if card.grid:
        grid = {k: card.grid[k] for k in ("model", "world_sizes", "warmup_steps",
                                          "measured_steps") if k in card.grid}
        if grid:
            lines.append("grid      " + ", ".join(f"{k}={v}" for k, v in grid.items()))
    rows = summary_rows(dataset.frame)
    skipped = (card.notes or {}).get("skipped_per_world_size") or {}
    columns = ["model", "hardware", "world_size", "configs", "ok", "oom", "error", "timeout"]
    if skipped:
        for row in rows:
            row["skipped"] = int(skipped.get(str(row["world_size"]), 0))
        columns.append("skipped")
    columns += ["best_tokens_per_s", "best_step_s", "best_config"]
    lines.append("")
    lines.append(format_table(rows, columns, headers={"world_size": "world",
                                                      "best_tokens_per_s": "best tok/s",
                                                      "best_step_s": "step s"})
                 if rows else "(no rows)")
    return "\n".join(lines)
