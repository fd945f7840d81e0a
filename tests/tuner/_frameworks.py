"""The frameworks' own code for the export and plan tests: Megatron-LM's argument parser."""

from __future__ import annotations

import importlib
import typing
import warnings

import pytest

FRAMEWORKS = "pip install -e '.[dev,frameworks]'"

CUDA_MAJOR = {"H100-80GB": 9, "H200": 9, "A100-80GB": 8, "B200": 10}
"""CUDA major generation of each catalogued GPU: Megatron's ``validate_args`` asks CUDA for it,
and this machine has none."""


def megatron_arguments():
    """Megatron-LM's ``megatron.training.arguments``, or a skip saying why not.

    megatron-core (which ships ``megatron/training`` from 0.17 on) declares Python 3.12 and
    uses ``typing.override`` (3.12) in two modules; on Python 3.11 that one name is taken
    from typing_extensions before the import, and nothing else of Megatron is changed.
    """
    if not hasattr(typing, "override"):
        try:
            import typing_extensions
        except ImportError as exc:
            pytest.skip(f"typing_extensions is missing ({exc})")
        typing.override = typing_extensions.override
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("megatron.training.arguments")
    except ImportError as exc:
        pytest.skip(f"Megatron-LM's parser does not import ({exc}); {FRAMEWORKS} and "
                    f"tests/tuner/install_megatron_parser.sh install it")
