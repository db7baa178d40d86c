"""The long-context runner: records equal a direct generate + score, the run resumes, oracles
work on ragged rows, the table's averages and standard errors are right, bad configs are named."""

import dataclasses
import json

import numpy as np
import pytest
import transformers
from flax import nnx

import kvjax
from kvjax.evaluation.results_store import read_records
from kvjax.evaluation.oracle import oracle_priorities
from kvjax.longctx.report import markdown
from kvjax.longctx.run import LongCtxConfig, budget, run_longctx, table, to_json
from kvjax.longctx.tasks import Generator, prompt_ids, score
from kvjax.real_model import ensure_model
from kvjax.text import stop_token_ids


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(ensure_model())


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig("llama", 49152, 32, 64, 2, 4, 2, 16, max_position_embeddings=1024, eos_token_id=2)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


def test_records_equal_a_direct_run_and_resume(model, tok, tmp_path):
    cfg = LongCtxConfig(tasks=["niah_noise", "qa"], lengths=[256], problems=3, compressions=[0.5],
                        policies=["streaming_llm", "oracle", "tova"], sinks=2, window=8, max_new=6, batch_size=2,
                        out_dir=str(tmp_path / "out"))
    tab = run_longctx(cfg, model=model, tokenizer=tok, progress=False)
    recs = read_records(tmp_path / "out")
    assert len(recs) == 2 * 3 * 4                        # tasks x problems x (dense, streaming, oracle, tova)
    # problem qa/2 (batched with qa/1: batches mix tasks, 6 problems in 3 batches of 2): rerun it alone
    p = Generator(tok).problem("qa", 256, 2)
    ids = sum(prompt_ids(tok, p), [])
    stops = list(stop_token_ids(model, tok))
    out = np.asarray(kvjax.generate(model, [ids], 6, policy=kvjax.make_policy("streaming_llm", budget(cfg, 256, 0.5)),
                                    eos_token_id=stops))[0, len(ids):]
    cut = [t for t in out.tolist()]
    cut = cut[: next((i for i, t in enumerate(cut) if t in stops), len(cut))]
    r = next(r for r in recs if r["task"] == "qa" and r["index"] == 2 and r["policy"] == "streaming_llm")
    assert r["answer"] == tok.decode(cut, skip_special_tokens=True)[:160]
    assert r["score"] == score(p, tok.decode(cut, skip_special_tokens=True)) and r["tokens"] == len(ids)
    assert {r["policy"] for r in recs} == {"dense", "streaming_llm", "oracle", "tova"}
    assert {r["prefill"] for r in recs if r["policy"] != "dense"} == {"bounded"}
    # TOVA ran bounded throughout: its prompt went token by token through the decode path
    tova = kvjax.make_policy("tova", budget(cfg, 256, 0.5))
    out = np.asarray(kvjax.generate(model, [ids], 6, policy=tova.with_prefill("stepwise"),
                                    eos_token_id=stops))[0, len(ids):]
    cut = out.tolist()[: next((i for i, t in enumerate(out.tolist()) if t in stops), len(out))]
    r = next(r for r in recs if r["task"] == "qa" and r["index"] == 2 and r["policy"] == "tova")
    assert r["answer"] == tok.decode(cut, skip_special_tokens=True)[:160]
    before = (tmp_path / "out" / "problems.jsonl.gz").read_bytes()
    again = run_longctx(cfg, model=model, tokenizer=tok, progress=False)     # all stored: nothing recomputed
    assert (tmp_path / "out" / "problems.jsonl.gz").read_bytes() == before and again == tab
    assert "| streaming_llm [3] |" in markdown(tab, cfg, ["dense", "streaming_llm", "oracle", "tova"])
    fewer = dataclasses.replace(cfg, problems=2)      # a smaller config on the same folder: its records only
    small = run_longctx(fewer, model=model, tokenizer=tok, progress=False)
    assert (tmp_path / "out" / "problems.jsonl.gz").read_bytes() == before
    assert {v[2] for v in small["cells"].values()} == {2}
    json.dumps(to_json(tab))


