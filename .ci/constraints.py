"""Print the installed versions of paratune's dependency tree as pip constraints.

Run in an environment where paratune is installed with its extras (CI's, or
``pip install -e '.[dev]'``), from the repository root::

    python .ci/constraints.py > constraints.txt

Every requirement of paratune (its extras included, where their packages are installed) is
followed through the installed distributions' own metadata, so the file holds that tree and
nothing else that happens to be in the environment. A local version label (``+cpu``) is
dropped: ``torch==2.13.0`` matches a CPU and a CUDA build alike. The installer's own tools
(pip, setuptools, wheel) are left out: they come with the virtual environment, and a pin of
an old one would clash with a package that needs a newer one at run time. A requirement the
installed version does not meet is reported and the script fails, so the file only ever holds
a set that pip's resolver accepts.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"pip", "setuptools", "wheel"}


def _extras() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return sorted(project.get("optional-dependencies", {}))


def _requirements(dist: metadata.Distribution, extras: set[str]) -> list[Requirement]:
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None:
            out.append(req)
            continue
        envs = [dict(default_environment(), extra=e) for e in (extras or {""})]
        if any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def tree(root: str, extras: set[str], problems: list[str]) -> dict[str, str]:
    """``{name: version}`` of every installed distribution ``root[extras]`` needs; a
    requirement the installed version does not satisfy is appended to ``problems``."""
    pins: dict[str, str] = {}
    todo = [(root, extras)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        key = (canonicalize_name(name), frozenset(wanted))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"# not installed, left out: {name}", file=sys.stderr)
            continue
        if canonicalize_name(name) != canonicalize_name(root):
            pins[canonicalize_name(name)] = re.sub(r"\+.*$", "", dist.version)
        for req in _requirements(dist, wanted):
            if canonicalize_name(req.name) in TOOLS:
                continue
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                version = None
            if version is not None and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{name} requires {req}, installed {version}")
            todo.append((req.name, set(req.extras)))
    return pins


def main() -> int:
    extras = _extras()
    problems: list[str] = []
    pins = tree("paratune", set(extras), problems)
    if problems:
        print("constraints: the installed set is inconsistent (run pip install -e "
              "'.[dev]' first):\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("# Known-good versions of paratune's dependencies (tested together by CI).")
    print("# Use: pip install -c constraints.txt -e '.[dev]'")
    print("# Regenerate: python .ci/constraints.py > constraints.txt  (in a CI-like environment)")
    print(f"# Python {sys.version.split()[0]}; extras followed: {', '.join(extras) or 'none'}")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
