"""Pipeline parallelism: split the model into stages by layers and build the schedule.

Stages hold consecutive layers; the first also holds ``tok_embeddings``, the last ``norm``
and ``output``. With ``pp`` ranks and ``v`` virtual stages there are ``pp * v`` stages and
stage ``i`` lives on pipeline rank ``i % pp`` (the looped placement of interleaved 1F1B).
Each stage is a :class:`~paratune.profiler.model.Transformer` with the other parts removed,
so parameter names are the full model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Schedule, stage_layer_counts

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from paratune.profiler.model import Transformer

__all__ = ["build_schedule", "build_stages", "cross_entropy_loss", "layer_ranges",
           "split_model", "stage_ids"]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``logits`` ``[batch, seq, vocab]`` (computed in float32
    or wider) against ``targets`` ``[batch, seq]``."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive layer indices of each stage, as even as possible (earlier stages take
    the remainder).

    Raises:
        ConfigError: fewer layers than stages.
    """
    ranges, start = [], 0
    for size in stage_layer_counts(num_layers, num_stages):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids(config: ParallelConfig, pp_rank: int) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``: ``pp_rank, pp_rank + pp, ...``."""
    return [pp_rank + v * config.pp for v in range(config.virtual_stages)]


def split_model(model: Transformer, config: ParallelConfig, pp_rank: int) -> list[Transformer]:
    """This rank's stages of ``model`` (best on the meta device: each stage is a copy).

    Args:
        model: The full model.
        config: Gives ``pp`` and ``virtual_stages``.
        pp_rank: This process's rank on the ``pp`` mesh axis.

    Returns:
        One :class:`Transformer` per stage, in stage order.

    Raises:
        ConfigError: tied embeddings across a pipeline (the embedding and the output
            projection would live on different ranks).
    """
    num_stages = config.num_stages
    if model.spec.tie_embeddings and num_stages > 1:
        raise ConfigError("pp", config.pp, "pipeline parallelism needs untied embeddings "
                          "(tie_embeddings=True puts one matrix on the first and last stage)")
    ranges = layer_ranges(model.spec.num_layers, num_stages)
    stages = []
    for stage in stage_ids(config, pp_rank):
        chunk = copy.deepcopy(model)
        keep = {str(i) for i in ranges[stage]}
        for name in list(chunk.layers.keys()):
            if name not in keep:
                del chunk.layers[name]
        if stage != 0:
            chunk.tok_embeddings = None
        if stage != num_stages - 1:
            chunk.norm = None
            chunk.output = None
        stages.append(chunk)
    return stages


def build_stages(modules: list[nn.Module], config: ParallelConfig, pp_rank: int,
                 pp_group: torch.distributed.ProcessGroup, device: torch.device
                 ) -> list[PipelineStage]:
    """Wrap this rank's (parallelised) stage modules as ``PipelineStage`` objects."""
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(module, stage, config.num_stages, device, group=pp_group)
            for module, stage in zip(modules, stage_ids(config, pp_rank))]


def build_schedule(stages: list[PipelineStage], config: ParallelConfig, *,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   = cross_entropy_loss) -> _PipelineSchedule:
    """The schedule of ``config.schedule`` over this rank's stages.

    ``n_microbatches`` is ``config.num_microbatches``; gradients are divided by it
    (``scale_grads``), so with a mean ``loss_fn`` they equal those of the whole local batch.
    """
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n = config.num_microbatches
    if config.schedule is Schedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=True)
    if len(stages) != 1:
        raise ConfigError("virtual_stages", config.virtual_stages,
                          f"must be 1 with schedule={config.schedule.value}")
    cls = ScheduleGPipe if config.schedule is Schedule.GPIPE else Schedule1F1B
    return cls(stages[0], n, loss_fn=loss_fn, scale_grads=True)
