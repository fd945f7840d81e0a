"""Verification on the target cluster: a one-config campaign per chosen config with its
``torchrun`` command and SLURM batch script, read back and refitted on by a later call."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text
from paratune.parallel import ParallelConfig
from paratune.tuner._verify_list import check_num_configs, verify_positions
from paratune.tuner._verify_refit import VerifyOptions, VerifyRuns, refit_and_compare

if TYPE_CHECKING:
    import pandas as pd

    from paratune.tuner._space import SearchSpace
    from paratune.tuner._tune import TuneResult

__all__ = ["ClusterVerification", "verify_on_cluster"]

# the verification's modules log under one name, the one users and their filters know
logger = logging.getLogger("paratune.tuner._verify")


@dataclass
class ClusterVerification:
    """The verification of a tuning result on its target cluster (see
    :func:`verify_on_cluster`)."""

    configs: list[ParallelConfig]
    """The configs to verify, in verification order."""
    directories: list[Path]
    """Each config's campaign directory (on a filesystem every node sees)."""
    torchrun: list[str]
    """Each config's torchrun command (run on every node; ``MASTER_ADDR`` the first)."""
    sbatch: list[Path]
    """Each config's SLURM batch script (``sbatch`` it; one ``srun`` of torchrun per node)."""
    finished: list[bool]
    """Whether each config's run is already measured (journaled)."""
    verification: pd.DataFrame | None = None
    """Predicted vs measured and the refit's prediction, once every config is measured."""
    refit_dir: Path | None = None
    """Where the model refitted on the verified runs was saved."""

    @property
    def pending(self) -> list[int]:
        return [i for i, done in enumerate(self.finished) if not done]

    def instructions(self, rerun: str = "the same tune command") -> str:
        """What to run on the cluster and how the results come back, as text."""
        lines = []
        for i in self.pending:
            cfg = self.configs[i]
            lines += [f"{cfg.key()} ({cfg.world_size} devices):",
                      f"  sbatch {self.sbatch[i]}",
                      f"  or on every node: {self.torchrun[i]}"]
        lines.append(f"then run {rerun} again (with --dataset, the data the predictor was "
                     "fitted on): it reads the verified runs, refits the model on them and "
                     "reports predicted vs measured; `paratune fit DATA "
                     + " ".join(str(d) for d in self.directories)
                     + "` fits on them too once they are read")
        return "\n".join(lines)


def _sbatch_script(command: str, *, nodes: int, per_node: int, name: str, gpus: bool) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    return "\n".join([*lines, "set -e", command, ""])


def verify_on_cluster(result: TuneResult, k: int, options: VerifyOptions | None = None,
                      **overrides: Any) -> ClusterVerification:
    """Prepare the verification of ``result`` on its target cluster, or read it back.

    The ``k`` configs are the first of :func:`verification_order` that paratune's trainer
    runs (:func:`trainer_runnable`), each a one-config profiling campaign in
    ``out_dir/<config key>`` with its torchrun command and a SLURM batch script
    (``verify.sbatch`` inside it). The configs chosen are kept in ``out_dir/verify.json``,
    so a later call verifies exactly those. Once every campaign is measured, a later call
    reads them (writing each as a dataset), refits on ``dataset`` plus them and reports
    predicted vs measured as :func:`verify_top_k` does.

    Args:
        result: A tuning result (its hardware need not be this machine's).
        k: Configs to verify.
        options: As for :func:`~paratune.tuner.verify_top_k`; ``out_dir`` (default:
            ``verify/`` beside the recommendation) on a filesystem the cluster's nodes see.
        **overrides: Fields of :class:`VerifyOptions` (or of :class:`VerifyRuns`) by name.

    Raises:
        ConfigError: ``k`` is not positive, no ranked config can run in paratune's trainer,
            or ``out_dir`` is unset and the result wrote no files.
    """
    options = VerifyOptions.build(options, **overrides)
    out_dir, refit_dir = options.out_dir, options.refit_dir
    check_num_configs(k)
    space = result.search.space
    if out_dir is None and not result.outputs:
        raise ConfigError("verify", k, "verifying on the cluster needs an output directory "
                          "(the campaigns and their commands go there)")
    base = Path(out_dir) if out_dir is not None else result.outputs["json"].parent / "verify"
    base.mkdir(parents=True, exist_ok=True)
    configs = _chosen_configs(result, k, base / "verify.json")
    runs = options.runs
    plan = ClusterVerification(configs=configs, directories=[], torchrun=[], sbatch=[],
                               finished=[])
    for cfg in configs:
        _prepare_campaign(plan, space, cfg, base, runs)
    if plan.pending:
        logger.info("%d of %d verification runs not measured yet", len(plan.pending),
                    len(configs))
        return plan
    _read_back(plan, result, dataset=options.dataset,
               refit_dir=Path(refit_dir) if refit_dir is not None else base / "refit",
               model_factory=options.model_factory)
    return plan


