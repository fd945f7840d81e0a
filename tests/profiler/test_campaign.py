"""Real campaigns: faults isolated and recorded, kill -9 and resume, torchrun launches,
timeouts and the machines a campaign ran on."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratune import ConfigError, ParallelConfig, Status, get_model
from paratune.cli import main
from paratune.datasets import read_dataset
from paratune.profiler._journal import (
    CampaignPaths,
    EventLog,
    append_record,
    failure_record,
    journal_keys,
    read_journal,
    read_plan,
    resolve_unfinished,
)
from paratune.profiler.campaign import (
    CampaignError,
    CampaignResult,
    CampaignSpec,
    LaunchOptions,
    enumerate_campaign,
    materialise,
    prepare_campaign,
    run_campaign,
    torchrun_commands,
)
from paratune.space import ConfigSpace
from tests.profiler._campaign import KEYS_WS2, TINY
from tests.profiler._campaign import campaign_spec as _spec

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- real campaigns
@pytest.mark.slow
def test_faults_are_isolated_and_recorded(tmp_path):
    """A hang, an exception on one rank, a rank killed by a signal and an OOM each become
    that config's status, and the campaign measures the rest."""
    faults = ",".join([f"hang:{KEYS_WS2[1]}:1", f"raise:{KEYS_WS2[2]}:1",
                       f"exit:{KEYS_WS2[3]}:0", f"oom:{KEYS_WS2[4]}"])
    result = run_campaign(_spec(timeout_s=20.0), tmp_path / "c", track=False,
                          progress=False, launch=LaunchOptions(
                              fail_grace_s=1.0, extra_env={"PARATUNE_FAULT": faults}))
    rows = {r["key"]: r["row"] for r in read_journal(tmp_path / "c" / "journal-ws2.jsonl")}
    assert list(rows) == KEYS_WS2  # each exactly once, in plan order
    assert rows[KEYS_WS2[0]]["status"] == "ok"
    assert len(rows[KEYS_WS2[0]]["step_times_s"]) == 2 and rows[KEYS_WS2[0]]["loss"] > 0
    assert rows[KEYS_WS2[1]]["status"] == "timeout"
    assert "timeout of 20 s" in rows[KEYS_WS2[1]]["error"]
    assert rows[KEYS_WS2[2]]["status"] == "error"
    assert "rank 1: RuntimeError: injected fault on rank 1" in rows[KEYS_WS2[2]]["error"]
    assert rows[KEYS_WS2[3]]["status"] == "error"
    assert "rank 0 was killed by SIGKILL" in rows[KEYS_WS2[3]]["error"]
    assert rows[KEYS_WS2[4]]["status"] == "oom"
    assert "out of memory" in rows[KEYS_WS2[4]]["error"]
    assert result.counts[2] == {"valid": 5, "skipped": 0, "ok": 1, "oom": 1, "error": 2,
                                "timeout": 1}
    dataset = read_dataset(tmp_path / "c")
    assert sorted(dataset.frame["status"]) == ["error", "error", "ok", "oom", "timeout"]
    assert dataset.card.campaign_id == result.campaign_id
    # Failure rows carry the fingerprint too.
    assert dataset.frame["device_name"].all() and (dataset.frame["device_count"] == 2).all()
    launches = {p.name.split("-rank")[0] for p in (tmp_path / "c" / "logs").iterdir()}
    assert len(launches) == 4  # relaunched after the hang, the exception and the crash


