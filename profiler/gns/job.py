"""A noise-scale run as a typed job: its validation, fingerprint and resume checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError
from paratune.parallel import check_seed
from paratune.profiler.gns.meter import NoiseScaleMeter
from paratune.profiler.gns.trajectory import (
    _LEGACY_TRAJECTORY_COLUMNS,
    TRAJECTORY_COLUMNS,
    _measured_rows,
    _read_trajectory,
)
from paratune.profiler.processes import check_gpus, resolved_device


@dataclass(frozen=True)
class GNSJob:
    """A training run on the text corpus that records the ``B_noise`` trajectory."""

    model: Any
    """:class:`~paratune.ModelSpec` (byte-level vocabulary: ``vocab_size >= 256``)."""
    config: Any
    """:class:`~paratune.ParallelConfig`; ``world_size`` processes are started."""
    steps: int
    """Optimizer steps to reach (a resumed run continues up to it)."""
    out: str
    """Trajectory CSV path (rows are appended and fsync'd as they are measured)."""
    seed: int = 0
    """Initialisation seed."""
    data_seed: int = 0
    """Data-order seed."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    mode: str = "auto"
    """Small-batch source (:func:`resolve_mode`)."""
    num_small_batches: int = 2
    """Chunks per step in ``accumulate`` mode."""
    precondition: str = "none"
    """``"none"`` or ``"adam"``."""
    beta: float = 0.95
    """Moving-average decay."""
    measure_every: int = 1
    """Measure on every ``measure_every``-th step (the trajectory has a row for each measured
    step only; see :class:`NoiseScaleMeter`)."""
    corpus_bytes: int | None = 8 << 20
    """Bytes of the standard library to read."""
    checkpoint_dir: str | None = None
    """Where to save state every ``checkpoint_every`` steps (and resume from). A run that
    does not resume removes a checkpoint left there by an earlier run before it starts."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: never)."""
    resume: bool = False
    """Continue from ``checkpoint_dir`` if it holds a complete checkpoint."""
    device: str = "auto"
    """``"cpu"`` (gloo), ``"cuda"`` (NCCL) or ``"auto"``."""

    def validate(self) -> None:
        """Check the job before any process starts.

        Raises:
            ConfigError: naming the field and the rule.
        """
        if self.steps < 1:
            raise ConfigError("steps", self.steps, "must be >= 1")
        check_seed("seed", self.seed)
        check_seed("data_seed", self.data_seed)
        if Path(self.out).is_dir():
            raise ConfigError("out", str(self.out), "is a directory; give the trajectory's "
                              "file path, such as gns.csv")
        if self.model.vocab_size < 256:
            raise ConfigError("model", self.model.name, "needs vocab_size >= 256 (byte-level "
                              f"text), got {self.model.vocab_size}")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", self.checkpoint_every, "must be >= 0")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir", None,
                              "is required with checkpoint_every or resume")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", self.device, "must be auto, cpu or cuda")
        if resolved_device(self.device) == "cuda":
            check_gpus(self.device, self.config.world_size)
        if self.checkpoint_every:
            from paratune.profiler.reconfigure import _check_supported

            _check_supported(self.config)  # zero1 with dp > 1 cannot be checkpointed
        from paratune.profiler.trainer import check_supported

        check_supported(self.model, self.config)
        NoiseScaleMeter(self.config, mode=self.mode, num_small_batches=self.num_small_batches,
                        precondition=self.precondition, beta=self.beta,
                        measure_every=self.measure_every)


def _job_fingerprint(job: GNSJob) -> dict[str, Any]:
    """What must be the same for a checkpoint to continue ``job``'s trajectory, flat
    (``model.seq_len``, ``config.dp``, ``lr``, ...) and JSON-normalised. The small-batch
    mode and count are the resolved ones (``auto`` and ``dp`` on a dp layout agree)."""
    import json

    meter = NoiseScaleMeter(job.config, mode=job.mode, num_small_batches=job.num_small_batches,
                            precondition=job.precondition, beta=job.beta)
    fingerprint: dict[str, Any] = {f"model.{k}": v for k, v in job.model.to_dict().items()}
    fingerprint.update({f"config.{k}": v for k, v in job.config.to_dict().items()})
    fingerprint.update(seed=job.seed, data_seed=job.data_seed, lr=job.lr,
                       weight_decay=job.weight_decay, mode=meter.mode,
                       num_small_batches=meter.num_small_batches,
                       precondition=job.precondition, beta=job.beta,
                       measure_every=job.measure_every, corpus_bytes=job.corpus_bytes)
    # The numerics: the same checkpoint continued on another device would change them.
    device = resolved_device(job.device)
    fingerprint.update(device=device, precision=_precision(device))
    return json.loads(json.dumps(fingerprint, default=str))


