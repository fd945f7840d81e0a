"""One call on one CUDA GPU: the GPU tests, then a world-size-1 campaign across batch sizes.

On a machine with one GPU, from the repository root, in at most ``--budget-s`` (480 s) of
wall clock, set-up included:

1. runs the tests marked ``gpu`` (NCCL, bf16 autocast, CUDA synchronise, allocator peaks,
   MFU), with pytest in a child process;
2. profiles a real campaign at world size 1 of ``llama3.2-1b`` (1.24B parameters, tied
   embeddings) at sequence length 2048 in bf16: micro-batches 1, 2, 4, 8 and 16, global
   batches 8, 16, 32 and 64 sequences, recompute ``none``, ``selective`` and ``full`` (25
   configs, planned at about 340 s), with the profiler's warm-up and measured steps
   (``--warmup``, ``--steps``); a config that runs out of memory is recorded as ``oom``, as
   the campaign records any failure;
3. writes into ``--out`` (at most 8 files)::

       dataset/card.json, dataset/measurements-*.parquet   the measurements (the card names
                                                           GPU, driver, CUDA and torch)
       summary.csv   one row per config: measured step time, tokens/s, MFU and peak memory
                     beside the analytical step time, MFU and memory estimate, and ratios
       summary.md    the same as a Markdown table, with the machine and the test result
       gpu_tests.txt pytest's output
       log.txt       this script's log (with the workers' output where a group failed)

The grid is run in four parts, most valuable first (recompute none at micro-batches 1, 4
and 16; selective; full; then micro-batches 2 and 8), each planned against the time left
from the analytical step time at an assumed MFU (:data:`ASSUMED_MFU`) and the measured
pace of the parts before it: a part that does not fit is trimmed (its largest batches
first) or left out, and once the deadline passes the campaign stops after the config in
flight, keeping every config already measured. The outputs are rewritten after each part,
so a run cut short by its caller still leaves what was measured. Configs left out are
listed in ``summary.md``.

It runs "as it is" where paratune is not installed and xgboost, optuna and mlflow are not
there (the GPU machine has Python, torch, pandas, pyarrow, pyyaml and tqdm, and no package
registry): the packages are staged from the checkout in a temporary folder as
``pyproject.toml``'s ``package-dir`` maps them (``paratune.profiler`` is ``profiler/``,
...), and put first on ``PYTHONPATH`` for this process, the campaign's workers and pytest;
nothing here imports xgboost, optuna or mlflow, nor tracks to MLflow (import the dataset
elsewhere: ``paratune fit OUT/dataset ...``). Without an importable pytest, wheels in the
git-ignored ``.whl/`` folder are installed into a temporary folder first (pytest is pure
Python); fetch them on a machine with a registry, from the repository root::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl \\
        pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0

and send ``.whl`` with the call. Without pytest at all, the tests are reported as not run
and the campaign still runs.

    python3 experiments/gpu_check.py --out OUT                  # on the GPU machine
    python experiments/gpu_check.py --device cpu --tiny --out OUT  # CPU smoke (CI, < 60 s)

``--tiny`` profiles the ``tiny`` model on a small grid instead (the same parts, the same
files). Exit status 0 when the tests passed (or skipped for want of CUDA) and at least one
config was measured ``ok``; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

ASSUMED_MFU = {"cuda": 0.30}
"""MFU assumed when planning the first part on a GPU (later parts use the measured pace)."""
BUILD_S = {"cuda": 4.0, "cpu": 0.6}
"""Seconds per config outside the steps (build, teardown), when planning."""
LAUNCH_S = {"cuda": 15.0, "cpu": 4.0}
"""Seconds to start a worker group (interpreter, torch, process group), when planning."""
CPU_STEP_S = 0.1
"""Seconds per step of the tiny model at 8 sequences of 64 tokens on a CPU, when planning
(the CPU has no peak FLOP/s to plan with)."""
RESERVE_S = {"cuda": 25.0, "cpu": 6.0}
"""Seconds kept back at the end for writing the outputs."""
HEAVY = ("xgboost", "optuna", "mlflow")
"""Packages the GPU machine lacks; none may be imported here."""


# ---------------------------------------------------------------------- the grid
@dataclass
class Part:
    """One worker-group launch: a recompute mode over micro-batch and global batch sizes."""

    name: str
    recompute: str
    micro_batch_sizes: tuple[int, ...]
    global_batch_sizes: tuple[int, ...]
    dropped: list[str] = field(default_factory=list)
    """Configs planned but left out, with the reason."""

    def configs(self) -> list[tuple[int, int]]:
        """``(micro, global)`` pairs that are valid at world size 1."""
        return [(m, g) for m in self.micro_batch_sizes for g in self.global_batch_sizes
                if g % m == 0]


def default_parts(tiny: bool) -> list[Part]:
    """The grid, most valuable part first."""
    if tiny:
        return [Part("none-core", "none", (1, 2), (2, 4, 8, 16)),
                Part("selective", "selective", (2,), (16,)),
                Part("full", "full", (2,), (16,)),
                Part("none-fill", "none", (4,), (4, 16))]
    return [Part("none-core", "none", (1, 4, 16), (8, 16, 32, 64)),
            Part("selective", "selective", (1, 4, 16), (8, 32)),
            Part("full", "full", (1, 4, 16), (8, 32)),
            Part("none-fill", "none", (2, 8), (16, 64))]


def estimate_part_s(part: Part, step_s: Any, *, device: str, steps: int,
                    pace: float = 1.0) -> float:
    """Planned seconds for ``part``: a launch, and per config its build and ``steps`` steps.

    Args:
        part: The part.
        step_s: ``(recompute, micro, global) -> seconds`` of one step.
        device: ``cuda`` or ``cpu``.
        steps: Warm-up plus measured steps per config.
        pace: Measured over planned seconds of the parts run so far.
    """
    configs = part.configs()
    if not configs:
        return 0.0
    work = sum(BUILD_S[device] + steps * step_s(part.recompute, m, g) for m, g in configs)
    return LAUNCH_S[device] + pace * work


def fit_part(part: Part, seconds_left: float, step_s: Any, *, device: str, steps: int,
             pace: float = 1.0) -> Part:
    """``part`` trimmed to fit ``seconds_left``: its largest global batch first (keeping
    two), then its largest micro-batch; an empty part when even one config does not fit.
    What is left out is listed in ``dropped``."""
    current = replace(part, dropped=list(part.dropped))

    def cost(p: Part) -> float:
        return estimate_part_s(p, step_s, device=device, steps=steps, pace=pace)

    while current.configs() and cost(current) > seconds_left:
        if len(current.global_batch_sizes) > 2:
            current.global_batch_sizes = current.global_batch_sizes[:-1]
        elif len(current.micro_batch_sizes) > 1:
            current.micro_batch_sizes = current.micro_batch_sizes[:-1]
        elif len(current.global_batch_sizes) > 1:
            current.global_batch_sizes = current.global_batch_sizes[:-1]
        else:
            current.micro_batch_sizes = ()
    kept = set(current.configs())
    current.dropped += [f"{part.recompute} mb{m} gb{g}: left out, it would not finish in "
                        f"the {seconds_left:.0f} s left" for m, g in part.configs()
                        if (m, g) not in kept]
    return current


# ---------------------------------------------------------------------- staging
def stage_packages(root: Path, target: Path) -> Path:
    """Copy the checkout's packages to ``target`` in their installed layout (pyproject's
    ``package-dir``), with ``tests/`` and ``pyproject.toml`` beside them for pytest.

    Returns:
        ``target``, to put first on ``sys.path`` and ``PYTHONPATH``.
    """
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = config.get("package-dir", {})
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # parents before children, so that a child lands inside its copied parent
    for package in sorted(config["packages"], key=lambda p: p.count(".")):
        source = _package_source(root, package, package_dir)
        dest = target.joinpath(*package.split("."))
        shutil.copytree(source, dest, ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(root / "tests", target / "tests", ignore=ignore)
    shutil.copy2(root / "pyproject.toml", target / "pyproject.toml")
    return target


def _package_source(root: Path, package: str, package_dir: dict[str, str]) -> Path:
    """Where ``package`` lives in the checkout: as setuptools resolves it, under the longest
    prefix ``package-dir`` maps (``paratune.profiler.gns`` is ``profiler/gns``)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return root / package_dir[prefix] / Path(*parts[n:])
    return root.joinpath(*parts)


