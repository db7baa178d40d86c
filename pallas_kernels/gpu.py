"""GPU (Triton) kernels. One program per (row, outer block) loops over the inner blocks
inside the kernel; blocks the block map marks empty are skipped by a ``lax.cond``, so
neither their loads nor their matmuls run. Triton rules: power-of-two block sizes and
head dims (checked by the op API); operands of ``dot`` at least 16 wide.

Layouts as in :mod:`pallas_kernels.tpu`: ``q [BK, G, Sp, D]``, ``k, v [BK, Sp, D]``,
``rank [BK, 1, Sp]``, ``cutoff [BK, Sp, 1]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.tiles import (NEG, backward_tile, decode_kernel, finish_target, grouped_keep, logits,
                                  online_softmax_step, transposed_dot)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret):
    """``pallas_call`` on the Triton backend (its compiler params select it over Mosaic GPU)."""
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2))


def _tile(q_ref, k_ref, rank_ref, cut_ref, i, j, *, sinks, window, bq, bk, G):
    """Keep mask ``[G*bq, bk]`` and loaded key tile of query block ``i`` x key block ``j``."""
    k = k_ref[pl.ds(j * bk, bk), :]
    keep = grouped_keep(i * bq, j * bk, rank_ref[:, pl.ds(j * bk, bk)].reshape(1, bk), cut_ref[...].reshape(bq, 1),
                        sinks=sinks, window=window, Q=bq, T=bk, G=G)
    return keep, k


def _fwd_kernel(kept_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, o_ref, lse_ref, cnt_ref, *, sinks, window, nk,
                bq, bk, G, scale):
    i = pl.program_id(1)
    D = q_ref.shape[-1]
    q = q_ref[...].reshape(G * bq, D)
    last = jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1)         # causal: no key block past the diagonal

    def body(j, carry):
        def compute(c):
            m, l, acc, n = c
            keep, k = _tile(q_ref, k_ref, rank_ref, cut_ref, i, j, sinks=sinks, window=window, bq=bq, bk=bk, G=G)
            m, l, acc = online_softmax_step(m, l, acc, logits(q, k, scale), keep, v_ref[pl.ds(j * bk, bk), :])
            return m, l, acc, n + 1
        return jax.lax.cond(kept_ref[0, j] != 0, compute, lambda c: c, carry)

    init = (jnp.full((G * bq, 1), NEG, jnp.float32), jnp.zeros((G * bq, 1), jnp.float32),
            jnp.zeros((G * bq, D), jnp.float32), jnp.int32(0))
    m, l, acc, n = jax.lax.fori_loop(0, last, body, init)
    l = jnp.maximum(l, 1e-30)
    o_ref[...] = (acc / l).reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(l)).reshape(lse_ref.shape)
    cnt_ref[...] = jnp.full(cnt_ref.shape, n, jnp.int32)


def _specs(G, bq, Sp, D, nk):
    return dict(
        kept=pl.BlockSpec((None, 1, nk), lambda r, i: (r, i, 0)),
        q=pl.BlockSpec((None, G, bq, D), lambda r, i: (r, 0, i, 0)),
        kv=pl.BlockSpec((None, Sp, D), lambda r, i: (r, 0, 0)),
        rank=pl.BlockSpec((None, 1, Sp), lambda r, i: (r, 0, 0)),
        cut=pl.BlockSpec((None, bq, 1), lambda r, i: (r, i, 0)),
        row=pl.BlockSpec((None, G, bq), lambda r, i: (r, 0, i)),
    )


def sparse_attention_fwd(q, k, v, rank, cut, blocks, *, sinks, window, bq, bk, interpret):
    """``(o, lse, computed [BK * nq])`` (the TPU module's contract)."""
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    sp = _specs(G, bq, Sp, D, nk)
    kernel = functools.partial(_fwd_kernel, sinks=sinks, window=window, nk=nk, bq=bq, bk=bk, G=G, scale=D ** -0.5)
    o, lse, cnt = _call(
        kernel, (BK, nq), [sp["kept"], sp["q"], sp["kv"], sp["kv"], sp["rank"], sp["cut"]],
        [sp["q"], sp["row"], pl.BlockSpec((None, 1, 1), lambda r, i: (r, i, 0))],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((BK, G, Sp), jnp.float32),
         jax.ShapeDtypeStruct((BK, nq, 1), jnp.int32)], interpret,
    )(blocks.astype(jnp.int32), q, k, v, rank, cut)
    return o, lse, cnt.reshape(-1)


