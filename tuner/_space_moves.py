"""Moves through a search space: the configs one move away from a trial (the local search's
neighbourhood), the least-memory probe of every layout, and one sharding level up.

Each takes the :class:`~paratune.tuner._space.SearchSpace` first; the space's methods of the
same names call them.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from paratune.parallel import ParallelConfig, Schedule
from paratune.tuner._space_params import MEMORY_KNOBS, parse_schedule_label

if TYPE_CHECKING:
    from paratune.tuner._space import SearchSpace

__all__ = ["more_sharding", "neighbours", "probes", "work_keeping_moves"]


def neighbours(space: SearchSpace, params: dict[str, Any]
               ) -> list[tuple[ParallelConfig, dict[str, Any]]]:
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

    choices = space.param_choices()
    conditional = [c for c in ("schedule", "sharding_index") if c in choices]
    moves: list[dict[str, Any]] = [{name: value} for name, current in params.items()
                                   for value in choices.get(name, []) if value != current]
    # Memory knobs also move in pairs: trading a larger micro-batch or an interleaved
    # schedule for recomputation or sharding is one step for the search, not two
    # through an infeasible config.
    knobs = [k for k in MEMORY_KNOBS if k in params]
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
    keeping = [(True, move) for move in work_keeping_moves(space, params, choices)]
    for keeps_work, move in keeping + [(False, move) for move in moves]:
        variants = [{**params, **move}]
        for cond in conditional:
            if cond not in variants[0]:
                variants = [{**v, cond: c} for v in variants for c in choices[cond]]
        for variant in variants:
            fixed = optuna.trial.FixedTrial(variant)
            cfg, _ = space.suggest(fixed)
            if cfg is not None and cfg not in out:
                out[cfg] = (-1 if keeps_work else steps(fixed.params), dict(fixed.params))
    ranked = sorted(out.items(), key=lambda item: item[1][0])  # stable: moves' order
    return [(cfg, p) for cfg, (_, p) in ranked]


def work_keeping_moves(space: SearchSpace, params: dict[str, Any], choices: dict[str, list[Any]]
                       ) -> list[dict[str, Any]]:
    """Layout moves that keep each rank's work per step (see :func:`neighbours`);
    ``choices`` as :meth:`SearchSpace.param_choices` gives them."""
    tps, pps = space.degree_choices()
    micros = list(space.space.micro_batch_sizes)
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


def probes(space: SearchSpace, params: dict[str, Any]
           ) -> list[tuple[ParallelConfig, dict[str, Any]]]:
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
    config one sharding level up (:func:`more_sharding`, queued by the search), so each
    layout is also seen at the least sharding that fits: the most sharding gathers the
    parameters every micro-batch, and a layout whose best config needs one level less
    looks slow at the most.

    Args:
        params: Trial parameters (as :meth:`SearchSpace.suggest` asks them) of the best
            config so far.

    Returns:
        ``(config, params)`` pairs, at most two per layout.
    """
    import optuna

    choices = space.param_choices()
    tps, pps = space.degree_choices()
    least_memory = {name: choices[name][index] for name, index in (
        ("micro_batch_size_index", 0), ("sharding_index", -1), ("recompute_index", -1))
        if name in choices}
    bases = [{**params, **least_memory}]
    if "sharding_index" in params and params["sharding_index"] != least_memory.get(
            "sharding_index"):
        bases.append({**bases[0], "sharding_index": params["sharding_index"]})
    order = [Schedule.INTERLEAVED_1F1B, Schedule.ONE_F_ONE_B, Schedule.GPIPE]

    def bubble_rank(label: str) -> tuple[int, int]:
        schedule, virtual = parse_schedule_label(label)
        return order.index(schedule), -virtual

    schedules = sorted(choices["schedule"], key=bubble_rank)
    batch = "global_batch_size_index"
    batches: list[Any] = sorted(choices.get(batch, [None]), key=lambda i: (
        0 if i is None else abs(i - params.get(batch, 0)), i))
    out: dict[ParallelConfig, dict[str, Any]] = {}
    for (_, tp, pp), knobs in itertools.product(space.layouts(), bases):
        layout = {**knobs, "tp_index": tps.index(tp), "pp_index": pps.index(pp)}
        for label, b in itertools.product(schedules, batches):
            fixed = optuna.trial.FixedTrial({**layout, "schedule": label,
                                             **({} if b is None else {batch: b})})
            cfg, _ = space.suggest(fixed)
            if cfg is not None:
                out.setdefault(cfg, dict(fixed.params))
                break
    return list(out.items())


def more_sharding(space: SearchSpace, params: dict[str, Any]
                  ) -> tuple[ParallelConfig, dict[str, Any]] | None:
    """The config of ``params`` with the next sharding level up (more memory saved), or
    ``None`` at the most sharding or where that config breaks a rule."""
    import optuna

    levels = space.param_choices().get("sharding_index")
    if not levels or params.get("sharding_index") not in levels:
        return None
    at = levels.index(params["sharding_index"])
    if at + 1 >= len(levels):
        return None
    fixed = optuna.trial.FixedTrial({**params, "sharding_index": levels[at + 1]})
    cfg, _ = space.suggest(fixed)
    return None if cfg is None else (cfg, dict(fixed.params))
