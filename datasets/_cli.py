"""The ``paratune datasets`` command group: ``show``, ``import`` and ``export``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from paratune.table import format_table

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "datasets", help="inspect and import measurement datasets",
        description="Inspect paratune datasets (parquet + card) and import public measurements.")
    commands = parser.add_subparsers(dest="datasets_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    show = commands.add_parser("show", help="summarise a dataset in a table",
                               description="Summarise a dataset: its card, then counts by "
                                           "status and the fastest config per world size.")
    show.add_argument("paths", nargs="+", metavar="DIR",
                      help="dataset directory, its card.json, or a paratune .parquet file")
    show.set_defaults(func=_show)

    imp = commands.add_parser("import", help="import public measurement CSVs as a dataset",
                              description="Convert public-format measurement CSVs to a "
                                          "paratune dataset.")
    imp.add_argument("files", nargs="+", metavar="FILE", help="public-format CSV files")
    imp.add_argument("--out", required=True, metavar="DIR", help="dataset directory to write")
    imp.add_argument("--force", action="store_true",
                     help="replace the dataset already in --out (refused without it)")
    imp.set_defaults(func=_import, field_flags={"out": "--out"})

    exp = commands.add_parser("export", help="write datasets as one public-format CSV",
                              description="Write the rows of paratune datasets as one CSV in "
                                          "the public measurement format (docs/public-format"
                                          ".md), which 'paratune datasets import', fit, predict "
                                          "and evaluate read.")
    exp.add_argument("paths", nargs="+", metavar="DIR",
                     help="dataset directory, its card.json, or a paratune .parquet file")
    exp.add_argument("--out", required=True, metavar="FILE", help="CSV file to write")
    exp.add_argument("--source", metavar="NAME",
                     help="the source of every row; its first '_'-separated word is the "
                          "measurement family (default: each row's own source)")
    exp.add_argument("--provenance", default="", metavar="TEXT",
                     help="text of the '# source:' first line: who measured, where, how")
    exp.add_argument("--precision", default="", metavar="DTYPE",
                     help="the precision cell of every row, e.g. bf16 (datasets do not "
                          "record it)")
    exp.add_argument("--force", action="store_true",
                     help="replace the file already at --out (refused without it)")
    exp.set_defaults(func=_export)


def _show(args: argparse.Namespace) -> int:
    texts = [_show_one(Path(path)) for path in args.paths]
    print("\n\n".join(texts))
    return 0


def _show_one(path: Path) -> str:
    """The summary of one dataset; of a campaign directory whose profiling has not finished,
    how far it got and how to finish it (its dataset, if any, is that of an earlier point)."""
    from paratune.datasets._store import CARD_FILE, read_dataset, summarise_dataset
    from paratune.datasets.materialise import campaign_progress
    from paratune.errors import DatasetError

    directory = path if path.is_dir() else path.parent if path.name == CARD_FILE else None
    progress = campaign_progress(directory) if directory is not None else None
    if progress is None:  # a plain dataset (or not a dataset: read_dataset says so)
        return summarise_dataset(read_dataset(path))
    rows = None
    if (directory / CARD_FILE).exists():
        try:
            dataset = read_dataset(path)
        except DatasetError:
            dataset = None  # e.g. rewritten meanwhile; the journals are the truth
        if dataset is not None and progress.finished and len(dataset) >= progress.num_rows:
            return summarise_dataset(dataset)  # a finished campaign
        rows = None if dataset is None else len(dataset)
    resume = f"paratune profile --out {shlex.quote(str(directory))} --resume"
    if progress.finished:
        state = (f"every planned config is journaled ({progress.num_rows}), but its dataset "
                 + ("is not written yet" if rows is None else f"holds only {rows} rows"))
        return (f"campaign  {progress.campaign_id} in {directory}: {state}\n"
                f"write it with: {resume}")
    table = format_table(
        [{"world_size": ws, "planned": "-" if planned is None else planned,
          "journaled": progress.journaled[ws],
          "left": "-" if planned is None else planned - progress.journaled[ws]}
         for ws, planned in progress.planned.items()],
        ["world_size", "planned", "journaled", "left"], headers={"world_size": "world"})
    lines = [f"campaign  {progress.campaign_id} in {directory}: unfinished (stopped before "
             f"every planned config was measured, or still being profiled)", "", table, ""]
    if rows is not None:
        lines.append(f"dataset   {rows} rows, written before it stopped (the journals hold "
                     f"{progress.num_rows}); not the campaign's result")
    lines.append(f"finish it with: {resume}")
    return "\n".join(lines)


def _import(args: argparse.Namespace) -> int:
    from paratune.datasets._store import (
        DatasetExistsError,
        holds_data,
        read_dataset,
        summarise_dataset,
    )
    from paratune.datasets.importers import import_files
    from paratune.errors import ConfigError

    # a card.json, or a measurements-*.parquet file (a dataset whose card was removed)
    exists = ConfigError("out", args.out, "already holds a dataset; pass --force to replace "
                                          "it, or choose another directory")
    if not args.force and holds_data(Path(args.out)):  # before reading the files
        raise exists
    try:
        # decided again under the dataset's write lock: another import may write meanwhile
        report = import_files(args.files, args.out, replace=args.force)
    except DatasetExistsError:
        raise exists from None
    print(report)
    print()
    print(summarise_dataset(read_dataset(args.out)))
    return 0


def _export(args: argparse.Namespace) -> int:
    from paratune.datasets._export import export_public_csv

    counts = export_public_csv(args.paths, args.out, provenance=args.provenance,
                               source=args.source, precision=args.precision,
                               replace=args.force)
    summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"wrote {sum(counts.values())} rows ({summary}) to {args.out}")
    return 0
