"""KVpop's three hot loops behind one op API, each with an XLA reference (``reference.py``)
as its ground truth and CPU path, and Pallas kernels per backend (``tpu.py``: Mosaic TPU,
``gpu.py``: Triton).

- :func:`sparse_attention` -- flash attention whose mask is the keep rule computed inside
  the kernel from per-token ranks and per-query cutoffs; key blocks without a kept key are
  skipped; backward by ``jax.custom_vjp`` (dq and dk/dv kernels reusing the saved LSE).
- :func:`transposed_target` -- the future-attention target by a transposed pass over key
  blocks, count normalisation and group aggregation fused, ``O(S)`` extra memory.
- :func:`sparse_decode` -- one decode step over the bounded cache's slots, split over slot
  chunks with a log-sum-exp merge.

``backend``: ``"auto"`` (the kernel of the platform JAX runs on; the XLA reference on
CPU), ``"xla"``, ``"tpu"``, ``"gpu"``; ``interpret=True`` runs a kernel in Pallas
interpret mode (how the kernels are tested on CPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.keep_rule import block_any_kept
from pallas_kernels import reference

BACKENDS = ("auto", "xla", "tpu", "gpu")


def resolve_backend(backend: str) -> str:
    """The concrete backend for ``backend`` on the platform JAX runs on."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    return "tpu" if platform == "tpu" else "gpu" if platform in ("gpu", "cuda", "rocm") else "xla"


def _module(backend: str):
    if backend == "tpu":
        from pallas_kernels import tpu
        return tpu
    from pallas_kernels import gpu
    return gpu


def _check_blocks(backend: str, block_q: int, block_k: int, head_dim: int) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
        if backend == "tpu" and b % 128:
            raise ValueError(f"{name}={b}: TPU kernels tile keys and queries in multiples of 128 lanes")
        if backend == "gpu" and b & (b - 1):
            raise ValueError(f"{name}={b}: GPU (Triton) blocks must be powers of two")
    if backend == "gpu" and head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: GPU (Triton) kernels need a power-of-two head dim")


