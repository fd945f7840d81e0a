from __future__ import annotations

import json
import shutil

import pytest
import torch

from paratune import ParallelConfig
from paratune.errors import ConfigError
from paratune.profiler.reconfigure import RunState, load_checkpoint

SEQ = 32
LR = 1e-3


def _spec():
    from paratune import get_model

    return get_model("tiny").replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                     ffn_hidden_size=176, seq_len=SEQ)


# (global batch, layout) per phase: dp x tp, then pp x tp with twice the batch and
# micro-batches of 2, then plain data parallelism over all four ranks.
PHASES = [
    (ParallelConfig(dp=2, tp=2, global_batch_size=4), 2),
    (ParallelConfig(pp=2, tp=2, global_batch_size=8, micro_batch_size=2), 2),
    (ParallelConfig(dp=4, global_batch_size=8), 1),
]


def _worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.gns import init_worker
    from paratune.profiler.reconfigure import reconfigure
    from paratune.profiler.trainer import Trainer

    torch.set_default_dtype(torch.float64)
    device = init_worker(rank, world_size, port, "cpu")
    try:
        spec = _spec()
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)

        def build(config):
            return Trainer(spec, config, device=device, seed=0, lr=LR)

        config, steps = PHASES[0]
        trainer = build(config)
        state = RunState(config=config, extra={"note": "kept"})
        losses, costs, before, after = [], [], [], []
        for index, (config, steps) in enumerate(PHASES):
            if index:
                before.append(trainer.gather_full())
                trainer, state, cost = reconfigure(trainer, state, config,
                                                   checkpoint_dir=f"{out_dir}/ckpt{index}",
                                                   build_trainer=build)
                after.append(trainer.gather_full())
                costs.append(cost.total_s)
            for _ in range(steps):
                gb = config.global_batch_size
                tokens = corpus.sequences(state.samples_seen, gb, SEQ, seed=0)
                losses.append(trainer.step(tokens))
                state.step += 1
                state.samples_seen += gb
        final = trainer.gather_full()
        if rank == 0:
            torch.save({"losses": losses, "costs": costs, "before": before, "after": after,
                        "final": final, "state": state.to_dict()}, f"{out_dir}/result.pt")
    finally:
        dist.destroy_process_group()


def _reference():
    """The same schedule of batches in one process, never interrupted."""
    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.model import build_model
    from paratune.profiler.pipeline import cross_entropy_loss

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)
        model = build_model(_spec(), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95),
                                eps=1e-8, foreach=False)
        losses, position = [], 0
        for config, steps in PHASES:
            for _ in range(steps):
                tokens = corpus.sequences(position, config.global_batch_size, SEQ, seed=0)
                position += config.global_batch_size
                loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.slow
def test_switching_layouts_keeps_parameters_optimizer_state_and_data_position(tmp_path):
    from paratune.profiler.gns import spawn

    spawn(_worker, 4, str(tmp_path))
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    ref_losses, ref_params = _reference()
    # Every parameter comes back bit for bit (up to float64 rounding) under the new layout.
    for before, after in zip(got["before"], got["after"]):
        assert set(before) == set(after) == set(ref_params)
        for name in before:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-12)
    # Training continues as if never interrupted: same losses (Adam moments and step count
    # carried over, the data position too), same final parameters.
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-9)
    for name, value in ref_params.items():
        torch.testing.assert_close(got["final"][name], value, rtol=1e-9, atol=1e-11)
    state = RunState.from_dict(got["state"])
    assert state.step == 5 and state.samples_seen == 4 * 2 + 8 * 2 + 8
    assert state.config == PHASES[-1][0] and state.extra == {"note": "kept"}
    assert len(got["costs"]) == 2 and all(c > 0 for c in got["costs"])
    # The hand-over checkpoint is complete: its run state names the layout it was saved under.
    saved = json.loads((tmp_path / "ckpt1" / "run_state.json").read_text())
    assert ParallelConfig.from_dict(saved["config"]) == PHASES[0][0]


def test_load_without_complete_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run_state\.json"):
        load_checkpoint(tmp_path, trainer=None)


def test_a_checkpoint_committed_while_it_is_looked_up_is_found(tmp_path, monkeypatch):
    """A save that committed between the lookup's two checks (``path`` moved aside, then the
    new one renamed into place and the old one removed) made the lookup find neither while
    a complete checkpoint existed at every instant (about once in 400,000 lookups against
    back-to-back saves)."""
    from paratune.profiler import reconfigure

    path = tmp_path / "ckpt"
    previous, staging = (path.with_name(path.name + s) for s in (".previous", ".saving"))
    for directory in (previous, staging):  # mid-commit: path moved aside, staging complete
        directory.mkdir()
        (directory / reconfigure.RUN_STATE_FILE).write_text("{}")
    real = reconfigure._is_complete
    checked = []

    def is_complete(candidate):
        found = real(candidate)
        checked.append(candidate)
        if len(checked) == 1:  # the commit finishes right after the lookup checked path
            staging.rename(path)
            shutil.rmtree(previous)
        return found

    monkeypatch.setattr(reconfigure, "_is_complete", is_complete)
    assert reconfigure.find_checkpoint(path) == path


