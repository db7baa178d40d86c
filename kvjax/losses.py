"""KVpop and LKV training losses.

Retention (scorers only; their inputs are ``stop_gradient``-ed upstream):

- ``regression_loss``: ``mean_t (r_hat_t - r_tgt_t)^2`` over tokens with a target; with
  ``centred``, ``mean_t (r_hat_t - r_tgt_t - c)^2`` with ``c`` the row's mean difference (the
  best per-(row, head) offset). The keep rule ranks ``p_t = r_hat_t + lambda_h t`` within a
  head, so an offset changes nothing kept; the plain loss spends the first hundreds of steps
  moving the scorer's output bias from 0 to the target's level (about -6 on the testbed; Adam
  moves a bias ~lr per step). Fitting the testbed target for 300 steps, the MLP scorer's
  per-head Spearman correlation was 0.51-0.81 plain and 0.83-0.93 centred.
- ``boundary_pairwise_loss`` (seed, "boundary-aware loss"): at sampled query positions
  ``q`` after the long-range budget is full (``|E(q)| > k``), the token leaving the window
  ``t = q - w`` is compared with the teacher's current cutoff token ``c(q)`` (the k-th
  best eligible token under the target ranking). Label ``y = 1`` if the teacher keeps
  ``t`` (its target ranks within the top-k of ``E(q)``); loss
  ``w * softplus(-(2y - 1) * (p_hat_t - p_hat_c))`` on the student's static priorities,
  with margin weight ``w = tanh(|p_tgt_t - p_tgt_c| / margin)`` (near-ties count little)
  and keep/drop balancing (positives and negatives each carry half the total weight).

Distillation (student backbone):

- ``kl_distill``: ``KL(p_teacher || p_student)`` per position, mean over the mask.
- ``topk_kl_distill``: the same on the teacher's top-K tokens, both distributions
  renormalised over that support.
- ``hidden_mse``: LKV's per-layer hidden-state MSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.eviction.fenwick import cutoffs_from_ranks, token_ranks


def _masked_mean(x, mask):
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def regression_loss(r_hat_BKS, r_tgt_BKS, *, centred: bool = False):
    """Mean squared error on tokens whose target and score are finite (the mLSTM reads a token
    ``w`` steps late: the last ``w`` of a row have no score, and a reconstruction target has a
    value there); ``centred``: after removing each row's mean difference (see the module docstring)."""
    ok = jnp.isfinite(r_tgt_BKS) & jnp.isfinite(r_hat_BKS)
    diff = jnp.where(ok, r_hat_BKS, 0.0) - jnp.where(ok, r_tgt_BKS, 0.0)
    if centred:
        n = jnp.maximum(jnp.sum(ok, axis=-1, keepdims=True), 1)
        diff = jnp.where(ok, diff - jnp.sum(diff, axis=-1, keepdims=True) / n, 0.0)
    return _masked_mean(diff ** 2, ok)


def boundary_pairs(p_tgt_BKS, *, sinks: int, window: int, topk: int):
    """For each query ``q``: the exiting token ``t = q - w``, the teacher's cutoff token
    ``c(q)``, whether the teacher keeps ``t``, and whether ``q`` is a valid boundary
    (budget full and ``t`` eligible). Returns ``(t [S], c [B, K, S], keep [B, K, S], valid [B, K, S])``."""
    B, K, S = p_tgt_BKS.shape
    ranks = token_ranks(p_tgt_BKS)                                          # [B, K, S]
    cut = cutoffs_from_ranks(ranks, sinks=sinks, window=window, topk=topk)  # [B, K, S]
    q = jnp.arange(S)
    t = q - window
    n_elig = jnp.maximum(q - window - sinks + 1, 0)
    valid = (t >= sinks) & (n_elig > topk) & (topk > 0)
    # token whose rank equals the cutoff: invert the rank permutation
    by_rank = jnp.argsort(ranks, axis=-1)                                   # rank -> token
    c = jnp.take_along_axis(by_rank, jnp.clip(cut, 0, S - 1), axis=-1)
    t_rank = jnp.take_along_axis(ranks, jnp.broadcast_to(jnp.clip(t, 0, S - 1), (B, K, S)), axis=-1)
    keep = t_rank <= cut
    return t, c, keep, jnp.broadcast_to(valid, (B, K, S))


