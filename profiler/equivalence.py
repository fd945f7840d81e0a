"""Check that a parallel layout computes the single-process training step exactly.

One or more optimizer steps of the same model (same seed, same global batches) are run in
one process with plain PyTorch (the reference) and under each layout in a group of gloo
processes; every step's loss, the last step's gradients and the updated parameters, gathered
whole by name, are compared. Later steps also check the optimizer state each layout keeps
(sharded by ZeRO-1/2/3): Adam's first step moves every element by about ``lr * sign(g)``
whatever the state, its second does not.
"""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec

__all__ = ["EquivalenceResult", "Layout", "compare", "reference_optimizer",
           "reference_step", "reference_steps", "reference_update", "run_layouts"]

LR = 1e-3
WEIGHT_DECAY = 0.1


@dataclass
class EquivalenceResult:
    """How far one layout's step is from the single-process reference."""

    config: ParallelConfig
    error: str = ""
    """Traceback if the layout failed to run."""
    loss_rel_diff: float = float("nan")
    """Largest over steps of ``|loss - loss_ref| / |loss_ref|``."""
    grad_rel_diff: float = float("nan")
    """Largest over tensors of ``max|g - g_ref| / max|g_ref|`` (the last step's gradients)."""
    param_rel_diff: float = float("nan")
    """Largest over tensors of ``max|p - p_ref| / max|p_ref|`` after the last optimizer
    step."""
    worst_param: str = ""
    missing: list[str] = field(default_factory=list)
    """Reference parameter names the layout did not produce (or produced extra)."""

    @property
    def ok(self) -> bool:
        return not self.error and not self.missing


def reference_step(spec: ModelSpec, tokens: torch.Tensor, *, seed: int, dtype: torch.dtype
                   ) -> dict[str, Any]:
    """One AdamW step of the full model in this process, without torch.distributed.

    Returns:
        ``{"loss": float, "losses": [loss], "grads": {fqn: tensor}, "params": {fqn: tensor}}``.
    """
    return reference_steps(spec, [tokens], seed=seed, dtype=dtype)


def reference_steps(spec: ModelSpec, batches: list[torch.Tensor], *, seed: int,
                    dtype: torch.dtype) -> dict[str, Any]:
    """One AdamW step per batch of the full model in this process, without torch.distributed.

    Args:
        spec: The model.
        batches: One ``[batch, seq_len + 1]`` token tensor per step.
        seed: Initialisation seed.
        dtype: Default dtype while building and training.

    Returns:
        ``{"loss": float, "losses": [float per step], "grads": {fqn: tensor},
        "params": {fqn: tensor}}``: ``loss`` and ``grads`` are the last step's, ``params``
        the values after the last step.
    """
    from paratune.profiler.model import build_model

    if not batches:
        raise ValueError("batches must hold at least one batch (one per step)")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(spec, seed=seed)
        optimizer = reference_optimizer(model)
        losses = []
        for tokens in batches:
            loss, grads = reference_update(model, optimizer, tokens)
            losses.append(loss)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_default_dtype(previous)
    return {"loss": losses[-1], "losses": losses, "grads": grads, "params": params}


def reference_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of the single-process reference (AdamW, :data:`LR`,
    :data:`WEIGHT_DECAY`)."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                             betas=(0.9, 0.95), eps=1e-8, foreach=False)


def reference_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One full-batch step of the reference: the loss and every gradient (by parameter
    name), then the optimizer's update."""
    from paratune.profiler.pipeline import cross_entropy_loss

    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a.to(b.dtype) - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def compare(config: ParallelConfig, got: dict[str, Any], ref: dict[str, Any]
            ) -> EquivalenceResult:
    """Relative differences between a layout's step (``got``) and the reference."""
    result = EquivalenceResult(config=config)
    if "error" in got:
        result.error = got["error"]
        return result
    result.missing = sorted(set(ref["params"]) ^ set(got["params"]))
    got_losses = got.get("losses", [got["loss"]])
    ref_losses = ref.get("losses", [ref["loss"]])
    if len(got_losses) != len(ref_losses):
        result.error = (f"{len(got_losses)} step losses, the reference has "
                        f"{len(ref_losses)}")
        return result
    result.loss_rel_diff = max(abs(a - b) / abs(b) for a, b in zip(got_losses, ref_losses))
    grad_diffs = {n: _rel(got["grads"][n], g) for n, g in ref["grads"].items()
                  if n in got["grads"]}
    param_diffs = {n: _rel(got["params"][n], p) for n, p in ref["params"].items()
                   if n in got["params"]}
    result.grad_rel_diff = max(grad_diffs.values(), default=float("nan"))
    result.param_rel_diff = max(param_diffs.values(), default=float("nan"))
    result.worst_param = max(param_diffs, key=param_diffs.__getitem__, default="")
    missing_grads = sorted(set(ref["grads"]) - set(got["grads"]))
    result.missing += [f"grad:{n}" for n in missing_grads]
    return result


