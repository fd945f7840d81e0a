"""Many configurations at once: :class:`ConfigBatch`, typed numpy columns of (model shape,
parallel layout, hardware), one row per configuration.

A batch is built from objects (:meth:`ConfigBatch.from_configs`) or from a config frame
(:meth:`ConfigBatch.from_frame`, the columns of :data:`paratune.predictor.CONFIG_COLUMNS`)
and turns back into either (:meth:`~ConfigBatch.configs`, :meth:`~ConfigBatch.to_frame`).
Its layout rules are one table, :data:`~paratune.layout_rules.LAYOUT_RULES`, in the order
:class:`~paratune.ParallelConfig` checks them, so that :meth:`ConfigBatch.validate` names
for each row the first rule it breaks with the same ``ConfigError(field, value, rule)`` that
``ParallelConfig(...).validate(model)`` raises for that row.

Options (schedule, sharding, recompute) are stored as codes: a value's position in its enum
(:func:`option_codes`), ``-1`` for text that is none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.layout_rules import (
    LAYOUT_INTS,
    LAYOUT_RULES,
    MLP_KINDS,
    OPTIONS,
    LayoutRule,
    RuleContext,
    option_codes,
)
from paratune.parallel import ParallelConfig, layout_key, max_stage_layers
from paratune.predictor import CONFIG_COLUMNS, PARALLEL_COLUMNS
from paratune.spec import (
    ModelSpec,
    block_params,
    model_flops_per_token,
    total_params,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FRAME_DEFAULTS", "LAYOUT_INTS", "LAYOUT_RULES", "MLP_KINDS", "MODEL_INTS", "OPTIONS",
           "ConfigBatch", "LayoutRule", "option_codes"]

MODEL_INTS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "vocab_size", "seq_len")
"""The integer fields of a model shape, in declaration order."""
_REQUIRED = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
             "seq_len", "dp", "tp", "pp", "micro_batch_size", "global_batch_size")
"""Config-frame columns :meth:`ConfigBatch.from_frame` needs; the others have defaults."""
_CODES = {name: option_codes(name) for name in OPTIONS}


_DEFAULTS = {f.name: (f.default.value if isinstance(f.default, StrEnum) else f.default)
             for f in dataclasses.fields(ParallelConfig)}
_DEFAULTS.update({f.name: f.default for f in dataclasses.fields(ModelSpec)
                  if f.default is not dataclasses.MISSING and f.name != "name"})
FRAME_DEFAULTS: dict[str, Any] = {
    "model_name": "model", **{k: v for k, v in _DEFAULTS.items() if k not in _REQUIRED},
    "hardware": "cpu", "devices_per_node": None}
"""What :meth:`ConfigBatch.from_frame` takes for a config-frame column a frame lacks
(``None``: derived, ``num_kv_heads`` from ``num_heads`` and ``devices_per_node`` from the
catalogue)."""


@dataclass(frozen=True, eq=False)
class ConfigBatch:
    """Configurations as columns: int64 sizes and degrees, option codes (int8), the MLP kind
    code, floats for the rotary base and norm epsilon, and the hardware names.

    Rows are not validated when built; :meth:`validate` says which break which rule.
    """

    model_name: np.ndarray
    """Model labels (object array of str)."""
    num_layers: np.ndarray
    hidden_size: np.ndarray
    num_heads: np.ndarray
    num_kv_heads: np.ndarray
    """Key/value heads (``num_heads`` where a frame leaves it empty)."""
    ffn_hidden_size: np.ndarray
    vocab_size: np.ndarray
    seq_len: np.ndarray
    tie_embeddings: np.ndarray
    """bool."""
    mlp: np.ndarray
    """Codes into :data:`MLP_KINDS` (int8; -1: none of them)."""
    rope_theta: np.ndarray
    norm_eps: np.ndarray
    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    micro_batch_size: np.ndarray
    global_batch_size: np.ndarray
    schedule: np.ndarray
    """Codes of :class:`~paratune.Schedule` (int8; -1: none of them)."""
    virtual_stages: np.ndarray
    sharding: np.ndarray
    """Codes of :class:`~paratune.Sharding`, equal to the ZeRO stage (int8; -1: none)."""
    recompute: np.ndarray
    """Codes of :class:`~paratune.Recompute` (int8; -1: none of them)."""
    cp: np.ndarray
    """Context-parallel degrees (1 where a frame has no ``cp`` column)."""
    hardware: np.ndarray
    """Catalogue names as given (object array of str)."""
    devices_per_node: np.ndarray
    """Devices per node (the catalogue's where not given; 0 for an unknown device)."""
    unknown: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """For an option or ``mlp`` column holding values of no code: the values as given (an
    object array, for the messages that name them)."""

    # ------------------------------------------------------------------ building
    @classmethod
    def from_configs(cls, model: ModelSpec | Sequence[ModelSpec],
                     configs: Iterable[ParallelConfig],
                     hardware: HardwareSpec | str | Sequence[HardwareSpec | str], *,
                     devices_per_node: int | Sequence[int | None] | None = None
                     ) -> ConfigBatch:
        """A batch of ``configs`` of ``model`` on ``hardware``.

        Args:
            model: The model, or one per config.
            configs: Layouts (not validated here).
            hardware: Catalogue entry or its name, or one per config.
            devices_per_node: Overrides the catalogue's node size (one figure, or one per
                config; ``None`` keeps the catalogue's).
        """
        configs = list(configs)
        n = len(configs)
        models = [model] * n if isinstance(model, ModelSpec) else list(model)
        specs = ([hardware] * n if isinstance(hardware, str | HardwareSpec) else list(hardware))
        specs = [get_hardware(h) if isinstance(h, str) else h for h in specs]
        sizes = (list(devices_per_node) if isinstance(devices_per_node, Sequence)
                 else [devices_per_node] * n)
        if not len(models) == len(specs) == len(sizes) == n:
            raise ConfigError("configs", n, "needs one model, hardware and node size per "
                              "config where a list of them is given")

        def column(values: Iterable[Any], dtype: Any) -> np.ndarray:
            return np.fromiter(values, dtype, n) if dtype is not object else np.asarray(
                list(values), dtype=object)

        columns: dict[str, np.ndarray] = {
            "model_name": column((m.name for m in models), object),
            "tie_embeddings": column((bool(m.tie_embeddings) for m in models), bool),
            "mlp": column((MLP_KINDS.index(m.mlp) for m in models), np.int8),
            "rope_theta": column((float(m.rope_theta) for m in models), float),
            "norm_eps": column((float(m.norm_eps) for m in models), float),
            "hardware": column((h.name for h in specs), object),
            "devices_per_node": column((size or h.devices_per_node
                                        for size, h in zip(sizes, specs)), np.int64)}
        for name in MODEL_INTS:
            columns[name] = column((getattr(m, name) for m in models), np.int64)
        for name in LAYOUT_INTS:
            columns[name] = column((getattr(c, name) for c in configs), np.int64)
        for name in OPTIONS:
            codes = _CODES[name]
            columns[name] = column((codes[getattr(c, name).value] for c in configs), np.int8)
        return cls(**columns)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, *, loose: bool = False) -> ConfigBatch:
        """A batch of a config frame's rows.

        Columns other than :data:`_REQUIRED` may be missing (the dataclass defaults; the
        hardware ``cpu``); empty ``num_kv_heads`` are ``num_heads`` and empty
        ``devices_per_node`` (or below 1) the catalogue's. Option and ``mlp`` text of no
        code is kept for the messages.

        Args:
            frame: A config frame.
            loose: Read the frame as predictions do rather than check it: option text
                matched without case or surrounding spaces, an empty cell taking the
                default, and sizes and degrees kept as float64 as given (NaN for an empty
                cell) rather than refused when they are not whole numbers.

        Raises:
            ConfigError: a required column is missing, or (unless ``loose``) a size or
                degree is not a whole number (the error's ``row`` attribute is the row's
                position).
        """
        n = len(frame)
        for name in _REQUIRED:
            if name not in frame.columns:
                raise ConfigError(name, None, "column missing from the config frame")
        columns = {name: _numbers(frame, name, _DEFAULTS.get(name), n, loose)
                   for name in (*MODEL_INTS, *LAYOUT_INTS) if name != "num_kv_heads"}
        kv = (np.asarray(frame["num_kv_heads"], dtype=float) if "num_kv_heads" in frame.columns
              else np.full(n, np.nan))
        columns["num_kv_heads"] = np.where(np.isnan(kv), columns["num_heads"], kv)
        if not loose:
            _check_whole("num_kv_heads", kv, np.isnan(kv))
            columns["num_kv_heads"] = columns["num_kv_heads"].astype(np.int64)
        unknown: dict[str, np.ndarray] = {}
        for name, table in (*_CODES.items(), ("mlp", {k: i for i, k in enumerate(MLP_KINDS)})):
            columns[name], text = _coded(frame, name, table, _DEFAULTS[name], n, loose)
            if text is not None:
                unknown[name] = text

        def column(name: str, default: Any, dtype: Any) -> np.ndarray:
            if name not in frame.columns:
                return np.full(n, default, dtype=dtype)
            return np.asarray(frame[name], dtype=dtype)

        columns["model_name"] = column("model_name", "model", object)
        if "tie_embeddings" in frame.columns and frame["tie_embeddings"].dtype != bool:
            columns["tie_embeddings"] = column("tie_embeddings", 0.0, float) > 0  # NaN: untied
        else:
            columns["tie_embeddings"] = column("tie_embeddings", False, bool)
        for name in ("rope_theta", "norm_eps"):
            columns[name] = column(name, float(_DEFAULTS[name]), float)
        columns["hardware"] = column("hardware", "cpu", object)
        given = column("devices_per_node", np.nan, float)
        missing = np.isnan(given) | (given < 1)
        columns["devices_per_node"] = (np.where(
            missing, _catalogue_node_sizes(columns["hardware"]), given) if missing.any()
            else given).astype(np.int64)
        return cls(**columns, unknown=unknown)

    # ------------------------------------------------------------------ rows
    def __len__(self) -> int:
        return len(self.dp)

    def take(self, indices: Any) -> ConfigBatch:
        """The rows at ``indices`` (positions, a boolean mask or a slice), in that order; one
        position gives a batch of one row."""
        if isinstance(indices, int | np.integer):
            indices = [indices]
        columns = {f.name: getattr(self, f.name)[indices] for f in dataclasses.fields(self)
                   if f.name != "unknown"}
        return ConfigBatch(**columns, unknown={k: v[indices] for k, v in self.unknown.items()})

    def __getitem__(self, indices: Any) -> ConfigBatch:
        return self.take(indices)

    def option_text(self, name: str) -> np.ndarray:
        """The values of option (or ``mlp``) column ``name`` as text (object array)."""
        values = (MLP_KINDS if name == "mlp" else tuple(_CODES[name]))
        table = np.asarray([*values, ""], dtype=object)
        text = table[np.where(getattr(self, name) < 0, len(values), getattr(self, name))]
        if name in self.unknown:
            text = np.where(getattr(self, name) < 0, self.unknown[name], text)
        return text

    def configs(self) -> list[ParallelConfig]:
        """The layouts, one :class:`~paratune.ParallelConfig` per row.

        Raises:
            ConfigError: a row's fields break a rule the dataclass checks.
        """
        return [ParallelConfig(**dict(zip(PARALLEL_COLUMNS, row)))
                for row in zip(*self._layout_lists())]

    def config_at(self, i: int) -> ParallelConfig:
        """Row ``i``'s layout (raises :class:`ConfigError` as :meth:`configs` does)."""
        return self.take(i).configs()[0]

    def model_at(self, i: int) -> ModelSpec:
        """Row ``i``'s model (raises :class:`ConfigError` for a shape the spec refuses)."""
        values = {name: int(getattr(self, name)[i]) for name in MODEL_INTS}
        return ModelSpec(name=str(self.model_name[i]), **values,
                         tie_embeddings=bool(self.tie_embeddings[i]),
                         mlp=self.take([i]).option_text("mlp")[0],
                         rope_theta=float(self.rope_theta[i]), norm_eps=float(self.norm_eps[i]))

    def keys(self) -> list[str]:
        """Each row's layout identity, :meth:`ParallelConfig.key`."""
        return [layout_key(row) for row in zip(*self._layout_lists())]

    def _layout_lists(self) -> list[list[Any]]:
        """The layout columns as Python lists, in ``ParallelConfig`` field order (options as
        text)."""
        return [(self.option_text(name) if name in OPTIONS else getattr(self, name)).tolist()
                for name in PARALLEL_COLUMNS]

    def to_frame(self) -> pd.DataFrame:
        """The config frame: the columns of :data:`~paratune.predictor.CONFIG_COLUMNS`."""
        import pandas as pd

        data = {name: (self.option_text(name) if name in OPTIONS or name == "mlp"
                       else getattr(self, name)) for name in CONFIG_COLUMNS}
        return pd.DataFrame(data, columns=list(CONFIG_COLUMNS))

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> np.ndarray:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_microbatches(self) -> np.ndarray:
        """``global_batch_size // (dp * micro_batch_size)`` (0 where a degree is 0)."""
        with np.errstate(all="ignore"):
            return np.floor_divide(self.global_batch_size, self.dp * self.micro_batch_size)

    @property
    def num_stages(self) -> np.ndarray:
        return self.pp * self.virtual_stages

    @property
    def layers_per_stage(self) -> np.ndarray:
        """Layers of the fullest pipeline rank (float)."""
        return max_stage_layers(self.num_layers, self.pp)

    @property
    def kv_dim(self) -> np.ndarray:
        return self.num_kv_heads * (self.hidden_size // self.num_heads)

    @property
    def mlp_matrices(self) -> np.ndarray:
        return np.where(self.mlp == MLP_KINDS.index("gelu"), 2, 3)

    @property
    def params_per_layer(self) -> np.ndarray:
        """:attr:`ModelSpec.params_per_layer` of each row (int64)."""
        return block_params(self.hidden_size, self.kv_dim, self.ffn_hidden_size,
                            self.mlp_matrices)

    @property
    def num_params(self) -> np.ndarray:
        """:attr:`ModelSpec.num_params` of each row (int64)."""
        return total_params(self.num_layers, self.params_per_layer, self.vocab_size,
                            self.hidden_size, self.tie_embeddings.astype(np.int64))

    def flops_per_token(self, *, training: bool = True, recompute: bool = False) -> np.ndarray:
        """:meth:`ModelSpec.flops_per_token` of each row."""
        return model_flops_per_token(self.num_layers, self.params_per_layer,
                                     self.hidden_size, self.seq_len, self.vocab_size,
                                     training=training, recompute=recompute)

    # ------------------------------------------------------------------ rules
    def violations(self, *, world_size: int | None = None, runnable: bool = True,
                   shape: bool = True, layout: bool = True) -> np.ndarray:
        """The position in :data:`LAYOUT_RULES` of the first rule each row breaks (-1: none).

        Args:
            world_size: Devices available (``dp*tp*pp*cp`` must equal it) when given.
            runnable: Also the limits of paratune's own trainer (as
                :meth:`ParallelConfig.validate`).
            shape: Also the rules between the layout and the row's model shape.
            layout: Also the layout rules (``False``: only the fields' own rules, those a
                ``ParallelConfig`` checks when built).
        """
        first = np.full(len(self), -1, dtype=np.int64)
        context = RuleContext(world_size=world_size, runnable=runnable)
        enabled = {name for name, on in (("layout", layout), ("world", world_size is not None),
                                         ("runnable", runnable), ("shape", shape)) if on}
        with np.errstate(all="ignore"):
            for position, rule in enumerate(LAYOUT_RULES):
                if rule.needs <= enabled:
                    first[rule.broken(self, context) & (first < 0)] = position
        return first

    def validate(self, *, world_size: int | None = None, runnable: bool = True,
                 shape: bool = True, layout: bool = True) -> list[ConfigError | None]:
        """Each row's first broken rule as the :class:`ConfigError` that
        ``ParallelConfig(...)`` (``layout=False``) or its ``validate(model, world_size,
        runnable=runnable)`` raises for it; ``None`` for a row that breaks none.

        Args: as :meth:`violations`.
        """
        first = self.violations(world_size=world_size, runnable=runnable, shape=shape,
                                layout=layout)
        context = RuleContext(world_size=world_size, runnable=runnable)
        out: list[ConfigError | None] = [None] * len(self)
        for i in np.flatnonzero(first >= 0).tolist():
            rule = LAYOUT_RULES[first[i]]
            value, text = rule.describe(self, i, context)
            out[i] = ConfigError(rule.field, value, text)
        return out


# ---------------------------------------------------------------------- frame helpers
def _numbers(frame: pd.DataFrame, name: str, default: Any, n: int, loose: bool) -> np.ndarray:
    """Column ``name`` as int64 (as float64 where ``loose``), ``default`` where absent."""
    if name not in frame.columns:
        return np.full(n, default, dtype=float if loose else np.int64)
    values = frame[name].to_numpy()
    if loose:
        return np.asarray(values, dtype=float)
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    numbers = np.asarray(values, dtype=float)
    _check_whole(name, numbers, np.zeros(n, dtype=bool))
    return numbers.astype(np.int64)


def _check_whole(name: str, numbers: np.ndarray, allowed_missing: np.ndarray) -> None:
    with np.errstate(invalid="ignore"):
        bad = ~allowed_missing & ~((numbers == np.round(numbers)) & (np.abs(numbers) < 2.0**62))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        value = None if np.isnan(numbers[i]) else float(numbers[i])
        error = ConfigError(name, value, "must be a positive integer")
        error.row = i  # type: ignore[attr-defined]
        raise error


def _coded(frame: pd.DataFrame, name: str, table: dict[str, int], default: Any, n: int,
           loose: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Codes of column ``name`` (``default`` where absent, and where ``loose`` for an empty
    cell) and, where some value has no code, the values as given."""
    import pandas as pd

    if name not in frame.columns:
        return np.full(n, table[str(default)], dtype=np.int8), None
    codes, uniques = pd.factorize(frame[name], sort=False, use_na_sentinel=True)
    if loose:
        keys = [str(u).strip().lower() for u in uniques] + [str(default)]
    else:
        keys = [u if isinstance(u, str) else None for u in uniques] + [None]
    lookup = np.asarray([table.get(k, -1) if k is not None else -1 for k in keys], dtype=np.int8)
    out = lookup[codes]
    if not (out < 0).any():
        return out, None
    values = np.array(frame[name], dtype=object)  # a copy: empty cells are set below
    values[codes < 0] = None  # an empty cell: no value (NaN, None or pandas' NA)
    return out, values


def _catalogue_node_sizes(names: np.ndarray) -> np.ndarray:
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(names), sort=False)
    sizes = []
    for name in uniques:
        try:
            sizes.append(get_hardware(str(name)).devices_per_node)
        except ConfigError:
            sizes.append(0)
    return np.asarray([*sizes, 0], dtype=np.int64)[codes]
