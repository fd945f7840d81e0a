"""The layout rules of :class:`~paratune.batch.ConfigBatch` as one table, and the option
codes a batch stores.

:data:`LAYOUT_RULES` lists every rule in the order :class:`~paratune.ParallelConfig` checks
them (its constructor's, then :meth:`~paratune.ParallelConfig.validate`'s); each says which
rows of a batch break it and words the error as the dataclass does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.parallel import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    Recompute,
    Schedule,
    Sharding,
    degrees_product,
)

if TYPE_CHECKING:
    from paratune.batch import ConfigBatch

__all__ = [
    "LAYOUT_INTS",
    "LAYOUT_RULES",
    "MLP_KINDS",
    "OPTIONS",
    "LayoutRule",
    "RuleContext",
    "option_codes",
]

OPTIONS: dict[str, type[StrEnum]] = {"schedule": Schedule, "sharding": Sharding,
                                     "recompute": Recompute}
"""The option columns and the enum each one's codes come from."""
MLP_KINDS: tuple[str, ...] = ("swiglu", "gelu")
"""Values of ``ModelSpec.mlp``; a batch stores the position (0: SwiGLU, three matrices)."""
LAYOUT_INTS = ("dp", "tp", "pp", "micro_batch_size", "global_batch_size", "virtual_stages",
               "cp")
"""The integer fields of a layout, in declaration order."""


def option_codes(name: str) -> dict[str, int]:
    """The code of each value of option ``name`` (its position in the enum of
    :data:`OPTIONS`): ``option_codes("sharding")["zero2"] == 2``."""
    return {member.value: i for i, member in enumerate(OPTIONS[name])}


_CODES = {name: option_codes(name) for name in OPTIONS}

# ---------------------------------------------------------------------- the rule table
@dataclass(frozen=True)
class RuleContext:
    """What a check is asked about: the world size (if any) and paratune's own trainer."""

    world_size: int | None
    runnable: bool


@dataclass(frozen=True)
class LayoutRule:
    """One rule: the field it names, when it applies, which rows break it and its words."""

    field: str
    needs: frozenset[str]
    """When it applies: always (empty: a field's own rule), or with all of ``layout`` (the
    layout rules), ``world`` (a world size given), ``runnable`` (paratune's own trainer)
    and ``shape`` (against the model)."""
    broken: Callable[[ConfigBatch, RuleContext], np.ndarray]
    describe: Callable[[ConfigBatch, int, RuleContext], tuple[Any, str]]


_ALWAYS: frozenset[str] = frozenset()
_LAYOUT = frozenset({"layout"})
_WORLD = frozenset({"layout", "world"})
_RUNNABLE = frozenset({"layout", "runnable"})
_SHAPE = frozenset({"layout", "shape"})


def _int(batch: ConfigBatch, name: str, i: int) -> int:
    return int(getattr(batch, name)[i])


def _option_rules() -> list[LayoutRule]:
    rules = []
    for name, enum in OPTIONS.items():
        allowed = ", ".join(m.value for m in enum)
        rules.append(LayoutRule(
            name, _ALWAYS, lambda b, c, name=name: getattr(b, name) < 0,
            lambda b, i, c, name=name, allowed=allowed: (
                b.option_text(name)[i], f"must be one of {allowed}")))
    return rules


def _field_rules() -> list[LayoutRule]:
    rules = []
    for name in LAYOUT_INTS:
        limit = MAX_GLOBAL_BATCH if "batch" in name else MAX_DEVICES
        rules.append(LayoutRule(name, _ALWAYS, lambda b, c, name=name: getattr(b, name) < 1,
                                lambda b, i, c, name=name: (_int(b, name, i),
                                                            "must be a positive integer")))
        rules.append(LayoutRule(
            name, _ALWAYS, lambda b, c, name=name, limit=limit: getattr(b, name) > limit,
            lambda b, i, c, name=name, limit=limit: (
                _int(b, name, i), f"is beyond the plausible range (at most {limit}): "
                                  "check the value")))
    return rules


_INTERLEAVED = _CODES["schedule"][Schedule.INTERLEAVED_1F1B.value]
_ONE_F_ONE_B = _CODES["schedule"][Schedule.ONE_F_ONE_B.value]


def _describe_world(b: ConfigBatch, i: int, c: RuleContext) -> tuple[Any, str]:
    dp, tp, pp, cp = (_int(b, name, i) for name in ("dp", "tp", "pp", "cp"))
    return dp, f"{degrees_product(dp, tp, pp, cp)} must equal the world size {c.world_size}"