Layout = ParallelConfig | tuple[ModelSpec, ParallelConfig]
"""A layout of the default model, or a (model, layout) pair."""


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[ModelSpec, ParallelConfig]],
            seed: int, steps: int, dtype: torch.dtype, out_dir: str) -> None:
    import torch.distributed as dist

    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.processes import init_worker
    from paratune.profiler.trainer import Trainer, synthetic_batch

    init_worker(rank, world_size, port, "cpu")
    torch.set_num_threads(1)
    torch.set_default_dtype(dtype)
    with closing_process_group():
        for index, (spec, config) in enumerate(jobs):
            try:
                trainer = Trainer(spec, config, device=torch.device("cpu"), seed=seed, lr=LR,
                                  weight_decay=WEIGHT_DECAY)
                losses = []
                for step in range(steps):
                    tokens = synthetic_batch(spec, config.global_batch_size, step=step,
                                             seed=seed)
                    losses.append(trainer.forward_backward(tokens))
                    if step == steps - 1:
                        grads = trainer.gather_full(grads=True)
                    trainer.optimizer_step()
                params = trainer.gather_full()
                trainer.close()
                got: dict[str, Any] = {"loss": losses[-1], "losses": losses, "grads": grads,
                                       "params": params}
            except Exception:  # reported per layout; the other layouts still run
                got = {"error": traceback.format_exc()}
            if rank == 0 or "error" in got:
                torch.save(got, Path(out_dir) / f"{index}-{rank}.pt")
            dist.barrier()


def run_layouts(spec: ModelSpec, configs: list[Layout], *, world_size: int, seed: int = 0,
                steps: int = 1, dtype: torch.dtype = torch.float64
                ) -> list[EquivalenceResult]:
    """Run ``steps`` training steps of every layout in ONE group of ``world_size`` gloo
    processes, in sequence, and compare each with :func:`reference_steps`.

    Args:
        spec: The model (small: every tensor is gathered in one process).
        configs: Layouts with ``world_size`` devices each; an item may also be a
            ``(model, layout)`` pair to use another model for that layout.
        world_size: Processes to spawn.
        seed: Initialisation and data seed.
        steps: Optimizer steps per layout, step ``s`` on ``synthetic_batch(step=s)``.
        dtype: Default dtype in every process (float64 makes the comparison sharp).

    Returns:
        One :class:`EquivalenceResult` per config, in order.

    Raises:
        ValueError: ``steps < 1``.
        WorkerError: a process of the group died (a layout that raises is reported in its
            result instead).
    """
    from paratune.profiler.processes import spawn
    from paratune.profiler.trainer import synthetic_batch

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    jobs = [item if isinstance(item, tuple) else (spec, item) for item in configs]
    refs: dict[tuple[ModelSpec, int], dict[str, Any]] = {}
    for job_spec, config in jobs:
        config.validate(job_spec, world_size)
        key = (job_spec, config.global_batch_size)
        if key not in refs:
            batches = [synthetic_batch(job_spec, config.global_batch_size, step=step, seed=seed)
                       for step in range(steps)]
            refs[key] = reference_steps(job_spec, batches, seed=seed, dtype=dtype)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, world_size, jobs, seed, steps, dtype, out_dir)
        results = []
        for index, (job_spec, config) in enumerate(jobs):
            files = sorted(Path(out_dir).glob(f"{index}-*.pt"))
            got = [torch.load(f, weights_only=False) for f in files]
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                results.append(EquivalenceResult(config=config, error=errors[0]))
            elif not got:
                results.append(EquivalenceResult(config=config, error="no result written"))
            else:
                results.append(compare(config, got[0],
                                       refs[(job_spec, config.global_batch_size)]))
    return results
