"""The space of parallel configurations, as data.

One :class:`ConfigSpace` describes which global batch sizes, micro-batch sizes, schedules,
sharding and recomputation modes to consider. The profiler enumerates it for a campaign grid;
the tuner samples or enumerates it for a search. Degrees (dp, tp, pp) are every factorisation
of the world size, optionally restricted.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding
from paratune.spec import ModelSpec

__all__ = ["ConfigSpace", "SpaceEnumeration", "divisors", "factorisations"]

DEFAULT_GLOBAL_BATCH_SIZES = (8,)
"""The global batch sizes of a space that does not give its own."""


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (found in O(sqrt n))."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def factorisations(world_size: int) -> Iterator[tuple[int, int, int]]:
    """Every ``(dp, tp, pp)`` with ``dp * tp * pp == world_size``."""
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            yield world_size // (tp * pp), tp, pp


@dataclass
class SpaceEnumeration:
    """Result of enumerating a space for one model and world size."""

    valid: list[ParallelConfig]
    """Configurations that pass every rule, in a stable order."""
    skipped: list[tuple[ParallelConfig, str]]
    """Configurations that break a rule, with the rule in words."""

    def __len__(self) -> int:
        return len(self.valid)


def _as_tuple(value: Any, cast: Any, name: str) -> tuple:
    if isinstance(value, (str, int)) or not isinstance(value, Sequence):
        value = [value]
    if len(value) == 0:
        raise ConfigError(name, list(value), "must list at least one value")
    if cast is int:
        # an integer option takes integers (and integral numbers such as 8.0 from YAML), not
        # bools or fractions that int() would quietly truncate
        bad = [v for v in value if isinstance(v, bool) or type(v).__name__ == "bool_"
               or not isinstance(v, numbers.Real | str)
               or (isinstance(v, numbers.Real) and not float(v).is_integer())]
        if bad:
            raise ConfigError(name, bad[0], "must be an integer")
    try:
        return tuple(cast(v) for v in value)
    except (TypeError, ValueError):
        if isinstance(cast, type) and issubclass(cast, Enum):
            allowed = ", ".join(m.value for m in cast)
            raise ConfigError(name, list(value), f"values must be among {allowed}") from None
        raise ConfigError(name, list(value), "values must be integers") from None


def _one_line(exc: Exception) -> str:
    """A parser's error on one line: YAML's names the problem and its line and column under
    a copy of the offending text (a caret diagram over several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


@dataclass(frozen=True, kw_only=True)
class ConfigSpace:
    """Which configurations to consider; every field is a list of allowed values."""

    global_batch_sizes: tuple[int, ...] | None = None
    """Global batch sizes, in sequences (stored sorted, without repeats). Left out (or
    ``None``): :data:`DEFAULT_GLOBAL_BATCH_SIZES`, with :attr:`global_batch_sizes_given`
    false, so that a tuner search picks batches sized for the job instead."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Micro-batch sizes, in sequences per data-parallel rank (stored sorted, without
    repeats)."""
    schedules: tuple[Schedule, ...] = (Schedule.GPIPE, Schedule.ONE_F_ONE_B,
                                       Schedule.INTERLEAVED_1F1B)
    """Pipeline schedules (only varied when pp > 1)."""
    virtual_stages: tuple[int, ...] = (2,)
    """Virtual stages per rank tried with ``interleaved_1f1b`` (stored sorted)."""
    shardings: tuple[Sharding, ...] = (Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2,
                                       Sharding.ZERO3)
    """Data-parallel sharding levels (only varied when dp > 1)."""
    recomputes: tuple[Recompute, ...] = (Recompute.NONE, Recompute.FULL)
    """Activation checkpointing modes."""
    tp_degrees: tuple[int, ...] | None = None
    """Allowed tensor-parallel degrees (stored sorted); ``None`` allows every divisor of the
    world size."""
    pp_degrees: tuple[int, ...] | None = None
    """Allowed pipeline degrees (stored sorted); ``None`` allows every divisor of the world
    size."""
    tp_within_node: bool = True
    """Keep every tensor-parallel group inside one node (tp divides the devices per node,
    where the job spans more than one)."""
    global_batch_sizes_given: bool = field(default=True, init=False, compare=False, repr=False)
    """Whether ``global_batch_sizes`` was given (as an argument, or as a key of a space file
    or mapping) rather than left to its default; set by the constructor."""

    def __post_init__(self) -> None:
        if (isinstance(self.tp_within_node, bool)
                or getattr(getattr(self.tp_within_node, "dtype", None), "kind", "") == "b"):
            object.__setattr__(self, "tp_within_node", bool(self.tp_within_node))
        else:  # not truthiness: the string "false" from a space file would read as true
            raise ConfigError("tp_within_node", self.tp_within_node, "must be true or false")
        if self.global_batch_sizes is None:
            object.__setattr__(self, "global_batch_sizes", DEFAULT_GLOBAL_BATCH_SIZES)
            object.__setattr__(self, "global_batch_sizes_given", False)
        conv = {
            "global_batch_sizes": int, "micro_batch_sizes": int, "schedules": Schedule,
            "virtual_stages": int, "shardings": Sharding, "recomputes": Recompute,
        }
        for name, cast in conv.items():
            object.__setattr__(self, name, _as_tuple(getattr(self, name), cast, name))
        for name in ("tp_degrees", "pp_degrees"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _as_tuple(getattr(self, name), int, name))
        for name in ("global_batch_sizes", "micro_batch_sizes", "virtual_stages",
                     "tp_degrees", "pp_degrees"):
            bad = [v for v in getattr(self, name) or () if v < 1]
            if bad:
                raise ConfigError(name, bad[0], "must be a positive integer")
        # Integer options are ordinal: the tuner samples them by index and moves between
        # neighbours, so every consumer sees them sorted and without repeats.
        for name in ("global_batch_sizes", "micro_batch_sizes", "virtual_stages",
                     "tp_degrees", "pp_degrees"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))
        bad_v = [v for v in self.virtual_stages if v < 2]
        if bad_v:
            raise ConfigError("virtual_stages", bad_v[0],
                              "must be >= 2 (they apply to interleaved_1f1b only)")

    # ------------------------------------------------------------------ enumeration
    def degrees(self, world_size: int, *, devices_per_node: int | None = None
                ) -> Iterator[tuple[tuple[int, int, int], str | None]]:
        """``((dp, tp, pp), reason)`` for every factorisation; reason is None if allowed."""
        for dp, tp, pp in factorisations(world_size):
            reason = None
            if self.tp_degrees is not None and tp not in self.tp_degrees:
                reason = f"tp={tp} is not in tp_degrees={list(self.tp_degrees)}"
            elif self.pp_degrees is not None and pp not in self.pp_degrees:
                reason = f"pp={pp} is not in pp_degrees={list(self.pp_degrees)}"
            elif (self.tp_within_node and devices_per_node and world_size > devices_per_node
                  and devices_per_node % tp):
                # not just tp <= node size: tp=6 on 8-device nodes puts a group across two
                # (a job in one node keeps every group there: tp=3 of 6 devices)
                reason = (f"tp={tp} must divide devices_per_node={devices_per_node} "
                          f"(tp_within_node: every tensor-parallel group inside one node)")
            yield (dp, tp, pp), reason

    def candidates(self, dp: int, tp: int, pp: int, global_batch_size: int
                   ) -> Iterator[ParallelConfig]:
        """Every combination of the options for fixed degrees and batch (not validated)."""
        schedules: list[tuple[Schedule, int]] = [(Schedule.ONE_F_ONE_B, 1)]
        if pp > 1:
            schedules = []
            for schedule in self.schedules:
                if schedule is Schedule.INTERLEAVED_1F1B:
                    schedules.extend((schedule, v) for v in self.virtual_stages)
                else:
                    schedules.append((schedule, 1))
        shardings = self.shardings if dp > 1 else (Sharding.NONE,)
        for mbs, (schedule, v), sharding, recompute in itertools.product(
                self.micro_batch_sizes, schedules, shardings, self.recomputes):
            yield ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs,
                                 global_batch_size=global_batch_size, schedule=schedule,
                                 virtual_stages=v, sharding=sharding, recompute=recompute)

    def enumerate(self, model: ModelSpec, world_size: int, *,
                  devices_per_node: int | None = None) -> SpaceEnumeration:
        """Every configuration of this space for ``model`` on ``world_size`` devices.

        Args:
            model: The model (its shape decides which degrees are possible).
            world_size: Devices in the job.
            devices_per_node: Node size, for ``tp_within_node``.

        Returns:
            The valid configurations and the skipped ones with the rule each breaks.
        """
        valid: list[ParallelConfig] = []
        skipped: list[tuple[ParallelConfig, str]] = []
        seen: set[ParallelConfig] = set()
        for gbs in self.global_batch_sizes:
            for (dp, tp, pp), reason in self.degrees(world_size,
                                                     devices_per_node=devices_per_node):
                for cfg in self.candidates(dp, tp, pp, gbs):
                    if cfg in seen:
                        continue
                    seen.add(cfg)
                    if reason is None:
                        try:
                            cfg.validate(model, world_size)
                        except ConfigError as exc:
                            skipped.append((cfg, str(exc)))
                            continue
                        valid.append(cfg)
                    else:
                        skipped.append((cfg, reason))
        return SpaceEnumeration(valid=valid, skipped=skipped)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if not f.init:  # derived, not an option
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [v.value if hasattr(v, "value") else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConfigSpace:
        """A space from a mapping of field -> values; a field left out takes its default
        (``global_batch_sizes`` left out is recorded in :attr:`global_batch_sizes_given`)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]],
                              f"is not a space field (fields: {', '.join(sorted(names))})")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> ConfigSpace:
        """Read a space from YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError("grid", str(path), "no such file") from None
        suffix = path.suffix.lower()
        empty = ConfigError("grid", str(path), "states no field (leave the flag out for "
                                               "the default space)")
        if not text.strip():
            # most likely a file not yet written: the whole default space would be measured
            # without a word
            raise empty
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # any parser error means a bad file
            raise ConfigError("grid", str(path),
                              f"could not be parsed ({_one_line(exc)})") from None
        if data is None or (suffix == ".toml" and data == {}):  # comments only
            raise empty
        if not isinstance(data, dict):
            raise ConfigError("grid", str(path), "must hold a mapping of field -> values")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ConfigSpace:
        """A copy with ``changes``; a default ``global_batch_sizes`` stays a default unless
        changed."""
        if not self.global_batch_sizes_given:
            changes.setdefault("global_batch_sizes", None)
        return dataclasses.replace(self, **changes)
