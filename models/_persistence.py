"""The saved form of a :class:`~paratune.models.PerformanceModel`: a directory of XGBoost
JSON files and a manifest (schema version, feature names, parameters, the training-data
fingerprint, the model's tree of small estimators and the SHA-256 of each component),
written by the generic component store (:mod:`paratune.models._component_store`) under a
lock, file by file with atomic replaces; never pickle."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune import __version__
from paratune.errors import ModelFormatError
from paratune.fileio import atomic_write_text, exclusive_lock
from paratune.models import features as F
from paratune.models._component_store import (
    ChangedError,
    load_components,
    read_bounded,
    save_components,
)
from paratune.models._components import (
    FamilyRouter,
    FeasibilityEstimator,
    MemoryEstimator,
    StallRegimeEstimator,
    StepTimeEstimator,
)

if TYPE_CHECKING:
    from paratune.models._estimators import PerformanceModel

__all__ = ["SCHEMA_VERSION"]

SCHEMA_VERSION = 25
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
training data on the regime's physics, see :func:`~paratune.models.features.stall_features`;
13: a family without measurements predicted as a well-tuned framework from physics (the
device memory's bandwidth in the element-wise work); 14: the model saved as a tree of
small estimators by the generic component store, each booster file named by its attribute
path; 15: the calibrated core's collectives across nodes
reduced hierarchically, and the nodes a tensor-parallel group spans as a distance axis;
16: the step-time model for families without measurements, ``cross_family_``; 17: the
data-parallel regime as a distance axis of the training ranges; 18: the loss's element-wise
work over the vocabulary, a constant of the calibrated core; 19: the nodes a data-parallel
group spans as a distance axis; 20: the context-parallel degree in the analytical estimate
and as a distance axis; 21: the step-time corrections as residuals of each family's
calibrated core, on its shares of the step, and the cross-family model's own margins; 22:
the families the feasibility classifier decides for; 23: a family's memory threshold from
its runs out of memory, and the sources in the training fingerprint; 24: the families whose
pipelines ran across nodes, see ``node_pipeline_families_``; 25: the calibrated memory core,
a family's constants of the model states, activations and logits per pipeline stage, whose
peak the memory correction multiplies, see ``memory_constants_``). A
model learns corrections to the analytical estimate and its core, so one fitted on another
version's would apply them to a different baseline."""
_MANIFEST = "model.json"
_LOCK_FILE = ".model.lock"
_LOCK_WAIT_S = 60.0
_KIND = "paratune.PerformanceModel"
_NAMES = {"step_time.overall.median": "throughput", "memory.booster": "memory",
          "feasibility.classifier": "feasibility"}
"""Components that keep their names of the earlier format rather than their attribute
paths, which readers of a saved model look for: ``throughput.json`` (the overall step-time
model's median booster), ``memory.json`` and ``feasibility.json``."""
_LEGACY_FILE = re.compile(  # the component files of schema 13 and before
    r"^(throughput|throughput_refine|throughput_quantiles|memory|feasibility|stall_classifier"
    r"|stall_time|stall_time_quantiles|transfer-.+|family-.+)\.json$")
_MAX_COMPONENT_BYTES = 1 << 30
"""The largest component file a model directory may hold (XGBoost JSON of a few MB)."""
_MAX_MANIFEST_BYTES = 16 << 20
_ChangedError = ChangedError


