"""Worker side of ``time_to_target.py``: profiling, the pilot run and the four arms.

Everything here runs in each of the ``world_size`` gloo processes; rank 0 writes results.
Profiled measurements (each step time, each switch cost) and runs are journaled as they are
made (one fsync'd JSON line each, in ``profile.jsonl`` and ``runs.jsonl``), so a killed
experiment resumes where it stopped and loses nothing already measured (a run still going
when it was killed starts again: a time to target is measured in one piece).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratune.fileio import append_jsonl, atomic_write_text, read_jsonl
from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec

LAYOUTS: dict[str, dict[str, Any]] = {
    # (dp, tp, pp, sharding); the micro-batch follows from the batch (see config_for).
    "dp4": {"dp": 4, "tp": 1, "pp": 1, "sharding": "none"},
    "dp2-tp2": {"dp": 2, "tp": 2, "pp": 1, "sharding": "none"},
    "pp2-tp2": {"dp": 1, "tp": 2, "pp": 2, "sharding": "none"},
    "dp2-pp2-zero2": {"dp": 2, "tp": 1, "pp": 2, "sharding": "zero2"},
}


def config_for(layout: str, batch: int, *, chunks: int = 1) -> ParallelConfig:
    """The config of ``layout`` at global batch ``batch``: one micro-batch per data-parallel
    rank without pipelining, ``pp`` micro-batches with it (1F1B needs at least ``pp``), for
    each of ``chunks`` gradient-accumulation chunks (the noise-scale meter's small batches)."""
    degrees = LAYOUTS[layout]
    local = batch // degrees["dp"] // chunks
    micro = max(1, local // degrees["pp"])
    return ParallelConfig(dp=degrees["dp"], tp=degrees["tp"], pp=degrees["pp"],
                          sharding=degrees["sharding"], micro_batch_size=micro,
                          global_batch_size=batch)


def measured_config_for(model: ModelSpec, layout: str, batch: int, *, world_size: int = 4
                        ) -> ParallelConfig | None:
    """The config a noise-measuring run uses for ``layout`` at ``batch``, or ``None`` if the
    layout cannot run that batch while measuring (per-rank small batches where the layout
    allows, else two accumulation chunks, each needing a valid layout of its own)."""
    from paratune.errors import ConfigError
    from paratune.profiler.gns import NoiseScaleMeter, resolve_mode
    from paratune.profiler.trainer import check_supported

    plain = config_for(layout, batch)
    chunks = 1 if resolve_mode(plain) == "dp" else 2
    config = config_for(layout, batch, chunks=chunks)
    try:
        config.validate(model, world_size)
        trainer_config = NoiseScaleMeter(config).trainer_config
        trainer_config.validate(model, world_size)
        check_supported(model, trainer_config)
    except ConfigError:
        return None
    return config


def layout_of(config: ParallelConfig) -> str:
    for name, degrees in LAYOUTS.items():
        if all(getattr(config, k) == v for k, v in degrees.items()):
            return name
    return config.key()


@dataclass
class Job:
    """What the workers do; one pickled object."""

    model: ModelSpec
    out_dir: str
    target_loss: float
    lr: float
    corpus_bytes: int
    val_seqs: int
    eval_every_tokens: int
    max_tokens: int
    batches: list[int]
    gns_beta: float
    runs: list[dict[str, Any]] = field(default_factory=list)
    profile: bool = False
    profile_steps: int = 8
    lr_rule: str = "none"
    """How the learning rate follows the batch (:func:`paratune.tuner.lr_scale`)."""
    lr_base_batch: int = 16
    """Batch at which ``lr`` holds."""
    gns_every: int = 1
    """Measure the noise scale on every ``gns_every``-th step (the meter's
    ``measure_every``)."""

    def lr_at(self, batch: int) -> float:
        """The learning rate of a run at global batch ``batch`` under ``lr_rule``."""
        from paratune.tuner import lr_scale

        if self.lr_rule == "adascale":  # needs B_noise, which the arms do not share
            raise ValueError("lr_rule adascale is not supported by this experiment")
        return self.lr * float(lr_scale([batch], self.lr_base_batch, self.lr_rule)[0])


def set_lr(trainer: Any, lr: float) -> None:
    """Set every optimizer's learning rate (after a checkpoint load restored the old one)."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


# ---------------------------------------------------------------------- policies
class Policy:
    """Chooses the config for the next step (called at evaluation points)."""

    needs_gns = False

    def initial(self) -> ParallelConfig:
        raise NotImplementedError

    def next_config(self, current: ParallelConfig, *, b_noise: float,
                    val_loss: float) -> ParallelConfig:
        return current


class Fixed(Policy):
    def __init__(self, config: ParallelConfig, *, measure: bool = False) -> None:
        self.config = config
        self.needs_gns = measure

    def initial(self) -> ParallelConfig:
        return self.config


class FollowNoise(Policy):
    """Global batch = candidate nearest (in log) to the measured ``B_noise``, never smaller
    than the current one; the layout is fixed, or the measured-fastest for each batch."""

    needs_gns = True

    def __init__(self, model: ModelSpec, batches: list[int], *, layout: str | None,
                 best_layout: dict[int, str]) -> None:
        self.model = model
        self.layout = layout
        self.best_layout = {int(k): v for k, v in best_layout.items()}
        self.batches = sorted(b for b in batches if self._config(b) is not None)

    def _config(self, batch: int) -> ParallelConfig | None:
        layout = self.layout or self.best_layout.get(batch)
        return measured_config_for(self.model, layout, batch) if layout else None

    def initial(self) -> ParallelConfig:
        return self._config(self.batches[0])

    def next_config(self, current: ParallelConfig, *, b_noise: float,
                    val_loss: float) -> ParallelConfig:
        if not (math.isfinite(b_noise) and b_noise > 0):
            return current
        wanted = min(self.batches, key=lambda b: abs(math.log(b) - math.log(b_noise)))
        if wanted <= current.global_batch_size:
            return current
        return self._config(wanted)


class Phases(Policy):
    """The phases of a plan, entered when the validation loss reaches the pilot's loss at
    the phase's start (progress measured by loss, so it transfers across batch sizes)."""

    def __init__(self, phases: list[dict[str, Any]]) -> None:
        self.phases = phases

    def initial(self) -> ParallelConfig:
        return ParallelConfig.from_dict(self.phases[0]["config"])

    def next_config(self, current: ParallelConfig, *, b_noise: float,
                    val_loss: float) -> ParallelConfig:
        chosen = self.phases[0]
        for phase in self.phases:
            if val_loss <= phase["start_loss"]:
                chosen = phase
        return ParallelConfig.from_dict(chosen["config"])


def make_policy(spec: dict[str, Any], model: ModelSpec) -> Policy:
    kind = spec["policy"]
    if kind == "fixed":
        return Fixed(ParallelConfig.from_dict(spec["config"]), measure=spec.get("measure", False))
    if kind == "follow":
        return FollowNoise(model, spec["batches"], layout=spec.get("layout"),
                           best_layout=spec["best_layout"])
    if kind == "phases":
        return Phases(spec["phases"])
    raise ValueError(f"policy={kind!r}: must be fixed, follow or phases")


# ---------------------------------------------------------------------- one run
class _Evaluator:
    """Validation loss of the whole model, computed on rank 0 from gathered parameters."""

    def __init__(self, spec: ModelSpec, val: torch.Tensor) -> None:
        from paratune.profiler.model import build_model

        self.val = val
        self.model = build_model(spec, seed=0) if dist.get_rank() == 0 else None

    def __call__(self, trainer: Any) -> float:
        from paratune.profiler.pipeline import cross_entropy_loss

        full = trainer.gather_full()
        value = torch.zeros(1, dtype=torch.float64)
        if self.model is not None:
            self.model.load_state_dict(full, strict=True)
            with torch.no_grad():
                value[0] = float(cross_entropy_loss(self.model(self.val[:, :-1]),
                                                    self.val[:, 1:]))
        dist.broadcast(value, src=0)
        return float(value[0])


def _broadcast(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def train_to_target(job: Job, run: dict[str, Any], corpus: Any, evaluator: _Evaluator,
                    device: torch.device) -> dict[str, Any]:
    """Train from scratch under ``run``'s policy until the validation loss reaches
    ``job.target_loss`` (or ``job.max_tokens``); the clock excludes evaluation only."""
    from paratune.profiler.gns import NoiseScaleMeter
    from paratune.profiler.reconfigure import RunState, reconfigure
    from paratune.profiler.trainer import Trainer

    seed = int(run["seed"])
    spec = job.model
    seq = spec.seq_len
    policy = make_policy(run, spec)
    config = policy.initial()

    def make_meter(cfg: ParallelConfig) -> NoiseScaleMeter | None:
        return (NoiseScaleMeter(cfg, beta=job.gns_beta, measure_every=job.gns_every)
                if policy.needs_gns else None)

    def build(cfg: ParallelConfig) -> Trainer:
        meter_cfg = make_meter(cfg)
        return Trainer(spec, meter_cfg.trainer_config if meter_cfg else cfg, device=device,
                       seed=seed, lr=job.lr_at(cfg.global_batch_size))

    meter = make_meter(config)
    trainer = build(config)
    state = RunState(config=config)
    ckpt = Path(job.out_dir) / "switch-checkpoint"
    clock = 0.0
    curve: list[dict[str, Any]] = []
    gns_rows: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = []
    next_eval = 0
    reached = False
    while True:
        tokens_seen = state.samples_seen * seq
        if tokens_seen >= next_eval:
            val_loss = evaluator(trainer)
            b_noise = meter.tracker.b_simple if meter else math.nan
            val_loss, b_noise = _broadcast([val_loss, b_noise])
            # config/measure: what the steps since the previous point ran under (a switch
            # happens after this point), the key modelled_time prices them by.
            curve.append({"tokens": tokens_seen, "step": state.step, "time_s": clock,
                          "val_loss": val_loss, "batch": config.global_batch_size,
                          "layout": layout_of(config), "config": config.key(),
                          "measure": meter is not None, "b_noise": b_noise})
            if val_loss <= job.target_loss:
                reached = True
                break
            if tokens_seen >= job.max_tokens:
                break
            next_eval += job.eval_every_tokens
            new = policy.next_config(config, b_noise=b_noise, val_loss=val_loss)
            if new != config:
                start = time.perf_counter()
                if meter is not None:
                    state.gns = meter.tracker.state_dict()
                new_meter = make_meter(new)
                trainer, state, cost = reconfigure(
                    trainer, state, new_meter.trainer_config if new_meter else new,
                    checkpoint_dir=ckpt, build_trainer=lambda c: Trainer(
                        spec, c, device=device, seed=seed, lr=job.lr))
                # the checkpoint brought the old batch's learning rate back
                set_lr(trainer, job.lr_at(new.global_batch_size))
                state.config = new
                if new_meter is not None:
                    new_meter.tracker.load_state_dict(state.gns)
                meter = new_meter
                elapsed = time.perf_counter() - start
                clock += elapsed
                switches.append({"step": state.step, "tokens": tokens_seen,
                                 "from": config.key(), "to": new.key(), "seconds": elapsed,
                                 "save_s": cost.save_s, "build_s": cost.build_s,
                                 "load_s": cost.load_s})
                config = new
        gb = config.global_batch_size
        batch = corpus.sequences(state.samples_seen, gb, seq, seed=seed)
        start = time.perf_counter()
        if meter is not None:
            result = meter.step(trainer, batch)
            loss = result.loss
        else:
            loss = trainer.step(batch)
        clock += time.perf_counter() - start
        state.step += 1
        state.samples_seen += gb
        if meter is not None:
            est = result.estimate
            gns_rows.append({"step": state.step, "tokens": state.samples_seen * seq,
                             "loss": loss, "b_simple": est.b_simple, "g2": est.g2,
                             "trace": est.trace, "batch": gb, "time_s": clock,
                             "seq_len": seq})
    trainer.close()
    last = curve[-1]
    return {"name": run["name"], "arm": run["arm"], "seed": seed, "reached": reached,
            "time_s": last["time_s"] if reached else math.nan,
            "steps": last["step"] if reached else math.nan,
            "tokens": last["tokens"], "final_val_loss": last["val_loss"],
            "num_switches": len(switches), "switch_s": sum(s["seconds"] for s in switches),
            "curve": curve, "gns": gns_rows, "switches": switches}


# ---------------------------------------------------------------------- profiling
def _median(values: list[float]) -> float:
    return float(sorted(values)[len(values) // 2])


def time_measuring_steps(job: Job, config: ParallelConfig, device: torch.device, *,
                         warmup_steps: int = 2) -> tuple[list[float], str]:
    """Step times of a noise-measuring run under ``config`` (collective): what the pilot and
    the batch and coadapt arms run, a :class:`NoiseScaleMeter` step (in ``accumulate`` mode
    one reduction per chunk of half the batch on measured steps), each the slowest rank's,
    over whole cycles of ``gns_every`` steps. Also the mode."""
    from paratune.profiler.gns import NoiseScaleMeter
    from paratune.profiler.trainer import Trainer, synthetic_batch

    meter = NoiseScaleMeter(config, beta=job.gns_beta, measure_every=job.gns_every)
    trainer = Trainer(job.model, meter.trainer_config, device=device, seed=0, lr=job.lr)
    times: list[float] = []
    try:
        for step in range(warmup_steps + job.profile_steps):
            tokens = synthetic_batch(job.model, config.global_batch_size, step=step)
            dist.barrier()
            begin = time.perf_counter()
            meter.step(trainer, tokens)
            if step >= warmup_steps:
                times.append(time.perf_counter() - begin)
    finally:
        trainer.close()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist(), meter.mode


PROFILE_JOURNAL = "profile.jsonl"
"""Under ``--out``: each profiled measurement (a row of the step-time table, a switch cost) as
it is made, one fsync'd JSON line with its ``id`` and ``measured_at`` (Unix time), so a killed
profiling resumes where it stopped; ``profile.json`` is assembled from it at the end."""


def step_id(config: ParallelConfig, measure: bool) -> str:
    """Journal id of the step time of ``config``, noise-measuring or not."""
    return f"step {config.key()} measure={int(measure)}"


def switch_id(index: int, source: ParallelConfig, target: ParallelConfig) -> str:
    """Journal id of the ``index``-th timed switch, ``source`` to ``target``."""
    return f"switch {index} {source.key()} -> {target.key()}"


def switch_plan() -> list[tuple[ParallelConfig, ParallelConfig]]:
    """The timed layout switches, in order (each starts where the previous one ended)."""
    first, second = config_for("dp4", 16), config_for("dp2-tp2", 32)
    return [(first, second), (second, first), (first, second)]


def profile_items(job: Job, world_size: int
                  ) -> list[tuple[str, str, int, bool, ParallelConfig]]:
    """The step times to measure, in table order: ``(id, layout, batch, measure, config)``;
    the plain config of each valid (layout, batch), then its noise-measuring config where one
    exists."""
    items = []
    for layout in LAYOUTS:
        for batch in job.batches:
            config = config_for(layout, batch)
            if config.is_valid(job.model, world_size):
                items.append((step_id(config, False), layout, batch, False, config))
            measuring = measured_config_for(job.model, layout, batch, world_size=world_size)
            if measuring is not None:
                items.append((step_id(measuring, True), layout, batch, True, measuring))
    return items


def assemble_profile(job: Job, world_size: int, records: dict[str, dict[str, Any]]
                     ) -> dict[str, Any] | None:
    """``profile.json``'s content from journal ``records`` (by id), or ``None`` while a
    measurement is missing. Journal-only fields (``id``, ``measured_at``) are left out."""
    ids = ([item[0] for item in profile_items(job, world_size)]
           + [switch_id(i, *pair) for i, pair in enumerate(switch_plan())])
    if any(i not in records for i in ids):
        return None
    rows = [{k: v for k, v in records[i].items() if k not in ("id", "measured_at")}
            for i in ids]
    num_steps = len(ids) - len(switch_plan())
    return {"table": rows[:num_steps], "switch_costs": rows[num_steps:]}


def read_profile_journal(path: Path) -> dict[str, dict[str, Any]]:
    """The measurements journaled in ``path`` by id (the first of each id; torn lines
    skipped)."""
    records: dict[str, dict[str, Any]] = {}
    for record in read_jsonl(path):
        if "id" in record:
            records.setdefault(record["id"], record)
    return records


def profile(job: Job, device: torch.device) -> dict[str, Any]:
    """Step times of the configs the runs use, and the cost of a layout switch.

    Two rows per (layout, batch) where they exist, keyed by the full config and ``measure``:
    the plain config (``measure`` false; what the fixed and plan arms run, and the configs
    the plan chooses from) and the noise-measuring config of :func:`measured_config_for`
    timed with the meter's step (``measure`` true; what the pilot and the batch and coadapt
    arms run, and what coadapt chooses layouts by).

    Each measurement is journaled (:data:`PROFILE_JOURNAL`) by rank 0 as soon as it is made;
    those already there (from a killed earlier profiling) are reused, not measured again.
    """
    from paratune.profiler import MeasureOptions, measure_config
    from paratune.profiler.mesh import build_mesh
    from paratune.profiler.reconfigure import RunState, reconfigure
    from paratune.profiler.trainer import Trainer, synthetic_batch

    rank, world_size = dist.get_rank(), dist.get_world_size()
    journal = Path(job.out_dir) / PROFILE_JOURNAL
    shared = [read_profile_journal(journal) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # every rank skips the same measurements
    records: dict[str, dict[str, Any]] = shared[0]

    def record(measurement_id: str, row: dict[str, Any]) -> None:
        entry = {"id": measurement_id, "measured_at": time.time(), **row}
        if rank == 0:
            append_jsonl(journal, entry)
        records[measurement_id] = entry

    for measurement_id, layout, batch, measure, config in profile_items(job, world_size):
        if measurement_id in records:
            continue
        if not measure:
            m = measure_config(job.model, config, hardware="cpu", device=device,
                               options=MeasureOptions(warmup_steps=2,
                                                      measured_steps=job.profile_steps, seed=0))
            record(measurement_id, {"layout": layout, "batch": batch, "measure": False,
                                    "mode": "", "key": config.key(),
                                    "config": config.to_dict(),
                                    "step_time_s": _median(m.step_times_s),
                                    "peak_rss_gb": m.peak_rss_gb})
        else:
            times, mode = time_measuring_steps(job, config, device)
            record(measurement_id, {"layout": layout, "batch": batch, "measure": True,
                                    "mode": mode, "key": config.key(),
                                    "config": config.to_dict(),
                                    "step_time_s": _median(times), "peak_rss_gb": math.nan})
    switches = switch_plan()
    missing = [i for i, pair in enumerate(switches) if switch_id(i, *pair) not in records]
    if missing:
        # A whole profiling has built every layout's mesh before its switches; a resumed
        # one may not have: build them untimed so a switch does not pay for it.
        for config in dict.fromkeys(c for pair in switches for c in pair):  # one order on
            build_mesh(config, device.type)  # every rank (a set's differs between processes)

        def build(c: ParallelConfig) -> Trainer:
            return Trainer(job.model, c, device=device, seed=0, lr=job.lr)

        checkpoint_dir = Path(job.out_dir) / "switch-checkpoint"
        current = switches[missing[0]][0]
        trainer = build(current)
        trainer.step(synthetic_batch(job.model, current.global_batch_size, step=0))
        state = RunState(config=current)
        for i in missing:
            source, target = switches[i]
            if current != source:  # not where this switch starts: go there untimed
                trainer, state, _ = reconfigure(trainer, state, source,
                                                checkpoint_dir=checkpoint_dir,
                                                build_trainer=build)
            trainer, state, cost = reconfigure(trainer, state, target,
                                               checkpoint_dir=checkpoint_dir,
                                               build_trainer=build)
            current = target
            trainer.step(synthetic_batch(job.model, target.global_batch_size, step=1))
            record(switch_id(i, source, target),
                   {"save_s": cost.save_s, "build_s": cost.build_s, "load_s": cost.load_s,
                    "total_s": cost.total_s, "checkpoint_bytes": cost.checkpoint_bytes})
        trainer.close()
    result = assemble_profile(job, world_size, records)
    assert result is not None, "every measurement was just made or journaled"
    return result


def worker(rank: int, world_size: int, port: int, job: Job) -> None:
    import json

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group

    device = init_worker(rank, world_size, port, "cpu")
    out = Path(job.out_dir)
    with closing_process_group():
        if job.profile:
            result = profile(job, device)
            if rank == 0:
                atomic_write_text(out / "profile.json", json.dumps(result, indent=1))
            dist.barrier()
        if not job.runs:
            return
        corpus = TextCorpus.from_stdlib(max_bytes=job.corpus_bytes)
        val = corpus.sequences(0, job.val_seqs, job.model.seq_len, seed=0, split="validation")
        evaluator = _Evaluator(job.model, val)
        journal = out / "runs.jsonl"
        for run in job.runs:
            done = {r["name"] for r in read_jsonl(journal)}
            if run["name"] in done:
                continue
            result = train_to_target(job, run, corpus, evaluator, device)
            if rank == 0:
                append_jsonl(journal, result)
                print(f"{run['name']}: reached={result['reached']} time={result['time_s']:.1f}s "
                      f"steps={result['steps']} switches={result['num_switches']}", flush=True)
            dist.barrier()
