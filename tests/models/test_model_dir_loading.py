"""A model directory's components resolve inside it and are regular files of a bounded size:
a ``model.json`` naming ``/dev/zero``, a FIFO or a file elsewhere is refused, not read."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from paratune.errors import ModelFormatError


def _copy(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def _point(model, component, value):
    manifest = json.loads((model / "model.json").read_text())
    manifest["components"][component] = value
    (model / "model.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("where", "match"), [
    ("/dev/zero", "not the name of a file in"),
    ("../elsewhere.json", "not the name of a file in"),
    ("fifo", "not a regular file"),
    ("link", "leads out of the model directory"),
    ("device-link", "leads out of the model directory"),
])
def test_a_component_outside_the_directory_or_not_a_file_is_refused(model_dir, tmp_path, where,
                                                                     match):
    from paratune.models import load_model

    model = _copy(model_dir, tmp_path)
    if where == "fifo":
        os.mkfifo(model / "fifo")  # reading it would wait for a writer for ever
    elif where == "link":
        (tmp_path / "outside.json").write_bytes((model / "throughput.json").read_bytes())
        os.symlink(tmp_path / "outside.json", model / "link")
    elif where == "device-link":
        os.symlink("/dev/zero", model / "device-link")
    _point(model, "throughput", where)
    with pytest.raises(ModelFormatError, match=match):
        load_model(model)


def test_an_oversized_component_is_refused_before_it_is_read(model_dir, tmp_path, monkeypatch):
    from paratune.models import _persistence, load_model

    model = _copy(model_dir, tmp_path)
    monkeypatch.setattr(_persistence, "_MAX_COMPONENT_BYTES", 1000)
    with pytest.raises(ModelFormatError, match="over the limit of 1000"):
        load_model(model)


def test_a_fifo_manifest_is_refused(model_dir, tmp_path):
    from paratune.models import load_model

    model = _copy(model_dir, tmp_path)
    (model / "model.json").unlink()
    os.mkfifo(model / "model.json")
    with pytest.raises(ModelFormatError, match="not a regular file"):
        load_model(model)


def test_predict_with_a_component_at_dev_zero_is_one_line(model_dir, synthetic, tmp_path,
                                                          capsys):
    from paratune.cli import main

    model = _copy(model_dir, tmp_path)
    _point(model, "throughput", "/dev/zero")
    src = tmp_path / "rows.csv"
    synthetic.head(3).to_csv(src, index=False)
    assert main(["predict", "--model", str(model), str(src), "--out",
                 str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "/dev/zero" in err
    assert not (tmp_path / "p.csv").exists()