def boundary_pairwise_loss(p_hat_BKS, p_tgt_BKS, *, sinks: int, window: int, topk: int, sample_mask_S=None,
                           margin: float = 1.0):
    """Boundary-aware logistic loss on student priorities (see module docstring)."""
    B, K, S = p_hat_BKS.shape
    t, c, keep, valid = boundary_pairs(jax.lax.stop_gradient(p_tgt_BKS), sinks=sinks, window=window, topk=topk)
    if sample_mask_S is not None:
        valid = valid & sample_mask_S
    tt = jnp.broadcast_to(jnp.clip(t, 0, S - 1), (B, K, S))
    pick = lambda x, i: jnp.take_along_axis(x, i, axis=-1)  # noqa: E731
    d_hat = jnp.where(valid, pick(p_hat_BKS, tt) - pick(p_hat_BKS, c), 0.0)   # masked before any
    d_tgt = jnp.where(valid, pick(p_tgt_BKS, tt) - pick(p_tgt_BKS, c), 0.0)   # nonlinearity: no inf*0
    sign = jnp.where(keep, 1.0, -1.0)
    w = jnp.where(valid, jnp.tanh(jnp.abs(jnp.nan_to_num(d_tgt)) / margin), 0.0)
    pos, neg = jnp.sum(jnp.where(keep, w, 0.0)), jnp.sum(jnp.where(keep, 0.0, w))
    w = jnp.where(keep, w / jnp.maximum(2 * pos, 1e-9), w / jnp.maximum(2 * neg, 1e-9))
    w = w * jnp.where((pos > 0) & (neg > 0), 1.0, 2.0)      # one class only: it carries all weight
    return jnp.sum(w * jax.nn.softplus(-sign * d_hat))


def kl_distill(teacher_logits_BSV, student_logits_BSV, mask_BS):
    """Mean over ``mask`` of ``KL(softmax(teacher) || softmax(student))``."""
    lt = jax.nn.log_softmax(teacher_logits_BSV.astype(jnp.float32), -1)
    ls = jax.nn.log_softmax(student_logits_BSV.astype(jnp.float32), -1)
    return _masked_mean(jnp.sum(jnp.exp(lt) * (lt - ls), -1), mask_BS)


def topk_kl_distill(teacher_logits_BSV, student_logits_BSV, mask_BS, k: int):
    """KL on the teacher's top-``k`` tokens, both sides renormalised over that support."""
    vals, idx = jax.lax.top_k(teacher_logits_BSV.astype(jnp.float32), k)
    lt = jax.nn.log_softmax(vals, -1)
    ls = jax.nn.log_softmax(jnp.take_along_axis(student_logits_BSV.astype(jnp.float32), idx, -1), -1)
    return _masked_mean(jnp.sum(jnp.exp(lt) * (lt - ls), -1), mask_BS)


def cached_topk_kl(teacher_logp_BSK, teacher_idx_BSK, student_logits_BSV, mask_BS):
    """Mean over ``mask`` of the KL between teacher and student over ``K + 1`` outcomes: the teacher's
    top-``K`` tokens (their cached log-probabilities ``log p_T``, ``kvjax.train.teacher_cache``) and
    one bucket for the rest of the vocabulary:

        sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest),
        p_rest = 1 - sum_k p_k,  q_rest = 1 - sum_k q_k,  q = softmax(student logits).

    Equal to ``kl_distill`` when ``K`` is the vocabulary; below it otherwise (grouping outcomes
    cannot raise a KL). The student stays normalised over the whole vocabulary, so mass it puts
    outside the teacher's top-``K`` is paid for (``topk_kl_distill`` renormalises and does not)."""
    lt = teacher_logp_BSK.astype(jnp.float32)
    ls = jnp.take_along_axis(jax.nn.log_softmax(student_logits_BSV.astype(jnp.float32), -1), teacher_idx_BSK, -1)
    pt = jnp.exp(lt)
    head = jnp.sum(pt * (lt - ls), -1)
    p_rest = jnp.clip(1.0 - jnp.sum(pt, -1), 0.0, 1.0)
    q_rest = jnp.clip(1.0 - jnp.sum(jnp.exp(ls), -1), 1e-30, 1.0)
    tail = jnp.where(p_rest > 0, p_rest * (jnp.log(jnp.maximum(p_rest, 1e-30)) - jnp.log(q_rest)), 0.0)
    return _masked_mean(head + tail, mask_BS)


def hidden_mse(teacher_hidden, student_hidden, mask_BS):
    """LKV: ``sum_l mean_{b,s in mask} ||h_l^S - h_l^T||^2 / E`` over per-layer hidden states."""
    total = 0.0
    for ht, hs in zip(teacher_hidden, student_hidden):
        total = total + _masked_mean(jnp.mean((hs.astype(jnp.float32) - ht.astype(jnp.float32)) ** 2, -1), mask_BS)
    return total


def lm_loss(logits_BSV, targets_BS, mask_BS):
    """Mean next-token cross entropy over ``mask`` (bool, or float weights): ``-sum m log p(x_{t+1} | x_<=t) / sum m``."""
    logp = jax.nn.log_softmax(logits_BSV[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BS[:, 1:, None], axis=-1)[..., 0]
    m = mask_BS[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