def test_prefill_compressed_records_equal_a_direct_run(model, tok, tmp_path):
    """``prefill: compressed``: each policy ranks only the context, the question evicts nothing;
    the oracle (from the shared prefill) equals one computed on the whole row."""
    from kvjax.eviction.prompt_compressed import prompt_compressed
    from kvjax.sampling import bucket

    cfg = LongCtxConfig(tasks=["niah_noise"], lengths=[256], problems=2, compressions=[0.75],
                        policies=["snapkv", "knorm", "adakv", "oracle"], sinks=2, window=8, max_new=6, batch_size=2,
                        prefill="compressed", out_dir=str(tmp_path / "out"))
    tab = run_longctx(cfg, model=model, tokenizer=tok, progress=False)
    recs = read_records(tmp_path / "out")
    assert {r["prefill"] for r in recs if r["policy"] != "dense"} == {"compressed"}
    p = Generator(tok).problem("niah_noise", 256, 1)
    ctx, q = prompt_ids(tok, p)
    stops = list(stop_token_ids(model, tok))
    snap = prompt_compressed(kvjax.make_policy("snapkv", budget(cfg, 256, 0.75)), 0.75, [len(ctx)])
    out = np.asarray(kvjax.generate(model, [ctx + q], 6, policy=snap, eos_token_id=stops))[0, len(ctx + q):].tolist()
    cut = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    r = next(r for r in recs if r["index"] == 1 and r["policy"] == "snapkv")
    assert r["answer"] == tok.decode(cut, skip_special_tokens=True)[:160]
    assert "prefill compression" in markdown(tab, cfg, ["dense", "snapkv", "knorm", "adakv", "oracle"])
    ada = prompt_compressed(kvjax.make_policy("adakv", budget(cfg, 256, 0.75)), 0.75, [len(ctx)])
    out = np.asarray(kvjax.generate(model, [ctx + q], 6, policy=ada, eos_token_id=stops))[0, len(ctx + q):].tolist()
    cut = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    r = next(r for r in recs if r["index"] == 1 and r["policy"] == "adakv")
    assert r["answer"] == tok.decode(cut, skip_special_tokens=True)[:160]
    out = np.asarray(kvjax.generate(model, [ctx + q], 6, eos_token_id=stops))[0, len(ctx + q):].tolist()
    full = ctx + q + out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    seq = np.zeros((1, bucket(len(ctx + q)) + bucket(6)), np.int32)
    seq[0, :len(full)] = full
    prio = oracle_priorities(model, seq, cfg.window, "mean", lengths_B=np.asarray([len(full)], np.int32))
    orc = prompt_compressed(kvjax.make_policy("oracle", budget(cfg, 256, 0.75), params=prio), 0.75, [len(ctx)])
    out = np.asarray(kvjax.generate(model, [ctx + q], 6, policy=orc, eos_token_id=stops))[0, len(ctx + q):].tolist()
    cut = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    r = next(r for r in recs if r["index"] == 1 and r["policy"] == "oracle")
    assert r["answer"] == tok.decode(cut, skip_special_tokens=True)[:160]
    with pytest.raises(ValueError, match="prefill must be 'bounded', 'auto' or 'compressed'"):
        LongCtxConfig(prefill="dense")


def test_an_oracle_beside_static_rankers_keeps_the_prefills_queries(model, tok, tmp_path):
    """No attention statistic in the config: the shared prefill still keeps its queries and
    log-sum-exps, which the oracle reads (else: "keep_queries=True")."""
    cfg = LongCtxConfig(tasks=["niah_noise"], lengths=[256], problems=1, compressions=[0.75],
                        policies=["knorm", "oracle"], sinks=2, window=8, max_new=4, batch_size=1,
                        prefill="compressed", out_dir=str(tmp_path / "out"))
    run_longctx(cfg, model=model, tokenizer=tok, progress=False)
    recs = read_records(tmp_path / "out")
    assert sorted(r["policy"] for r in recs) == ["dense", "knorm", "oracle"]


def test_oracle_priorities_of_a_padded_row_equal_the_unpadded_row(model):
    rs = np.random.RandomState(0)
    a = rs.randint(0, 49152, (1, 40)).astype(np.int32)
    padded = np.concatenate([a, np.full((1, 24), 2, np.int32)], 1)
    both = np.concatenate([padded, rs.randint(0, 49152, (1, 64)).astype(np.int32)], 0)
    want = np.asarray(oracle_priorities(model, a, 8))                              # [L, 1, K, 40]
    got = np.asarray(oracle_priorities(model, both, 8, lengths_B=np.asarray([40, 64])))[:, :1, :, :40]
    fin = np.isfinite(want) & (want > -1e5)
    np.testing.assert_allclose(got[fin], want[fin], atol=2e-4)
    np.testing.assert_array_equal(fin, np.isfinite(got) & (got > -1e5))


def test_table_averages_solvable_tasks_with_combined_se():
    cfg = LongCtxConfig(tasks=["niah_noise", "vt"], lengths=[1024], compressions=[0.75], policies=["dense", "knorm"])
    recs = []
    for i, (d, k, v) in enumerate([(1, 1, 0), (1, 0, 0), (1, 1, 0), (1, 1, 0)]):
        recs += [{"length": 1024, "compression": 0.0, "policy": "dense", "task": "niah_noise", "score": d},
                 {"length": 1024, "compression": 0.75, "policy": "knorm", "task": "niah_noise", "score": k},
                 {"length": 1024, "compression": 0.0, "policy": "dense", "task": "vt", "score": v},
                 {"length": 1024, "compression": 0.75, "policy": "knorm", "task": "vt", "score": v}]
    tab = table(recs, ["dense", "knorm"], cfg)
    assert tab["solvable"] == {1024: ["niah_noise"]}              # dense never solves vt: not averaged
    m, se, n = tab["average"][(1024, 0.75, "knorm")]
    assert (m, n) == (0.75, 1) and se == pytest.approx(np.std([1, 0, 1, 1], ddof=1) / 2)
    assert tab["cells"][(1024, 0.75, "knorm", "vt")][:2] == (0.0, 0.0)


