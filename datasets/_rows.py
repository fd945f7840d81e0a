"""Rows on their way into a dataset: a frame of measurements, typed to the schema, with the
optional columns filled in and every row checked.

Every row is checked before anything is written, by the rules its reader applies (the
model shape and the layout, as :class:`~paratune.ModelSpec` and
:class:`~paratune.ParallelConfig` check them, with ``world_size == dp*tp*pp*cp``) and the
ranges of the measured values; a row breaking one is refused, naming the row, the column
and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from paratune.batch import LAYOUT_RULES, ConfigBatch
from paratune.datasets.schema import (
    arrow_schema,
    column_defaults,
    column_types,
    required_columns,
)
from paratune.errors import ConfigError, DatasetError
from paratune.measurement import Measurement, Status
from paratune.parallel import degrees_product
from paratune.predictor import MODEL_COLUMNS, PARALLEL_COLUMNS

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = ["records_to_frame"]


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
    for name, default in column_defaults().items():
        if name in frame.columns:
            continue
        if name in _DERIVED:
            frame[name] = _derived(frame, name)
        elif isinstance(default, list):
            frame[name] = pd.Series([[] for _ in range(n)], index=frame.index, dtype=object)
        else:
            frame[name] = pd.Series([default] * n, index=frame.index, dtype=object)


_DERIVED = ("num_kv_heads", "world_size", "num_microbatches")


def _derived(frame: pd.DataFrame, name: str) -> pd.Series:
    """Column ``name`` of :data:`_DERIVED` computed from the others (missing where the
    degrees it needs are not positive integers)."""
    import pandas as pd

    if name == "num_kv_heads":
        return frame["num_heads"]
    degrees = {c: pd.to_numeric(frame[c], errors="coerce")
               for c in ("dp", "tp", "pp", "micro_batch_size", "global_batch_size")}
    valid = pd.Series(True, index=frame.index)
    for values in degrees.values():
        valid &= values >= 1
    if name == "world_size":
        cp = (pd.to_numeric(frame["cp"], errors="coerce").fillna(1) if "cp" in frame.columns
              else 1)
        value = degrees["dp"] * degrees["tp"] * degrees["pp"] * cp
    else:
        value = degrees["global_batch_size"] // (degrees["dp"] * degrees["micro_batch_size"])
    return value if valid.all() else value.where(valid)


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
    for name in ("world_size", "num_microbatches"):  # an empty cell is derived too
        if frame[name].isna().any():
            frame[name] = frame[name].fillna(_derived(frame, name))
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
        table = pa.Table.from_pandas(frame[standard + extra_names], schema=schema,
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
    _check_rows(table, where)
    return table


# Measured values: (columns, rule, check on a float array; a missing value is not checked).
_VALUE_RULES: tuple[tuple[tuple[str, ...], str, Any], ...] = (
    (("step_time_s", "step_time_mean_s", "step_time_p10_s", "step_time_p90_s", "tokens_per_s",
      "tokens_per_s_per_device"), "must be a positive finite number (empty where not known)",
     lambda v: (v > 0) & (v < math.inf)),
    (("step_time_std_s", "peak_mem_allocated_gb", "peak_mem_reserved_gb", "peak_rss_gb"),
     "must be a non-negative finite number (empty where not known)",
     lambda v: (v >= 0) & (v < math.inf)),
    (("mfu",), "must be a fraction in [0, 1] (0.43 = 43%; empty where not known)",
     lambda v: (v >= 0) & (v <= 1)),
    (("warmup_steps", "measured_steps"), "must be a non-negative integer", lambda v: v >= 0),
    (("devices_per_node",), "must be a positive integer", lambda v: v >= 1),
)


def _check_rows(table: pa.Table, where: str) -> None:
    """Refuse a row its reader would refuse or misread: a model shape
    :class:`~paratune.ModelSpec` refuses (checked once per distinct model), a layout
    :class:`~paratune.ParallelConfig` refuses (``validate(model, runnable=False)``), a
    ``world_size`` other than ``dp*tp*pp*cp`` or ``num_microbatches`` other than
    ``global_batch_size // (dp*micro_batch_size)``, or a measured value out of its range.

    The layout rules are those of :class:`~paratune.batch.ConfigBatch`, checked over all
    rows at once.

    Raises:
        DatasetError: ``<where>: row <i>: <column>=<value>: <rule>`` (rows counted from 0).
    """
    import numpy as np
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return
    frame = table.select(["model_name", *MODEL_COLUMNS[1:], *PARALLEL_COLUMNS, "world_size",
                          "num_microbatches"]).to_pandas()
    try:
        batch = ConfigBatch.from_frame(frame)
    except ConfigError as exc:
        raise DatasetError(f"{where}: row {getattr(exc, 'row', 0)}: {exc}") from None
    for i in frame[list(MODEL_COLUMNS)].drop_duplicates().index:
        try:
            batch.model_at(int(i))
        except ConfigError as exc:
            raise DatasetError(f"{where}: row {i}: {exc}") from None
    _check_layouts(batch, frame, where)

    for names, rule, check in _VALUE_RULES:
        for name in names:
            values = table.column(name).to_numpy(zero_copy_only=False).astype(float)
            with np.errstate(invalid="ignore"):
                bad = ~(check(values) | np.isnan(values))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DatasetError(f"{where}: row {i}: {name}={_number(values[i])!r}: {rule}")
    times = table.column("step_times_s")
    flat = pc.list_flatten(times).to_numpy(zero_copy_only=False).astype(float)
    bad = ~((flat > 0) & (flat < math.inf))
    if bad.any():
        i = int(pc.list_parent_indices(times).to_numpy()[np.flatnonzero(bad)[0]])
        raise DatasetError(f"{where}: row {i}: step_times_s={times[i].as_py()!r}: must hold "
                           f"positive finite step times")


def _number(value: float) -> int | float:
    return int(value) if value.is_integer() else float(value)


def _stated(value: float) -> int | float | None:
    """A stated count as the message names it (``None`` where the cell is empty)."""
    return None if math.isnan(value) else _number(value)


def _check_layouts(batch: ConfigBatch, frame: pd.DataFrame, where: str) -> None:
    """Refuse the first row whose layout breaks a rule, in the order a reader checks it: the
    fields (as ``ParallelConfig`` is built), the stated ``world_size``, the layout on the
    row's model (``runnable=False``), the stated ``num_microbatches``."""
    import numpy as np

    world = frame["world_size"].to_numpy(dtype=float, na_value=math.nan)
    microbatches = frame["num_microbatches"].to_numpy(dtype=float, na_value=math.nan)
    first = batch.violations(runnable=False)
    layout_wrong = first >= 0
    built = layout_wrong & np.asarray([not rule.needs for rule in LAYOUT_RULES])[first]
    world_wrong = world != batch.world_size
    micro_wrong = microbatches != batch.num_microbatches
    bad = np.flatnonzero(built | world_wrong | layout_wrong | micro_wrong)
    if not len(bad):
        return
    i = int(bad[0])
    row = batch.take([i])
    dp, tp, pp, cp = int(row.dp[0]), int(row.tp[0]), int(row.pp[0]), int(row.cp[0])
    if built[i]:
        error = row.validate(layout=False)[0]
    elif world_wrong[i]:
        error = ConfigError("world_size", _stated(world[i]),
                            f"must equal {degrees_product(dp, tp, pp, cp)}")
    elif layout_wrong[i]:
        error = row.validate(runnable=False)[0]
    else:
        gbs, mbs = int(row.global_batch_size[0]), int(row.micro_batch_size[0])
        error = ConfigError("num_microbatches", _stated(microbatches[i]),
                            f"must equal global_batch_size // (dp*micro_batch_size) = "
                            f"{gbs} // ({dp}*{mbs}) = {int(row.num_microbatches[0])}")
    raise DatasetError(f"{where}: row {i}: {error}")
