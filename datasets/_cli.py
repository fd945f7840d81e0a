"""The ``paratune datasets`` command group: ``show`` and ``import``."""

from __future__ import annotations

import argparse

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


def _show(args: argparse.Namespace) -> int:
    from paratune.datasets._store import read_dataset, summarise_dataset

    texts = [summarise_dataset(read_dataset(path)) for path in args.paths]
    print("\n\n".join(texts))
    return 0


def _import(args: argparse.Namespace) -> int:
    from pathlib import Path

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