def test_attention_statistic_policies_are_marked_dense_prefill():
    from kvjax.longctx.run import dense_prefill

    assert [p for p in ("snapkv", "h2o", "tova", "knorm", "kvpop_mlp", "oracle", "dense") if dense_prefill(p)] == \
        ["snapkv", "h2o", "tova"]


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="unknown task 'ruler'"):
        LongCtxConfig(tasks=["ruler"])
    with pytest.raises(ValueError, match="compression 0.97 of 1024 tokens leaves 31 slots"):
        LongCtxConfig(lengths=[1024], compressions=[0.97])
    with pytest.raises(ValueError, match="learned_budgets: 'kvpop' is not a label in learned"):
        LongCtxConfig(learned={"lkv": "x"}, learned_budgets={"kvpop": "adakv"})
    with pytest.raises(ValueError, match="rule must be 'uniform', 'pyramid', 'adakv', 'global' or 'layer', got 'duo'"):
        LongCtxConfig(learned={"lkv": "x"}, learned_budgets={"lkv": "duo"})
    with pytest.raises(ValueError, match="variants.kn: budgets 'global' shares one top-k .* not prefill: bounded"):
        LongCtxConfig(policies=["kn"], variants={"kn": {"policy": "knorm", "budgets": "global"}})
    with pytest.raises(ValueError, match="variants.kn: 'topk' cannot be set here"):
        LongCtxConfig(prefill="compressed", policies=["kn"], variants={"kn": {"policy": "knorm", "topk": 3}})
    with pytest.raises(ValueError, match="question_aware .* needs prefill: compressed"):
        LongCtxConfig(question_aware=True)


def test_exported_problems_are_the_runners_token_ids(tok, tmp_path):
    from kvjax.longctx.run import export_problems

    cfg = LongCtxConfig(tasks=["niah_multikey", "vt"], lengths=[512], problems=2, problems_at={512: 3}, compressions=[0.5],
                        prefill="compressed", question_aware=True)
    assert export_problems(cfg, tmp_path / "p.jsonl", tok) == 6
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    p = Generator(tok).problem("vt", 512, 2)
    ctx, q = prompt_ids(tok, p, question_aware=True)
    r = rows[-1]
    assert (r["id"], r["context_ids"], r["question_ids"], r["answers"]) == ("512/vt/2", ctx, q, list(p.answers))
    assert not (tmp_path / "p.jsonl.tmp").exists()


def test_figures_pick_dense_the_best_heuristic_and_the_best_learned(tmp_path):
    from kvjax.longctx.plots import best_policies, write_figures

    rs = np.random.RandomState(0)
    quality = {"dense": 1.0, "snapkv": 0.6, "tova": 0.7, "kvpop_a": 0.5, "kvpop_b": 0.8, "oracle": 0.95}
    recs = [{"task": task, "length": n, "depth": (0.05, 0.25, 0.5, 0.75, 0.95)[i % 5] if task != "fwe" else None,
             "policy": p, "compression": 0.0 if p == "dense" else c, "index": i,
             "score": float(rs.rand() < q)}
            for task in ("niah_noise", "fwe") for n in (1024, 2048) for i in range(10)
            for p, q in quality.items() for c in ([0.0] if p == "dense" else [0.75, 0.88])]
    cfg = LongCtxConfig(tasks=["niah_noise", "fwe"], lengths=[1024, 2048], compressions=[0.75, 0.88])
    tab = table(recs, list(quality), cfg)
    assert best_policies(tab["average"], ["kvpop_a", "kvpop_b"], 0.75) == ["dense", "tova", "kvpop_b"]
    paths = write_figures(recs, tab["average"], ["kvpop_a", "kvpop_b"], [0.75, 0.88], tmp_path, "bounded")
    assert [p.name for p in paths] == ["accuracy_vs_compression.png", "needle_heatmap.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_later_batches_reuse_the_first_batchs_programs(model, tok, tmp_path):
    """``prefill: compressed``: the padded sizes are seeded with the longest context, prompt and
    question of the run (and each row's kept slots), so a run of many batches compiles each
    program as often as a run of its first batch alone."""
    from kvjax.cache import compressed
    from kvjax.eviction import shared_prefill

    jitted = {"prefill": shared_prefill._prefill, "compact": compressed._compact, "answer": shared_prefill._answer}

    def compiled(problems: int) -> dict:
        for f in jitted.values():
            f.clear_cache()
        cfg = LongCtxConfig(tasks=["niah_noise", "niah_multikey"], lengths=[320], problems=problems,
                            compressions=[0.75], policies=["streaming_llm", "knorm"], sinks=2, window=8, max_new=4,
                            batch_size=2, prefill="compressed", out_dir=str(tmp_path / f"out{problems}"))
        run_longctx(cfg, model=model, tokenizer=tok, progress=False)
        return {k: f._cache_size() for k, f in jitted.items()}

    p = Generator(tok)
    contexts = {len(prompt_ids(tok, p.problem(t, 320, i))[0]) for i in range(6) for t in ("niah_noise", "niah_multikey")}
    assert len(contexts) > 1                 # the batches differ, so unseeded sizes would grow
    assert compiled(6) == compiled(1)