@pytest.mark.slow
def test_under_torchrun_a_failed_rank_does_not_wait_for_a_stuck_peer(tmp_path):
    """Rank 1's config fails; rank 0 never reaches the exchange of outcomes (it hangs, as a
    rank stuck in a collective the failed rank left would). Under torchrun nothing but the
    ranks ends such a group: rank 1 exits for a relaunch after a short grace, not at the
    config's timeout, and the next launch records the failure from its event."""
    from paratune.profiler._journal import EXIT_RELAUNCH
    from paratune.profiler._worker import ATTEMPT_ENV, FAULT_ENV, PARENT_ENV, fail_grace_s
    from paratune.profiler.launcher import free_port

    spec = _spec(timeout_s=30.0)
    assert fail_grace_s(spec.timeout_s) < spec.timeout_s
    paths, _ = prepare_campaign(spec, tmp_path / "c")
    key = KEYS_WS2[0]
    env = {k: v for k, v in os.environ.items() if k not in (PARENT_ENV, ATTEMPT_ENV)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
               **{FAULT_ENV: f"hang:{key}:0,raise:{key}:1"})
    command = [sys.executable, "-m", "paratune.profiler._worker", "--plan",
               str(paths.plan(2))]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "wb") as handle:
                procs.append(subprocess.Popen(
                    command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        code = procs[1].wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == EXIT_RELAUNCH, logs[1].read_text()[-3000:]
    events = [json.loads(line)["event"] for line in paths.events(2, 1).read_text().splitlines()]
    assert events == ["start", "fail"]  # no timeout: it did not wait for one
    records = resolve_unfinished(paths, read_plan(paths.plan(2)))
    assert [r.config.key() for r in records] == [key]
    assert records[0].status is Status.ERROR
    assert "rank 1: RuntimeError: injected fault on rank 1" in records[0].error


@pytest.mark.slow
def test_a_group_that_never_starts_stops_the_campaign_with_its_output(tmp_path):
    with pytest.raises(CampaignError, match=r"(?s)finished no config in 3 launches.*"
                                            r"PARATUNE_FAULT='explode:x'"):
        run_campaign(_spec(world_sizes=(1,)), tmp_path / "c", track=False, progress=False,
                     launch=LaunchOptions(extra_env={"PARATUNE_FAULT": "explode:x"}))


def _workers_of(plan_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "paratune.profiler._worker" in cmdline and str(plan_dir) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_kill_9_then_resume_redoes_nothing_and_loses_nothing(tmp_path, monkeypatch):
    """The campaign parent is killed with SIGKILL mid-campaign; --resume finishes it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "c"
    grid = tmp_path / "grid.yaml"
    grid.write_text("micro_batch_sizes: [2]\nshardings: [none]\nrecomputes: [none]\n"
                    "tp_degrees: [1]\n")
    command = [sys.executable, "-m", "paratune", "profile", "--model", "tiny",
               "--world-sizes", "1,2", "--grid", str(grid), "--out", str(out), "--warmup", "1",
               "--steps", "2", "--device", "cpu", "--no-progress"]
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=dict(os.environ))
    journal2 = out / "journal-ws2.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and parent.poll() is None:
        if journal2.exists() and len(journal2.read_text().splitlines()) >= 2:
            break
        time.sleep(0.1)
    assert parent.poll() is None, parent.stderr.read().decode()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while _workers_of(out) and time.monotonic() < deadline:  # they die with their parent
        time.sleep(0.2)
    assert _workers_of(out) == []
    before = {p.name: p.read_text() for p in out.glob("journal-ws*.jsonl")}
    finished = set().union(*(journal_keys(out / name) for name in before))
    assert len(finished) >= 3  # ws=1's config and at least two of ws=2
    meta = json.loads((out / "campaign.json").read_text())
    assert meta.get("mlflow_run_id")

    paths = CampaignPaths(out)
    starts_before = _start_counts(paths)
    assert main(["profile", "--resume", "--out", str(out), "--no-progress"]) == 0
    for name, text in before.items():  # nothing lost: the old journal is a prefix
        assert (out / name).read_text().startswith(text)
    starts_after = _start_counts(paths)
    for key in finished:  # nothing redone
        assert starts_after[key] == starts_before[key]
    dataset = read_dataset(out)
    plan_keys = {ws: [ParallelConfig.from_dict(c).key() for c in
                      read_plan(paths.plan(ws))["configs"]] for ws in (1, 2)}
    assert len(dataset) == len(plan_keys[1]) + len(plan_keys[2]) == 1 + 4
    assert (dataset.frame["status"] == "ok").all()
    assert sorted(dataset.frame["world_size"].value_counts().items()) == [(1, 1), (2, 4)]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(meta["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model"] == "tiny"
    assert json.loads(run.data.params["world_sizes"]) == [1, 2]
    assert run.data.metrics["ok"] == 5 and run.data.metrics["failed"] == 0
    # every status per world size too, failed included, as docs/tracking.md lists them
    assert {k: run.data.metrics[k] for k in ("ws1_ok", "ws2_ok", "ws1_failed", "ws2_failed")
            } == {"ws1_ok": 1, "ws2_ok": 4, "ws1_failed": 0, "ws2_failed": 0}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "dataset")}
    assert "dataset/card.json" in artifacts


def _start_counts(paths: CampaignPaths) -> dict[str, int]:
    counts: dict[str, int] = {}
    for events in paths.root.glob("events/ws*/rank0.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                counts[event["key"]] = counts.get(event["key"], 0) + 1
    return counts


@pytest.mark.slow
def test_torchrun_launcher_runs_the_same_worker(tmp_path, capsys, monkeypatch):
    # a torchrun first on PATH (another installation's) is not the one a local run starts
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "torchrun").write_text("#!/bin/sh\necho another torchrun >&2\nexit 3\n")
    (other / "torchrun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    space = tmp_path / "grid.json"
    space.write_text(json.dumps({"micro_batch_sizes": [2], "shardings": ["none"],
                                 "recomputes": ["none"], "pp_degrees": [1],
                                 "tp_degrees": [1]}))
    assert main(["profile", "--launcher", "torchrun", "--world-sizes", "2", "--grid",
                 str(space), "--out", str(tmp_path / "c"), "--warmup", "1", "--steps", "2",
                 "--device", "cpu", "--no-track", "--no-progress"]) == 0
    out = capsys.readouterr().out
    dataset = read_dataset(tmp_path / "c")
    assert dataset.frame["dp"].tolist() == [2] and dataset.frame["status"].tolist() == ["ok"]
    assert dataset.card.campaign_id  # written by the workers' rank 0 and again at the end
    assert "world  valid  ok" in out


@pytest.mark.slow
def test_a_world_size_without_valid_configs_before_one_with_some(tmp_path):
    # ws=4: dp4*mb8 cannot divide the global batch of 8; ws=1: one config.
    space = ConfigSpace(micro_batch_sizes=[8], tp_degrees=[1], pp_degrees=[1],
                        shardings=["none"], recomputes=["none"])
    result = run_campaign(_spec(world_sizes=(4, 1), space=space), tmp_path / "c",
                          track=False, progress=False)
    assert result.counts[4]["valid"] == 0 and result.counts[4]["skipped"] > 0
    assert result.dataset.frame["status"].tolist() == ["ok"]


@pytest.mark.slow
def test_campaign_on_real_text(tmp_path):
    one = ConfigSpace(micro_batch_sizes=[2], shardings=["none"], recomputes=["none"])
    losses = {}
    for data in ("synthetic", "text"):
        result = run_campaign(_spec(world_sizes=(1,), space=one, data=data), tmp_path / data,
                              track=False, progress=False)
        frame = result.dataset.frame
        assert frame["status"].tolist() == ["ok"]
        losses[data] = float(frame["loss"].iloc[0])
    # Uniform random tokens sit at ln(256); bytes of real source code do not.
    assert losses["synthetic"] == pytest.approx(math.log(256), abs=0.05)
    assert abs(losses["text"] - losses["synthetic"]) > 1e-3
    with pytest.raises(ConfigError, match="vocab_size >= 256"):
        _spec(model=TINY.replace(vocab_size=128), data="text")


def test_a_cpu_campaign_that_cannot_fit_in_memory_is_refused_before_anything_starts(tmp_path):
    llama = get_model("llama3-8b")
    spec = CampaignSpec(model=llama, world_sizes=(8,),
                        space=ConfigSpace(global_batch_sizes=[16], micro_batch_sizes=[1],
                                          tp_degrees=[1], pp_degrees=[1], shardings=["none"],
                                          recomputes=["none"]))
    with pytest.raises(ConfigError, match=r"nothing to profile.*model='llama3-8b'.*"
                                          r"dp8-tp1-pp1-mb1-gb16.*x 8 processes"):
        run_campaign(spec, tmp_path / "c", track=False, progress=False)
    assert not (tmp_path / "c").exists()


def test_cpu_configs_that_cannot_fit_are_skipped_and_the_rest_kept(monkeypatch):
    # llama3.2-1b on 2 ranks: without sharding each rank holds ~20 GB of state, ZeRO-3
    # shards it; on a machine of 30 GB only the sharded config fits
    from paratune.profiler import _memory

    model = get_model("llama3.2-1b")
    need = {s: 2 * _memory.cpu_process_memory_gb(
        model, ParallelConfig(dp=2, global_batch_size=2, sharding=s)) for s in ("none", "zero3")}
    assert need["zero3"] < 30 < need["none"]
    monkeypatch.setattr(_memory, "physical_memory_bytes", lambda: int(30e9))
    space = ConfigSpace(global_batch_sizes=[2], micro_batch_sizes=[1], tp_degrees=[1],
                        pp_degrees=[1], shardings=["none", "zero3"], recomputes=["none"])
    enumeration = enumerate_campaign(CampaignSpec(model=model, world_sizes=(2,),
                                                  space=space))[2]
    assert [c.sharding.value for c in enumeration.valid] == ["zero3"]
    assert any("model='llama3.2-1b'" in reason and "x 2 processes" in reason
               and "30.0 GB" in reason for _, reason in enumeration.skipped)


def test_resume_keeps_the_campaigns_timeout_unless_one_is_given(tmp_path):
    """``profile --resume`` takes options not given from the campaign, the per-config
    timeout included (it is not part of the identity, so it is read from campaign.json)."""
    import argparse

    from paratune.profiler._cli import build_spec, register

    out = tmp_path / "c"
    prepare_campaign(_spec(world_sizes=(1,), timeout_s=900.0), out)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def resumed(*extra):
        args = parser.parse_args(["profile", "--out", str(out), "--resume", "--device", "cpu",
                                  *extra])
        return build_spec(args)

    spec = resumed()
    assert spec.timeout_s == 900.0 and spec.warmup_steps == 1
    prepare_campaign(spec, out, resume=True)
    assert read_plan(CampaignPaths(out).plan(1))["timeout_s"] == 900.0
    assert resumed("--timeout", "60").timeout_s == 60.0
    fresh = parser.parse_args(["profile", "--out", str(tmp_path / "new"), "--device", "cpu"])
    assert build_spec(fresh).timeout_s == 300.0


@pytest.mark.slow
def test_ok_and_failed_rows_record_the_campaigns_devices_per_node(tmp_path):
    """Measured rows used to take LOCAL_WORLD_SIZE (the world size under the local launcher)
    and failure rows the plan's value: one campaign, two node sizes."""
    space = ConfigSpace(global_batch_sizes=[4], micro_batch_sizes=[2], shardings=["none"],
                        recomputes=["none", "full"], tp_degrees=[1], pp_degrees=[1],
                        tp_within_node=False)
    failing = "dp2-tp1-pp1-mb2-gb4-1f1b-v1-none-full"
    result = run_campaign(_spec(space=space, devices_per_node=1, timeout_s=120.0),
                          tmp_path / "c", track=False, progress=False,
                          launch=LaunchOptions(fail_grace_s=1.0, extra_env={
                              "PARATUNE_FAULT": f"raise:{failing}:1"}))
    frame = result.dataset.frame
    assert sorted(frame["status"]) == ["error", "ok"]
    assert list(frame["devices_per_node"]) == [1, 1]


def test_materialise_names_every_machine_a_resumed_campaign_measured_on(tmp_path):
    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    configs = [ParallelConfig.from_dict(c) for c in plan["configs"]]
    for i, config in enumerate(configs):
        # the first two on one host, the rest after a resume on another torch and host
        host, torch_version = ("node-a", "2.13.0") if i < 2 else ("node-b", "2.14.0")
        record = failure_record(plan, config, Status.OK, "",
                                fingerprint={"hostname": host, "torch_version": torch_version})
        record.step_times_s = [0.1, 0.1]
        append_record(paths.journal(2), record)
    card = materialise(paths.root).card
    assert card.fingerprint["hostname"] == "node-a"
    machines = {(m["hostname"], m["torch_version"]): m["num_ok_rows"]
                for m in card.notes["fingerprints"]}
    assert machines == {("node-a", "2.13.0"): 2, ("node-b", "2.14.0"): len(configs) - 2}
    # a campaign measured on one machine has no such note
    single = prepare_campaign(_spec(), tmp_path / "d")[0]
    for config in configs:
        record = failure_record(plan, config, Status.OK, "", fingerprint={"hostname": "a"})
        record.step_times_s = [0.1]
        append_record(single.journal(2), record)
    assert "fingerprints" not in materialise(single.root).card.notes


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, True])
def test_campaign_timeout_must_be_a_finite_positive_number(timeout):
    with pytest.raises(ConfigError, match=r"timeout_s=.*must be a finite positive number"):
        _spec(timeout_s=timeout).validate()


def test_a_cpu_allocation_failure_is_recorded_as_oom():
    """The CPU allocator's failure is a plain RuntimeError (``DefaultCPUAllocator: can't
    allocate memory``), Python's a MemoryError: both are out-of-memory failures of the
    config, as CUDA's OutOfMemoryError is, also as the cause of the error raised."""
    import torch

    from paratune.profiler._worker import is_oom

    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**62, dtype=torch.uint8)  # refused at once: nothing is allocated
    assert "can't allocate memory" in str(cpu.value) and type(cpu.value) is RuntimeError
    assert is_oom(cpu.value)
    with pytest.raises(MemoryError) as python:
        bytearray(2**62)
    assert is_oom(python.value)
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as wrapped:
        try:
            torch.empty(2**62, dtype=torch.uint8)
        except RuntimeError as exc:
            raise RuntimeError("building the model failed") from exc
    assert is_oom(wrapped.value)
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("micro batch size must divide the global batch"))


