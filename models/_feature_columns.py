"""The config frame's columns as numpy arrays, resolved once, for the analytical features
(:mod:`paratune.models.features`): model shape, layout, option codes and hardware figures per
row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.batch import option_codes
from paratune.errors import ConfigError
from paratune.hardware import HardwareSpec, get_hardware
from paratune.parallel import max_stage_layers
from paratune.spec import block_params

if TYPE_CHECKING:
    import pandas as pd

    from paratune.parallel import ParallelConfig
    from paratune.spec import ModelSpec

_SCHEDULES = option_codes("schedule")


class Columns:
    """numpy views of a config frame's columns, resolved once (hardware looked up per name).

    Rows whose hardware is unknown get NaN hardware figures, and rows with an unknown
    schedule, sharding or recompute value a NaN code; :attr:`error` holds the message for
    them (empty string elsewhere).
    """

    def __init__(self, frame: pd.DataFrame) -> None:
        from paratune.batch import ConfigBatch

        batch = ConfigBatch.from_frame(frame, loose=True)
        self.n = len(batch)
        self.layers = batch.num_layers
        self.hidden = batch.hidden_size
        self.heads = batch.num_heads
        self.kv_heads = np.where(batch.num_kv_heads <= 0, self.heads, batch.num_kv_heads)
        self.ffn = batch.ffn_hidden_size
        self.vocab = batch.vocab_size
        self.seq = batch.seq_len
        self.tied = batch.tie_embeddings
        self.mlp_matrices = batch.mlp_matrices.astype(float)
        self.dp = batch.dp
        self.tp = batch.tp
        self.pp = batch.pp
        self.cp = np.maximum(batch.cp, 1.0)
        # a sequence's tokens on one rank, and the ranks that hold the same parameters (the
        # gradient reduction's and ZeRO's group: Megatron-LM reduces over dp*cp)
        self.seq_local = batch.seq_len / self.cp
        self.dp_group = batch.dp * self.cp
        self.micro = batch.micro_batch_size
        self.global_batch = batch.global_batch_size
        self.virtual = np.maximum(batch.virtual_stages, 1.0)
        option_errors = np.full(self.n, "", dtype=object)

        def codes(name: str) -> np.ndarray:
            code = getattr(batch, name)
            bad = code < 0
            if bad.any():
                rule = f"must be one of {', '.join(option_codes(name))}"
                fresh = bad & (option_errors == "")
                option_errors[fresh] = [f"{name}={v!r} {rule}" for v in batch.unknown[name][fresh]]
            return np.where(bad, np.nan, code.astype(float))

        self.schedule = codes("schedule")
        # ZeRO-1 over a single rank of the parameters (dp * cp) shards nothing: the same run
        # as none (what every framework does), and so the same features, not a rarely-seen
        # category
        self.sharding = codes("sharding")
        self.sharding = np.where((self.sharding == 1) & (self.dp_group == 1), 0.0,
                                 self.sharding)
        self.recompute = codes("recompute")
        hw = hardware_columns(batch.hardware)
        self.peak_flops = hw["peak_flops"]
        self.memory_gb = hw["memory_gb"]
        self.intra_bw = hw["intra_node_bw"]
        self.inter_bw = hw["inter_node_bw"]
        self.memory_bw = hw["memory_bw"]
        self.matmul_efficiency = hw["matmul_efficiency"]
        per_node = batch.devices_per_node.astype(float)
        self.per_node = np.where(per_node < 1, hw["devices_per_node"], per_node)
        self.hardware_error = hw["error"]
        self.error = np.where(self.hardware_error != "", self.hardware_error, option_errors)
        self.accelerator = hw["accelerator"]
        self.world = self.dp * self.tp * self.pp * self.cp

    # derived shapes
    @property
    def head_dim(self) -> np.ndarray:
        return self.hidden / self.heads

    @property
    def params_per_layer(self) -> np.ndarray:
        return block_params(self.hidden, self.kv_heads * self.head_dim, self.ffn,
                            self.mlp_matrices)

    @property
    def layers_per_stage(self) -> np.ndarray:
        """Layers on the fullest pipeline rank (at least one)."""
        return max_stage_layers(self.layers, self.pp)


def _lookup(values: Any, convert: Any, *, dtype: Any = float) -> np.ndarray:
    """``convert`` applied to each distinct value, spread back over the rows (vectorised)."""
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(np.asarray(values, dtype=object), dtype=object),
                                  sort=False)
    table = np.asarray([convert(u) for u in uniques] + [convert(None)], dtype=dtype)
    return table[codes]  # code -1 (missing) picks the last entry


def hardware_columns(names: Any) -> dict[str, np.ndarray]:
    """Catalogue figures for each row's hardware name (unknown names: NaN and an error)."""
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(np.asarray(names, dtype=object)), sort=False)
    specs: list[HardwareSpec | None] = []
    errors: list[str] = []
    for name in [*uniques, None]:
        if name is None or not str(name).strip() or str(name).strip().lower() == "nan":
            specs.append(None)
            errors.append("hardware is missing")
            continue
        try:
            specs.append(get_hardware(str(name)))
            errors.append("")
        except ConfigError as exc:
            specs.append(None)
            # named after the config frame's column (the catalogue's own field is "gpu")
            errors.append(str(ConfigError("hardware", name, exc.rule)))
    out: dict[str, np.ndarray] = {}
    # "peak_flops" here is the compute speed the estimate assumes: the vendor peak, or the
    # catalogue's nominal figure where there is none (the CPU).
    for attr, source in (("peak_flops", "effective_flops"), ("memory_gb", "memory_gb"),
                         ("intra_node_bw", "intra_node_bw"), ("inter_node_bw", "inter_node_bw"),
                         ("devices_per_node", "devices_per_node"), ("memory_bw", "memory_bw"),
                         ("matmul_efficiency", "matmul_efficiency")):
        table = np.asarray([float(getattr(s, source)) if s is not None
                            and getattr(s, source) is not None else np.nan for s in specs],
                           dtype=float)
        out[attr] = table[codes]
    out["accelerator"] = np.asarray([s is not None and s.device_type != "cpu" for s in specs],
                                    dtype=bool)[codes]
    out["error"] = np.asarray(errors, dtype=object)[codes]
    return out


def _cols(frame: pd.DataFrame | Columns) -> Columns:
    return frame if isinstance(frame, Columns) else Columns(frame)


def config_row(model: ModelSpec, config: ParallelConfig, hardware: HardwareSpec | str, *,
               devices_per_node: int | None = None) -> pd.DataFrame:
    """A one-row config frame (for computing features of a single configuration)."""
    from paratune.predictor import config_frame

    return config_frame(model, [config], hardware, devices_per_node=devices_per_node)


def num_microbatches(frame: pd.DataFrame | Columns) -> np.ndarray:
    """Micro-batches per step on each data-parallel rank: ``global / (dp * micro)``."""
    c = _cols(frame)
    return c.global_batch / (c.dp * c.micro)
