"""Importers: public GPU measurement CSVs to paratune :class:`~paratune.Measurement` records.

The public format (one file per source) is a ``# source:`` comment line (optional), a header,
and one row per measured or failed configuration with the columns ``source, model, params_b,
layers, hidden, heads, seq_len, gpu, num_gpus, tp, pp, dp, cp, micro_batch, global_batch,
zero_stage, recompute, tflops_per_gpu, mfu, tokens_per_sec, step_time_s,
tokens_per_sec_per_gpu, precision, notes`` and optionally ``gpus_per_node, nodes, grad_accum,
gpu_mem_gb, status`` (and the shape columns of ``docs/public-format.md``). Empty cells (or
``nan``, ``none``, ``null``) are values the source does not state; a UTF-8 byte-order mark
and CRLF line endings are accepted.

Every row either becomes a record or is reported with its line number and the reason; nothing
is silently dropped or guessed. Line numbers count every line of the file, comment and header
included. A row is reported (not imported) when its cells do not line up with the header, when
every cell equals an earlier row's (a copy, not a repeated measurement), when a value is not a
finite number or breaks its column's rule (degrees and batch sizes positive integers with
``dp*tp*pp*cp == num_gpus`` (``cp`` 1 where empty), where one of num_gpus, tp, pp and dp may
be empty and is then what the others imply, as ``micro_batch`` may be where ``grad_accum`` is
stated; ``mfu`` a fraction in [0, 1]; times, rates and memory positive; on a GPU no
``precision`` naming FP8 or 32 bits and no step faster than the devices' peak computes the
model's matrix products), when its layout breaks a rule any framework needs against the
model (``tp`` dividing the heads, key-value heads and MLP width), or when stated values
contradict each other.
The optional columns ``vocab_size, ffn_hidden_size, num_kv_heads, mlp, tie_embeddings``
state the model's shape; what a row does not state comes from :data:`MODEL_FAMILIES`, which
names each assumption, or from a GPT-style default (see :func:`model_spec_from_public`).
The format is documented in ``docs/public-format.md``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune.datasets._public_rows import (
    GPT_DEFAULT,
    MODEL_FAMILIES,
    SHAPE_COLUMNS,
    _row_to_measurement,
    _Unmappable,
    config_from_public,
    model_spec_from_public,
    public_row_config,
    public_row_devices_per_node,
    public_row_layout,
)
from paratune.errors import ConfigError, DatasetError
from paratune.measurement import Measurement

__all__ = [
    "GPT_DEFAULT",
    "MODEL_FAMILIES",
    "SHAPE_COLUMNS",
    "ImportProblem",
    "ImportReport",
    "NotUtf8Error",
    "ParsedRow",
    "config_from_public",
    "first_problems",
    "header_and_body",
    "import_files",
    "is_public_csv",
    "layout_problem",
    "missing_public_columns",
    "model_spec_from_public",
    "parse_public_csv",
    "public_header_problem",
    "public_row_config",
    "public_row_devices_per_node",
    "public_row_layout",
    "read_public_csv",
]

PUBLIC_REQUIRED = ("model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp", "pp",
                   "dp", "micro_batch", "global_batch")


@dataclass(frozen=True)
class ImportProblem:
    """A row that could not be mapped: where it is and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class ParsedRow:
    """One data row of a public CSV: its raw cells and the record, or why there is none."""

    path: str
    line: int
    raw: dict[str, str]
    measurement: Measurement | None = None
    error: str = ""


@dataclass
class ImportReport:
    """What an import produced."""

    out_dir: str | None = None
    num_rows: int = 0
    num_records: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    problems: list[ImportProblem] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    """Configurations recorded both as successful and as failed (both records are kept)."""
    sources: dict[str, str] = field(default_factory=dict)
    """File name -> its ``# source:`` provenance line."""

    def summary(self) -> str:
        """A few human-readable lines: counts, then every problem with its line number."""
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.status_counts.items()))
        lines = [f"imported {self.num_records} of {self.num_rows} rows"
                 + (f" ({counts})" if counts else "")
                 + (f" into {self.out_dir}" if self.out_dir else "")]
        if self.duplicates:
            lines.append(f"{len(self.duplicates)} configurations are recorded both ok and failed;"
                         " both records are kept (a configuration that ran at least once counts "
                         "as feasible when fitting)")
        unsourced = sorted(name for name, line in self.sources.items() if not line)
        if unsourced:
            lines.append(f"no '# source:' provenance line in {', '.join(unsourced)}")
        if self.problems:
            lines.append(f"{len(self.problems)} rows not imported:")
            lines.extend(f"  {p}" for p in self.problems)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------------- reading