def pytest_path(root: Path, work: Path, log: Any) -> str | None:
    """A ``PYTHONPATH`` entry that provides pytest (``""`` when it is importable already);
    ``None`` when there is none."""
    probe = subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True)
    if probe.returncode == 0:
        return ""
    wheels = sorted((root / ".whl").glob("*.whl"))
    if not wheels:
        log("pytest is not importable and .whl/ holds no wheels: the GPU tests are not run")
        return None
    site = work / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--target", str(site),
                           *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"installing .whl/ failed: {proc.stderr.strip()[-500:]}")
        return None
    log(f"pytest from .whl/ ({', '.join(w.name for w in wheels)})")
    return str(site)


# ---------------------------------------------------------------------- machine
def driver_version() -> str:
    """The NVIDIA driver's version ('' when unknown)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        return text.split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return ""


def machine(device: str) -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda or "", "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), driver=driver_version(),
                    gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    multiprocessors=props.multi_processor_count,
                    nccl=_nccl_version(),
                    cudnn=str(torch.backends.cudnn.version()))
    else:
        from paratune.profiler.fingerprint import cpu_model

        info.update(cpu=cpu_model(), cores=os.cpu_count())
    return info


def _nccl_version() -> str:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return ""
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


# ---------------------------------------------------------------------- tests
def run_gpu_tests(stage: Path, extra_path: str | None, out: Path, timeout_s: float,
                  log: Any) -> dict[str, Any]:
    """Run the ``gpu``-marked tests of the files that have them; pytest's output goes to
    ``gpu_tests.txt``."""
    files = sorted(str(p.relative_to(stage)) for p in (stage / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    result: dict[str, Any] = {"files": files, "returncode": None, "line": "not run"}
    if extra_path is None:
        (out / "gpu_tests.txt").write_text("not run: pytest is not available\n")
        return result
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(stage), extra_path, os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-p",
               "no:cacheprovider", *files]
    log(f"gpu tests: {' '.join(command[1:])}")
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=stage, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else (p or "")
                 for p in (exc.stdout, exc.stderr)]
        text = "".join(parts) + f"\ntimed out after {timeout_s:.0f} s\n"
        code = -1
    (out / "gpu_tests.txt").write_text(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    result.update(returncode=code, line=lines[-1] if lines else "",
                  seconds=round(time.monotonic() - started, 1))
    if code == 5:
        result["line"] += " (no tests collected: a failure, not a pass)"
    log(f"gpu tests: exit {code}: {result['line']}")
    return result


# ---------------------------------------------------------------------- campaign
class OutOfTime(Exception):
    """The deadline passed: the campaign stops after the config in flight."""


def _children() -> list[int]:
    """Processes whose parent is this process (the campaign's worker group)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _stop_children() -> None:
    """Kill the campaign's workers (each leads its own session) and reap them."""
    for pid in _children():
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in _children():
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)


