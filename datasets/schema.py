"""The column schema of a paratune dataset and its card.

A dataset is a table of :class:`~paratune.Measurement` rows (the keys of
:meth:`~paratune.Measurement.to_row`) plus a JSON card describing where they come from. The
Arrow schema is derived from ``Measurement.to_row()`` so that it follows the record: every
column has one explicit type, ``step_times_s`` is a ``list<double>``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from paratune.errors import DatasetError, SchemaVersionError
from paratune.measurement import FINGERPRINT_FIELDS, Measurement
from paratune.parallel import ParallelConfig
from paratune.spec import MODEL_PRESETS, ModelSpec

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "CARD_FILE",
    "SCHEMA_VERSION",
    "DatasetCard",
    "arrow_schema",
    "column_defaults",
    "column_types",
    "required_columns",
]

SCHEMA_VERSION = 3
"""Version of the dataset layout written by this code; readers refuse newer ones.

2: the ``timing_*`` columns of :class:`~paratune.measurement.StepTiming` (a version-1 file
reads with them NaN). 3: the context-parallel degree ``cp`` (an older file reads with 1)."""

CARD_FILE = "card.json"
"""Name of the card inside a dataset directory."""

# Fingerprint values are free text except the device count.
_FINGERPRINT_TYPES = {name: "string" for name in FINGERPRINT_FIELDS} | {"device_count": "int64"}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list<float64>"
    raise TypeError(f"no column type for {type(value).__name__}")


@cache
def _sample_row() -> dict[str, Any]:
    sample = Measurement(model=MODEL_PRESETS["tiny"], config=ParallelConfig(), hardware="cpu",
                         step_times_s=[1.0, 2.0])
    return sample.to_row()


@cache
def column_types() -> dict[str, str]:
    """Column name -> type name (``int64``, ``float64``, ``string``, ``bool``,
    ``list<float64>``), in ``Measurement.to_row()`` order."""
    types = {}
    for name, value in _sample_row().items():
        types[name] = _FINGERPRINT_TYPES.get(name) or _type_name(value)
    return types


@cache
def required_columns() -> tuple[str, ...]:
    """Columns a frame must have to be a dataset: the model shape, the degrees and batch
    sizes, the hardware and the status. Other columns take :func:`column_defaults`."""
    missing = dataclasses.MISSING
    model_fields = [f.name for f in dataclasses.fields(ModelSpec)
                    if f.default is missing and f.default_factory is missing]
    return ("model_name", *model_fields, "dp", "tp", "pp", "micro_batch_size",
            "global_batch_size", "hardware", "status")


def column_defaults() -> dict[str, Any]:
    """Value used for an optional column a frame lacks: the default of the
    :class:`~paratune.ModelSpec`, :class:`~paratune.ParallelConfig` or
    :class:`~paratune.Measurement` field, else missing (NaN / null / empty).

    Derived columns (``world_size``, ``num_microbatches``, ``num_kv_heads``,
    ``tokens_per_s_per_device``) are computed by the store instead.
    """
    field_defaults: dict[str, Any] = {}
    for cls in (ModelSpec, ParallelConfig, Measurement):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                value = f.default
                field_defaults[f.name] = value.value if hasattr(value, "value") else value
    defaults: dict[str, Any] = {}
    for name, kind in column_types().items():
        if name in FINGERPRINT_FIELDS:
            defaults[name] = None
        elif name in field_defaults and field_defaults[name] is not None:
            defaults[name] = field_defaults[name]
        elif kind == "float64":
            defaults[name] = math.nan
        elif kind == "list<float64>":
            defaults[name] = []
        elif kind == "string":
            defaults[name] = ""
        else:
            defaults[name] = None
    return defaults


def arrow_schema(extra: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """The Arrow schema of the dataset table.

    Args:
        extra: Additional columns (e.g. an importer's provenance) and their types, appended
            after the standard ones.
    """
    import pyarrow as pa

    to_arrow = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
                "bool": pa.bool_(), "list<float64>": pa.list_(pa.float64())}
    fields = [pa.field(name, to_arrow[kind]) for name, kind in column_types().items()]
    for name, dtype in (extra or {}).items():
        fields.append(pa.field(name, dtype))
    return pa.schema(fields)


@dataclass(kw_only=True)
class DatasetCard:
    """What a dataset is: its provenance, written as ``card.json`` beside the table."""

    schema_version: int = SCHEMA_VERSION
    """Layout version (see :data:`SCHEMA_VERSION`)."""
    campaign_id: str = ""
    """Identity of the campaign (or import) that produced the rows."""
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(
        timespec="seconds"))
    """When the dataset was written (ISO 8601, UTC)."""
    source: str = "paratune"
    """``"paratune"`` for profiled data, else the public source's name."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """Hardware and software of the machine that measured (device, CPU, torch, CUDA, NCCL)."""
    grid: dict[str, Any] = field(default_factory=dict)
    """What was profiled: model, world sizes, the configuration space, steps."""
    num_rows: int = 0
    """Rows in the table."""
    data_file: str = ""
    """Name of the parquet file holding the rows (relative to the card)."""
    data_sha256: str = ""
    """SHA-256 of that file, checked on reading (empty inside the file's own metadata)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Anything else worth keeping (counts, skipped configurations, import reports)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "card") -> DatasetCard:
        """Parse a card, refusing a newer schema version.

        Raises:
            SchemaVersionError: ``schema_version`` is newer than :data:`SCHEMA_VERSION`.
            DatasetError: the card is not a mapping or lacks ``schema_version``.
        """
        if not isinstance(data, dict) or "schema_version" not in data:
            raise DatasetError(f"{where}: not a paratune dataset card "
                               f"(no schema_version)")
        version = data["schema_version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DatasetError(f"{where}: schema_version={version!r} must be a positive integer")
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{where}: schema_version={version} is newer than this paratune reads "
                f"(<= {SCHEMA_VERSION}); upgrade paratune")
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        _check_card_fields(known, where)
        card = cls(**known)
        unknown = {k: v for k, v in data.items() if k not in names}
        if unknown:
            card.notes = {**card.notes, "unknown_card_fields": unknown}
        return card


def _check_card_fields(fields: dict[str, Any], where: str) -> None:
    """Refuse card fields of the wrong type (a hand-edited or damaged card)."""
    for name in ("fingerprint", "grid", "notes"):
        if name in fields and not isinstance(fields[name], dict):
            raise DatasetError(f"{where}: {name}={fields[name]!r} must be a JSON object")
    for name in ("data_file", "data_sha256"):
        if name in fields and not isinstance(fields[name], str):
            raise DatasetError(f"{where}: {name}={fields[name]!r} must be a string")
    rows = fields.get("num_rows", 0)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise DatasetError(f"{where}: num_rows={rows!r} must be a non-negative integer")
    data_file = fields.get("data_file", "")
    if data_file and (data_file != PurePath(data_file).name or data_file in (".", "..")
                      or "\\" in data_file):
        raise DatasetError(f"{where}: data_file={data_file!r} must be a file name in the "
                           f"dataset directory (no directory part)")