def is_public_csv(path: str | Path) -> bool:
    """Whether ``path`` looks like a CSV in the public format (by its header)."""
    try:
        header = header_and_body(Path(path))[0]
    except NotUtf8Error:
        raise  # not a CSV of any format: say so (file and line) rather than try another
    except (OSError, DatasetError):
        return False
    return not missing_public_columns(header)


# The columns that mark a header as the public format (the config degrees and batch sizes).
_PUBLIC_KEY_COLUMNS = ("num_gpus", "tp", "pp", "dp", "micro_batch", "global_batch")


def missing_public_columns(header: Sequence[str]) -> list[str]:
    """The columns of the public format's config (``num_gpus, tp, pp, dp, micro_batch,
    global_batch``) that ``header`` lacks; empty for a public CSV."""
    return [c for c in _PUBLIC_KEY_COLUMNS if c not in header]


# Columns of the public format that paratune's own formats do not have (they say
# ``hardware``, ``world_size``, ``micro_batch_size``, ``global_batch_size``, ``num_layers``).
_PUBLIC_ONLY_COLUMNS = ("params_b", "layers", "hidden", "heads", "gpu", "num_gpus",
                        "micro_batch", "global_batch", "zero_stage")


def public_header_problem(header: Sequence[str]) -> str | None:
    """Why a header that looks like the public format (it has a column only that format
    has) is not one: ``"missing public column(s) ..."``; ``None`` for a public header or one
    that does not look public."""
    missing = missing_public_columns(header)
    if not missing or not any(c in header for c in _PUBLIC_ONLY_COLUMNS):
        return None
    return (f"looks like the public measurement format but is missing public column(s) "
            f"{', '.join(missing)} (it needs {', '.join(_PUBLIC_KEY_COLUMNS)})")


def _read_text(path: Path) -> str:
    """The file's text (UTF-8, a byte-order mark dropped), or an error naming the file."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a CSV file") from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise NotUtf8Error(f"{path}: line {line} is not UTF-8 text (byte "
                           f"0x{data[exc.start]:02x}); save the file as UTF-8", exc) from None


class NotUtf8Error(DatasetError, UnicodeDecodeError):
    """A CSV that is not UTF-8 text: a :class:`DatasetError` naming the file and line, and
    still the :class:`UnicodeDecodeError` that callers handling undecodable input expect."""

    def __init__(self, message: str, cause: UnicodeDecodeError) -> None:
        UnicodeDecodeError.__init__(self, cause.encoding, cause.object, cause.start, cause.end,
                                    cause.reason)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _comment(line: str) -> str:
    """The ``#`` comment a line holds, or ``""``: a line starting with ``#``, or one quoted
    whole as a spreadsheet or ``csv.writer`` writes a one-cell comment that has commas
    (``"# source: a, b"``)."""
    if line.startswith("#"):
        return line.strip()
    if line.startswith('"#'):
        cells = next(csv.reader([line]), [])
        if len(cells) == 1 or not any(c.strip() for c in cells[1:]):
            return cells[0].strip()
    return ""


def header_and_body(path: Path) -> tuple[list[str], list[str], int, str]:
    """Header cells, the remaining lines, the line number of the header and the provenance.

    Lines keep their endings (``\\n``, ``\\r\\n`` or ``\\r``), so that ``csv.reader`` reads
    quoted cells holding line breaks and its ``line_num`` counts lines as an editor does.
    The provenance is every distinct ``#`` comment line before the header, joined by
    `` | `` (none is dropped when a file has two).

    Raises:
        DatasetError: the file is a directory, unreadable, not UTF-8, has no header, or its
            header names a column twice.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    lines = io.StringIO(_read_text(path), newline="").readlines()
    comments: list[str] = []
    start = 0
    while start < len(lines) and (not lines[start].strip() or _comment(lines[start])):
        comment = _comment(lines[start]).lstrip("#").strip()
        if comment and comment not in comments:
            comments.append(comment)
        start += 1
    if start >= len(lines):
        raise DatasetError(f"{path}: no CSV header (the file is empty or holds only comments)")
    header = [h.strip() for h in next(csv.reader([lines[start]]))]
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise DatasetError(f"{path}:{start + 1}: the header names column {name!r} twice")
        seen.add(name)
    return header, lines[start + 1:], start + 1, " | ".join(comments)


