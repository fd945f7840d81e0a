"""Change a running job's batch size and parallel layout at a step boundary, keeping its state.

A switch saves the model and optimizer state with ``torch.distributed.checkpoint`` (DCP),
builds the trainer for the new :class:`~paratune.ParallelConfig` on the same processes, and
loads the checkpoint into it. DCP stores every tensor by fully-qualified name with its global
shape, so a load under another layout reshards: tensor-parallel DTensor shards are re-cut,
pipeline stages read only the layers they now hold, data-parallel replicas read one copy.
The optimizer state is flattened per parameter name (torchtitan's convention), so it moves
with its parameter between stages. What is not a tensor (step, data position, the noise-scale
averages, the config) goes into ``run_state.json``, written by rank 0 after DCP's own
metadata, so a checkpoint directory holding ``run_state.json`` is complete.

Before anything of a checkpoint is read by ``torch.distributed.checkpoint`` (whose reader
unpickles the ``.metadata`` file: a pickle runs code), its files are checked against
``manifest.json``, the SHA-256 and size of every file as the save wrote it (written before
``run_state.json``): a file changed, added, missing, or not a regular file, and a
checkpoint without a manifest (saved elsewhere, or by an earlier version), are refused
unread (:func:`verify_checkpoint`). ``run_state.json`` itself is plain JSON, read as such.

A save never touches the checkpoint already at its path until the new one is complete: it is
written beside it (``<path>.saving``), then renamed into place, the old one moved aside to
``<path>.previous`` for the instant between the two renames and deleted after. A run killed at
any moment keeps a complete checkpoint, the old or the new; :func:`find_checkpoint` says
which.

The data position carries over because batches are addressed by sequences consumed (see
:class:`~paratune.profiler.corpus.TextCorpus`), not by step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text, fsync_dir
from paratune.parallel import ParallelConfig, Sharding

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MANIFEST_FILE", "RUN_STATE_FILE", "RunState", "SwitchCost", "find_checkpoint",
           "load_checkpoint", "reconfigure", "save_checkpoint", "verify_checkpoint"]

RUN_STATE_FILE = "run_state.json"
MANIFEST_FILE = "manifest.json"
"""SHA-256 and size of each file of a checkpoint (but ``run_state.json``), as saved."""
_MANIFEST_MAX_BYTES = 1 << 20
_FORMAT_VERSION = 1
_SAVING = ".saving"
_PREVIOUS = ".previous"


@dataclass
class RunState:
    """Everything about a run that is not a model or optimizer tensor."""

    config: ParallelConfig
    """Layout the state was written under."""
    step: int = 0
    """Optimizer steps taken."""
    samples_seen: int = 0
    """Sequences consumed: the data position."""
    tokens_seen: int = 0
    """Tokens trained on so far."""
    gns: dict[str, Any] = field(default_factory=dict)
    """:meth:`~paratune.profiler.gns.GradientNoiseScale.state_dict` of the run's estimator."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able additions (seed, learning rate, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": _FORMAT_VERSION, "config": self.config.to_dict(),
                "step": self.step, "samples_seen": self.samples_seen,
                "tokens_seen": self.tokens_seen, "gns": self.gns, "extra": self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        version = data.get("format_version")
        if version != _FORMAT_VERSION:
            raise ConfigError("format_version", version, f"must be {_FORMAT_VERSION}")
        return cls(config=ParallelConfig.from_dict(data["config"]), step=int(data["step"]),
                   samples_seen=int(data["samples_seen"]),
                   tokens_seen=int(data["tokens_seen"]), gns=dict(data.get("gns", {})),
                   extra=dict(data.get("extra", {})))


@dataclass(frozen=True)
class SwitchCost:
    """Seconds spent on one reconfiguration (slowest rank's view, after barriers)."""

    save_s: float
    """Writing the checkpoint."""
    build_s: float
    """Building the new trainer (mesh, parallelisation, optimizer)."""
    load_s: float
    """Reading and resharding the checkpoint into it."""
    checkpoint_bytes: int
    """Size of the checkpoint on disk."""

    @property
    def total_s(self) -> float:
        return self.save_s + self.build_s + self.load_s


def _check_supported(config: ParallelConfig) -> None:
    if config.sharding is Sharding.ZERO1 and config.dp_enabled:
        raise ConfigError("sharding", config.sharding.value,
                          "zero1 (ZeroRedundancyOptimizer) state cannot be resharded by "
                          "torch.distributed.checkpoint; use none, zero2 or zero3")


def _state_dicts(model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
                 ) -> dict[str, dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if len(model_parts) != len(optimizers):
        raise ConfigError("optimizers", len(optimizers),
                          f"must be one per model part ({len(model_parts)})")
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, optimizer in zip(model_parts, optimizers):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, optimizer, options=options))
    return {"model": model, "optimizer": optim}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _is_complete(path: Path) -> bool:
    return (path / RUN_STATE_FILE).is_file()


