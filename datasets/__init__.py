"""paratune.datasets: the measurement store (parquet + JSON card) and importers.

Names are resolved lazily so that importing the package (e.g. for the CLI) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it
_LAZY = {
    "CARD_METADATA_KEY": "paratune.datasets._store",
    "Dataset": "paratune.datasets._store",
    "DatasetCard": "paratune.datasets.schema",
    "SCHEMA_VERSION": "paratune.datasets.schema",
    "arrow_schema": "paratune.datasets.schema",
    "export_public_csv": "paratune.datasets._export",
    "read_dataset": "paratune.datasets._store",
    "read_datasets": "paratune.datasets._store",
    "records_to_frame": "paratune.datasets._rows",
    "summarise_dataset": "paratune.datasets._summary",
    "write_dataset": "paratune.datasets._store",
    "ImportReport": "paratune.datasets.importers",
    "import_files": "paratune.datasets.importers",
    "parse_public_csv": "paratune.datasets.importers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paratune.datasets' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