def read_public_csv(path: str | Path, *, seen: dict[tuple[Any, ...], str] | None = None
                    ) -> tuple[list[ParsedRow], str]:
    """Parse every data row of a public CSV.

    Args:
        path: The CSV file.
        seen: Rows already read (their cells, and the runs they map to -> ``path:line``), to
            report duplicates across files; filled in here. Duplicates within the file are
            always reported: a row whose every cell equals an earlier one's, and a row that
            maps to the same run as an earlier one (model, layout, device, source and
            measured figures) though written differently (``dp`` given once and left to
            arithmetic once, ``1`` and ``1.0``).

    Returns:
        One :class:`ParsedRow` per data row (a record or an error), and the provenance line.
        Line numbers count every line of the file (comment and header included); a row whose
        quoted cell spans lines has the number of its first line.

    Raises:
        DatasetError: the file is unreadable, has no header or lacks a required column.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    header, body, header_line, provenance = header_and_body(path)
    missing = [c for c in PUBLIC_REQUIRED if c not in header]
    if missing:
        raise DatasetError(f"{path}: not the public measurement format, missing columns "
                           f"{', '.join(missing)}")
    seen = {} if seen is None else seen
    rows = []
    reader = csv.reader(body)
    end = 0
    for cells in reader:
        line, end = header_line + end + 1, reader.line_num
        last = header_line + end
        if not cells or not any(c.strip() for c in cells):
            continue
        raw = {h: (cells[i].strip() if i < len(cells) else "") for i, h in enumerate(header)}
        parsed = ParsedRow(path=str(path), line=line, raw=raw)
        rows.append(parsed)
        parsed.error = layout_problem(cells, header, line, last)
        if parsed.error:
            continue
        key = tuple(raw.items())
        if key in seen:
            parsed.error = (f"duplicate of {seen[key]} (every cell equal): the same row "
                            "twice is a copy, not a repeated measurement")
            continue
        seen[key] = f"{path}:{line}"
        try:
            measurement = _row_to_measurement(raw)
        except _Unmappable as exc:
            parsed.error = str(exc)
            continue
        except ConfigError as exc:
            parsed.error = f"invalid {exc.field}={exc.value!r}: {exc.rule}"
            continue
        run = ("run", _run_key(measurement))
        if run in seen:
            parsed.error = (f"duplicate of {seen[run]} (the same run written differently: "
                            "model, layout, device, source and measured figures equal)")
            continue
        seen[run] = f"{path}:{line}"
        parsed.measurement = measurement
    return rows, provenance


def _run_key(measurement: Measurement) -> str:
    """What makes two rows one run: every field of its flat row (see
    :meth:`~paratune.Measurement.to_row`), in a canonical text."""
    return json.dumps(measurement.to_row(), sort_keys=True, default=str)


def layout_problem(cells: list[str], header: list[str], line: int, last: int) -> str:
    """Why a row's cells do not line up with the header, or ``""``."""
    first = cells[0].strip()
    if first.startswith("#"):
        more = (" (a second file's provenance: were two files joined into one?)"
                if first.lstrip("#").strip().startswith("source:") else "")
        return f"a '#' comment line after the header is not a data row{more}"
    if [c.strip() for c in cells] == header:
        return "repeats the header (were two files joined into one?)"
    if len(cells) > len(header) and not any(c.strip() for c in cells[len(header):]):
        cells = cells[:len(header)]  # a trailing separator, as spreadsheets export
    if len(cells) != len(header):
        span = (f" (its cells span lines {line}-{last}: a quote not closed on its line?)"
                if last > line else "")
        return f"has {len(cells)} cells but the header has {len(header)} columns{span}"
    for name, cell in zip(header, cells):
        if name != "notes" and ("\n" in cell or "\r" in cell):
            return (f"column {name}: a quoted cell spans lines {line}-{last} (a quote not "
                    f"closed on its line?)")
    return ""


def parse_public_csv(path: str | Path) -> tuple[list[Measurement], list[ImportProblem]]:
    """Records of the mappable rows of a public CSV and a problem for every other row."""
    rows, _ = read_public_csv(path)
    records = [r.measurement for r in rows if r.measurement is not None]
    problems = [ImportProblem(r.path, r.line, r.error) for r in rows if r.measurement is None]
    return records, problems


