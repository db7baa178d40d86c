"""Which of a needle's tokens each policy still holds when the prompt ends.

    python experiments/needle_kept_share.py [--tasks niah_noise niah_text] [--problems 8] [--length 1024]
        [--compression 0.75] [--learned kvpop_mlp=assets/smollm2-scorers/kvpop-mlp-mean ...]
        [--prefill bounded|compressed] [--question-aware] [--obs-window 32] [--pool 7]
        [--retrieval-heads 20] [--duo assets/smollm2-duo]

For every RULER-style needle problem (``kvjax.longctx.tasks``) the prompt (context + question)
is prefilled through each policy's bounded cache (4 sinks + 32 window + the rest of the budget,
the long-context runs' budget); for each token of the asked value (``161688`` is six tokens on
SmolLM2) it prints the share of (layer, KV head) pairs whose kept set holds that token,
averaged over the problems. A head that lost a digit cannot copy it; the share at the base
rate (the budget over the prompt length) means the policy does not tell the needle from the
haystack.

``--prefill compressed`` measures kvpress's setting instead (the long-context table's): one dense
pass over each context, then each policy's one-time selection of the context
(:mod:`kvjax.eviction.shared_prefill`); ``--question-aware`` compresses the question with the
context, so SnapKV's observation window and TOVA's last query are the question's. ``--pool``
and ``--obs-window`` set SnapKV's pooling kernel (odd; 1 = no pooling) and observation window
(defaults as in the long-context table: 7 and 32). ``--retrieval-heads R`` adds a second row per
policy over only the ``R`` (layer, KV head) pairs with the largest DuoAttention gates
(``--duo``, trained on passkey retrieval): the heads that copy a needle, whose kept set decides
the answer.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

DEFAULT_LEARNED = ["kvpop_mlp=assets/smollm2-scorers/kvpop-mlp-mean",
                   "kvpop_mlstm=assets/smollm2-scorers/kvpop-mlstm-mean"]


def value_span(tok, context_ids: list[int], value: str) -> tuple[int, int]:
    """``[start, end)`` of the last occurrence of ``value`` in the context's tokens."""
    starts = [s for s in range(len(context_ids)) if tok.decode(context_ids[s:s + 16]).lstrip(' "').startswith(value)]
    if not starts:
        raise ValueError(f"value {value!r} not found in the context")
    s = e = starts[-1]
    while value not in tok.decode(context_ids[s:e]):
        e += 1
    return s, e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=["niah_noise", "niah_text"])
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--compression", type=float, default=0.75)
    ap.add_argument("--policies", nargs="+", default=["knorm", "streaming_llm"])
    ap.add_argument("--learned", nargs="*", default=DEFAULT_LEARNED, help="label=exported scorer folder")
    ap.add_argument("--prefill", choices=["bounded", "compressed"], default="bounded")
    ap.add_argument("--question-aware", action="store_true", help="compress the question with the context")
    ap.add_argument("--pool", type=int, default=7, help="SnapKV's pooling kernel")
    ap.add_argument("--obs-window", type=int, default=32, help="SnapKV's observation window")
    ap.add_argument("--retrieval-heads", type=int, default=0,
                    help="also the share over the R heads of largest DuoAttention gate (0: off)")
    ap.add_argument("--duo", default="assets/smollm2-duo", help="exported DuoAttention gates")
    args = ap.parse_args(argv)
    if args.question_aware and args.prefill != "compressed":
        ap.error("--question-aware needs --prefill compressed")

    import transformers

    import kvjax
    from kvjax.evaluation.budgets import fixed_window_budget
    from kvjax.evaluation.retention import kept_positions, positions_to_mask
    from kvjax.eviction.policies import make_policy
    from kvjax.eviction.prompt_compressed import prompt_compressed
    from kvjax.eviction.shared_prefill import compress, prefill_context
    from kvjax.longctx.tasks import Generator, prompt_ids
    from kvjax.real_model import ensure_model
    from kvjax.sampling import bucket

    folder = ensure_model()
    model = kvjax.load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    gen = Generator(tok)
    rows, contexts, spans = [], [], []
    for task in args.tasks:
        for i in range(args.problems):
            p = gen.problem(task, args.length, i)
            ctx, q = prompt_ids(tok, p, question_aware=args.question_aware)
            rows.append(ctx + q)
            contexts.append(ctx)
            spans.append(value_span(tok, ctx, p.answers[0]))
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ev = dataclasses.replace(fixed_window_budget(args.length, args.compression, sinks=4, window=32),
                             obs_window=args.obs_window, pool=args.pool)
    policies = {name: make_policy(name, ev) for name in args.policies}
    for item in args.learned:
        label, _, path = item.partition("=")
        policies[label] = kvjax.load_scorers(path, model=model).at_budget(ev)
    if args.prefill == "compressed":
        pre = prefill_context(model, contexts, cache_len=bucket(max(map(len, rows))), keep_queries=True)
        base = 1.0 - args.compression
        setting = "prefill compression" + (", question-aware" if args.question_aware else "")
        print(f"{len(rows)} problems ({', '.join(args.tasks)}), {args.length} tokens, {args.compression:.0%} "
              f"compression, {setting}: base rate {base:.2f}; SnapKV window {args.obs_window}, pool {args.pool}")
    else:
        base = (ev.sinks + ev.window + ev.topk) / lengths.mean()
        print(f"{len(rows)} problems ({', '.join(args.tasks)}), {args.length} tokens, {args.compression:.0%} "
              f"compression: {ev.sinks + ev.window + ev.topk} slots a head, base rate {base:.2f}")
    print("share of (layer, KV head) pairs holding each token of the value, in order:")
    top = None
    if args.retrieval_heads:
        gates = np.asarray(kvjax.load_scorers(args.duo, model=model).params["gates"])     # [L, K]
        top = np.zeros(gates.size, bool)
        top[np.argsort(-gates.reshape(-1), kind="stable")[:args.retrieval_heads]] = True
        top = top.reshape(gates.shape)
        print(f"(second row: the {args.retrieval_heads} heads of largest DuoAttention gate, "
              f"layers {sorted(set(np.nonzero(top)[0].tolist()))})")
    for name, pol in policies.items():
        if args.prefill == "compressed":
            cache = compress(prompt_compressed(pol, args.compression, [len(c) for c in contexts]), model, pre)
            held = np.stack([np.asarray(k) for k in cache.keep])          # [L, B, K, T]
        else:
            every, _ = kept_positions(model, tokens, lengths, pol)           # [L, B, K, slots]
            held = positions_to_mask(every, tokens.shape[1])                  # [L, B, K, S]
        for label, heads in [(name, np.ones(held.shape[0:1] + held.shape[2:3], bool)),
                             *([("  retrieval", top)] if top is not None else [])]:
            shares = [held[:, b, :, s:e][heads].mean(0) for b, (s, e) in enumerate(spans)]
            n = max(map(len, shares))
            by_token = [np.mean([sh[j] for sh in shares if j < len(sh)]) for j in range(n)]
            print(f"  {label:<16}" + " ".join(f"{x:.2f}" for x in by_token), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