def _dq_kernel(kept_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref, dq_ref, *, sinks,
               window, nk, bq, bk, G, scale):
    i = pl.program_id(1)
    D = q_ref.shape[-1]
    q, do = q_ref[...].reshape(G * bq, D), do_ref[...].reshape(G * bq, D)
    lse, delta = lse_ref[...].reshape(G * bq, 1), delta_ref[...].reshape(G * bq, 1)
    last = jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1)

    def body(j, dq):
        def compute(dq):
            keep, k = _tile(q_ref, k_ref, rank_ref, cut_ref, i, j, sinks=sinks, window=window, bq=bq, bk=bk, G=G)
            _, ds = backward_tile(q, do, k, v_ref[pl.ds(j * bk, bk), :], keep, lse, delta, scale)
            return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
        return jax.lax.cond(kept_ref[0, j] != 0, compute, lambda x: x, dq)

    dq = jax.lax.fori_loop(0, last, body, jnp.zeros((G * bq, D), jnp.float32))
    dq_ref[...] = dq.reshape(dq_ref.shape).astype(dq_ref.dtype)


def _dkv_kernel(kept_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                sinks, window, nq, bq, bk, G, scale):
    j = pl.program_id(1)
    D = k_ref.shape[-1]
    k, v = k_ref[...], v_ref[...]
    rank = rank_ref[...].reshape(1, bk)
    first = (j * bk) // bq                                        # causal: no query block before the key block

    def body(i, carry):
        def compute(c):
            dk, dv = c
            q = q_ref[:, pl.ds(i * bq, bq), :].reshape(G * bq, D)
            do = do_ref[:, pl.ds(i * bq, bq), :].reshape(G * bq, D)
            keep = grouped_keep(i * bq, j * bk, rank, cut_ref[pl.ds(i * bq, bq), :].reshape(bq, 1),
                                sinks=sinks, window=window, Q=bq, T=bk, G=G)
            p, ds = backward_tile(q, do, k, v, keep, lse_ref[:, pl.ds(i * bq, bq)].reshape(G * bq, 1),
                                  delta_ref[:, pl.ds(i * bq, bq)].reshape(G * bq, 1), scale)
            return dk + transposed_dot(ds, q) * scale, dv + transposed_dot(p, do)
        return jax.lax.cond(kept_ref[0, i] != 0, compute, lambda c: c, carry)

    zeros = jnp.zeros((bk, D), jnp.float32)
    dk, dv = jax.lax.fori_loop(first, nq, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def sparse_attention_bwd(q, k, v, rank, cut, blocks, do, lse, delta, *, sinks, window, bq, bk, interpret):
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    sp = _specs(G, bq, Sp, D, nk)
    dq = _call(
        functools.partial(_dq_kernel, sinks=sinks, window=window, nk=nk, bq=bq, bk=bk, G=G, scale=D ** -0.5),
        (BK, nq), [sp["kept"], sp["q"], sp["kv"], sp["kv"], sp["rank"], sp["cut"], sp["q"], sp["row"], sp["row"]],
        sp["q"], jax.ShapeDtypeStruct(q.shape, q.dtype), interpret,
    )(blocks.astype(jnp.int32), q, k, v, rank, cut, do, lse, delta)
    full_q = pl.BlockSpec((None, G, Sp, D), lambda r, j: (r, 0, 0, 0))
    full_row = pl.BlockSpec((None, G, Sp), lambda r, j: (r, 0, 0))
    kb = pl.BlockSpec((None, bk, D), lambda r, j: (r, j, 0))
    dk, dv = _call(
        functools.partial(_dkv_kernel, sinks=sinks, window=window, nq=nq, bq=bq, bk=bk, G=G, scale=D ** -0.5),
        (BK, nk), [pl.BlockSpec((None, 1, nq), lambda r, j: (r, j, 0)), full_q, kb, kb,
                   pl.BlockSpec((None, 1, bk), lambda r, j: (r, 0, j)), pl.BlockSpec((None, Sp, 1), lambda r, j: (r, 0, 0)),
                   full_q, full_row, full_row],
        [kb, kb], [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)], interpret,
    )(jnp.swapaxes(blocks, -1, -2).astype(jnp.int32), q, k, v, rank, cut, do, lse, delta)
    return dq, dk, dv


