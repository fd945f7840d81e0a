from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import MODEL_PRESETS, ConfigError, ParallelConfig, get_model
from paratune.batch import LAYOUT_RULES, ConfigBatch, option_codes
from paratune.parallel import Recompute, Schedule, Sharding, max_stage_layers, stage_layer_counts
from paratune.predictor import CONFIG_COLUMNS
from paratune.scalars import plain


def _random_layouts(rng: np.random.Generator, n: int) -> list[dict]:
    """Layout fields, about half of them valid for small models, the rest breaking every
    kind of rule (degrees of 0, beyond the range, uneven batches, wrong virtual stages...)."""
    rows = []
    for _ in range(n):
        dp, tp, pp = (int(rng.choice([1, 1, 1, 2, 2, 4, 8, 3, 0])) for _ in range(3))
        micro = int(rng.choice([1, 2, 3, 4]))
        accumulate = int(rng.choice([1, 2, 3, 4, 8, 16]))
        global_batch = max(dp, 1) * micro * accumulate + int(rng.choice([0, 0, 0, 0, 1]))
        if rng.random() < 0.02:
            global_batch = 1 << 25  # beyond MAX_GLOBAL_BATCH
        if rng.random() < 0.02:
            dp = (1 << 20) + 1  # beyond MAX_DEVICES
        schedule = str(rng.choice([*(s.value for s in Schedule), "1f1b", "1f1b"]))
        rows.append(dict(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                         global_batch_size=global_batch, schedule=schedule,
                         virtual_stages=int(rng.choice([1, 1, 1, 1, 2, 3])),
                         sharding=str(rng.choice([s.value for s in Sharding])),
                         recompute=str(rng.choice([r.value for r in Recompute])),
                         cp=int(rng.choice([1] * 12 + [2, 4, 3, 0]))))
    return rows


def _reference(fields: dict, model, world_size, runnable) -> ConfigError | None:
    try:
        ParallelConfig(**fields).validate(model, world_size, runnable=runnable)
    except ConfigError as exc:
        return exc
    return None


@pytest.mark.parametrize("model_name", ["tiny", "small", "llama3.2-1b"])
def test_rule_table_agrees_with_parallel_config_on_random_configs(model_name):
    model = get_model(model_name)
    if model_name == "small":  # a vocabulary tp=2 does not divide and 3 layers
        model = model.replace(vocab_size=1001, num_layers=3)
    rows = _random_layouts(np.random.default_rng(7), 1500)
    frame = ConfigBatch.from_configs(model, [ParallelConfig()] * len(rows), "cpu").to_frame()
    for name in rows[0]:
        frame[name] = [row[name] for row in rows]
    frame.loc[::97, "schedule"] = "zigzag"  # an option of no code
    rows = [dict(row, schedule="zigzag") if i % 97 == 0 else row for i, row in enumerate(rows)]
    batch = ConfigBatch.from_frame(frame)
    valid = 0
    for world_size in (None, 8):
        for runnable in (True, False):
            errors = batch.validate(world_size=world_size, runnable=runnable)
            for fields, got in zip(rows, errors):
                want = _reference(fields, model, world_size, runnable)
                assert (want is None) == (got is None), (fields, want, got)
                if want is not None:
                    assert (got.field, got.value, got.rule) == (want.field, want.value,
                                                                 want.rule), fields
                    assert str(got) == str(want)
                valid += want is None
    assert valid > len(rows) // 4  # valid layouts too, not only broken ones
    # the draw reaches every layout rule (not only the fields' own) and the head rule
    hit = set(batch.violations(world_size=8).tolist()) | set(batch.violations().tolist())
    wanted = {i for i, rule in enumerate(LAYOUT_RULES)
              if "layout" in rule.needs and "shape" not in rule.needs}
    assert wanted <= hit and 0 in hit and hit & {i for i, r in enumerate(LAYOUT_RULES)
                                                 if r.field == "tp" and r.needs}


