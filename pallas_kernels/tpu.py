"""Mosaic TPU kernels. The innermost grid axis walks key (or query) blocks; which blocks
hold a kept key is scalar-prefetched (splash attention's mask-info idea): a skipped block
runs no compute, and its index map re-points at the previously fetched block so no DMA is
issued either. Accumulators live in VMEM scratch across that axis.

Layouts inside: ``q [BK, G, Sp, D]``, ``k, v [BK, Sp, D]``, ``rank [BK, 1, Sp]``,
``cutoff [BK, Sp, 1]`` (``BK = B * K`` rows, ``Sp`` the length padded to the blocks).
TPU tiling: ``block_q`` and ``block_k`` must be multiples of 128 (checked by the op API).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tiles import (NEG, backward_tile, decode_kernel, finish_target, grouped_keep, logits,
                                  online_softmax_step, transposed_dot)

LANES = 128


def _fetch_map(kept_RN):
    """For each row's block list: the block to fetch (itself when kept, else the last kept
    one before it, else 0), so skipped steps re-use the resident block."""
    N = kept_RN.shape[-1]
    idx = jnp.where(kept_RN, jnp.arange(N, dtype=jnp.int32), -1)
    return jnp.maximum(jax.lax.cummax(idx, axis=kept_RN.ndim - 1), 0).astype(jnp.int32)


def _fwd_kernel(kept_ref, fetch_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, o_ref, lse_ref, cnt_ref,
                m_sc, l_sc, acc_sc, *, sinks, window, nq, nk, bq, bk, G, scale):
    bh, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = bh * nq + i

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        cnt_ref[row] = 0

    @pl.when(kept_ref[row * nk + j] != 0)
    def _compute():
        D = q_ref.shape[-1]
        q = q_ref[...].reshape(G * bq, D)
        keep = grouped_keep(i * bq, j * bk, rank_ref[...].reshape(1, bk), cut_ref[...].reshape(bq, 1),
                            sinks=sinks, window=window, Q=bq, T=bk, G=G)
        m, l, acc = online_softmax_step(m_sc[...], l_sc[...], acc_sc[...], logits(q, k_ref[...], scale), keep,
                                        v_ref[...])
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc
        cnt_ref[row] += 1

    @pl.when(j == nk - 1)
    def _finish():
        l = jnp.maximum(l_sc[...], 1e-30)
        o_ref[...] = (acc_sc[...] / l).reshape(o_ref.shape).astype(o_ref.dtype)
        lse_ref[...] = (m_sc[...] + jnp.log(l)).reshape(lse_ref.shape)


def sparse_attention_fwd(q, k, v, rank, cut, blocks, *, sinks, window, bq, bk, interpret):
    """``(o [BK, G, Sp, D], lse [BK, G, Sp], computed [BK * nq])`` (layouts in the module doc)."""
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    kept = blocks.reshape(BK * nq, nk)
    fetch = _fetch_map(kept).reshape(-1)
    kept = kept.astype(jnp.int32).reshape(-1)

    def kv_map(bh, i, j, kept_ref, fetch_ref):
        return bh, fetch_ref[(bh * nq + i) * nk + j], 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(BK, nq, nk),
        in_specs=[pl.BlockSpec((None, G, bq, D), lambda bh, i, j, *_: (bh, 0, i, 0)),
                  pl.BlockSpec((None, bk, D), kv_map), pl.BlockSpec((None, bk, D), kv_map),
                  pl.BlockSpec((None, 1, bk), lambda bh, i, j, kr, fr: (bh, 0, fr[(bh * nq + i) * nk + j])),
                  pl.BlockSpec((None, bq, 1), lambda bh, i, j, *_: (bh, i, 0))],
        out_specs=[pl.BlockSpec((None, G, bq, D), lambda bh, i, j, *_: (bh, 0, i, 0)),
                   pl.BlockSpec((None, G, bq), lambda bh, i, j, *_: (bh, 0, i)),
                   pl.BlockSpec(memory_space=pltpu.SMEM)],
        scratch_shapes=[pltpu.VMEM((G * bq, 1), jnp.float32), pltpu.VMEM((G * bq, 1), jnp.float32),
                        pltpu.VMEM((G * bq, D), jnp.float32)])
    kernel = functools.partial(_fwd_kernel, sinks=sinks, window=window, nq=nq, nk=nk, bq=bq, bk=bk, G=G,
                               scale=D ** -0.5)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((BK, G, Sp, D), q.dtype), jax.ShapeDtypeStruct((BK, G, Sp), jnp.float32),
                   jax.ShapeDtypeStruct((BK * nq,), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(kept, fetch, q, k, v, rank, cut)


def _backward_tile(q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref, i, j, *, sinks, window, bq,
                   bk, G, scale):
    """``(p, ds, q, do, k)`` of query block ``i`` x key block ``j`` (resident blocks)."""
    D = q_ref.shape[-1]
    q, do, k = q_ref[...].reshape(G * bq, D), do_ref[...].reshape(G * bq, D), k_ref[...]
    keep = grouped_keep(i * bq, j * bk, rank_ref[...].reshape(1, bk), cut_ref[...].reshape(bq, 1), sinks=sinks,
                        window=window, Q=bq, T=bk, G=G)
    p, ds = backward_tile(q, do, k, v_ref[...], keep, lse_ref[...].reshape(G * bq, 1),
                          delta_ref[...].reshape(G * bq, 1), scale)
    return p, ds, q, do, k


def _bwd_dq_kernel(kept_ref, fetch_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref,
                   dq_ref, dq_sc, *, sinks, window, nq, nk, bq, bk, G, scale):
    bh, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(kept_ref[(bh * nq + i) * nk + j] != 0)
    def _compute():
        _, ds, _, _, k = _backward_tile(q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref, i, j,
                                        sinks=sinks, window=window, bq=bq, bk=bk, G=G, scale=scale)
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].reshape(dq_ref.shape).astype(dq_ref.dtype)


def _bwd_dkv_kernel(kept_ref, fetch_ref, q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref,
                    dk_ref, dv_ref, dk_sc, dv_sc, *, sinks, window, nq, nk, bq, bk, G, scale):
    bh, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(kept_ref[(bh * nk + j) * nq + i] != 0)
    def _compute():
        p, ds, q, do, _ = _backward_tile(q_ref, k_ref, v_ref, rank_ref, cut_ref, do_ref, lse_ref, delta_ref, i, j,
                                         sinks=sinks, window=window, bq=bq, bk=bk, G=G, scale=scale)
        dv_sc[...] += transposed_dot(p, do)
        dk_sc[...] += transposed_dot(ds, q) * scale

    @pl.when(i == nq - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def sparse_attention_bwd(q, k, v, rank, cut, blocks, do, lse, delta, *, sinks, window, bq, bk, interpret):
    """``(dq, dk, dv)`` in the kernel layouts; ``delta = rowsum(do * o)`` ``[BK, G, Sp]``."""
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    kept_q = blocks.reshape(BK * nq, nk)
    kept_k = jnp.swapaxes(blocks, -1, -2).reshape(BK * nk, nq)
    params = dict(sinks=sinks, window=window, nq=nq, nk=nk, bq=bq, bk=bk, G=G, scale=D ** -0.5)
    interp = pltpu.InterpretParams() if interpret else False
    cp = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))

    # dq: grid over query blocks, walking key blocks
    fetch = _fetch_map(kept_q).reshape(-1)
    kv = lambda bh, i, j, kr, fr: (bh, fr[(bh * nq + i) * nk + j], 0)  # noqa: E731
    qb = lambda bh, i, j, *_: (bh, 0, i, 0)  # noqa: E731
    rowq = lambda bh, i, j, *_: (bh, 0, i)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_bwd_dq_kernel, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(BK, nq, nk),
            in_specs=[pl.BlockSpec((None, G, bq, D), qb), pl.BlockSpec((None, bk, D), kv),
                      pl.BlockSpec((None, bk, D), kv),
                      pl.BlockSpec((None, 1, bk), lambda bh, i, j, kr, fr: (bh, 0, fr[(bh * nq + i) * nk + j])),
                      pl.BlockSpec((None, bq, 1), lambda bh, i, j, *_: (bh, i, 0)),
                      pl.BlockSpec((None, G, bq, D), qb), pl.BlockSpec((None, G, bq), rowq),
                      pl.BlockSpec((None, G, bq), rowq)],
            out_specs=pl.BlockSpec((None, G, bq, D), qb),
            scratch_shapes=[pltpu.VMEM((G * bq, D), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=cp, interpret=interp,
    )(kept_q.astype(jnp.int32).reshape(-1), fetch, q, k, v, rank, cut, do, lse, delta)

    # dk, dv: grid over key blocks, walking query blocks
    fetch = _fetch_map(kept_k).reshape(-1)
    qf = lambda bh, j, i, kr, fr: (bh, 0, fr[(bh * nk + j) * nq + i], 0)  # noqa: E731
    rowf = lambda bh, j, i, kr, fr: (bh, 0, fr[(bh * nk + j) * nq + i])  # noqa: E731
    kb = lambda bh, j, i, *_: (bh, j, 0)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_bwd_dkv_kernel, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(BK, nk, nq),
            in_specs=[pl.BlockSpec((None, G, bq, D), qf), pl.BlockSpec((None, bk, D), kb),
                      pl.BlockSpec((None, bk, D), kb), pl.BlockSpec((None, 1, bk), lambda bh, j, i, *_: (bh, 0, j)),
                      pl.BlockSpec((None, bq, 1), lambda bh, j, i, kr, fr: (bh, fr[(bh * nk + j) * nq + i], 0)),
                      pl.BlockSpec((None, G, bq, D), qf), pl.BlockSpec((None, G, bq), rowf),
                      pl.BlockSpec((None, G, bq), rowf)],
            out_specs=[pl.BlockSpec((None, bk, D), kb), pl.BlockSpec((None, bk, D), kb)],
            scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, D), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cp, interpret=interp,
    )(kept_k.astype(jnp.int32).reshape(-1), fetch, q, k, v, rank, cut, do, lse, delta)
    return dq, dk, dv


def _target_kernel(live_ref, fetch_ref, q_ref, k_ref, lse_ref, out_ref, mass_sc, *, S, window, nq, nk, bq, bk, G,
                   scale, aggregate, eps):
    bh, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(i == 0)
    def _init():
        mass_sc[...] = jnp.zeros(mass_sc.shape, jnp.float32)

    @pl.when(live_ref[j * nq + i] != 0)
    def _compute():
        D = q_ref.shape[-1]
        s = logits(q_ref[...].reshape(G * bq, D), k_ref[...], scale) - lse_ref[...].reshape(G * bq, 1)
        d = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        t = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        future = jnp.broadcast_to(((d >= t + window) & (d < S))[None], (G, bq, bk)).reshape(G * bq, bk)
        p = jnp.where(future, jnp.exp(s), 0.0).reshape(G, bq, bk)
        mass_sc[...] += jnp.sum(p, axis=1)

    @pl.when(i == nq - 1)
    def _finish():
        out_ref[...] = finish_target(mass_sc[...], j * bk, S=S, window=window, aggregate=aggregate, eps=eps, T=bk)


def transposed_target(q, k, lse, *, S, window, aggregate, eps, bq, bk, interpret):
    """``float32 [BK, 1, Sp]``: per key block, the query blocks holding some ``d >= t + w``
    are walked (the others skipped without DMA) and the target finished in the kernel."""
    BK, G, Sp, D = q.shape
    nq, nk = Sp // bq, Sp // bk
    last_q = jnp.minimum(jnp.arange(nq) * bq + bq, S) - 1
    live = last_q[None, :] >= jnp.arange(nk)[:, None] * bk + window            # [nk, nq], a suffix per row
    first = jnp.argmax(live, axis=1).astype(jnp.int32)[:, None]                   # its first live block
    # skipped (leading) steps fetch the first live block early; rows with none stay on block 0
    fetch = jnp.where(live.any(axis=1, keepdims=True), jnp.maximum(jnp.arange(nq, dtype=jnp.int32), first), 0)
    fetch = fetch.reshape(-1)
    qf = lambda bh, j, i, lr, fr: (bh, 0, fr[j * nq + i], 0)  # noqa: E731
    kernel = functools.partial(_target_kernel, S=S, window=window, nq=nq, nk=nk, bq=bq, bk=bk, G=G, scale=D ** -0.5,
                               aggregate=aggregate, eps=eps)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(BK, nk, nq),
            in_specs=[pl.BlockSpec((None, G, bq, D), qf), pl.BlockSpec((None, bk, D), lambda bh, j, i, *_: (bh, j, 0)),
                      pl.BlockSpec((None, G, bq), lambda bh, j, i, lr, fr: (bh, 0, fr[j * nq + i]))],
            out_specs=pl.BlockSpec((None, 1, bk), lambda bh, j, i, *_: (bh, 0, j)),
            scratch_shapes=[pltpu.VMEM((G, bk), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((BK, 1, Sp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(live.astype(jnp.int32).reshape(-1), fetch, q, k, lse)


def sparse_decode(q, k, v, valid, *, split, interpret):
    """Partial ``(o [BK, P, G, D], lse [BK, P, G, 1])`` over ``P`` slot splits of ``split`` slots."""
    BK, G, D = q.shape
    N = k.shape[1]
    P = N // split
    return pl.pallas_call(
        functools.partial(decode_kernel, scale=D ** -0.5), grid=(BK, P),
        in_specs=[pl.BlockSpec((None, G, D), lambda b, p: (b, 0, 0)), pl.BlockSpec((None, split, D), lambda b, p: (b, p, 0)),
                  pl.BlockSpec((None, split, D), lambda b, p: (b, p, 0)),
                  pl.BlockSpec((None, 1, split), lambda b, p: (b, 0, p))],
        out_specs=[pl.BlockSpec((None, None, G, D), lambda b, p: (b, p, 0, 0)),
                   pl.BlockSpec((None, None, G, 1), lambda b, p: (b, p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((BK, P, G, D), jnp.float32), jax.ShapeDtypeStruct((BK, P, G, 1), jnp.float32)],
        interpret=pltpu.InterpretParams() if interpret else False,
    )(q, k, v, valid)