def test_resume_of_a_cuda_campaign_measured_elsewhere_writes_its_dataset_without_a_gpu(
        tmp_path, monkeypatch, capsys):
    """A campaign prepared with --print-command for CUDA and measured on a cluster: its
    --resume on a machine without a GPU writes the dataset (nothing is left to launch),
    while a resume with configs left still needs the GPUs."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    spec = _spec(device="cuda", hardware="H100-80GB")
    out = tmp_path / "c"
    torchrun_commands(spec, out)
    paths = CampaignPaths(out)
    plan = read_plan(paths.plan(2))
    configs = [ParallelConfig.from_dict(c) for c in plan["configs"]]
    assert len(configs) >= 2
    for config in configs[:-1]:  # as rank 0 of the workers journals them
        append_record(paths.journal(2), failure_record(plan, config, Status.OOM,
                                                       "rank 0: OutOfMemoryError"))
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        run_campaign(spec, out, resume=True, track=False, progress=False)
    append_record(paths.journal(2), failure_record(plan, configs[-1], Status.TIMEOUT,
                                                   "no result within the per-config timeout"))
    journal = paths.journal(2).read_text()
    assert main(["profile", "--resume", "--out", str(out), "--no-track",
                 "--no-progress"]) == 0
    assert "nothing new to measure" in capsys.readouterr().out
    dataset = read_dataset(out)
    assert sorted(dataset.frame["status"]) == ["oom"] * (len(configs) - 1) + ["timeout"]
    result = run_campaign(spec, out, resume=True, track=False, progress=False,
                          launch=LaunchOptions(launcher="torchrun"))
    assert result.num_measured == 0 and len(result.dataset) == len(configs)
    assert paths.journal(2).read_text() == journal
    assert not list(out.glob("logs/torchrun-*"))  # nothing was launched


def _pretend_rank(plan: Path) -> subprocess.Popen:
    """A process whose command line is that of a rank of ``plan``'s campaign."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--plan",
                             str(plan)], stdin=subprocess.DEVNULL)


