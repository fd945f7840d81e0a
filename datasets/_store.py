"""The dataset store: one parquet table of measurements plus a JSON card, written atomically.

Layout of a dataset directory::

    card.json                       the card (schema version, campaign, fingerprint, grid, ...)
    measurements-<id>.parquet       the rows; the card names it and carries its SHA-256
    .dataset.lock                   held (flock) by the process writing, if any
    .dataset.pending                names the data file of a write in progress

Writing puts a new, uniquely named parquet file in place first and then replaces
``card.json`` (an atomic rename) to point at it; only then is the data file the previous
card named removed. A reader therefore sees the old dataset or the new one, never a mix,
and a writer killed at any moment leaves the previous dataset readable (the next write
removes the data file the killed one placed, named by ``.dataset.pending``). Other
``measurements-*.parquet`` files (a dataset whose card was removed, a copied file) are left
alone: a directory holding one holds data, and :func:`write_dataset` replaces it only when
told to. The card is also embedded in the parquet file's metadata, so a lone ``.parquet``
file is still a self-describing dataset. Writers of one directory take turns (the lock):
without it, one writer's removal of the previous data file could delete the file that
another writer's card is about to name, and two writers that must not replace a dataset
could both find the directory empty.

Every row is checked before anything is written (see :mod:`paratune.datasets._rows`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.datasets._rows import _check_rows as _check_rows  # re-exported
from paratune.datasets._rows import _fill_optional, _normalise, records_to_frame
from paratune.datasets._summary import summarise_dataset
from paratune.datasets._summary import summary_rows as summary_rows  # re-exported
from paratune.datasets.schema import (
    CARD_FILE,
    SCHEMA_VERSION,
    DatasetCard,
    column_types,
    required_columns,
)
from paratune.errors import DatasetError, SchemaVersionError
from paratune.fileio import atomic_write_bytes, atomic_write_text, exclusive_lock
from paratune.measurement import Measurement

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = ["CARD_METADATA_KEY", "Dataset", "DatasetExistsError", "holds_data", "read_dataset",
           "read_datasets", "records_to_frame", "summarise_dataset", "write_dataset"]

CARD_METADATA_KEY = b"paratune.card"
"""Key of the parquet schema metadata that holds a dataset file's embedded card (JSON)."""
_DATA_PREFIX = "measurements-"
LOCK_FILE = ".dataset.lock"
"""Lock file inside a dataset directory, held while a write replaces the data and card."""
_LOCK_TIMEOUT_S = 120.0
_PENDING_FILE = ".dataset.pending"
"""Names the data file a write placed before its card (removed once the card names it)."""


class DatasetExistsError(DatasetError):
    """The directory already holds data (a card or a ``measurements-*.parquet`` file) and
    the write was told not to replace it."""


def holds_data(path: str | Path) -> bool:
    """Whether directory ``path`` holds a dataset's card or any ``measurements-*.parquet``
    file (a dataset without its card is still data: each such file reads on its own)."""
    path = Path(path)
    return (path / CARD_FILE).exists() or any(path.glob(f"{_DATA_PREFIX}*.parquet"))


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


# ---------------------------------------------------------------------- write
def write_dataset(path: str | Path, records_or_frame: Any, *,
                  card: DatasetCard | Mapping[str, Any] | None = None,
                  replace: bool = True) -> Dataset:
    """Write measurements as a dataset directory, atomically.

    Args:
        path: The dataset directory (created if missing; other files in it are left alone).
        records_or_frame: :class:`~paratune.Measurement` records, ``to_row()`` dicts, or a
            DataFrame with those columns.
        card: Provenance (a :class:`DatasetCard` or a dict of its fields); ``num_rows``,
            ``data_file`` and the schema version are filled in here.
        replace: Whether to replace data already in ``path`` (a card, or any
            ``measurements-*.parquet`` file), decided under the directory's write lock so that
            of two writers that must not replace, one fails. Replacing removes the data
            file the previous card named; other parquet files are kept.

    Returns:
        The dataset as written.

    Raises:
        DatasetError: a required column is missing or empty, a value does not fit its
            column's type, or a row breaks a rule (a model shape or layout its reader refuses,
            ``world_size`` other than ``dp*tp*pp*cp``, an unknown status, schedule, sharding or
            recompute, a time or rate not positive, ``mfu`` outside [0, 1]); the message names
            the column, the rule and the row; or another process kept the directory's write
            lock too long.
        DatasetExistsError: ``replace`` is false and ``path`` already holds data.
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
                                           CARD_METADATA_KEY: embedded})
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
        if not replace and holds_data(path):
            raise DatasetExistsError(f"{path}: already holds a dataset (a {CARD_FILE} or a "
                                     f"{_DATA_PREFIX}*.parquet file); refused to replace it")
        previous = _data_file_named(path / CARD_FILE)
        atomic_write_text(path / _PENDING_FILE, card.data_file + "\n")
        atomic_write_bytes(path / card.data_file, data)
        atomic_write_text(path / CARD_FILE,
                          json.dumps(card.to_dict(), indent=2, default=str) + "\n")
        if previous and previous != card.data_file:
            (path / previous).unlink(missing_ok=True)
        (path / _PENDING_FILE).unlink(missing_ok=True)
    return Dataset(path=path, frame=_to_pandas(table), card=card)


@contextlib.contextmanager
def _write_lock(directory: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the dataset's write lock (:data:`LOCK_FILE`, see
    :func:`paratune.fileio.exclusive_lock`), waiting up to ``timeout_s`` for another writer."""
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


def _data_file_named(file: Path) -> str | None:
    """The data file a card (or a pending-write note) names, if it can be read and names a
    ``measurements-*.parquet`` file of its directory."""
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    if file.name == CARD_FILE:
        try:
            data = json.loads(text)
        except ValueError:
            return None
        name = data.get("data_file") if isinstance(data, dict) else None
    else:
        name = text.strip()
    if (isinstance(name, str) and name.startswith(_DATA_PREFIX) and name.endswith(".parquet")
            and name == Path(name).name and "\\" not in name):
        return name
    return None


def _remove_stale_temporaries(path: Path) -> None:
    """Remove what writes killed before finishing left (under the lock, so none belongs to a
    write in progress): temporary files, and a data file placed before its card was (named by
    :data:`_PENDING_FILE`, and not by the card)."""
    for pattern in (f".{_DATA_PREFIX}*.parquet.*.tmp", f".{CARD_FILE}.*.tmp",
                    f".{_PENDING_FILE}.*.tmp"):
        for stale in path.glob(pattern):
            stale.unlink(missing_ok=True)
    pending = _data_file_named(path / _PENDING_FILE)
    if pending and pending != _data_file_named(path / CARD_FILE):
        (path / pending).unlink(missing_ok=True)
    (path / _PENDING_FILE).unlink(missing_ok=True)


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
    if CARD_METADATA_KEY not in metadata:
        raise DatasetError(f"{where}: not a paratune dataset (no paratune card in its "
                           f"metadata)")
    try:
        card_data = json.loads(metadata[CARD_METADATA_KEY])
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
