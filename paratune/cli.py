"""The ``paratune`` command: one entry point, one subcommand per job.

Each package contributes its subcommands through a light ``register(subparsers)`` function
(argparse only: heavy imports happen inside the handlers), so ``paratune --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from paratune import __version__
from paratune.errors import ParatuneError

__all__ = ["build_parser", "main"]

# Modules whose ``register(subparsers)`` adds subcommands, in the order --help lists them.
_COMMAND_MODULES = (
    "paratune._quickstart",
    "paratune.profiler._cli",
    "paratune.datasets._cli",
    "paratune.models._cli",
    "paratune.tuner._cli",
    "paratune.profiler._gns_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratune",
        description="Measure, learn and tune global batch size and 3D parallelism for LLM "
                    "training.")
    parser.add_argument("--version", action="version", version=f"paratune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except (ParatuneError, ValueError, FileNotFoundError) as exc:
        print(f"paratune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"paratune {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