def _precision(device: str) -> str:
    """What the GNS workers' :class:`~paratune.profiler.trainer.Trainer` computes in on
    ``device`` (its default ``mixed_precision``, in fresh processes whose default dtype is
    float32)."""
    return "bf16-mixed" if device == "cuda" else "float32"


def _check_fingerprint(job: GNSJob, saved: dict[str, Any], found: Path) -> None:
    """Refuse a checkpoint saved by a run with other settings, naming the first field that
    differs and both values.

    A checkpoint written before fingerprints were saved is checked on what it holds (its
    layout and the moving-average decay) and accepted with a warning.
    """
    import warnings

    mine = _job_fingerprint(job)
    fingerprint = saved.get("extra", {}).get("job")
    if fingerprint is None:
        fingerprint = {f"config.{k}": v for k, v in saved["config"].items()}
        if "beta" in saved.get("gns", {}):
            fingerprint["beta"] = saved["gns"]["beta"]
        warnings.warn(f"{found} predates job fingerprints: only its parallel config and beta "
                      "can be checked against this run", stacklevel=3)
    for name in [*mine, *(n for n in fingerprint if n not in mine)]:
        if mine.get(name) != fingerprint.get(name, mine.get(name)):
            raise ConfigError(name, mine.get(name), f"differs from {fingerprint.get(name)!r}, "
                              f"the value of the run that saved the checkpoint {found}: it "
                              "cannot continue this trajectory. Resume with the same settings, "
                              "or run without resume to start a new trajectory")


def _check_rows_match(job: GNSJob, step: int, tokens: int, found: Path) -> None:
    """Refuse a checkpoint at ``step`` whose trajectory rows up to it are not exactly the
    measured steps of ``1..step`` of this run (every ``measure_every``-th from step 1;
    missing, gapped or spliced rows, another sequence length)."""
    header, rows = _read_trajectory(job.out)
    if header and header not in (TRAJECTORY_COLUMNS, _LEGACY_TRAJECTORY_COLUMNS):
        raise ConfigError("out", job.out, f"has columns {','.join(header)}, not a trajectory's")
    kept = [fields for fields in rows if int(fields[0]) <= step]
    steps = [int(fields[0]) for fields in kept]
    expected = list(range(1, step + 1, job.measure_every))
    if steps != expected:
        last = steps[-1] if steps else None
        which = (f"steps 1..{step}" if job.measure_every == 1 else
                 f"steps 1, {1 + job.measure_every}, ... up to {expected[-1]} (every "
                 f"{job.measure_every}th)")
        raise ConfigError("resume", True, f"the checkpoint {found} is at step {step} but "
                          f"{job.out} holds {len(steps)} rows up to it (last step {last}), not "
                          f"{which}: they are not the same run. Nothing was changed; "
                          "run without resume to start a new trajectory")
    if steps:
        where = dict(zip(header, kept[-1]))
        # every step takes the same tokens: the last row's share of the checkpoint's
        at_row = tokens * steps[-1] // step
        if int(where["tokens"]) != at_row:
            raise ConfigError("resume", True, f"{job.out} has {where['tokens']} tokens at step "
                              f"{steps[-1]}, the checkpoint {found} {at_row} there: not the "
                              "same run")
        seq_lens = {int(float(fields[-1])) for fields in kept} if "seq_len" in header else set()
        if seq_lens - {job.model.seq_len}:
            raise ConfigError("model.seq_len", job.model.seq_len, f"differs from seq_len "
                              f"{sorted(seq_lens)} of the rows of {job.out}")


