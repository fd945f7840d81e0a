"""Importers: public GPU measurement CSVs to paratune :class:`~paratune.Measurement` records.

The public format (one file per source) is a ``# source:`` comment line (optional), a header,
and one row per measured or failed configuration with the columns ``source, model, params_b,
layers, hidden, heads, seq_len, gpu, num_gpus, tp, pp, dp, cp, micro_batch, global_batch,
zero_stage, recompute, tflops_per_gpu, mfu, tokens_per_sec, step_time_s,
tokens_per_sec_per_gpu, precision, notes`` and optionally ``nodes, grad_accum, gpu_mem_gb,
status``. Empty cells (or ``nan``, ``none``, ``null``) are values the source does not
state; a UTF-8 byte-order mark and CRLF line endings are accepted.

Every row either becomes a record or is reported with its line number and the reason; nothing
is silently dropped or guessed. Line numbers count every line of the file, comment and header
included. A row is reported (not imported) when its cells do not line up with the header, when
every cell equals an earlier row's (a copy, not a repeated measurement), when a value is not a
finite number or breaks its column's rule (degrees and batch sizes positive integers with
``dp*tp*pp == num_gpus``; ``mfu`` a fraction in [0, 1]; times, rates and memory positive),
or when stated values contradict each other. The optional columns ``vocab_size,
ffn_hidden_size, num_kv_heads, mlp, tie_embeddings`` state the model's shape; what a row does
not state comes from :data:`MODEL_FAMILIES`, which names each assumption, or from a GPT-style
default (see :func:`model_spec_from_public`). The format is documented in
``docs/public-format.md``.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError, DatasetError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.measurement import Measurement, Status
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding
from paratune.scalars import plain
from paratune.spec import ModelSpec

__all__ = [
    "MODEL_FAMILIES",
    "SHAPE_COLUMNS",
    "ImportProblem",
    "ImportReport",
    "NotUtf8Error",
    "ParsedRow",
    "first_problems",
    "header_and_body",
    "import_files",
    "is_public_csv",
    "layout_problem",
    "missing_public_columns",
    "parse_public_csv",
    "public_header_problem",
    "public_row_config",
    "public_row_layout",
    "read_public_csv",
]

PUBLIC_REQUIRED = ("model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp", "pp",
                   "dp", "micro_batch", "global_batch")
_STATUS_WORDS = {"ok": Status.OK, "success": Status.OK, "oom": Status.OOM,
                 "failed": Status.ERROR, "error": Status.ERROR, "crashed": Status.ERROR,
                 "timeout": Status.TIMEOUT}
# Relative disagreement tolerated between two stated values of the same quantity (rounding).
_TOLERANCE = 0.02


@dataclass(frozen=True)
class _Family:
    """Shape assumptions for a family of public models (what the CSV does not state)."""

    mlp: str
    vocab_size: int
    tie_embeddings: bool
    ffn_by_shape: dict[tuple[int, int], int]
    """``(layers, hidden) -> ffn_hidden_size`` of the configurations the source used."""
    ffn_default_ratio: float | None
    """``ffn = ratio * hidden`` when the shape is not in ``ffn_by_shape``."""
    default_recompute: Recompute
    note: str


MODEL_FAMILIES: dict[str, _Family] = {
    # nanotron scaling_benchmarks model_configs, multi-head attention, vocabulary 131072.
    # Shapes checked against the source: FLOPs per token with these MLP widths reproduce the
    # reported MFU / tokens-per-second ratio of the pp=1 rows (1B, 3B; 8B with the vocabulary
    # counted twice, as nanotron's MFU does for untied models).
    "ultrascale": _Family(
        mlp="swiglu", vocab_size=131072, tie_embeddings=False,
        ffn_by_shape={(16, 2048): 8192, (28, 3072): 8192, (32, 4096): 14336,
                      (80, 8192): 28672},
        ffn_default_ratio=None, default_recompute=Recompute.NONE,
        note="Llama-style (SwiGLU, MHA), vocab 131072, untied; MLP width from nanotron's "
             "scaling_benchmarks model_configs, else solved from params_b; not stated by the "
             "source and taken as: recompute none where the recompute cell is empty, sharding "
             "none where zero_stage is empty, 1F1B for pipelines, gpu_mem_gb as the peak "
             "reserved memory"),
    # Megatron GPT: GeLU MLP of 4x hidden, GPT-2 vocabulary padded to 51200 (divisible by
    # 128 * tp for every tp up to 8), tied input/output embeddings.
    "gpt": _Family(
        mlp="gelu", vocab_size=51200, tie_embeddings=True, ffn_by_shape={},
        ffn_default_ratio=4.0, default_recompute=Recompute.FULL,
        note="Megatron GPT (GeLU, ffn 4x hidden), vocab 50257 padded to 51200, tied "
             "embeddings; not stated by the source and taken as: full recompute where the "
             "recompute cell is empty, sharding none where zero_stage is empty (Megatron-"
             "DeepSpeed without ZeRO), 1F1B for pipelines, an A100 of 80 GB"),
}


def _family_for(source: str, model: str) -> str:
    """The :data:`MODEL_FAMILIES` key of a row: the model's name decides where it names an
    architecture (a Llama measured with Megatron-LM is still a Llama), else the source."""
    model = model.lower()
    if "llama" in model:
        return "ultrascale"
    if "gpt" in model:
        return "gpt"
    source = source.lower()
    if "vtrain" in source or "gpt" in source or "megatron" in source:
        return "gpt"
    return "ultrascale"


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
_PUBLIC_ONLY_COLUMNS = ("params_b", "layers", "hidden", "heads", "gpu", "num_gpus", "cp",
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


def read_public_csv(path: str | Path, *, seen: dict[tuple[tuple[str, str], ...], str] | None = None
                    ) -> tuple[list[ParsedRow], str]:
    """Parse every data row of a public CSV.

    Args:
        path: The CSV file.
        seen: Rows already read (their cells -> ``path:line``), to report exact duplicates
            across files; filled in here. Duplicates within the file are always reported.

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
            parsed.measurement = _row_to_measurement(raw)
        except _Unmappable as exc:
            parsed.error = str(exc)
        except ConfigError as exc:
            parsed.error = f"invalid {exc.field}={exc.value!r}: {exc.rule}"
    return rows, provenance


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