# ---------------------------------------------------------------------------------- import
def first_problems(problems: Sequence[ImportProblem], shown: int = 3) -> str:
    """The first ``shown`` problems, ``; ``-joined, and how many more there are."""
    text = "; ".join(str(p) for p in problems[:shown])
    return text + (f"; and {len(problems) - shown} more" if len(problems) > shown else "")


def _config_identity(m: Measurement) -> tuple[Any, ...]:
    return (m.source, m.model.name, m.hardware, m.devices_per_node, m.config.key())


def import_files(paths: Sequence[str | Path] | Iterable[str | Path],
                 out_dir: str | Path | None, *, replace: bool = True) -> ImportReport:
    """Convert public CSVs to paratune records and write them as one dataset.

    Rows that cannot be mapped are listed in the report with their line number and reason.
    A configuration recorded both as successful and as failed (the Ultra-Scale failed file
    repeats some successful configurations) keeps both records; models fitted on the dataset
    count a configuration that ran at least once as feasible.

    Args:
        paths: Public-format CSV files.
        out_dir: Dataset directory to write (through ``paratune.datasets.write_dataset``);
            ``None`` parses and reports without writing.
        replace: Whether to replace data already in ``out_dir``, decided under the
            dataset's write lock (see :func:`paratune.datasets.write_dataset`).

    Returns:
        An :class:`ImportReport`.

    Raises:
        DatasetError: no files, a file given twice, or a file that is a directory, unreadable,
            not UTF-8 or not in the public format (the message names the file); with
            ``out_dir``, no row that can be imported (nothing is written).
        DatasetExistsError: ``replace`` is false and ``out_dir`` already holds data.
        FileNotFoundError: a file does not exist.
    """
    report = ImportReport(out_dir=str(out_dir) if out_dir is not None else None)
    records: list[Measurement] = []
    paths = [Path(p) for p in paths]
    if not paths:
        raise DatasetError("import: no files given")
    given: dict[Path, Path] = {}
    for path in paths:
        resolved = path.resolve()
        if resolved in given:
            raise DatasetError(f"{path}: given twice (as {given[resolved]} too); every row "
                               f"would be imported twice")
        given[resolved] = path
    names = [p.name for p in paths]
    seen: dict[tuple[Any, ...], str] = {}
    for path in paths:
        rows, provenance = read_public_csv(path, seen=seen)
        report.sources[path.name if names.count(path.name) == 1 else str(path)] = provenance
        report.num_rows += len(rows)
        for row in rows:
            if row.measurement is None:
                report.problems.append(ImportProblem(row.path, row.line, row.error))
            else:
                records.append(row.measurement)
    by_identity: dict[tuple[Any, ...], set[str]] = {}
    for m in records:
        by_identity.setdefault(_config_identity(m), set()).add(m.status.value)
        report.status_counts[m.status.value] = report.status_counts.get(m.status.value, 0) + 1
    report.duplicates = sorted(f"{k[1]} {k[4]}" for k, v in by_identity.items()
                               if "ok" in v and len(v) > 1)
    report.num_records = len(records)
    if out_dir is not None and not records:
        # an empty dataset would only fail later, where the fit or evaluation reads it
        raise DatasetError("import: no row to import, nothing written" + (
            f" (each was left out: {first_problems(report.problems)})" if report.problems
            else " (nothing below the files' headers)"))
    if out_dir is not None:
        from paratune.datasets import write_dataset

        sources = sorted({m.source for m in records})
        # what each row's model took for what the row did not state, with its rows
        taken: dict[str, int] = {}
        for m in records:
            note = m.model.extra.get("assumptions", "")
            if note:
                taken[note] = taken.get(note, 0) + 1
        card = {"source": ",".join(sources) or "public", "campaign_id": "import",
                "notes": {"provenance": report.sources,
                          "assumptions": dict(sorted(taken.items(), key=lambda kv: -kv[1])),
                          "family_assumptions": {k: v.note for k, v in MODEL_FAMILIES.items()},
                          "status_counts": report.status_counts,
                          "duplicates_ok_and_failed": report.duplicates,
                          "rows_not_imported": [str(p) for p in report.problems]}}
        write_dataset(out_dir, records, card=card, replace=replace)
    return report
