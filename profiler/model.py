"""The profiled workload: a Llama-style decoder-only transformer built from a ModelSpec.

The module layout follows torchtitan so that pipeline splitting and parallelisation keep
fully-qualified parameter names (FQNs): ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``
keyed ``"0"`` .. ``"L-1"``), ``norm`` and ``output``. A pipeline stage is the same class with
some layers removed and ``tok_embeddings`` / ``norm`` / ``output`` set to ``None``.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from paratune.spec import ModelSpec

__all__ = ["Attention", "FeedForward", "RMSNorm", "Transformer", "TransformerBlock",
           "build_model", "rope_tables"]


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or as it is when already wider: half-precision activations are
    upcast for the reductions and rotations, float64 ones are never rounded down to float32
    (which would make float64 runs only as exact as float32 ones)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = _at_least_float32(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of rotary embeddings, each ``[seq_len, head_dim // 2]``.

    Computed in float64 and cast to the default dtype so that every process (and every
    default dtype) gets the same tables.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    dtype = torch.get_default_dtype()
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` ``[batch, seq, heads, head_dim]`` (interleaved pairs,
    as in the original Llama code)."""
    seq_len = x.shape[1]
    cos = cos[:seq_len].view(1, seq_len, 1, -1)
    sin = sin[:seq_len].view(1, seq_len, 1, -1)
    pairs = _at_least_float32(x).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Head counts are derived from the projection outputs at run time (``view(..., -1,
    head_dim)``), so after tensor parallelism shards ``wq``/``wk``/``wv`` column-wise each rank
    simply sees its local heads; :func:`paratune.profiler.parallelize.apply_tp` also updates
    ``num_local_heads`` / ``num_local_kv_heads`` for readers.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.num_local_heads = spec.num_heads
        self.num_local_kv_heads = spec.num_kv_heads
        self.wq = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.hidden_size, spec.kv_dim, bias=False)
        self.wv = nn.Linear(spec.hidden_size, spec.kv_dim, bias=False)
        self.wo = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        repeats = q.shape[2] // k.shape[2]
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP (``w2(silu(w1 x) * w3 x)``) or GELU MLP (``w2(gelu(w1 x))``, no ``w3``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.kind = spec.mlp
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)
        self.w3 = (nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
                   if spec.mlp == "swiglu" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))`` then ``h + feed_forward(norm(h))``.

    ``recompute`` is set by :func:`~paratune.profiler.parallelize.apply_activation_checkpointing`:
    ``"full"`` recomputes the whole block in backward, ``"selective"`` only the attention
    half. Checkpointing lives inside ``forward`` (rather than a wrapper module) so parameter
    names do not change.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.feed_forward = FeedForward(spec)
        self.recompute = "none"

    def _attention_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x), cos, sin)

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self._attention_part(x, cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._block, x, cos, sin,
                                                     use_reentrant=False)
        if self.recompute == "selective" and torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(self._attention_part, x, cos, sin,
                                                  use_reentrant=False)
            return h + self.feed_forward(self.ffn_norm(h))
        return self._block(x, cos, sin)


class Transformer(nn.Module):
    """Decoder-only transformer; also a pipeline stage when some parts are ``None``.

    Args:
        spec: The model shape.

    A full model maps tokens ``[batch, seq]`` to logits ``[batch, seq, vocab]``. A stage
    without ``tok_embeddings`` takes hidden states instead; a stage without ``output``
    returns hidden states.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size,
                                                                spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec)
                                     for i in range(spec.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(spec.head_dim, spec.seq_len, spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation from ``seed``, the same on every process and layout.

        Normal(0, 0.02) for embeddings and projections, with residual output projections
        (``wo``, ``w2``) scaled by ``1 / sqrt(2 * num_layers)`` as in GPT-2; norms at one.
        Each parameter draws from its own generator seeded by ``seed`` and its FQN, so a
        pipeline stage, or a tensor-parallel / FSDP shard (a DTensor), gets exactly the values
        the full single-process model has: the full tensor is drawn and this rank keeps its
        shard. Also (re)computes the rotary tables, which are not saved buffers.
        """
        cos, sin = rope_tables(self.spec.head_dim, self.spec.seq_len, self.spec.rope_theta)
        self.rope_cos = cos.to(device=self.rope_cos.device, dtype=self.rope_cos.dtype)
        self.rope_sin = sin.to(device=self.rope_sin.device, dtype=self.rope_sin.dtype)
        residual_std = 0.02 / math.sqrt(2 * self.spec.num_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                full = _initial_value(name, tuple(param.shape), seed=seed,
                                      residual_std=residual_std, device=param.device)
                _copy_into(param, full)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def _initial_value(name: str, shape: tuple[int, ...], *, seed: int, residual_std: float,
                   device: torch.device) -> torch.Tensor:
    """The full initial value of parameter ``name`` (float32)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
    # The ".layers.N." index is part of the FQN, so every tensor gets its own stream.
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=gen_device).normal_(0.0, std, generator=gen).to(device)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the global value) into ``param``, keeping only this rank's shard when
    ``param`` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.dtype))


def build_model(spec: ModelSpec, *, seed: int = 0, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> Transformer:
    """A freshly initialised :class:`Transformer` for ``spec``.

    Args:
        spec: The model shape.
        seed: Initialisation seed (same seed, same weights, on any process).
        device: Where to put the parameters.
        dtype: Parameter dtype; the default dtype when ``None``.

    Returns:
        The model, on ``device``.
    """
    model = Transformer(spec)
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device=device)
    model.init_weights(seed)
    return model
