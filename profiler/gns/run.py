"""Running a :class:`~paratune.profiler.gns.GNSJob`: the workers, the checkpoints, progress."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from paratune.profiler.gns.job import (
    GNSJob,
    _check_resumable,
    _checkpoint_step,
    _job_fingerprint,
    _start_fresh,
)
from paratune.profiler.gns.meter import NoiseScaleMeter
from paratune.profiler.gns.trajectory import _append_row, _locked_trajectory, _truncate_rows
from paratune.profiler.processes import init_worker, resolved_device, spawn


def _gns_worker(rank: int, world_size: int, port: int, job: GNSJob) -> None:
    import time

    import torch.distributed as dist

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.reconfigure import (
        RunState,
        find_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from paratune.profiler.trainer import Trainer

    device = init_worker(rank, world_size, port, job.device)
    with closing_process_group():
        corpus = TextCorpus.from_stdlib(max_bytes=job.corpus_bytes)
        meter = NoiseScaleMeter(job.config, mode=job.mode,
                                num_small_batches=job.num_small_batches,
                                precondition=job.precondition, beta=job.beta,
                                measure_every=job.measure_every)
        trainer = Trainer(job.model, meter.trainer_config, device=device, seed=job.seed,
                          lr=job.lr, weight_decay=job.weight_decay)
        fingerprint = _job_fingerprint(job)
        state = RunState(config=job.config, extra={"elapsed_s": 0.0, "job": fingerprint})
        ckpt = Path(job.checkpoint_dir) if job.checkpoint_dir else None
        # run_gns has checked a resume's checkpoint against this job (or started afresh:
        # deleted the trajectory and any earlier run's checkpoint) before starting us.
        if job.resume and ckpt is not None and find_checkpoint(ckpt) is not None:
            state = load_checkpoint(ckpt, trainer)
            state.config = job.config  # checked equal (run_gns: _check_fingerprint)
            meter.tracker.load_state_dict(state.gns)
            if rank == 0:
                _truncate_rows(job.out, state.step, seq_len=job.model.seq_len)
        dist.barrier()
        meter.steps = state.step
        gb, seq_len = job.config.global_batch_size, job.model.seq_len
        elapsed = float(state.extra.get("elapsed_s", 0.0))
        while state.step < job.steps:
            start = time.perf_counter()
            tokens = corpus.sequences(state.samples_seen, gb, seq_len, seed=job.data_seed)
            result = meter.step(trainer, tokens)
            elapsed += time.perf_counter() - start
            state.step += 1
            state.samples_seen += gb
            state.tokens_seen += gb * seq_len
            if rank == 0 and result.measured:
                est = result.estimate
                _append_row(job.out, {
                    "step": state.step, "tokens": state.tokens_seen, "loss": result.loss,
                    "b_simple": est.b_simple, "g2": est.g2, "trace": est.trace,
                    "g2_ema": est.g2_ema, "trace_ema": est.trace_ema,
                    "small_sqnorm": result.small_sqnorm, "big_sqnorm": result.big_sqnorm,
                    "b_small": result.b_small, "b_big": result.b_big, "elapsed_s": elapsed,
                    "seq_len": seq_len})
            if ckpt is not None and job.checkpoint_every and (
                    state.step % job.checkpoint_every == 0 or state.step == job.steps):
                state.gns = meter.tracker.state_dict()
                state.extra["elapsed_s"] = elapsed
                state.extra["job"] = fingerprint
                save_checkpoint(ckpt, trainer, state)
        trainer.close()


def run_gns(job: GNSJob, *, progress: bool = False) -> Path:
    """Train ``job.model`` on the standard-library text and write its ``B_noise`` trajectory.

    Starts ``job.config.world_size`` processes on this machine (gloo on CPU, NCCL on CUDA).
    Rank 0 appends one row per measured step (every ``job.measure_every``-th from step 1) to
    ``job.out`` (columns :data:`TRAJECTORY_COLUMNS`) and
    fsyncs it, so a killed run keeps every row measured; with ``checkpoint_dir`` and
    ``resume`` a rerun continues from the last complete checkpoint (rows past it are
    re-measured). Each checkpoint holds the job's fingerprint (model, config, seeds, lr,
    weight decay, small batches, preconditioner, beta, measuring period, corpus size,
    device and precision); a resume whose settings differ, or whose rows up to the
    checkpoint's step are not the measured steps of ``1..step`` of that run, is refused
    before any process starts, as is resuming where ``job.out`` has rows but no complete
    checkpoint exists (the rows are kept); resuming with neither starts from step 0.
    A run starting from step 0 deletes ``job.out`` and any checkpoint left in
    ``checkpoint_dir``, so a later resume cannot continue another run's weights.
    While it runs, this process holds an exclusive lock on ``<out>.lock`` (released when it
    ends, however it ends), and a second run on the same ``out`` is refused. A SIGINT or
    SIGTERM ends the workers before it propagates (see :func:`spawn`; :func:`resume_hint`
    says what a rerun can continue from).

    Args:
        job: The run.
        progress: Show a progress bar on stderr (step of ``job.steps``, loss, latest
            ``b_simple``, time left), read from the rows as rank 0 writes them.

    Returns:
        The trajectory path.

    Raises:
        ConfigError: the job is invalid, it resumes measured rows without a checkpoint or
            from a checkpoint of another run (the differing field named) or one already past
            ``steps``, another run is writing ``out``, on CUDA this machine has fewer GPUs
            than ranks, or on the CPU its processes cannot fit in this machine's memory
            (checked before any process starts).
    """
    job.validate()
    with _locked_trajectory(job.out):
        _check_resumable(job)
        if resolved_device(job.device) == "cpu":
            from paratune.profiler._memory import check_cpu_memory

            check_cpu_memory(job.model, job.config)
        from paratune.profiler.reconfigure import find_checkpoint

        if not (job.resume and job.checkpoint_dir is not None
                and find_checkpoint(job.checkpoint_dir) is not None):
            _start_fresh(job)
        if not progress:
            spawn(_gns_worker, job.config.world_size, job)
            return Path(job.out)
        with _ProgressBar(job) as bar:
            spawn(_gns_worker, job.config.world_size, job, poll=bar.poll)
    return Path(job.out)


class _ProgressBar:
    """A progress bar of a run's steps, fed by the trajectory rows rank 0 appends (as
    ``paratune profile`` shows its configs): step of total, loss, latest ``b_simple``
    and the time left. Reads only what was appended since the last poll."""

    def __init__(self, job: GNSJob) -> None:
        self.job = job
        self.path = Path(job.out)
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.partial = ""
        self.columns: list[str] | None = None
        self.bar: Any = None

    def __enter__(self) -> _ProgressBar:
        from paratune.progress import progress_bar

        # a resumed run starts at its checkpoint's step (rows past it are measured again)
        self.bar = progress_bar(total=self.job.steps, initial=_checkpoint_step(self.job),
                                unit="step", desc=f"gns {self.job.config.key()}", enabled=True)
        # rows already there belong to the run being resumed: skipped until rank 0 has
        # cut them back to the checkpoint (a new file)
        with contextlib.suppress(FileNotFoundError):
            stat = self.path.stat()
            self.identity, self.offset = (stat.st_ino, stat.st_dev), stat.st_size
            with open(self.path, encoding="utf-8") as handle:
                self.columns = handle.readline().rstrip("\n").split(",")
        return self

    def __exit__(self, *exc: Any) -> None:
        # the rows written since the last poll (an interrupt can land before the next one):
        # the bar a stopped run leaves shows the step and loss it saved
        with contextlib.suppress(Exception):
            self.poll()
        self.bar.close()

    def poll(self) -> None:
        row = self._last_new_row()
        if row is None:
            return
        step = int(row["step"])
        self.bar.set_postfix_str(f"loss={float(row['loss']):.4g} "
                                 f"b_simple={float(row['b_simple']):.4g}", refresh=False)
        self.bar.update(step - self.bar.n)

    def _last_new_row(self) -> dict[str, str] | None:
        """The last complete row appended since the previous call (the file is read afresh
        when it was replaced, as a resume truncates it)."""
        import os

        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        identity = (stat.st_ino, stat.st_dev)
        if identity != self.identity or stat.st_size < self.offset:
            self.identity, self.offset, self.partial, self.columns = identity, 0, "", None
        if stat.st_size == self.offset:
            return None
        with open(self.path, encoding="utf-8") as handle:
            handle.seek(self.offset)
            text = self.partial + handle.read()
            self.offset = handle.tell()
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished line waits for the next call
        if self.columns is None and lines:
            self.columns = lines.pop(0).split(",")
        for line in reversed(lines):
            fields = line.split(",")
            if self.columns and len(fields) == len(self.columns) and fields[0].isdigit():
                return dict(zip(self.columns, fields))
        return None
