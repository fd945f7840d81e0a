"""How a training step is laid out over devices: the 3D-parallel configuration."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError

if TYPE_CHECKING:
    from paratune.spec import ModelSpec

__all__ = ["MAX_DEVICES", "MAX_GLOBAL_BATCH", "SEED_LIMIT", "MeshAxis", "ParallelConfig",
           "Recompute", "Schedule", "Sharding", "check_magnitude", "check_seed",
           "degrees_product", "layout_key",
           "max_stage_layers", "stage_layer_counts"]

MAX_DEVICES = 1 << 20
"""The most devices (world size, or any one degree) paratune plans for: about ten times the
largest training clusters built; a larger count is a typo, not a job."""
MAX_GLOBAL_BATCH = 1 << 24
"""The largest global (or micro) batch in sequences paratune plans for: 2**24 sequences is
tens of billions of tokens per step, far past any published recipe."""


def check_magnitude(field: str, value: int, limit: int) -> int:
    """``value`` when it is at most ``limit``.

    Raises:
        ConfigError: ``value`` exceeds ``limit`` (the message names the field and the limit).
    """
    if value > limit:
        raise ConfigError(field, value, f"is beyond the plausible range (at most {limit}): "
                          "check the value")
    return value


SEED_LIMIT = 2**32
"""Seeds are below this: the profiler's data seed per step is ``seed * 1_000_003 + step``,
which a larger seed pushes past the 64 bits torch's generators take."""