class _Unmappable(ValueError):
    """A row's values cannot be mapped to a record; the message is the reason."""


def _number(raw: dict[str, str], key: str) -> float | None:
    text = raw.get(key, "")
    if text == "" or text.lower() in ("nan", "none", "null"):
        return None
    try:
        if "_" in text:  # float() reads '1_024' as 1024: a typo more often than a number
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise _Unmappable(f"{key}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise _Unmappable(f"{key}={text!r} must be a finite number (leave the cell empty where "
                          f"the source states no value)")
    return value


# Measured or stated quantities: (column, rule, check). Empty cells are values not stated.
_METRIC_RULES: tuple[tuple[str, str, Any], ...] = (
    ("mfu", "must be a fraction in [0, 1] (0.43 = 43%)", lambda v: 0 <= v <= 1),
    ("tokens_per_sec", "must be positive", lambda v: v > 0),
    ("tokens_per_sec_per_gpu", "must be positive", lambda v: v > 0),
    ("step_time_s", "must be positive", lambda v: v > 0),
    ("tflops_per_gpu", "must be positive", lambda v: v > 0),
    ("gpu_mem_gb", "must be positive", lambda v: v > 0),
    ("params_b", "must be positive", lambda v: v > 0),
)
_STEP_METRICS = ("mfu", "tokens_per_sec", "tokens_per_sec_per_gpu", "step_time_s",
                 "tflops_per_gpu")


def _check_metrics(raw: dict[str, str]) -> None:
    for key, rule, check in _METRIC_RULES:
        value = _number(raw, key)
        if value is not None and not check(value):
            raise _Unmappable(f"{key}={raw[key]!r} {rule}")


def _integer(raw: dict[str, str], key: str, *, required: bool = True) -> int | None:
    value = _number(raw, key)
    if value is None:
        if required:
            raise _Unmappable(f"missing {key}")
        return None
    if value != int(value) or value < 1:
        raise _Unmappable(f"{key}={raw[key]!r} must be a positive integer")
    return int(value)


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= _TOLERANCE * max(abs(a), abs(b))


# Optional public columns that state the model's shape where the family's assumption (the
# vocabulary, the MLP, multi-head attention, tying) does not hold; each overrides it.
SHAPE_COLUMNS = ("vocab_size", "ffn_hidden_size", "num_kv_heads", "mlp", "tie_embeddings")
# The shape taken where the family's cannot be (no params_b, or a params_b smaller than the
# family's vocabulary allows): a GPT-style model, as in GPT-2/GPT-3 and Megatron-LM's defaults.
GPT_DEFAULT = "gpt"


def _shape_cell(raw: dict[str, str], key: str) -> str:
    text = raw.get(key, "").strip()
    return "" if text.lower() in ("nan", "none", "null") else text


def _stated_shape(raw: dict[str, str]) -> dict[str, Any]:
    """The shape columns a row states, checked (a one-line reason naming the column if not)."""
    stated: dict[str, Any] = {}
    for key in ("vocab_size", "ffn_hidden_size", "num_kv_heads"):
        value = _integer(raw, key, required=False)
        if value is not None:
            stated[key] = value
    mlp = _shape_cell(raw, "mlp").lower()
    if mlp:
        if mlp not in ("swiglu", "gelu"):
            raise _Unmappable(f"mlp={raw['mlp']!r} must be swiglu or gelu")
        stated["mlp"] = mlp
    tie = _shape_cell(raw, "tie_embeddings").lower()
    if tie:
        if tie not in ("true", "1", "yes", "false", "0", "no"):
            raise _Unmappable(f"tie_embeddings={raw['tie_embeddings']!r} must be true or false "
                              "(or 1/0, yes/no)")
        stated["tie_embeddings"] = tie in ("true", "1", "yes")
    return stated


def _default_ffn(hidden: int, mlp: str) -> int:
    """The GPT-style MLP width: 4x hidden for GeLU; for SwiGLU the same FLOPs, 8/3 x hidden
    rounded up to a multiple of 256 (Llama's and Megatron-LM's rule)."""
    if mlp == "gelu":
        return 4 * hidden
    return -(-int(8 * hidden / 3) // 256) * 256


def model_spec_from_public(raw: dict[str, str]) -> ModelSpec:
    """The :class:`ModelSpec` of a public row.

    The shape is what the row states (``layers, hidden, heads, seq_len`` and the optional
    :data:`SHAPE_COLUMNS`); what it does not state comes from its family in
    :data:`MODEL_FAMILIES`: a known shape's MLP width, else the MLP width solved from
    ``params_b``, else (no ``params_b``, or one too small for the family's vocabulary) the
    GPT-style default: 4x hidden GeLU MLP, vocabulary 51200, tied embeddings. The assumptions
    taken are named in the spec's ``extra["assumptions"]``.

    Raises:
        _Unmappable: a shape cell is missing or breaks its column's rule.
        ConfigError: the shape breaks a :class:`ModelSpec` rule.
    """
    label = raw.get("model", "") or "model"
    family_name = _family_for(raw.get("source", ""), label)
    layers = _integer(raw, "layers")
    hidden = _integer(raw, "hidden")
    heads = _integer(raw, "heads")
    seq_len = _integer(raw, "seq_len")
    stated = _stated_shape(raw)
    family = MODEL_FAMILIES[family_name]
    shape = _family_shape(family, stated)
    kv_heads = stated.get("num_kv_heads", heads)
    solved = _ffn_from_params(raw, layers=layers, hidden=hidden,
                              kv_dim=hidden * kv_heads // heads, **shape)
    ffn = stated.get("ffn_hidden_size")
    if ffn is None and shape == _family_shape(family, {}):
        ffn = family.ffn_by_shape.get((layers, hidden))
    if ffn is None and family.ffn_default_ratio and shape["mlp"] == family.mlp:
        ffn = int(family.ffn_default_ratio * hidden)
    note = family.note
    too_small = solved is None and _number(raw, "params_b") is not None
    if (ffn is None and solved is None) or (too_small and not {"vocab_size", "tie_embeddings"}
                                            <= stated.keys()):
        # the family's shape cannot be the model's (params_b is too small for its
        # vocabulary, or nothing gives the MLP width): the GPT-style default for what the row
        # does not state
        family_name = GPT_DEFAULT
        shape = _family_shape(MODEL_FAMILIES[GPT_DEFAULT], stated)
        solved = None
        if ffn is None or "ffn_hidden_size" not in stated:
            ffn = _default_ffn(hidden, shape["mlp"])
        note = ("GPT-style default shape, the row's params_b being "
                + ("too small for the source family's vocabulary" if too_small else "missing")
                + ": GeLU MLP of 4x hidden (SwiGLU of 8/3x where mlp=swiglu is stated), vocab "
                "51200, tied embeddings, multi-head attention, for what the row does not state")
    if ffn is None:
        ffn = solved
    if stated:
        note += "; stated by the row: " + ", ".join(f"{k}={v}" for k, v in stated.items())
    name = label if family_name == "ultrascale" else f"{label}-{layers}L-{hidden}H"
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv_heads, ffn_hidden_size=ffn,
                     seq_len=seq_len, extra={"assumptions": note}, **shape)


def _family_shape(family: _Family, stated: dict[str, Any]) -> dict[str, Any]:
    """``mlp, vocab_size, tie_embeddings``: the stated ones, else the family's."""
    return {"mlp": stated.get("mlp", family.mlp),
            "vocab_size": stated.get("vocab_size", family.vocab_size),
            "tie_embeddings": stated.get("tie_embeddings", family.tie_embeddings)}


def _ffn_from_params(raw: dict[str, str], *, layers: int, hidden: int, kv_dim: int, mlp: str,
                     vocab_size: int, tie_embeddings: bool) -> int | None:
    """The MLP width that makes the model ``params_b`` (multiple of 256), or ``None`` where
    ``params_b`` is not stated or too small for this vocabulary and depth."""
    params_b = _number(raw, "params_b")
    if params_b is None:
        return None
    if params_b <= 0:
        raise _Unmappable(f"params_b={raw['params_b']!r} must be positive")
    embeddings = hidden * vocab_size * (1 if tie_embeddings else 2)
    matrices = 3 if mlp == "swiglu" else 2
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim  # q, o and k, v
    rest = params_b * 1e9 - embeddings - layers * (attention + 2 * hidden) - hidden
    ffn = round(rest / (matrices * hidden * layers) / 256) * 256
    return int(ffn) if ffn >= hidden else None


def config_from_public(raw: dict[str, str], *, check_grad_accum: bool = True
                       ) -> tuple[ParallelConfig, int]:
    """The :class:`ParallelConfig` of a public row and its stated GPU count.

    Args:
        raw: The row's cells.
        check_grad_accum: Require ``dp * micro_batch * grad_accum == global_batch`` where
            ``grad_accum`` is stated (a record needs it; a prediction uses ``global_batch``).

    Raises:
        _Unmappable: a degree is missing or stated values contradict each other.
    """
    num_gpus = _integer(raw, "num_gpus")
    tp, pp, dp = (_integer(raw, k) for k in ("tp", "pp", "dp"))
    micro, global_batch = _integer(raw, "micro_batch"), _integer(raw, "global_batch")
    cp = _integer(raw, "cp", required=False) or 1
    if cp != 1:
        raise _Unmappable(f"cp={cp}: context parallelism is not modelled")
    if dp * tp * pp != num_gpus:
        raise _Unmappable(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} contradicts "
                          f"num_gpus={num_gpus}")
    if global_batch % (dp * micro):
        raise _Unmappable(f"global_batch={global_batch} is not a multiple of dp*micro_batch = "
                          f"{dp}*{micro}")
    grad_accum = _integer(raw, "grad_accum", required=False)
    if check_grad_accum and grad_accum is not None and dp * micro * grad_accum != global_batch:
        raise _Unmappable(f"dp*micro_batch*grad_accum = {dp}*{micro}*{grad_accum} = "
                          f"{dp * micro * grad_accum} contradicts global_batch={global_batch}")
    zero = _number(raw, "zero_stage")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise _Unmappable(f"zero_stage={raw['zero_stage']!r} must be 0, 1, 2 or 3")
    recompute_text = raw.get("recompute", "").lower()
    family = MODEL_FAMILIES[_family_for(raw.get("source", ""), raw.get("model", ""))]
    if not recompute_text:
        recompute = family.default_recompute
    elif recompute_text.startswith("full"):
        recompute = Recompute.FULL
    elif recompute_text.startswith("selective"):
        recompute = Recompute.SELECTIVE
    elif recompute_text in ("none", "no", "false", "0"):
        recompute = Recompute.NONE
    elif recompute_text in ("yes", "true", "1"):
        recompute = Recompute.FULL
    else:
        raise _Unmappable(f"recompute={raw['recompute']!r} is not none, full or selective")
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                            global_batch_size=global_batch, schedule=Schedule.ONE_F_ONE_B,
                            sharding=Sharding.from_stage(int(zero or 0)), recompute=recompute)
    return config, num_gpus


