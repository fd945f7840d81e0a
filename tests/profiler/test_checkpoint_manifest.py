"""A checkpoint is read only once its files match the SHA-256 manifest of its save: torch's
checkpoint reader unpickles ``.metadata``, and a pickle runs code."""

from __future__ import annotations

import os
import pickle

import pytest

from paratune.errors import ConfigError


class _Payload:
    """Unpickling this creates ``marker``: evidence that the pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _gns(tmp_path, *flags):
    out = tmp_path / "t.csv"
    return ["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.25",
            "--config", "mb=2,gb=4", "--device", "cpu", "--no-track", "--no-progress",
            "--out", str(out), *flags]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trajectory of 2 steps and its checkpoint, saved by ``paratune gns``."""
    from paratune.cli import main

    root = tmp_path_factory.mktemp("gns")
    assert main(_gns(root, "--steps", "2")) == 0
    return root


def _copy(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    return tmp_path / "t-checkpoint"


def test_a_pickle_in_place_of_the_metadata_is_refused_unread(saved, tmp_path, capsys):
    from paratune.cli import main

    ckpt = _copy(saved, tmp_path)
    rows = (tmp_path / "t.csv").read_text()
    marker = tmp_path / "the-pickle-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    capsys.readouterr()
    assert main(_gns(tmp_path, "--steps", "3", "--resume")) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert len(err.strip().splitlines()) == 1, err
    assert ".metadata is not the file saved" in err and "SHA-256" in err
    assert (tmp_path / "t.csv").read_text() == rows  # nothing measured is lost


def test_load_checkpoint_verifies_before_reading(saved, tmp_path):
    """The library's own loader (every worker calls it) checks the manifest first: a
    tampered checkpoint raises before any file is unpickled (no trainer needed to see it)."""
    from paratune.profiler.reconfigure import load_checkpoint

    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ConfigError, match=r"\.metadata is not the file saved"):
        load_checkpoint(ckpt, trainer=None)
    assert not marker.exists()


@pytest.mark.parametrize("change", ["no manifest", "added file", "symlink", "missing file",
                                    "foreign manifest"])
def test_a_checkpoint_that_is_not_the_one_saved_is_refused(saved, tmp_path, change):
    from paratune.profiler.reconfigure import MANIFEST_FILE, verify_checkpoint

    ckpt = _copy(saved, tmp_path)
    verify_checkpoint(ckpt)  # as saved: accepted
    data = sorted(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))[0]
    if change == "no manifest":
        (ckpt / MANIFEST_FILE).unlink()
        match = "has no manifest.json"
    elif change == "added file":
        (ckpt / "__9_0.distcp").write_bytes(pickle.dumps(_Payload(str(tmp_path / "x"))))
        match = "does not list"
    elif change == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(data.read_bytes())
        data.unlink()
        os.symlink(target, data)
        match = "not a regular file"
    elif change == "missing file":
        data.unlink()
        match = "is missing"
    else:
        (ckpt / MANIFEST_FILE).write_text('{"algorithm": "md5", "files": {}}')
        match = "unreadable"
    with pytest.raises(ConfigError, match=match) as info:
        verify_checkpoint(ckpt)
    assert info.value.field == "checkpoint_dir"
