"""The requests ``tune`` and ``plan`` take (``TuneJob``, ``SearchOptions``, ``OutputOptions``,
``PlanOptions``): validation naming the field and the rule, the CLI flags and MLflow params
derived from their fields, and the two spellings of ``tune`` giving one answer."""

from __future__ import annotations

import dataclasses

import pytest

from paratune import ConfigError
from paratune.tuner import (
    OutputOptions,
    PlanOptions,
    SearchOptions,
    TuneJob,
    make_sampler,
    plan,
    tune,
)


@pytest.mark.parametrize(("build", "field", "rule"), [
    (lambda: TuneJob(model="llama3-8b", gpus=0, hardware="H100"), "gpus", "positive"),
    (lambda: TuneJob(model="llama3-8b", gpus=8, hardware="H100", devices_per_node=0),
     "devices_per_node", "positive integer"),
    (lambda: TuneJob(model="llama3-8b", gpus=8, hardware="H100", min_feasible_prob=1.5),
     "min_feasible_prob", "probability in [0, 1]"),
    (lambda: TuneJob(model="llama3-8b", gpus=8, hardware="H100", memory_limit_gb=-1.0),
     "memory_limit_gb", "positive number of GB"),
    (lambda: SearchOptions(search="grid"), "search", "must be one of optuna, exhaustive"),
    (lambda: SearchOptions(n_trials=0), "n_trials", "positive integer"),
    (lambda: SearchOptions(batch_size=True), "batch_size", "positive integer"),
    (lambda: SearchOptions(sampler="cmaes"), "sampler", "must be one of tpe, random"),
    (lambda: SearchOptions(verify=-1), "verify", "number of configs >= 0"),
    (lambda: OutputOptions(top_k=0), "top_k", "positive integer"),
    (lambda: PlanOptions(law="kaplan2020", threshold=-1.0), "threshold", "finite number >= 0"),
    (lambda: PlanOptions(), "trajectory", "either a trajectory file or a critical-batch law"),
])
def test_a_bad_request_names_its_field_and_the_rule(build, field, rule):
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.field == field and rule in caught.value.rule
    assert "\n" not in str(caught.value)


def test_an_exhaustive_search_counts_no_trials():
    assert SearchOptions(search="exhaustive", n_trials=0).n_trials == 0


def test_requests_are_frozen():
    options = SearchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.n_trials = 5  # type: ignore[misc]


def _flags(command: str) -> dict[str, object]:
    import argparse

    from paratune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action for action in sub.choices[command]._actions
            for flag in action.option_strings}


@pytest.mark.parametrize(("command", "requests"), [
    ("tune", (TuneJob, SearchOptions, OutputOptions)), ("plan", (TuneJob, PlanOptions))])
def test_every_field_with_a_flag_is_a_flag_with_its_help(command, requests):
    """A new option is written once: its field's metadata is the flag, its help and its
    default."""
    flags = _flags(command)
    for request in requests:
        for item in dataclasses.fields(request):
            flag = item.metadata.get("flag")
            if flag is None or (command == "plan" and request is OutputOptions):
                continue
            action = flags[flag]
            assert item.metadata["help"].split("{")[0].split("%")[0][:30] in action.help
            if (item.default is not dataclasses.MISSING and "from_cli" not in
                    item.metadata["cli"]):
                assert action.default == item.default, flag


def test_the_run_params_of_the_search_come_from_its_fields():
    params = SearchOptions(n_trials=7, seed=3, sampler="random", batch_size=2).params()
    assert params == {"search": "optuna", "n_trials": 7, "sampler": "random", "seed": 3,
                      "batch_size": 2, "verify": 0}
    assert SearchOptions(search="exhaustive").params()["sampler"] == ""
    assert OutputOptions(top_k=4).params() == {"top_k": 4}


def test_both_spellings_of_tune_give_one_answer(closed_form, tmp_path):
    job = TuneJob(model="llama3-8b", gpus=32, hardware="H100", global_batch_sizes=[512])
    new = tune(job, search=SearchOptions(n_trials=12, seed=1),
               output=OutputOptions(track=False), predictor=closed_form)
    old = tune("llama3-8b", 32, "H100", closed_form, global_batch_sizes=[512], n_trials=12,
               seed=1, track=False)
    assert new.best == old.best and new.ranked["objective"].tolist() == \
        old.ranked["objective"].tolist()
    with pytest.raises(TypeError, match="no_such_option"):
        tune("llama3-8b", 32, "H100", closed_form, no_such_option=1)


def test_a_sampler_may_be_given_as_an_instance(closed_form):
    """Samplers come from a registry by name, or are given as they are."""
    sampler = make_sampler("random", seed=5)
    job = TuneJob(model="llama3-8b", gpus=32, hardware="H100", global_batch_sizes=[512])
    result = tune(job, search=SearchOptions(n_trials=6, sampler=sampler),
                  output=OutputOptions(track=False), predictor=closed_form)
    assert result.study.sampler is sampler and result.search.mode == "RandomSampler"
    assert result.search.num_trials == 6


def test_plan_is_a_library_function(closed_form, tmp_path):
    job = TuneJob(model="llama3-8b", gpus=64, hardware="H100", global_batch_sizes="64:2048")
    outcome = plan(job, PlanOptions(law="kaplan2020", max_segments=8),
                   predictor=closed_form, output=OutputOptions(output_dir=tmp_path / "p",
                                                               track=False))
    assert outcome.plan.total_time_s > 0 and outcome.written == tmp_path / "p" / "plan.json"
    assert outcome.written.is_file() and "README" in outcome.files
    assert list(outcome.space.global_batch_sizes) == [64, 128, 256, 512, 1024, 2048]


def test_the_options_handed_on_are_option_objects():
    """``tune`` hands verify its ``VerifyOptions`` and ``plan`` hands ``plan_phases`` its
    ``ScheduleOptions``, each built once from the request."""
    from paratune.tuner import ScheduleOptions, VerifyOptions
    from paratune.tuner._verify_refit import VerifyRuns

    given = VerifyOptions(out_dir="verify")
    assert SearchOptions(verify_options=given).verify_options is given
    built = SearchOptions(verify_options={"out_dir": "verify", "measured_steps": 2})
    assert built.verify_options == VerifyOptions(out_dir="verify",
                                                 runs=VerifyRuns(measured_steps=2))
    for bad in ({"measured": 2}, ["out_dir"]):
        with pytest.raises(ConfigError, match="verify_options"):
            SearchOptions(verify_options=bad)
    options = PlanOptions(law="kaplan2020", reconfig_cost_s=60, threshold=0.0, base_batch=256)
    assert options.schedule_options() == ScheduleOptions(reconfig_cost_s=60, threshold=0.0,
                                                         base_batch=256)
    assert SearchOptions(refine_fraction=0.0, timeout_s=5).refine_fraction == 0.0
    with pytest.raises(ConfigError, match="refine_fraction"):
        SearchOptions(refine_fraction=1.5)