def find_checkpoint(path: str | Path) -> Path | None:
    """The complete checkpoint saved at ``path``, or ``None``.

    That is ``path`` itself, or, when a save was killed between moving the old checkpoint
    aside and renaming the new one into place, the old one (``<path>.previous``).

    A save running meanwhile in another process removes ``<path>.previous`` once its new
    checkpoint is in place, so what this returns is only safe to read while no save runs:
    ``paratune gns`` holds its output's lock (:func:`paratune.fileio.exclusive_lock`) across its
    saves and loads, so none of its own runs alongside another's.
    """
    path = Path(path)
    # ``path`` once more at the end: a save that commits between the first two checks moves
    # ``path`` aside (so it is absent), renames the new one into place and removes the old
    # one (so ``previous`` is absent) while a complete checkpoint existed all along.
    for candidate in (path, _sibling(path, _PREVIOUS), path):
        if _is_complete(candidate):
            return candidate
    return None


def _removable(path: Path) -> bool:
    """Whether ``path`` is absent or holds nothing but (parts of) a checkpoint."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    return all(entry.name in (RUN_STATE_FILE, MANIFEST_FILE) or entry.name.startswith(".")
               or entry.name.endswith(".distcp") for entry in path.iterdir())


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(path: Path) -> None:
    """``manifest.json`` of the checkpoint files in ``path`` (all but ``run_state.json``)."""
    files = {entry.name: {"sha256": _sha256(entry), "bytes": entry.stat().st_size}
             for entry in sorted(path.iterdir())
             if entry.name not in (RUN_STATE_FILE, MANIFEST_FILE) and entry.is_file()}
    atomic_write_text(path / MANIFEST_FILE, json.dumps(
        {"format_version": _FORMAT_VERSION, "algorithm": "sha256", "files": files}, indent=1))


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint's files against its manifest before anything unpickles them.

    Args:
        path: A complete checkpoint directory (see :func:`find_checkpoint`).

    Raises:
        ConfigError: (field ``checkpoint_dir``) the manifest is missing or unreadable, or a
            file is missing, added, not a regular file, or not the file saved (its size or
            SHA-256 differs); the checkpoint is not loaded.
    """
    import stat

    path = Path(path)
    refuse = ("it is not loaded (torch's checkpoint reader would unpickle its files, which "
              "can run code): resume only checkpoints this run saved, or start over without "
              "--resume")
    manifest_path = path / MANIFEST_FILE
    try:
        info = os.lstat(manifest_path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MANIFEST_MAX_BYTES:
            raise ConfigError("checkpoint_dir", str(path), f"{manifest_path} is not a regular "
                              f"file of at most {_MANIFEST_MAX_BYTES} bytes; {refuse}")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("not a sha256 manifest")
    except FileNotFoundError:
        raise ConfigError("checkpoint_dir", str(path), f"has no {MANIFEST_FILE} (the SHA-256 "
                          "of its files, written when paratune saves a checkpoint): it was "
                          f"saved elsewhere or by an earlier version; {refuse}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("checkpoint_dir", str(path), f"{manifest_path} is unreadable "
                          f"({exc}); {refuse}") from None
    present = {entry.name for entry in path.iterdir()} - {RUN_STATE_FILE, MANIFEST_FILE}
    extra = sorted(present - set(files))
    if extra:
        raise ConfigError("checkpoint_dir", str(path), f"holds {extra[0]}, which its manifest "
                          f"does not list (added after the save); {refuse}")
    for name, expected in sorted(files.items()):
        file = path / name
        if "/" in name or name in ("", ".", ".."):
            raise ConfigError("checkpoint_dir", str(path), f"its manifest names {name!r}, "
                              f"not a file of the checkpoint; {refuse}")
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            raise ConfigError("checkpoint_dir", str(path), f"{name} is missing (its manifest "
                              f"lists it); {refuse}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("checkpoint_dir", str(path), f"{name} is not a regular file; "
                              f"{refuse}")
        if (info.st_size != int(expected.get("bytes", -1))
                or _sha256(file) != expected.get("sha256")):
            raise ConfigError("checkpoint_dir", str(path), f"{name} is not the file saved "
                              f"(its SHA-256 differs from the manifest's); {refuse}")


def _commit(staging: Path, path: Path) -> None:
    """Rename the complete checkpoint ``staging`` to ``path``; a complete checkpoint exists
    at every instant (see :func:`find_checkpoint`)."""
    previous = _sibling(path, _PREVIOUS)
    if _is_complete(path):
        shutil.rmtree(previous, ignore_errors=True)  # older than path: not needed
        os.replace(path, previous)
    elif path.exists():
        shutil.rmtree(path)  # an incomplete leftover; a complete `previous` stays meanwhile
    os.replace(staging, path)
    fsync_dir(path.parent)
    shutil.rmtree(previous, ignore_errors=True)


def save_checkpoint(path: str | Path, trainer: Any, state: RunState) -> float:
    """Save ``trainer``'s model and optimizer state and ``state`` (collective over all ranks).

    The checkpoint is written to ``<path>.saving`` and renamed to ``path`` once complete, so
    a kill at any moment leaves the previous checkpoint (or the new one) loadable.

    Args:
        path: Checkpoint directory (a previous checkpoint there is replaced once the new one
            is complete).
        trainer: Has ``model_parts`` and ``optimizers`` (one optimizer per part).
        state: The run's non-tensor state.

    Returns:
        Seconds taken (after a closing barrier).

    Raises:
        ConfigError: the layout's optimizer state cannot be checkpointed (``zero1`` with
            ``dp > 1``), or ``path`` holds files that are not a checkpoint (checked on every
            rank before anything is written).
    """
    import torch.distributed.checkpoint as dcp

    _check_supported(state.config)
    path = Path(path)
    staging = _sibling(path, _SAVING)
    for target in (path, staging):
        if not _removable(target):
            raise ConfigError("checkpoint_dir", str(path), f"{target} holds files that are "
                              "not a checkpoint; choose an empty or checkpoint directory")
    start = time.perf_counter()
    _barrier()  # every rank has checked before rank 0 changes anything
    if _is_rank0():
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
        staging.mkdir(parents=True)
    _barrier()
    dcp.save(_state_dicts(trainer.model_parts, trainer.optimizers),
             checkpoint_id=str(staging))
    if _is_rank0():  # every rank's files are written once DCP's save returns on rank 0
        _write_manifest(staging)
        atomic_write_text(staging / RUN_STATE_FILE, json.dumps(state.to_dict(), indent=1))
        _commit(staging, path)
    _barrier()
    return time.perf_counter() - start


def load_checkpoint(path: str | Path, trainer: Any) -> RunState:
    """Load a checkpoint into ``trainer``, whatever layout it was saved under.

    Args:
        path: A directory written by :func:`save_checkpoint` (the complete checkpoint
            :func:`find_checkpoint` finds there is read).
        trainer: A freshly built trainer (any layout of the same model).

    Returns:
        The saved :class:`RunState` (its ``config`` is the layout it was saved under).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ConfigError: its files do not match its manifest (see :func:`verify_checkpoint`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint ({RUN_STATE_FILE} missing)")
    path = found
    verify_checkpoint(path)  # before DCP unpickles anything
    state_file = path / RUN_STATE_FILE
    run_state = RunState.from_dict(json.loads(state_file.read_text()))
    target = _state_dicts(trainer.model_parts, trainer.optimizers)
    dcp.load(target, checkpoint_id=str(path))
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    for part, optimizer in zip(trainer.model_parts, trainer.optimizers):
        set_model_state_dict(part, target["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, optimizer, target["optimizer"], options=options)
    _barrier()
    return run_state


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def reconfigure(trainer: Any, state: RunState, new_config: ParallelConfig, *,
                checkpoint_dir: str | Path,
                build_trainer: Callable[[ParallelConfig], Any]) -> tuple[Any, RunState, SwitchCost]:
    """Switch a run to ``new_config`` at the current step boundary.

    Args:
        trainer: The running trainer: its state is saved, then it is closed (its model,
            optimizer and schedule freed before the new trainer is built, so the two never
            hold memory together); do not use it afterwards.
        state: The run's state; its ``config`` is the current layout.
        new_config: The layout (and global batch size) to continue with.
        checkpoint_dir: Where the hand-over checkpoint is written.
        build_trainer: Builds a trainer for a config on the current processes.

    Returns:
        ``(new trainer, new state, cost)``; the new state has ``config=new_config`` and the
        same step, data position and noise-scale averages.
    """
    import torch.distributed as dist

    _check_supported(new_config)
    if dist.is_available() and dist.is_initialized():
        new_config.validate(world_size=dist.get_world_size())
    checkpoint_dir = Path(checkpoint_dir)
    save_s = save_checkpoint(checkpoint_dir, trainer, state)
    close = getattr(trainer, "close", None)
    if callable(close):
        close()
    del trainer
    start = time.perf_counter()
    new_trainer = build_trainer(new_config)
    _barrier()
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    loaded = load_checkpoint(checkpoint_dir, new_trainer)
    load_s = time.perf_counter() - start
    loaded.config = new_config
    cost = SwitchCost(save_s=save_s, build_s=build_s, load_s=load_s,
                      checkpoint_bytes=_dir_bytes(find_checkpoint(checkpoint_dir)
                                                  or checkpoint_dir))
    return new_trainer, loaded, cost