def _check_resumable(job: GNSJob) -> None:
    """Check a resume before any process starts: nothing is changed when it is refused.

    Refused: measured rows without a complete checkpoint to continue from (restarting at
    step 0 would delete them); a checkpoint saved by a run with other settings (see
    :func:`_check_fingerprint`); a checkpoint past ``job.steps`` (the run would end with more
    rows than asked for); rows up to the checkpoint's step that are not its run's.
    """
    import json

    if not job.resume:
        return
    from paratune.profiler.reconfigure import RUN_STATE_FILE, find_checkpoint

    found = None if job.checkpoint_dir is None else find_checkpoint(job.checkpoint_dir)
    if found is None:
        rows = _measured_rows(job.out)
        if rows:
            raise ConfigError("resume", True, f"no complete checkpoint was saved in "
                              f"{job.checkpoint_dir} to continue the {rows} rows of "
                              f"{job.out} from (the first comes after --checkpoint-every "
                              "steps); they are kept. Rerun without --resume to start over "
                              f"(this replaces {job.out}), or give another --out")
        return
    from paratune.profiler.reconfigure import verify_checkpoint

    verify_checkpoint(found)  # refused before any process starts, nothing unpickled
    saved = json.loads((found / RUN_STATE_FILE).read_text(encoding="utf-8"))
    _check_fingerprint(job, saved, found)
    step = int(saved["step"])
    if job.steps < step:
        raise ConfigError("steps", job.steps, f"the run being resumed is already at step {step} "
                          f"(checkpoint {found}); nothing was changed. Give at least {step} "
                          "steps to continue it, or run without resume to start a new "
                          "trajectory")
    _check_rows_match(job, step, int(saved["tokens_seen"]), found)


def _start_fresh(job: GNSJob) -> None:
    """Before a run that starts at step 0: delete ``job.out`` and any checkpoint an earlier
    run left in ``job.checkpoint_dir`` (a later resume would otherwise continue from its
    weights). A checkpoint directory holding other files is refused, nothing deleted."""
    import shutil

    from paratune.profiler.reconfigure import _PREVIOUS, _SAVING, _removable

    targets = []
    if job.checkpoint_dir is not None:
        ckpt = Path(job.checkpoint_dir)
        targets = [ckpt, ckpt.with_name(ckpt.name + _PREVIOUS),
                   ckpt.with_name(ckpt.name + _SAVING)]
        for target in targets:
            if not _removable(target):
                raise ConfigError("checkpoint_dir", job.checkpoint_dir,
                                  f"{target} holds files that are not a checkpoint; move "
                                  "them away, or give another --out (the checkpoint goes "
                                  "beside it)")
    Path(job.out).parent.mkdir(parents=True, exist_ok=True)
    Path(job.out).unlink(missing_ok=True)
    for target in targets:
        shutil.rmtree(target, ignore_errors=True)


def _checkpoint_step(job: GNSJob) -> int:
    """The step of the complete checkpoint in ``job.checkpoint_dir`` (0 without one)."""
    import json

    from paratune.profiler.reconfigure import RUN_STATE_FILE, find_checkpoint

    if job.checkpoint_dir is None:
        return 0
    found = find_checkpoint(job.checkpoint_dir)
    if found is None:
        return 0
    try:
        return int(json.loads((found / RUN_STATE_FILE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError):
        return 0


def resume_hint(job: GNSJob) -> str:
    """What an interrupted run left and how to continue it: the rows measured, the
    checkpoint's step, and whether ``--resume`` can continue from it."""
    rows = _measured_rows(job.out)
    step = _checkpoint_step(job)
    measured = f"{rows} of {job.steps} steps are measured in {job.out}"
    if step:
        return (f"{measured}; the checkpoint in {job.checkpoint_dir} is at step {step}: rerun "
                f"the same command with --resume to continue from step {step + 1} (the "
                f"{rows - step} steps after it are measured again)" if rows > step else
                f"{measured}; the checkpoint in {job.checkpoint_dir} is at step {step}: rerun "
                "the same command with --resume to continue")
    if not job.checkpoint_every:
        return f"{measured}; this run saves no checkpoint, so a rerun starts from step 0"
    return (f"{measured}; no checkpoint was saved yet (the first at step "
            f"{job.checkpoint_every}), so a rerun starts from step 0")
