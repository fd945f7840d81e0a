from __future__ import annotations

import pytest

from paratune import ConfigError, ParallelConfig, Schedule, Sharding, get_model


def test_derived_quantities():
    cfg = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=2, global_batch_size=16)
    assert cfg.world_size == 8
    assert cfg.num_microbatches == 4
    assert cfg.local_batch_size == 8
    assert cfg.tp_enabled and cfg.pp_enabled and cfg.dp_enabled
    assert cfg.mesh_shape() == (2, 2, 2)


@pytest.mark.parametrize(("kwargs", "world", "field", "rule"), [
    (dict(tp=3), 3, "tp", "must divide num_heads=8"),
    (dict(dp=2, global_batch_size=3), 2, "global_batch_size", "divisible by dp\\*micro_batch_size"),
    (dict(dp=2, tp=2, global_batch_size=4), 8, "dp", "must equal the world size 8"),
    (dict(pp=8, global_batch_size=8), 8, "pp", "need at least as many layers"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=1, global_batch_size=4), 2,
     "virtual_stages", ">= 2"),
    (dict(pp=1, virtual_stages=2), 1, "virtual_stages", "must be 1 unless"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, global_batch_size=3), 2,
     "global_batch_size", "multiple of pp=2"),
    (dict(pp=2, micro_batch_size=2, global_batch_size=2), 2,
     "global_batch_size", "1f1b needs at least pp=2 micro-batches"),
])
def test_validate_names_field_value_and_rule(kwargs, world, field, rule):
    cfg = ParallelConfig(**kwargs)
    with pytest.raises(ConfigError, match=rule) as info:
        cfg.validate(get_model("tiny"), world)
    assert info.value.field == field
    assert not cfg.is_valid(get_model("tiny"), world)


def test_runnable_false_skips_only_the_trainers_own_limits():
    # fewer micro-batches than stages: torch's 1F1B refuses it, other frameworks run it
    fewer = ParallelConfig(pp=2, micro_batch_size=2, global_batch_size=2)
    fewer.validate(get_model("tiny"), 2, runnable=False)
    # the rules every framework has still hold
    with pytest.raises(ConfigError, match="must divide num_heads=8"):
        ParallelConfig(tp=3).validate(get_model("tiny"), 3, runnable=False)
    # a vocabulary tp does not divide (Megatron-LM pads it) and more pipeline stages than
    # layers (nanotron gives the embedding and the head stages of their own) run elsewhere
    odd_vocab = get_model("tiny").replace(vocab_size=1001)
    ParallelConfig(tp=2).validate(odd_vocab, 2, runnable=False)
    with pytest.raises(ConfigError, match="must divide vocab_size=1001"):
        ParallelConfig(tp=2).validate(odd_vocab, 2)
    deep = ParallelConfig(pp=4, micro_batch_size=1, global_batch_size=4)
    shallow = get_model("tiny").replace(num_layers=3)
    deep.validate(shallow, 4, runnable=False)
    with pytest.raises(ConfigError, match="need at least as many layers"):
        deep.validate(shallow, 4)


def test_bad_enum_value_lists_choices():
    with pytest.raises(ConfigError, match=r"sharding='zero4'.*none, zero1, zero2, zero3"):
        ParallelConfig(sharding="zero4")


def test_nonpositive_degree_rejected():
    with pytest.raises(ConfigError, match="dp=0: must be a positive integer"):
        ParallelConfig(dp=0)


def test_roundtrip_and_key():
    cfg = ParallelConfig(dp=2, pp=2, global_batch_size=8, schedule=Schedule.GPIPE,
                         sharding=Sharding.ZERO3)
    again = ParallelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.key() == cfg.key() == "dp2-tp1-pp2-mb1-gb8-gpipe-v1-zero3-none"
    assert Sharding.from_stage(2) is Sharding.ZERO2 and Sharding.ZERO3.stage == 3


def test_check_trainer_names_what_only_other_frameworks_run():
    untied, tied = get_model("llama3-8b"), get_model("llama3.2-1b")
    ParallelConfig(dp=2, tp=2, global_batch_size=4).check_trainer(untied)
    with pytest.raises(ConfigError, match="sharding='zero1': needs tp=1"):
        ParallelConfig(dp=2, tp=2, global_batch_size=4, sharding="zero1").check_trainer(untied)
    with pytest.raises(ConfigError, match=r"pp=2: pipeline parallelism .* untied embeddings"):
        ParallelConfig(pp=2, global_batch_size=4).check_trainer(tied)
    ParallelConfig(pp=2, global_batch_size=4).check_trainer(untied)