def run_part(part: Part, model: Any, *, args: argparse.Namespace, hardware: str,
             work: Path, deadline: float, next_config_s: float, log: Any
             ) -> tuple[Path | None, bool]:
    """Profile one part as a campaign of its own.

    Returns:
        Its directory (``None`` when no config finished), and whether the campaign failed
        (its worker group could not run: the parts after it are not tried).
    """
    from paratune.profiler.campaign import CampaignSpec, LaunchOptions, materialise, run_campaign
    from paratune.space import ConfigSpace

    if not part.configs():
        return None, False
    spec = CampaignSpec(model=model, world_sizes=(1,), device=args.device, hardware=hardware,
                        warmup_steps=args.warmup, measured_steps=args.steps,
                        timeout_s=args.config_timeout_s, seed=0,
                        space=ConfigSpace(micro_batch_sizes=part.micro_batch_sizes,
                                          global_batch_sizes=part.global_batch_sizes,
                                          shardings=["none"], recomputes=[part.recompute]))
    directory = work / f"campaign-{part.name}"

    def on_record(key: str) -> None:
        if time.monotonic() + next_config_s > deadline:
            _stop_children()
            raise OutOfTime(key)

    failed = False
    try:
        run_campaign(spec, directory, track=False, progress=False, on_record=on_record,
                     launch=LaunchOptions(startup_timeout_s=args.config_timeout_s))
        return directory, False
    except OutOfTime:
        log(f"  {part.name}: the deadline is near: stopped, keeping the configs measured")
    except Exception as exc:  # e.g. a group that never starts: its output is in the message
        _stop_children()
        failed = True
        log(f"  {part.name}: the campaign failed: {type(exc).__name__}: {exc}")
    try:  # what was journaled before it stopped
        materialise(directory)
    except Exception as exc:
        log(f"  {part.name}: no dataset ({exc})")
        return None, failed
    return directory, failed


