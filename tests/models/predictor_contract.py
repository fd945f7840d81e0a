"""What every predictor must do, stated once (as optuna's ``testing`` package does for samplers).

Subclass :class:`PredictorContract` in a ``test_*.py`` file, name it ``Test...`` and define
:meth:`PredictorContract.make_predictor`; pytest then runs every contract test on that
predictor, fitted once per class on a small measured dataset (the synthetic measurements of
``tests/models/conftest.py``, with a stalled pipeline regime, so that the models that learn one
do). A predictor is anything that satisfies :class:`paratune.predictor.Predictor`.

Class attributes say what a predictor offers beyond the protocol:

* ``output_columns``: the exact columns of its prediction frame, in order (``None``: only
  :data:`paratune.predictor.PREDICTION_COLUMNS` first, in their order);
* ``quantiles``: the lower and upper throughput quantile columns it gives (``None``: none);
* ``saves``: it has ``save(path)``, and ``load_path(path)`` reads the saved form back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest

from paratune import ParallelConfig, get_model
from paratune.predictor import (
    CONFIG_COLUMNS,
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_STEP_TIME_S,
    PRED_TOKENS_PER_SEC_PER_GPU,
    PREDICTION_COLUMNS,
    Predictor,
    config_frame,
)

__all__ = ["PredictorContract"]


def _unseen_configs() -> pd.DataFrame:
    """Config rows the training data does not hold: another model size, more devices, a row
    of unknown hardware among them."""
    model = get_model("llama3-8b", seq_len=4096)
    layouts = [ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=1,
                              global_batch_size=dp * 16)
               for dp, tp, pp in ((16, 8, 1), (8, 8, 2), (4, 4, 8), (32, 2, 2))]
    known = config_frame(model, layouts, "H100")
    unknown = config_frame(model, layouts[:1], "H100")
    unknown["hardware"] = "no-such-gpu"
    return pd.concat([known, unknown], ignore_index=True)


class PredictorContract:
    """The contract tests; a subclass supplies the predictor."""

    output_columns: ClassVar[tuple[str, ...] | None] = None
    quantiles: ClassVar[tuple[str, str] | None] = None
    saves: ClassVar[bool] = False

    def make_predictor(self) -> Any:
        """A new, unfitted predictor with ``fit(frame)`` returning the fitted one."""
        raise NotImplementedError

    def load_path(self, path: Path) -> Any:
        """The predictor saved at ``path`` (for ``saves = True``)."""
        raise NotImplementedError

    # -------------------------------------------------------------- fixtures
    # class-scoped, so each predictor is fitted once for all the contract's tests
    @pytest.fixture(scope="class")
    @classmethod
    def training(cls, make_synthetic) -> pd.DataFrame:
        return make_synthetic(seed=5, n_per_model=40, stalls=True)

    @pytest.fixture(scope="class")
    @classmethod
    def fitted(cls, training) -> Any:
        return cls().make_predictor().fit(training)

    @pytest.fixture(scope="class")
    @classmethod
    def configs(cls, training) -> pd.DataFrame:
        """Training configurations and unseen ones, under an index that is not 0..n-1."""
        frame = pd.concat([training[list(CONFIG_COLUMNS)], _unseen_configs()],
                          ignore_index=True)
        frame.index = 1000 + 3 * np.arange(len(frame))
        return frame

    @pytest.fixture(scope="class")
    @classmethod
    def predictions(cls, fitted, configs) -> pd.DataFrame:
        return fitted.predict(configs)

    # -------------------------------------------------------------- the contract
    def test_is_a_predictor(self, fitted):
        assert isinstance(fitted, Predictor)

    def test_columns_and_their_order(self, predictions):
        columns = list(predictions.columns)
        if self.output_columns is not None:
            assert columns == list(self.output_columns)
        else:
            assert columns[:len(PREDICTION_COLUMNS)] == list(PREDICTION_COLUMNS)
        if self.quantiles is not None:
            assert set(self.quantiles) <= set(columns)

    def test_one_row_per_input_row_in_order(self, fitted, configs, predictions):
        assert len(predictions) == len(configs)
        assert predictions.index.equals(configs.index)
        # the same rows in another order: the same predictions, in that order
        order = np.random.default_rng(0).permutation(len(configs))
        shuffled = fitted.predict(configs.iloc[order])
        assert shuffled.index.equals(configs.index[order])
        pd.testing.assert_frame_equal(shuffled, predictions.iloc[order])

    def test_vectorised_prediction_equals_row_by_row(self, fitted, configs, predictions):
        # every unseen row and a spread of the training ones
        rows = [*range(0, len(configs) - 5, 17), *range(len(configs) - 5, len(configs))]
        one_by_one = pd.concat([fitted.predict(configs.iloc[[i]]) for i in rows])
        pd.testing.assert_frame_equal(one_by_one, predictions.iloc[rows])

    def test_a_bad_row_leaves_the_others_alone(self, fitted, configs, predictions):
        bad = configs.iloc[:6].copy()
        bad.iloc[2, bad.columns.get_loc("hardware")] = "no-such-gpu"
        out = fitted.predict(bad)
        assert np.isnan(out[PRED_STEP_TIME_S].iloc[2])
        keep = [0, 1, 3, 4, 5]
        pd.testing.assert_frame_equal(out.iloc[keep], predictions.iloc[keep])

    def test_predictions_are_positive_and_consistent(self, configs, predictions):
        known = configs["hardware"].ne("no-such-gpu").to_numpy()
        step = predictions[PRED_STEP_TIME_S].to_numpy(float)
        tokens = predictions[PRED_TOKENS_PER_SEC_PER_GPU].to_numpy(float)
        assert np.isfinite(step[known]).all() and (step[known] > 0).all()
        assert np.isnan(step[~known]).all()
        # throughput per device is the batch's tokens over the step time and the devices
        per_step = configs["global_batch_size"].to_numpy(float) * configs["seq_len"].to_numpy(
            float) / configs["world_size"].to_numpy(float)
        np.testing.assert_allclose(tokens[known], per_step[known] / step[known], rtol=1e-9)
        memory = predictions[PRED_PEAK_MEM_GB].to_numpy(float)
        assert (memory[known] > 0).all()

    def test_feasibility_is_a_probability(self, configs, predictions):
        known = configs["hardware"].ne("no-such-gpu").to_numpy()
        prob = predictions[PRED_FEASIBLE_PROB].to_numpy(float)
        assert np.isfinite(prob[known]).all()
        assert ((prob[known] >= 0.0) & (prob[known] <= 1.0)).all()

    def test_quantiles_hold_the_point_prediction(self, predictions):
        if self.quantiles is None:
            pytest.skip("this predictor gives no throughput quantiles")
        lower, upper = (predictions[c].to_numpy(float) for c in self.quantiles)
        point = predictions[PRED_TOKENS_PER_SEC_PER_GPU].to_numpy(float)
        given = np.isfinite(lower) & np.isfinite(upper) & np.isfinite(point)
        assert given.sum() > len(point) // 2
        assert (lower[given] <= point[given]).all()
        assert (point[given] <= upper[given]).all()

    def test_save_and_load_give_the_same_predictions(self, fitted, configs, predictions,
                                                     tmp_path):
        if not self.saves:
            pytest.skip("this predictor has no saved form")
        fitted.save(tmp_path / "model")
        loaded = self.load_path(tmp_path / "model")
        pd.testing.assert_frame_equal(loaded.predict(configs), predictions)
