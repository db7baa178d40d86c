"""Long-context quality of every policy on RULER-style problems.

For each length, problems of every task are generated (:mod:`kvjax.longctx.tasks`), batched, and
answered greedily (``max_new`` tokens) by the dense model and by every policy at every
compression; an answer is scored by RULER's string match. The per-head budget is
``sinks + window + topk = round((1 - c) * length)``. With ``prefill: bounded`` (default)
every policy runs *bounded throughout* (KVpop's setting): the budget holds during prefill
and decode, every prompt query sees only its kept set. Static-priority policies get that
from ``kvjax.generate``'s one-pass keep-rule prefill; attention-statistic policies (SnapKV,
H2O, TOVA) feed the prompt token by token through the decode path (``policy.with_prefill("stepwise")``,
slower). With ``prefill: auto`` those three prefill densely and compress once when the
prompt ends (``generate``'s default); each record says which (``prefill``) and the table
marks dense-prefill rows with †. With ``prefill: compressed`` every policy runs in kvpress's
setting (``EvictionConfig.prefill="compressed"``, :mod:`kvjax.eviction.prompt_compressed`): dense
prefill, the context (not the question) compressed once to ``round((1 - c) * n)`` tokens per head,
then nothing is evicted; the dense context pass is memoised once per batch and shared by every
policy and compression (:mod:`kvjax.eviction.shared_prefill`, equal to one pass per policy).
The hindsight oracles rank by the dense model's future attention over its own prompt + answer
(with prefill compression, from the shared context pass: only the question and answer run again).

Records are per problem in a :class:`~kvjax.evaluation.results_store.ResultsStore`
(resumable, scorer digests fingerprinted); :func:`table` averages them with standard errors.
``python -m kvjax.longctx --config configs/longctx-smollm2-quick.yaml``
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvjax.evaluation.policy_rows import ORACLES
from kvjax.eviction.config import kept_slots
from kvjax.longctx.tasks import TASKS

SETTING = {"bounded": "bounded throughout (every prompt query sees only the kept set)",
           "auto": "bounded throughout except † (dense prefill, compressed when the prompt ends)",
           "compressed": "prefill compression (kvpress's setting: dense prefill, the context compressed once, "
                         "the question and answer evict nothing)"}


def dense_prefill(name: str) -> bool:
    """Whether ``generate`` prefills policy ``name`` densely (scores from the prefill's attention)."""
    from kvjax.eviction.policies import REGISTRY

    return name in REGISTRY and not REGISTRY[name].static


@dataclass(frozen=True)
class LongCtxConfig:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    problems: int = 64                      # per task and length
    problems_at: dict[int, int] = field(default_factory=dict)   # per-length override, e.g. {4096: 32}
    compressions: list[float] = field(default_factory=lambda: [0.5, 0.75, 0.88, 0.94])
    policies: list[str] = field(default_factory=lambda: ["dense", "streaming_llm", "random", "knorm", "snapkv",
                                                         "h2o", "tova", "oracle"])
    learned: dict[str, str] = field(default_factory=dict)   # label -> exported scorer folder
    learned_budgets: dict[str, str] = field(default_factory=dict)   # label -> budget rule, e.g. adakv, global
    # rows of a heuristic or oracle under other EvictionConfig fields: label -> {policy, fields},
    # e.g. {knorm_global: {policy: knorm, budgets: global}} (one top-k over all layers and heads)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    sinks: int = 4
    window: int = 32
    obs_window: int = 16                    # SnapKV's observation window (kvpress's window_size: = window)
    pool: int = 7                           # SnapKV's pooling kernel
    question_aware: bool = False            # compress the question with the context (kvpress's question-aware)
    prefill: Literal["bounded", "auto", "compressed"] = "bounded"   # auto: SnapKV/H2O/TOVA prefill densely;
    #                                                 compressed: kvpress's setting (dense prefill, context compressed once)
    max_new: int = 32
    batch_size: int = 8
    batch_at: dict[int, int] = field(default_factory=dict)      # per-length override, e.g. {4096: 4}
    seed: int = 0
    model_dir: str | None = None            # HF folder; default: SmolLM2 via kvjax.real_model
    out_dir: str = "runs/longctx/smollm2"

    def __post_init__(self):
        for name in ("problems_at", "batch_at"):
            object.__setattr__(self, name, {int(k): int(v) for k, v in getattr(self, name).items()})
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"tasks: unknown task {bad[0]!r}; known: {', '.join(TASKS)}")
        for c in self.compressions:
            if not 0.0 < c < 1.0:
                raise ValueError(f"compressions: {c} is not in (0, 1)")
            for n in self.lengths:
                if kept_slots(c, n) <= self.sinks + self.window:
                    raise ValueError(f"compression {c} of {n} tokens leaves {kept_slots(c, n)} slots, "
                                     f"not more than sinks + window = {self.sinks + self.window}")
        for label, rule in self.learned_budgets.items():
            if label not in self.learned:
                raise ValueError(f"learned_budgets: {label!r} is not a label in learned ({', '.join(self.learned)})")
            if rule not in ("uniform", "pyramid", "adakv", "global", "layer"):
                raise ValueError(f"learned_budgets: {label}: rule must be 'uniform', 'pyramid', 'adakv', 'global' "
                                 f"or 'layer', got {rule!r}")
            from kvjax.longctx.checks import check_shared_budget

            check_shared_budget(f"learned_budgets: {label}:", rule, self.prefill)
        if self.prefill not in ("bounded", "auto", "compressed"):
            raise ValueError(f"prefill must be 'bounded', 'auto' or 'compressed', got {self.prefill!r}")
        if self.question_aware and self.prefill != "compressed":
            raise ValueError("question_aware moves the question into the compressed context: it needs "
                             f"prefill: compressed (with prefill: {self.prefill} the whole prompt is under the budget)")
        if min(self.problems, self.batch_size, self.max_new, *self.batch_at.values(), *self.problems_at.values()) < 1:
            raise ValueError("problems, batch_size, max_new and every problems_at / batch_at value must be >= 1")
        if not self.tasks or not self.lengths or not self.compressions:
            raise ValueError("tasks, lengths and compressions each need at least one entry")
        for n in self.lengths:
            if not isinstance(n, int) or n < 256:
                raise ValueError(f"lengths: {n} is too short for a long-context problem (at least 256 tokens)")
        for name in ("lengths", "compressions", "tasks", "policies"):
            seen = getattr(self, name)
            if len(set(seen)) != len(seen):
                raise ValueError(f"{name}: {next(x for x in seen if seen.count(x) > 1)!r} is listed twice")
        for name in ("problems_at", "batch_at"):     # a length not run is fine: --set lengths=[...] narrows a run
            bad = [n for n, v in getattr(self, name).items() if not isinstance(n, int) or n < 256 or v < 1]
            if bad:
                raise ValueError(f"{name}: {{{bad[0]}: {getattr(self, name)[bad[0]]}}} needs a length >= 256 and a "
                                 "count >= 1")
        from kvjax.longctx.checks import check_policy_names, check_variants

        check_variants(self.variants, self.learned, self.prefill)   # a variant unlisted in policies is fine
        check_policy_names([p for p in self.policies if p not in self.variants], self.learned, ORACLES)