def _describe_divisible(b: ConfigBatch, i: int, c: RuleContext) -> tuple[Any, str]:
    dp, mbs = _int(b, "dp", i), _int(b, "micro_batch_size", i)
    return _int(b, "global_batch_size", i), (f"must be divisible by dp*micro_batch_size = "
                                             f"{dp}*{mbs} = {dp * mbs}")


def _layout_rules() -> list[LayoutRule]:
    def interleaved(b: ConfigBatch) -> np.ndarray:
        return b.schedule == _INTERLEAVED

    return [
        LayoutRule("dp", _WORLD, lambda b, c: b.world_size != c.world_size, _describe_world),
        LayoutRule("global_batch_size", _LAYOUT,
                   lambda b, c: np.mod(b.global_batch_size, b.dp * b.micro_batch_size) != 0,
                   _describe_divisible),
        LayoutRule("schedule", _LAYOUT, lambda b, c: interleaved(b) & (b.pp < 2),
                   lambda b, i, c: ("interleaved_1f1b", "interleaved_1f1b needs pp >= 2")),
        LayoutRule("virtual_stages", _LAYOUT,
                   lambda b, c: interleaved(b) & (b.virtual_stages < 2),
                   lambda b, i, c: (_int(b, "virtual_stages", i),
                                    "must be >= 2 with schedule=interleaved_1f1b")),
        LayoutRule("global_batch_size", _LAYOUT,
                   lambda b, c: interleaved(b) & (np.mod(b.num_microbatches, b.pp) != 0),
                   lambda b, i, c: (_int(b, "global_batch_size", i), (
                       f"interleaved_1f1b needs the number of micro-batches "
                       f"({int(b.num_microbatches[i])}) to be a multiple of "
                       f"pp={_int(b, 'pp', i)}"))),
        LayoutRule("virtual_stages", _LAYOUT,
                   lambda b, c: ~interleaved(b) & (b.virtual_stages != 1),
                   lambda b, i, c: (_int(b, "virtual_stages", i), (
                       f"must be 1 unless schedule=interleaved_1f1b "
                       f"(schedule={b.option_text('schedule')[i]})"))),
        # torch.distributed.pipelining.Schedule1F1B refuses fewer micro-batches than stages
        LayoutRule("global_batch_size", _RUNNABLE,
                   lambda b, c: ((b.schedule == _ONE_F_ONE_B) & (b.virtual_stages == 1)
                                 & (b.pp > 1) & (b.num_microbatches < b.pp)),
                   lambda b, i, c: (_int(b, "global_batch_size", i), (
                       f"1f1b needs at least pp={_int(b, 'pp', i)} micro-batches per step "
                       f"(num_microbatches={int(b.num_microbatches[i])})"))),
    ]


def _shape_rules() -> list[LayoutRule]:
    rules = []
    for name in ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"):
        needs = _SHAPE | _RUNNABLE if name == "vocab_size" else _SHAPE
        rules.append(LayoutRule(
            "tp", needs, lambda b, c, name=name: np.mod(getattr(b, name), b.tp) != 0,
            lambda b, i, c, name=name: (_int(b, "tp", i),
                                        f"must divide {name}={_int(b, name, i)}")))
    rules.append(LayoutRule(
        "cp", _SHAPE, lambda b, c: (b.cp > 1) & (np.mod(b.seq_len, 2 * b.cp) != 0),
        lambda b, i, c: (_int(b, "cp", i), (
            f"2*cp = {2 * _int(b, 'cp', i)} must divide seq_len={_int(b, 'seq_len', i)}"))))
    rules.append(LayoutRule(
        "pp", _SHAPE | _RUNNABLE, lambda b, c: b.num_layers < b.num_stages,
        lambda b, i, c: (_int(b, "pp", i), (
            f"pp*virtual_stages = {int(b.num_stages[i])} pipeline stages need at least as "
            f"many layers (num_layers={_int(b, 'num_layers', i)})"))))
    return rules


LAYOUT_RULES: tuple[LayoutRule, ...] = (*_option_rules(), *_field_rules(), *_layout_rules(),
                                        *_shape_rules())
"""Every layout rule, in the order :class:`~paratune.ParallelConfig` checks them (its
constructor's, then :meth:`~paratune.ParallelConfig.validate`'s); a property test holds the
two to the same verdict and message on random configurations."""