def test_run_state_rejects_unknown_format():
    data = RunState(config=ParallelConfig()).to_dict()
    assert RunState.from_dict(data).config == ParallelConfig()
    data["format_version"] = 99
    with pytest.raises(ConfigError, match="format_version"):
        RunState.from_dict(data)


# ---------------------------------------------------------------------- one process
# (the `world_one` fixture is in conftest.py)
def _trainer(config=None):
    from paratune.profiler.trainer import Trainer

    return Trainer(_spec(), config or ParallelConfig(global_batch_size=2),
                   device=torch.device("cpu"), seed=0, lr=LR)


def _train_step(trainer, step):
    from paratune.profiler.trainer import synthetic_batch

    trainer.step(synthetic_batch(_spec(), trainer.config.global_batch_size, step=step))


def test_a_save_killed_at_any_point_leaves_a_complete_checkpoint(world_one, tmp_path,
                                                                  monkeypatch):
    import torch.distributed.checkpoint as dcp

    from paratune.profiler.reconfigure import find_checkpoint, save_checkpoint

    ckpt = tmp_path / "ckpt"
    trainer = _trainer()
    _train_step(trainer, 0)
    save_checkpoint(ckpt, trainer, RunState(config=trainer.config, step=1))
    assert find_checkpoint(ckpt) == ckpt
    saved = {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}
    _train_step(trainer, 1)

    # Killed while DCP writes the next one: it had written part of its files.
    real_save = dcp.save

    def killed(state_dict, *, checkpoint_id):
        (tmp_path / "ckpt.saving" / "__0_0.distcp").write_bytes(b"torn")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, trainer, RunState(config=trainer.config, step=2))
    monkeypatch.setattr(dcp, "save", real_save)
    fresh = _trainer()
    assert load_checkpoint(ckpt, fresh).step == 1
    for name, param in fresh.model_parts[0].named_parameters():
        torch.testing.assert_close(param.detach(), saved[name], rtol=0, atol=0)

    # Killed between moving the old checkpoint aside and renaming the new one into place.
    save_checkpoint(ckpt, trainer, RunState(config=trainer.config, step=2))
    assert not (tmp_path / "ckpt.saving").exists()
    assert not (tmp_path / "ckpt.previous").exists()
    (ckpt).rename(tmp_path / "ckpt.previous")
    assert find_checkpoint(ckpt) == tmp_path / "ckpt.previous"
    assert load_checkpoint(ckpt, _trainer()).step == 2
    # The next save commits normally and cleans up.
    save_checkpoint(ckpt, trainer, RunState(config=trainer.config, step=3))
    assert find_checkpoint(ckpt) == ckpt and not (tmp_path / "ckpt.previous").exists()
    assert load_checkpoint(ckpt, _trainer()).step == 3
    # A directory of other files is never taken over.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a checkpoint"):
        save_checkpoint(tmp_path / "notes", trainer, RunState(config=trainer.config))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_reconfigure_frees_the_old_trainer_before_building_the_new(world_one, tmp_path):
    import weakref

    from paratune.profiler.reconfigure import reconfigure

    config = ParallelConfig(global_batch_size=2)
    trainer = _trainer(config)
    _train_step(trainer, 0)
    param = weakref.ref(trainer.model_parts[0].output.weight)
    moment = weakref.ref(next(iter(trainer.optimizers[0].state.values()))["exp_avg"])
    alive = []

    def build(new_config):
        alive.append((param() is not None, moment() is not None))
        return _trainer(new_config)

    new, state, _ = reconfigure(trainer, RunState(config=config),
                                config.replace(global_batch_size=4),
                                checkpoint_dir=tmp_path / "ckpt", build_trainer=build)
    assert alive == [(False, False)]
    assert state.config.global_batch_size == 4
    _train_step(new, 1)


def test_zero1_without_data_parallelism_checkpoints(world_one, tmp_path):
    """ZeRO-1 over one replica is plain AdamW: nothing to partition, and its state saves."""
    from paratune.profiler.reconfigure import save_checkpoint

    config = ParallelConfig(global_batch_size=2, sharding="zero1")
    trainer = _trainer(config)
    assert type(trainer.optimizers[0]) is torch.optim.AdamW
    _train_step(trainer, 0)
    save_checkpoint(tmp_path / "ckpt", trainer, RunState(config=config, step=1))
    fresh = _trainer(config)
    assert load_checkpoint(tmp_path / "ckpt", fresh).step == 1
    moments = [s["exp_avg"] for s in trainer.optimizers[0].state.values()]
    loaded = [s["exp_avg"] for s in fresh.optimizers[0].state.values()]
    assert len(moments) == len(loaded) > 0
    for a, b in zip(moments, loaded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
