"""Predicting a CSV of configurations: the public measurement format or paratune's own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.batch import FRAME_DEFAULTS, LAYOUT_INTS, MLP_KINDS, MODEL_INTS, OPTIONS, option_codes
from paratune.errors import DatasetError
from paratune.parallel import MAX_DEVICES, MAX_GLOBAL_BATCH
from paratune.predictor import CONFIG_COLUMNS, MODEL_COLUMNS, PARALLEL_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from paratune.predictor import Predictor

__all__ = ["predict_csv", "read_config_csv"]

_OWN_REQUIRED = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
                 "seq_len", "dp", "tp", "pp", "micro_batch_size", "global_batch_size",
                 "hardware")
_LIMITS = {"dp": MAX_DEVICES, "tp": MAX_DEVICES, "pp": MAX_DEVICES, "world_size": MAX_DEVICES,
           "devices_per_node": MAX_DEVICES, "virtual_stages": MAX_DEVICES, "cp": MAX_DEVICES,
           "num_microbatches": MAX_GLOBAL_BATCH, "micro_batch_size": MAX_GLOBAL_BATCH,
           "global_batch_size": MAX_GLOBAL_BATCH}
"""The largest value of a parallel column a prediction row may give."""
_INTEGER = (*MODEL_INTS, *LAYOUT_INTS, "world_size", "num_microbatches", "devices_per_node")
_DEFAULTS: dict[str, Any] = {k: (np.nan if v is None else v) for k, v in FRAME_DEFAULTS.items()}
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no", "")


def _read_raw(path: Path) -> tuple[pd.DataFrame, np.ndarray]:
    """Every data row's cells as strings (padded or cut to the header) and why each row cannot
    be read as a row (``""`` where it can): empty, or cells that do not line up with the header
    as ``paratune datasets import`` reports them (a cell count other than the header's, a
    ``#`` comment line, a repeated header, a quote not closed on its line). Blank lines are no
    rows, as pandas reads them. A row whose cells span several lines and do not line up is one
    output row per line it spans, each with the reason: no line of the input vanishes."""
    import csv

    import pandas as pd

    from paratune.datasets.importers import header_and_body, layout_problem

    header, body, header_line, _ = header_and_body(path)
    rows: list[list[str]] = []
    errors: list[str] = []

    def add(cells: list[str], error: str) -> None:
        rows.append((cells + [""] * (len(header) - len(cells)))[: len(header)])
        errors.append(error)

    start = 0
    while start < len(body):
        reader = csv.reader(body[start:])
        end = 0
        for cells in reader:
            first, end = end, reader.line_num
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue
            if not any(c.strip() for c in cells):
                add(cells, "empty row: every cell is empty")
                continue
            line = header_line + start + first + 1
            error = layout_problem(cells, header, line, header_line + start + end)
            if not error or end - first == 1:
                add(cells, error)
                continue
            # a quote not closed on its line swallowed the lines after it: each line it spans
            # is a row of its own (not predicted), and reading starts again after them
            for text in body[start + first:start + end]:
                if text.strip():
                    add(next(csv.reader([text.rstrip("\r\n")]), []), error)
            start += end
            break
        else:
            break
    raw = pd.DataFrame(rows, columns=header, dtype=object)
    return raw, np.asarray(errors, dtype=object)


def read_config_csv(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray]:
    """Read a CSV of configurations to predict.

    Args:
        path: A CSV in the public measurement format (optional ``# source:`` first line) or
            with paratune's config columns (:data:`paratune.predictor.CONFIG_COLUMNS`;
            optional ones take their defaults).

    Returns:
        ``(raw, configs, errors)``: the input cells as strings (every row, in order), the
        config frame with a ``source`` column (same length; placeholder values where a row
        could not be read) and a message per row (empty where the row was read).

    Raises:
        DatasetError: the file has neither format's required columns (a header that looks
            like the public format is told which public columns it lacks).
    """
    import pandas as pd

    from paratune.datasets.importers import (
        PUBLIC_REQUIRED,
        missing_public_columns,
        public_header_problem,
    )

    path = Path(path)
    raw, errors = _read_raw(path)
    # the header as read above (is_public_csv would read the file again)
    if not missing_public_columns(list(raw.columns)):
        # a column every row needs for a prediction (all the format requires but the
        # model's name) is the file's problem, told once, as import and fit tell theirs
        lacking = [c for c in PUBLIC_REQUIRED if c != "model" and c not in raw.columns]
        if lacking:
            raise DatasetError(f"{path}: the public measurement format without columns "
                               f"{', '.join(lacking)}, which every row needs for a prediction")
        configs = _public_configs(raw, errors)
        return raw, _fill_placeholders(configs, errors), errors
    missing = [c for c in _OWN_REQUIRED if c not in raw.columns]
    # a header with every config column is that format, whatever other columns it has (one
    # named like a public column, num_gpus or gpu, passes through as the others do)
    problem = public_header_problem(list(raw.columns)) if missing else None
    if problem:
        raise DatasetError(f"{path}: {problem}")
    if missing:
        raise DatasetError(f"{path}: neither the public measurement format nor paratune's "
                           f"config columns (missing {', '.join(missing)})")
    configs = pd.DataFrame(index=raw.index)
    for column in (*MODEL_COLUMNS, *PARALLEL_COLUMNS, "devices_per_node", "hardware"):
        if column in raw.columns:
            configs[column] = raw[column].astype(str).str.strip()
        else:
            configs[column] = _DEFAULTS.get(column, np.nan)
    _parse_integers(configs, raw, errors)
    _parse_flags_and_numbers(configs, raw, errors)
    for column in (*OPTIONS, "mlp"):
        default = _DEFAULTS[column]
        configs[column] = configs[column].replace("", default).fillna(default)
    configs["virtual_stages"] = configs["virtual_stages"].fillna(1)
    configs["cp"] = configs["cp"].fillna(1)
    _derive_counts(configs, raw, errors)
    _check_options(configs, errors)
    _check_layouts(configs, errors)
    # the source (when given) picks the step-time model of its measurement family
    configs["source"] = raw["source"].astype(str) if "source" in raw.columns else ""
    return raw, _fill_placeholders(configs[[*CONFIG_COLUMNS, "source"]], errors), errors


def _public_configs(raw: pd.DataFrame, errors: np.ndarray) -> pd.DataFrame:
    """The config frame of rows in the public measurement format (placeholders where a row
    could not be read; its message goes into ``errors``)."""
    from paratune.batch import ConfigBatch
    from paratune.datasets.importers import public_row_devices_per_node, public_row_layout

    parts, per_node = [], []
    for i, cells in enumerate(raw.to_dict("records")):
        if not errors[i]:
            row = {k: str(v).strip() for k, v in cells.items()}
            try:
                parts.append(public_row_layout(row))
                per_node.append(public_row_devices_per_node(row))
                continue
            except ValueError as exc:
                errors[i] = str(exc)
        parts.append(_placeholder_parts())
        per_node.append(None)
    batch = ConfigBatch.from_configs([p[0] for p in parts], [p[1] for p in parts],
                                     [p[2] for p in parts], devices_per_node=per_node)
    configs = batch.to_frame()
    configs["source"] = raw["source"].to_numpy() if "source" in raw.columns else ""
    return configs


def _parse_integers(configs: pd.DataFrame, raw: pd.DataFrame, errors: np.ndarray) -> None:
    """The integer columns as numbers; a message per row whose value is not a positive
    integer or beyond the plausible range."""
    import pandas as pd

    for column in _INTEGER:
        if column not in configs.columns:
            continue
        values = pd.to_numeric(configs[column].replace("", np.nan), errors="coerce")
        given = configs[column].astype(str).ne("") & configs[column].notna()
        bad = (values.isna() & given) | (values.notna() & ((values < 1) | (values % 1 != 0)))
        if column in _OWN_REQUIRED:
            bad |= values.isna()
        for i in np.flatnonzero(bad.to_numpy() & (errors == "")):
            errors[i] = f"{column}={raw[column].iloc[i]!r} must be a positive integer"
        limit = _LIMITS.get(column)
        if limit is not None:  # 1e26 sequences is a typo: refused, not predicted
            for i in np.flatnonzero((values > limit).to_numpy() & (errors == "")):
                errors[i] = (f"{column}={raw[column].iloc[i]!r} is beyond the plausible range "
                             f"(at most {limit})")
        configs[column] = values


def _parse_flags_and_numbers(configs: pd.DataFrame, raw: pd.DataFrame, errors: np.ndarray
                             ) -> None:
    """``tie_embeddings`` as a flag and the positive real columns as numbers, with a message
    per row that holds neither."""
    import pandas as pd

    if "tie_embeddings" in raw.columns:
        flag = raw["tie_embeddings"].astype(str).str.strip().str.lower()
        wrong = ~flag.isin(_TRUE + _FALSE)
        for i in np.flatnonzero(wrong.to_numpy() & (errors == "")):
            errors[i] = (f"tie_embeddings={raw['tie_embeddings'].iloc[i]!r} must be true or "
                         "false (or 1/0, yes/no; empty: false)")
        configs["tie_embeddings"] = flag.isin(_TRUE)
    for column in ("rope_theta", "norm_eps"):
        if column not in raw.columns:
            continue
        text = configs[column].astype(str)
        values = pd.to_numeric(text.replace("", np.nan), errors="coerce")
        bad = text.ne("") & ~(np.isfinite(values) & (values > 0))
        for i in np.flatnonzero(bad.to_numpy() & (errors == "")):
            errors[i] = f"{column}={raw[column].iloc[i]!r} must be a positive number"
        configs[column] = values.fillna(_DEFAULTS[column])


def _derive_counts(configs: pd.DataFrame, raw: pd.DataFrame, errors: np.ndarray) -> None:
    """``world_size`` and ``num_microbatches`` from the layout, checked against the stated
    ones."""
    import pandas as pd

    configs["world_size"] = configs["dp"] * configs["tp"] * configs["pp"] * configs["cp"]
    if "world_size" in raw.columns:
        stated = pd.to_numeric(raw["world_size"], errors="coerce")
        clash = stated.notna() & (stated != configs["world_size"])
        for i in np.flatnonzero(clash.to_numpy() & (errors == "")):
            product = "dp*tp*pp*cp" if configs["cp"].iloc[i] > 1 else "dp*tp*pp"
            errors[i] = (f"world_size={raw['world_size'].iloc[i]} contradicts {product} = "
                         f"{int(configs['world_size'].iloc[i])}")
    configs["num_microbatches"] = configs["global_batch_size"] / (
        configs["dp"] * configs["micro_batch_size"])
    uneven = configs["num_microbatches"] % 1 != 0
    for i in np.flatnonzero(uneven.to_numpy() & (errors == "")):
        dp, micro = int(configs["dp"].iloc[i]), int(configs["micro_batch_size"].iloc[i])
        errors[i] = (f"global_batch_size={raw['global_batch_size'].iloc[i]} is not a multiple "
                     f"of dp*micro_batch_size = {dp}*{micro} = {dp * micro}")
    if "num_microbatches" in raw.columns:
        stated = pd.to_numeric(raw["num_microbatches"], errors="coerce")
        clash = stated.notna() & (stated != configs["num_microbatches"])
        for i in np.flatnonzero(clash.to_numpy() & (errors == "")):
            errors[i] = (f"num_microbatches={raw['num_microbatches'].iloc[i]} contradicts "
                         "global_batch_size/(dp*micro_batch_size) = "
                         f"{int(configs['num_microbatches'].iloc[i])}")


def _check_options(configs: pd.DataFrame, errors: np.ndarray) -> None:
    """A message per row whose schedule, sharding, recompute or MLP kind is unknown."""
    for column, rule in (*((name, tuple(option_codes(name))) for name in OPTIONS),
                         ("mlp", MLP_KINDS)):
        wrong = ~configs[column].astype(str).str.lower().isin(rule)
        for i in np.flatnonzero(wrong.to_numpy() & (errors == "")):
            errors[i] = f"{column}={configs[column].iloc[i]!r} must be one of {', '.join(rule)}"

def _check_layouts(configs: pd.DataFrame, errors: np.ndarray) -> None:
    """Write into ``errors`` why a row's layout cannot run its model (tp must divide the heads,
    a stage needs a layer, virtual stages need the interleaved schedule...), for the rows
    read without error: the first rule of :class:`~paratune.batch.ConfigBatch` each breaks
    (the model's own shape first, as :class:`~paratune.ModelSpec` checks it)."""
    from paratune.batch import ConfigBatch
    from paratune.errors import ConfigError

    while True:
        readable = np.flatnonzero(errors == "")
        if not len(readable):
            return
        part = configs.iloc[readable].copy()
        for column in ("schedule", "sharding", "recompute", "mlp"):
            part[column] = part[column].astype(str).str.strip().str.lower()
        try:
            batch = ConfigBatch.from_frame(part)
            break
        except ConfigError as exc:  # a size past int64 (1e30 layers): refused, not predicted
            errors[readable[exc.row]] = str(exc)
    built = batch.validate(layout=False)
    laid_out = batch.validate(runnable=False)
    shapes = part[[c for c in MODEL_COLUMNS if c != "model_name"]]
    keys = np.asarray(["|".join(map(str, row)) for row in shapes.itertuples(index=False)])
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    shape_errors = []
    for i in first.tolist():
        try:
            # the shape the layout rules read; the rope base and norm epsilon are not checked
            batch.take([i]).model_at(0)
            shape_errors.append(None)
        except ConfigError as exc:
            shape_errors.append(exc)
    shape_error = [shape_errors[k] for k in inverse.tolist()]
    # in the order a reader meets them: the layout's fields, the model, the layout's rules
    errors[readable] = np.asarray([str(a or b or c or "") for a, b, c in
                                   zip(built, shape_error, laid_out)], dtype=object)


def _placeholder_parts() -> tuple[Any, Any, Any]:
    """A model, layout and hardware standing in for a row that could not be read (its
    predictions are blanked)."""
    from paratune.parallel import ParallelConfig
    from paratune.spec import get_model

    return get_model("tiny"), ParallelConfig(), "cpu"


def _fill_placeholders(configs: pd.DataFrame, errors: np.ndarray) -> pd.DataFrame:
    """Rows that could not be read get a harmless placeholder (their predictions are blanked)."""
    from paratune.predictor import config_frame

    bad = errors != ""
    if not bad.any():
        return configs.reset_index(drop=True)
    model, layout, hardware = _placeholder_parts()
    placeholder = config_frame(model, [layout], hardware).iloc[0]
    configs = configs.reset_index(drop=True).copy()
    for column in configs.columns:
        configs[column] = configs[column].astype(object)
        configs.loc[bad, column] = placeholder.get(column, "")
    return configs


def predict_csv(model: Predictor, input_path: str | Path, output_path: str | Path | None = None
                ) -> pd.DataFrame:
    """Predict every row of a configuration CSV and write input columns plus predictions.

    Args:
        model: A fitted predictor.
        input_path: See :func:`read_config_csv`.
        output_path: CSV to write (``None``: only return the frame).

    Returns:
        The input cells followed by the prediction columns and ``pred_error``, one row per
        input row in order (a row of empty cells included). Rows that could not be predicted
        have empty predictions and a message. Input columns named like prediction columns
        (a previous output) are replaced by the new predictions.
    """
    from paratune.fileio import atomic_write_text
    from paratune.models._estimators import PRED_ERROR

    raw, configs, errors = read_config_csv(input_path)
    if len(configs):
        pred = model.predict(configs).reset_index(drop=True)
    else:
        import pandas as pd

        from paratune.models._estimators import OUTPUT_COLUMNS

        pred = pd.DataFrame(columns=list(OUTPUT_COLUMNS))
    reading = errors != ""
    numeric = [c for c in pred.columns if c != PRED_ERROR]
    pred.loc[reading, numeric] = np.nan
    pred[PRED_ERROR] = np.where(reading, errors, pred[PRED_ERROR].astype(object))
    out = raw.reset_index(drop=True).copy()
    stale = [c for c in pred.columns if c in out.columns]
    if stale:  # a previous output fed back in: its predictions are replaced, not kept
        import logging

        logging.getLogger(__name__).warning(
            "%s: replaced the input's prediction columns %s with new predictions", input_path,
            ", ".join(stale))
        out = out.drop(columns=stale)
    for column in pred.columns:
        out[column] = pred[column].to_numpy()
    if output_path is not None:
        atomic_write_text(output_path, out.to_csv(index=False))
    return out
