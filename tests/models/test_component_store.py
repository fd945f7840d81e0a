"""The generic component store: a tree of small estimators, boosters, dicts and lists saved as
XGBoost JSON files named by attribute path, with a SHA-256 each, and read back exactly."""

from __future__ import annotations

import numpy as np
import pytest

from paratune.errors import ModelFormatError
from paratune.models._component_store import load_components, save_components
from paratune.models._components import FamilyRouter, StepTimeEstimator

_PARAMS = {"n_estimators": 5, "max_depth": 2, "learning_rate": 0.3, "n_jobs": 1,
           "random_state": 0}


def _router():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 4))
    y = X[:, 0] + 0.1 * rng.normal(size=200)
    families = np.where(np.arange(200) < 100, "a", "b").astype(object)
    keys = np.where(np.arange(200) % 2 == 0, "m1", "m2").astype(object)
    hardware = np.where(np.arange(200) < 100, "H100-80GB", "A100-80GB").astype(object)
    router = FamilyRouter(estimator=StepTimeEstimator(params=_PARAMS, aux_params=_PARAMS),
                          transfer_columns=[0, 1], min_family_rows=50)
    return router.fit(X, y, keys=keys, families=families, hardware=hardware), X, keys


def _load(path, saved, manifest_extra=None):
    manifest = {"components": saved.files, "component_sha256": saved.digests,
                **(manifest_extra or {})}
    return load_components(path, manifest, saved.tree, manifest_name="model.json",
                           max_bytes=1 << 30, kinds=(FamilyRouter, StepTimeEstimator))


def test_a_tree_is_saved_by_attribute_path_and_loads_to_the_same_predictions(tmp_path):
    router, X, keys = _router()
    tree = {"router": router, "plain": {"x": [1, 2.5, None, "s"]}}
    saved = save_components(tmp_path, tree, names={"router.overall.median": "median"})
    assert "router.families.a.median.json" in saved.files.values()
    assert saved.files["median"] == "median.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(saved.files.values())
    back = _load(tmp_path, saved)
    assert back["plain"] == tree["plain"]
    route = router.route(len(X), np.full(len(X), "A100-80GB", dtype=object), None)
    for got, want in zip(back["router"].predict(X, keys, route), router.predict(X, keys, route),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_changed_file_or_an_unknown_class_is_refused(tmp_path):
    router, _, _ = _router()
    saved = save_components(tmp_path, {"router": router})
    (tmp_path / "router.overall.refine.json").write_bytes(
        (tmp_path / "router.overall.median.json").read_bytes())
    with pytest.raises(ModelFormatError, match="SHA-256"):
        _load(tmp_path, saved)
    saved.tree["router"]["__estimator__"] = "os.system"
    with pytest.raises(ModelFormatError, match=r"unknown estimator 'os\.system'"):
        _load(tmp_path, saved)