def test_a_resume_does_not_launch_beside_ranks_of_an_earlier_launch(tmp_path, monkeypatch):
    """Ranks of an earlier launch still running on this machine (their parent killed, they
    not yet ended) would measure the configs a second time beside the new group: a resume
    waits for them to end, and refuses to launch when they do not."""
    from paratune.profiler.campaign import launch

    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    monkeypatch.setattr(launch, "_EARLIER_LAUNCH_WAIT_S", 1.0)
    rank = _pretend_rank(paths.plan(2))
    try:
        with pytest.raises(ConfigError, match=r"out=.*earlier launch of this campaign are "
                                              rf"still running \(pids {rank.pid}\)"):
            run_campaign(_spec(), paths.root, resume=True, track=False, progress=False)
    finally:
        rank.kill()
        rank.wait()
    assert not paths.journal(2).exists() and not paths.logs.exists()  # nothing launched


_EARLIER_LAUNCH = """
import sys, time
from pathlib import Path
from paratune.measurement import Status
from paratune.parallel import ParallelConfig
from paratune.profiler._journal import CampaignPaths, append_record, failure_record, read_plan
plan_path = Path(sys.argv[sys.argv.index("--plan") + 1])
plan = read_plan(plan_path)
journal = CampaignPaths(plan_path.parent).journal(plan["world_size"])
go = Path(sys.argv[sys.argv.index("--go") + 1])
while not go.exists():  # until the resume says it waits for this process
    time.sleep(0.02)
for config in plan["configs"]:
    append_record(journal, failure_record(plan, ParallelConfig.from_dict(config), Status.ERROR,
                                          "journaled by the earlier launch"))
    time.sleep(0.1)
"""


