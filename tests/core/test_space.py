from __future__ import annotations

import pytest

from paratune import ConfigError, Recompute, Schedule, Sharding, get_model
from paratune.space import ConfigSpace, factorisations


def test_factorisations_cover_world_size():
    facts = sorted(factorisations(8))
    assert len(facts) == 10
    assert all(dp * tp * pp == 8 for dp, tp, pp in facts)


def test_enumeration_valid_configs_all_validate_and_skips_carry_reasons():
    model = get_model("tiny")
    result = ConfigSpace().enumerate(model, 4)
    assert result.valid and result.skipped
    for cfg in result.valid:
        cfg.validate(model, 4)
    for cfg, reason in result.skipped:
        assert not cfg.is_valid(model, 4)
        assert "=" in reason
    assert len(set(result.valid)) == len(result.valid)


def test_options_vary_only_where_they_matter():
    result = ConfigSpace().enumerate(get_model("tiny"), 2)
    for cfg in result.valid:
        if cfg.pp == 1:
            assert cfg.schedule is Schedule.ONE_F_ONE_B and cfg.virtual_stages == 1
        if cfg.dp == 1:
            assert cfg.sharding is Sharding.NONE
    assert {c.schedule for c in result.valid if c.pp == 2} == set(Schedule)


def test_tp_within_node_skips_cross_node_tp():
    # 32 kv heads: tp=16 divides every sharded dimension, so only the node size rules it out
    model = get_model("llama3-8b").replace(num_kv_heads=32)
    space = ConfigSpace(global_batch_sizes=[256], micro_batch_sizes=[1])
    result = space.enumerate(model, 16, devices_per_node=8)
    assert {c.tp for c in result.valid} == {1, 2, 4, 8}
    assert any(c.tp == 16 and "tp=16 must divide devices_per_node=8" in reason
               for c, reason in result.skipped)
    loose = space.replace(tp_within_node=False).enumerate(model, 16, devices_per_node=8)
    assert {c.tp for c in loose.valid} == {1, 2, 4, 8, 16}
    assert set(result.valid) < set(loose.valid)


def test_tp_within_node_needs_tp_to_divide_the_node():
    # tp=6 fits in an 8-device node's count but not its layout: groups 0-5, 6-11 put the
    # second across two nodes
    model = get_model("tiny").replace(hidden_size=144, num_heads=12, num_kv_heads=6,
                                      ffn_hidden_size=384, vocab_size=264)
    space = ConfigSpace(global_batch_sizes=[24], micro_batch_sizes=[1])
    result = space.enumerate(model, 12, devices_per_node=8)
    assert {c.tp for c in result.valid} == {1, 2}  # (tp=4 does not divide 6 kv heads)
    for tp in (3, 6):
        assert any(f"tp={tp} must divide devices_per_node=8" in reason
                   for _, reason in result.skipped)
    loose = space.replace(tp_within_node=False).enumerate(model, 12, devices_per_node=8)
    assert {c.tp for c in loose.valid} >= {3, 6}
    # a job in one node keeps every group in it: 6 of 8 devices run tp=3 and tp=6
    small = space.replace(global_batch_sizes=[12]).enumerate(model, 6, devices_per_node=8)
    assert {c.tp for c in small.valid} == {1, 2, 3, 6}
    from paratune.models import features as F
    from paratune.predictor import config_frame

    frame = config_frame(model, [c for c in small.valid if c.tp in (3, 6)], "H100")
    assert (F.tp_crosses_nodes(frame) == 0).all()
    assert (F.tp_crosses_nodes(config_frame(model, [c for c in loose.valid if c.tp == 6],
                                            "H100")) == 1).all()


