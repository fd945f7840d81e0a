from __future__ import annotations

import subprocess
import sys

from paratune.cli import main


def test_help_does_not_import_heavy_libraries():
    code = ("import sys; from paratune.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'xgboost', 'mlflow', 'optuna', 'pandas') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""


def test_help_lists_subcommands(capsys):
    assert main([]) == 2
    text = capsys.readouterr().out
    for command in ("profile", "datasets", "fit", "predict", "evaluate", "tune", "plan", "gns",
                    "quickstart"):
        assert command in text
