"""Quality of eviction policies on testbed problems, one batch of problems at a time.

For a batch and every policy: per-category token accuracy (lookup near / far, compute,
graded) of teacher-forced next-token predictions with the bounded cache; the KL divergence
from the dense model's next-token distribution on graded tokens; answer accuracy under
free generation (prompted up to the word ``answer``, the policy's cache throughout); and
per-head retention recall against the oracle's top-k at the moment the answer starts.
Static-priority policies run one keep-rule-masked pass; attention heuristics run token by
token through the decode path (the two agree for static policies; see the tests).
Results are per problem, so a caller can store them as they complete.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.data import EOS_ID, category_counts, check_answer, predictions_from_logits
from kvjax.data.metrics import POOLED_IDS
from kvjax.evaluation.oracle import oracle_priorities
from kvjax.evaluation.retention import kept_positions, retention_recall
from kvjax.eviction.config import EvictionConfig
from kvjax.eviction.forced import sparse_logits, stepwise_logits
from kvjax.evaluation import policy_rows
from kvjax.eviction.policies import make_policy
from kvjax.generate import forward, generate

ANSWER_MAX_NEW = 32   # the longest answer line (4 terms) is 21 tokens


def _kl_rows(dense_BSV, sparse_BSV, mask_BS) -> tuple[np.ndarray, np.ndarray]:
    """Per row: summed KL(dense || policy) over graded next-token targets, and their count."""
    p = jax.nn.log_softmax(dense_BSV, -1)
    q = jax.nn.log_softmax(sparse_BSV, -1)
    kl = jnp.sum(jnp.exp(p) * (p - q), -1)[:, :-1]
    m = mask_BS[:, 1:]
    return np.asarray(jnp.sum(kl * m, 1)), np.asarray(jnp.sum(m, 1))


# policy name -> oracle_priorities kind ("values": the testbed's structure, not the model's attention)
ORACLES = {**policy_rows.ORACLES, "oracle_values": "values"}   # the testbed also knows where values are


def value_priorities(tokens_BS, num_layers: int, num_kv_heads: int, room: int) -> np.ndarray:
    """``float32 [L, B, K, S + room]``: every fact value (a number right after a name: definitions,
    bindings, lookups) above every other token, each group most recent first: "keep all values"."""
    from kvjax.data.vocab import MAX_NAMES, NAME_BASE

    tokens = np.asarray(tokens_BS)
    B, S = tokens.shape
    after_name = np.zeros((B, S + room), bool)
    after_name[:, 1:S] = (tokens[:, :-1] >= NAME_BASE) & (tokens[:, :-1] < NAME_BASE + MAX_NAMES)
    t = np.arange(S + room, dtype=np.float32) / (S + room)
    pri = np.where(after_name, 1.0 + t, t).astype(np.float32)
    return np.broadcast_to(pri[None, :, None, :], (num_layers, B, num_kv_heads, S + room)).copy()


class BatchContext:
    """Per-batch quantities every policy shares: dense logits, oracle priorities (over the
    full trace plus the generated answer's room) and the oracle's kept set at the answer."""

    def __init__(self, model, batch: dict, ev: EvictionConfig | None):
        self.model, self.b, self.ev = model, batch, ev
        self.tokens = batch["tokens"]
        self.dense = forward(model, self.tokens)
        self.graded = jnp.asarray(np.isin(batch["category"], POOLED_IDS))     # the KL's positions
        self.prompts_len = batch["answer_start"]
        self._oracle: dict[str, jax.Array] = {}
        self._oracle_lr = None

    def oracle_params(self, kind: str = "mean"):
        """Hindsight priorities ``[L, B, K, S + room]`` of ``kind`` (``mean``: KVpop's target)."""
        if kind not in self._oracle:
            c = self.model.config
            if kind == "values":
                self._oracle[kind] = jnp.asarray(value_priorities(self.tokens, c.num_layers, c.num_kv_heads,
                                                                  ANSWER_MAX_NEW))
            else:
                padded = np.pad(self.tokens, ((0, 0), (0, ANSWER_MAX_NEW)))
                self._oracle[kind] = oracle_priorities(self.model, padded, self.ev.window, kind)
        return self._oracle[kind]

    def oracle_long_range(self):
        if self._oracle_lr is None:
            pol = make_policy("oracle", self.ev, params=self.oracle_params())
            _, self._oracle_lr = kept_positions(self.model, self.tokens, self.prompts_len, pol)
        return self._oracle_lr


def evaluate_policy(ctx: BatchContext, name: str, learned: dict, answers: bool = True,
                    recall: bool = True, students: dict | None = None, path_check: bool = False,
                    variants: dict | None = None) -> list[dict]:
    """Per-problem results of policy ``name`` on the batch: category counts, KL to the dense
    teacher, answer, retention recall ``[L][K]`` and the kept positions ``[L][K][slots]``.
    A learned policy runs on its distilled student (``students[name]``) when given.
    ``path_check`` (static policies): also run the trace token by token through the decode
    path and record, per problem, the largest logit difference from the one-pass sparse
    path and the fraction of positions whose argmax agrees (``path_check: [diff, agree]``)."""
    model, b = (students or {}).get(name, ctx.model), ctx.b
    pol = policy_rows.build_policy(name, ctx.ev, learned, context=ctx.tokens.shape[1] + ANSWER_MAX_NEW,
                                   oracle=ctx.oracle_params, oracles=ORACLES, variants=variants)
    if pol is None:
        logits = ctx.dense
    else:
        logits = sparse_logits(model, ctx.tokens, pol) if pol.static else stepwise_logits(model, ctx.tokens, pol)
    pred = predictions_from_logits(np.asarray(logits))
    check = [None] * len(ctx.tokens)
    if path_check and pol is not None and pol.static:
        check = _path_check(logits, stepwise_logits(model, ctx.tokens, pol), ctx.b["length"])
    kl_sum, kl_n = _kl_rows(ctx.dense, logits, ctx.graded)
    n = len(ctx.tokens)
    right = [None] * n
    if answers:
        prompts = [row[:s].tolist() for row, s in zip(ctx.tokens, ctx.prompts_len)]
        out = np.asarray(generate(model, prompts, ANSWER_MAX_NEW, policy=pol, eos_token_id=EOS_ID))
        width = out.shape[1] - ANSWER_MAX_NEW
        right = [bool(check_answer(out[i, width:], int(b["answer"][i]))) for i in range(n)]
    rec, kept = [None] * n, [None] * n
    if recall and pol is not None:
        every, _ = kept_positions(model, ctx.tokens, ctx.prompts_len, pol)
        r = retention_recall(every, ctx.oracle_long_range(), ctx.tokens.shape[1])   # [L, B, K]
        rec = [np.where(np.isnan(r[:, i]), -1.0, r[:, i]).round(6).tolist() for i in range(n)]
        kept = [every[:, i].tolist() for i in range(n)]
    results = []
    for i in range(n):
        counts = category_counts(pred[i : i + 1], ctx.tokens[i : i + 1], b["category"][i : i + 1],
                                 b["answer_start"][i : i + 1])
        results.append({"counts": {k: list(v) for k, v in counts.items()}, "kl": [float(kl_sum[i]), float(kl_n[i])],
                        "answer": right[i], "recall": rec[i], "kept": kept[i]}
                       | ({"path_check": check[i]} if check[i] is not None else {}))
    return results


def _path_check(sparse_BSV, decode_BSV, length_B) -> list[list[float]]:
    """Per row, over its real tokens: ``[max |sparse - decode| logit, argmax agreement]``."""
    sparse, decode = np.asarray(sparse_BSV, np.float32), np.asarray(decode_BSV, np.float32)
    out = []
    for i, n in enumerate(np.asarray(length_B)):
        diff = float(np.abs(sparse[i, :n] - decode[i, :n]).max())
        agree = float((sparse[i, :n].argmax(-1) == decode[i, :n].argmax(-1)).mean())
        out.append([round(diff, 6), round(agree, 6)])
    return out


def aggregate(records: list[dict]) -> dict:
    """Pooled metrics of a policy's per-problem records."""
    out: dict = {"problems": len(records)}
    names = records[0]["counts"].keys() if records else ()
    for k in names:
        c = sum(r["counts"][k][0] for r in records)
        t = sum(r["counts"][k][1] for r in records)
        out[k] = c / t if t else float("nan")
    out["kl"] = sum(r["kl"][0] for r in records) / max(sum(r["kl"][1] for r in records), 1.0)
    answered = [r["answer"] for r in records if r["answer"] is not None]
    if answered:
        out["answer"] = float(np.mean(answered))
        out["answer_se"] = float(np.std(answered, ddof=1) / np.sqrt(len(answered))) if len(answered) > 1 else float("nan")
    checks = [r["path_check"] for r in records if r.get("path_check") is not None]
    if checks:
        out["decode_diff"] = max(c[0] for c in checks)
        out["decode_agree"] = float(np.mean([c[1] for c in checks]))
    recalls = [np.asarray(r["recall"], np.float64) for r in records if r.get("recall") is not None]
    if recalls:
        stack = np.where(np.stack(recalls) < 0, np.nan, np.stack(recalls))   # [P, L, K]
        with np.errstate(invalid="ignore"):
            per_head = np.nanmean(stack, axis=0)
        out["recall_per_head"] = np.where(np.isnan(per_head), -1.0, per_head).round(4).tolist()
        out["recall"] = float(np.nanmean(stack))
    return out


def dense_quality(model, cfg, num: int, seq_len: int, batch_size: int = 32, split: str = "valid",
                  answer_num: int | None = None) -> dict:
    """The dense model's pooled token accuracies on ``num`` problems and its answer accuracy
    on the first ``answer_num`` of them (default all): the trainer's held-out evaluation."""
    from kvjax.data import batch as make_batch

    answer_num = num if answer_num is None else answer_num
    records = []
    for start in range(0, num, batch_size):
        b = make_batch(cfg, split, start, min(batch_size, num - start), seq_len)
        ctx = BatchContext(model, b, None)
        res = evaluate_policy(ctx, "dense", {}, answers=start < answer_num, recall=False)
        records += res
    out = aggregate(records)
    answered = [r["answer"] for r in records[:answer_num] if r["answer"] is not None]
    out["answer"] = float(np.mean(answered)) if answered else float("nan")
    out.pop("kl", None)
    out.pop("problems", None)
    return out
