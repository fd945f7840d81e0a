from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratune import ConfigError, Measurement, ParallelConfig, get_model
from paratune.measurement import FINGERPRINT_FIELDS
from paratune.profiler.equivalence import reference_step
from paratune.profiler.mesh import build_mesh
from paratune.profiler.trainer import Trainer, check_supported, measure_config, synthetic_batch
from tests.profiler._dist import init_one_process_group, one_process_group

SPEC = get_model("tiny").replace(seq_len=32)
CPU = torch.device("cpu")


def test_synthetic_batch_is_reproducible():
    a = synthetic_batch(SPEC, 4, step=3, seed=1)
    assert a.shape == (4, SPEC.seq_len + 1) and a.dtype == torch.long
    assert torch.equal(a, synthetic_batch(SPEC, 4, step=3, seed=1))
    assert not torch.equal(a, synthetic_batch(SPEC, 4, step=4, seed=1))
    assert int(a.max()) < SPEC.vocab_size


def test_check_supported_names_the_rule():
    with pytest.raises(ConfigError, match=r"zero1.*tp=1") as info:
        check_supported(SPEC, ParallelConfig(dp=2, tp=2, global_batch_size=4, sharding="zero1"))
    assert info.value.field == "sharding"
    with pytest.raises(ConfigError, match="untied embeddings"):
        check_supported(SPEC.replace(tie_embeddings=True), ParallelConfig(pp=2,
                                                                          global_batch_size=2))


def test_trainer_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        Trainer(SPEC, ParallelConfig(global_batch_size=2), device=CPU)


def test_world_one_gradient_accumulation_matches_one_big_batch(world_one):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config = ParallelConfig(micro_batch_size=2, global_batch_size=8)
        trainer = Trainer(SPEC, config, device=CPU, seed=5, lr=1e-3, weight_decay=0.1)
        tokens = synthetic_batch(SPEC, 8, step=0, seed=5)
        loss = trainer.forward_backward(tokens)
        grads = trainer.gather_full(grads=True)
        trainer.optimizer_step()
        params = trainer.gather_full()
        ref = reference_step(SPEC, tokens, seed=5, dtype=torch.float64)
    finally:
        torch.set_default_dtype(previous)
    assert loss == pytest.approx(ref["loss"], rel=1e-12)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-14)
    for name, param in ref["params"].items():
        torch.testing.assert_close(params[name], param, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in trainer.model_parts[0].parameters())


