"""Extrapolation splits: fit on what was measured, predict what people ask about next.

Each split is data: a :class:`Split` holds one or more :class:`Fold` values, each a train
mask and a test mask over the rows of one measurement frame (rows in neither are not used).
Unlike a cross-validation fold, the train mask is not the complement of the test mask: an
extrapolation fold fits on a small corner of the data and predicts far outside it.

* ``larger-model``: per measurement family with several models, fit on the rows of models
  no larger than the family's smallest (by parameter count, any family), predict the
  family's largest model where it is at least 4x larger (1B -> 8B on the Ultra-Scale data:
  by the models' names 8x, by parameters with the 131k-token embeddings 5.5x, by the
  blocks' parameters 9x);
* ``larger-cluster``: per family with several cluster sizes, fit on the family's runs on at
  most a quarter of its largest cluster (and every other family's runs), predict the largest
  (Ultra-Scale <= 64 GPUs -> 256 GPUs, vTrain 2 GPUs -> 8 GPUs); and again from at most half
  of it, the step people take next (Ultra-Scale <= 128 -> 256 GPUs, vTrain <= 4 -> 8 GPUs);
* ``family``: each measurement family left out in turn (fit without vTrain, predict vTrain,
  and the reverse): a framework and cluster with no measurement of its own;
* ``multi-node``: the largest cluster of each single-node family predicted from its smaller
  ones (vTrain's A100 2-4 GPUs -> 8 GPUs, the other families fitted on), and, where a
  family spans nodes, its two-node runs predicted from its one-node runs (Ultra-Scale's 8
  GPUs -> 16 GPUs: the inter-node link and the tensor-parallel groups across nodes are
  never seen in training). The public A100 data holds no multi-node run, so the first fold
  is the A100 scale-out proxy and the second the node-crossing proxy (on H100).

A family is the first word of a row's source (:func:`~paratune.models.source_family`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EXTRAPOLATION_SPLITS", "Fold", "Split", "extrapolation_split", "model_params"]

EXTRAPOLATION_SPLITS = ("larger-model", "larger-cluster", "family", "multi-node")
"""Names of the extrapolation splits, in the order the experiment reports them."""

MIN_MODEL_RATIO = 4.0
"""The held-out model of ``larger-model`` has at least this many times the parameters of the
largest model fitted on (else the family is skipped: it is no extrapolation)."""


@dataclass(frozen=True)
class Fold:
    """One fit-and-predict of a split."""

    label: str
    """What is fitted and what is predicted, in words (``ultrascale: <=64 -> 256 GPUs``)."""
    train: np.ndarray
    """Boolean mask of the rows fitted on."""
    test: np.ndarray
    """Boolean mask of the rows predicted (disjoint from ``train``)."""

    def __post_init__(self) -> None:
        if self.train.shape != self.test.shape:
            raise ValueError("train and test masks must have one entry per row")
        if np.any(self.train & self.test):
            raise ValueError(f"fold {self.label!r}: a row is both fitted on and predicted")


@dataclass(frozen=True)
class Split:
    """A named set of folds over one frame."""

    name: str
    """One of :data:`EXTRAPOLATION_SPLITS`."""
    folds: tuple[Fold, ...]
    """The folds, each scored on its own."""


def model_params(frame: pd.DataFrame, c: Any = None) -> np.ndarray:
    """Parameter count of each row's model (blocks plus embeddings, untied unless the row
    says ``tie_embeddings``); ``c``: the frame's :class:`~paratune.models.features.Columns`
    where already built."""
    from paratune.models.features import Columns

    c = Columns(frame) if c is None else c
    embeddings = np.where(c.tied, 1.0, 2.0) * c.vocab * c.hidden
    return c.layers * c.params_per_layer + embeddings


def _families(frame: pd.DataFrame) -> np.ndarray:
    from paratune.models._estimators import source_family

    return source_family(frame)


def _timed(frame: pd.DataFrame) -> np.ndarray:
    from paratune.models._data import measured_step_time

    return np.isfinite(measured_step_time(frame))


def extrapolation_split(frame: pd.DataFrame, name: str) -> Split:
    """The folds of extrapolation split ``name`` over the rows of ``frame``.

    Args:
        frame: Measurement rows (successful and failed).
        name: One of :data:`EXTRAPOLATION_SPLITS`.

    Returns:
        A :class:`Split` whose folds each have rows to fit on and timed rows to predict.

    Raises:
        ConfigError: unknown split name.
        DatasetError: the data holds no fold of that split (one family, one model, ...).
    """
    builders = {"larger-model": _larger_model, "larger-cluster": _larger_cluster,
                "family": _family_out, "multi-node": _multi_node}
    if name not in builders:
        raise ConfigError("split", name, f"must be one of {', '.join(EXTRAPOLATION_SPLITS)}")
    family = _families(frame)
    timed = _timed(frame)
    built = builders[name](frame, family)
    folds = [f for f in built if (f.test & timed).any() and (f.train & timed).any()]
    if not folds:
        # a fold whose side to fit on or to predict has no run that ran: say that, not
        # what a fold needs, which the data has
        why = "; ".join(f"{f.label}: no run that ran among the rows "
                        f"{'to predict' if not (f.test & timed).any() else 'to fit on'}"
                        for f in built)
        raise DatasetError(f"split {name}: the data holds no fold of it ("
                           f"{why or _needs[name]})")
    return Split(name=name, folds=tuple(folds))


_needs = {"larger-model": "a family with models at least 4x apart in size",
          "larger-cluster": "a family with cluster sizes at least 4x apart",
          "family": "at least two measurement families",
          "multi-node": "a family with cluster sizes 2x apart or one spanning nodes"}


def _larger_model(frame: pd.DataFrame, family: np.ndarray) -> list[Fold]:
    params = model_params(frame)
    names = frame["model_name"].astype(str).to_numpy()
    out = []
    for fam in sorted(set(family)):
        own = family == fam
        sizes = {n: float(np.nanmedian(params[own & (names == n)]))
                 for n in set(names[own])}
        if len(sizes) < 2:
            continue
        smallest = min(sizes.values())
        largest_name = max(sizes, key=sizes.get)
        if sizes[largest_name] < MIN_MODEL_RATIO * smallest:
            continue
        train = params <= smallest * 1.05
        test = own & (names == largest_name)
        fitted = sorted({str(n) for n in names[train & own]})
        out.append(Fold(f"{fam}: {','.join(fitted)} -> {largest_name}", train & ~test, test))
    return out


def _larger_cluster(frame: pd.DataFrame, family: np.ndarray) -> list[Fold]:
    world = np.asarray(frame["world_size"], dtype=float)
    out = []
    for fam in sorted(set(family)):
        own = family == fam
        largest = world[own].max()
        small = own & (world <= largest / 4)
        if not small.any():
            continue
        test = own & (world == largest)
        label = f"{fam}: <={int(world[small].max())} -> {int(largest)} GPUs"
        out.append(Fold(label, small | ~own, test))
        half = own & (world <= largest / 2)
        if world[half].max() > world[small].max():
            label = f"{fam}: <={int(world[half].max())} -> {int(largest)} GPUs (2x)"
            out.append(Fold(label, half | ~own, test))
    return out


def _family_out(frame: pd.DataFrame, family: np.ndarray) -> list[Fold]:
    families = sorted(set(family))
    if len(families) < 2:
        return []
    return [Fold(f"without {fam} -> {fam}", family != fam, family == fam) for fam in families]


def _multi_node(frame: pd.DataFrame, family: np.ndarray) -> list[Fold]:
    from paratune.models.features import Columns

    c = Columns(frame)
    world = c.world
    nodes = np.ceil(world / c.per_node)
    out = []
    for fam in sorted(set(family)):
        own = family == fam
        if nodes[own].max() <= 1:
            # single-node family: its largest cluster from the smaller ones
            largest = world[own].max()
            small = own & (world <= largest / 2)
            if small.any():
                label = (f"{fam}: {int(world[small].min())}-{int(world[small].max())} -> "
                         f"{int(largest)} GPUs (one node)")
                out.append(Fold(label, small | ~own, own & (world == largest)))
        else:
            one = own & (nodes == 1)
            two = own & (nodes == 2)
            if one.any() and two.any():
                label = f"{fam}: 1 node -> 2 nodes ({int(world[two].max())} GPUs)"
                out.append(Fold(label, one | ~own, two))
    return out
