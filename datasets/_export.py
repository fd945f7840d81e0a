"""Paratune datasets to the public measurement format (``docs/public-format.md``): the
inverse of :func:`~paratune.datasets.importers.import_files`.

Every row states the model's full shape (``vocab_size, ffn_hidden_size, num_kv_heads, mlp,
tie_embeddings``), so the importer assumes nothing (the rotary base and the norm epsilon,
which do not change a step's cost, are not in the format), and its measured metrics: the median
step time, the rates derived from it, MFU and peak memory (``gpu_mem_gb`` is the peak
reserved, as the format defines it; the peak allocated rides along in
``gpu_mem_allocated_gb``, a column the importer carries and ignores). A failed row states
no step metrics and keeps the first line of its error in ``notes``. A row the format cannot
express (a device the hardware catalogue does not know, a pipeline schedule other than
1F1B) is refused, naming the row and the rule: nothing is dropped or changed silently.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path

from paratune.datasets._public_rows import precision_problem, step_problem
from paratune.datasets._store import read_dataset
from paratune.errors import ConfigError, DatasetError
from paratune.fileio import atomic_write_text
from paratune.hardware import get_hardware
from paratune.measurement import Measurement, Status

__all__ = ["PUBLIC_EXPORT_COLUMNS", "export_public_csv", "public_row"]

PUBLIC_EXPORT_COLUMNS = (
    "source", "model", "params_b", "layers", "hidden", "heads", "num_kv_heads",
    "ffn_hidden_size", "vocab_size", "mlp", "tie_embeddings", "seq_len", "gpu", "num_gpus",
    "gpus_per_node", "tp", "pp", "dp", "cp", "micro_batch", "global_batch", "grad_accum",
    "schedule", "virtual_stages", "zero_stage", "recompute",
    "precision", "status", "step_time_s", "tokens_per_sec", "tokens_per_sec_per_gpu", "mfu",
    "gpu_mem_gb", "gpu_mem_allocated_gb", "notes")
"""The columns :func:`export_public_csv` writes, in order."""


def _number(value: float) -> str:
    """Six significant digits (well inside the importer's 2% agreement rule); empty where
    the value is unknown."""
    return "" if value is None or not math.isfinite(value) else f"{value:.6g}"


def public_row(m: Measurement, *, source: str | None = None, precision: str = ""
               ) -> dict[str, str]:
    """The public-format cells of one measurement (the keys of
    :data:`PUBLIC_EXPORT_COLUMNS`).

    Args:
        m: The measurement.
        source: The ``source`` cell (its first ``_``-separated word is the measurement
            family); ``None`` keeps the record's own source.
        precision: The ``precision`` cell (datasets do not record it); on a device with a
            16-bit peak, bf16 or fp16 (or empty), what the importer reads back.

    Raises:
        ValueError: the format cannot express the row, or its importer would refuse it; the
            message names the field and rule.
    """
    model, config = m.model, m.config
    try:
        hardware = get_hardware(m.hardware)
    except ConfigError:
        raise ValueError(f"hardware={m.hardware!r} is not a device of the hardware catalogue "
                         f"(the public format's gpu column needs one)") from None
    gpu = hardware.name
    ok = m.status is Status.OK
    if ok and not (math.isfinite(m.step_time_s) and m.step_time_s > 0):
        raise ValueError(f"status ok but step_time_s={m.step_time_s!r} is not a positive time")
    step = m.step_time_s if ok else math.nan
    # what the importer would refuse (a dataset's layouts already meet the model's rules):
    # a precision the model does not price there, a step faster than the devices' peak
    problem = precision_problem(precision, hardware) or step_problem(
        model, hardware, config.global_batch_size * model.seq_len, config.world_size,
        step if ok else None)
    if problem:
        raise ValueError(problem)
    tokens = m.tokens_per_s if ok and math.isfinite(m.tokens_per_s) else (
        config.global_batch_size * model.seq_len / step if ok else math.nan)
    error = m.error.strip().splitlines()[0] if m.error.strip() else ""
    return {
        "source": m.source if source is None else source,
        "model": model.name,
        "params_b": _number(model.num_params / 1e9),
        "layers": str(model.num_layers),
        "hidden": str(model.hidden_size),
        "heads": str(model.num_heads),
        "num_kv_heads": str(model.num_kv_heads),
        "ffn_hidden_size": str(model.ffn_hidden_size),
        "vocab_size": str(model.vocab_size),
        "mlp": model.mlp,
        "tie_embeddings": "true" if model.tie_embeddings else "false",
        "seq_len": str(model.seq_len),
        "gpu": gpu,
        "num_gpus": str(config.world_size),
        "gpus_per_node": str(m.devices_per_node),
        "tp": str(config.tp),
        "pp": str(config.pp),
        "dp": str(config.dp),
        "cp": str(config.cp) if config.cp > 1 else "",
        "micro_batch": str(config.micro_batch_size),
        "global_batch": str(config.global_batch_size),
        "grad_accum": str(config.num_microbatches),
        # without a pipeline the schedule is moot (the importer takes 1F1B)
        "schedule": config.schedule.value if config.pp > 1 else "",
        "virtual_stages": str(config.virtual_stages) if config.pp > 1 else "",
        "zero_stage": str(config.sharding.stage),
        "recompute": config.recompute.value,
        "precision": precision,
        "status": m.status.value,
        "step_time_s": _number(step),
        "tokens_per_sec": _number(tokens),
        "tokens_per_sec_per_gpu": _number(tokens / config.world_size),
        "mfu": _number(m.mfu if ok else math.nan),
        "gpu_mem_gb": _number(m.peak_mem_reserved_gb if ok else math.nan),
        "gpu_mem_allocated_gb": _number(m.peak_mem_allocated_gb if ok else math.nan),
        "notes": error,
    }


def export_public_csv(datasets: Sequence[str | Path] | str | Path, out: str | Path, *,
                      provenance: str = "", source: str | None = None, precision: str = "",
                      replace: bool = False) -> dict[str, int]:
    """Write the rows of one or more datasets as one CSV in the public format.

    ``paratune datasets import`` reads the file back to the same models, configurations,
    statuses and metrics (a model of the importer's GPT family, a name with ``gpt`` or a
    vTrain, Megatron or GPT source, comes back with its layers and width appended to its
    name, as the importer names GPT labels).

    Args:
        datasets: Dataset directories, cards or paratune parquet files.
        out: The CSV file to write (atomically).
        provenance: The text of the ``# source:`` first line; empty: no such line.
        source: The ``source`` of every row (see :func:`public_row`); ``None`` keeps each
            record's own.
        precision: The ``precision`` of every row (datasets do not record it).
        replace: Whether to replace an existing ``out``.

    Returns:
        Rows written per status (``{"ok": 22, "oom": 3}``).

    Raises:
        DatasetError: no dataset given, ``out`` is a directory, or exists and ``replace`` is
            false, a text spans lines, ``source`` is blank, a dataset cannot be read, or a
            row cannot be expressed in the format or would be refused by the importer (a
            ``precision`` the model does not price on its device; the dataset, its row and
            the rule are named); nothing is written then.
    """
    paths = [datasets] if isinstance(datasets, (str, Path)) else list(datasets)
    if not paths:
        raise DatasetError("export: no dataset given")
    out = Path(out)
    if out.is_dir():
        raise DatasetError(f"{out}: is a directory, not a file")
    if out.exists() and not replace:
        raise DatasetError(f"{out}: already exists; refused to replace it (replace=True, "
                           "or --force on the command line, replaces it)")
    for name, text in (("provenance", provenance), ("precision", precision),
                       ("source", source or "")):
        if "\n" in text or "\r" in text:
            raise DatasetError(f"export: the {name} must be one line")
    if source is not None and not source.strip():
        raise DatasetError(f"export: source={source!r} names no measurement family (its "
                           "first '_'-separated word); leave it out to keep each row's own")
    rows: list[dict[str, str]] = []
    counts: dict[str, int] = {}
    for path in paths:
        for index, m in enumerate(read_dataset(path).measurements()):
            try:
                rows.append(public_row(m, source=source, precision=precision))
            except ValueError as exc:
                raise DatasetError(f"{path}: row {index} ({m.model.name} {m.config.key()}): "
                                   f"{exc}") from None
            counts[m.status.value] = counts.get(m.status.value, 0) + 1
    text = io.StringIO(newline="")
    if provenance:
        text.write(f"# source: {provenance.strip()}\n")
    writer = csv.DictWriter(text, fieldnames=PUBLIC_EXPORT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out, text.getvalue())
    return counts