# ---------------------------------------------------------------------- results
def merge(directories: list[Path], out: Path, notes: dict[str, Any]) -> Any:
    """One dataset in ``out/dataset`` from the parts' datasets, its card naming the machine."""
    import pandas as pd

    from paratune.datasets import DatasetCard, read_dataset, write_dataset
    from paratune.datasets.schema import CARD_FILE

    datasets = [read_dataset(d) for d in directories]
    frame = pd.concat([d.frame for d in datasets], ignore_index=True)
    first = datasets[0].card
    card = DatasetCard(
        campaign_id="gpu-check-" + "+".join(d.card.campaign_id for d in datasets),
        source="paratune", fingerprint=first.fingerprint,
        grid={"model": first.grid.get("model"), "model_spec": first.grid.get("model_spec"),
              "parts": [d.card.grid.get("grid") for d in datasets],
              "warmup_steps": first.grid.get("warmup_steps"),
              "measured_steps": first.grid.get("measured_steps"), "world_sizes": [1]},
        notes=notes)
    target = out / "dataset"
    if target.exists():
        shutil.rmtree(target)
    dataset = write_dataset(target, frame, card=card)
    for path in target.iterdir():  # the writers' lock: no other writer, and a file less
        if path.name not in (dataset.card.data_file, CARD_FILE):
            path.unlink()
    return dataset


def predictions(frame: Any, model: Any, hardware: str) -> Any:
    """Per row: the analytical step time, MFU and memory estimate beside the measurement."""
    import numpy as np

    from paratune import ParallelConfig
    from paratune.models import features as F
    from paratune.predictor import config_frame

    configs = [ParallelConfig(micro_batch_size=int(r.micro_batch_size),
                              global_batch_size=int(r.global_batch_size),
                              recompute=str(r.recompute)) for r in frame.itertuples()]
    cf = config_frame(model, configs, hardware)
    times = F.analytical_step_time(cf)["step_time_s"]
    memory = F.analytical_memory_gb(cf)
    at_peak = F.step_time_at_mfu(cf, 1.0)  # model FLOPs at the device's peak
    measured_memory = np.where(np.isfinite(frame["peak_mem_allocated_gb"].to_numpy(float)),
                               frame["peak_mem_allocated_gb"].to_numpy(float),
                               frame["peak_rss_gb"].to_numpy(float))
    step = frame["step_time_s"].to_numpy(float)
    times_list = frame["step_times_s"].tolist()
    spread = [max(t) / min(t) if len(t) else math.nan for t in times_list]
    out = frame[["recompute", "micro_batch_size", "global_batch_size", "status"]].copy()
    out["step_time_s"] = step
    out["step_spread"] = spread
    out["tokens_per_s"] = frame["tokens_per_s"].to_numpy(float)
    out["mfu"] = frame["mfu"].to_numpy(float)
    out["analytical_step_time_s"] = times
    out["analytical_mfu"] = at_peak / times
    out["step_time_ratio"] = step / times
    out["peak_mem_allocated_gb"] = frame["peak_mem_allocated_gb"].to_numpy(float)
    out["peak_mem_reserved_gb"] = frame["peak_mem_reserved_gb"].to_numpy(float)
    out["peak_rss_gb"] = frame["peak_rss_gb"].to_numpy(float)
    out["memory_estimate_gb"] = memory
    out["memory_ratio"] = measured_memory / memory
    out["error"] = frame["error"].astype(str).str.slice(0, 200)
    return out.sort_values(["recompute", "micro_batch_size", "global_batch_size"],
                           kind="stable").reset_index(drop=True)


