from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import paratune.datasets._store as store
from paratune import DatasetError, Measurement, ParallelConfig, Status, get_model
from paratune.cli import main
from paratune.datasets import (
    SCHEMA_VERSION,
    DatasetCard,
    read_dataset,
    read_datasets,
    write_dataset,
)
from paratune.datasets.schema import CARD_FILE, arrow_schema, column_types
from paratune.errors import SchemaVersionError
from paratune.measurement import FINGERPRINT_FIELDS

FINGERPRINT = {"device_name": "cpu", "device_count": 2, "cpu": "x86_64", "torch_version": "2.x",
               "cuda_version": "", "nccl_version": "", "python_version": "3.11",
               "hostname": "node0"}


def _records() -> list[Measurement]:
    model = get_model("tiny")
    return [
        Measurement(model=model, config=ParallelConfig(dp=2, global_batch_size=8),
                    hardware="cpu", step_times_s=[0.10, 0.12, 0.11], peak_rss_gb=0.5,
                    warmup_steps=1, fingerprint=FINGERPRINT, campaign_id="c1", loss=5.5),
        Measurement(model=model, config=ParallelConfig(tp=2, micro_batch_size=2,
                                                       global_batch_size=8),
                    hardware="cpu", step_times_s=[0.2, 0.3], fingerprint=FINGERPRINT),
        Measurement(model=model, config=ParallelConfig(pp=2, global_batch_size=8,
                                                       schedule="gpipe"),
                    hardware="cpu", status=Status.OOM, error="CUDA out of memory",
                    fingerprint=FINGERPRINT),
    ]


def _parquet_files(path):
    return sorted(path.glob("*.parquet"))


def test_round_trip_keeps_every_column_and_record(tmp_path):
    records = _records()
    card = DatasetCard(campaign_id="c1", fingerprint=FINGERPRINT, grid={"model": "tiny"})
    write_dataset(tmp_path / "ds", records, card=card)
    ds = read_dataset(tmp_path / "ds")
    assert list(ds.frame.columns) == list(records[0].to_row())
    assert len(ds) == 3 and ds.card.num_rows == 3
    assert ds.card.campaign_id == "c1" and ds.card.schema_version == SCHEMA_VERSION
    assert ds.card.grid == {"model": "tiny"} and ds.card.fingerprint["device_count"] == 2
    assert ds.frame["step_times_s"][0] == [0.10, 0.12, 0.11]
    assert ds.frame["step_times_s"][2] == []
    for original, back in zip(records, ds.measurements()):
        # pytest.approx compares flat mappings only (pytest 9 refuses a nested list value):
        # the list column on its own, the rest with approx.
        row, expected = back.to_row(), original.to_row()
        assert row.pop("step_times_s") == pytest.approx(expected.pop("step_times_s"))
        assert row == pytest.approx(expected, nan_ok=True)
        assert (back.model, back.config, back.status) == (original.model, original.config,
                                                          original.status)
    # The Arrow types are the declared ones, not whatever pandas inferred.
    table = pq.read_table(tmp_path / "ds" / ds.card.data_file)
    for name, kind in column_types().items():
        assert table.schema.field(name).type == arrow_schema().field(name).type, (name, kind)


def test_lone_parquet_file_is_self_describing(tmp_path):
    ds = write_dataset(tmp_path / "ds", _records(), card={"campaign_id": "abc"})
    lone = read_dataset(tmp_path / "ds" / ds.card.data_file)
    assert lone.card.campaign_id == "abc" and len(lone) == 3
    assert read_dataset(tmp_path / "ds" / CARD_FILE).card.campaign_id == "abc"


def test_rewrite_replaces_data_and_leaves_one_file(tmp_path):
    path = tmp_path / "ds"
    (path).mkdir()
    (path / "journal.jsonl").write_text("{}\n")  # other files in the directory are kept
    write_dataset(path, _records()[:1])
    write_dataset(path, _records())
    assert len(_parquet_files(path)) == 1 and (path / "journal.jsonl").exists()
    assert len(read_dataset(path)) == 3


