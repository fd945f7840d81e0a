"""The model being trained: a Llama-style (or GPT-style) decoder-only transformer."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError

__all__ = ["MODEL_PRESETS", "ModelSpec", "block_params", "forward_flops_per_token", "get_model",
           "model_flops_per_token", "total_params"]

logger = logging.getLogger(__name__)

_MLP_KINDS = ("swiglu", "gelu")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shape of a decoder-only transformer; everything the profiler and the features need.

    Parameter count and FLOPs per token are computed here and nowhere else.
    """

    name: str = "custom"
    """Label used in datasets and reports (e.g. ``"llama3-8b"``)."""
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model (residual stream) width."""
    num_heads: int
    """Attention query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_heads`` (multi-head)."""
    ffn_hidden_size: int
    """Inner width of the MLP (per projection for SwiGLU)."""
    vocab_size: int
    """Vocabulary size (already padded, as the training framework pads it)."""
    seq_len: int
    """Training sequence length in tokens."""
    tie_embeddings: bool = False
    """Whether the output projection shares the input embedding matrix."""
    mlp: str = "swiglu"
    """``"swiglu"`` (Llama: gate, up, down) or ``"gelu"`` (GPT: up, down)."""
    rope_theta: float = 500000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Free-form provenance (e.g. where a spec was read from); not part of identity."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the shape is a real transformer.

        Raises:
            ConfigError: naming the field, the value and the rule.
        """
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                     "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, value, "must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ConfigError("num_heads", self.num_heads,
                              f"must divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads={self.num_heads}")
        if self.mlp not in _MLP_KINDS:
            raise ConfigError("mlp", self.mlp, f"must be one of {', '.join(_MLP_KINDS)}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", self.tie_embeddings, "must be true or false")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(name, value, "must be a positive, finite number")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", self.name, "must be a non-empty text")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError("hidden_size", self.hidden_size,
                              "head_dim = hidden_size / num_heads must be even (rotary embeddings)")

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer block (attention, MLP and the two norms)."""
        return block_params(self.hidden_size, self.kv_dim, self.ffn_hidden_size,
                            self.num_mlp_matrices)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All trainable parameters (the tied output matrix counted once)."""
        return total_params(self.num_layers, self.params_per_layer, self.vocab_size,
                            self.hidden_size, self.tie_embeddings)

    @property
    def num_matmul_params(self) -> int:
        """Parameters that take part in matrix multiplies per token: every block's weights and
        the output projection (the embedding lookup is a gather, not a matmul)."""
        return self.num_layers * self.params_per_layer + self.embedding_params

    def flops_per_token(self, *, training: bool = True, recompute: bool = False) -> float:
        """Model FLOPs per token (the MFU convention of Megatron-LM and nanotron).

        Forward: ``2 * matmul params + 4 * num_layers * seq_len * hidden`` (attention scores
        and their weighted sum, not halved for the causal mask). Training is three forwards
        (forward, and a backward twice as expensive); ``recompute=True`` adds one more forward
        of the transformer blocks (the output projection is not recomputed), giving hardware
        FLOPs under full activation recomputation.

        Args:
            training: Count the backward pass too.
            recompute: Count a second forward (full activation recomputation).

        Returns:
            FLOPs for one token of one sequence of ``seq_len`` tokens.
        """
        return model_flops_per_token(self.num_layers, self.params_per_layer,
                                     self.hidden_size, self.seq_len, self.vocab_size,
                                     training=training, recompute=recompute)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("extra")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], "is not a ModelSpec field")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(missing[0], None, "is missing: a model needs "
                              f"{', '.join(missing)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, path: str | Path, *, name: str | None = None,
                       seq_len: int | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a Llama-family or GPT-2 style config).

        Args:
            path: The ``config.json`` file, or the directory that holds it.
            name: Label for the spec; defaults to the directory name.
            seq_len: Training sequence length; defaults to ``max_position_embeddings``
                (the longest context the model supports, often far longer than the
                sequences it is trained on), with a logged warning naming the value.

        Raises:
            ConfigError: a required key is missing or a value breaks a rule.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("path", str(path), "no such config.json") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("path", str(path), f"is not valid JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ConfigError("path", str(path), "must hold a JSON object of model settings")

        def find(*keys: str) -> str | None:
            """The first of ``keys`` present and not null (a null counts as absent)."""
            return next((key for key in keys if cfg.get(key) is not None), None)

        def need(*keys: str) -> str:
            key = find(*keys)
            if key is None:
                raise ConfigError(keys[0], None, f"missing (or null) from {path}")
            return key

        def integer(key: str) -> int:
            return _hf_int(key, cfg[key], path)

        def real(keys: tuple[str, ...], default: float) -> float:
            key = find(*keys)
            return default if key is None else _hf_float(key, cfg[key], path)

        hidden = integer(need("hidden_size", "n_embd", "d_model"))
        layers = integer(need("num_hidden_layers", "n_layer", "num_layers"))
        heads = integer(need("num_attention_heads", "n_head", "num_heads"))
        experts = next((k for k in _MOE_KEYS if cfg.get(k)), None)
        if experts is not None:
            raise ConfigError(experts, cfg[experts], "mixture-of-experts models are not "
                              "modelled (every layer is taken as dense)")
        if find("head_dim") is not None and integer("head_dim") * heads != hidden:
            raise ConfigError("head_dim", cfg["head_dim"], f"must be hidden_size / "
                              f"num_attention_heads = {hidden}/{heads}: paratune's attention "
                              f"projects the hidden size onto the heads")
        model_type = str(cfg.get("model_type") or "")
        mlp = _hf_mlp(cfg, model_type, path)
        ffn_key = next((k for k in ("intermediate_size", "n_inner", "ffn_dim") if cfg.get(k)),
                       None)
        kv_key = find("num_key_value_heads")
        tie = cfg.get("tie_word_embeddings")
        if tie is None:
            # the default of the model's own config class, which the file leaves out
            tie = model_type in _HF_TIED or (model_type not in _HF_UNTIED and "n_embd" in cfg)
            if model_type not in _HF_TIED | _HF_UNTIED:
                logger.warning("%s states no tie_word_embeddings: taken as %s for model_type "
                               "%r; state it to count the output matrix right", path,
                               "tied" if tie else "untied", model_type)
        elif not isinstance(tie, bool):
            raise ConfigError("tie_word_embeddings", tie,
                              f"must be true or false (a JSON boolean) in {path}")
        if seq_len is None:
            key = need("max_position_embeddings", "n_positions", "seq_length")
            seq_len = integer(key)
            logger.warning("%s gives no training sequence length: assuming %s=%s tokens per "
                           "sequence; give the one you train with (--seq-len N, or seq_len=N)",
                           path, key, seq_len)
        return cls(
            name=name or path.parent.name or "hf-model",
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=None if kv_key is None else integer(kv_key),
            ffn_hidden_size=4 * hidden if ffn_key is None else integer(ffn_key),
            vocab_size=integer(need("vocab_size")),
            seq_len=int(seq_len),
            tie_embeddings=tie,
            mlp=mlp,
            rope_theta=real(("rope_theta",), 500000.0),
            norm_eps=real(("rms_norm_eps", "layer_norm_epsilon"), 1e-5),
            extra={"hf_config": str(path)},
        )


# ---------------------------------------------------------------------- formulas
# Written once for a number or a numpy array of them (a ConfigBatch column): ModelSpec and
# paratune.batch.ConfigBatch both compute through these.
def block_params(hidden_size: Any, kv_dim: Any, ffn_hidden_size: Any, mlp_matrices: Any) -> Any:
    """Weights of one transformer block: q and o (``h*h`` each), k and v (``h*kv_dim`` each),
    ``mlp_matrices`` MLP matrices of ``h*ffn`` and two norms of ``h``."""
    h = hidden_size
    return h * h * 2 + h * kv_dim * 2 + mlp_matrices * h * ffn_hidden_size + 2 * h


def total_params(num_layers: Any, params_per_layer: Any, vocab_size: Any, hidden_size: Any,
                 tie_embeddings: Any) -> Any:
    """All trainable parameters: the embedding, the output matrix unless tied, the blocks and
    the final norm."""
    embedding = vocab_size * hidden_size
    return embedding * (2 - tie_embeddings) + num_layers * params_per_layer + hidden_size


def forward_flops_per_token(num_layers: Any, params_per_layer: Any, hidden_size: Any,
                            seq_len: Any, vocab_size: Any, *, lm_head: Any = 1) -> Any:
    """Forward FLOPs per token of ``num_layers`` blocks and (``lm_head`` times) the output
    projection: ``2 * matmul params + 4 * layers * seq_len * hidden`` (see
    :meth:`ModelSpec.flops_per_token`)."""
    matmul_params = num_layers * params_per_layer + lm_head * vocab_size * hidden_size
    return 2.0 * matmul_params + 4.0 * num_layers * seq_len * hidden_size


def model_flops_per_token(num_layers: Any, params_per_layer: Any, hidden_size: Any,
                          seq_len: Any, vocab_size: Any, *, training: bool = True,
                          recompute: Any = False) -> Any:
    """FLOPs per token of the whole model (scalars or arrays alike): the forward's
    (:func:`forward_flops_per_token`), or with ``training`` three forwards, plus (where
    ``recompute``) a second forward of the blocks (the output projection is not recomputed).
    :meth:`ModelSpec.flops_per_token` and ``ConfigBatch.flops_per_token`` both count this."""
    forward = forward_flops_per_token(num_layers, params_per_layer, hidden_size, seq_len,
                                      vocab_size)
    if not training:
        return forward
    return 3.0 * forward + recompute * (forward - 2.0 * vocab_size * hidden_size)


def _hf_int(key: str, value: Any, path: Path) -> int:
    """A ``config.json`` value that must be a whole number (a JSON integer, an integral
    number, or a string of digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ConfigError(key, value, f"must be an integer in {path}")


def _hf_float(key: str, value: Any, path: Path) -> float:
    """A ``config.json`` value that must be a finite number."""
    try:
        number = (float(value) if isinstance(value, int | float | str)
                  and not isinstance(value, bool) else math.nan)
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(key, value, f"must be a finite number in {path}")
    return number


_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_HF_GATED = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                       "gemma3_text", "phi3", "olmo", "olmo2", "stablelm", "cohere", "granite",
                       "internlm2"})
"""``model_type`` values whose MLP is gated (three matrices: SwiGLU, or GeGLU in Gemma, which
costs the same), whatever ``hidden_act`` names."""
_HF_UNGATED = frozenset({"gpt2", "gpt_neox", "gptj", "gpt_neo", "opt", "phi", "bloom",
                         "falcon", "gpt_bigcode", "starcoder2", "mpt", "codegen"})
"""``model_type`` values whose MLP is two matrices around the activation (GeLU or ReLU)."""
_HF_TIED = frozenset({"gpt2", "gpt_neo", "opt", "bloom", "falcon", "gpt_bigcode", "mpt",
                      "starcoder2", "gemma", "gemma2", "gemma3", "gemma3_text"})
"""``model_type`` values whose config class ties the embeddings unless the file says not."""
_HF_UNTIED = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gptj", "phi",
                        "phi3", "olmo", "olmo2", "stablelm", "cohere", "granite", "internlm2",
                        "codegen"})
"""``model_type`` values whose config class unties them unless the file says so."""


def _hf_mlp(cfg: dict[str, Any], model_type: str, path: Path) -> str:
    """``swiglu`` (a gated MLP, three matrices) or ``gelu`` (two) for a Hugging Face config:
    by its ``model_type`` where known, else by its activation (``silu`` and ``swish`` come
    gated; GeLU and ReLU variants not), else gated, with a warning."""
    if model_type in _HF_GATED:
        return "swiglu"
    if model_type in _HF_UNGATED:
        return "gelu"
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or "").lower()
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith(("gelu", "relu")) or "n_embd" in cfg:
        return "gelu"
    logger.warning("%s: model_type %r and activation %r do not say whether the MLP is gated: "
                   "taken as SwiGLU (three matrices)", path, model_type, act)
    return "swiglu"


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Byte-level vocabulary so the same model trains on raw text with no tokenizer download.
    "tiny": ModelSpec(name="tiny", num_layers=4, hidden_size=128, num_heads=8,
                       num_kv_heads=4, ffn_hidden_size=352, vocab_size=256, seq_len=128,
                       tie_embeddings=False, rope_theta=10000.0),
    "small": ModelSpec(name="small", num_layers=8, hidden_size=256, num_heads=8,
                       num_kv_heads=4, ffn_hidden_size=688, vocab_size=256, seq_len=256,
                       tie_embeddings=False, rope_theta=10000.0),
    "llama3.2-1b": ModelSpec(name="llama3.2-1b", num_layers=16, hidden_size=2048, num_heads=32,
                       num_kv_heads=8, ffn_hidden_size=8192, vocab_size=128256, seq_len=8192,
                       tie_embeddings=True, rope_theta=500000.0),
    "llama3.2-3b": ModelSpec(name="llama3.2-3b", num_layers=28, hidden_size=3072, num_heads=24,
                       num_kv_heads=8, ffn_hidden_size=8192, vocab_size=128256, seq_len=8192,
                       tie_embeddings=True, rope_theta=500000.0),
    "llama3-8b": ModelSpec(name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32,
                       num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256, seq_len=8192,
                       tie_embeddings=False, rope_theta=500000.0),
    "llama3-70b": ModelSpec(name="llama3-70b", num_layers=80, hidden_size=8192, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, vocab_size=128256, seq_len=8192,
                       tie_embeddings=False, rope_theta=500000.0),
    "llama3-405b": ModelSpec(name="llama3-405b", num_layers=126, hidden_size=16384, num_heads=128,
                       num_kv_heads=8, ffn_hidden_size=53248, vocab_size=128256, seq_len=8192,
                       tie_embeddings=False, rope_theta=500000.0),
}


def get_model(name_or_path: str | Path, *, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, or a spec read from a Hugging Face ``config.json`` path.

    Args:
        name_or_path: A key of :data:`MODEL_PRESETS` (case-insensitive) or a path.
        seq_len: Override the sequence length (of a preset, or of a config.json, which
            otherwise takes its ``max_position_embeddings``).

    Raises:
        ConfigError: unknown preset and no such file.
    """
    key = str(name_or_path).lower()
    if key in MODEL_PRESETS:
        spec = MODEL_PRESETS[key]
        return spec.replace(seq_len=seq_len) if seq_len is not None else spec
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_hf_config(path, seq_len=seq_len)
    raise ConfigError("model", str(name_or_path),
                      f"is neither a preset ({', '.join(MODEL_PRESETS)}) nor a config.json path")
