"""The ``paratune`` command: one entry point, one subcommand per job.

Each package contributes its subcommands through a light ``register(subparsers)`` function
(argparse only: heavy imports happen inside the handlers), so ``paratune --help`` is fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from paratune import __version__
from paratune.errors import ConfigError, ParatuneError, Terminated

__all__ = ["StoreWithAliases", "Terminated", "at_least", "build_parser", "flag_message", "main",
           "sigterm_as_exit"]

# Modules whose ``register(subparsers)`` adds subcommands, in the order --help lists them.
_COMMAND_MODULES = (
    "paratune._quickstart",
    "paratune.profiler._cli",
    "paratune.datasets._cli",
    "paratune.models._cli",
    "paratune.tuner._cli",
    "paratune.profiler._gns_cli",
)


_RST_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)\s*(?:<[^`>]*>)?`")
_RST_LITERAL = re.compile(r"``(.+?)``")
_RST_DEFAULT_ROLE = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")


def plain_text(text: str | None) -> str | None:
    """``text`` without reStructuredText markup, as a terminal shows it.

    ``:class:`~paratune.ModelSpec``` becomes ``ModelSpec``, a role with an explicit title
    (``:func:`title <target>```) its title, and literals and default-role text lose their
    backquotes.
    """
    if not text:
        return text

    def role(match: re.Match[str]) -> str:
        inner = match.group(1)
        whole = match.group(0)
        if "~" in whole.split("`", 1)[1][:1]:  # :role:`~a.b.c` shows the last part
            inner = inner.rsplit(".", 1)[-1]
        return inner

    text = _RST_ROLE.sub(role, text)
    text = _RST_LITERAL.sub(r"\1", text)
    return _RST_DEFAULT_ROLE.sub(r"\1", text)


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Strip reStructuredText markup from the help texts of ``parser`` and its subcommands."""
    parser.description = plain_text(parser.description)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain_text(choice.help)
            for sub in dict.fromkeys(action.choices.values()):
                _plain_help(sub)


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
    _plain_help(parser)
    return parser


def at_least(minimum: float, cast: Callable[[str], float] = int) -> Callable[[str], float]:
    """An argparse ``type``: a number (an integer with ``cast=int``) no smaller than
    ``minimum``, so that ``--top-k 0`` is refused as ``argument --top-k: must be an integer
    >= 1, not '0'`` before any work starts."""
    kind = "an integer" if cast is int else "a finite number"

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not minimum <= value < float("inf"):  # NaN is refused too
            raise argparse.ArgumentTypeError(f"must be {kind} >= {minimum:g}, not {text!r}")
        return value

    return parse


class StoreWithAliases(argparse.Action):
    """``store`` for an option with several spellings, such as ``--gpu`` and ``--hardware``
    (``add_argument("--gpu", "--hardware", dest="hardware", action=StoreWithAliases)``): it
    records the spelling the user typed in ``args.typed_flags[dest]``, so that
    :func:`flag_message` names that one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        typed = dict(getattr(namespace, "typed_flags", None) or {})
        typed[self.dest] = option_string or self.option_strings[0]
        namespace.typed_flags = typed


def flag_message(exc: ConfigError, args: argparse.Namespace) -> str:
    """The message of ``exc`` naming the flag the user typed where the library checked its
    value under another name: ``max_segments=0: ...`` becomes ``--segments=0: ...``.

    A subcommand lists those names with ``set_defaults(field_flags={field: flag})``. The
    field is renamed only when that flag holds a value (given, or by default) or the error
    is about a missing value: a value the command read elsewhere (a file, a stored campaign)
    keeps the library's name. Of a flag with aliases (:class:`StoreWithAliases`), the
    spelling the user typed is named.
    """
    flag = getattr(args, "field_flags", {}).get(exc.field)
    if flag is None:
        return str(exc)
    dest = flag.lstrip("-").replace("-", "_")
    flag = (getattr(args, "typed_flags", None) or {}).get(dest, flag)
    if exc.value is None:
        return f"{flag}: {exc.rule}"
    if getattr(args, dest, None) is None:
        return str(exc)
    return f"{flag}={exc.value!r}: {exc.rule}"


def _is_utf8(path: Path) -> bool:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except (UnicodeDecodeError, OSError):
        return False
    return True


def _not_utf8(exc: UnicodeDecodeError, argv: Sequence[str]) -> str:
    """The message for a file that could not be decoded: the file named on the command line
    that is not UTF-8 text, when there is one."""
    for arg in argv:
        candidate = Path(arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg)
        try:
            if candidate.is_file() and not _is_utf8(candidate):
                return f"{candidate} is not UTF-8 text"
        except OSError:
            continue
    return f"an input file is not UTF-8 text ({exc.reason} at byte {exc.start})"


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(128 + signum)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while the block runs (main thread only, and only
    where SIGTERM has its default action). A handler a command installs inside the block (as
    ``paratune gns`` does while its workers run) takes precedence until it restores this one.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    with sigterm_as_exit():
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    try:
        result = args.func(args)
    except FileNotFoundError as exc:
        message = f"{exc.filename}: no such file" if exc.filename else str(exc)
        print(f"paratune {args.command}: error: {message}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"paratune {args.command}: error: {_not_utf8(exc, argv)}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"paratune {args.command}: error: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    except (ParatuneError, ValueError) as exc:
        print(f"paratune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"paratune {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:
        print(f"paratune {args.command}: terminated", file=sys.stderr)
        return int(exc.code)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