def check_seed(field: str, value: Any) -> int:
    """``value`` when it is an integer in ``[0, SEED_LIMIT)``.

    Raises:
        ConfigError: naming ``field`` and the rule.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(field, value, f"must be an integer from 0 to {SEED_LIMIT - 1}")
    return value


class MeshAxis(StrEnum):
    """Names of the device-mesh axes, outermost first."""

    PP = "pp"
    DP = "dp"
    TP = "tp"


class Schedule(StrEnum):
    """Pipeline schedule (ignored when ``pp == 1``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class Sharding(StrEnum):
    """How data-parallel replicas share training state.

    ``none`` is plain DDP; ``zero1`` shards optimizer state; ``zero2`` shards gradients and
    optimizer state (FSDP2 without resharding after forward); ``zero3`` shards parameters
    too (FSDP2 with resharding after forward).
    """

    NONE = "none"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @property
    def stage(self) -> int:
        """The ZeRO stage: the member's position (its code in a config batch)."""
        return list(Sharding).index(self)

    @classmethod
    def from_stage(cls, stage: int) -> Sharding:
        return list(cls)[int(stage)]


class Recompute(StrEnum):
    """Activation checkpointing: none, every block (full), or attention only (selective)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


def _enum_field(cls: type[StrEnum], name: str, value: Any) -> StrEnum:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise ConfigError(name, value, f"must be one of {allowed}") from None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees and options of one training-step layout.

    This class owns the degrees: anything that needs the world size, the number of
    micro-batches or whether an axis is in use asks it rather than recomputing.
    """

    dp: int = 1
    """Data-parallel degree (replicas, or shards under ZeRO)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of pipeline ranks)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = 1
    """Sequences per optimizer step across the whole job."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (``> 1`` only with ``interleaved_1f1b``)."""
    sharding: Sharding = Sharding.NONE
    """Data-parallel sharding level."""
    recompute: Recompute = Recompute.NONE
    """Activation checkpointing mode."""
    cp: int = 1
    """Context-parallel degree: each sequence split over ``cp`` ranks, which exchange keys
    and values around a ring in attention (Megatron-LM's ``--context-parallel-size``,
    torchtitan's ``context_parallel_degree``). The performance model predicts it; paratune's
    own trainer does not run it (:meth:`check_trainer`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", _enum_field(Schedule, "schedule", self.schedule))
        object.__setattr__(self, "sharding", _enum_field(Sharding, "sharding", self.sharding))
        object.__setattr__(self, "recompute", _enum_field(Recompute, "recompute", self.recompute))
        for name in ("dp", "tp", "pp", "micro_batch_size", "global_batch_size", "virtual_stages",
                     "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, value, "must be a positive integer")
            check_magnitude(name, value, MAX_GLOBAL_BATCH if "batch" in name else MAX_DEVICES)

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_group_size(self) -> int:
        """Ranks that hold the same parameters: the gradient reduction's and ZeRO's group,
        ``dp * cp`` (Megatron-LM and torchtitan shard over the context-parallel ranks too)."""
        return self.dp * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (ranks x virtual stages)."""
        return self.pp * self.virtual_stages

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank (= gradient-accumulation steps)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def local_batch_size(self) -> int:
        """Sequences per step on each data-parallel rank."""
        return self.global_batch_size // self.dp

    def mesh_shape(self) -> tuple[int, int, int]:
        """Degrees in :class:`MeshAxis` order (pp, dp, tp).

        Raises:
            ConfigError: ``cp > 1`` (the trainer's mesh has no context-parallel axis).
        """
        self._refuse_split_sequences("its device mesh is (pp, dp, tp)")
        return (self.pp, self.dp, self.tp)

    def _refuse_split_sequences(self, why: str) -> None:
        """Raise a :class:`ConfigError` naming ``cp`` (and ``why``) where ``cp > 1``: what
        paratune's own trainer cannot run."""
        if self.cp > 1:
            raise ConfigError("cp", self.cp,
                              f"paratune's trainer has no context parallelism (cp=1): {why}")

    # ------------------------------------------------------------------ validation
    def validate(self, model: ModelSpec | None = None, world_size: int | None = None, *,
                 runnable: bool = True) -> None:
        """Raise if this layout cannot run ``model`` on ``world_size`` devices.

        Args:
            model: The model; shape rules are checked when given.
            world_size: Devices available; ``dp * tp * pp * cp`` must equal it when given.
            runnable: Also check the limits of paratune's own trainer (torch's 1F1B schedule
                needs at least ``pp`` micro-batches, ``tp`` must divide the vocabulary, a
                pipeline stage needs a decoder layer); ``False`` checks only what any
                framework needs, e.g. for predicting a layout run elsewhere (Megatron-LM pads
                the vocabulary to a multiple of ``tp``; nanotron places the embedding, the
                final norm and the head in pipeline stages of their own, so a layout may have
                more stages than layers).

        Raises:
            ConfigError: naming the field, the value and the rule broken.
        """
        if world_size is not None and self.world_size != world_size:
            product = degrees_product(self.dp, self.tp, self.pp, self.cp)
            raise ConfigError("dp", self.dp, f"{product} must equal the world size {world_size}")
        per_step = self.dp * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ConfigError("global_batch_size", self.global_batch_size,
                              f"must be divisible by dp*micro_batch_size = {self.dp}*"
                              f"{self.micro_batch_size} = {per_step}")
        if self.schedule is Schedule.INTERLEAVED_1F1B:
            if self.pp < 2:
                raise ConfigError("schedule", self.schedule.value, "interleaved_1f1b needs pp >= 2")
            if self.virtual_stages < 2:
                raise ConfigError("virtual_stages", self.virtual_stages,
                                  "must be >= 2 with schedule=interleaved_1f1b")
            if self.num_microbatches % self.pp:
                raise ConfigError("global_batch_size", self.global_batch_size,
                                  f"interleaved_1f1b needs the number of micro-batches "
                                  f"({self.num_microbatches}) to be a multiple of pp={self.pp}")
        elif self.virtual_stages != 1:
            raise ConfigError("virtual_stages", self.virtual_stages,
                              f"must be 1 unless schedule=interleaved_1f1b "
                              f"(schedule={self.schedule.value})")
        elif (runnable and self.pp_enabled and self.schedule is Schedule.ONE_F_ONE_B
              and self.num_microbatches < self.pp):
            # torch.distributed.pipelining.Schedule1F1B refuses fewer micro-batches than stages.
            raise ConfigError("global_batch_size", self.global_batch_size,
                              f"1f1b needs at least pp={self.pp} micro-batches per step "
                              f"(num_microbatches={self.num_microbatches})")
        if model is None:
            return
        shapes = [("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                  ("ffn_hidden_size", model.ffn_hidden_size)]
        if runnable:
            shapes.append(("vocab_size", model.vocab_size))
        for field_name, size in shapes:
            if size % self.tp:
                raise ConfigError("tp", self.tp, f"must divide {field_name}={size}")
        if self.cp > 1 and model.seq_len % (2 * self.cp):
            # each rank holds two chunks of the sequence, one from each end, so that causal
            # attention's work is balanced around the ring (Megatron-LM, torchtitan)
            raise ConfigError("cp", self.cp, f"2*cp = {2 * self.cp} must divide "
                              f"seq_len={model.seq_len}")
        if runnable and model.num_layers < self.num_stages:
            raise ConfigError("pp", self.pp,
                              f"pp*virtual_stages = {self.num_stages} pipeline stages need at "
                              f"least as many layers (num_layers={model.num_layers})")

    def check_trainer(self, model: ModelSpec) -> None:
        """Raise for layouts valid in general that paratune's own trainer cannot run (other
        frameworks, e.g. Megatron-LM's distributed optimizer, can).

        Raises:
            ConfigError: ``zero1`` with ``tp > 1`` (``ZeroRedundancyOptimizer`` cannot
                partition tensor-parallel parameters); tied embeddings with ``pp > 1`` (one
                matrix on the first and the last stage); context parallelism (``cp > 1``).
        """
        self._refuse_split_sequences("predict such a layout, or export it to Megatron-LM or "
                                     "torchtitan")
        if self.sharding is Sharding.ZERO1 and self.tp_enabled:
            raise ConfigError("sharding", "zero1", f"needs tp=1 (tp={self.tp}) in paratune's "
                              "trainer: ZeroRedundancyOptimizer cannot partition "
                              "tensor-parallel parameters")
        if model.tie_embeddings and self.pp_enabled:
            raise ConfigError("pp", self.pp, "pipeline parallelism in paratune's trainer needs "
                              "untied embeddings (tie_embeddings=True puts one matrix on the "
                              "first and last stage)")

    def is_valid(self, model: ModelSpec | None = None, world_size: int | None = None) -> bool:
        try:
            self.validate(model, world_size)
        except ConfigError:
            return False
        return True

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), StrEnum) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], "is not a ParallelConfig field")
        return cls(**data)

    def replace(self, **changes: Any) -> ParallelConfig:
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """A short, stable, readable identity: ``dp2-tp2-pp1-mb1-gb8-1f1b-v1-none-none``
        (``-cp2`` appended where the sequence is split)."""
        return layout_key((self.dp, self.tp, self.pp, self.micro_batch_size,
                           self.global_batch_size, self.schedule.value, self.virtual_stages,
                           self.sharding.value, self.recompute.value, self.cp))

    def __str__(self) -> str:
        return self.key()