def test_writer_killed_before_card_leaves_old_dataset_readable(tmp_path, monkeypatch):
    path = tmp_path / "ds"
    write_dataset(path, _records()[:1], card={"campaign_id": "old"})

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed between data and card")

    monkeypatch.setattr(store, "atomic_write_text", die)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(path, _records(), card={"campaign_id": "new"})
    monkeypatch.undo()
    ds = read_dataset(path)
    assert ds.card.campaign_id == "old" and len(ds) == 1


def test_not_a_dataset_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: not a paratune dataset \(no card.json\)"):
        read_dataset(tmp_path / "empty")
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), other)
    with pytest.raises(DatasetError, match=r"other\.parquet: not a paratune dataset"):
        read_dataset(other)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(DatasetError, match=r"notes\.txt: not a paratune dataset"):
        read_dataset(text)
    card_only = tmp_path / "cardonly"
    card_only.mkdir()
    (card_only / CARD_FILE).write_text(json.dumps({"hello": 1}))
    with pytest.raises(DatasetError, match="no schema_version"):
        read_dataset(card_only)


def test_truncated_files_are_reported(tmp_path):
    ds = write_dataset(tmp_path / "ds", _records())
    data = tmp_path / "ds" / ds.card.data_file
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DatasetError, match="truncated"):
        read_dataset(tmp_path / "ds")
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        read_dataset(data)  # the lone file, without the card's checksum
    ds = write_dataset(tmp_path / "ds2", _records())
    card = tmp_path / "ds2" / CARD_FILE
    card.write_text(card.read_text()[:40])
    with pytest.raises(DatasetError, match=r"card\.json is not valid JSON"):
        read_dataset(tmp_path / "ds2")
    ds = write_dataset(tmp_path / "ds3", _records())
    (tmp_path / "ds3" / ds.card.data_file).unlink()
    with pytest.raises(DatasetError, match="is missing"):
        read_dataset(tmp_path / "ds3")


def test_newer_schema_version_is_refused(tmp_path):
    write_dataset(tmp_path / "ds", _records())
    card_path = tmp_path / "ds" / CARD_FILE
    card = json.loads(card_path.read_text())
    card["schema_version"] = SCHEMA_VERSION + 1
    card_path.write_text(json.dumps(card))
    with pytest.raises(SchemaVersionError, match=f"schema_version={SCHEMA_VERSION + 1} is newer"):
        read_dataset(tmp_path / "ds")


def test_bad_frames_name_the_column(tmp_path):
    frame = store.records_to_frame(_records())
    with pytest.raises(DatasetError, match="column 'dp' is required"):
        write_dataset(tmp_path / "a", frame.drop(columns=["dp"]))
    bad = frame.copy()
    bad["status"] = ["ok", "exploded", "ok"]
    with pytest.raises(DatasetError, match="status='exploded' must be one of"):
        write_dataset(tmp_path / "b", bad)
    bad = frame.copy()
    bad["tp"] = bad["tp"].astype(object)
    bad.loc[1, "tp"] = "two"
    with pytest.raises(DatasetError, match="column 'tp' does not fit type int64"):
        write_dataset(tmp_path / "c", bad)
    bad = frame.copy()
    bad.loc[0, "seq_len"] = None
    with pytest.raises(DatasetError, match="column 'seq_len' must not be empty"):
        write_dataset(tmp_path / "d", bad)
    with pytest.raises(DatasetError, match=r"directory, not a \.parquet"):
        write_dataset(tmp_path / "e.parquet", frame)