def _target_kernel(q_ref, k_ref, lse_ref, out_ref, *, S, window, nq, bq, bk, G, scale, aggregate, eps):
    j = pl.program_id(1)
    D = k_ref.shape[-1]
    k = k_ref[...]
    first = jnp.minimum((j * bk + window) // bq, nq)               # the first query block with d >= t + w

    def body(i, mass):
        q = q_ref[:, pl.ds(i * bq, bq), :].reshape(G * bq, D)
        s = logits(q, k, scale) - lse_ref[:, pl.ds(i * bq, bq)].reshape(G * bq, 1)
        d = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        t = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        future = jnp.broadcast_to(((d >= t + window) & (d < S))[None], (G, bq, bk)).reshape(G * bq, bk)
        return mass + jnp.sum(jnp.where(future, jnp.exp(s), 0.0).reshape(G, bq, bk), axis=1)

    mass = jax.lax.fori_loop(first, nq, body, jnp.zeros((G, bk), jnp.float32))
    out_ref[...] = finish_target(mass, j * bk, S=S, window=window, aggregate=aggregate, eps=eps, T=bk)


def transposed_target(q, k, lse, *, S, window, aggregate, eps, bq, bk, interpret):
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    kernel = functools.partial(_target_kernel, S=S, window=window, nq=nq, bq=bq, bk=bk, G=G, scale=D ** -0.5,
                               aggregate=aggregate, eps=eps)
    return _call(kernel, (BK, nk),
                 [pl.BlockSpec((None, G, Sp, D), lambda r, j: (r, 0, 0, 0)),
                  pl.BlockSpec((None, bk, D), lambda r, j: (r, j, 0)),
                  pl.BlockSpec((None, G, Sp), lambda r, j: (r, 0, 0))],
                 pl.BlockSpec((None, 1, bk), lambda r, j: (r, 0, j)),
                 jax.ShapeDtypeStruct((BK, 1, Sp), jnp.float32), interpret)(q, k, lse)


def sparse_decode(q, k, v, valid, *, split, interpret):
    BK, G, D = q.shape
    P = k.shape[1] // split
    return _call(
        functools.partial(decode_kernel, scale=D ** -0.5), (BK, P),
        [pl.BlockSpec((None, G, D), lambda b, p: (b, 0, 0)), pl.BlockSpec((None, split, D), lambda b, p: (b, p, 0)),
         pl.BlockSpec((None, split, D), lambda b, p: (b, p, 0)), pl.BlockSpec((None, 1, split), lambda b, p: (b, 0, p))],
        [pl.BlockSpec((None, None, G, D), lambda b, p: (b, p, 0, 0)),
         pl.BlockSpec((None, None, G, 1), lambda b, p: (b, p, 0, 0))],
        [jax.ShapeDtypeStruct((BK, P, G, D), jnp.float32), jax.ShapeDtypeStruct((BK, P, G, 1), jnp.float32)],
        interpret)(q, k, v, valid)
