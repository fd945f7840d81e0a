"""Checks that a parallel layout measures what one process measures on the same batches."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paratune.profiler.gns.estimator import GradientNoiseScale
from paratune.profiler.gns.meter import NoiseScaleMeter
from paratune.profiler.gns.norms import adam_preconditioners, micro_batch_gradients
from paratune.profiler.processes import init_worker, spawn


@dataclass(frozen=True)
class _LayoutRuns:
    """What each worker of :func:`measure_layouts` trains."""

    model: Any
    runs: list[dict[str, Any]]
    steps: int
    seed: int
    dtype_name: str
    out_dir: str


def _layouts_worker(rank: int, world_size: int, port: int, job: _LayoutRuns) -> None:
    import json

    import torch
    import torch.distributed as dist

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.trainer import Trainer

    model, seed = job.model, job.seed
    torch.set_default_dtype(getattr(torch, job.dtype_name))
    device = init_worker(rank, world_size, port, "cpu")
    with closing_process_group():
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)
        for index, run in enumerate(job.runs):
            config = run["config"]
            meter = NoiseScaleMeter(config, mode=run.get("mode", "auto"),
                                    num_small_batches=run.get("num_small_batches", 2),
                                    precondition=run.get("precondition", "none"),
                                    measure_every=run.get("measure_every", 1))
            trainer = Trainer(model, meter.trainer_config, device=device, seed=seed, lr=1e-3)
            records = []
            for step in range(job.steps):
                tokens = corpus.batch(step, config.global_batch_size, model.seq_len, seed=seed)
                result = meter.step(trainer, tokens)
                records.append({**asdict(result), "mode": meter.mode})
            trainer.close()
            if rank == 0:
                Path(job.out_dir, f"{index}.json").write_text(json.dumps(records))
            dist.barrier()


def measure_layouts(model: Any, runs: list[dict[str, Any]], *, world_size: int, steps: int = 3,
                    seed: int = 0, dtype: str = "float64") -> list[list[dict[str, Any]]]:
    """Train ``steps`` steps under each run's layout on the same text batches, in one group
    of ``world_size`` gloo processes, and return every step's :class:`GNSStep` as a dict.

    Used to check that a parallel layout measures what one process measures on the same
    small batches.

    Args:
        model: The model shape.
        runs: Dicts with ``config`` (a ParallelConfig of ``world_size`` devices) and optional
            ``mode``, ``num_small_batches``, ``precondition``, ``measure_every``.
        world_size: Processes to start.
        steps: Steps per run.
        seed: Initialisation and data seed.
        dtype: Default dtype in the workers (``float64`` makes comparisons sharp).

    Returns:
        Per run, per step, the fields of :class:`GNSStep` (``estimate`` nested) and ``mode``.
    """
    import json
    import tempfile

    for run in runs:
        run["config"].validate(model, world_size)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_layouts_worker, world_size, _LayoutRuns(model, runs, steps, seed, dtype, out_dir))
        return [json.loads(Path(out_dir, f"{i}.json").read_text()) for i in range(len(runs))]


def single_process_reference(spec: Any, global_batch: int, steps: int, *, num_small: int,
                             precondition: str = "none") -> list[dict[str, float]]:
    """The noise-scale run of ``spec`` in this process with plain PyTorch, float64, one model
    and the small batches one by one: what a run under 3D parallelism must reproduce
    (per step ``loss``, ``small_sqnorm``, ``big_sqnorm`` and ``b_simple``)."""
    import torch

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.model import build_model
    from paratune.profiler.pipeline import cross_entropy_loss

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)
        model = build_model(spec, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                betas=(0.9, 0.95), eps=1e-8, foreach=False)
        gns = GradientNoiseScale()
        params = list(model.parameters())
        out = []
        for step in range(steps):
            tokens = corpus.batch(step, global_batch, spec.seq_len, seed=0)
            losses: list[float] = []

            def backward(chunk, losses=losses):
                loss = cross_entropy_loss(model(chunk[:, :-1]), chunk[:, 1:])
                losses.append(loss.item())
                loss.backward()

            weights = adam_preconditioners([opt]) if precondition == "adam" else None
            fns = [lambda c=c: backward(c) for c in tokens.chunk(num_small)]
            small, big = micro_batch_gradients(params, fns, preconditioners=weights)
            est = gns.update(small, big, global_batch // num_small, global_batch)
            opt.step()
            opt.zero_grad()
            out.append({"loss": sum(losses) / num_small, "small_sqnorm": small,
                        "big_sqnorm": big, "b_simple": est.b_simple})
        return out
    finally:
        torch.set_default_dtype(previous)