def test_a_resume_that_waited_for_an_earlier_launch_counts_only_its_own_configs(tmp_path,
                                                                              caplog):
    """What the ranks of an earlier launch journal while a resume waits for them to end is
    theirs, not the resume's: here they finish every config, and the resume measured none."""
    import threading

    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    go = tmp_path / "go"
    # a process whose command line is that of a rank of the campaign, journaling its configs
    # once the resume waits for it (released by a file, so that no sleep decides the order)
    earlier = subprocess.Popen([sys.executable, "-c", _EARLIER_LAUNCH, "--plan",
                                str(paths.plan(2)), "--go", str(go)], stdin=subprocess.DEVNULL)

    def release() -> None:
        deadline = time.monotonic() + 120
        while "of an earlier launch" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        go.touch()

    releaser = threading.Thread(target=release, daemon=True)
    try:
        with caplog.at_level("WARNING", logger="paratune.profiler.campaign"):
            releaser.start()
            result = run_campaign(_spec(), paths.root, resume=True, track=False,
                                  progress=False)
    finally:
        go.touch()
        releaser.join()
        earlier.kill()
        earlier.wait()
    assert "waiting for 1 processes of an earlier launch" in caplog.text
    assert journal_keys(paths.journal(2)) == set(KEYS_WS2)
    assert result.num_measured == 0 and result.in_step_s == 0.0
    assert result.footer().startswith("nothing new to measure: 5 configs already measured")
    assert result.worker_cpu_s >= 0.0
    assert not paths.logs.exists()  # nothing launched
    assert len(result.dataset) == len(KEYS_WS2)


