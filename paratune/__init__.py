"""paratune: measure, learn and tune global batch size and 3D parallelism for LLM training.

Core types live here; the packages ``paratune.profiler``, ``paratune.datasets``,
``paratune.models`` and ``paratune.tuner`` build on them.
"""

from __future__ import annotations

from paratune.errors import ConfigError, DatasetError, ModelFormatError, ParatuneError
from paratune.hardware import HARDWARE, HardwareSpec, get_hardware
from paratune.measurement import Measurement, Status
from paratune.parallel import MeshAxis, ParallelConfig, Recompute, Schedule, Sharding
from paratune.spec import MODEL_PRESETS, ModelSpec, get_model

__version__ = "0.1.0"

__all__ = [
    "HARDWARE",
    "MODEL_PRESETS",
    "ConfigError",
    "DatasetError",
    "HardwareSpec",
    "Measurement",
    "MeshAxis",
    "ModelFormatError",
    "ModelSpec",
    "ParallelConfig",
    "ParatuneError",
    "Recompute",
    "Schedule",
    "Sharding",
    "Status",
    "__version__",
    "get_hardware",
    "get_model",
]