def test_minimal_frame_gets_defaults_and_derived_columns(tmp_path):
    frame = pd.DataFrame({
        "model_name": ["m"], "num_layers": [4], "hidden_size": [128], "num_heads": [8],
        "ffn_hidden_size": [352], "vocab_size": [256], "seq_len": [128], "dp": [2], "tp": [2],
        "pp": [1], "micro_batch_size": [1], "global_batch_size": [8], "hardware": ["H100-80GB"],
        "status": ["ok"], "tokens_per_s": [1000.0], "source_note": ["table 3"],
    })
    ds = write_dataset(tmp_path / "ds", frame, card={"source": "paper"})
    back = read_dataset(tmp_path / "ds")
    row = back.frame.iloc[0]
    assert row["world_size"] == 4 and row["num_microbatches"] == 4
    assert row["num_kv_heads"] == 8 and row["tokens_per_s_per_device"] == 250.0
    assert row["sharding"] == "none" and math.isnan(row["step_time_s"])
    assert row["source_note"] == "table 3"  # extra columns are kept
    assert back.card.source == "paper" and ds.card.num_rows == 1
    m = back.measurements()[0]
    assert m.config.world_size == 4 and m.fingerprint["device_count"] is None


def test_a_dataset_without_rows_writes_and_reads_back(tmp_path):
    from paratune.datasets.schema import column_types

    ds = write_dataset(tmp_path / "ds", [], card={"source": "nothing measured yet"})
    back = read_dataset(tmp_path / "ds")
    assert len(back.frame) == 0 and ds.card.num_rows == 0
    assert list(back.frame.columns) == list(column_types())


def test_read_datasets_concatenates(tmp_path):
    write_dataset(tmp_path / "a", _records()[:2])
    write_dataset(tmp_path / "b", _records())
    frame = read_datasets([tmp_path / "a", tmp_path / "b"], label_column="dataset")
    assert len(frame) == 5
    assert frame["dataset"].tolist().count(str(tmp_path / "a")) == 2
    with pytest.raises(DatasetError, match="no dataset paths"):
        read_datasets([])


