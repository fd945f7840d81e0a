"""paratune.tuner: search global batch size and parallelism jointly against a learned model.

``tune`` answers "this model on N devices: how should I run it?"; ``plan`` (over
``plan_phases``) turns a gradient-noise-scale trajectory into a schedule of training phases.
Both take a ``TuneJob`` and options requests (``SearchOptions``, ``PlanOptions``,
``OutputOptions``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LAYOUT_DISCOUNT",
    "LR_RULES",
    "NOISE_LAWS",
    "SAMPLERS",
    "ClusterVerification",
    "Objective",
    "ObjectiveKind",
    "OutputOptions",
    "Plan",
    "PlanOptions",
    "PlanOutcome",
    "ScheduleOptions",
    "SearchOptions",
    "SearchResult",
    "SearchSpace",
    "StudyNotRecorded",
    "Trajectory",
    "TuneJob",
    "TuneResult",
    "VerifyOptions",
    "config_times",
    "default_batch_range",
    "effective_b_noise",
    "evaluate",
    "examples_to_target",
    "exhaustive",
    "law_trajectory",
    "load_predictor",
    "load_trajectory",
    "lr_scale",
    "make_sampler",
    "megatron_args",
    "megatron_command",
    "megatron_env",
    "optuna_search",
    "parse_batch_sizes",
    "plan",
    "plan_launch",
    "plan_phases",
    "pollux_efficiency",
    "predict_configs",
    "progress_segments",
    "rank",
    "recommendation",
    "risk_aware_ranking",
    "smallest_busy_batch",
    "steps_to_target",
    "time_to_target",
    "torchrun_command",
    "torchtitan_args",
    "torchtitan_command",
    "torchtitan_config_module",
    "torchtitan_toml",
    "tune",
    "verification_order",
    "verify_list",
    "verify_on_cluster",
    "verify_top_k",
    "write_recommendation",
]

_WHERE = {
    "LAYOUT_DISCOUNT": "_verify_list",
    "config_times": "_plan",
    "predict_configs": "_plan",
    "progress_segments": "_plan_progress",
    "rank": "_ranking",
    "load_predictor": "_tune_inputs",
    "Objective": "_objective", "ObjectiveKind": "_objective",
    "Plan": "_plan", "ScheduleOptions": "_plan", "effective_b_noise": "_plan",
    "plan_phases": "_plan",
    "default_batch_range": "_plan", "smallest_busy_batch": "_plan",
    "plan_launch": "_plan_export",
    "NOISE_LAWS": "gns_trajectory", "law_trajectory": "gns_trajectory",
    "LR_RULES": "_efficiency", "lr_scale": "_efficiency",
    "SAMPLERS": "_search", "SearchResult": "_search", "evaluate": "_search",
    "exhaustive": "_search", "optuna_search": "_search", "StudyNotRecorded": "_search",
    "SearchSpace": "_space", "parse_batch_sizes": "_space",
    "Trajectory": "gns_trajectory", "load_trajectory": "gns_trajectory",
    "TuneResult": "_tune", "tune": "_tune",
    "TuneJob": "_requests", "SearchOptions": "_requests", "OutputOptions": "_requests",
    "PlanOptions": "_plan_job", "PlanOutcome": "_plan_job", "plan": "_plan_job",
    "make_sampler": "_samplers",
    "examples_to_target": "_efficiency", "pollux_efficiency": "_efficiency",
    "steps_to_target": "_efficiency", "time_to_target": "_efficiency",
    "megatron_args": "_export", "recommendation": "_export", "torchrun_command": "_export",
    "torchtitan_toml": "_export", "torchtitan_args": "_export", "torchtitan_command": "_export",
    "torchtitan_config_module": "_export", "megatron_command": "_export",
    "megatron_env": "_export", "write_recommendation": "_export",
    "verification_order": "_verify", "verify_list": "_verify", "verify_top_k": "_verify",
    "ClusterVerification": "_verify", "risk_aware_ranking": "_verify",
    "verify_on_cluster": "_verify", "VerifyOptions": "_verify",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f"paratune.tuner.{_WHERE[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'paratune.tuner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
