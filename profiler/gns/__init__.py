"""Gradient noise scale of a training run: the two-batch estimator of McCandlish et al. (2018).

The *simple noise scale* ``B_simple = tr(Sigma) / |G|^2`` compares the per-example gradient
covariance ``Sigma`` with the squared norm of the true gradient ``G``; batches much smaller
than it waste little compute per step, batches much larger waste compute on redundant
examples, which is why goodput needs it.

Two-batch estimator (McCandlish et al. 2018, appendix A.1): with ``|g_small|^2`` the squared
norm of a gradient averaged over ``B_small`` examples and ``|g_big|^2`` that over ``B_big``,
``E|g_B|^2 = |G|^2 + tr(Sigma) / B`` gives the unbiased estimates

* ``|G|^2    = (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)``
* ``tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)``.

Each is noisy step to step, so each is smoothed with a bias-corrected exponential moving
average before the ratio is taken (a ratio of averages, not an average of ratios).

In a data-parallel run the small batches are free: every data-parallel rank holds the
gradient of its own ``global_batch / dp`` sequences before the gradient all-reduce, and the
average over ranks afterwards is the big batch. :func:`sharded_sqnorm` computes a squared
norm over a model split by tensor and pipeline parallelism: tensor-parallel shards (DTensor
``Shard`` placements) are summed over their mesh group, replicated tensors are counted once,
and pipeline stages (which hold distinct layers) are summed over the ``pp`` group. Units are
sequences (the batch unit of :class:`~paratune.ParallelConfig`).

Preconditioning: by default the plain Euclidean norm is used (``precondition="none"``). With
``precondition="adam"`` each squared gradient entry is weighted by ``1 / (sqrt(v_hat) +
eps)`` from Adam's bias-corrected second moment, as Pollux (Qiao et al. 2021) does for
adaptive optimizers; before the optimizer's first step the weight is one.

Modules: :mod:`.estimator` (the two-batch estimator and its moving averages), :mod:`.norms`
(squared norms under 3D parallelism), :mod:`.meter` (measuring on a trainer),
:mod:`.trajectory` (the CSV a run writes), :mod:`.job` (a run's settings and resume checks),
:mod:`.run` (the run), :mod:`.layouts` (checks against one process). The processes are
started by :mod:`paratune.profiler.processes`.
"""

from __future__ import annotations

from paratune.profiler.gns.estimator import (
    GNSEstimate,
    GradientNoiseScale,
    estimate_dict,
    unbiased_norms,
)
from paratune.profiler.gns.job import GNSJob, resume_hint
from paratune.profiler.gns.layouts import measure_layouts, single_process_reference
from paratune.profiler.gns.meter import GNS_MODES, GNSStep, NoiseScaleMeter, resolve_mode
from paratune.profiler.gns.norms import (
    PRECONDITIONERS,
    adam_preconditioners,
    micro_batch_gradients,
    sharded_sqnorm,
)
from paratune.profiler.gns.run import run_gns
from paratune.profiler.gns.trajectory import TRAJECTORY_COLUMNS
from paratune.profiler.processes import WorkerError, init_worker, spawn

__all__ = [
    "GNS_MODES",
    "PRECONDITIONERS",
    "TRAJECTORY_COLUMNS",
    "GNSEstimate",
    "GNSJob",
    "GNSStep",
    "GradientNoiseScale",
    "NoiseScaleMeter",
    "WorkerError",
    "adam_preconditioners",
    "estimate_dict",
    "init_worker",
    "measure_layouts",
    "micro_batch_gradients",
    "resolve_mode",
    "resume_hint",
    "run_gns",
    "sharded_sqnorm",
    "single_process_reference",
    "spawn",
    "unbiased_norms",
]
