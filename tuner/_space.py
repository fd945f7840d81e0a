"""The tuner's search space: a :class:`~paratune.space.ConfigSpace` bound to a job.

The space itself (batch sizes, micro-batches, schedules, sharding, recomputation, allowed
degrees) is data in :class:`ConfigSpace`; this module binds it to one model, world size and
device, enumerates it (for exhaustive search) and turns an Optuna trial into a
:class:`~paratune.ParallelConfig`. Sampling is valid by construction where the rule is known
up front: the degrees offered for a batch size factorise the world size, respect the
model's shape and the node size, and divide the batch; what remains (micro-batch divisibility,
interleaved-schedule rules) is checked by :meth:`ParallelConfig.validate` and the trial is
pruned with the rule it breaks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.parallel import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    ParallelConfig,
    Recompute,
    Schedule,
    Sharding,
    check_magnitude,
)
from paratune.space import ConfigSpace, SpaceEnumeration, divisors
from paratune.spec import ModelSpec

if TYPE_CHECKING:
    import optuna

__all__ = ["MAX_BATCH_SIZES", "SearchSpace", "parse_batch_sizes"]

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*(?::\s*(x?)(\d+)\s*)?$")


def check_gpus(gpus: object) -> int:
    """``gpus`` as an ``int`` when it is a positive integer.

    Raises:
        ConfigError: ``gpus`` is not a positive integer (``0``, ``-8``, ``2.5``, ``True``).
    """
    if (isinstance(gpus, bool) or type(gpus).__name__ == "bool_"
            or not isinstance(gpus, numbers.Real | str)):
        raise ConfigError("gpus", gpus, "must be a positive integer")
    try:
        number = float(gpus)
    except ValueError:
        raise ConfigError("gpus", gpus, "must be a positive integer") from None
    if not number.is_integer() or number < 1:
        raise ConfigError("gpus", gpus, "must be a positive integer")
    return check_magnitude("gpus", int(number), MAX_DEVICES)


MAX_BATCH_SIZES = 64
"""The most global batch sizes one search takes."""


def parse_batch_sizes(text: str | int | Sequence[int]) -> tuple[int, ...]:
    """Global batch sizes from a list or a range expression.

    Accepted forms: ``512``; ``"256,512,1024"``; ``"256:2048"`` (the powers of two from the
    smallest one >= 256 up to 2048: ``"100:1000"`` is 128, 256, 512); ``"256:2048:x2"``
    (geometric from ``lo``, factor 2: ``"96:1024:x2"`` is 96, 192, 384, 768);
    ``"256:1024:256"`` (arithmetic step from ``lo``). At most :data:`MAX_BATCH_SIZES` sizes.

    Raises:
        ConfigError: ``global_batch_sizes`` is malformed, empty or longer than
            :data:`MAX_BATCH_SIZES`.
    """
    if isinstance(text, str):
        match = _RANGE.match(text)
        if match:
            values = _batch_range(text, match)
        else:
            try:
                values = [int(v) for v in text.replace(" ", "").split(",") if v]
            except ValueError:
                raise ConfigError("global_batch_sizes", text,
                                  "must be integers: '512', '256,512' or a range "
                                  "'256:2048[:x2|:step]'") from None
    else:
        items = [text] if isinstance(text, numbers.Real) else list(text)
        bad = [v for v in items if isinstance(v, bool) or type(v).__name__ == "bool_"
               or not isinstance(v, numbers.Real) or not float(v).is_integer()]
        if bad:
            raise ConfigError("global_batch_sizes", bad[0],
                              "batch sizes must be integers (sequences per step)")
        values = [int(v) for v in items]
    if not values:
        raise ConfigError("global_batch_sizes", text, "must list at least one batch size")
    if any(v < 1 for v in values):
        raise ConfigError("global_batch_sizes", text, "batch sizes must be positive")
    values = sorted(set(values))
    if len(values) > MAX_BATCH_SIZES:
        raise ConfigError("global_batch_sizes", text, _too_many(len(values)))
    if values[-1] > MAX_GLOBAL_BATCH:
        raise ConfigError("global_batch_sizes", text, f"batch size {values[-1]} is beyond the "
                          f"plausible range (at most {MAX_GLOBAL_BATCH} sequences)")
    return tuple(values)


def _too_many(count: int) -> str:
    return (f"gives {count} batch sizes; at most {MAX_BATCH_SIZES} are searched (narrow the "
            "range or take a larger step)")


def _batch_range(text: str, match: re.Match[str]) -> list[int]:
    """The sizes of a range ``lo:hi``, ``lo:hi:xF`` or ``lo:hi:STEP`` (see
    :func:`parse_batch_sizes`), counted before they are built."""
    lo, hi = int(match.group(1)), int(match.group(2))
    factor = match.group(3) == "x"
    step = int(match.group(4)) if match.group(4) is not None else None
    if lo < 1 or hi < lo or (step is not None and step < (2 if factor else 1)):
        raise ConfigError("global_batch_sizes", text,
                          "a range lo:hi[:step|:xfactor] needs 1 <= lo <= hi and "
                          "step >= 1 (factor >= 2)")
    if step is None:  # lo:hi: the powers of two in [lo, hi]
        first = 1 << (lo - 1).bit_length()
        if first > hi:
            raise ConfigError("global_batch_sizes", text,
                              f"a range lo:hi is the powers of two from lo to hi, and there "
                              f"is none between {lo} and {hi} (list the sizes instead)")
        count = hi.bit_length() - first.bit_length() + 1
        if count > MAX_BATCH_SIZES:
            raise ConfigError("global_batch_sizes", text, _too_many(count))
        return [first << i for i in range(count)]
    if not factor:  # lo:hi:STEP: arithmetic
        count = (hi - lo) // step + 1
        if count > MAX_BATCH_SIZES:
            raise ConfigError("global_batch_sizes", text, _too_many(count))
        return [lo + i * step for i in range(count)]
    values, v = [], lo  # lo:hi:xF: geometric from lo (at most log2(hi) terms)
    while v <= hi:
        values.append(v)
        v *= step
    if len(values) > MAX_BATCH_SIZES:
        raise ConfigError("global_batch_sizes", text, _too_many(len(values)))
    return values


_MEMORY_KNOBS = ("micro_batch_size_index", "schedule", "sharding_index", "recompute_index")


def _schedule_label(schedule: Schedule, virtual_stages: int) -> str:
    if schedule is Schedule.INTERLEAVED_1F1B:
        return f"{schedule.value}-v{virtual_stages}"
    return schedule.value


def _parse_schedule_label(label: str) -> tuple[Schedule, int]:
    if label.startswith(Schedule.INTERLEAVED_1F1B.value):
        return Schedule.INTERLEAVED_1F1B, int(label.rsplit("-v", 1)[1])
    return Schedule(label), 1


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A :class:`ConfigSpace` for one model on ``world_size`` devices of one kind."""

    model: ModelSpec
    """The model to train."""
    world_size: int
    """Devices in the job."""
    hardware: HardwareSpec
    """The device kind."""
    space: ConfigSpace = field(default_factory=ConfigSpace)
    """Allowed values of every option."""
    devices_per_node: int = 8
    """Node size (decides ``tp_within_node``)."""
    _layout_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("gpus", self.world_size, "must be a positive integer")
        if (isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int)
                or self.devices_per_node < 1):
            raise ConfigError("devices_per_node", self.devices_per_node,
                              "must be a positive integer")
        if not self.layouts():
            raise self._no_layout_error()
        unreachable = [b for b in self.space.global_batch_sizes
                       if not any(b % (dp * mbs) == 0 for dp, _, _ in self.layouts()
                                  for mbs in self.space.micro_batch_sizes)]
        if unreachable:
            logger.warning("global_batch_sizes %s: no layout of %d devices for %s reaches "
                           "them (dp*micro_batch_size must divide the batch); samples of them "
                           "are pruned", unreachable, self.world_size, self.model.name)

    def _shape_rule(self, dp: int, tp: int, pp: int) -> str | None:
        """The shape rule (tp divides the heads, pp fits the layers) that ``(dp, tp, pp)``
        breaks, or ``None``."""
        # GPipe with one micro-batch per rank has no schedule rule of its own
        probe = ParallelConfig(dp=dp, tp=tp, pp=pp, global_batch_size=dp,
                               schedule=Schedule.GPIPE)
        try:
            probe.validate(self.model, self.world_size)
        except ConfigError as exc:
            return f"{exc.field}={exc.value} {exc.rule}"
        return None

    def _degree_rule(self, name: str, degree: int, pp_or_tp: Sequence[int]) -> str:
        """Why ``name`` (``tp`` or ``pp``) = ``degree`` is in no valid layout when the other
        degree takes the values ``pp_or_tp``."""
        n, node = self.world_size, self.devices_per_node
        if n % degree:
            return f"{name}={degree} does not divide {n} devices"
        if name == "tp" and self.space.tp_within_node and node % degree:
            return (f"tp={degree} does not divide devices_per_node={node} (tp_within_node: "
                    f"every tensor-parallel group inside one node)")
        rules = []
        for other in pp_or_tp:
            tp, pp = (degree, other) if name == "tp" else (other, degree)
            if n % (tp * pp):
                continue
            rule = self._shape_rule(n // (tp * pp), tp, pp)
            if rule is None:
                return (f"{name}={degree} leaves no dp with dp*micro_batch_size "
                        f"(micro_batch_sizes={list(self.space.micro_batch_sizes)}) dividing "
                        f"a global batch size in {list(self.space.global_batch_sizes)}")
            rules.append(rule)
        if not rules:
            other = "pp" if name == "tp" else "tp"
            return (f"{name}={degree}: tp*pp divides {n} devices for no {other} in "
                    f"{other}_degrees={list(pp_or_tp)}")
        # the rule of the layout with the other degree at 1, else the first
        return rules[0]

    def _no_layout_error(self) -> ConfigError:
        """The error for a space without a valid layout, naming the space fields that rule
        every layout out (``tp_degrees``, ``pp_degrees``) where they do, else ``gpus``."""
        n, node = self.world_size, self.devices_per_node
        batches = list(self.space.global_batch_sizes)
        # layouts the rules allow regardless of the degree lists
        free = self.space.replace(tp_degrees=None, pp_degrees=None)
        allowed = [(dp, tp, pp) for (dp, tp, pp), reason in free.degrees(n, devices_per_node=node)
                   if reason is None and self._shape_rule(dp, tp, pp) is None
                   and any(b % (dp * mbs) == 0 for b in batches
                           for mbs in self.space.micro_batch_sizes)]
        tps, pps = self.space.tp_degrees, self.space.pp_degrees
        for name, values, position in (("tp", tps, 1), ("pp", pps, 2)):
            if values is not None and not any(layout[position] in values for layout in allowed):
                others = ((pps or divisors(n)) if name == "tp" else (tps or divisors(n)))
                rules = "; ".join(self._degree_rule(name, v, sorted(others)) for v in values)
                return ConfigError(f"{name}_degrees", list(values),
                                   f"no value gives a valid layout of {n} devices for "
                                   f"{self.model.name}: {rules}")
        if allowed and tps is not None and pps is not None:  # each list allows a layout
            shaped = [(dp, tp, pp) for (dp, tp, pp), reason in self.space.degrees(
                n, devices_per_node=node) if reason is None
                and self._shape_rule(dp, tp, pp) is None]
            if not shaped:
                return ConfigError("tp_degrees", list(tps),
                                   f"with pp_degrees={list(pps)}, no (tp, pp) gives a valid "
                                   f"layout of {n} devices for {self.model.name} (tp*pp must "
                                   f"divide {n} and tp, pp must fit the model's shape)")
            return ConfigError("global_batch_sizes", batches,
                               f"dp*micro_batch_size must divide a batch, and under "
                               f"tp_degrees={list(tps)} and pp_degrees={list(pps)} no dp "
                               f"(dp in {sorted({dp for dp, _, _ in shaped})}) with "
                               f"micro_batch_sizes={list(self.space.micro_batch_sizes)} does")
        node_rule = (f", tp must divide devices_per_node={node} (tp_within_node)"
                     if self.space.tp_within_node else "")
        return ConfigError("gpus", n,
                           f"no (dp, tp, pp) layout of {n} devices is valid for "
                           f"{self.model.name} with global_batch_sizes={batches} (tp must "
                           f"divide the head counts{node_rule}, pp*virtual stages <= layers, "
                           f"dp*micro_batch_size must divide a batch)")

    @classmethod
    def build(cls, model: ModelSpec, world_size: int, hardware: HardwareSpec | str, *,
              space: ConfigSpace | None = None,
              global_batch_sizes: str | int | Sequence[int] | None = None,
              devices_per_node: int | None = None) -> SearchSpace:
        """Bind a space to a job; ``global_batch_sizes`` overrides the space's batch list.

        Args:
            model: The model.
            world_size: Devices in the job.
            hardware: Device kind or its catalogue name.
            space: Options to search; defaults to :class:`ConfigSpace` defaults.
            global_batch_sizes: Batch sizes (list or range text, see
                :func:`parse_batch_sizes`).
            devices_per_node: Node size; defaults to the catalogue's.

        Raises:
            ConfigError: ``world_size`` (``gpus``) or ``devices_per_node`` is not a positive
                integer, or no layout of the devices is valid.
        """
        world_size = check_gpus(world_size)
        hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
        if devices_per_node is None:
            devices_per_node = hw.devices_per_node
        elif (isinstance(devices_per_node, bool) or not isinstance(devices_per_node, numbers.Real)
              or not float(devices_per_node).is_integer() or devices_per_node < 1):
            raise ConfigError("devices_per_node", devices_per_node, "must be a positive integer")
        space = space or ConfigSpace()
        if global_batch_sizes is not None:
            space = space.replace(global_batch_sizes=parse_batch_sizes(global_batch_sizes))
        return cls(model=model, world_size=world_size, hardware=hw, space=space,
                   devices_per_node=int(devices_per_node))

    # ------------------------------------------------------------------ structure
    @property
    def global_batch_sizes(self) -> tuple[int, ...]:
        return self.space.global_batch_sizes

    def layouts(self, global_batch_size: int | None = None) -> list[tuple[int, int, int]]:
        """Degrees ``(dp, tp, pp)`` that can hold a valid config (for one batch, or any)."""
        if global_batch_size in self._layout_cache:
            return self._layout_cache[global_batch_size]
        batches = (self.space.global_batch_sizes if global_batch_size is None
                   else (global_batch_size,))
        out = []
        for (dp, tp, pp), reason in self.space.degrees(self.world_size,
                                                       devices_per_node=self.devices_per_node):
            if reason is not None:
                continue
            # Shape rules only (tp divides the heads, pp fits the layers): GPipe with one
            # micro-batch per rank has no schedule rule of its own.
            probe = ParallelConfig(dp=dp, tp=tp, pp=pp, global_batch_size=dp,
                                   schedule=Schedule.GPIPE)
            if not probe.is_valid(self.model, self.world_size):
                continue
            if any(gbs % (dp * mbs) == 0 for gbs in batches
                   for mbs in self.space.micro_batch_sizes):
                out.append((dp, tp, pp))
        self._layout_cache[global_batch_size] = out
        return out

    def schedule_choices(self) -> list[str]:
        labels = []
        for schedule in self.space.schedules:
            if schedule is Schedule.INTERLEAVED_1F1B:
                labels.extend(_schedule_label(schedule, v) for v in self.space.virtual_stages)
            else:
                labels.append(_schedule_label(schedule, 1))
        return labels

    def enumerate(self) -> SpaceEnumeration:
        """Every valid config (and every skipped one with its rule), via ``ConfigSpace``."""
        return self.space.enumerate(self.model, self.world_size,
                                    devices_per_node=self.devices_per_node)

    # ------------------------------------------------------------------ sampling
    def degree_choices(self) -> tuple[list[int], list[int]]:
        """Tensor and pipeline degrees that appear in some valid layout, sorted."""
        layouts = self.layouts()
        return sorted({tp for _, tp, _ in layouts}), sorted({pp for _, _, pp in layouts})

    def suggest(self, trial: optuna.trial.BaseTrial, *, conditional: bool = True
                ) -> tuple[ParallelConfig | None, str]:
        """Draw a config from ``trial``.

        Batch size, tensor and pipeline degree and micro-batch size are ordinal: each is
        drawn as an index into its sorted list of allowed values (``*_index`` parameters),
        so a sampler that models numbers (TPE, GP) learns that neighbours behave alike. Only
        degrees that occur in a valid layout are offered, and options that do not apply are
        not asked (no schedule when ``pp == 1``, no sharding when ``dp == 1``), so
        conditional samplers (TPE with ``group=True``) model each sub-space separately.

        Returns:
            ``(config, "")`` for a valid config, or ``(None, rule)`` naming the broken rule.
        """
        batches = self.space.global_batch_sizes
        tps, pps = self.degree_choices()
        mbss = list(self.space.micro_batch_sizes)

        def pick(name: str, values: Sequence[Any]) -> Any:
            if len(values) == 1:
                return values[0]
            return values[trial.suggest_int(f"{name}_index", 0, len(values) - 1)]

        gbs = pick("global_batch_size", batches)
        tp = pick("tp", tps)
        pp = pick("pp", pps)
        mbs = pick("micro_batch_size", mbss)
        if self.world_size % (tp * pp):
            return None, (f"tp*pp = {tp}*{pp} = {tp * pp} must divide the world size "
                          f"{self.world_size}")
        dp = self.world_size // (tp * pp)
        if (dp, tp, pp) not in self.layouts():
            reason = dict(((d, t, p), r) for (d, t, p), r in self.space.degrees(
                self.world_size, devices_per_node=self.devices_per_node)).get((dp, tp, pp))
            return None, reason or (f"dp={dp}, tp={tp}, pp={pp} is not a valid layout of "
                                    f"{self.model.name} for any batch size searched")
        schedule, virtual = Schedule.ONE_F_ONE_B, 1
        if pp > 1 or not conditional:
            label = trial.suggest_categorical("schedule", self.schedule_choices())
            if pp > 1:
                schedule, virtual = _parse_schedule_label(label)
        sharding = Sharding.NONE
        shardings = self.shardings()
        if dp > 1 or not conditional:
            chosen = pick("sharding", shardings)
            if dp > 1:
                sharding = chosen
        recompute = pick("recompute", self.recomputes())
        cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, global_batch_size=gbs,
                             schedule=schedule, virtual_stages=virtual, sharding=sharding,
                             recompute=recompute)
        try:
            cfg.validate(self.model, self.world_size)
        except ConfigError as exc:
            return None, str(exc)
        return cfg, ""

    def shardings(self) -> list[Sharding]:
        """Allowed sharding levels, by stage (less memory per rank as the index grows)."""
        return sorted(self.space.shardings, key=lambda s: s.stage)

    def recomputes(self) -> list[Recompute]:
        """Allowed recomputation modes, from least to most recomputation."""
        order = [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
        return sorted(self.space.recomputes, key=order.index)

    def param_choices(self) -> dict[str, list[Any]]:
        """Every value each sampled parameter can take (see :meth:`suggest`)."""
        tps, pps = self.degree_choices()
        out: dict[str, list[Any]] = {}
        for name, values in (("global_batch_size", self.space.global_batch_sizes),
                             ("tp", tps), ("pp", pps),
                             ("micro_batch_size", self.space.micro_batch_sizes)):
            if len(values) > 1:
                out[f"{name}_index"] = list(range(len(values)))
        for name, values in (("sharding", self.shardings()), ("recompute", self.recomputes())):
            if len(values) > 1:
                out[f"{name}_index"] = list(range(len(values)))
        out["schedule"] = self.schedule_choices()
        return out

    def neighbours(self, params: dict[str, Any]) -> list[tuple[ParallelConfig, dict[str, Any]]]:
        """Valid configs one move away from ``params`` (a trial's parameters), nearest first.

        A move changes one parameter, or two of the memory knobs (micro-batch size,
        schedule, sharding, recomputation) together. A change that makes a conditional
        option apply (``pp`` from 1 to 2 asks for a schedule) is tried with each of that
        option's values. Three layout moves keep each rank's work per step and come first:
        doubling (halving) ``tp`` or ``pp`` together with the micro-batch (``dp`` halves
        as the micro-batch doubles, so the micro-batches per step stay), and doubling one of
        ``tp`` and ``pp`` while halving the other (``dp`` stays). Then the others, the
        fewest index steps from ``params`` first: the local search tries the nearby configs
        of several layouts before the far ones of one.

        Returns:
            ``(config, params)`` pairs, the params being exactly those the config asks for.
        """
        import optuna

        choices = self.param_choices()
        conditional = [c for c in ("schedule", "sharding_index") if c in choices]
        moves: list[dict[str, Any]] = [{name: value} for name, current in params.items()
                                       for value in choices.get(name, []) if value != current]
        # Memory knobs also move in pairs: trading a larger micro-batch or an interleaved
        # schedule for recomputation or sharding is one step for the search, not two
        # through an infeasible config.
        knobs = [k for k in _MEMORY_KNOBS if k in params]
        for a, b in itertools.combinations(knobs, 2):
            moves += [{a: x, b: y} for x in choices[a] for y in choices[b]
                      if x != params[a] and y != params[b]]

        def steps(variant: dict[str, Any]) -> int:
            total = sum(1 for name in params if name not in variant)
            for name, value in variant.items():
                if name not in params:
                    total += 1
                elif value != params[name]:
                    numeric = isinstance(value, int) and isinstance(params[name], int)
                    total += abs(value - params[name]) if numeric else 1
            return total

        out: dict[ParallelConfig, tuple[int, dict[str, Any]]] = {}
        keeping = [(True, move) for move in self._work_keeping_moves(params, choices)]
        for keeps_work, move in keeping + [(False, move) for move in moves]:
            variants = [{**params, **move}]
            for cond in conditional:
                if cond not in variants[0]:
                    variants = [{**v, cond: c} for v in variants for c in choices[cond]]
            for variant in variants:
                fixed = optuna.trial.FixedTrial(variant)
                cfg, _ = self.suggest(fixed)
                if cfg is not None and cfg not in out:
                    out[cfg] = (-1 if keeps_work else steps(fixed.params), dict(fixed.params))
        ranked = sorted(out.items(), key=lambda item: item[1][0])  # stable: moves' order
        return [(cfg, p) for cfg, (_, p) in ranked]

    def _work_keeping_moves(self, params: dict[str, Any], choices: dict[str, list[Any]]
                            ) -> list[dict[str, Any]]:
        """Layout moves that keep each rank's work per step (see :meth:`neighbours`);
        ``choices`` as :meth:`param_choices` gives them."""
        tps, pps = self.degree_choices()
        micros = list(self.space.micro_batch_sizes)
        tp = tps[params["tp_index"]] if "tp_index" in params else tps[0]
        pp = pps[params["pp_index"]] if "pp_index" in params else pps[0]
        micro_index = params.get("micro_batch_size_index")
        micro = micros[micro_index] if micro_index is not None else None
        out: list[dict[str, Any]] = []
        for factor in (2, 0.5):
            for name, degrees, degree in (("tp_index", tps, tp), ("pp_index", pps, pp)):
                if micro is None or name not in choices:
                    continue
                if degree * factor in degrees and micro * factor in micros:
                    out.append({name: degrees.index(int(degree * factor)),
                                "micro_batch_size_index": micros.index(int(micro * factor))})
            if ("tp_index" in choices and "pp_index" in choices and tp * factor in tps
                    and pp / factor in pps):
                out.append({"tp_index": tps.index(int(tp * factor)),
                            "pp_index": pps.index(int(pp / factor))})
        return out

    def probes(self, params: dict[str, Any]) -> list[tuple[ParallelConfig, dict[str, Any]]]:
        """Every valid layout with the knobs that need the least memory.

        Per layout (dp, tp, pp): the smallest micro-batch, full recomputation, the most
        sharding (and again with the sharding of ``params``) and, with a pipeline, the
        schedule with the smallest bubble that the layout accepts (interleaved with the most
        virtual stages, then 1F1B, then GPipe), at the global batch of ``params`` or the
        nearest one that gives that schedule enough micro-batches. Such configs run in most
        layouts, so they tell which layouts are worth a local search, which then relaxes the
        knobs one move at a time. A sampler rarely draws a layout whose best config needs
        every knob set just so.

        A probe at the sharding of ``params`` that does not fit is followed by the same
        config one sharding level up (:meth:`more_sharding`, queued by the search), so each
        layout is also seen at the least sharding that fits: the most sharding gathers the
        parameters every micro-batch, and a layout whose best config needs one level less
        looks slow at the most.

        Args:
            params: Trial parameters (as :meth:`suggest` asks them) of the best config so far.

        Returns:
            ``(config, params)`` pairs, at most two per layout.
        """
        import optuna

        choices = self.param_choices()
        tps, pps = self.degree_choices()
        least_memory = {name: choices[name][index] for name, index in (
            ("micro_batch_size_index", 0), ("sharding_index", -1), ("recompute_index", -1))
            if name in choices}
        bases = [{**params, **least_memory}]
        if "sharding_index" in params and params["sharding_index"] != least_memory.get(
                "sharding_index"):
            bases.append({**bases[0], "sharding_index": params["sharding_index"]})
        order = [Schedule.INTERLEAVED_1F1B, Schedule.ONE_F_ONE_B, Schedule.GPIPE]

        def bubble_rank(label: str) -> tuple[int, int]:
            schedule, virtual = _parse_schedule_label(label)
            return order.index(schedule), -virtual

        schedules = sorted(choices["schedule"], key=bubble_rank)
        batch = "global_batch_size_index"
        batches: list[Any] = sorted(choices.get(batch, [None]), key=lambda i: (
            0 if i is None else abs(i - params.get(batch, 0)), i))
        out: dict[ParallelConfig, dict[str, Any]] = {}
        for (_, tp, pp), knobs in itertools.product(self.layouts(), bases):
            layout = {**knobs, "tp_index": tps.index(tp), "pp_index": pps.index(pp)}
            for label, b in itertools.product(schedules, batches):
                fixed = optuna.trial.FixedTrial({**layout, "schedule": label,
                                                 **({} if b is None else {batch: b})})
                cfg, _ = self.suggest(fixed)
                if cfg is not None:
                    out.setdefault(cfg, dict(fixed.params))
                    break
        return list(out.items())

    def more_sharding(self, params: dict[str, Any]
                      ) -> tuple[ParallelConfig, dict[str, Any]] | None:
        """The config of ``params`` with the next sharding level up (more memory saved), or
        ``None`` at the most sharding or where that config breaks a rule."""
        import optuna

        levels = self.param_choices().get("sharding_index")
        if not levels or params.get("sharding_index") not in levels:
            return None
        at = levels.index(params["sharding_index"])
        if at + 1 >= len(levels):
            return None
        fixed = optuna.trial.FixedTrial({**params, "sharding_index": levels[at + 1]})
        cfg, _ = self.suggest(fixed)
        return None if cfg is None else (cfg, dict(fixed.params))

    # ------------------------------------------------------------------ identity
    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "world_size": self.world_size,
                "hardware": self.hardware.name, "devices_per_node": self.devices_per_node,
                "space": self.space.to_dict()}

    def fingerprint(self) -> str:
        """A short hash of everything that defines the space (names default studies)."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]