class _Persistence:
    """Save and load of :class:`~paratune.models.PerformanceModel` (a mix-in of it)."""

    def save(self, path: str | Path) -> Path:
        """Write the model as a directory of XGBoost JSON files and a manifest.

        The manifest (``model.json``) holds the schema version, feature names, parameters,
        the training-data fingerprint, the model's learned state (a tree of small estimators
        whose boosters are files named by their attribute path, see
        :mod:`paratune.models._component_store`) and the SHA-256 of each file. Written
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
        with _directory_lock(path, "saving"):
            _remove_stale_temporaries(path)
            # saving over another model: without its manifest the directory does not load
            # until this one's manifest is written, never as a mixture of the two models' files
            (path / _MANIFEST).unlink(missing_ok=True)
            saved = save_components(path, self, names=_NAMES)
            manifest = self._manifest(saved.tree, saved.files, saved.digests)
            atomic_write_text(path / _MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            # the components of a model saved here before that this one lacks (a family, the
            # stall regime): the directory holds this model's files alone
            ours = _component_pattern(saved.tree["state"])
            for file in path.glob("*.json"):
                if (file.name not in saved.files.values() and file.name != _MANIFEST
                        and (ours.match(file.name) or _LEGACY_FILE.match(file.name))):
                    file.unlink(missing_ok=True)
        return path

    def _manifest(self, tree: dict[str, Any], files: dict[str, str],
                  digests: dict[str, str]) -> dict[str, Any]:
        """The manifest of this model, whose tree (see
        :func:`~paratune.models._component_store.save_components`) went to ``files``."""
        return {
            "kind": _KIND,
            "schema_version": SCHEMA_VERSION,
            "paratune_version": __version__,
            **_feature_names(),
            "target": "log(measured_step_time_s / calibrated core step time) per family; "
                      "log(measured_step_time_s / analytical_step_time_s) across families",
            "stall_target": "log(measured_step_time_s / num_microbatches) of stalled runs",
            "params": tree["params"],
            "state": tree["state"],
            "components": files,
            "component_sha256": digests,
            # for readers of the manifest; checked against the state on load
            "training": {"fingerprint_sha256": self.fingerprint_,
                         "num_rows": self.num_train_rows_},
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
            manifest = json.loads(read_bounded(manifest_path, what="manifest",
                                               limit=_MAX_MANIFEST_BYTES))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{manifest_path}: corrupt manifest ({exc})") from None
        if not isinstance(manifest, dict):
            raise ModelFormatError(f"{manifest_path}: corrupt manifest (a JSON "
                                   f"{type(manifest).__name__}, not an object)")
        if manifest.get("kind") != _KIND:
            raise ModelFormatError(f"{manifest_path}: kind={manifest.get('kind')!r} is not "
                                   "paratune.PerformanceModel")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ModelFormatError(f"{manifest_path}: schema_version={version!r} but this "
                                   f"paratune reads schema_version={SCHEMA_VERSION}; refit it")
        differ = [key for key, names in _feature_names().items() if manifest.get(key) != names]
        if differ:
            raise ModelFormatError(f"{manifest_path}: {', '.join(differ)} differ from this "
                                   "paratune's features; refit the model")
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
        tree = {"__estimator__": cls.__name__, "params": manifest["params"],
                "state": manifest["state"]}
        model = load_components(
            path, manifest, tree, manifest_name=_MANIFEST, max_bytes=_MAX_COMPONENT_BYTES,
            kinds=(cls, FamilyRouter, StepTimeEstimator, StallRegimeEstimator, MemoryEstimator,
                   FeasibilityEstimator))
        model.quantiles = tuple(model.quantiles)
        if manifest["training"]["fingerprint_sha256"] != model.fingerprint_:
            raise ValueError("'training' (its fingerprint is not the model's)")
        return model


def _feature_names() -> dict[str, list[str]]:
    """The columns each booster of a saved model reads, by manifest key: written on save,
    and on load each must be this paratune's."""
    return {"feature_names": list(F.FEATURE_NAMES),
            "feasibility_feature_names": [*F.FEATURE_NAMES, "log2_pred_mem_fraction"],
            "transfer_feature_names": list(F.TRANSFER_FEATURE_NAMES),
            "stall_transfer_feature_names": list(F.STALL_FEATURE_NAMES),
            "memory_feature_names": list(F.MEMORY_FEATURE_NAMES)}


def _component_pattern(state: dict[str, Any]) -> re.Pattern[str]:
    """The names of component files under the learned attributes ``state`` names (and the
    names that some keep, ``_NAMES``): what a save removes where this model has none."""
    roots = sorted({*state, *_NAMES.values()})
    return re.compile(rf"^({'|'.join(map(re.escape, roots))})(\..+)?\.json$")


def _remove_stale_temporaries(path: Path) -> None:
    """Temporaries of a save killed part-way (not of one in flight where flock is missing):
    the boosters' and the manifest's (paratune.fileio's atomic writes)."""
    for leftover in [*path.glob(".*.tmp.json"), *path.glob(f".{_MANIFEST}.*.tmp")]:
        with contextlib.suppress(OSError):
            if leftover.stat().st_mtime < time.time() - 60:
                leftover.unlink()


def _directory_lock(path: Path, what: str) -> contextlib.AbstractContextManager[bool]:
    """The lock that saves into (and loads from) one model directory take turns on."""
    return exclusive_lock(path / _LOCK_FILE, field="path", value=str(path),
                          what=f"{what} a performance model there", wait_s=_LOCK_WAIT_S)