def _pad_to(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


class _AttnCfg(NamedTuple):
    backend: str
    sinks: int
    window: int
    block_q: int
    block_k: int
    interpret: bool


# ---- layouts ------------------------------------------------------------------------------
def _q_to_kernel(x_BSH, Sp: int, K: int):
    """Query-side ``[B, S, H, ...]`` (q, do, lse) -> ``[B*K, G, Sp, ...]``, padded to ``Sp``."""
    B, _, H = x_BSH.shape[:3]
    rest = x_BSH.shape[3:]
    x = _pad_to(x_BSH, 1, Sp).reshape(B, Sp, K, H // K, *rest)
    return jnp.moveaxis(x, 1, 3).reshape(B * K, H // K, Sp, *rest)


def _kv_to_kernel(x_BSKD, Sp: int):
    """``[B, S, K, D]`` -> ``[B*K, Sp, D]``, padded to ``Sp``."""
    B, _, K, D = x_BSKD.shape
    return _pad_to(x_BSKD, 1, Sp).transpose(0, 2, 1, 3).reshape(B * K, Sp, D)


def _to_kernel(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cut_BKS, Sp):
    B, K = rank_BKS.shape[:2]
    rank = _pad_to(rank_BKS.astype(jnp.int32), 2, Sp, Sp).reshape(B * K, 1, Sp)
    cut = _pad_to(cut_BKS.astype(jnp.int32), 2, Sp, -1).reshape(B * K, Sp, 1)
    return _q_to_kernel(q_BSHD, Sp, K), _kv_to_kernel(k_BSKD, Sp), _kv_to_kernel(v_BSKD, Sp), rank, cut


def _q_from_kernel(x_RGSD, B, S, K):
    BK, G, Sp = x_RGSD.shape[:3]
    rest = x_RGSD.shape[3:]
    x = x_RGSD.reshape(B, K, G, Sp, *rest)[:, :, :, :S]
    return jnp.moveaxis(x, 3, 1).reshape(B, S, K * G, *rest)


def _kv_from_kernel(x_RSD, B, S, K):
    return x_RSD.reshape(B, K, *x_RSD.shape[1:])[:, :, :S].transpose(0, 2, 1, 3)


def _attn_forward(cfg: _AttnCfg, q, k, v, rank, cut):
    B, S, H, D = q.shape
    K = k.shape[2]
    step = int(np.lcm(cfg.block_q, cfg.block_k))
    Sp = -(-S // step) * step
    blocks = block_any_kept(rank, cut, sinks=cfg.sinks, window=cfg.window, block_q=cfg.block_q,
                            block_k=cfg.block_k)
    blocks = _pad_to(_pad_to(blocks, 2, Sp // cfg.block_q, False), 3, Sp // cfg.block_k, False)
    kq, kk, kv, kr, kc = _to_kernel(q, k, v, rank, cut, Sp)
    o, lse, counts = _module(cfg.backend).sparse_attention_fwd(
        kq, kk, kv, kr, kc, blocks.reshape(B * K, *blocks.shape[2:]), sinks=cfg.sinks, window=cfg.window,
        bq=cfg.block_q, bk=cfg.block_k, interpret=cfg.interpret)
    out = _q_from_kernel(o, B, S, K)
    lse_BSH = _q_from_kernel(lse[..., None], B, S, K)[..., 0]
    return (out, lse_BSH), (kq, kk, kv, kr, kc, blocks, o, lse, counts, (B, S, K))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse_attention(cfg, q, k, v, rank, cut):
    return _attn_forward(cfg, q, k, v, rank, cut)[0]


def _sparse_attention_fwd(cfg, q, k, v, rank, cut):
    out, res = _attn_forward(cfg, q, k, v, rank, cut)
    return out, (res[:-2] + (res[-1],), rank, cut)


def _sparse_attention_bwd(cfg, residuals, cotangents):
    (kq, kk, kv, kr, kc, blocks, o, lse, (B, S, K)), rank, cut = residuals
    d_out, d_lse = cotangents
    Sp = kq.shape[2]
    do, dl = _q_to_kernel(d_out, Sp, K), _q_to_kernel(d_lse, Sp, K)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dl.astype(jnp.float32)
    dq, dk, dv = _module(cfg.backend).sparse_attention_bwd(
        kq, kk, kv, kr, kc, blocks.reshape(B * K, *blocks.shape[2:]), do.astype(kq.dtype), lse, delta,
        sinks=cfg.sinks, window=cfg.window, bq=cfg.block_q, bk=cfg.block_k, interpret=cfg.interpret)
    zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731  (integer inputs)
    return (_q_from_kernel(dq, B, S, K), _kv_from_kernel(dk, B, S, K), _kv_from_kernel(dv, B, S, K),
            zero(rank), zero(cut))


_sparse_attention.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


def _check_attention_args(q, k, v, rank, cutoff):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, S, H, D] and k, v [B, S, K, D], got {q.shape}, {k.shape}, {v.shape}")
    B, S, H, D = q.shape
    if k.shape[0] != B or k.shape[1] != S or k.shape[3] != D or H % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree (H must be a multiple of K)")
    want = (B, k.shape[2], S)
    for name, x in (("rank", rank), ("cutoff", cutoff)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape [B, K, S] = {want}, got {tuple(x.shape)}")


def sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS, *, sinks: int, window: int, causal: bool = True,
                     backend: str = "auto", interpret: bool = False, block_q: int = 128, block_k: int = 128):
    """``(out [B, S, H, D], lse [B, S, H] float32)``: causal attention under the keep rule.

    ``rank``/``cutoff`` ``[B, K, S]`` from :func:`kvjax.eviction.compact_keep` (or
    ``token_ranks`` + ``cutoffs_from_ranks``). Differentiable in ``q``, ``k``, ``v``.
    """
    if not causal:
        raise ValueError("sparse_attention: the keep rule is causal; causal=False is not supported")
    _check_attention_args(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS)
    be = resolve_backend(backend)
    if be == "xla":
        return reference.sparse_attention(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS, sinks=sinks, window=window)
    _check_blocks(be, block_q, block_k, q_BSHD.shape[-1])
    cfg = _AttnCfg(be, int(sinks), int(window), block_q, block_k, bool(interpret))
    return _sparse_attention(cfg, q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS)


def sparse_attention_block_counts(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS, *, sinks: int, window: int,
                                  backend: str, interpret: bool = True, block_q: int = 128, block_k: int = 128):
    """Debug output: ``int32 [B, K, nq]`` key blocks each query block of the kernel computed."""
    _check_attention_args(q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS)
    be = resolve_backend(backend)
    if be == "xla":
        raise ValueError("block counts come from a kernel backend ('tpu' or 'gpu')")
    _check_blocks(be, block_q, block_k, q_BSHD.shape[-1])
    cfg = _AttnCfg(be, int(sinks), int(window), block_q, block_k, bool(interpret))
    counts = _attn_forward(cfg, q_BSHD, k_BSKD, v_BSKD, rank_BKS, cutoff_BKS)[1][-2]
    B, K = rank_BKS.shape[:2]
    return counts.reshape(B, K, -1)


def transposed_target(q_BSHD, k_BSKD, lse_BSH, *, window: int, aggregate: str = "max", eps: float = 1e-8,
                      backend: str = "auto", interpret: bool = False, block_q: int = 128, block_k: int = 128):
    """``float32 [B, K, S]``: ``log(eps + m(t))`` of KVpop's future-attention mass (see
    :mod:`kvjax.targets`), ``-inf`` where ``t + window >= S``."""
    if aggregate not in ("max", "mean"):
        raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    if H % K or lse_BSH.shape != (B, S, H):
        raise ValueError(f"q {q_BSHD.shape}, k {k_BSKD.shape} and lse {lse_BSH.shape} disagree")
    be = resolve_backend(backend)
    if be == "xla":
        return reference.transposed_target(q_BSHD, k_BSKD, lse_BSH, window=int(window), aggregate=aggregate, eps=eps)
    _check_blocks(be, block_q, block_k, D)
    step = int(np.lcm(block_q, block_k))
    Sp = -(-S // step) * step
    q, k, lse = _q_to_kernel(q_BSHD, Sp, K), _kv_to_kernel(k_BSKD, Sp), _q_to_kernel(lse_BSH.astype(jnp.float32), Sp, K)
    out = _module(be).transposed_target(q, k, lse, S=S, window=int(window), aggregate=aggregate, eps=float(eps),
                                        bq=block_q, bk=block_k, interpret=interpret)
    return out.reshape(B, K, Sp)[:, :, :S]


def sparse_decode(q_BHD, k_BKND, v_BKND, valid_BKN, *, backend: str = "auto", interpret: bool = False,
                  split: int = 512):
    """``out [B, H, D]``: one decode step's attention over the bounded cache's slots (all query
    heads of a KV head together), computed per chunk of ``split`` slots and merged by LSE."""
    B, H, D = q_BHD.shape
    K, N = k_BKND.shape[1], k_BKND.shape[2]
    if k_BKND.shape != (B, K, N, D) or v_BKND.shape != k_BKND.shape or valid_BKN.shape != (B, K, N) or H % K:
        raise ValueError(f"sparse_decode: q {q_BHD.shape}, k {k_BKND.shape}, v {v_BKND.shape}, "
                         f"valid {valid_BKN.shape} disagree")
    be = resolve_backend(backend)
    if be == "xla":
        return reference.sparse_decode(q_BHD, k_BKND, v_BKND, valid_BKN)
    if be == "gpu":
        split = 1 << max(4, (min(split, N) - 1).bit_length())      # a power of two, >= 16
    elif split % 128:
        raise ValueError(f"split={split}: TPU kernels tile slots in multiples of 128")
    Np = -(-N // split) * split
    G = H // K
    q = q_BHD.reshape(B * K, G, D)
    k = _pad_to(k_BKND, 2, Np).reshape(B * K, Np, D)
    v = _pad_to(v_BKND, 2, Np).reshape(B * K, Np, D)
    valid = _pad_to(valid_BKN.astype(jnp.int32), 2, Np).reshape(B * K, 1, Np)
    o_part, lse_part = _module(be).sparse_decode(q, k, v, valid, split=split, interpret=interpret)
    lse_part = lse_part[..., 0]                                                     # [BK, P, G]
    lse = jax.nn.logsumexp(lse_part, axis=1, keepdims=True)
    w = jnp.exp(lse_part - lse)[..., None]
    out = jnp.sum(w * o_part, axis=1)
    return out.reshape(B, H, D).astype(q_BHD.dtype)


__all__ = ["BACKENDS", "resolve_backend", "sparse_attention", "sparse_attention_block_counts",
           "transposed_target", "sparse_decode"]
