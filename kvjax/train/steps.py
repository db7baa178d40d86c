"""The jitted train step: microbatch gradient accumulation, masked update, metrics.

``loss_fn(params, frozen, batch, rng, step) -> (loss, aux)`` is the mode's loss (``frozen``:
parameters it reads but does not train, e.g. the distillation teacher; ``step`` the global
step, for schedules inside the loss such as LKV's Gumbel temperature); the step averages
its gradients over ``grad_accum`` microbatches with ``lax.scan``, zeroes the updates of
frozen parameters (the phase's trainable mask), and scales them by the phase's
``lr_scale``. Non-finite gradients skip the update (``optax.apply_if_finite``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, grad_accum: int):
    def step(params, frozen, opt_state, batch, rng, update_mask, lr_scale, global_step):
        def micro(carry, xs):
            mb, key = xs
            (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, mb, key, global_step)
            acc_g, acc_l, acc_aux = carry
            return (jax.tree.map(jnp.add, acc_g, g), acc_l + loss,
                    jax.tree.map(jnp.add, acc_aux, aux)), None

        mbs = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
        keys = jax.random.split(rng, grad_accum)
        zero_g = jax.tree.map(jnp.zeros_like, params)
        _, aux0 = jax.eval_shape(loss_fn, params, frozen, jax.tree.map(lambda x: x[0], mbs), keys[0],
                                 global_step)
        zero_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux0)
        (g, loss, aux), _ = jax.lax.scan(micro, (zero_g, jnp.float32(0), zero_aux), (mbs, keys))
        g = jax.tree.map(lambda x: x / grad_accum, g)
        loss, aux = loss / grad_accum, jax.tree.map(lambda x: x / grad_accum, aux)
        grad_norm = optax.tree.norm(g)
        updates, new_opt = optimizer.update(g, opt_state, params)
        updates = jax.tree.map(lambda u, m: u * m * lr_scale, updates, update_mask)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, **aux,
                   "skipped_steps": new_opt.total_notfinite.astype(jnp.float32)}
        return new_params, new_opt, metrics

    return step
