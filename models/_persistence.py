"""The saved form of a :class:`~paratune.models.PerformanceModel`: a directory of XGBoost
JSON files and a manifest (schema version, feature names, parameters, the training-data
fingerprint and the SHA-256 of each component), written under a lock, file by file with
atomic replaces; never pickle."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune import __version__
from paratune.errors import ModelFormatError
from paratune.fileio import atomic_write_text, exclusive_lock
from paratune.models import features as F
from paratune.models._calibration import CONSTANT_NAMES

if TYPE_CHECKING:
    from paratune.models._estimators import PerformanceModel

__all__ = ["SCHEMA_VERSION"]

SCHEMA_VERSION = 13
"""Version of the saved-model directory format; loading another version fails (2: the
layer-passes feature; 3: the data-parallel ring latency in the analytical estimate; 4: the
step-time models for models not in the training data; 5: the stalled-pipeline regime; 6:
model keys with every digit of the shapes, hardware names in their catalogue spelling; 7: the
analytical estimate's per-micro-batch ZeRO-2/3 traffic and latency, recompute working set
and FLOPs, GPipe's last rank, largest-chunk pipeline fill and node-crossing tp groups, and the
training ranges; 8: the memory correction on its own features, with monotone directions; 9:
the families whose pipelines never stalled, kept out of the stalled regime; 10: the models
each family's step-time model has seen, and family names fit for file names; 11: the
training ranges per family, the interval's widening with distance from them and the
few-shot calibration of families; 12: the stall classifier for models not in the
training data on the regime's physics, see :func:`~paratune.models.features.stall_features`).
A
model learns corrections to the analytical estimate, so one fitted on another version's
estimate would apply them to a different baseline."""
_MANIFEST = "model.json"
_LOCK_FILE = ".model.lock"
_LOCK_WAIT_S = 60.0
_TIME_COMPONENTS = ("throughput", "throughput_refine", "throughput_quantiles")
_STALL_COMPONENTS = ("stall_classifier", "stall_time", "stall_time_quantiles")
_COMPONENT_FILE = re.compile(  # a booster file save writes (transfer and family ones by prefix)
    rf"^({'|'.join((*_TIME_COMPONENTS, 'memory', 'feasibility', *_STALL_COMPONENTS))}"
    r"|transfer-.+|family-.+)\.json$")


class _Persistence:
    """Save and load of :class:`~paratune.models.PerformanceModel` (a mix-in of it)."""

    def save(self, path: str | Path) -> Path:
        """Write the model as a directory of XGBoost JSON files and a manifest.

        The manifest (``model.json``) holds the schema version, feature names, parameters,
        the training-data fingerprint, the component files and the SHA-256 of each. Written
        file by file with atomic replaces; a manifest already there goes first and the new one
        is written last, so a half-written directory (also one saved over another model) does
        not load. The save holds the directory's lock (``.model.lock``) throughout: saves into
        one directory take turns (the last one's model is what stays), and a :meth:`load`
        waits for the save to end.

        Args:
            path: Directory (created if missing).

        Returns:
            The directory.

        Raises:
            ConfigError: another process kept the directory locked for over a minute.
            OSError: the directory or its lock file cannot be written.
        """
        self._check_fitted()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        components = self._components()
        with _directory_lock(path, "saving"):
            _remove_stale_temporaries(path)
            # saving over another model: without its manifest the directory does not load
            # until this one's manifest is written, never as a mixture of the two models' files
            (path / _MANIFEST).unlink(missing_ok=True)
            files, digests = _write_components(path, components)
            manifest = self._manifest(files, digests)
            atomic_write_text(path / _MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            # the components of a model saved here before that this one lacks (a family, the
            # stall regime): the directory holds this model's files alone
            for file in path.glob("*.json"):
                if (file.name not in files.values() and file.name != _MANIFEST
                        and _COMPONENT_FILE.match(file.name)):
                    file.unlink(missing_ok=True)
        return path

    def _components(self) -> dict[str, Any]:
        """Component name -> booster (None where the model has no such part)."""
        components = {"throughput": self.throughput_, "throughput_refine": self.refine_,
                      "throughput_quantiles": self.quantile_,
                      "memory": self.memory_, "feasibility": self.feasibility_}
        for name, booster in zip(_TIME_COMPONENTS, self.transfer_):
            components[f"transfer-{name}"] = booster
        if self.stall_ is not None:
            for name, booster in zip(_STALL_COMPONENTS, self.stall_):
                components[name] = booster
            for name, booster in zip(_STALL_COMPONENTS, self.stall_transfer_):
                components[f"transfer-{name}"] = booster
        for family, boosters in self.families_.items():
            for name, booster in zip(_TIME_COMPONENTS, boosters):
                components[f"family-{family}-{name}"] = booster
            for name, booster in zip(_TIME_COMPONENTS, self.family_transfer_[family]):
                components[f"family-{family}-transfer-{name}"] = booster
        return components

    def _manifest(self, files: dict[str, str], digests: dict[str, str]) -> dict[str, Any]:
        """The manifest of this model whose components went to ``files``."""
        params = self.get_params()
        params["quantiles"] = list(params["quantiles"])
        return {
            "kind": "paratune.PerformanceModel",
            "schema_version": SCHEMA_VERSION,
            "paratune_version": __version__,
            "feature_names": list(F.FEATURE_NAMES),
            "feasibility_feature_names": [*F.FEATURE_NAMES, "log2_pred_mem_fraction"],
            "transfer_feature_names": list(F.TRANSFER_FEATURE_NAMES),
            "stall_transfer_feature_names": list(F.STALL_FEATURE_NAMES),
            "memory_feature_names": list(F.MEMORY_FEATURE_NAMES),
            "seen_models": self.seen_models_,
            "target": "log(measured_step_time_s / analytical_step_time_s)",
            "stall_target": "log(measured_step_time_s / num_microbatches) of stalled runs",
            "params": params,
            "components": files,
            "component_sha256": digests,
            "families": sorted(self.families_),
            "family_seen_models": self.family_seen_,
            "hardware_family": self.hardware_family_,
            "stall_free_families": self.stall_free_families_,
            "stall_free_hardware": self.stall_free_hardware_,
            "interval_widening": self.interval_widening_,
            "core_constants": {family: dict(zip(CONSTANT_NAMES, values, strict=True))
                               for family, values in self.core_constants_.items()},
            "family_offsets": self.family_offsets_,
            "training": {"fingerprint_sha256": self.fingerprint_,
                         "num_rows": self.num_train_rows_,
                         "num_time_rows": self.num_time_rows_,
                         "num_memory_rows": self.num_memory_rows_,
                         "num_stall_rows": self.num_stall_rows_,
                         "pipeline_runs_and_stalls_by_family": self.pipeline_runs_,
                         "num_feasibility_configs": self.num_feasibility_rows_,
                         "sources": self.sources_, "ranges": self.training_ranges_,
                         "extrapolation_ranges": self.extrapolation_ranges_},
        }

    @classmethod
    def load(cls, path: str | Path) -> PerformanceModel:
        """Load a directory written by :meth:`save`.

        Holds the directory's lock while it reads (waiting up to a minute for a save there to
        end), so a model being saved over loads as the old model or the new one. Where the
        lock cannot be taken (a read-only directory without the lock file) the files are read
        unlocked; either way each component must match the SHA-256 the manifest records, so
        files of two saves never load as one model.

        Raises:
            ModelFormatError: missing or corrupt files (or files another save changed), another
                schema version, or feature names that differ from this version's.
            ConfigError: another process kept the directory locked for over a minute.
        """
        path = Path(path)
        if not ((path / _MANIFEST).is_file() or (path / _LOCK_FILE).is_file()):
            # checked before locking: loading never creates a lock file where no model is
            raise ModelFormatError(f"{path}: not a saved performance model (no {_MANIFEST})")
        with contextlib.ExitStack() as stack:
            locked = False  # where the lock cannot be had, the files are checked twice
            # OSError: a read-only directory without the lock file (nor a save there), or
            # another user's private lock file
            with contextlib.suppress(OSError):
                locked = stack.enter_context(_directory_lock(path, "saving or loading"))
            try:
                return cls._load_files(path)
            except _ChangedError:
                if locked:
                    raise
            # unlocked, a save elsewhere may have rewritten a file since the manifest was
            # read: read the directory once more before calling it corrupt
            time.sleep(0.5)
            return cls._load_files(path)

    @classmethod
    def _load_files(cls, path: Path) -> PerformanceModel:
        """Read and check the manifest, then the model it describes."""
        manifest_path = path / _MANIFEST
        if not manifest_path.exists():
            raise ModelFormatError(f"{path}: not a saved performance model (no {_MANIFEST})")
        try:
            manifest = json.loads(_read_bounded(manifest_path, what="manifest",
                                                limit=_MAX_MANIFEST_BYTES))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{manifest_path}: corrupt manifest ({exc})") from None
        if not isinstance(manifest, dict):
            raise ModelFormatError(f"{manifest_path}: corrupt manifest (a JSON "
                                   f"{type(manifest).__name__}, not an object)")
        if manifest.get("kind") != "paratune.PerformanceModel":
            raise ModelFormatError(f"{manifest_path}: kind={manifest.get('kind')!r} is not "
                                   "paratune.PerformanceModel")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ModelFormatError(f"{manifest_path}: schema_version={version!r} but this "
                                   f"paratune reads schema_version={SCHEMA_VERSION}; refit it")
        if (manifest.get("feature_names") != list(F.FEATURE_NAMES)
                or manifest.get("transfer_feature_names") != list(F.TRANSFER_FEATURE_NAMES)
                or manifest.get("memory_feature_names") != list(F.MEMORY_FEATURE_NAMES)):
            raise ModelFormatError(f"{manifest_path}: feature_names differ from this paratune's "
                                   "features; refit the model")
        try:
            return cls._from_manifest(path, manifest)
        except ModelFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"{manifest_path}: corrupt manifest (bad or missing "
                                   f"entry {exc})") from None

    @classmethod
    def _from_manifest(cls, path: Path, manifest: dict[str, Any]) -> PerformanceModel:
        """The model a checked manifest describes (KeyError/TypeError where it is corrupt)."""
        import xgboost as xgb

        params = dict(manifest["params"])
        params["quantiles"] = tuple(params["quantiles"])
        model = cls(**params)
        read = _ComponentReader(path, manifest)
        model.throughput_, model.refine_, model.quantile_ = read.time_models("")
        model.transfer_ = read.time_models("transfer-")
        model.seen_models_ = [str(k) for k in manifest.get("seen_models", [])]
        model.stall_ = model.stall_transfer_ = None
        if _STALL_COMPONENTS[0] in read.files:
            model.stall_ = read.stall_models("")
            model.stall_transfer_ = read.stall_models("transfer-")
        model.memory_ = read.booster("memory", xgb.XGBRegressor)
        model.feasibility_ = read.booster("feasibility", xgb.XGBClassifier)
        model.families_ = {}
        model.family_transfer_ = {}
        for family in manifest.get("families", []):
            model.families_[family] = read.time_models(f"family-{family}-")
            model.family_transfer_[family] = read.time_models(f"family-{family}-transfer-")
        model.family_seen_ = {str(f): [str(k) for k in keys]
                              for f, keys in manifest["family_seen_models"].items()}
        _restore_state(model, manifest)
        return model


class _ComponentReader:
    """Reads the boosters a checked manifest lists from a model directory."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.files = manifest["components"]
        # a model saved before the digests were recorded has none to check
        self.digests = manifest.get("component_sha256") or {}

    def booster(self, name: str, kind: type) -> Any:
        """The component ``name`` (None where the manifest lists none), checked against
        its digest."""
        import xgboost as xgb

        path, files, digests = self.path, self.files, self.digests
        if name not in files:
            return None
        file = _component_file(path, name, files[name])
        try:
            data = _read_bounded(file, what=f"component {name!r}")
        except (FileNotFoundError, IsADirectoryError):
            raise _ChangedError(f"{file}: missing ({_MANIFEST} lists it as component "
                                f"{name!r}); refit the model or restore the file"
                                ) from None
        if name in digests and hashlib.sha256(data).hexdigest() != digests[name]:
            raise _ChangedError(f"{file}: corrupt: its content differs from the one "
                                f"{_MANIFEST} records (SHA-256) for component {name!r}: "
                                "changed after the save, or left by another save into "
                                f"{path}; save or refit the model again")
        obj = kind()
        try:
            obj.load_model(bytearray(data))
        except (xgb.core.XGBoostError, OSError, ValueError, KeyError, TypeError) as exc:
            what = "classifier" if kind is xgb.XGBClassifier else "regressor"
            raise ModelFormatError(f"{file}: corrupt: not an XGBoost {what} "
                                   f"({_first_line(exc)}); refit the model") from None
        return obj

    def time_models(self, prefix: str) -> tuple[Any, Any, Any]:
        """The median, refinement and quantile boosters under ``prefix``."""
        import xgboost as xgb

        for name in _TIME_COMPONENTS:
            if prefix + name not in self.files:
                raise ModelFormatError(f"{self.path / _MANIFEST}: component {prefix + name!r} "
                                       "missing")
        return tuple(self.booster(prefix + name, xgb.XGBRegressor) for name in _TIME_COMPONENTS)

    def stall_models(self, prefix: str) -> tuple[Any, Any, Any]:
        """The stall classifier and stalled-time boosters under ``prefix``."""
        import xgboost as xgb

        kinds = (xgb.XGBClassifier, xgb.XGBRegressor, xgb.XGBRegressor)
        for name in _STALL_COMPONENTS:
            if prefix + name not in self.files:
                raise ModelFormatError(f"{self.path / _MANIFEST}: component "
                                       f"{prefix + name!r} missing")
        return tuple(self.booster(prefix + name, kind)
                     for name, kind in zip(_STALL_COMPONENTS, kinds))


def _restore_state(model: Any, manifest: dict[str, Any]) -> None:
    """The learned attributes other than boosters, from a checked manifest."""
    model.hardware_family_ = dict(manifest.get("hardware_family", {}))
    model.stall_free_families_ = [str(f) for f in manifest["stall_free_families"]]
    model.stall_free_hardware_ = [str(h) for h in manifest["stall_free_hardware"]]
    training = manifest["training"]
    model.fingerprint_ = training["fingerprint_sha256"]
    model.num_train_rows_ = training["num_rows"]
    model.num_time_rows_ = training["num_time_rows"]
    model.num_memory_rows_ = training["num_memory_rows"]
    model.num_stall_rows_ = training["num_stall_rows"]
    model.pipeline_runs_ = {str(f): [int(n) for n in v] for f, v in
                            training["pipeline_runs_and_stalls_by_family"].items()}
    model.num_feasibility_rows_ = training["num_feasibility_configs"]
    model.sources_ = training["sources"]
    # a model saved before its training ranges were recorded has none
    model.training_ranges_ = training.get("ranges", {})
    model.extrapolation_ranges_ = {
        str(f): {str(a): [float(v) for v in r] for a, r in axes.items()}
        for f, axes in training["extrapolation_ranges"].items()}
    model.interval_widening_ = {
        str(f): {str(k): float(v) for k, v in margins.items()}
        for f, margins in manifest["interval_widening"].items()}
    model.core_constants_ = {str(f): [float(values[name]) for name in CONSTANT_NAMES]
                             for f, values in manifest["core_constants"].items()}
    model.family_offsets_ = {str(f): {"log_factor": float(e["log_factor"]),
                                      "margin": float(e["margin"]), "rows": int(e["rows"])}
                             for f, e in manifest["family_offsets"].items()}


def _write_components(path: Path, components: dict[str, Any]
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """Each booster saved to ``<name>.json`` by an atomic replace; returns the file names and
    SHA-256 digests by component."""
    files, digests = {}, {}
    for name, booster in components.items():
        if booster is None:
            continue
        target = path / f"{name}.json"
        # a name of its own (XGBoost picks the format from the .json suffix)
        tmp = path / f".{name}.{secrets.token_hex(4)}.tmp.json"
        try:
            booster.save_model(str(tmp))
            with open(tmp, "rb") as handle:
                digests[name] = hashlib.sha256(handle.read()).hexdigest()
                os.fsync(handle.fileno())
            tmp.replace(target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        files[name] = target.name
    return files, digests


def _remove_stale_temporaries(path: Path) -> None:
    """Temporaries of a save killed part-way (not of one in flight where flock is missing):
    the boosters' and the manifest's (paratune.fileio's atomic writes)."""
    for leftover in [*path.glob(".*.tmp.json"), *path.glob(f".{_MANIFEST}.*.tmp")]:
        with contextlib.suppress(OSError):
            if leftover.stat().st_mtime < time.time() - 60:
                leftover.unlink()


class _ChangedError(ModelFormatError):
    """A component file is missing or not the one the manifest records: another save may be
    rewriting the directory (see :meth:`PerformanceModel.load`)."""


def _directory_lock(path: Path, what: str) -> contextlib.AbstractContextManager[bool]:
    """The lock that saves into (and loads from) one model directory take turns on."""
    return exclusive_lock(path / _LOCK_FILE, field="path", value=str(path),
                          what=f"{what} a performance model there", wait_s=_LOCK_WAIT_S)


_XGB_LOCATION = re.compile(r"^\[[\d:]+\] [^:]*:\d+: ")


def _first_line(exc: BaseException) -> str:
    """The first line of an error without XGBoost's ``[time] source.cc:LINE:`` prefix (its
    messages go on with a C++ stack trace)."""
    lines = str(exc).strip().splitlines()
    return _XGB_LOCATION.sub("", lines[0]).strip() if lines else type(exc).__name__


_MAX_COMPONENT_BYTES = 1 << 30
"""The largest component file a model directory may hold (XGBoost JSON of a few MB)."""
_MAX_MANIFEST_BYTES = 16 << 20


def _component_file(path: Path, name: str, relative: Any) -> Path:
    """The file of component ``name``: a file name inside the model directory ``path``
    (neither a path elsewhere, absolute or through ``..``, nor a link out of it)."""
    if not isinstance(relative, str) or not relative or "/" in relative or "\\" in relative \
            or relative in (".", ".."):
        raise ModelFormatError(f"{path / _MANIFEST}: component {name!r} is {relative!r}, not "
                               f"the name of a file in {path}; refit the model")
    file = path / relative
    root = path.resolve()
    if file.resolve().parent != root:
        raise ModelFormatError(f"{file}: component {name!r} leads out of the model directory "
                               f"{path} (a link to {file.resolve()}); refit the model")
    return file


def _read_bounded(file: Path, *, what: str, limit: int | None = None) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes: a device, a FIFO or
    an oversized file is refused before it is read (it would hang or exhaust memory)."""
    import stat

    limit = _MAX_COMPONENT_BYTES if limit is None else limit
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