def _chosen_configs(result: TuneResult, k: int, listing: Path) -> list[ParallelConfig]:
    """The ``k`` configs to verify: those ``listing`` names where an earlier call chose them
    for the same job (model with its sequence length, devices, hardware) among the configs
    this search ranked, else the first of the verification order (kept in ``listing``)."""
    space = result.search.space
    identity = {"model": space.model.to_dict(), "world_size": space.world_size,
                "hardware": space.hardware.name, "devices_per_node": space.devices_per_node}
    stored = json.loads(listing.read_text()) if listing.exists() else None
    ranked_configs = result.search.configs()
    if stored and stored.get("identity") == identity and len(stored["configs"]) >= k:
        named = [ParallelConfig.from_dict(c) for c in stored["configs"][:k]]
        # a later call verifies exactly the configs the first one named, where this search
        # ranked them too (not after another batch or space was asked for)
        if all(config in ranked_configs for config in named):
            return named
    picked = verify_positions(result.search.ranked, ranked_configs, space.model, k)
    configs = [ranked_configs[i] for i in picked]
    atomic_write_text(listing, json.dumps({"identity": identity, "configs": [
        c.to_dict() for c in configs]}, indent=2) + "\n")
    return configs


def _prepare_campaign(plan: ClusterVerification, space: SearchSpace, cfg: ParallelConfig,
                      base: Path, runs: VerifyRuns) -> None:
    """Write ``cfg``'s campaign directory and batch script; add them, its torchrun command
    and whether it is measured already to ``plan``."""
    from paratune.profiler.campaign import campaign_progress, torchrun_commands
    from paratune.tuner._export_torchrun import launch_shape

    gpu = space.hardware.name.lower() != "cpu"
    spec = runs.campaign(space, cfg, device="cuda" if gpu else "cpu")
    nodes, per_node = launch_shape(space.world_size, space.devices_per_node)
    target = (base / runs.directory_name(space, cfg)).resolve()
    (command,) = torchrun_commands(spec, target, nproc_per_node=per_node)
    (srun,) = torchrun_commands(spec, target, nproc_per_node=per_node, slurm=True)
    script = target / "verify.sbatch"
    atomic_write_text(script, _sbatch_script(srun, nodes=nodes, per_node=per_node,
                                             name=f"paratune-verify-{cfg.key()}", gpus=gpu))
    progress = campaign_progress(target)
    plan.directories.append(target)
    plan.torchrun.append(command)
    plan.sbatch.append(script)
    plan.finished.append(progress is not None and progress.finished and progress.num_rows > 0)


def _read_back(plan: ClusterVerification, result: TuneResult, *,
               dataset: str | Path | Sequence[str | Path] | None, refit_dir: Path,
               model_factory: Any) -> None:
    """Read every measured campaign of ``plan``, refit and set its ``verification``."""
    from paratune.profiler.campaign import materialise

    frames = [materialise(d).frame for d in plan.directories]
    ranked = result.search.ranked
    position = {c.key(): i for i, c in reversed(list(enumerate(result.search.configs())))}
    predicted = [float(ranked["tokens_per_s"].iloc[position[c.key()]])
                 if c.key() in position else math.nan for c in plan.configs]
    plan.refit_dir = refit_dir
    plan.verification = refit_and_compare(result, plan.configs, frames, predicted,
                                          dataset=dataset, refit_path=refit_dir,
                                          model_factory=model_factory)