def public_row_layout(raw: dict[str, str]) -> tuple[ModelSpec, ParallelConfig, HardwareSpec]:
    """The model, layout and hardware of a public row, as a prediction needs them.

    Only the configuration is checked (not the metrics, nor a stated ``grad_accum`` that
    contradicts ``global_batch``).

    Raises:
        ValueError: the configuration cannot be mapped (missing degrees, contradictions, a
            ``gpu`` the catalogue does not know); the message is the reason.
    """
    try:
        model = model_spec_from_public(raw)
        config, _ = config_from_public(raw, check_grad_accum=False)
    except ConfigError as exc:
        raise ValueError(f"invalid {exc.field}={exc.value!r}: {exc.rule}") from None
    try:
        hardware = get_hardware(raw.get("gpu", ""))
    except ConfigError as exc:
        raise ValueError(f"gpu={raw.get('gpu', '')!r} {exc.rule}") from None
    try:
        nodes = _integer(raw, "nodes", required=False)
    except _Unmappable as exc:
        raise ValueError(str(exc)) from None
    if nodes is not None and hardware.num_nodes(config.world_size) != nodes:
        raise ValueError(f"nodes={nodes} contradicts num_gpus={config.world_size} on "
                         f"{hardware.devices_per_node}-GPU nodes")
    return model, config, hardware


