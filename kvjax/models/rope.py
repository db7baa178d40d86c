"""Rotary position embeddings (RoPE), with Llama 3's ``llama3`` frequency rescaling.

Default inverse frequencies: ``inv_freq_i = theta^(-2i/D)`` for ``i < D/2``.
``llama3``: with wavelength ``lambda_i = 2 pi / inv_freq_i``, low frequencies
(``lambda_i > L_orig / low_freq_factor``) are divided by ``factor``, high ones kept, and
the band between is interpolated with
``s = (L_orig / lambda_i - low) / (high - low)``, ``f = (1 - s) f / factor + s f``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """``float32 [D/2]`` inverse frequencies, computed in float32 as ``transformers`` does."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq).astype(np.float32)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BSHD: jnp.ndarray, positions_BS: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate ``x`` by its positions (``rotate_half`` convention: halves, not interleaved)."""
    freqs_BSF = positions_BS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs_BSF, freqs_BSF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x_BSHD.dtype), jnp.sin(emb).astype(x_BSHD.dtype)
    half = x_BSHD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BSHD[..., half:], x_BSHD[..., :half]], axis=-1)
    return x_BSHD * cos + rotated * sin