def test_the_footer_never_shows_negative_worker_time(tmp_path):
    paths, meta = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    append_record(paths.journal(2), failure_record(
        plan, ParallelConfig.from_dict(plan["configs"][0]), Status.ERROR, "failed"))
    result = CampaignResult(out=paths.root, campaign_id=meta["campaign_id"],
                            dataset=materialise(paths.root), counts={}, wall_s=2.0,
                            num_measured=1, in_step_s=1.0, worker_cpu_s=-1e-12)
    assert "(workers used 0 CPU s)" in result.footer()
    result.worker_cpu_s = -0.0
    assert "(workers used 0 CPU s)" in result.footer()


def _one_config_torchrun_campaign(tmp_path: Path) -> tuple[Path, str, list[str]]:
    """``(out, key, command)``: a ``paratune profile --launcher torchrun`` command line of
    the tiny model on 2 CPU ranks whose grid holds the one config ``key``."""
    out = tmp_path / "c"
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"micro_batch_sizes": [2], "shardings": ["none"],
                                "recomputes": ["none"], "pp_degrees": [1], "tp_degrees": [1]}))
    command = [sys.executable, "-m", "paratune", "profile", "--launcher", "torchrun",
               "--model", "tiny", "--world-sizes", "2", "--grid", str(grid), "--out", str(out),
               "--warmup", "1", "--steps", "2", "--timeout", "60", "--device", "cpu",
               "--no-track", "--no-progress"]
    return out, "dp2-tp1-pp1-mb2-gb8-1f1b-v1-none-none", command