def test_datasets_show_cli(tmp_path, capsys):
    write_dataset(tmp_path / "ds", _records(),
                  card={"campaign_id": "c9", "fingerprint": FINGERPRINT,
                        "notes": {"skipped_per_world_size": {"2": 5}}})
    assert main(["datasets", "show", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "campaign  c9" in out and "device_name=cpu" in out
    header, _rule, row = out.strip().splitlines()[-3:]
    assert header.split()[:9] == ["model", "hardware", "world", "configs", "ok", "oom", "error",
                                  "timeout", "skipped"]
    assert row.split()[:9] == ["tiny", "cpu", "2", "3", "2", "1", "0", "0", "5"]
    assert row.split()[-1] == "dp2-tp1-pp1-mb1-gb8-1f1b-v1-none-none"
    assert main(["datasets", "show", str(tmp_path / "nope")]) == 2


def _show(path, capsys) -> str:
    assert main(["datasets", "show", str(path)]) == 0
    return capsys.readouterr().out


def _table_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["world", "planned"])
    return [line.split() for line in lines[start + 2:] if line.strip() and
            line.split()[0].isdigit()]


def test_datasets_show_of_an_unfinished_campaign_says_how_far_it_got(tmp_path, capsys):
    """A campaign directory whose profiling stopped (killed) holds journals and perhaps a
    dataset of an earlier point: show says it is unfinished, how many configs each world
    size has journaled of those planned, and how to finish it; once finished, the dataset."""
    from paratune.profiler._journal import append_record, failure_record, read_plan
    from paratune.profiler.campaign import CampaignSpec, materialise, prepare_campaign
    from paratune.space import ConfigSpace

    spec = CampaignSpec(model=get_model("tiny"), world_sizes=(1, 2), warmup_steps=1,
                        measured_steps=2,
                        space=ConfigSpace(micro_batch_sizes=[2], shardings=["none"],
                                          recomputes=["none"]))
    out = tmp_path / "c"
    paths, meta = prepare_campaign(spec, out, measure_here=False)
    plans = {ws: read_plan(paths.plan(ws)) for ws in (1, 2)}
    planned = {ws: len(plan["configs"]) for ws, plan in plans.items()}
    assert planned == {1: 1, 2: 5}

    def journal(world_size: int, configs: list[dict]) -> None:  # as the campaign does
        for config in configs:
            append_record(paths.journal(world_size), failure_record(
                plans[world_size], ParallelConfig.from_dict(config), Status.OOM, "oom"))

    resume = f"finish it with: paratune profile --out {out} --resume"
    # killed before any config finished: no dataset yet
    text = _show(out, capsys)
    assert text.startswith(f"campaign  {meta['campaign_id']} in {out}: unfinished")
    assert _table_rows(text) == [["1", "1", "0", "1"], ["2", "5", "0", "5"]]
    assert "written before it stopped" not in text and text.rstrip().endswith(resume)
    # killed in world size 2: the dataset written after world size 1 is stale
    journal(1, plans[1]["configs"])
    materialise(out)
    journal(2, plans[2]["configs"][:2])
    for path in (out, out / CARD_FILE):
        text = _show(path, capsys)
        assert _table_rows(text) == [["1", "1", "1", "0"], ["2", "5", "2", "3"]]
        assert "dataset   1 rows, written before it stopped (the journals hold 3)" in text
        assert text.rstrip().endswith(resume)
    # every config journaled, the dataset not yet rewritten
    journal(2, plans[2]["configs"][2:])
    text = _show(out, capsys)
    assert "every planned config is journaled (6), but its dataset holds only 1 rows" in text
    assert f"paratune profile --out {out} --resume" in text
    materialise(out)  # finished: the dataset, as for any other
    text = _show(out, capsys)
    assert "unfinished" not in text and "--resume" not in text
    assert text.startswith(f"dataset   {out}") and "rows      6" in text


@pytest.mark.slow
def test_datasets_show_of_a_killed_campaign(tmp_path, capsys):
    """A real campaign killed with SIGKILL in world size 2, while its second config there
    hangs (the first is journaled): where the kill lands does not depend on the pace."""
    import signal

    from tests.profiler.test_campaign import KEYS_WS2

    grid = tmp_path / "grid.yaml"
    grid.write_text("micro_batch_sizes: [2]\nshardings: [none]\nrecomputes: [none]\n")
    from paratune.profiler._journal import journal_keys

    out = tmp_path / "k"
    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:  # a file: a pipe nobody reads could fill and block it
        parent = subprocess.Popen(
            [sys.executable, "-m", "paratune", "profile", "--model", "tiny", "--world-sizes",
             "1,2", "--grid", str(grid), "--out", str(out), "--warmup", "1", "--steps", "2",
             "--device", "cpu", "--no-track", "--no-progress"], stdout=subprocess.DEVNULL,
            stderr=stderr, env=dict(os.environ, OMP_NUM_THREADS="1",
                                    PARATUNE_FAULT=f"hang:{KEYS_WS2[1]}:0"))
    journal2 = out / "journal-ws2.jsonl"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and parent.poll() is None:
            if journal2.exists() and journal2.read_text().strip():
                break
            time.sleep(0.1)
        assert parent.poll() is None, log.read_text()
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    # as the journal's reader counts them (a line the kill cut short is no config)
    done = len(journal_keys(journal2))
    text = _show(out, capsys)
    assert "unfinished" in text
    rows = _table_rows(text)
    assert rows[0] == ["1", "1", "1", "0"]
    assert rows[1][:2] == ["2", "5"] and int(rows[1][2]) == done == 1
    assert "dataset   1 rows, written before it stopped" in text
    assert text.rstrip().endswith(f"finish it with: paratune profile --out {out} --resume")


def test_fingerprint_columns_follow_the_record():
    assert set(FINGERPRINT_FIELDS) <= set(column_types())


def test_datasets_import_cli_writes_a_readable_dataset(tmp_path, capsys):
    repo = Path(__file__).resolve().parents[2]
    public = Path(os.environ.get("PARATUNE_PUBLIC_DATA", repo.parent / "shared/data/public-gpu"))
    source = public / "vtrain_a100_single_node.csv"
    if not source.exists():
        pytest.skip(f"public GPU measurements not found at {public}")
    assert main(["datasets", "import", str(source), "--out", str(tmp_path / "pub")]) == 0
    out = capsys.readouterr().out
    dataset = read_dataset(tmp_path / "pub")
    assert len(dataset) > 0 and set(dataset.frame["hardware"]) == {"A100-80GB"}
    assert f"rows      {len(dataset)}" in out and "A100-80GB" in out
    assert all(m.config.world_size in (2, 4, 8) for m in dataset.measurements()[:50])


def test_datasets_import_refuses_to_replace_a_dataset_without_force(tmp_path, capsys):
    source = tmp_path / "vtrain.csv"
    source.write_text(
        "source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
        "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
        "step_time_s,tokens_per_sec_per_gpu,precision,notes\n"
        "vtrain_ground_truth_single_node,GPT,,24,1024,16,1024,A100,2,1,2,1,1,8,16,,full,,,,"
        "0.372,,,\n")
    out = tmp_path / "pub"
    assert main(["datasets", "import", str(source), "--out", str(out)]) == 0
    card = (out / "card.json").read_text()
    assert main(["datasets", "import", str(source), "--out", str(out)]) == 2
    assert "already holds a dataset; pass --force" in capsys.readouterr().err
    assert (out / "card.json").read_text() == card
    assert main(["datasets", "import", str(source), "--out", str(out), "--force"]) == 0
    assert len(read_dataset(out)) == 1


def test_a_measurement_without_fingerprint_writes(tmp_path):
    # to_row writes "" for the unknown device count: a missing number, whatever the dtype
    # pandas gives the column (object, or str under pandas 3)
    record = Measurement(model=get_model("tiny"), config=ParallelConfig(), hardware="cpu",
                         step_times_s=[1.0])
    write_dataset(tmp_path / "ds", [record])
    assert read_dataset(tmp_path / "ds").frame["device_count"].tolist() == [None]


def test_a_file_without_an_optional_column_reads_with_its_default(tmp_path):
    ds = write_dataset(tmp_path / "ds", _records())
    table = pq.read_table(tmp_path / "ds" / ds.card.data_file)
    older = table.drop_columns(["device_count", "world_size", "cp"]).replace_schema_metadata(
        table.schema.metadata)
    pq.write_table(older, tmp_path / "older.parquet")
    back = read_dataset(tmp_path / "older.parquet")
    assert back.frame["device_count"].tolist() == [None] * 3
    assert back.frame["world_size"].tolist() == [2, 2, 2]
    # a file written before the context-parallel degree was stored: whole sequences
    assert back.frame["cp"].tolist() == [1, 1, 1]
    assert [m.config.world_size for m in back.measurements()] == [2, 2, 2]
    # filled columns have the types a file with them reads back with
    fresh = read_dataset(tmp_path / "ds").frame
    dropped = table.drop_columns(["mfu", "peak_rss_gb", "virtual_stages"])
    pq.write_table(dropped.replace_schema_metadata(table.schema.metadata),
                   tmp_path / "older2.parquet")
    filled = read_dataset(tmp_path / "older2.parquet").frame
    for column in ("mfu", "peak_rss_gb", "virtual_stages"):
        assert filled[column].dtype == fresh[column].dtype, column


def test_concurrent_writers_take_turns_and_leave_a_readable_dataset(tmp_path, monkeypatch):
    # Writer "slow" pauses between placing its data file and its card; a second writer
    # meanwhile must not delete that data file (the card about to be written names it).
    path = tmp_path / "ds"
    write_dataset(path, _records()[:1])
    paused, resume = threading.Event(), threading.Event()
    real_write_text = store.atomic_write_text

    def slow_card(*args, **kwargs):
        if threading.current_thread().name == "slow":
            paused.set()
            resume.wait(10)
        return real_write_text(*args, **kwargs)

    monkeypatch.setattr(store, "atomic_write_text", slow_card)
    errors = []

    def write(records):
        try:
            write_dataset(path, records)
        except Exception as exc:  # reported below
            errors.append(exc)

    slow = threading.Thread(target=write, args=(_records()[:2],), name="slow")
    fast = threading.Thread(target=write, args=(_records(),), name="fast")
    slow.start()
    assert paused.wait(10)
    fast.start()
    fast.join(0.5)
    resume.set()
    slow.join(10)
    fast.join(10)
    assert not errors
    assert len(read_dataset(path)) == 3  # the second writer's rows, complete
    assert len(_parquet_files(path)) == 1


def test_write_lock_held_too_long_is_a_clear_error(tmp_path):
    path = tmp_path / "ds"
    write_dataset(path, _records()[:1])
    held = pytest.raises(DatasetError, match=r"another process .* is writing this dataset \(waited")
    with store._write_lock(path), held, store._write_lock(path, timeout_s=0.1):
        pass
    assert len(read_dataset(path)) == 1


def test_writer_killed_mid_write_keeps_the_stored_rows(tmp_path):
    # A real SIGKILL while a process rewrites the dataset in a loop: the dataset read
    # afterwards is one complete version, and the next write removes the killed write's
    # temporary files.
    path = tmp_path / "ds"
    write_dataset(path, _records())
    script = (
        "import sys, pandas as pd\n"
        "from paratune.datasets import read_dataset, write_dataset\n"
        "frame = read_dataset(sys.argv[1]).frame\n"
        "big = pd.concat([frame] * 5000, ignore_index=True)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    write_dataset(sys.argv[1], big)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.8)
    finally:
        proc.kill()
        proc.wait()
    assert len(read_dataset(path)) in (3, 15000)
    (path / ".measurements-0123456789ab.parquet.x1y2.tmp").write_bytes(b"half a file")
    write_dataset(path, _records()[:1])
    assert [p.name for p in path.iterdir() if p.name.endswith(".tmp")] == []
    assert len(read_dataset(path)) == 1


def test_rewriting_a_dataset_of_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "ds"
    write_dataset(path, _records())
    card_path = path / CARD_FILE
    card = json.loads(card_path.read_text())
    card["schema_version"] = SCHEMA_VERSION + 1
    card_path.write_text(json.dumps(card))
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(SchemaVersionError, match=f"holds a dataset of schema_version="
                                                 f"{SCHEMA_VERSION + 1}, newer"):
        write_dataset(path, _records()[:1])
    assert sorted(p.name for p in path.iterdir()) == before
    assert json.loads(card_path.read_text()) == card


@pytest.mark.parametrize(("field", "value", "message"), [
    ("data_file", 5, "data_file=5 must be a string"),
    ("data_file", "../other/measurements-x.parquet", "must be a file name in the dataset"),
    ("num_rows", "3", "num_rows='3' must be a non-negative integer"),
    ("fingerprint", ["cpu"], r"fingerprint=\['cpu'\] must be a JSON object"),
])
def test_a_damaged_card_is_refused_naming_the_field(tmp_path, field, value, message):
    path = tmp_path / "ds"
    write_dataset(path, _records())
    card = json.loads((path / CARD_FILE).read_text())
    card[field] = value
    (path / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(DatasetError, match=message):
        read_dataset(path)


def test_a_missing_card_points_at_the_self_describing_data_file(tmp_path):
    ds = write_dataset(tmp_path / "ds", _records())
    (tmp_path / "ds" / CARD_FILE).unlink()
    with pytest.raises(DatasetError, match=rf"no card\.json\); it holds {ds.card.data_file}"):
        read_dataset(tmp_path / "ds")
    assert len(read_dataset(tmp_path / "ds" / ds.card.data_file)) == 3


# ---------------------------------------------------------------------- row rules
@pytest.mark.parametrize("column, value, message", [
    ("dp", 0, r"row 1: dp=0: must be a positive integer"),
    ("schedule", "bogus", r"row 1: schedule='bogus': must be one of gpipe, 1f1b"),
    ("sharding", "zero9", r"row 1: sharding='zero9': must be one of none, zero1"),
    ("recompute", None, r"row 1: recompute=None: must be one of none, full, selective"),
    ("world_size", 7, r"row 1: world_size=7: must equal dp\*tp\*pp = 1\*2\*1 = 2"),
    ("num_microbatches", 3, r"row 1: num_microbatches=3: must equal global_batch_size // "),
    ("global_batch_size", 7, r"row 1: global_batch_size=7: must be divisible by "
                             r"dp\*micro_batch_size = 1\*2 = 2"),
    ("virtual_stages", 2, r"row 1: virtual_stages=2: must be 1 unless"),
    ("tp", 3, r"row 1: world_size=2: must equal dp\*tp\*pp = 1\*3\*1 = 3"),
    ("num_heads", 3, r"row 1: num_heads=3: must divide hidden_size=128"),
    ("step_time_s", -1.0, r"row 1: step_time_s=-1: must be a positive finite number"),
    ("tokens_per_s", math.inf, r"row 1: tokens_per_s=inf: must be a positive finite number"),
    ("tokens_per_s", 0.0, r"row 1: tokens_per_s=0: must be a positive finite number"),
    ("peak_rss_gb", -0.5, r"row 1: peak_rss_gb=-0.5: must be a non-negative finite number"),
    ("mfu", 43.0, r"row 1: mfu=43: must be a fraction in \[0, 1\]"),
    ("step_times_s", [0.2, -0.3], r"row 1: step_times_s=\[0.2, -0.3\]: must hold positive"),
])
def test_a_row_its_reader_would_refuse_or_misread_is_not_written(tmp_path, column, value,
                                                                 message):
    path = tmp_path / "ds"
    write_dataset(path, _records(), card={"campaign_id": "kept"})
    frame = read_dataset(path).frame
    ok = frame.copy()  # what the project writes: CPU rows with mfu 0 or empty, failed runs
    ok.loc[0, "mfu"] = 0.0  # with no metrics (row 2), and 1.0 at most
    ok.loc[1, "mfu"] = 1.0
    write_dataset(tmp_path / "ok", ok)
    bad = frame.copy()
    bad[column] = bad[column].astype(object)
    bad.at[1, column] = value
    with pytest.raises(DatasetError, match=f"{path}: {message}"):
        write_dataset(path, bad)
    assert read_dataset(path).card.campaign_id == "kept"  # nothing was replaced


def test_the_layout_rules_are_those_of_parallel_config(tmp_path):
    # Every layout of a small grid: written exactly when ParallelConfig.validate (as for a
    # layout run elsewhere) accepts it on the row's model; and the read rows agree.
    from paratune.errors import ConfigError

    model = get_model("tiny")
    base = store.records_to_frame(_records()[:1])
    rows, valid = [], []
    for dp in (1, 2, 3):
        for tp in (1, 2, 3):
            for pp in (1, 2, 4):
                for mbs, gbs in ((1, 4), (2, 4), (1, 6), (2, 16)):
                    for schedule, stages in (("1f1b", 1), ("gpipe", 1), ("gpipe", 2),
                                             ("interleaved_1f1b", 1), ("interleaved_1f1b", 2)):
                        fields = dict(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs,
                                      global_batch_size=gbs, schedule=schedule,
                                      virtual_stages=stages)
                        try:
                            ParallelConfig(**fields).validate(model, runnable=False)
                            valid.append(True)
                        except ConfigError:
                            valid.append(False)
                        rows.append({**base.iloc[0].to_dict(), **fields, "world_size": dp * tp * pp,
                                     "num_microbatches": gbs // (dp * mbs)})
    assert 0 < sum(valid) < len(valid)
    table = pa.Table.from_pandas(pd.DataFrame(rows)[list(column_types())], schema=arrow_schema(),
                                 preserve_index=False)
    for i, ok in enumerate(valid):  # the typed rows, one at a time, as _normalise checks them
        if ok:
            store._check_rows(table.slice(i, 1), "x")
        else:
            with pytest.raises(DatasetError, match=r"x: row 0: \w+="):
                store._check_rows(table.slice(i, 1), "x")
    good = pd.DataFrame([r for r, ok in zip(rows, valid) if ok])
    written = write_dataset(tmp_path / "ds", good)
    assert len(read_dataset(tmp_path / "ds").measurements()) == len(written) == sum(valid)


def test_an_empty_world_size_is_derived_not_kept(tmp_path):
    frame = store.records_to_frame(_records())
    frame["world_size"] = frame["world_size"].astype(object)
    frame.loc[1, "world_size"] = None
    frame.loc[2, "world_size"] = ""
    write_dataset(tmp_path / "ds", frame)
    assert read_dataset(tmp_path / "ds").frame["world_size"].tolist() == [2, 2, 2]
    bad = frame.copy()
    bad.loc[1, "world_size"] = 3
    with pytest.raises(DatasetError, match=r"row 1: world_size=3: must equal dp\*tp\*pp"):
        write_dataset(tmp_path / "bad", bad)


# ---------------------------------------------------------------------- replacing data
def _public_csv(path: Path, rows: int) -> Path:
    lines = ["source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
             "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
             "step_time_s,tokens_per_sec_per_gpu,precision,notes"]
    for i in range(rows):
        lines.append(f"vtrain_ground_truth_single_node,GPT,,{2 + i % 40},1024,16,"
                     f"{512 * (1 + i // 40 % 8)},A100,2,1,2,1,1,8,16,,full,,,,"
                     f"{3 + i / 10000:.4f},,,")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_concurrent_imports_into_one_directory_one_fails(tmp_path):
    # Two processes import into the same --out at once: the check that --out holds no
    # dataset is made under the dataset's write lock, so exactly one import writes and the
    # other is refused; the dataset left is the winner's, complete.
    sizes = {"a": 3000, "b": 2000}
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "paratune.cli", "datasets", "import",
         str(_public_csv(tmp_path / f"{name}.csv", n)), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        for name, n in sizes.items()}
    results = {name: (p.wait(120), p.stderr.read()) for name, p in procs.items()}
    for p in procs.values():
        p.stdout.close()
        p.stderr.close()
    winners = [name for name, (rc, _) in results.items() if rc == 0]
    assert len(winners) == 1, results
    loser = "b" if winners == ["a"] else "a"
    rc, err = results[loser]
    assert rc == 2 and f"--out={str(out)!r}: already holds a dataset; pass --force" in err, err
    assert len(read_dataset(out)) == sizes[winners[0]]
    assert len(_parquet_files(out)) == 1


def test_a_directory_holding_a_data_file_without_its_card_is_not_replaced(tmp_path, capsys):
    # A dataset whose card was removed still holds data (`datasets show` points at its
    # parquet file): importing into it needs --force, and even then only the data file the
    # previous card named is removed.
    copy = tmp_path / "copy"
    kept = write_dataset(copy, _records()).card.data_file
    (copy / CARD_FILE).unlink()
    source = _public_csv(tmp_path / "in.csv", 2)
    assert main(["datasets", "import", str(source), "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "already holds a dataset; pass --force" in err
    with pytest.raises(store.DatasetExistsError, match="already holds a dataset"):
        write_dataset(copy, _records()[:1], replace=False)
    assert len(read_dataset(copy / kept)) == 3
    assert main(["datasets", "import", str(source), "--out", str(copy), "--force"]) == 0
    assert len(read_dataset(copy)) == 2 and len(read_dataset(copy / kept)) == 3
    previous = read_dataset(copy).card.data_file
    # the data file of a write killed before its card (named by the pending-write note)
    # goes with the next write; the stray file stays
    (copy / "measurements-0123456789ab.parquet").write_bytes((copy / previous).read_bytes())
    (copy / store._PENDING_FILE).write_text("measurements-0123456789ab.parquet\n")
    write_dataset(copy, _records()[:1])
    names = sorted(p.name for p in _parquet_files(copy))
    assert names == sorted([kept, read_dataset(copy).card.data_file])
    assert not (copy / store._PENDING_FILE).exists()


def test_replace_false_refuses_a_dataset_under_the_lock(tmp_path):
    path = tmp_path / "ds"
    write_dataset(path, _records(), replace=False)  # an empty directory: written
    card = (path / CARD_FILE).read_text()
    with pytest.raises(store.DatasetExistsError, match=rf"{path}: already holds a dataset"):
        write_dataset(path, _records()[:1], replace=False)
    assert (path / CARD_FILE).read_text() == card and len(_parquet_files(path)) == 1
    write_dataset(path, _records()[:1])
    assert len(read_dataset(path)) == 1 and len(_parquet_files(path)) == 1
