"""Which of a needle's tokens each policy still holds when the prompt ends, bounded throughout.

    python bench/needle_kept_share.py [--tasks niah_noise niah_text] [--problems 8] [--length 1024]
        [--compression 0.75] [--learned kvpop_mlp=assets/smollm2-scorers/kvpop-mlp-mean ...]

For every RULER-style needle problem (``kvjax.longctx.tasks``) the prompt (context + question)
is prefilled through each policy's bounded cache (4 sinks + 32 window + the rest of the budget,
the long-context runs' budget); for each token of the asked value (``161688`` is six tokens on
SmolLM2) it prints the share of (layer, KV head) pairs whose kept set holds that token,
averaged over the problems. A head that lost a digit cannot copy it; the share at the base
rate (the budget over the prompt length) means the policy does not tell the needle from the
haystack.
"""

from __future__ import annotations

import argparse

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
    args = ap.parse_args(argv)

    import transformers

    import kvjax
    from kvjax.evaluation.budgets import fixed_window_budget, rebudget
    from kvjax.evaluation.retention import kept_positions, positions_to_mask
    from kvjax.eviction.policies import make_policy
    from kvjax.longctx.tasks import Generator, prompt_ids
    from kvjax.real_model import ensure_model

    folder = ensure_model()
    model = kvjax.load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    gen = Generator(tok)
    rows, spans = [], []
    for task in args.tasks:
        for i in range(args.problems):
            p = gen.problem(task, args.length, i)
            ctx, q = prompt_ids(tok, p)
            rows.append(ctx + q)
            spans.append(value_span(tok, ctx, p.answers[0]))
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ev = fixed_window_budget(args.length, args.compression, sinks=4, window=32)
    policies = {name: make_policy(name, ev) for name in args.policies}
    for item in args.learned:
        label, _, path = item.partition("=")
        policies[label] = rebudget(kvjax.load_scorers(path, model=model), ev)
    base = (ev.sinks + ev.window + ev.topk) / lengths.mean()
    print(f"{len(rows)} problems ({', '.join(args.tasks)}), {args.length} tokens, {args.compression:.0%} compression: "
          f"{ev.sinks + ev.window + ev.topk} slots a head, base rate {base:.2f}")
    print("share of (layer, KV head) pairs holding each token of the value, in order:")
    for name, pol in policies.items():
        every, _ = kept_positions(model, tokens, lengths, pol)           # [L, B, K, slots]
        held = positions_to_mask(every, tokens.shape[1])                  # [L, B, K, S]
        shares = [held[:, b, :, s:e].mean((0, 1)) for b, (s, e) in enumerate(spans)]
        n = max(map(len, shares))
        by_token = [np.mean([sh[j] for sh in shares if j < len(sh)]) for j in range(n)]
        print(f"  {name:<16}" + " ".join(f"{x:.2f}" for x in by_token), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
