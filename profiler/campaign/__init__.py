"""Profiling campaigns: every valid config of a grid, for each world size, measured for real.

A campaign enumerates the configuration space (:class:`~paratune.space.ConfigSpace`) for
each world size, reports the invalid configs as skipped with the rule each breaks, and
profiles the valid ones with one launch of ``world_size`` worker processes per world size
(each config rebuilds mesh, model and optimizer inside those processes). The parent process
supervises the group: a config that hangs past its timeout, a rank that raises while the
others wait, or a rank that dies is recorded as that config's status (``timeout``, ``error``,
``oom``), the group is torn down and relaunched on the remaining configs. Every finished
config is appended to a journal with an fsync before the next one starts, so killing the
campaign (even with ``kill -9``) loses nothing measured, and ``resume=True`` redoes nothing
that finished. At the end the journals become a dataset (parquet + card) in the campaign
directory, and the campaign is one MLflow run.

Modules: :mod:`.spec` (what is profiled), :mod:`.plan` (the campaign directory and its
plans), :mod:`.supervise` (local worker groups under this process's supervision),
:mod:`.launch` (``torchrun`` and earlier launches' processes), :mod:`.results` (progress,
dataset, result), :mod:`.run` (the whole campaign).
"""

from __future__ import annotations

from paratune.datasets.materialise import CampaignProgress, campaign_progress, materialise
from paratune.profiler.campaign.plan import prepare_campaign
from paratune.profiler.campaign.results import CampaignResult, in_step_seconds
from paratune.profiler.campaign.run import LAUNCHERS, LaunchOptions, run_campaign, torchrun_commands
from paratune.profiler.campaign.spec import (
    EXPERIMENT,
    CampaignError,
    CampaignSpec,
    default_space,
    detect_device,
    detect_hardware,
    enumerate_campaign,
)

__all__ = ["EXPERIMENT", "LAUNCHERS", "CampaignError", "CampaignProgress", "CampaignResult",
           "CampaignSpec", "LaunchOptions",
           "campaign_progress", "default_space", "detect_device", "detect_hardware",
           "enumerate_campaign", "in_step_seconds", "materialise", "prepare_campaign",
           "run_campaign", "torchrun_commands"]
