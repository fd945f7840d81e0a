"""The ``paratune`` command: one entry point, one subcommand per job.

Each package contributes its subcommands through a light ``register(subparsers)`` function
(argparse only: heavy imports happen inside the handlers), so ``paratune --help`` is fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

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


_VALUE_ERROR = re.compile(r"^argument (?P<flag>[^:]+): (?P<rule>(?:must |invalid ).*)$", re.S)
_INVALID_TYPE = re.compile(r"^invalid (?P<type>\w+) value: (?P<value>.*)$", re.S)
_TYPE_NAMES = {"int": "an integer", "float": "a number"}


class _Parser(argparse.ArgumentParser):
    """An argument parser that refuses a bad value of an option in one line, as a
    :class:`~paratune.errors.ConfigError` from a command is refused (``paratune tune: error:
    argument --top-k: must be an integer >= 1, not '0'``), keeping the usage block for errors
    of the command line's shape (a missing or unknown option). A ``type`` function says what
    a value must be with ``ArgumentTypeError("must be ...")``."""

    def error(self, message: str) -> NoReturn:
        match = _VALUE_ERROR.match(message)
        if match is None or not match.group("flag").startswith("-"):
            # a misspelt command, a missing or unknown option: the usage shows the shape
            super().error(message)
        rule = match.group("rule")
        invalid = _INVALID_TYPE.match(rule)
        if invalid is not None and invalid.group("type") in _TYPE_NAMES:
            rule = f"must be {_TYPE_NAMES[invalid.group('type')]}, not {invalid.group('value')}"
        self.exit(2, f"{self.prog}: error: argument {match.group('flag')}: {rule}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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


def world_sizes(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated positive process counts such as ``1,2,4``."""
    rule = f"must be comma-separated positive integers such as 1,2,4, not {text!r}"
    parts = text.split(",")
    if any(not part.strip() for part in parts):
        raise argparse.ArgumentTypeError(f"{rule} (it has an empty entry)")
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(rule)
    return sizes


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


class _CliFormatter(logging.Formatter):
    """Log records as a command's output: paratune's INFO messages as plain lines, a warning
    or an error prefixed with its level (``warning: ...``), other libraries' records with
    their logger's name; with ``verbose`` every record keeps its level and logger name
    (``DEBUG paratune.tuner._verify: ...``)."""

    def __init__(self, *, verbose: bool = False) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        from paratune.redact import redact

        text = redact(super().format(record))  # a store's URL may carry its password
        if self.verbose:
            return text
        if record.name != "paratune" and not record.name.startswith("paratune."):
            text = f"{record.name}: {text}"
        if record.levelno > logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        return text


