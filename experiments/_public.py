"""Shared helpers of the experiments: where the public measurements are, and loading them."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def public_data_dir(arg: str | None = None) -> Path:
    """``--data``, else ``PARATUNE_PUBLIC_DATA``, else ``../shared/data/public-gpu``."""
    path = Path(arg or os.environ.get("PARATUNE_PUBLIC_DATA",
                                      REPO.parent / "shared/data/public-gpu"))
    if not (path / "ultrascale_playbook_h100.csv").exists():
        raise SystemExit(f"public GPU measurements not found at {path} (set --data or "
                         "PARATUNE_PUBLIC_DATA)")
    return path


def ultrascale_frame(data: Path):
    """Ultra-Scale Playbook H100 measurements, successful and failed, as measurement rows."""
    from paratune.models import load_measurements

    return load_measurements([data / "ultrascale_playbook_h100.csv",
                              data / "ultrascale_playbook_h100_failed.csv"])