@pytest.mark.slow
def test_kill_9_of_a_torchrun_campaign_ends_torchrun_and_its_ranks(tmp_path):
    """torchrun and its ranks die with the campaign process, also when it is killed with
    SIGKILL, so that no group of the killed run measures beside a resumed one."""
    out, key, command = _one_config_torchrun_campaign(tmp_path)
    # every rank hangs in the config: the group is alive when the parent is killed
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=dict(os.environ, PARATUNE_FAULT=f"hang:{key}"))
    events = [out / "events" / "ws2" / f"rank{rank}.jsonl" for rank in range(2)]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and parent.poll() is None:
            if all(e.exists() and '"start"' in e.read_text() for e in events):
                break
            time.sleep(0.1)
        assert parent.poll() is None, parent.stderr.read().decode()
        assert len(_workers_of(out)) == 3  # torchrun and two ranks
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _workers_of(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _workers_of(out) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in _workers_of(out):
            os.kill(pid, signal.SIGKILL)


def test_a_campaign_prepared_for_a_cluster_records_the_machines_that_ran_it(
        tmp_path, monkeypatch, capsys):
    """Commands printed on a machine without a GPU, for a CUDA cluster: the rows of configs
    that failed there name the cluster's machine (the worker's fingerprint), never the one
    that prepared the campaign, and a card whose rows name no machine says none."""
    import torch

    from paratune.profiler.fingerprint import cpu_model

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    here = (cpu_model(), torch.__version__)
    node = {"device_name": "NVIDIA H100 80GB HBM3", "device_count": 2,
            "cpu": "Intel(R) Xeon(R) Platinum 8480+", "torch_version": "2.5.1+cu124",
            "cuda_version": "12.4", "nccl_version": "2.21.5", "python_version": "3.11.9",
            "hostname": "gpu-node-7"}
    assert node["torch_version"] != torch.__version__
    for name, fingerprint in (("ran", node), ("unknown", None)):
        out = tmp_path / name
        assert main(["profile", "--model", "tiny", "--world-sizes", "2", "--device", "cuda",
                     "--hardware", "H100-80GB", "--warmup", "1", "--nproc-per-node", "2",
                     "--launcher", "torchrun", "--print-command", "--out", str(out),
                     "--no-track"]) == 0
        paths = CampaignPaths(out)
        plan = read_plan(paths.plan(2))
        configs = [ParallelConfig.from_dict(c) for c in plan["configs"]]
        assert len(configs) >= 2
        # as the workers on the cluster journal them: one config timed out (resolved by the
        # next launch from its event), every other one failed while it ran
        for rank in (0, 1):
            EventLog(paths.events(2, rank), rank=rank, attempt="a1").write(
                "start", configs[0].key())
        EventLog(paths.events(2, 0), rank=0, attempt="a1").write(
            "timeout", configs[0].key(), timeout_s=plan["timeout_s"])
        resolved = resolve_unfinished(paths, plan, fingerprint=fingerprint)
        assert [r.status for r in resolved] == [Status.TIMEOUT]
        for config in configs[1:]:
            append_record(paths.journal(2), failure_record(
                plan, config, Status.OOM, "rank 0: OutOfMemoryError", fingerprint=fingerprint))
        assert main(["profile", "--resume", "--out", str(out), "--no-track",
                     "--no-progress"]) == 0
        dataset = read_dataset(out)
        frame, card = dataset.frame, dataset.card
        assert len(frame) == len(configs) and set(frame["hardware"]) == {"H100-80GB"}
        for column, value in zip(("device_name", "torch_version"), here):
            assert value not in set(frame[column]) and card.fingerprint.get(column) != value
        if fingerprint:
            assert set(frame["device_name"]) == {node["device_name"]}
            assert set(frame["hostname"]) == {"gpu-node-7"}
            assert {k: card.fingerprint[k] for k in node} == node
        else:
            assert set(frame["device_name"]) <= {"", None}
            assert card.fingerprint.get("device_name") in (None, "")
            assert card.fingerprint.get("hostname") in (None, "")
    capsys.readouterr()


def test_a_launch_stopped_from_outside_is_not_an_attempt(tmp_path):
    """Launches in which every rank wrote ``interrupted`` for a config (stopped by SIGTERM or
    SIGINT) leave it to be measured; launches that died without a word, or where only some
    ranks were stopped (a peer crashed first), still count as attempts."""
    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    for attempt in ("a1", "a2"):
        for rank in (0, 1):
            log = EventLog(paths.events(2, rank), rank=rank, attempt=attempt)
            for key in KEYS_WS2[:3]:
                log.write("start", key)
            log.write("interrupted", KEYS_WS2[0], signal="SIGTERM")
        # in KEYS_WS2[1] only rank 0 was stopped: rank 1 had died first
        EventLog(paths.events(2, 0), rank=0, attempt=attempt).write(
            "interrupted", KEYS_WS2[1], signal="SIGTERM")
    records = {r.config.key(): r for r in resolve_unfinished(paths, plan)}
    assert KEYS_WS2[0] not in records
    assert records[KEYS_WS2[1]].status is Status.ERROR
    assert records[KEYS_WS2[2]].status is Status.ERROR
    assert "in 2 launches" in records[KEYS_WS2[2]].error
    # two stopped launches and one that died: one attempt, still left to be measured
    for rank in (0, 1):
        EventLog(paths.events(2, rank), rank=rank, attempt="a3").write("start", KEYS_WS2[0])
    assert resolve_unfinished(paths, plan) == []
    assert journal_keys(paths.journal(2)) == set(KEYS_WS2[1:3])


@pytest.mark.slow
def test_sigterm_of_a_torchrun_campaign_twice_in_one_config_then_resume_measures_it(tmp_path):
    """A torchrun campaign stopped by SIGTERM twice while the same config runs: each rank
    records the stop, and the next resume measures the config instead of recording it as
    failed."""
    out, key, command = _one_config_torchrun_campaign(tmp_path)
    events = [out / "events" / "ws2" / f"rank{rank}.jsonl" for rank in range(2)]

    def starts(path: Path) -> int:
        return path.read_text().count('"start"') if path.exists() else 0

    try:
        for stop in (1, 2):
            parent = subprocess.Popen(command + (["--resume"] if stop > 1 else []),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env=dict(os.environ, PARATUNE_FAULT=f"hang:{key}"))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and parent.poll() is None:
                if all(starts(e) >= stop for e in events):
                    break
                time.sleep(0.1)
            assert parent.poll() is None, parent.stderr.read().decode()
            parent.send_signal(signal.SIGTERM)
            parent.wait(timeout=30)
            deadline = time.monotonic() + 20
            while _workers_of(out) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _workers_of(out) == []
        assert not journal_keys(out / "journal-ws2.jsonl")
        assert main(["profile", "--resume", "--out", str(out), "--launcher", "torchrun",
                     "--no-track", "--no-progress"]) == 0
        [entry] = read_journal(out / "journal-ws2.jsonl")
        assert entry["key"] == key and entry["row"]["status"] == Status.OK.value
        interrupted = [e for path in events
                       for e in map(json.loads, path.read_text().splitlines())
                       if e["event"] == "interrupted"]
        assert sorted((e["rank"], e["key"]) for e in interrupted) == [(0, key)] * 2 + [(1, key)] * 2
    finally:
        for pid in _workers_of(out):
            os.kill(pid, signal.SIGKILL)
