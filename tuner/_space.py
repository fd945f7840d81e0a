"""The tuner's search space: a :class:`~paratune.space.ConfigSpace` bound to a job.

The space itself (batch sizes, micro-batches, schedules, sharding, recomputation, allowed
degrees) is data in :class:`ConfigSpace`; this module binds it to one model, world size and
device, enumerates it (for exhaustive search) and turns an Optuna trial into a
:class:`~paratune.ParallelConfig`. Sampling is valid by construction where the rule is known
up front: the degrees offered for a batch size factorise the world size, respect the
model's shape and the node size, and divide the batch; what remains (micro-batch divisibility,
interleaved-schedule rules) is checked by :meth:`ParallelConfig.validate` and the trial is
pruned with the rule it breaks.

The parameters' text forms (batch-size lists and ranges, schedule labels) are in
:mod:`~paratune.tuner._space_params`, the moves of the local search in
:mod:`~paratune.tuner._space_moves`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.measurement import family_of
from paratune.parallel import ParallelConfig, Recompute, Schedule, Sharding
from paratune.space import ConfigSpace, SpaceEnumeration, divisors
from paratune.spec import ModelSpec
from paratune.tuner import _space_moves
from paratune.tuner._space_params import (
    MAX_BATCH_SIZES,
    check_gpus,
    parse_batch_sizes,
    parse_schedule_label,
    schedule_label,
)

if TYPE_CHECKING:
    import optuna

__all__ = ["MAX_BATCH_SIZES", "SearchSpace", "check_gpus", "parse_batch_sizes"]

logger = logging.getLogger(__name__)

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
    framework: str = ""
    """The framework the configs run in, as the performance model names its measurement
    families (the first word of a measurement's source: ``ultrascale``, ``vtrain``,
    ``megatron-lm``): the source of every config it predicts. A framework it has no
    measurement of is predicted as a well-tuned one on the device. Empty: whichever family
    measured the device kind."""
    _layout_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("gpus", self.world_size, "must be a positive integer")
        if (isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int)
                or self.devices_per_node < 1):
            raise ConfigError("devices_per_node", self.devices_per_node,
                              "must be a positive integer")
        if not isinstance(self.framework, str) or (
                self.framework and family_of(self.framework, missing="") != self.framework.lower()):
            raise ConfigError("framework", self.framework,
                              "must be a name of letters, digits, '.' and '-' (a measurement "
                              "family's name, e.g. megatron-lm), neither starting nor ending "
                              "with '-'")
        object.__setattr__(self, "framework", self.framework.lower())
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
        if name == "tp" and self.space.tp_within_node and n > node and node % degree:
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
                     if self.space.tp_within_node and n > node else "")
        return ConfigError("gpus", n,
                           f"no (dp, tp, pp) layout of {n} devices is valid for "
                           f"{self.model.name} with global_batch_sizes={batches} (tp must "
                           f"divide the head counts{node_rule}, pp*virtual stages <= layers, "
                           f"dp*micro_batch_size must divide a batch)")

    @classmethod
    def build(cls, model: ModelSpec, world_size: int, hardware: HardwareSpec | str, *,
              space: ConfigSpace | None = None,
              global_batch_sizes: str | int | Sequence[int] | None = None,
              devices_per_node: int | None = None, framework: str | None = None
              ) -> SearchSpace:
        """Bind a space to a job; ``global_batch_sizes`` overrides the space's batch list.

        Args:
            model: The model.
            world_size: Devices in the job.
            hardware: Device kind or its catalogue name.
            space: Options to search; defaults to :class:`ConfigSpace` defaults.
            global_batch_sizes: Batch sizes (list or range text, see
                :func:`parse_batch_sizes`).
            devices_per_node: Node size; defaults to the catalogue's.
            framework: The framework the configs run in (see :attr:`framework`); ``None``:
                the device kind's measured family.

        Raises:
            ConfigError: ``world_size`` (``gpus``) or ``devices_per_node`` is not a positive
                integer, ``framework`` is not a family name, or no layout of the devices is
                valid.
        """
        world_size = check_gpus(world_size)
        hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
        if devices_per_node is None:
            devices_per_node = hw.devices_per_node
        elif (isinstance(devices_per_node, bool) or not isinstance(devices_per_node, numbers.Real)
              or not float(devices_per_node).is_integer() or devices_per_node < 1):
            raise ConfigError("devices_per_node", devices_per_node, "must be a positive integer")
        devices_per_node = _launched_per_node(world_size, int(devices_per_node))
        space = space or ConfigSpace()
        if global_batch_sizes is not None:
            space = space.replace(global_batch_sizes=parse_batch_sizes(global_batch_sizes))
        return cls(model=model, world_size=world_size, hardware=hw, space=space,
                   devices_per_node=devices_per_node, framework=framework or "")

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
            if self._shape_rule(dp, tp, pp) is not None:
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
                labels.extend(schedule_label(schedule, v) for v in self.space.virtual_stages)
            else:
                labels.append(schedule_label(schedule, 1))
        return labels

    def enumerate(self) -> SpaceEnumeration:
        """Every valid config (and every skipped one with its rule), via ``ConfigSpace``,
        less those the :attr:`framework` does not run (:meth:`framework_rule`)."""
        found = self.space.enumerate(self.model, self.world_size,
                                     devices_per_node=self.devices_per_node)
        if not self.framework:
            return found
        rules = [(cfg, self.framework_rule(cfg)) for cfg in found.valid]
        return SpaceEnumeration(valid=[cfg for cfg, rule in rules if rule is None],
                                skipped=[*found.skipped,
                                         *((cfg, rule) for cfg, rule in rules if rule)])

    def framework_rule(self, config: ParallelConfig) -> str | None:
        """Why the :attr:`framework` does not run ``config``, or ``None``: Megatron-LM
        (a framework named ``megatron...``) shards gradients and parameters (ZeRO-2/3) only
        with Megatron-FSDP, which runs no pipeline parallelism."""
        if (self.framework.startswith("megatron") and config.pp_enabled
                and config.dp_group_size > 1
                and config.sharding in (Sharding.ZERO2, Sharding.ZERO3)):
            return (f"sharding={config.sharding.value} with pp={config.pp}: Megatron-LM shards "
                    "gradients and parameters only with Megatron-FSDP, which runs no pipeline "
                    "parallelism")
        return None

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
                schedule, virtual = parse_schedule_label(label)
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
        rule = self.framework_rule(cfg)
        return (None, rule) if rule else (cfg, "")

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
        """Valid configs one move away from ``params``, nearest first (see
        :func:`paratune.tuner._space_moves.neighbours`)."""
        return _space_moves.neighbours(self, params)

    def probes(self, params: dict[str, Any]) -> list[tuple[ParallelConfig, dict[str, Any]]]:
        """Every valid layout with the knobs that need the least memory (see
        :func:`paratune.tuner._space_moves.probes`)."""
        return _space_moves.probes(self, params)

    def more_sharding(self, params: dict[str, Any]
                      ) -> tuple[ParallelConfig, dict[str, Any]] | None:
        """The config of ``params`` one sharding level up, or ``None`` (see
        :func:`paratune.tuner._space_moves.more_sharding`)."""
        return _space_moves.more_sharding(self, params)

    # ------------------------------------------------------------------ identity
    def to_dict(self) -> dict[str, Any]:
        # the framework only where one is named: the spaces (and studies) of the device's
        # own family keep the fingerprints they had
        return {"model": self.model.to_dict(), "world_size": self.world_size,
                "hardware": self.hardware.name, "devices_per_node": self.devices_per_node,
                **({"framework": self.framework} if self.framework else {}),
                "space": self.space.to_dict()}

    def fingerprint(self) -> str:
        """A short hash of everything that defines the space (names default studies)."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def _launched_per_node(world_size: int, devices_per_node: int) -> int:
    """The devices per node a job of ``world_size`` runs with: ``devices_per_node`` where it
    sits in one node (or no launch spreads it evenly), else what torchrun starts on each of
    the nodes that hold it (:func:`~paratune.tuner._export_torchrun.launch_shape`: 12
    devices of 8-device nodes run 6 on each of 2), so that configs are predicted, exported
    and verified on one placement."""
    from paratune.tuner._export_torchrun import launch_shape

    if world_size <= devices_per_node:
        return devices_per_node
    try:
        return launch_shape(world_size, devices_per_node)[1]
    except ConfigError:  # 13 devices: refused where a launch is written, with the reason
        return devices_per_node