def public_row_config(raw: dict[str, str]) -> dict[str, Any]:
    """A config-frame row (:data:`paratune.predictor.CONFIG_COLUMNS`) for a public row.

    Raises:
        ValueError: as :func:`public_row_layout`.
    """
    from paratune.batch import ConfigBatch

    model, config, hardware = public_row_layout(raw)
    frame = ConfigBatch.from_configs(model, [config], hardware).to_frame()
    return {k: plain(v) for k, v in frame.iloc[0].items()}


def _row_to_measurement(raw: dict[str, str]) -> Measurement:
    notes = raw.get("notes", "")
    flag = re.search(r"FLAG=([^;]*)", notes)
    model = model_spec_from_public(raw)
    config, num_gpus = config_from_public(raw)
    try:
        hardware = get_hardware(raw["gpu"])
    except ConfigError:
        raise _Unmappable(f"gpu={raw['gpu']!r} is not a known device") from None
    nodes = _integer(raw, "nodes", required=False)
    per_node = hardware.devices_per_node
    if nodes is not None and hardware.num_nodes(num_gpus) != nodes:
        raise _Unmappable(f"nodes={nodes} contradicts num_gpus={num_gpus} on "
                          f"{per_node}-GPU nodes")
    if flag:
        raise _Unmappable(f"the source flags contradictory values (FLAG={flag.group(1)})")
    _check_metrics(raw)

    tokens = config.global_batch_size * model.seq_len
    step = _number(raw, "step_time_s")
    cluster_tps = _number(raw, "tokens_per_sec")
    per_gpu_tps = _number(raw, "tokens_per_sec_per_gpu")
    if cluster_tps is not None and per_gpu_tps is not None and not _agree(
            cluster_tps, per_gpu_tps * num_gpus):
        raise _Unmappable(f"tokens_per_sec={cluster_tps:g} contradicts tokens_per_sec_per_gpu*"
                          f"num_gpus = {per_gpu_tps * num_gpus:g}")
    if cluster_tps is None and per_gpu_tps is not None:
        cluster_tps = per_gpu_tps * num_gpus
    if step is None and cluster_tps:
        step = tokens / cluster_tps
    elif step is not None and cluster_tps and not _agree(step, tokens / cluster_tps):
        raise _Unmappable(f"step_time_s={step:g} contradicts global_batch*seq_len/tokens_per_sec "
                          f"= {tokens / cluster_tps:g}")
    if cluster_tps is None and step:
        cluster_tps = tokens / step

    status_text = raw.get("status", "").lower()
    if status_text:
        if status_text not in _STATUS_WORDS:
            raise _Unmappable(f"status={raw['status']!r} is not one of "
                              f"{', '.join(sorted(_STATUS_WORDS))}")
        status = _STATUS_WORDS[status_text]
    elif step:
        status = Status.OK
    else:
        raise _Unmappable("no status and no step_time_s or tokens_per_sec: neither a "
                          "measurement nor a stated failure")
    if status is Status.OK and not step:
        raise _Unmappable("status ok but neither step_time_s nor tokens_per_sec is stated")
    error = ""
    if status is not Status.OK:
        stated = [k for k in _STEP_METRICS if _number(raw, k) is not None]
        if stated:
            raise _Unmappable(f"status={raw['status']!r} contradicts the stated "
                              f"{', '.join(stated)}: a run that did not finish has no step "
                              f"metrics")
        error = f"{raw.get('status') or 'failed'}: the source reports no metrics (crashed or " \
                "out of memory)"
        step = cluster_tps = None

    mem = _number(raw, "gpu_mem_gb")
    mfu = _number(raw, "mfu")
    return Measurement(
        model=model, config=config, hardware=hardware.name, devices_per_node=per_node,
        status=status, error=error,
        step_time_s=step if step is not None else math.nan,
        tokens_per_s=cluster_tps if cluster_tps is not None else math.nan,
        peak_mem_reserved_gb=mem if mem is not None else math.nan,
        mfu=mfu if mfu is not None and status is Status.OK else math.nan,
        source=raw.get("source", "") or "public", campaign_id=raw.get("model", ""),
        fingerprint={"device_name": hardware.name, "device_count": num_gpus},
        timestamp=0.0,
    )


# ---------------------------------------------------------------------------------- import
def first_problems(problems: Sequence[ImportProblem], shown: int = 3) -> str:
    """The first ``shown`` problems, ``; ``-joined, and how many more there are."""
    text = "; ".join(str(p) for p in problems[:shown])
    return text + (f"; and {len(problems) - shown} more" if len(problems) > shown else "")


def _config_identity(m: Measurement) -> tuple[Any, ...]:
    return (m.source, m.model.name, m.hardware, m.config.key())


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
    seen: dict[tuple[tuple[str, str], ...], str] = {}
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
    report.duplicates = sorted(f"{k[1]} {k[3]}" for k, v in by_identity.items()
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
        card = {"source": ",".join(sources) or "public", "campaign_id": "import",
                "notes": {"provenance": report.sources,
                          "assumptions": {k: v.note for k, v in MODEL_FAMILIES.items()},
                          "status_counts": report.status_counts,
                          "duplicates_ok_and_failed": report.duplicates,
                          "rows_not_imported": [str(p) for p in report.problems]}}
        write_dataset(out_dir, records, card=card, replace=replace)
    return report