def test_fields_only_matches_construction():
    frame = ConfigBatch.from_configs(get_model("tiny"), [ParallelConfig()] * 3, "cpu").to_frame()
    frame["dp"] = [0, 3, 1]
    frame["sharding"] = ["none", "none", "zero9"]
    errors = ConfigBatch.from_frame(frame).validate(layout=False, world_size=2)
    assert str(errors[0]) == "dp=0: must be a positive integer"
    assert errors[1] is None  # the world size is a layout rule
    assert str(errors[2]) == "sharding='zero9': must be one of none, zero1, zero2, zero3"
    with pytest.raises(ConfigError, match="sharding='zero9'"):
        ParallelConfig(sharding="zero9")


def _configs():
    return [ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=1, global_batch_size=8,
                           schedule="interleaved_1f1b", virtual_stages=2, sharding="zero3",
                           recompute="selective"),
            ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=64, sharding="zero1"),
            ParallelConfig(tp=8, pp=1, schedule="gpipe", recompute="full")]


def test_round_trips_configs_and_frames():
    model = get_model("llama3-8b")
    batch = ConfigBatch.from_configs(model, _configs(), "H100", devices_per_node=4)
    assert len(batch) == 3
    assert batch.configs() == _configs()
    assert batch.keys() == [c.key() for c in _configs()]
    assert batch.model_at(1) == model
    frame = batch.to_frame()
    assert list(frame.columns) == list(CONFIG_COLUMNS)
    assert frame["world_size"].tolist() == [8, 4, 8]
    assert frame["num_microbatches"].tolist() == [c.num_microbatches for c in _configs()]
    assert frame["hardware"].tolist() == ["H100-80GB"] * 3
    assert frame["devices_per_node"].tolist() == [4] * 3
    assert frame["schedule"].tolist() == ["interleaved_1f1b", "1f1b", "gpipe"]
    again = ConfigBatch.from_frame(frame)
    pd.testing.assert_frame_equal(again.to_frame(), frame)
    assert again.configs() == _configs()
    # the codes are the enums' positions
    assert batch.sharding.tolist() == [3, 1, 0] == [c.sharding.stage for c in _configs()]
    assert option_codes("schedule") == {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2}


def test_take_and_slices_keep_rows_together():
    batch = ConfigBatch.from_configs(get_model("tiny"), _configs(), "cpu")
    assert batch.take([2, 0]).configs() == [_configs()[2], _configs()[0]]
    assert batch[1:].keys() == [c.key() for c in _configs()[1:]]
    assert batch[np.array([False, True, False])].configs() == [_configs()[1]]
    assert batch[2].configs() == [_configs()[2]] and len(batch[np.int64(0)]) == 1
    frame = batch.to_frame()
    frame.loc[1, "recompute"] = "sometimes"
    odd = ConfigBatch.from_frame(frame)
    assert odd.take([1]).option_text("recompute").tolist() == ["sometimes"]
    assert odd.take([0, 2]).option_text("recompute").tolist() == ["selective", "full"]


def test_frame_defaults_and_refusals():
    frame = ConfigBatch.from_configs(get_model("tiny"), _configs(), "H100").to_frame()
    lean = frame.drop(columns=["num_kv_heads", "schedule", "virtual_stages", "sharding",
                               "devices_per_node", "tie_embeddings", "mlp"])
    batch = ConfigBatch.from_frame(lean)
    assert batch.num_kv_heads.tolist() == [8] * 3  # num_heads
    assert batch.devices_per_node.tolist() == [8] * 3  # the catalogue's
    assert batch.option_text("schedule").tolist() == ["1f1b"] * 3
    with pytest.raises(ConfigError, match="column missing"):
        ConfigBatch.from_frame(frame.drop(columns=["dp"]))
    frame["tp"] = frame["tp"].astype(float)
    frame.loc[2, "tp"] = 1.5
    with pytest.raises(ConfigError, match=r"tp=1\.5: must be a positive integer") as info:
        ConfigBatch.from_frame(frame)
    assert info.value.row == 2


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_vectorised_sizes_and_flops_equal_the_spec_on_every_preset(name):
    model = MODEL_PRESETS[name]
    variants = [model, model.replace(tie_embeddings=not model.tie_embeddings),
                model.replace(mlp="gelu", num_kv_heads=model.num_heads)]
    for spec in variants:
        batch = ConfigBatch.from_configs(spec, _configs(), "cpu")
        assert batch.params_per_layer.tolist() == [spec.params_per_layer] * 3
        assert batch.num_params.tolist() == [spec.num_params] * 3
        for training in (True, False):
            for recompute in (True, False):
                assert batch.flops_per_token(training=training, recompute=recompute).tolist() \
                    == [spec.flops_per_token(training=training, recompute=recompute)] * 3


