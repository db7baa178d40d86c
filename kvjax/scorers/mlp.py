"""KVpop-MLP scorer: a tiny per-(layer, KV head) MLP on the detached ``[k_t; v_t]``.

Dimension letters: B batch, S positions, K KV heads, D head dim, F hidden width,
X = 2D scorer input.

For layer ``l`` and KV head ``h`` (weights stacked over heads, indexed by layer):

    x_t = stop_gradient([k_t; v_t])                        (X = 2D)
    r_t = w2_h . act(W1_h^T x_t + b1_h) + b2_h              (log-space score)
    p_t = r_t + lambda_h t,  lambda_h = softplus(rho_h) >= 0 (static priority)

``act`` is SiLU or GELU. The score is memory-free: a token's score is fixed when it
is written, so decode scores it once at insertion (or at exit, identically).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.eviction.keep_rule import static_priority
from kvjax.scorers.params import decay_param, init_normal, scorer_param, stop_features

ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu}


class MLPScorer(nnx.Module):
    """Per-layer, per-KV-head MLP scorer; all weights are ``ScorerParam``."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, hidden: int = 64, *,
                 activation: str = "silu", rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
        L, K, X, F = num_layers, kv_heads, 2 * head_dim, hidden
        self.activation = activation
        self.w1 = scorer_param(init_normal(rngs, (L, K, X, F), X ** -0.5),
                               ("layers", "kv_heads", None, "scorer_hidden"))
        self.b1 = scorer_param(jnp.zeros((L, K, F)), ("layers", "kv_heads", "scorer_hidden"))
        self.w2 = scorer_param(init_normal(rngs, (L, K, F), F ** -0.5), ("layers", "kv_heads", "scorer_hidden"))
        self.b2 = scorer_param(jnp.zeros((L, K)), ("layers", "kv_heads"))
        self.decay_raw = decay_param(L, K)

    def decay(self, layer) -> jax.Array:
        """``lambda_h = softplus(rho_h) >= 0`` for ``layer``: ``[K]``."""
        return jax.nn.softplus(self.decay_raw[...][layer])

    def scores(self, layer, k_BSKD: jax.Array, v_BSKD: jax.Array, window: int = 0, *, chunk: int = 64,
               lengths_B=None) -> jax.Array:
        """Log-space scores ``r_t``: float32 ``[B, K, S]`` (works for ``S = 1`` at decode).

        The signature is :meth:`MLSTMScorer.scores`'s, so callers need not ask which scorer they
        hold; the MLP reads each token alone, so ``window``, ``chunk`` and ``lengths_B`` leave its
        scores unchanged."""
        x_BSKX = stop_features(k_BSKD, v_BSKD)
        act = ACTIVATIONS[self.activation]
        hid_BSKF = act(jnp.einsum("bskx,kxf->bskf", x_BSKX, self.w1[...][layer]) + self.b1[...][layer])
        r_BSK = jnp.einsum("bskf,kf->bsk", hid_BSKF, self.w2[...][layer]) + self.b2[...][layer]
        return jnp.transpose(r_BSK, (0, 2, 1))

    def priority(self, layer, k_BSKD: jax.Array, v_BSKD: jax.Array, t_BS: jax.Array, window: int = 0,
                 **kw) -> jax.Array:
        """Static priority ``p_t = r_t + lambda_h t``: ``[B, K, S]``; ``t_BS`` are the tokens' positions
        (:meth:`MLSTMScorer.priority`'s signature; ``window`` and ``kw`` as in :meth:`scores`)."""
        return static_priority(self.scores(layer, k_BSKD, v_BSKD, window, **kw), self.decay(layer), t_BS[:, None, :])