def _configure_logging(*, verbose: bool) -> None:
    """Log to stderr through :class:`_CliFormatter` (once per process: a second call, as in
    tests that run several commands, only sets the level)."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in root.handlers:
        if isinstance(handler.formatter, _CliFormatter):
            handler.setFormatter(_CliFormatter(verbose=verbose))
            return
    if root.handlers:  # an embedding program configured logging: leave its handlers alone
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_CliFormatter(verbose=verbose))
    root.addHandler(handler)


def _command_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """``{dest: flag}`` of the options of the command that runs (``--out`` for ``out``; of an
    option with aliases, the spelling typed)."""
    flags: dict[str, str] = {}
    pending = [parser]
    while pending:
        current = pending.pop()
        if current._defaults.get("func") is getattr(args, "func", None):
            for action in current._actions:
                if action.option_strings:
                    long = [o for o in action.option_strings if o.startswith("--")]
                    flags.setdefault(action.dest, (long or action.option_strings)[0])
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(dict.fromkeys(action.choices.values()))
    flags.update(getattr(args, "typed_flags", None) or {})
    return flags


def _path_message(exc: OSError, args: argparse.Namespace, flags: dict[str, str]) -> str:
    """One line for an error about a path: the path, what is wrong with it, and the option
    that named it where one did (``--out run.csv: is a file, not a directory``)."""
    import errno
    import os

    path = os.fsdecode(exc.filename)
    flag, given = _flag_of(path, args, flags)
    if isinstance(exc, IsADirectoryError):
        reason = "is a directory, not a file"
    elif isinstance(exc, NotADirectoryError) or exc.errno == errno.EEXIST:
        # a file where a directory belongs: name the part of the path that is a file
        blocking = next((p for p in (Path(path), *Path(path).parents)
                         if p.exists() and not p.is_dir()), None)
        if blocking is None:
            reason = ("is not a directory" if isinstance(exc, NotADirectoryError)
                      else "already exists")
        elif _same(blocking, given if given is not None else path):
            reason = "is a file, not a directory"
        else:
            reason = f"{blocking} is a file, not a directory"
    elif isinstance(exc, PermissionError):
        reason = "permission denied"
    else:
        reason = (exc.strerror or str(exc)).lower()
    if (given is not None and not _same(given, path)
            and not isinstance(exc, NotADirectoryError) and exc.errno != errno.EEXIST):
        reason = (f"{path} {reason}" if isinstance(exc, IsADirectoryError)
                  else f"{path}: {reason}")  # a file inside (or above) the path given
    shown = given if given is not None else path
    return f"{flag} {shown}: {reason}" if flag else f"{shown}: {reason}"


def _same(a: str | Path, b: str | Path) -> bool:
    import os

    return os.path.abspath(a) == os.path.abspath(b)


def _flag_of(path: str, args: argparse.Namespace, flags: dict[str, str]
             ) -> tuple[str | None, str | None]:
    """The option (``None`` for a positional argument) and the value given for it that is
    ``path``, a directory above it or a path below it, or ``(None, None)``."""
    import os

    target = os.path.abspath(path)
    best: tuple[int, str | None, str | None] = (-1, None, None)
    below: tuple[str | None, str | None] = (None, None)  # --out a/b.csv where a is a file
    for dest, value in vars(args).items():
        if dest == "command":
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if not isinstance(item, (str, Path)) or not str(item):
                continue
            given = os.path.abspath(item)
            inside = target == given or target.startswith(given.rstrip(os.sep) + os.sep)
            if inside and len(given) > best[0]:  # the deepest: --out DIR and --plot DIR/x.png
                best = (len(given), flags.get(dest), str(item))
            elif given.startswith(target.rstrip(os.sep) + os.sep) and below[1] is None:
                below = (flags.get(dest), str(item))
    return (best[1], best[2]) if best[2] is not None else below


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    _configure_logging(verbose=args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    with sigterm_as_exit():
        try:
            code = _run(args, argv, flags=_command_flags(parser, args))
            sys.stdout.flush()  # here, not at exit, where a closed pipe prints a traceback
            return code
        except BrokenPipeError:
            # the output's reader left (`| head`): the rest of it is not wanted
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # as a shell reports a command ended by SIGPIPE


def _error(args: argparse.Namespace, message: str) -> None:
    """Print ``paratune COMMAND: error: message`` on stderr, passwords in URLs masked (a
    message may quote a store's URL)."""
    from paratune.redact import redact

    print(redact(f"paratune {args.command}: error: {message}"), file=sys.stderr)


def _run(args: argparse.Namespace, argv: Sequence[str],
         flags: dict[str, str] | None = None) -> int:
    try:
        result = args.func(args)
    except FileNotFoundError as exc:
        _error(args, f"{exc.filename}: no such file" if exc.filename else str(exc))
        return 2
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a write or flush names no file
            where = f" ({exc.filename})" if exc.filename else ""
            again = (" (what was measured is kept: run it again with --resume)"
                     if args.command in ("profile", "gns") else "")
            _error(args, f"{os.strerror(exc.errno).lower()}{where}: free some space and run "
                         f"it again{again}")
            return 1
        if not exc.filename:  # not about a path the user gave: a bug or the system's, shown whole
            raise
        _error(args, _path_message(exc, args, flags or {}))
        return 2
    except UnicodeDecodeError as exc:
        # paratune's own (a DatasetError too) already names the file and line
        _error(args, str(exc) if isinstance(exc, ParatuneError) else _not_utf8(exc, argv))
        return 2
    except ConfigError as exc:
        _error(args, flag_message(exc, args))
        return 2
    except (ParatuneError, ValueError) as exc:
        _error(args, str(exc))
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
