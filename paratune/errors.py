"""Exceptions raised by paratune.

Invalid user input raises :class:`ValueError` (or a subclass) naming the field, the value and
the rule, so callers that only know Python's built-ins still catch it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DatasetError", "ModelFormatError", "ParatuneError", "SchemaVersionError",
           "Terminated"]


class ParatuneError(Exception):
    """Base class of paratune's own errors."""


class ConfigError(ParatuneError, ValueError):
    """A model, parallel or hardware configuration breaks a rule.

    Args:
        field: The offending field.
        value: Its value.
        rule: The rule it breaks, in words.
    """

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={value!r}: {rule}")


class DatasetError(ParatuneError, ValueError):
    """A file or directory is not a readable paratune dataset."""


class SchemaVersionError(DatasetError):
    """A dataset or model was written by a newer (or incompatible) schema version."""


class ModelFormatError(ParatuneError, ValueError):
    """A saved performance model is missing, corrupt, or of an incompatible schema."""


class Terminated(SystemExit):
    """Raised in the main thread when the process receives SIGTERM (``kill``, SLURM
    ``scancel``, a job's time limit), so that ``finally`` blocks and context managers run:
    an MLflow run ends as ``KILLED``, workers are stopped. Exit code ``128 + SIGTERM``."""
