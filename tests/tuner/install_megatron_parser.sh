#!/bin/sh
# Megatron-LM's argument parser (megatron.training.arguments), for the export tests
# (tests/tuner/test_export_frameworks.py); run after pip install -e '.[dev,frameworks]'.
#
# megatron-core ships megatron/training in its wheels from 0.17 on, and those declare
# Python >= 3.12. Its parser and model config import on Python 3.11 given typing.override,
# which the test takes from typing_extensions. So on 3.11 the wheel is unpacked into
# site-packages without its Python check; with no dependencies either on any Python:
# the parser needs only torch, numpy and packaging, which paratune installs, and the
# wheel's optional GPU stack (Transformer Engine, apex) is not wanted here.
set -eu
PYTHON=${PYTHON:-python}
VERSION=${MEGATRON_CORE_VERSION:-0.19.2}
if "$PYTHON" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
    site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" -m pip install --no-deps --ignore-requires-python --python-version 3.12 \
        --only-binary=:all: --upgrade --target "$site" "megatron-core==$VERSION"
else
    "$PYTHON" -m pip install --no-deps "megatron-core==$VERSION"
fi
