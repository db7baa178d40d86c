"""One decoder for Qwen3 and Llama 3.x (Flax NNX), used functionally.

Dimension letters: B batch, S query positions, T key positions, E hidden (embed),
H query heads, K KV heads, D head dim, F MLP width, V vocabulary.

Each layer: ``h += o(attn(rope(norm_q(q(rms(h)))), rope(norm_k(k(rms(h)))), v(rms(h))))``,
``h += down(silu(gate(rms(h))) * up(rms(h)))``; the q/k norms exist for Qwen3 only.
Attention goes through an *attention backend*
``backend(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, state) -> (out_BSHD, state)``
so the same weights serve dense training, the dense KV cache and bounded caches. A backend
with a true ``takes_hidden`` attribute is also given the layer's normalised input
(``hidden_BSE=``), which KVzip+ reads.
Parameters carry ``logical_axes`` metadata for :mod:`kvjax.sharding`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.config import ModelConfig
from kvjax.models.attention import dense_attention
from kvjax.models.rope import apply_rope, inverse_frequencies

AttentionBackend = Callable[..., tuple[jax.Array, Any]]


def _param(rngs: nnx.Rngs | None, init, shape, dtype, axes) -> nnx.Param:
    value = init(rngs.params(), shape, dtype) if rngs is not None else jnp.zeros(shape, dtype)
    return nnx.Param(value, logical_axes=axes)


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def rms_norm(x, weight, eps: float):
    """``w * x / sqrt(mean(x^2) + eps)``, statistics in float32 (as ``transformers``)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def causal_attention(layer, q_BSHD, k_BSKD, v_BSKD, positions_BS, state):
    """Backend without a cache: dense causal attention over the given keys (positions grow
    along the sequence, so it runs in causal query blocks)."""
    out, _ = dense_attention(q_BSHD, k_BSKD, v_BSKD, positions_BS, positions_BS, prefill=True)
    return out, state


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, param_dtype, init_std: float, qk_norm_init: float = 1.0):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w = nnx.initializers.normal(init_std)
        self.q_proj = _param(rngs, w, (E, H, D), param_dtype, ("embed", "q_heads", "head_dim"))
        self.k_proj = _param(rngs, w, (E, K, D), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _param(rngs, w, (E, K, D), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _param(rngs, w, (H, D, E), param_dtype, ("q_heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = _param(rngs, _zeros, (H, D), param_dtype, ("q_heads", "head_dim"))
            self.k_bias = _param(rngs, _zeros, (K, D), param_dtype, ("kv_heads", "head_dim"))
            self.v_bias = _param(rngs, _zeros, (K, D), param_dtype, ("kv_heads", "head_dim"))
            self.o_bias = _param(rngs, _zeros, (E,), param_dtype, ("embed",))
        if cfg.qk_norm:
            norm_init = lambda key, shape, dtype: jnp.full(shape, qk_norm_init, dtype)  # noqa: E731
            self.q_norm = _param(rngs, norm_init, (D,), param_dtype, ("head_dim",))
            self.k_norm = _param(rngs, norm_init, (D,), param_dtype, ("head_dim",))
        self.cfg = cfg

    def qkv(self, x_BSE, positions_BS, inv_freq):
        """Post-RoPE queries, keys and values."""
        cfg, dt = self.cfg, x_BSE.dtype
        q = jnp.einsum("bse,ehd->bshd", x_BSE, self.q_proj[...].astype(dt))
        k = jnp.einsum("bse,ekd->bskd", x_BSE, self.k_proj[...].astype(dt))
        v = jnp.einsum("bse,ekd->bskd", x_BSE, self.v_proj[...].astype(dt))
        if cfg.attention_bias:
            q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                       v + self.v_bias[...].astype(dt))
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        return apply_rope(q, positions_BS, inv_freq), apply_rope(k, positions_BS, inv_freq), v

    def out(self, attn_BSHD):
        y = jnp.einsum("bshd,hde->bse", attn_BSHD, self.o_proj[...].astype(attn_BSHD.dtype))
        if self.cfg.attention_bias:
            y = y + self.o_bias[...].astype(y.dtype)
        return y


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, param_dtype, init_std: float):
        E, F = cfg.hidden_size, cfg.intermediate_size
        w = nnx.initializers.normal(init_std)
        self.gate_proj = _param(rngs, w, (E, F), param_dtype, ("embed", "mlp"))
        self.up_proj = _param(rngs, w, (E, F), param_dtype, ("embed", "mlp"))
        self.down_proj = _param(rngs, w, (F, E), param_dtype, ("mlp", "embed"))
        if cfg.mlp_bias:
            self.gate_bias = _param(rngs, _zeros, (F,), param_dtype, ("mlp",))
            self.up_bias = _param(rngs, _zeros, (F,), param_dtype, ("mlp",))
            self.down_bias = _param(rngs, _zeros, (E,), param_dtype, ("embed",))
        self.mlp_bias = cfg.mlp_bias

    def __call__(self, x_BSE):
        dt = x_BSE.dtype
        g = x_BSE @ self.gate_proj[...].astype(dt)
        u = x_BSE @ self.up_proj[...].astype(dt)
        if self.mlp_bias:
            g, u = g + self.gate_bias[...].astype(dt), u + self.up_bias[...].astype(dt)
        y = (jax.nn.silu(g) * u) @ self.down_proj[...].astype(dt)
        return y + self.down_bias[...].astype(dt) if self.mlp_bias else y


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, param_dtype, init_std: float, qk_norm_init: float = 1.0):
        E = cfg.hidden_size
        self.input_layernorm = _param(rngs, _ones, (E,), param_dtype, ("norm",))
        self.self_attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype, init_std=init_std,
                                   qk_norm_init=qk_norm_init)
        self.post_attention_layernorm = _param(rngs, _ones, (E,), param_dtype, ("norm",))
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype, init_std=init_std)
        self.eps = cfg.rms_norm_eps

    def __call__(self, h_BSE, positions_BS, inv_freq, backend: AttentionBackend, layer: int, state):
        """One layer on the residual stream: ``(h + attn + mlp, backend state)``."""
        x = rms_norm(h_BSE, self.input_layernorm[...], self.eps)
        q, k, v = self.self_attn.qkv(x, positions_BS, inv_freq)
        if getattr(backend, "takes_hidden", False):     # a backend that also reads the layer's input
            attn, state = backend(layer, q, k, v, positions_BS, state, hidden_BSE=x)
        else:
            attn, state = backend(layer, q, k, v, positions_BS, state)
        h = h_BSE + self.self_attn.out(attn)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm[...], self.eps)), state


