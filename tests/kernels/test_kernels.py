"""Every Pallas kernel (TPU and GPU, in interpret mode) against its XLA reference: forward
output and LSE, gradients, the transposed target and decode; block skipping counted; and
the errors for sizes a backend cannot tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from kvjax.eviction import compact_keep
from pallas_kernels import reference

BLOCKS = {"tpu": 128, "gpu": 32}   # the smallest legal tiles keep interpret mode fast


def _inputs(B, S, G, K, D, seed=0, dtype=jnp.float32):
    rs = np.random.RandomState(seed)
    q = jnp.asarray(rs.randn(B, S, G * K, D), dtype)
    k = jnp.asarray(rs.randn(B, S, K, D), dtype)
    v = jnp.asarray(rs.randn(B, S, K, D), dtype)
    return q, k, v, jnp.asarray(rs.randn(B, K, S).astype(np.float32))


def _keep(prio, backend, sinks, window, topk):
    b = BLOCKS[backend]
    return compact_keep(prio, sinks=sinks, window=window, topk=topk, block_q=b, block_k=b)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("D,G,S,budget", [
    (64, 1, 150, (4, 16, 10_000)),      # keeps everything
    (128, 2, 137, (2, 8, 0)),           # k = 0: sinks + window only
    (64, 4, 200, (4, 32, 24)),
    (64, 8, 140, (1, 4, 9)),
])
def test_sparse_attention_forward_matches_reference(backend, D, G, S, budget):
    sinks, window, topk = budget
    q, k, v, prio = _inputs(2, S, G, 2, D)
    ck = _keep(prio, backend, sinks, window, topk)
    b = BLOCKS[backend]
    out, lse = pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=sinks, window=window, backend=backend,
                                   interpret=True, block_q=b, block_k=b)
    ref_out, ref_lse = reference.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=sinks, window=window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sparse_attention_bf16(backend):
    """bf16 inputs, float32 accumulation: within 2e-2 of the float32 reference on the same
    (bf16-rounded) inputs; the LSE within 1e-2."""
    q, k, v, prio = _inputs(2, 150, 2, 2, 64, seed=1, dtype=jnp.bfloat16)
    ck = _keep(prio, backend, 4, 16, 20)
    b = BLOCKS[backend]
    out, lse = pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=4, window=16, backend=backend, interpret=True,
                                   block_q=b, block_k=b)
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse = reference.sparse_attention(*f32, ck.rank, ck.cutoff, sinks=4, window=16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=2e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_sparse_attention_gradients_match_reference(backend):
    q, k, v, prio = _inputs(2, 140, 2, 2, 64, seed=2)
    ck = _keep(prio, backend, 2, 12, 16)
    b = BLOCKS[backend]

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(lse))   # the LSE's cotangent is used too
        return f

    kern = loss(lambda q, k, v: pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=12,
                                                     backend=backend, interpret=True, block_q=b, block_k=b))
    ref = loss(lambda q, k, v: reference.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=12))
    for a, r in zip(jax.grad(kern, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_block_skipping_computes_exactly_the_blocks_with_a_kept_key(backend):
    b = BLOCKS[backend]
    S = 5 * b + 7
    q, k, v, prio = _inputs(1, S, 1, 2, 64, seed=3)
    ck = _keep(prio, backend, 4, 8, 6)
    counts = pk.sparse_attention_block_counts(q, k, v, ck.rank, ck.cutoff, sinks=4, window=8, backend=backend,
                                              block_q=b, block_k=b)
    want = np.asarray(ck.block_any_kept).sum(-1)
    np.testing.assert_array_equal(np.asarray(counts), want)
    nq = want.shape[-1]
    assert want.sum() < 2 * nq * (nq + 1) // 2          # fewer than the causal blocks: skipping is real


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("G,window,aggregate", [(1, 8, "max"), (2, 40, "mean"), (4, 3, "max")])
def test_transposed_target_matches_reference(backend, G, window, aggregate):
    q, k, _, prio = _inputs(2, 150, G, 2, 64, seed=4)
    ck = _keep(prio, backend, 2, window, 12)
    _, lse = reference.sparse_attention(q, k, k, ck.rank, ck.cutoff, sinks=2, window=window)
    b = BLOCKS[backend]
    got = np.asarray(pk.transposed_target(q, k, lse, window=window, aggregate=aggregate, backend=backend,
                                          interpret=True, block_q=b, block_k=b))
    want = np.asarray(reference.transposed_target(q, k, lse, window=window, aggregate=aggregate))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("G,N,split", [(2, 200, 128), (4, 90, 512)])
def test_sparse_decode_matches_reference(backend, G, N, split):
    rs = np.random.RandomState(5)
    q = jnp.asarray(rs.randn(2, 2 * G, 64).astype(np.float32))
    k = jnp.asarray(rs.randn(2, 2, N, 64).astype(np.float32))
    v = jnp.asarray(rs.randn(2, 2, N, 64).astype(np.float32))
    valid = jnp.asarray(rs.rand(2, 2, N) < 0.6)
    got = pk.sparse_decode(q, k, v, valid, backend=backend, interpret=True, split=split if backend == "tpu" else 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference.sparse_decode(q, k, v, valid)), atol=2e-5)


def test_auto_is_the_reference_on_cpu_and_bad_sizes_are_named():
    assert pk.resolve_backend("auto") == "xla"
    q, k, v, prio = _inputs(1, 40, 2, 1, 64)
    ck = compact_keep(prio, sinks=2, window=4, topk=5)
    out, _ = pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4)
    ref, _ = reference.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError, match="multiples of 128 lanes"):
        pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4, backend="tpu", block_q=96)
    with pytest.raises(ValueError, match="powers of two"):
        pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4, backend="gpu", block_k=48)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        q3, k3, v3, _ = _inputs(1, 40, 2, 1, 96)
        pk.sparse_attention(q3, k3, v3, ck.rank, ck.cutoff, sinks=2, window=4, backend="gpu")
    with pytest.raises(ValueError, match="causal=False is not supported"):
        pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4, causal=False)
    with pytest.raises(ValueError, match=r"rank must have shape \[B, K, S\]"):
        pk.sparse_attention(q, k, v, ck.rank[:, :, :10], ck.cutoff, sinks=2, window=4)
    with pytest.raises(ValueError, match="backend must be one of"):
        pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=2, window=4, backend="cuda")


def test_integration_config_key_forces_a_kernel(hf_dir, tmp_path):
    """The bounded cache's prefill and decode, and the distill_kvpop student's attention and
    target, run the Pallas kernels when ``kernel`` names one, with the reference's results."""
    import kvjax
    from kvjax.eviction.config import EvictionConfig
    from kvjax.eviction.forced import sparse_logits
    from kvjax.eviction.policies import make_policy
    from kvjax.train.tasks import make_task
    from train_helpers import tiny_config

    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    tokens = np.random.RandomState(6).randint(3, 97, (2, 70))
    prio = jnp.asarray(np.random.RandomState(7).randn(model.config.num_layers, 2, model.config.num_kv_heads, 90))
    runs = {}
    for kernel in ("xla", "gpu"):
        pol = make_policy("oracle", EvictionConfig(sinks=2, window=6, topk=9, kernel=kernel, kernel_interpret=True),
                          params=prio)
        runs[kernel] = (np.asarray(sparse_logits(model, tokens, pol)),
                        np.asarray(kvjax.generate(model, tokens[:, :50], 12, policy=pol, eos_token_id=[])))
    np.testing.assert_allclose(runs["gpu"][0], runs["xla"][0], atol=1e-5)
    np.testing.assert_array_equal(runs["gpu"][1], runs["xla"][1])

    batch = {"tokens": jnp.asarray(np.random.RandomState(8).randint(3, 299, (2, 96))),
             "loss_mask": jnp.ones((2, 96), bool)}
    losses = {}
    for kernel in ("xla", "gpu"):
        task = make_task(tiny_config(tmp_path, mode="distill_kvpop", **{
            "eviction": {"sinks": 2, "window": 8, "topk": 16, "kernel": kernel, "kernel_interpret": True}}))
        losses[kernel] = jax.value_and_grad(task.loss_fn, has_aux=True)(task.params, task.frozen, batch,
                                                                         jax.random.key(0), jnp.int32(0))
    (lx, ax), gx = losses["xla"]
    (lg, ag), gg = losses["gpu"]
    np.testing.assert_allclose(float(lg), float(lx), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gx)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.parametrize("backend,platform,marker", [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "triton")])