def test_space_from_yaml_and_bad_values(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("global_batch_sizes: [8, 16]\nshardings: [none, zero3]\n")
    space = ConfigSpace.from_file(path)
    assert space.global_batch_sizes == (8, 16)
    assert space.shardings == (Sharding.NONE, Sharding.ZERO3)
    assert ConfigSpace.from_dict(space.to_dict()) == space
    with pytest.raises(ConfigError, match="shardings"):
        ConfigSpace(shardings=["zero9"])
    with pytest.raises(ConfigError, match="micro_batch_size"):
        ConfigSpace.from_dict({"micro_batch_size": [1]})
    with pytest.raises(ConfigError, match="micro_batch_sizes=0"):
        ConfigSpace(micro_batch_sizes=[0])


def test_a_space_records_whether_it_was_given_its_global_batch_sizes(tmp_path):
    recompute_only = tmp_path / "grid.yaml"
    recompute_only.write_text("recomputes: [full]\n")
    space = ConfigSpace.from_file(recompute_only)
    assert space.global_batch_sizes == (8,) and not space.global_batch_sizes_given
    assert space.recomputes == (Recompute.FULL,)
    # a default stays a default through other changes, and a round trip keeps the options
    assert not space.replace(tp_within_node=False).global_batch_sizes_given
    assert space.replace(global_batch_sizes=[16]).global_batch_sizes_given
    assert not ConfigSpace().global_batch_sizes_given
    assert not ConfigSpace.from_dict({}).global_batch_sizes_given
    assert ConfigSpace.from_dict(space.to_dict()) == space
    assert "global_batch_sizes_given" not in space.to_dict()
    with pytest.raises(ConfigError, match="global_batch_sizes_given=False: is not a space field"):
        ConfigSpace.from_dict({"global_batch_sizes_given": False})
    # given, even when it is the default value
    given = tmp_path / "grid.json"
    given.write_text('{"global_batch_sizes": [8], "recomputes": ["full"]}')
    for explicit in (ConfigSpace.from_file(given), ConfigSpace(global_batch_sizes=(8,))):
        assert explicit.global_batch_sizes_given
        assert explicit.replace(tp_within_node=False).global_batch_sizes_given
    assert ConfigSpace.from_file(given) == space  # the same options either way


def test_integer_options_are_stored_sorted_without_repeats():
    space = ConfigSpace(global_batch_sizes=[256, 64, 1024, 64], micro_batch_sizes=(4, 1, 2, 1),
                        virtual_stages=(4, 2), tp_degrees=(8, 2, 2), pp_degrees=[4, 1])
    assert space.global_batch_sizes == (64, 256, 1024)
    assert space.micro_batch_sizes == (1, 2, 4)
    assert space.virtual_stages == (2, 4)
    assert space.tp_degrees == (2, 8) and space.pp_degrees == (1, 4)
    assert space.replace(micro_batch_sizes=(8, 2)).micro_batch_sizes == (2, 8)
    assert ConfigSpace(micro_batch_sizes=(2, 1)) == ConfigSpace(micro_batch_sizes=(1, 2))


@pytest.mark.parametrize(("values", "bad"), [([8.7], "8.7"), ([True], "True"),
                                             ([8, "16.5"], "'16.5'")])
def test_integer_options_refuse_fractions_and_bools(values, bad):
    with pytest.raises(ConfigError, match=rf"global_batch_sizes={bad}: must be an integer|"
                                          r"global_batch_sizes=.*values must be integers"):
        ConfigSpace(global_batch_sizes=values)


def test_integer_options_take_numpy_integers():
    import numpy as np

    space = ConfigSpace(global_batch_sizes=[np.int64(64), 8.0], micro_batch_sizes=[np.int32(2)])
    assert space.global_batch_sizes == (8, 64) and space.micro_batch_sizes == (2,)


@pytest.mark.parametrize(("options", "message"), [
    ({"tp_within_node": "false"}, "tp_within_node='false': must be true or false"),
    ({"tp_within_node": 0}, "tp_within_node=0: must be true or false"),
    ({"tp_within_node": None}, "tp_within_node=None: must be true or false"),
    ({"tp_degrees": [0, 2]}, "tp_degrees=0: must be a positive integer"),
    ({"pp_degrees": [-2]}, "pp_degrees=-2: must be a positive integer"),
])
def test_every_field_is_checked_for_its_type(options, message):
    """A space file's string "false" is not true: a field that is not of its type is refused,
    named, rather than read by its truthiness."""
    with pytest.raises(ConfigError) as info:
        ConfigSpace(**options)
    assert str(info.value) == message


def test_a_space_file_flag_written_as_a_string_is_refused(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text('tp_within_node: "false"\ntp_degrees: [8]\n')
    with pytest.raises(ConfigError, match=r"^tp_within_node='false': must be true or false$"):
        ConfigSpace.from_file(path)
    path.write_text("tp_within_node: false\n")
    assert ConfigSpace.from_file(path).tp_within_node is False


@pytest.mark.parametrize(("name", "text", "message"), [
    ("g.yaml", "global_batch_sizes: [8\n", r"could not be parsed \(.* at line 2, column 1\)$"),
    ("g.toml", "global_batch_sizes = [8\n", r"could not be parsed \(.*\)$"),
    ("g.yaml", "", r"states no field \(leave the flag out for the default space\)$"),
    ("g.json", " \n", r"states no field"),
    ("g.yaml", "# to be written\n", r"states no field"),
    ("g.toml", "# to be written\n", r"states no field"),
])
def test_a_grid_file_that_says_nothing_usable_is_one_line(tmp_path, name, text, message):
    """A parser's caret diagram is not an error line, and a file that states no field is not
    the default space (it is most likely a file not yet written)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        ConfigSpace.from_file(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"grid={str(path)!r}")


def test_an_empty_mapping_written_out_is_the_default_space(tmp_path):
    for name, text in (("g.json", "{}"), ("g.yaml", "{}\n")):
        (tmp_path / name).write_text(text)
        assert ConfigSpace.from_file(tmp_path / name) == ConfigSpace()