def test_pipeline_split_is_one_rule():
    for layers in range(1, 40):
        for stages in range(1, layers + 1):
            counts = stage_layer_counts(layers, stages)
            assert sum(counts) == layers and max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True)
            assert max_stage_layers(layers, stages) == counts[0]
    with pytest.raises(ConfigError, match="need at least as many layers"):
        stage_layer_counts(3, 4)


def test_plain_unwraps_numpy_scalars_only():
    assert type(plain(np.int64(3))) is int and plain(np.int64(3)) == 3
    assert type(plain(np.float32(0.5))) is float
    assert type(plain(np.bool_(True))) is bool
    assert plain([1, 2]) == [1, 2] and plain("x") == "x" and plain(None) is None
    array = np.arange(3)
    assert plain(array) is array  # several values stay an array


def test_one_model_and_hardware_per_config():
    models = [get_model("tiny"), get_model("llama3-8b"), get_model("tiny")]
    batch = ConfigBatch.from_configs(models, _configs(), ["cpu", "H100", "A100"],
                                     devices_per_node=[None, 4, None])
    frame = batch.to_frame()
    assert frame["model_name"].tolist() == ["tiny", "llama3-8b", "tiny"]
    assert frame["hardware"].tolist() == ["cpu", "H100-80GB", "A100-80GB"]
    assert frame["devices_per_node"].tolist() == [1024, 4, 8]
    for i, model in enumerate(models):
        assert batch.model_at(i) == model
        pd.testing.assert_frame_equal(
            frame.iloc[[i]].reset_index(drop=True),
            ConfigBatch.from_configs(model, [_configs()[i]], frame["hardware"][i],
                                     devices_per_node=int(frame["devices_per_node"][i])
                                     ).to_frame())
    with pytest.raises(ConfigError, match="one model, hardware and node size per config"):
        ConfigBatch.from_configs(models[:2], _configs(), "cpu")


def test_loose_frames_read_as_predictions_read_them():
    frame = ConfigBatch.from_configs(get_model("tiny"), _configs(), "cpu").to_frame()
    frame["schedule"] = [" Interleaved_1F1B", None, "GPIPE"]
    frame["dp"] = [2.0, np.nan, 1.0]
    loose = ConfigBatch.from_frame(frame, loose=True)
    assert loose.option_text("schedule").tolist() == ["interleaved_1f1b", "1f1b", "gpipe"]
    assert loose.dp.dtype == float and np.isnan(loose.dp[1])
    with pytest.raises(ConfigError, match="dp=None: must be a positive integer"):
        ConfigBatch.from_frame(frame)
    strict = ConfigBatch.from_frame(frame.assign(dp=[2, 4, 1]))
    assert strict.option_text("schedule").tolist() == [" Interleaved_1F1B", None, "GPIPE"]
    assert str(strict.validate()[2]) == ("schedule='GPIPE': must be one of gpipe, 1f1b, "
                                         "interleaved_1f1b")


def test_config_at_is_one_row_of_configs():
    batch = ConfigBatch.from_configs(get_model("tiny"), _configs(), "cpu")
    assert [batch.config_at(i) for i in range(len(batch))] == batch.configs()
    assert batch[1:].config_at(0) == _configs()[1]
