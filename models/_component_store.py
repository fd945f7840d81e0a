"""One generic store for composed estimators: any tree of XGBoost models, small estimators,
dicts and lists of them and plain JSON values is saved as one XGBoost JSON file per booster,
named by its attribute path (``step_time.families.vtrain.median.json``), and a JSON tree
that refers to them; the SHA-256 of each file goes in the manifest, and a file whose content
differs is refused on load. Never pickle: an estimator is rebuilt from its class (one of the
``kinds`` the caller allows), its parameters and its learned attributes.

The tree's JSON form: a plain value as it is; a list as a list; a dict (string keys, none
starting with ``__``) as an object; a booster as ``{"__booster__": class name, "component":
name}``; an estimator as ``{"__estimator__": class name, "params": ..., "state": {learned
attribute without its trailing "_": tree}}``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sklearn.base import BaseEstimator

from paratune.errors import ModelFormatError

__all__ = ["ChangedError", "SavedComponents", "load_components", "read_bounded",
           "save_components"]

_BOOSTER_KINDS = ("XGBRegressor", "XGBClassifier")
_PLAIN = (str, int, float, bool, type(None))


class ChangedError(ModelFormatError):
    """A component file is missing or not the one the manifest records: another save may be
    rewriting the directory."""


@dataclass
class SavedComponents:
    """What :func:`save_components` wrote: the JSON tree, and per component its file name
    and SHA-256."""

    tree: Any
    files: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


def _learned(estimator: BaseEstimator) -> dict[str, Any]:
    """An estimator's learned attributes (public, ending in ``_``) by name without the
    ``_``."""
    return {name[:-1]: value for name, value in vars(estimator).items()
            if name.endswith("_") and not name.startswith("_")}


def save_components(path: Path, tree: Any, *, prefix: str = "",
                    names: dict[str, str] | None = None) -> SavedComponents:
    """Write every booster of ``tree`` into the directory ``path`` by an atomic replace.

    Args:
        path: The directory.
        tree: Estimators, boosters (anything else that is not a plain JSON value, a dict or
            a list is saved by its ``save_model``), dicts with string keys and lists.
        prefix: The attribute path of ``tree`` (``""``: the root).
        names: Component name by attribute path, where one keeps another name.

    Returns:
        The JSON tree and the components' files and digests.
    """
    saved = SavedComponents(tree=None)
    saved.tree = _save(path, tree, prefix, names or {}, saved)
    return saved


def _join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _save(path: Path, node: Any, where: str, names: dict[str, str],
          saved: SavedComponents) -> Any:
    if isinstance(node, _PLAIN):
        return node
    if isinstance(node, list | tuple):
        return [_save(path, v, _join(where, i), names, saved) for i, v in enumerate(node)]
    if isinstance(node, dict):
        bad = [k for k in node if not isinstance(k, str) or k.startswith("__")]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} cannot be saved (string keys not "
                            "starting with '__' only)")
        return {k: _save(path, v, _join(where, k), names, saved) for k, v in node.items()}
    if isinstance(node, BaseEstimator) and not hasattr(node, "save_model"):
        return {"__estimator__": type(node).__name__,
                "params": _save(path, node.get_params(deep=False), _join(where, "params"),
                                names, saved),
                "state": {k: _save(path, v, _join(where, k), names, saved)
                          for k, v in _learned(node).items()}}
    name = names.get(where, where)
    saved.files[name], saved.digests[name] = _write_booster(path, name, node)
    return {"__booster__": type(node).__name__, "component": name}


def _write_booster(path: Path, name: str, booster: Any) -> tuple[str, str]:
    """``booster`` saved to ``<name>.json`` by an atomic replace; its file name and
    SHA-256."""
    target = path / f"{name}.json"
    # a name of its own (XGBoost picks the format from the .json suffix)
    tmp = path / f".{name}.{secrets.token_hex(4)}.tmp.json"
    try:
        booster.save_model(str(tmp))
        with open(tmp, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
            os.fsync(handle.fileno())
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target.name, digest


@dataclass
class _Reader:
    """Reads and checks the components a manifest lists."""

    path: Path
    manifest_name: str
    files: dict[str, Any]
    digests: dict[str, Any]
    kinds: dict[str, type]
    max_bytes: int


def load_components(path: Path, manifest: dict[str, Any], tree: Any, *,
                    kinds: tuple[type, ...], manifest_name: str, max_bytes: int) -> Any:
    """The tree :func:`save_components` wrote, from the directory ``path``.

    Args:
        path: The directory.
        manifest: Holds ``components`` (file name by component) and ``component_sha256``.
        tree: The JSON tree :func:`save_components` returned.
        kinds: The estimator classes the tree may hold (nothing else is built).
        manifest_name: The manifest's file name, for messages.
        max_bytes: The largest component file read.

    Raises:
        ModelFormatError: a component file is corrupt, not a regular file, too large or
            outside the directory, or the tree names an unknown class.
        ChangedError: a component file is missing or its SHA-256 is not the recorded one.
        KeyError, TypeError: the manifest is corrupt.
    """
    files, digests = manifest["components"], manifest["component_sha256"]
    if not isinstance(files, dict) or not isinstance(digests, dict):
        raise TypeError("'components' and 'component_sha256' must be objects")
    reader = _Reader(path, manifest_name, files, digests,
                     {kind.__name__: kind for kind in kinds}, max_bytes)
    return _load(reader, tree)


def _load(reader: _Reader, node: Any) -> Any:
    if isinstance(node, _PLAIN):
        return node
    if isinstance(node, list):
        return [_load(reader, v) for v in node]
    if not isinstance(node, dict):
        raise TypeError(f"a {type(node).__name__} in the model tree")
    if "__booster__" in node:
        return _read_booster(reader, str(node["component"]), str(node["__booster__"]))
    if "__estimator__" in node:
        kind = reader.kinds.get(node["__estimator__"])
        if kind is None:
            raise ModelFormatError(f"{reader.path / reader.manifest_name}: unknown estimator "
                                   f"{node['__estimator__']!r}; refit the model")
        estimator = kind(**_load(reader, node["params"]))
        for name, value in node["state"].items():
            try:
                setattr(estimator, f"{name}_", _load(reader, value))
            except AttributeError:  # a read-only property: not a learned attribute
                raise TypeError(f"{name!r} is not a learned attribute") from None
        return estimator
    return {k: _load(reader, v) for k, v in node.items()}


def _read_booster(reader: _Reader, name: str, kind: str) -> Any:
    """The component ``name``, checked against its digest and read as an XGBoost ``kind``."""
    import xgboost as xgb

    manifest = reader.manifest_name
    if kind not in _BOOSTER_KINDS:
        raise ModelFormatError(f"{reader.path / manifest}: component {name!r} is a {kind!r}, "
                               "not an XGBoost model; refit the model")
    file = _component_file(reader.path, manifest, name, reader.files[name])
    try:
        data = read_bounded(file, what=f"component {name!r}", limit=reader.max_bytes)
    except (FileNotFoundError, IsADirectoryError):
        raise ChangedError(f"{file}: missing ({manifest} lists it as component "
                           f"{name!r}); refit the model or restore the file") from None
    if hashlib.sha256(data).hexdigest() != reader.digests[name]:
        raise ChangedError(f"{file}: corrupt: its content differs from the one "
                           f"{manifest} records (SHA-256) for component {name!r}: "
                           "changed after the save, or left by another save into "
                           f"{reader.path}; save or refit the model again")
    booster = getattr(xgb, kind)()
    try:
        booster.load_model(bytearray(data))
    except (xgb.core.XGBoostError, OSError, ValueError, KeyError, TypeError) as exc:
        what = "classifier" if kind == "XGBClassifier" else "regressor"
        raise ModelFormatError(f"{file}: corrupt: not an XGBoost {what} "
                               f"({_first_line(exc)}); refit the model") from None
    return booster


_XGB_LOCATION = re.compile(r"^\[[\d:]+\] [^:]*:\d+: ")


def _first_line(exc: BaseException) -> str:
    """The first line of an error without XGBoost's ``[time] source.cc:LINE:`` prefix (its
    messages go on with a C++ stack trace)."""
    lines = str(exc).strip().splitlines()
    return _XGB_LOCATION.sub("", lines[0]).strip() if lines else type(exc).__name__


def _component_file(path: Path, manifest: str, name: str, relative: Any) -> Path:
    """The file of component ``name``: a file name inside the model directory ``path``
    (neither a path elsewhere, absolute or through ``..``, nor a link out of it)."""
    if not isinstance(relative, str) or not relative or "/" in relative or "\\" in relative \
            or relative in (".", ".."):
        raise ModelFormatError(f"{path / manifest}: component {name!r} is {relative!r}, not "
                               f"the name of a file in {path}; refit the model")
    file = path / relative
    root = path.resolve()
    if file.resolve().parent != root:
        raise ModelFormatError(f"{file}: component {name!r} leads out of the model directory "
                               f"{path} (a link to {file.resolve()}); refit the model")
    return file


def read_bounded(file: Path, *, what: str, limit: int) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes: a device, a FIFO or
    an oversized file is refused before it is read (it would hang or exhaust memory)."""
    info = os.stat(file)  # FileNotFoundError / IsADirectoryError: the caller's message
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(str(file))
    if not stat.S_ISREG(info.st_mode):
        raise ModelFormatError(f"{file}: the model's {what} is not a regular file (a device, "
                               "a FIFO or a socket); refit the model or restore the file")
    if info.st_size > limit:
        raise ModelFormatError(f"{file}: the model's {what} is {info.st_size} bytes, over the "
                               f"limit of {limit}; refit the model or restore the file")
    with open(file, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ModelFormatError(f"{file}: the model's {what} grew past {limit} bytes while "
                               "it was read")
    return data
