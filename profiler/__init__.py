"""paratune.profiler: the measured workload, its 3D parallelism, and profiling campaigns.

Heavy modules (torch) load on first use of a name: ``from paratune.profiler import Trainer``.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule that defines it; only add lines.
_EXPORTS: dict[str, str] = {
    "physical_memory_bytes": "_memory",
    "Transformer": "model",
    "build_model": "model",
    "build_mesh": "mesh",
    "apply_tp": "parallelize",
    "apply_fsdp": "parallelize",
    "apply_ddp": "parallelize",
    "apply_activation_checkpointing": "parallelize",
    "parallelize": "parallelize",
    "split_model": "pipeline",
    "build_schedule": "pipeline",
    "Trainer": "trainer",
    "measure_config": "measure",
    "MeasureOptions": "measure",
    "synthetic_batch": "trainer",
    "check_supported": "trainer",
    "fingerprint": "fingerprint",
    "CampaignError": "campaign",
    "CampaignResult": "campaign",
    "CampaignSpec": "campaign",
    "default_space": "campaign",
    "enumerate_campaign": "campaign",
    "materialise": "campaign",
    "run_campaign": "campaign",
    "LaunchOptions": "campaign",
    "torchrun_commands": "campaign",
    "TextCorpus": "corpus",
    "GradientNoiseScale": "gns",
    "NoiseScaleMeter": "gns",
    "GNSJob": "gns",
    "run_gns": "gns",
    "sharded_sqnorm": "gns",
    "unbiased_norms": "gns",
    "RunState": "reconfigure",
    "SwitchCost": "reconfigure",
    "reconfigure": "reconfigure",
    "save_checkpoint": "reconfigure",
    "load_checkpoint": "reconfigure",
    "find_checkpoint": "reconfigure",
    "check_cpu_memory": "_memory",
    "cpu_process_memory_gb": "_memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
