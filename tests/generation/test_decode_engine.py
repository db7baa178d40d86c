"""The one decode engine (kvjax/decode.py): positions, the carry, and parity with the dense forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import decode
from kvjax.cache import DenseKV


def _run(model, policy, fn):
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, pp: fn(nnx.merge(graphdef, p), pp))(params, policy.params)


def test_prompt_then_steps_equal_the_dense_forward(tiny_llama):
    """A prompt fed in one block, then tokens fed one step at a time, give the logits of one
    dense causal pass over the whole sequence; positions advance by each row's real length."""
    rs = np.random.RandomState(0)
    B, P, N = 2, 9, 6
    seq = jnp.asarray(rs.randint(3, 97, (B, P + N)), jnp.int32)
    lengths = jnp.asarray([P, P - 3], jnp.int32)
    policy = DenseKV()

    def fn(model, pp):
        attend = decode.bind(policy, pp)
        st = decode.open_state(model, policy, pp, B, P + N, lengths)
        hidden, st = decode.feed_prompt(model, attend, st, seq[:, :P], lengths)
        after_prompt = st.position
        first = decode.last_logits(model, hidden, lengths)
        logits = []
        for i in range(N):   # row b feeds its token at its own position lengths[b] + i
            tok = seq[jnp.arange(B), lengths + i]
            lg, st = decode.decode_step(model, attend, st, tok)
            logits.append(lg)
        return first, jnp.stack(logits, 1), after_prompt, st.position, st.step

    first, steps, after_prompt, end, n_steps = _run(tiny_llama, policy, fn)
    np.testing.assert_array_equal(np.asarray(after_prompt), np.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(end), np.asarray(lengths) + N)
    assert int(n_steps) == N
    dense = np.asarray(kvjax.forward(tiny_llama, seq))
    for b in range(B):
        n = int(lengths[b])
        np.testing.assert_allclose(np.asarray(first)[b], dense[b, n - 1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(steps)[b], dense[b, n:n + N], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["knorm", "h2o"])
def test_generate_is_a_driver_of_decode_step(tiny_llama, name):
    """generate's greedy tokens equal a hand-written loop over open_state / feed_prompt / decode_step
    with a bounded policy (static priorities and attention statistics)."""
    rs = np.random.RandomState(1)
    B, P, N = 2, 40, 12
    prompt = rs.randint(3, 97, (B, P)).astype(np.int32)
    policy = kvjax.make_policy(name, kvjax.EvictionConfig(2, 4, 8))
    want = np.asarray(kvjax.generate(tiny_llama, prompt, N, policy=policy, eos_token_id=[],
                                     bucket_lengths=False))[:, P:]
    lengths = jnp.full((B,), P, jnp.int32)

    def fn(model, pp):
        attend = decode.bind(policy, pp)
        st = decode.open_state(model, policy, pp, B, P + N, lengths)
        hidden, st = decode.feed_prompt(model, attend, st, jnp.asarray(prompt), lengths)
        tok = jnp.argmax(decode.last_logits(model, hidden, lengths), -1).astype(jnp.int32)
        out = [tok]
        for _ in range(N - 1):
            lg, st = decode.decode_step(model, attend, st, tok)
            tok = jnp.argmax(lg, -1).astype(jnp.int32)
            out.append(tok)
        return jnp.stack(out, 1)

    got = np.asarray(_run(tiny_llama, policy, fn))
    assert len(np.unique(want)) > 3
    np.testing.assert_array_equal(got, want)