def _params(model: Any) -> str:
    n = model.num_params
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _md(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def markdown(summary: Any, info: dict[str, Any], tests: dict[str, Any],
             dropped: list[str], timings: dict[str, float], model: Any) -> str:
    """The summary table in Markdown, with the machine, the tests and what was left out."""
    import numpy as np

    ok = summary[summary["status"] == "ok"]
    lines = [f"# GPU check: {model.name} ({_params(model)} parameters), "
             f"seq {model.seq_len}, world size 1", ""]
    lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    lines.append(f"gpu tests ({', '.join(tests['files'])}): {tests['line']}")
    lines.append("wall clock: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    if len(ok):
        ratio = ok["step_time_ratio"].to_numpy(float)
        mem = ok["memory_ratio"].to_numpy(float)
        lines.append(
            f"measured / analytical step time: median {np.nanmedian(ratio):.3g} "
            f"(range {np.nanmin(ratio):.3g} to {np.nanmax(ratio):.3g}); "
            f"measured / estimated peak memory: median {np.nanmedian(mem):.3g} "
            f"(range {np.nanmin(mem):.3g} to {np.nanmax(mem):.3g})"
            if np.isfinite(ratio).any() else
            f"measured / estimated peak memory: median {np.nanmedian(mem):.3g}")
    counts = summary["status"].value_counts().to_dict()
    lines.append("configs: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    lines.append("")
    columns = [("recompute", "recompute"), ("micro_batch_size", "mb"),
               ("global_batch_size", "gb"), ("status", "status"),
               ("step_time_s", "step s"), ("analytical_step_time_s", "analytical s"),
               ("step_time_ratio", "ratio"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
               ("analytical_mfu", "analytical MFU"),
               ("peak_mem_allocated_gb", "peak alloc GB"),
               ("peak_mem_reserved_gb", "peak reserved GB"), ("peak_rss_gb", "peak RSS GB"),
               ("memory_estimate_gb", "estimate GB"), ("memory_ratio", "mem ratio")]
    columns = [(k, h) for k, h in columns if summary[k].notna().any()]
    lines.append("| " + " | ".join(h for _, h in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in summary.itertuples():
        lines.append("| " + " | ".join(_md(getattr(row, k)) for k, _ in columns) + " |")
    failed = summary[summary["status"] != "ok"]
    for row in failed.itertuples():
        lines.append(f"\n{row.recompute} mb{row.micro_batch_size} gb{row.global_batch_size}: "
                     f"{row.status}: {row.error}")
    if dropped:
        lines += ["", "left out:"] + [f"- {d}" for d in dropped]
    return "\n".join(lines) + "\n"


def write_outputs(directories: list[Path], out: Path, *, model: Any, hardware: str,
                  info: dict[str, Any], tests: dict[str, Any], dropped: list[str],
                  timings: dict[str, float], log: Any) -> Any:
    if not directories:
        (out / "summary.md").write_text(markdown_empty(info, tests, dropped))
        return None
    notes = {"gpu_check": {"machine": info, "gpu_tests": tests, "left_out": dropped,
                           "wall_s": timings}}
    dataset = merge(directories, out, notes)
    summary = predictions(dataset.frame, model, hardware)
    summary.to_csv(out / "summary.csv", index=False)
    text = markdown(summary, info, tests, dropped, timings, model)
    (out / "summary.md").write_text(text)
    return summary


def markdown_empty(info: dict[str, Any], tests: dict[str, Any], dropped: list[str]) -> str:
    return ("# GPU check: nothing measured\n\nmachine: " + json.dumps(info)
            + f"\ngpu tests: {tests['line']}\n" + "".join(f"- {d}\n" for d in dropped))


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (<= 8 files)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny model on a small grid (the CPU smoke run)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="wall-clock budget of the whole run, set-up included")
    parser.add_argument("--model", default=None,
                        help="model preset to profile (llama3.2-1b; tiny with --tiny)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (2048; 64 with --tiny)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per config")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per config (3; 2 with --tiny)")
    parser.add_argument("--config-timeout-s", type=float, default=None,
                        help="per-config timeout (120 s on CUDA, 60 s on the CPU)")
    parser.add_argument("--tests-timeout-s", type=float, default=150.0)
    parser.add_argument("--skip-tests", action="store_true", help="do not run the gpu tests")
    parser.add_argument("--hardware", default=None,
                        help="catalogue name of the device (detected by default)")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the planned parts and their estimated seconds, and stop "
                             "(with --hardware, also where the device is not present)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    args.config_timeout_s = args.config_timeout_s or (120.0 if args.device == "cuda" else 60.0)
    args.steps = args.steps or (2 if args.tiny else 3)
    for name, value, low in (("warmup", args.warmup, 1 if args.device == "cuda" else 0),
                             ("steps", args.steps, 1), ("budget-s", args.budget_s, 1)):
        if value < low:
            parser.error(f"--{name}={value:g}: must be >= {low}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "log.txt").open("w")

    def log(message: str) -> None:
        line = f"[{time.monotonic() - started:6.1f} s] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    work = Path(tempfile.mkdtemp(prefix="paratune-gpu-check-"))
    try:
        return _run(args, out, work, deadline, started, log)
    finally:
        _stop_children()
        log_file.close()
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path, work: Path, deadline: float, started: float,
         log: Any) -> int:
    stage = stage_packages(ROOT, work / "src")
    sys.path.insert(0, str(stage))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(stage), os.environ.get("PYTHONPATH", "")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(stage)  # workers run `python -m`, which puts the working directory first
    import paratune
    from paratune import get_model
    from paratune.profiler.campaign import detect_hardware

    log(f"paratune {paratune.__version__} from {Path(paratune.__file__).parent}")
    timings: dict[str, float] = {}
    import torch

    if args.device == "cuda" and not torch.cuda.is_available() and not (
            args.plan_only and args.hardware):
        log("no CUDA device is visible: use --device cpu (or --plan-only --hardware NAME)")
        return 1
    hardware = args.hardware or detect_hardware(args.device)
    if args.plan_only:
        return _plan_only(args, hardware, log)
    info = machine(args.device)
    log("machine: " + json.dumps(info))
    timings["set-up"] = time.monotonic() - started

    tests: dict[str, Any] = {"files": [], "line": "skipped (--skip-tests)", "returncode": 0}
    if not args.skip_tests:
        extra = pytest_path(ROOT, work, log)
        tests = run_gpu_tests(stage, extra, out, args.tests_timeout_s, log)
    timings["gpu tests"] = time.monotonic() - started - timings["set-up"]

    name = args.model or ("tiny" if args.tiny else "llama3.2-1b")
    model = get_model(name, seq_len=args.seq_len or (64 if args.tiny else 2048))
    step_s = _step_estimator(model, hardware, args.device)
    steps = args.warmup + args.steps
    parts = default_parts(args.tiny)
    total = sum(len(p.configs()) for p in parts)
    planned = sum(estimate_part_s(p, step_s, device=args.device, steps=steps) for p in parts)
    end = deadline - RESERVE_S[args.device]
    log(f"campaign: {model.name} ({_params(model)} parameters), seq "
        f"{model.seq_len}, {hardware}, {total} configs in {len(parts)} parts, "
        f"{args.warmup}+{args.steps} steps each; planned {planned:.0f} s, "
        f"{end - time.monotonic():.0f} s left")
    directories: list[Path] = []
    dropped: list[str] = []
    pace, campaign_start, planned_run = 1.0, time.monotonic(), 0.0
    broken = False
    for part in parts:
        if broken:
            dropped += [f"{part.recompute} mb{m} gb{g}: not run, an earlier part's campaign "
                        "failed" for m, g in part.configs()]
            continue
        left = max(0.0, end - time.monotonic())
        fitted = fit_part(part, left, step_s, device=args.device, steps=steps, pace=pace)
        dropped += fitted.dropped
        if not fitted.configs():
            log(f"  {part.name}: left out ({left:.0f} s left)")
            continue
        plan_s = estimate_part_s(fitted, step_s, device=args.device, steps=steps, pace=pace)
        log(f"  {part.name}: recompute {fitted.recompute}, mb {fitted.micro_batch_sizes}, gb "
            f"{fitted.global_batch_sizes}: {len(fitted.configs())} configs, planned "
            f"{plan_s:.0f} s of {left:.0f} s left")
        largest = max(BUILD_S[args.device] + steps * step_s(fitted.recompute, m, g)
                      for m, g in fitted.configs())
        begin = time.monotonic()
        directory, broken = run_part(fitted, model, args=args, hardware=hardware, work=work,
                                     deadline=end, next_config_s=pace * largest, log=log)
        took = time.monotonic() - begin
        unplanned = estimate_part_s(fitted, step_s, device=args.device, steps=steps)
        planned_run += unplanned
        # measured over planned time of the parts so far: the next parts are planned at it
        pace = max(0.25, (time.monotonic() - campaign_start) / planned_run)
        log(f"  {part.name}: {took:.0f} s (planned {unplanned:.0f} s at the assumed pace); "
            f"pace now {pace:.2f}")
        why = "its campaign failed" if broken else "the deadline passed"
        measured = set() if directory is None else _measured_configs(directory)
        dropped += [f"{fitted.recompute} mb{m} gb{g}: not run, {why}"
                    for m, g in fitted.configs() if (m, g) not in measured]
        if directory is not None:
            directories.append(directory)
            timings["campaign"] = time.monotonic() - campaign_start
            write_outputs(directories, out, model=model, hardware=hardware, info=info,
                          tests=tests, dropped=dropped, timings=timings, log=log)
    timings["campaign"] = time.monotonic() - campaign_start
    summary = write_outputs(directories, out, model=model, hardware=hardware, info=info,
                            tests=tests, dropped=dropped, timings=timings, log=log)
    timings["total"] = time.monotonic() - started
    heavy = [name for name in HEAVY if name in sys.modules]
    log(f"heavy packages imported: {', '.join(heavy) or 'none'}")
    if summary is not None:
        from paratune.table import format_table

        shown = ["recompute", "micro_batch_size", "global_batch_size", "status", "step_time_s",
                 "analytical_step_time_s", "tokens_per_s", "mfu", "peak_mem_allocated_gb",
                 "peak_rss_gb", "memory_estimate_gb"]
        log("summary:\n" + format_table(summary.to_dict("records"),
                                        [c for c in shown if summary[c].notna().any()]))
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    log(f"done in {timings['total']:.0f} s: {len(files)} files in {out}: {', '.join(files)}")
    ok_rows = 0 if summary is None else int((summary["status"] == "ok").sum())
    tests_ok = args.skip_tests or tests["returncode"] == 0
    return 0 if tests_ok and ok_rows and not heavy else 1


def _plan_only(args: argparse.Namespace, hardware: str, log: Any) -> int:
    from paratune import get_model

    model = get_model(args.model or ("tiny" if args.tiny else "llama3.2-1b"),
                      seq_len=args.seq_len or (64 if args.tiny else 2048))
    step_s = _step_estimator(model, hardware, args.device)
    steps = args.warmup + args.steps
    total = 0.0
    for part in default_parts(args.tiny):
        seconds = estimate_part_s(part, step_s, device=args.device, steps=steps)
        total += seconds
        log(f"{part.name}: recompute {part.recompute}, mb {part.micro_batch_sizes}, gb "
            f"{part.global_batch_sizes}: {len(part.configs())} configs, {seconds:.0f} s")
        for m, g in part.configs():
            log(f"    mb{m} gb{g}: {step_s(part.recompute, m, g):.2f} s per step")
    log(f"{model.name} on {hardware}: {total:.0f} s planned for the campaign, before the "
        f"gpu tests and set-up (budget {args.budget_s:.0f} s)")
    return 0


def _measured_configs(directory: Path) -> set[tuple[int, int]]:
    from paratune.datasets import read_dataset

    frame = read_dataset(directory).frame
    return {(int(m), int(g)) for m, g in zip(frame["micro_batch_size"],
                                             frame["global_batch_size"])}


def _step_estimator(model: Any, hardware: str, device: str) -> Any:
    """``(recompute, micro, global) -> planned seconds of one step``."""
    from paratune import ParallelConfig
    from paratune.models import features as F
    from paratune.predictor import config_frame

    cache: dict[tuple[str, int, int], float] = {}

    def step_s(recompute: str, micro: int, global_batch: int) -> float:
        key = (recompute, micro, global_batch)
        if key not in cache:
            if device == "cpu":
                cache[key] = CPU_STEP_S * global_batch / 8
            else:
                cf = config_frame(model, [ParallelConfig(micro_batch_size=micro,
                                                         global_batch_size=global_batch,
                                                         recompute=recompute)], hardware)
                at_peak = float(F.analytical_step_time(cf)["step_time_s"][0])
                cache[key] = at_peak / ASSUMED_MFU[device]
        return cache[key]

    return step_s


if __name__ == "__main__":
    raise SystemExit(main())