def _layer_call(graphdef, backend, layer: int, inv_freq):
    """``(block params, h, positions, state) -> Block(...)``, a pure function for ``jax.checkpoint``
    (the static layer index and backend closed over)."""
    def run(params, h_BSE, positions_BS, state):
        return nnx.merge(graphdef, params)(h_BSE, positions_BS, inv_freq, backend, layer, state)

    return run


class Decoder(nnx.Module):
    """The causal LM. ``dtype`` is the compute dtype; parameters keep ``param_dtype``.

    ``remat``: recompute each block's activations in the backward pass (``jax.checkpoint``)
    instead of storing them; set from the train config's ``model.remat``."""

    remat: bool = False

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 dtype=jnp.float32, init_std: float = 0.02, embed_init_std: float = 0.02,
                 qk_norm_init: float = 1.0):
        E, V = cfg.hidden_size, cfg.vocab_size
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = _param(rngs, nnx.initializers.normal(embed_init_std), (V, E), param_dtype,
                                   ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs=rngs, param_dtype=param_dtype, init_std=init_std,
                                      qk_norm_init=qk_norm_init) for _ in range(cfg.num_layers)])
        self.norm = _param(rngs, _ones, (E,), param_dtype, ("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, nnx.initializers.normal(init_std), (V, E), param_dtype,
                                  ("vocab", "embed"))

    def __call__(self, tokens_BS, positions_BS=None, backend: AttentionBackend = causal_attention,
                 state: Any = None, *, layer_outputs: bool = False):
        """Final-norm hidden states ``[B, S, E]`` (compute dtype) and the backend state;
        with ``layer_outputs``, also the residual stream after every layer (for LKV's MSE)."""
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        inv_freq = inverse_frequencies(self.config)
        h = jnp.take(self.embed_tokens[...], tokens_BS, axis=0).astype(self.dtype)
        per_layer = []
        for i, blk in enumerate(self.layers):
            if self.remat:
                graphdef, params = nnx.split(blk)
                h, state = jax.checkpoint(_layer_call(graphdef, backend, i, inv_freq))(params, h, positions_BS, state)
            else:
                h, state = blk(h, positions_BS, inv_freq, backend, i, state)
            per_layer.append(h)
        out = rms_norm(h, self.norm[...], self.config.rms_norm_eps)
        return (out, state, tuple(per_layer)) if layer_outputs else (out, state)

    def logits(self, hidden_BSE):
        """Float32 logits ``[B, S, V]`` from final hidden states."""
        w = self.embed_tokens[...] if self.config.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("bse,ve->bsv", hidden_BSE, w.astype(hidden_BSE.dtype),
                          preferred_element_type=jnp.float32)