def budget(cfg: LongCtxConfig, length: int, compression: float):
    from kvjax.evaluation.budgets import fixed_window_budget

    ev = fixed_window_budget(length, compression, sinks=cfg.sinks, window=cfg.window)
    return dataclasses.replace(ev, obs_window=cfg.obs_window, pool=cfg.pool)



def _answers(new_BN: np.ndarray, stops) -> list[list[int]]:
    """Each row's new tokens up to (not including) its first stop token."""
    out = []
    for row in new_BN:
        hit = np.flatnonzero(np.isin(row, stops))
        out.append(row[: hit[0]].tolist() if hit.size else row.tolist())
    return out


def run_longctx(cfg: LongCtxConfig, *, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Answer every (length, task, problem, compression, policy) not yet stored; returns :func:`table`
    plus ``"records"`` (this config's per-problem records)."""
    import transformers
    from tqdm import tqdm

    import kvjax
    from kvjax.evaluation.oracle import oracle_priorities, prefill_oracle_priorities
    from kvjax.evaluation.policy_rows import build_policy
    from kvjax.evaluation.results_store import ResultsStore, load_learned, record_key
    from kvjax.eviction.prompt_compressed import prompt_compressed
    from kvjax.eviction.shared_prefill import answer as shared_answer
    from kvjax.eviction.shared_prefill import compress, prefill_context, uncompressed
    from kvjax.export import config_hash
    from kvjax.host_memory import release_free_memory
    from kvjax.longctx.checks import check_learned, learned_rule
    from kvjax.longctx.tasks import Generator, prompt_ids, score
    from kvjax.real_model import ensure_model
    from kvjax.sampling import bucket
    from kvjax.text import stop_token_ids

    check_learned(cfg)                  # before the model loads: a wrong folder costs nothing
    folder = Path(cfg.model_dir) if cfg.model_dir else None
    if model is None or tokenizer is None:
        folder = folder or ensure_model()
    model = model or kvjax.load_hf(folder)
    tok = tokenizer or transformers.AutoTokenizer.from_pretrained(folder)
    stops = np.asarray(stop_token_ids(model, tok), np.int32)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and max(cfg.lengths) + cfg.max_new > limit:
        raise ValueError(f"lengths: {max(cfg.lengths)} tokens + max_new {cfg.max_new} exceed the model's "
                         f"max_position_embeddings={limit}")
    learned, digests = load_learned(cfg.learned, model)
    names = list(dict.fromkeys(["dense", *cfg.policies, *learned]))

    def base(name: str) -> str:
        """The registered policy a row runs (a variant's base policy)."""
        return cfg.variants[name]["policy"] if name in cfg.variants else name
    gen = Generator(tok)
    run = {"model": config_hash(model.config), "metric": "longctx-v1", "prefill": cfg.prefill,
           "problems": gen.fingerprint(),
           "seed": cfg.seed, "sinks": cfg.sinks, "window": cfg.window, "obs_window": cfg.obs_window,
           "pool": cfg.pool, "question_aware": cfg.question_aware,
           "max_new": cfg.max_new, "tokenizer": hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]}
    store = ResultsStore(cfg.out_dir, run, policies={
        **{lbl: {**digests[lbl], **learned_rule(cfg.learned_budgets.get(lbl), learned[lbl])} for lbl in cfg.learned},
        **{lbl: {"variant": v} for lbl, v in cfg.variants.items()}})
    try:
        work = []     # batches of (task, index) of one length; tasks mix, so batches stay full
        for length in cfg.lengths:
            n = cfg.problems_at.get(length, cfg.problems)
            items = [(task, i) for i in range(n) for task in cfg.tasks]    # a stopped run: equal N per task
            size = cfg.batch_at.get(length, cfg.batch_size)
            for j in range(0, len(items), size):
                work.append((length, items[j:j + size]))
        per_batch = 1 + (len(names) - 1) * len(cfg.compressions)
        prompts = {(length, task, i): (p, prompt_ids(tok, p, question_aware=cfg.question_aware))
                   for length, items in work for task, i in items
                   for p in [gen.problem(task, length, i, cfg.seed)]}

        def cache_slots(prompt: int) -> int:
            """Cache slots for prompts of ``prompt`` tokens and the answer: one compile per bucket."""
            return bucket(prompt) + bucket(cfg.max_new)

        # padded sizes per length and per (policy, ratio): shared_prefill.at_least. Seeded with each
        # length's longest context, prompt and question, so that no later batch outgrows the first
        # batch's programs (a question padded 8 tokens longer recompiles every policy's answer)
        floors: dict = {}
        longest: dict = {}     # each length's longest context, in tokens
        for (length, _, _), (_, (c, q)) in prompts.items():
            f = floors.setdefault(length, {"context": 0, "cache": 0, "question": 0})
            longest[length] = max(longest.get(length, 0), len(c))
            f["context"] = max(f["context"], bucket(len(c)))
            f["cache"] = max(f["cache"], cache_slots(len(c) + len(q)))
            f["question"] = max(f["question"], bucket(len(q)))

        def row_floor(length: int, comp: float) -> dict:
            """A table row's first padded sizes: the length's longest question, and the kept
            slots a uniform budget gives its longest context (prompt_compressed keeps
            ``round((1 - ratio) * n_b)``; a policy whose heads keep more grows it once)."""
            return {"question": floors[length]["question"],
                    "slots": bucket(max(1, round((1.0 - comp) * longest[length])))}

        bar = tqdm(total=len(work) * per_batch, desc="longctx", unit="batch", disable=not progress)
        for length, items in work:
            probs = [prompts[length, task, i][0] for task, i in items]
            parts = [prompts[length, task, i][1] for task, i in items]
            ids = [c + q for c, q in parts]
            context = [len(c) for c, _ in parts]
            S = max(map(len, ids))
            tokens = np.full((len(ids), S), int(stops[0]), np.int32)
            mask = np.zeros_like(tokens)
            for b, r in enumerate(ids):
                tokens[b, : len(r)], mask[b, : len(r)] = r, 1
            dense_new, oracles, shared = None, {}, {}      # the last batch's prefill and oracles are freed

            def stepwise(policy) -> bool:
                """Bounded throughout, attention statistics feed the prompt token by token."""
                return policy is not None and not policy.static and cfg.prefill == "bounded"

            def run_policy(policy, row=("dense", 0.0)) -> np.ndarray:
                """New tokens ``[B, max_new]`` of ``policy`` (None: dense) on this batch. Prefill
                compression shares one dense context pass among all policies (shared_prefill);
                the padded shapes of each length and each table ``row`` (policy, ratio) only grow
                from batch to batch (``floors``), so the first batch's programs serve the rest."""
                if cfg.prefill == "compressed":
                    if "pre" not in shared:
                        shared["pre"] = prefill_context(model, [c for c, _ in parts], pad_id=int(stops[0]),
                                                        cache_len=cache_slots(S),
                                                        keep_queries=any(dense_prefill(base(n)) or base(n) in ORACLES
                                                                         for n in names),
                                                        floor=floors.setdefault(length, {}))
                    cache = uncompressed(shared["pre"]) if policy is None else compress(policy, model, shared["pre"],
                                                                                     memo=shared.setdefault("prio", {}))
                    return shared_answer(model, cache, [q for _, q in parts], context, cfg.max_new,
                                         eos_ids=stops.tolist(), pad_id=int(stops[0]),
                                         floor=floors.setdefault((length, row), row_floor(length, row[1])))
                if stepwise(policy):
                    policy = policy.with_prefill("stepwise")
                return np.asarray(kvjax.generate(model, tokens, cfg.max_new, policy=policy, attention_mask=mask,
                                                 eos_token_id=stops.tolist()))[:, S:]

            def answer(make_policy_, name, comp):
                """``make_policy_()`` builds the policy only when some record is missing."""
                nonlocal dense_new
                keys = [record_key(length, comp, name, f"{p.task}/{p.index}") for p in probs]
                bar.update(1)
                if store.has(keys):
                    return
                policy = make_policy_()
                if policy is not None and cfg.prefill == "compressed":
                    policy = prompt_compressed(policy, comp, context)
                t0 = time.time()
                out = run_policy(policy, (name, comp))
                sec = (time.time() - t0) / len(probs)
                if name == "dense":
                    dense_new = out
                prefill = ("dense" if policy is None else "compressed" if cfg.prefill == "compressed"
                           else "bounded" if policy.static or stepwise(policy) else "dense")
                store.add([{"key": k, "task": p.task, "index": p.index, "length": length, "tokens": len(r),
                            "depth": p.depth, "compression": comp, "policy": name, "prefill": prefill,
                            "score": score(p, tok.decode(a, skip_special_tokens=True)),
                            "answer": tok.decode(a, skip_special_tokens=True)[:160], "seconds": round(sec, 2)}
                           for k, p, r, a in zip(keys, probs, ids, _answers(out, stops))])
                release_free_memory()   # freed buffers' pages back to the system (glibc keeps them: host_memory)

            def oracle(kind):
                nonlocal dense_new
                if kind not in oracles:
                    if dense_new is None:      # resumed: the dense answers again (greedy, the same tokens)
                        dense_new = run_policy(None)
                    new = _answers(dense_new, stops)
                    if cfg.prefill == "compressed":     # the shared prefill's context; the tail runs again
                        tails = [q + a for (_, q), a in zip(parts, new)]
                        oracles[kind] = prefill_oracle_priorities(model, shared["pre"], tails, cfg.window, kind)
                    else:
                        full = [r + a for r, a in zip(ids, new)]
                        T = cache_slots(S)        # generate's shapes
                        seq = np.full((len(full), T), int(stops[0]), np.int32)
                        for b, r in enumerate(full):
                            seq[b, : len(r)] = r
                        oracles[kind] = oracle_priorities(model, seq, cfg.window, kind,
                                                          lengths_B=np.asarray([len(r) for r in full], np.int32))
                return oracles[kind]

            answer(lambda: None, "dense", 0.0)
            for comp in cfg.compressions:
                ev = budget(cfg, length, comp)
                for name in names[1:]:
                    make = functools.partial(build_policy, name, ev, learned, context=length, oracle=oracle,
                                             variants=cfg.variants,
                                             learned_budgets=cfg.learned_budgets.get(name, "uniform"))
                    answer(make, name, comp)
        bar.close()
        wanted = {record_key(length, 0.0 if name == "dense" else comp, name, f"{task}/{i}")
                  for length, items in work for task, i in items for name in names
                  for comp in ([0.0] if name == "dense" else cfg.compressions)}
        # this config's records only (a folder may also hold other compressions or more problems)
        mine = [r for k, r in store.records.items() if k in wanted]
        return {**table(mine, names, cfg), "records": mine}
    finally:
        store.close()


def export_problems(cfg: LongCtxConfig, path, tokenizer) -> int:
    """Write this config's problems, tokenized exactly as the runner feeds them, as JSONL
    ``{"id", "task", "length", "depth", "context_ids", "question_ids", "answers", "metric"}``
    (for ``experiments/kvpress_compare.py``: the same token ids, compressed at the context's end).
    Returns the number written."""
    import json

    from kvjax.longctx.tasks import Generator, prompt_ids

    gen = Generator(tokenizer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w") as f:
        for length in cfg.lengths:
            for task in cfg.tasks:
                for i in range(cfg.problems_at.get(length, cfg.problems)):
                    p = gen.problem(task, length, i, cfg.seed)
                    ctx, q = prompt_ids(tokenizer, p, question_aware=cfg.question_aware)
                    f.write(json.dumps({"id": f"{length}/{task}/{i}", "task": task, "length": length,
                                        "depth": p.depth, "context_ids": ctx, "question_ids": q,
                                        "answers": list(p.answers), "metric": p.metric}) + "\n")
                    n += 1
    tmp.replace(path)                   # whole file or none
    return n


def _mean_se(x) -> tuple[float, float]:
    x = np.asarray(x, float)
    return float(x.mean()), (float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan"))


def table(records: list[dict], names, cfg: LongCtxConfig, solvable: float = 0.5) -> dict:
    """``{"cells": {(length, comp, policy, task): (mean, se, n)}, "average": {(length, comp, policy): (mean,
    se, tasks)}, "solvable": {length: [tasks]}}``. The task average covers the tasks the dense
    model solves (score >= ``solvable``) at that length; its SE combines the tasks' SEs."""
    cells: dict = {}
    groups: dict = {}
    for r in records:
        comp = 0.0 if r["policy"] == "dense" else r["compression"]
        groups.setdefault((r["length"], comp, r["policy"], r["task"]), []).append(r["score"])
    for key, v in groups.items():
        m, se = _mean_se(v)
        cells[key] = (m, se, len(v))
    solv = {L: [t for t in cfg.tasks if cells.get((L, 0.0, "dense", t), (0.0,))[0] >= solvable] for L in cfg.lengths}
    avg = {}
    for L in cfg.lengths:
        for comp in [0.0, *cfg.compressions]:
            for p in names:
                got = [cells[(L, comp, p, t)] for t in solv[L] if (L, comp, p, t) in cells]
                if got and len(got) == len(solv[L]):
                    se = math.sqrt(sum(c[1] ** 2 for c in got)) / len(got)     # NaN if a task has one problem
                    avg[(L, comp, p)] = (float(np.mean([c[0] for c in got])), se, len(got))
    return {"cells": cells, "average": avg, "solvable": solv}


def to_json(tab: dict) -> dict:
    """:func:`table` with string keys ``length|compression|policy[|task]``."""
    key = lambda k: "|".join(f"{x:g}" if isinstance(x, float) else str(x) for x in k)   # noqa: E731
    return {"cells": {key(k): list(v) for k, v in tab["cells"].items()},
            "average": {key(k): list(v) for k, v in tab["average"].items()},
            "solvable": {str(k): v for k, v in tab["solvable"].items()}}