def test_kernels_lower_for_their_platform(backend, platform, marker):
    """Without the hardware: forward, backward, target and decode lower through Mosaic TPU /
    Triton (their tiling and dtype rules are checked by the real lowering, not interpret mode),
    bf16, head dim 128, a length that is not a multiple of the block."""
    B, S, H, K, D = 1, 300, 8, 2, 128
    q = jnp.zeros((B, S, H, D), jnp.bfloat16)
    k = jnp.zeros((B, S, K, D), jnp.bfloat16)
    ck = compact_keep(jnp.asarray(np.random.RandomState(0).randn(B, K, S).astype(np.float32)), sinks=4, window=32,
                      topk=100)

    def fwd(q, k, v):
        return pk.sparse_attention(q, k, v, ck.rank, ck.cutoff, sinks=4, window=32, backend=backend)

    def grad(q, k, v):
        return jax.grad(lambda *a: jnp.sum(fwd(*a)[0].astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    slots = jnp.zeros((B, K, 1024, D), jnp.bfloat16)
    cases = [(fwd, (q, k, k)), (grad, (q, k, k)),
             (lambda q, k: pk.transposed_target(q, k, jnp.zeros((B, S, H)), window=32, backend=backend), (q, k)),
             (lambda q, k, v, m: pk.sparse_decode(q, k, v, m, backend=backend), (q[:, 0], slots, slots,
                                                                                  jnp.ones((B, K, 1024), bool)))]
    for fn, args in cases:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert marker in text.lower()


@pytest.mark.parametrize("kv_layout", ["BTKD", "BKTD"])
def test_causal_blocks_equal_one_grouped_attention(kv_layout):
    """The references' causal prefill in query blocks (a block size that does not divide S,
    keys past S present and ignored) gives the full formulation's output and LSE, and the
    keep-rule reference built block by block equals the one from the whole S x S mask."""
    from pallas_kernels.keep_rule import dense_keep_mask

    rs = np.random.RandomState(5)
    B, S, T, K, G, D = 2, 45, 53, 2, 3, 8
    q = jnp.asarray(rs.randn(B, S, K * G, D), jnp.float32)
    shape = (B, T, K, D) if kv_layout == "BTKD" else (B, K, T, D)
    k, v = jnp.asarray(rs.randn(*shape), jnp.float32), jnp.asarray(rs.randn(*shape), jnp.float32)
    tri = np.arange(T)[None, :] <= np.arange(S)[:, None]
    mask = jnp.asarray(tri[None, None, None] & ((rs.rand(B, K, 1, S, T) < 0.6) | np.eye(S, T, dtype=bool)))
    want_out, want_lse, _ = reference.grouped_attention(q, k, v, allowed=mask, kv_layout=kv_layout)
    got_out, got_lse = reference.causal_attention(q, k, v, allowed=lambda s0, e: mask[:, :, :, s0:e, :e],
                                                  kv_layout=kv_layout, block=16)
    np.testing.assert_allclose(got_out, want_out, atol=2e-6)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-6)

    qs, ks, vs, prio = _inputs(2, 300, 2, 2, 8, seed=6)
    ck = compact_keep(prio, sinks=3, window=7, topk=40, block_q=32, block_k=32)
    full = dense_keep_mask(ck.rank, ck.cutoff, 3, 7)
    want_out, want_lse, _ = reference.grouped_attention(qs, ks, vs, allowed=full[:, :, None])
    got_out, got_lse = reference.sparse_attention(qs, ks, vs, ck.rank, ck.cutoff, sinks=3, window=7)
    assert reference.CAUSAL_BLOCK < 300                                  # more than one block ran
    np.testing.assert_allclose(got_out, want_out, atol=2e-6)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-6)