def test_training_reduces_the_loss(world_one):
    config = ParallelConfig(micro_batch_size=4, global_batch_size=4, recompute="selective")
    trainer = Trainer(SPEC, config, device=CPU, seed=0, lr=3e-3)
    tokens = synthetic_batch(SPEC, 4, step=0)
    losses = [trainer.step(tokens) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5  # memorising one batch
    with pytest.raises(ConfigError, match="tokens"):
        trainer.step(tokens[:, :-1])
    trainer.close()
    assert trainer.model_parts == [] and trainer.optimizers == []


def test_measure_config_world_one(world_one):
    details: dict[str, float] = {}
    config = ParallelConfig(micro_batch_size=2, global_batch_size=4)
    m = measure_config(SPEC, config, hardware="cpu", device=CPU, warmup_steps=1,
                       measured_steps=3, details=details)
    assert isinstance(m, Measurement) and m.ok
    assert len(m.step_times_s) == 3 and all(t > 0 for t in m.step_times_s)
    assert m.tokens_per_s == pytest.approx(4 * SPEC.seq_len / m.step_time_s)
    assert m.warmup_steps == 1 and m.measured_steps == 3
    assert 0 < m.peak_rss_gb < 64
    assert math.isnan(m.mfu)  # no honest CPU peak FLOP/s
    assert math.isnan(m.peak_mem_allocated_gb)
    assert 4.0 < m.loss < 7.0  # about log(256) = 5.5 at the start
    assert set(m.fingerprint) == set(FINGERPRINT_FIELDS)
    assert m.fingerprint["device_count"] == 1 and m.fingerprint["torch_version"]
    assert details["build_s"] > 0 and details["teardown_s"] >= 0
    assert 0 <= details["mesh_s"] <= details["build_s"] <= details["overhead_s"]
    row = Measurement.from_row(m.to_row())
    assert row.config == config and row.step_times_s == m.step_times_s
    with pytest.raises(ConfigError, match="world size"):
        measure_config(SPEC, ParallelConfig(dp=2, global_batch_size=4), hardware="cpu",
                       device=CPU)
    with pytest.raises(ConfigError, match="measured_steps"):
        measure_config(SPEC, config, hardware="cpu", device=CPU, measured_steps=0)


def _peak_rss_resettable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _peak_rss_resettable(), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_is_each_configs_own(world_one):
    """A small config measured after a big one in the same process reports its own peak,
    not the big one's (the process-lifetime high-water mark)."""
    spec = get_model("tiny")
    peaks, details = [], []
    for batch in (128, 2):
        info: dict[str, float] = {}
        m = measure_config(spec, ParallelConfig(micro_batch_size=batch, global_batch_size=batch),
                           hardware="cpu", device=CPU, warmup_steps=0, measured_steps=1,
                           details=info)
        peaks.append(m.peak_rss_gb)
        details.append(info)
    big, small = peaks
    assert details[0]["peak_rss_reset"] == details[1]["peak_rss_reset"] == 1.0
    assert details[0]["rss_peak_increase_gb"] > 0.3  # the big batch's activations
    assert small < big - 0.3, peaks
    assert small >= details[1]["rss_before_gb"] > 0


def test_devices_per_node_is_the_one_given(world_one, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # what the local launcher sets
    config = ParallelConfig(global_batch_size=2)
    common = dict(hardware="cpu", device=CPU, warmup_steps=0, measured_steps=1)
    assert measure_config(SPEC, config, devices_per_node=3, **common).devices_per_node == 3
    assert measure_config(SPEC, config, **common).devices_per_node == 8


def test_mesh_is_cached_per_shape(world_one):
    config = ParallelConfig(global_batch_size=2)
    mesh = build_mesh(config, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert build_mesh(config.replace(global_batch_size=4), "cpu") is mesh


@pytest.mark.parametrize("fails", [False, True])
def test_closing_process_group_destroys_it_after_the_body(tmp_path, fails):
    from paratune.profiler import mesh as mesh_module

    init_one_process_group(tmp_path)
    try:
        with mesh_module.closing_process_group():
            build_mesh(ParallelConfig(global_batch_size=2), "cpu")
            assert mesh_module._CACHE
            if fails:
                raise ValueError("in the body")
    except ValueError as exc:
        assert fails and str(exc) == "in the body"
    finally:
        initialized = dist.is_initialized()
        if initialized:
            dist.destroy_process_group()
    assert not initialized and not mesh_module._CACHE


# ---------------------------------------------------------------------- two processes
def _two_rank_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from paratune.profiler.gns import init_worker

    init_worker(rank, world_size, port, "cpu")
    torch.set_num_threads(1)
    out: dict = {}
    try:
        # Local gradients (sync_grads=False), then the hand reduction.
        torch.set_default_dtype(torch.float64)
        config = ParallelConfig(dp=2, micro_batch_size=2, global_batch_size=8)
        trainer = Trainer(SPEC, config, device=CPU, seed=3)
        tokens = synthetic_batch(SPEC, 8, step=0, seed=3)
        out["local_loss"] = trainer.forward_backward(tokens, sync_grads=False)
        out["local_grads"] = {n: p.grad.clone()
                              for n, p in trainer.model_parts[0].named_parameters()}
        trainer.reduce_gradients()
        out["reduced_grads"] = {n: p.grad.clone()
                                for n, p in trainer.model_parts[0].named_parameters()}
        trainer.close()
        fsdp = Trainer(SPEC, config.replace(sharding="zero3"), device=CPU, seed=3)
        try:
            fsdp.forward_backward(tokens, sync_grads=False)
        except ConfigError as exc:
            out["fsdp_error"] = str(exc)
        fsdp.close()
        torch.set_default_dtype(torch.float32)
        # Unsupported layouts raise before anything collective; the group stays usable.
        try:
            measure_config(SPEC, ParallelConfig(dp=1, tp=2, global_batch_size=2,
                                                sharding="zero1"), hardware="cpu", device=CPU)
        except ConfigError as exc:
            out["zero1_error"] = str(exc)
        out["measurements"] = []
        out["details"] = []
        for cfg in (ParallelConfig(dp=2, micro_batch_size=2, global_batch_size=4),
                    ParallelConfig(tp=2, micro_batch_size=2, global_batch_size=4),
                    ParallelConfig(pp=2, micro_batch_size=1, global_batch_size=4)):
            details: dict = {}
            m = measure_config(SPEC, cfg, hardware="cpu", device=CPU, warmup_steps=1,
                               measured_steps=2, details=details)
            out["measurements"].append(m.to_row())
            out["details"].append(details)
    except Exception:  # reported to the test through the output file
        out["error"] = traceback.format_exc()
    torch.save(out, Path(out_dir) / f"{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from paratune.profiler.gns import spawn

    out_dir = tmp_path_factory.mktemp("two_ranks")
    spawn(_two_rank_worker, 2, str(out_dir))
    outs = [torch.load(out_dir / f"{r}.pt", weights_only=False) for r in range(2)]
    for out in outs:
        assert "error" not in out, out["error"]
    return outs


@pytest.mark.slow
def test_local_gradients_are_each_ranks_own_slice(two_ranks):
    tokens = synthetic_batch(SPEC, 8, step=0, seed=3)
    full = reference_step(SPEC, tokens, seed=3, dtype=torch.float64)
    for rank, out in enumerate(two_ranks):
        mine = reference_step(SPEC, tokens[rank * 4:(rank + 1) * 4], seed=3,
                              dtype=torch.float64)
        for name, grad in mine["grads"].items():
            torch.testing.assert_close(out["local_grads"][name], grad, rtol=1e-10, atol=1e-14)
        for name, grad in full["grads"].items():
            torch.testing.assert_close(out["reduced_grads"][name], grad, rtol=1e-10, atol=1e-14)
        assert out["local_loss"] == pytest.approx(full["loss"], rel=1e-12)
        assert "sync_grads" in out["fsdp_error"]


@pytest.mark.slow
def test_measure_config_two_ranks(two_ranks):
    assert "needs tp=1" in two_ranks[0]["zero1_error"]
    rows = [out["measurements"] for out in two_ranks]
    assert [len(r) for r in rows] == [3, 3]
    for a, b in zip(*rows):
        assert a["status"] == "ok" and a["world_size"] == 2
        # the step time is the slowest rank's: every rank reports the same figures
        assert a["step_times_s"] == b["step_times_s"] and len(a["step_times_s"]) == 2
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["peak_rss_gb"] == b["peak_rss_gb"] > 0
        assert a["device_count"] == 2
    for details in two_ranks[0]["details"]:
        assert details["build_s"] > 0


def _count_loss_reductions(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Per layout: the all-reduces on the whole group (where the loss is reduced) made by
    ``Trainer.train_step`` and by ``measure_config`` with few and with many steps, and the
    loss ``measure_config`` reports beside the one ``Trainer.step`` returns for the same
    step."""
    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group

    init_worker(rank, world_size, port, "cpu")
    calls = [0]
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is None or group is dist.group.WORLD:
            calls[0] += 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    out = {}
    try:
        with closing_process_group():
            for config in _LOSS_LAYOUTS:
                common = dict(hardware="cpu", device=CPU, seed=0)
                calls[0] = 0
                measure_config(SPEC, config, warmup_steps=1, measured_steps=1, **common)
                few = calls[0]
                calls[0] = 0
                m = measure_config(SPEC, config, warmup_steps=2, measured_steps=3, **common)
                many = calls[0]
                trainer = Trainer(SPEC, config, device=CPU, seed=0)
                losses = [trainer.step(synthetic_batch(SPEC, 4, step=s)) for s in range(5)]
                calls[0] = 0
                local = trainer.train_step(synthetic_batch(SPEC, 4, step=5))
                in_train_step = calls[0]
                trainer.global_loss(local)
                trainer.close()
                out[config.key()] = dict(few=few, many=many, in_train_step=in_train_step,
                                         measured_loss=m.loss, step_loss=losses[-1])
    except Exception:
        out = {"error": traceback.format_exc()}
    torch.save(out, Path(out_dir) / f"{rank}.pt")


_LOSS_LAYOUTS = [ParallelConfig(dp=2, micro_batch_size=2, global_batch_size=4),
                 ParallelConfig(pp=2, micro_batch_size=1, global_batch_size=4)]


@pytest.mark.slow
def test_timed_steps_do_not_reduce_the_loss(tmp_path):
    """The timed steps run as a training loop does: no all-reduce of the loss (and no host
    synchronisation for it) inside a step; measure_config reduces the last step's loss once,
    after them, and reports what Trainer.step returns for that step."""
    from paratune.profiler.gns import spawn

    spawn(_count_loss_reductions, 2, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert "error" not in out, out["error"]
        for config in _LOSS_LAYOUTS:
            got = out[config.key()]
            assert got["in_train_step"] == 0, (rank, config.key(), got)
            # the loss and the step-time statistics, however many steps were timed
            assert got["few"] == got["many"] == 2, (rank, config.key(), got)
            assert got["measured_loss"] == pytest.approx(got["step_loss"], rel=1e-12)


def test_warmup_is_required_on_cuda():
    """On CUDA the first step pays one-off costs: it is never timed (checked before
    anything is built, so this needs no GPU)."""
    with pytest.raises(ConfigError, match=r"warmup_steps=0: must be >= 1 on CUDA"):
        measure_config(SPEC, ParallelConfig(global_batch_size=2), hardware="H100",
                       device="cuda", warmup_steps=0)


# ---------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_config_on_one_gpu(tmp_path):
    """NCCL, bf16 autocast, CUDA synchronise and allocator peaks on a single GPU."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with one_process_group(tmp_path, "nccl"):
        config = ParallelConfig(micro_batch_size=2, global_batch_size=4, recompute="full")
        m = measure_config(SPEC, config, hardware="H100", device=device, warmup_steps=1,
                           measured_steps=3)
        assert m.ok and len(m.step_times_s) == 3
        assert 0 < m.peak_mem_allocated_gb <= m.peak_mem_reserved_gb
        assert 0 < m.mfu < 1
        assert m.fingerprint["cuda_version"] and m.fingerprint["nccl_version"]
        assert 4.0 < m.loss < 7.0
        trainer = Trainer(SPEC, config, device=device)
        assert trainer.mixed_precision
        tokens = synthetic_batch(SPEC, 4, step=0)
        losses = [trainer.step(tokens) for _ in range(5)]
        assert losses[-1] < losses[0]
        trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reserved_peak_leaves_out_memory_cached_before_the_steps(tmp_path):
    """What the caching allocator holds before the steps (here a freed 2 GB block, as
    initialisation's temporaries would leave) is released before the peaks are reset."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with one_process_group(tmp_path, "nccl"):
        block = torch.empty(2 * 10**9, dtype=torch.uint8, device=device)
        del block
        assert torch.cuda.memory_reserved(device) >= 2e9
        m = measure_config(SPEC, ParallelConfig(global_batch_size=2), hardware="H100",
                           device=device, warmup_steps=1, measured_steps=1)
        assert 0 < m.peak_mem_reserved_gb < 1.0


# ---------------------------------------------------------------------- collectives per step
# Each layout runs with micro-batches of 1 and with as few micro-batches as it allows (one,
# or pp under a pipeline schedule).
_ACCUMULATION_LAYOUTS = [
    ParallelConfig(dp=2, tp=2, global_batch_size=8),  # FSDP2 `replicate` (DTensor params)
    ParallelConfig(dp=4, global_batch_size=8, sharding="zero2"),
    ParallelConfig(dp=4, global_batch_size=8, sharding="zero3"),
    ParallelConfig(pp=2, dp=2, global_batch_size=8, sharding="zero2"),
    ParallelConfig(pp=2, dp=2, global_batch_size=8, sharding="zero3"),
]


def _count_dp_collectives(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Per layout and micro-batch count: the data-parallel collectives FSDP2 issues in one
    ``forward_backward`` (its Python-level calls, on the ``dp`` group only: tensor-parallel
    all-reduces go through functional collectives and are not counted)."""
    import collections

    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group

    init_worker(rank, world_size, port, "cpu")
    counts: collections.Counter = collections.Counter()
    recording: list[tuple[int, ...]] = []  # the dp group's ranks while recording

    def wrap(name, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if recording and group is not None and \
                    tuple(dist.get_process_group_ranks(group)) == recording[0]:
                counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        setattr(dist, name, wrap(name, getattr(dist, name)))
    out = {}
    try:
        with closing_process_group():
            for layout in _ACCUMULATION_LAYOUTS:
                local = layout.global_batch_size // layout.dp
                for micro in (1, local // layout.pp):
                    config = layout.replace(micro_batch_size=micro)
                    trainer = Trainer(SPEC, config, device=CPU)
                    trainer.step(synthetic_batch(SPEC, 8, step=0))  # lazy initialisation
                    group = trainer.mesh["dp"].get_group()
                    recording.append(tuple(dist.get_process_group_ranks(group)))
                    counts.clear()
                    trainer.forward_backward(synthetic_batch(SPEC, 8, step=1))
                    recording.clear()
                    out[(layout.key(), config.num_microbatches)] = dict(counts)
                    trainer.optimizer_step()
                    trainer.close()
    except Exception:
        out = {"error": traceback.format_exc()}
    torch.save(out, Path(out_dir) / f"{rank}.pt")


@pytest.mark.slow
def test_data_parallel_gradient_reductions_per_step(
        tmp_path):
    """Gradient accumulation reduces once, on the last micro-batch, under FSDP2 ``replicate``
    (tp > 1) and for pipelined ZeRO-2/3 stages; ZeRO-2/3 without pipelining reduce-scatter
    every micro-batch into the shard (sharded gradient memory, FSDP2's own schedule)."""
    from paratune.profiler.gns import spawn

    spawn(_count_dp_collectives, 4, str(tmp_path))
    for rank in range(4):
        out = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert "error" not in out, out["error"]
        for layout in _ACCUMULATION_LAYOUTS:
            key = layout.key()
            (many_n, many), (few_n, one) = [(n, c) for (k, n), c in out.items() if k == key]
            assert many_n > few_n == layout.pp, (key, many_n, few_n)
            if layout.sharding.value == "none":  # replicate: one all-reduce per step
                assert many == one == {"all_reduce": 1}, (rank, key, many, one)
                continue
            assert "all_reduce" not in many
            if layout.pp == 1:  # one reduce-scatter per FSDP unit and micro-batch
                units = one["reduce_scatter_single"]
                assert units >= 1, (rank, key, one)
                assert many["reduce_scatter_single"] == many_n * units, (rank, key, many)
                continue
            units = one["reduce_scatter_single"]  # one reduce-scatter per FSDP unit and step
            assert units >= 1 and many["reduce_scatter_single"] == units, (rank, key, many)
            if layout.sharding.value == "zero2":  # gathered once, kept through the step
                assert many["all_gather_single"] == one["all_gather_single"] == units, \
                    (rank, key, many, one)
            else:  # zero3 regathers for every forward and backward
                assert many["all_gather_single"] > one["all_gather_single"], (rank, key)


def test_an_mfu_above_one_is_left_empty_with_a_warning(caplog):
    """A device never runs faster than its peak: above it, the peak is another device's."""
    import logging
    import math

    from paratune.profiler.trainer import model_flops_utilisation

    assert model_flops_utilisation(400e12, 989e12, "H100-80GB") == pytest.approx(0.4044, 1e-3)
    with caplog.at_level(logging.WARNING):
        assert math.isnan(model_flops_utilisation(600e12, 312e12, "A100-80GB"))
    assert "1.92x the peak of A100-80GB: is --hardware right?" in caplog.text
