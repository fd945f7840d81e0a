from __future__ import annotations

from paratune import ParallelConfig, get_model


def test_verify_takes_the_top_configs_the_trainer_can_run(caplog):
    """The first config the trainer cannot run (ZeRO-1 with tensor parallelism) is the
    recommendation: its skip is a warning, not a note, and so is a list shorter than asked."""
    from paratune.tuner._verify import trainer_runnable

    model = get_model("tiny")
    ranked = [ParallelConfig(dp=2, tp=2, global_batch_size=8, sharding="zero1"),
              ParallelConfig(dp=4, global_batch_size=8, sharding="zero1"),
              ParallelConfig(dp=2, tp=2, global_batch_size=8)]
    with caplog.at_level("INFO", logger="paratune.tuner"):
        assert trainer_runnable(ranked, model, 2) == [1, 2]
    (skip,) = [r for r in caplog.records if "not verified" in r.getMessage()]
    assert skip.levelname == "WARNING" and "the first of the list" in skip.getMessage()
    assert trainer_runnable(ranked, model, 1) == [1]
    caplog.clear()
    with caplog.at_level("WARNING", logger="paratune.tuner"):
        assert trainer_runnable(ranked, model, 3) == [1, 2]
    assert "2 of the 3 configs asked for are verified" in caplog.text
    assert trainer_runnable(ranked[:1], model, 1) == []