def layout_key(fields: Sequence[Any]) -> str:
    """The identity of a layout (:meth:`ParallelConfig.key`), from its fields in declaration
    order (dp, tp, pp, micro batch, global batch, schedule, virtual stages, sharding,
    recompute and, optionally, cp; the enums as their values):
    ``dp2-tp2-pp1-mb1-gb8-1f1b-v1-none-none``, with ``-cp2`` appended where ``cp > 1`` (so
    the keys of layouts without context parallelism are what they always were).
    """
    dp, tp, pp, micro_batch_size, global_batch_size, schedule, virtual_stages, sharding, \
        recompute, *rest = fields
    cp = int(rest[0]) if rest else 1
    return (f"dp{dp}-tp{tp}-pp{pp}-mb{micro_batch_size}-gb{global_batch_size}-{schedule}"
            f"-v{virtual_stages}-{sharding}-{recompute}" + (f"-cp{cp}" if cp > 1 else ""))


def degrees_product(dp: int, tp: int, pp: int, cp: int = 1) -> str:
    """The world-size product in words, ``dp*tp*pp = 2*2*1 = 4`` (``dp*tp*pp*cp = ...``
    where ``cp > 1``), for the messages that compare it with a device count."""
    if cp > 1:
        return f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * tp * pp * cp}"
    return f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}"


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Decoder layers of each pipeline stage: as even as possible, the earlier stages taking
    one more where ``num_stages`` does not divide ``num_layers``.

    Raises:
        ConfigError: fewer layers than stages.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError("pp", num_stages, f"{num_stages} pipeline stages need at least as "
                          f"many layers (num_layers={num_layers})")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def max_stage_layers(num_layers: Any, num_stages: Any) -> Any:
    """Layers of the fullest stage of :func:`stage_layer_counts` (its first),
    ``ceil(num_layers / num_stages)`` and at least one; for numbers or numpy arrays."""
    import numpy as np

    return np.maximum(np.ceil(num_layers / num_stages), 1.0)
