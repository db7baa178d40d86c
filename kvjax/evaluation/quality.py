"""Teacher-forced quality of an eviction policy on testbed problems.

For every policy: per-category token accuracy (lookup near / far, compute, graded) of
the model's next-token predictions with the bounded cache, and the KL divergence from
the dense model's next-token distribution on graded tokens. Static-priority policies
run one keep-rule-masked pass; attention heuristics run token by token through the
decode path (the two agree for static policies; see the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import kvjax
from kvjax.data import OTHER, TestbedConfig, batch, category_counts, predictions_from_logits
from kvjax.evaluation.oracle import oracle_priorities
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.eviction.policies import make_policy


def _kl(dense_BSV, sparse_BSV, mask_BS):
    p = jax.nn.log_softmax(dense_BSV, -1)
    q = jax.nn.log_softmax(sparse_BSV, -1)
    kl = jnp.sum(jnp.exp(p) * (p - q), -1)[:, :-1]
    m = mask_BS[:, 1:]
    return float(jnp.sum(kl * m)), float(jnp.sum(m))


def policy_logits(model, tokens, name: str, ev: EvictionConfig | None):
    if name == "dense":
        return kvjax.forward(model, tokens)
    params = oracle_priorities(model, tokens, ev.window) if name == "oracle" else None
    pol = make_policy(name, ev, params=params)
    return sparse_logits(model, tokens, pol) if pol.static else stepwise_logits(model, tokens, pol)


def teacher_forced_quality(model, cfg: TestbedConfig, policies: list[str], ev: EvictionConfig | None,
                           num: int, seq_len: int, batch_size: int = 16, split: str = "test",
                           progress: bool = True) -> dict[str, dict[str, float]]:
    """``{policy: {lookup_near, lookup_far, compute, graded, kl}}`` over ``num`` problems."""
    counts = {p: {} for p in policies}
    kls = {p: [0.0, 0.0] for p in policies}
    bar = tqdm(total=num * len(policies), disable=not progress, desc="teacher-forced", dynamic_ncols=True)
    for start in range(0, num, batch_size):
        b = batch(cfg, split, start, min(batch_size, num - start), seq_len)
        dense = kvjax.forward(model, b["tokens"])
        graded = jnp.asarray(b["category"] != OTHER)
        for name in policies:
            logits = dense if name == "dense" else policy_logits(model, b["tokens"], name, ev)
            pred = predictions_from_logits(np.asarray(logits))
            for k, (c, t) in category_counts(pred, b["tokens"], b["category"]).items():
                acc = counts[name].setdefault(k, [0, 0])
                acc[0] += c
                acc[1] += t
            s, n = _kl(dense, logits, graded)
            kls[name][0] += s
            kls[name][1] += n
            bar.update(len(b["tokens"]))
            g = counts[name]["graded"]
            bar.set_postfix(policy=name, graded=f"{g[0] / max(g[1], 1):.3f}")
    bar.close()
    return {name: {**{k: c / t if t else float("nan") for k, (c, t) in counts[name].items()},
                   "kl": kls[name][0] / max(kls[name][1], 1.0)} for name in policies}


def answer_policy(model, cfg: TestbedConfig, name: str, ev: EvictionConfig | None, num: int, seq_len: int,
                  batch_size: int = 16, split: str = "test", max_new: int = 40) -> float:
    """Answer accuracy under free generation from the ``answer`` word, with the policy's cache."""
    from kvjax.data import EOS_ID, check_answer

    right = 0
    for start in range(0, num, batch_size):
        b = batch(cfg, split, start, min(batch_size, num - start), seq_len)
        prompts = [row[:s].tolist() for row, s in zip(b["tokens"], b["answer_start"])]
        if name == "dense":
            pol = None
        else:
            params = None
            if name == "oracle":
                params = oracle_priorities(model, np.pad(b["tokens"], ((0, 0), (0, max_new))), ev.window)
            pol = make_policy(name, ev, params=params)
        out = np.asarray(kvjax.generate(model, prompts, max_new, policy=pol, eos_token_id=EOS_ID))
        width = out.shape[1] - max_new
        right += sum(check_answer(out[i, width:], int(b["answer"][i])) for i in range(len(prompts)))
    return right / num
