from __future__ import annotations

from paratune import ParallelConfig, get_model


def test_verify_takes_the_top_configs_the_trainer_can_run():
    from paratune.tuner._verify import trainer_runnable

    model = get_model("tiny")
    ranked = [ParallelConfig(dp=2, tp=2, global_batch_size=8, sharding="zero1"),
              ParallelConfig(dp=4, global_batch_size=8, sharding="zero1"),
              ParallelConfig(dp=2, tp=2, global_batch_size=8)]
    assert trainer_runnable(ranked, model, 2) == [1, 2]
    assert trainer_runnable(ranked, model, 1) == [1]
    assert trainer_runnable(ranked[:1], model, 1) == []
