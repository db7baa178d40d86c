"""KVpop scorers: the mLSTM's three forms agree, decode = training, stabiliser, gradients, MLP, params.

Every model call is jitted through a few shared helpers (static window / form / chunk) so
the suite compiles each configuration once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.scorers import MLPScorer, MLSTMScorer, ScorerParam, mlstm_chunkwise, mlstm_readout, mlstm_scan
from kvjax.scorers.mlstm import zero_state

B, S, K, D, QK, E = 2, 29, 3, 8, 16, 12
WINDOW, CHUNK = 4, 8          # 8 does not divide S = 29
T_BS = jnp.broadcast_to(jnp.arange(S), (B, S))


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _kv(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return _normal(rng, (B, S, K, D), scale), _normal(rng, (B, S, K, D), scale)


def _close(a, b, tol):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    fin = np.isfinite(a)
    np.testing.assert_allclose(a[fin], b[fin], atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def mlstm():
    return MLSTMScorer(2, K, D, QK, v_dim=E, rngs=nnx.Rngs(0))


@functools.partial(nnx.jit, static_argnames=("window", "form", "chunk"))
def _prefill_jit(m, k, v, lengths, *, window, form, chunk):
    return m.prefill(1, k, v, window, lengths_B=lengths, form=form, chunk=chunk)


def _prefill(m, k, v, lengths=(S, S), *, window=WINDOW, form="chunkwise", chunk=CHUNK):
    """Always the same call signature, so each (window, form, chunk) compiles once."""
    return _prefill_jit(m, k, v, jnp.asarray(lengths), window=window, form=form, chunk=chunk)


@nnx.jit
def _decode_jit(m, k_BSKD, v_BSKD, window):
    def body(st, q):
        t = jnp.maximum(q - window, 0)           # q < w: no exiting token, score ignored
        return m.step(1, st, k_BSKD[:, q], v_BSKD[:, q], k_BSKD[:, t], v_BSKD[:, t])

    st, r_QBK = jax.lax.scan(body, m.init_state(B), jnp.arange(S))
    return jnp.moveaxis(r_QBK, 0, -1), st


def _decode(m, k_BSKD, v_BSKD, window):
    """Feed tokens one at a time through ``step``; at ``q`` the caller passes token ``q - w``'s k, v.

    Returns the scores laid out by token (``-inf`` where never read) and the final memory.
    """
    r_BKQ, st = _decode_jit(m, k_BSKD, v_BSKD, window)
    out = np.full(r_BKQ.shape, -np.inf, np.float32)
    out[..., : S - window] = np.asarray(r_BKQ)[..., window:]
    return out, st


def _readout_probe(st, seed):
    return mlstm_readout(st, _normal(np.random.default_rng(seed), st.n.shape))


def test_mlstm_forms_agree(mlstm):
    k, v = _kv(1)
    ref, st_ref = _prefill(mlstm, k, v, form="scan")
    assert ref.shape == (B, K, S) and ref.dtype == jnp.float32
    assert np.all(np.isfinite(ref[..., : S - WINDOW])) and np.all(np.isneginf(ref[..., S - WINDOW:]))
    for chunk in (1, CHUNK, 64):                 # 64 > S
        r, st = _prefill(mlstm, k, v, chunk=chunk)
        _close(r, ref, 1e-4)
        _close(_readout_probe(st, 2), _readout_probe(st_ref, 2), 1e-4)


@pytest.mark.parametrize("window", [0, WINDOW])
def test_decode_steps_equal_training_scores(mlstm, window):
    k, v = _kv(2)
    dec, st = _decode(mlstm, k, v, window)
    ref, st_ref = _prefill(mlstm, k, v, window=window)
    _close(dec, ref, 1e-5)
    _close(_readout_probe(st, 9), _readout_probe(st_ref, 9), 1e-5)


def test_prefill_lengths(mlstm):
    """A row shorter than S: -inf past its length - w, and its memory stops at its last token."""
    k, v = _kv(4)
    r, st = _prefill(mlstm, k, v, (S, 17))
    r_full, _ = _prefill(mlstm, k, v)
    _close(r[0], r_full[0], 1e-6)
    np.testing.assert_array_equal(np.isneginf(r[1]), np.broadcast_to(np.arange(S) >= 17 - WINDOW, (K, S)))
    _close(r[1, :, : 17 - WINDOW], r_full[1, :, : 17 - WINDOW], 1e-5)       # delayed reads before 17 unchanged
    # the tokens past the length leave no trace: same memory as with zeros there
    k17, v17 = jnp.concatenate([k[1:, :17]] * 2), jnp.concatenate([v[1:, :17]] * 2)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, S - 17), (0, 0), (0, 0)))
    _, st17 = _prefill(mlstm, pad(k17), pad(v17), (17, 17))
    row = lambda st, b: jax.tree.map(lambda a: a[b:b + 1], st)
    _close(_readout_probe(row(st, 1), 5), _readout_probe(row(st17, 0), 5), 1e-6)


def test_stabiliser_large_gates():
    """Gate pre-activations ~ +-50: no inf/nan in values or gradients (zero queries = unread rows)."""
    rng = np.random.default_rng(6)
    q = _normal(rng, (B, K, S, QK)).at[:, :, :WINDOW].set(0.0)
    kk, v = _normal(rng, (B, K, S, QK)), _normal(rng, (B, K, S, 4))
    i = jnp.asarray(rng.uniform(-50, 50, (B, K, S)), jnp.float32)
    lf = jax.nn.log_sigmoid(jnp.asarray(rng.uniform(-50, 50, (B, K, S)), jnp.float32))
    st0 = zero_state(B, K, QK, 4)
    forms = {"scan": lambda i, lf: mlstm_scan(st0, q, kk, v, i, lf)[0],
             "chunkwise": lambda i, lf: mlstm_chunkwise(st0, q, kk, v, i, lf, CHUNK)[0]}
    outs = {}
    for name, f in forms.items():
        outs[name], grads = jax.jit(lambda i, lf: (f(i, lf), jax.grad(lambda *a: jnp.sum(jnp.tanh(f(*a))),
                                                                      argnums=(0, 1))(i, lf)))(i, lf)
        assert np.all(np.isfinite(outs[name])), name
        assert all(np.all(np.isfinite(g)) for g in grads), name
    _close(outs["chunkwise"], outs["scan"], 1e-4)


def test_scorer_large_inputs(mlstm):
    k, v = _kv(7, scale=50.0)
    for form in ("scan", "chunkwise"):
        assert np.all(np.isfinite(_prefill(mlstm, k, v, form=form)[0][..., : S - WINDOW])), form


def _param_grads(model, score_fn, k, v):
    """``(score_fn(model, k, v), grads of a loss on it wrt (scorer params, k, v))``."""
    graphdef, params = nnx.split(model, ScorerParam)

    def loss(params, k, v):
        r = score_fn(nnx.merge(graphdef, params), k, v)
        fin = jnp.isfinite(r)                       # -inf = unread: mask before the loss's nonlinearity
        return jnp.sum(jnp.where(fin, jnp.sin(jnp.where(fin, r, 0.0)), 0.0)), r

    (_, r), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(params, k, v)
    return r, grads


def _assert_params_only(g_params, g_k, g_v):
    assert np.all(np.asarray(g_k) == 0) and np.all(np.asarray(g_v) == 0)     # stop_gradient on k, v
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        assert np.all(np.isfinite(g)), path
        assert np.any(np.asarray(g)[1] != 0), path     # layer 1 is the one scored: every weight learns
        assert np.all(np.asarray(g)[0] == 0), path


def test_mlstm_priority_and_gradients(mlstm):
    """p_t = r_hat_t + lambda_h t; grads reach every scorer weight (decay through p), not k, v;
    training through the chunkwise form gives the reference (scan) gradients."""
    k, v = _kv(8)
    out = {form: _param_grads(mlstm, lambda m, k, v: m.priority(1, k, v, T_BS, WINDOW, form=form, chunk=CHUNK),
                              k, v) for form in ("scan", "chunkwise")}
    p, grads = out["chunkwise"]
    lam = np.asarray(mlstm.decay(1))
    assert np.all(lam > 0)
    _close(p, _prefill(mlstm, k, v)[0] + lam[None, :, None] * np.arange(S), 1e-5)
    _assert_params_only(*grads)
    for g, g_ref in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(out["scan"][1][0])):
        np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-3)


def test_mlp_gradients():
    model = MLPScorer(2, K, D, 16, rngs=nnx.Rngs(1))
    k, v = _kv(11)
    _assert_params_only(*_param_grads(model, lambda m, k, v: m.priority(1, k, v, T_BS), k, v)[1])


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_mlp_shapes_decay_priority(activation):
    model = MLPScorer(3, K, D, rngs=nnx.Rngs(2), activation=activation)
    assert model.w1.shape == (3, K, 2 * D, 64)
    model.decay_raw[...] = _normal(np.random.default_rng(0), (3, K), 3.0)    # a spread of decays
    lam = np.asarray(model.decay(2), np.float64)
    assert np.all(lam >= 0)
    rng = np.random.default_rng(1)
    t = jnp.asarray(np.sort(rng.integers(0, 1000, (B, S)), axis=1))
    k, v = _kv(12)
    r, p, r_tok = nnx.jit(lambda m, k, v, t: (m.scores(2, k, v), m.priority(2, k, v, t),
                                              m.scores(2, k[:, 5:6], v[:, 5:6])))(model, k, v, t)
    assert r.shape == p.shape == (B, K, S) and r.dtype == jnp.float32
    _close(r_tok[..., 0], r[..., 5], 1e-6)                                   # one token at a time (decode)
    r64, t64 = np.asarray(r, np.float64), np.asarray(t, np.float64)[:, None, :]
    for q in (int(t.max()), int(t.max()) + 500):
        decayed = r64 - lam[None, :, None] * (q - t64)                      # r_t - lambda_h (q - t)
        np.testing.assert_array_equal(np.argsort(-np.asarray(p), axis=-1, kind="stable"),
                                      np.argsort(-decayed, axis=-1, kind="stable"))


@pytest.mark.parametrize("make", [lambda: MLPScorer(2, K, D, 16, rngs=nnx.Rngs(0)),
                                  lambda: MLSTMScorer(2, K, D, QK, rngs=nnx.Rngs(0))], ids=["mlp", "mlstm"])
def test_params_are_scorer_params(make):
    model = make()
    assert len(jax.tree.leaves(nnx.state(model, ScorerParam))) == len(jax.tree.leaves(nnx.state(model))) > 0
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            assert isinstance(var, ScorerParam)
            assert len(var.logical_axes) == var.get_value().ndim
            assert var.logical_axes[:2] == ("layers", "kv_heads")
