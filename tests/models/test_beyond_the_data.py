"""Where nobody measured (experiments/beyond_the_data.py): an 80B model ten times the
largest fitted, and tensor parallelism across A100 nodes from a family measured in one node.
No measurement scores these here; the physics bounds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def public_model(public_dir):
    from paratune.models import PerformanceModel, load_measurements, source_family

    frame = load_measurements(sorted(public_dir.glob("*.csv")))
    families = source_family(frame)
    sources = frame["source"].astype(str)
    model = PerformanceModel(n_estimators=200, n_jobs=1).fit(frame)
    return model, {f: sources[families == f].iloc[0] for f in ("ultrascale", "vtrain")}


@pytest.mark.slow
def test_an_80b_models_first_choice_is_a_pipeline_at_a_framework_like_share_of_peak(
        public_model):
    sys.path.insert(0, str(REPO / "experiments"))
    from beyond_the_data import WORLDS_80B, large_model_summary, large_model_table

    model, sources = public_model
    table = large_model_table(model, sources["ultrascale"])
    summary = {row["world_size"]: row for row in large_model_summary(table)}
    assert sorted(summary) == list(WORLDS_80B)
    pipelines = table[table["pp"] > 1]
    # the sweep's stalls, learned on 1-8B, do not decide an 80B model's pipelines
    assert pipelines["stall_prob"].max() < 0.1
    for world, row in summary.items():
        # deep pipelines of such a model run at about 30% of peak in the sweep's framework;
        # the prediction stays in a framework's range, neither stalled nor at the peak
        assert 0.15 < row["mfu_max"] < 0.45, (world, row)
        assert " pp1 " not in row["first_by_point"] + " ", (world, row["first_by_point"])
        # the risk-aware choice (what tune ranks by here) is not bought with more than the
        # bound of throughput: no tensor-parallel group over several nodes, whose slow end
        # is the surest but which is predicted at under half the pipelines' throughput
        tp = int(row["first_by_risk_aware"].split()[0].removeprefix("tp"))
        assert tp <= 8, (world, row["first_by_risk_aware"])


@pytest.mark.slow
def test_tensor_parallelism_across_a100_nodes_costs_a_few_times_its_node(public_model):
    sys.path.insert(0, str(REPO / "experiments"))
    from beyond_the_data import a100_table

    model, sources = public_model
    table = a100_table(model, sources["vtrain"])
    across = table[table["tp_crosses_nodes"] & (table["tp"] == 16)]
    assert len(across) == 3  # on 16, 32 and 64 A100s
    # two nodes' tp=16 against tp=8 in one node on the same cluster: hierarchical
    # reduction and a well-tuned constant, not every byte at the network's bandwidth (the
    # analytical estimate alone has it 10x the in-node collective)
    assert ((across["vs_tp8"] > 1.2) & (across["vs_tp8"] < 4.0)).all(), across
    # and the interval says it is unsure: wider than in the node (q90 / q10 of the step
    # 3.6 against 2.3 in the median; the rows in the node are beyond vTrain's 8 GPUs too)
    inside = table[~table["tp_crosses_nodes"]]
    assert (across["q90_step_s"] / across["q10_step_s"]).median() > 1.25 * (
        inside["q90_step_s"] / inside["q10_step_s"]).median()
