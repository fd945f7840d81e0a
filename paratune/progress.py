"""Progress of long jobs: a live tqdm bar on a terminal, plain lines in a log.

On a terminal a bar redraws itself in place with carriage returns many times a second. Written
to a file (a batch job's stderr, a CI log) the same output is one enormous line, so a stream
that is not a terminal gets :class:`LineProgress` instead: a newline-terminated line at the
start, at most every ``interval_s`` seconds while the work goes on, and at the end, e.g.

    profiling ws=8: 12/40 [30%, 2m05s elapsed, ~4m50s left, 10.4 s/config] ok=11, failed=1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["LineProgress", "ProgressOutput", "progress_bar"]


@dataclass(frozen=True)
class ProgressOutput:
    """Where a :func:`progress_bar` writes, and how often when that is not a terminal."""

    stream: IO[str] | None = None
    """Where to write; ``None``: ``sys.stderr`` at the time of the call."""
    interval_s: float = 30.0
    """Least seconds between two lines when ``stream`` is not a terminal (``0``: a line at
    every update)."""
    clock: Callable[[], float] | None = None
    """Seconds of a monotonic clock (``None``: :func:`time.monotonic`)."""

    def __post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ValueError(f"interval_s={self.interval_s!r}: must be a number >= 0")


def progress_bar(*, total: int | None, desc: str, unit: str, initial: int = 0, postfix: str = "",
                 enabled: bool | None = None, output: ProgressOutput | None = None) -> Any:
    """A progress bar of ``total`` units of work, suited to where it is written.

    Args:
        total: Units of work in all (``None``: unknown).
        desc: What is being done, shown first (``set_description`` changes it).
        unit: The name of one unit (``config``, ``trial``).
        initial: Units already done (a resumed job).
        postfix: Text shown after the counts from the first line on (``set_postfix_str``
            changes it).
        enabled: ``True``: show progress (the bar on a terminal, lines elsewhere);
            ``False``: show nothing; ``None``: the bar on a terminal, nothing elsewhere.
        output: Where to write and how often (defaults: ``sys.stderr``, a line at most
            every 30 s off a terminal).

    Returns:
        A ``tqdm`` bar when ``stream`` is a terminal (or in a Jupyter kernel, where
        ``tqdm.auto`` draws a widget); otherwise a :class:`LineProgress`, silent unless
        ``enabled``. Both offer ``update``, ``set_description``, ``set_postfix``,
        ``set_postfix_str``, ``refresh``, ``write``, ``close``, ``n``, ``total`` and use as a
        context manager.

    """
    output = output if output is not None else ProgressOutput()
    stream = output.stream
    if enabled is False:
        return LineProgress(total=total, desc=desc, unit=unit, initial=initial, stream=None,
                            postfix=postfix)
    from tqdm.asyncio import tqdm as plain_tqdm
    from tqdm.auto import tqdm

    out = stream if stream is not None else sys.stderr
    # tqdm.auto is the plain bar except in a Jupyter kernel, where it draws a widget
    if (stream is None and tqdm is not plain_tqdm) or _is_terminal(out):
        return tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True,
                    postfix=postfix or None, file=stream, disable=False)
    return LineProgress(total=total, desc=desc, unit=unit, initial=initial, postfix=postfix,
                        stream=out if enabled else None, interval_s=output.interval_s,
                        clock=output.clock)


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


class LineProgress:
    """The part of the ``tqdm`` interface paratune uses, written as plain lines (no ``\\r``,
    no terminal control codes) to ``stream``: one when created, then at most one every
    ``interval_s`` seconds on ``update`` or ``refresh``, one when the description changes
    after some progress (a new phase of the work), and a last one, with the count reached,
    on ``close``. With ``stream=None`` it counts and writes nothing.
    """

    def __init__(self, *, total: int | None, desc: str, unit: str, initial: int = 0,
                 postfix: str = "", stream: IO[str] | None, interval_s: float = 30.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.total = total
        self.n = initial
        self.desc = desc
        self.unit = unit
        self.postfix = postfix
        self.disable = stream is None
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock or time.monotonic
        self._initial = initial
        self._start = self._clock()
        self._last_time = self._start
        self._last_shown: tuple[int, str, str] | None = None
        self._closed = False
        self._emit()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units; writes a line if ``interval_s`` has passed since the last."""
        self.n += n
        self._maybe_emit()

    def refresh(self) -> None:
        """Write a line if ``interval_s`` has passed since the last."""
        self._maybe_emit()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Change the description; a line says so at once if work was done since the last
        line (a phase of the job ended)."""
        changed = (desc or "") != self.desc
        self.desc = desc or ""
        if changed and refresh and self._last_shown is not None \
                and self._last_shown[0] != self.n:
            self._emit()

    set_description_str = set_description

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Text shown after the counts (from the next line on)."""
        self.postfix = str(s)

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        """``key=value`` pairs shown after the counts (from the next line on)."""
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={_format_value(value)}" for key, value in items.items())

    def write(self, s: str, file: IO[str] | None = None, end: str = "\n") -> None:
        """Write a message of one's own (to ``file``, default the progress stream or stderr)."""
        target = file or self._stream or sys.stderr
        target.write(s + end)
        target.flush()

    def close(self) -> None:
        """Write the last line (unless the previous one already showed the same)."""
        if self._closed:
            return
        self._closed = True
        if self._last_shown != (self.n, self.desc, self.postfix):
            self._emit()

    def line(self) -> str:
        """The line that describes the progress now."""
        elapsed = max(0.0, self._clock() - self._start)
        done = self.n - self._initial
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        counts = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        parts = []
        if self.total:
            parts.append(f"{int(100 * self.n / self.total)}%")
        parts.append(f"{_duration(elapsed)} elapsed")
        if rate is not None and self.total is not None and self.n < self.total:
            parts.append(f"~{_duration((self.total - self.n) / rate)} left")
        if rate is not None:
            parts.append(f"{_number(rate)} {self.unit}/s" if rate >= 1
                         else f"{_number(1 / rate)} s/{self.unit}")
        text = f"{counts} [{', '.join(parts)}]"
        if self.desc:
            text = f"{self.desc}: {text}"
        if self.postfix:
            text = f"{text} {self.postfix}"
        return text

    def _maybe_emit(self) -> None:
        if self._clock() - self._last_time >= self._interval_s:
            self._emit()

    def _emit(self) -> None:
        self._last_time = self._clock()
        self._last_shown = (self.n, self.desc, self.postfix)
        if self._stream is None:
            return
        self._stream.write(self.line() + "\n")
        self._stream.flush()


def _duration(seconds: float) -> str:
    """``45s``, ``2m05s``, ``3h02m10s``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).strip()
