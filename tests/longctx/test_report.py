"""``python -m kvjax.longctx --report``: the table of a store while its run goes on, from the
problems that have every record only (paired N), refusing a store of other settings."""

import json

import pytest

from kvjax.evaluation.results_store import record_key
from kvjax.longctx.__main__ import main
from kvjax.longctx.report import report
from kvjax.longctx.run import LongCtxConfig

RUN = {"prefill": "compressed", "seed": 0, "sinks": 4, "window": 32, "obs_window": 32, "pool": 7,
       "question_aware": False, "max_new": 32, "model": "m", "tokenizer": "t"}


def _store(folder, problems: int, missing=(), torn=False):
    folder.mkdir(parents=True)
    (folder / "fingerprint.json").write_text(json.dumps({"run": RUN, "policies": {}}))
    lines = []
    for i in range(problems):
        for task in ("niah_noise", "vt"):
            for name, comp in (("dense", 0.0), ("knorm", 0.75), ("knorm", 0.88)):
                key = record_key(1024, comp, name, f"{task}/{i}")
                if key in missing:
                    continue
                score = 1.0 if name == "dense" or (task == "niah_noise" and i % 2) else 0.0
                lines.append(json.dumps({"key": key, "task": task, "index": i, "length": 1024, "compression": comp,
                                         "policy": name, "score": score, "depth": 0.5}))
    (folder / "problems.jsonl").write_text("\n".join(lines) + "\n" + ('{"key": "10' if torn else ""))


def _cfg(folder, **kw):
    return LongCtxConfig(tasks=["niah_noise", "vt"], lengths=[1024], problems=6, compressions=[0.75, 0.88],
                         policies=["dense", "knorm"], prefill="compressed", obs_window=32, out_dir=str(folder), **kw)


def test_only_problems_with_every_record_count(tmp_path):
    _store(tmp_path / "s", 4, missing={record_key(1024, 0.88, "knorm", "vt/3")}, torn=True)
    tab = report(_cfg(tmp_path / "s"))
    assert tab["complete"] == {1024: {"niah_noise": 4, "vt": 3}}
    assert tab["cells"][(1024, 0.75, "knorm", "niah_noise")][:1] == (0.5,)
    assert tab["cells"][(1024, 0.75, "knorm", "vt")][2] == 3 == tab["cells"][(1024, 0.0, "dense", "vt")][2]
    assert tab["average"][(1024, 0.75, "knorm")][0] == pytest.approx(0.25)


def test_other_settings_and_a_missing_store_are_refused(tmp_path):
    _store(tmp_path / "s", 2)
    with pytest.raises(ValueError, match=r"other settings \(sinks=4\) than the config \(sinks=0\)"):
        report(_cfg(tmp_path / "s", sinks=0))
    with pytest.raises(FileNotFoundError, match="no stored long-context run"):
        report(_cfg(tmp_path / "none"))


def test_cli_writes_the_table_and_figures_without_running(tmp_path, capsys):
    _store(tmp_path / "s", 3)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"tasks: [niah_noise, vt]\nlengths: [1024]\nproblems: 6\ncompressions: [0.75, 0.88]\n"
                   f"policies: [dense, knorm]\nprefill: compressed\nobs_window: 32\nout_dir: {tmp_path / 's'}\n")
    assert main(["--config", str(cfg), "--report"]) == 0
    out = capsys.readouterr().out
    assert "complete problems per task: 1024: niah_noise 3, vt 3" in out
    assert "| knorm [3] |" in out
    assert "| policy | 1k, 75% | 1k, 88% |\n" in out and "| knorm | 16.7% ± 16.7% | 16.7% ± 16.7% |" in out
    assert "problems per task: 1024: 3; averaged over the tasks dense solves: 1024: niah_noise, vt" in out
    assert {p.name for p in (tmp_path / "s").iterdir()} >= {"table.md", "summary.json", "accuracy_vs_compression.png",
                                                            "needle_heatmap.png"}


def test_who_wins_where_ranks_policies_without_the_oracle_and_pairs_the_margins():
    from kvjax.longctx.report import markdown, paired_difference
    from kvjax.longctx.run import table

    scores = {("niah_noise", "dense"): [1, 1, 1], ("niah_noise", "lkv"): [1, 1, 0], ("niah_noise", "knorm"): [1, 0, 0],
              ("niah_noise", "oracle"): [1, 1, 1], ("vt", "dense"): [1, 1, 1], ("vt", "lkv"): [1, 0, 1],
              ("vt", "knorm"): [0, 0, 1], ("vt", "oracle"): [1, 1, 1]}
    recs = [{"length": 1024, "compression": 0.0 if p == "dense" else 0.75, "policy": p, "task": t, "index": i,
             "score": float(v), "depth": None} for (t, p), vs in scores.items() for i, v in enumerate(vs)]
    cfg = LongCtxConfig(tasks=["niah_noise", "vt"], lengths=[1024], compressions=[0.75],
                        policies=["dense", "knorm", "oracle"], learned={"lkv": "unused"})
    names = ["dense", "knorm", "oracle", "lkv"]
    tab = {**table(recs, names, cfg), "records": recs}
    m, se = paired_difference(recs, 1024, 0.75, "lkv", "knorm", ["niah_noise", "vt"])
    assert m == pytest.approx(1 / 3) and se == pytest.approx(((2 * (1 / 3) ** 2) ** 0.5) / 2)   # per task: 1/3
    assert paired_difference(recs, 1024, 0.75, "knorm", "lkv", ["vt"])[0] == pytest.approx(-1 / 3)
    md = markdown(tab, cfg, names)
    assert "| 1k, 75% | lkv 66.7% | knorm 33.3% | +33.3 ± 23.6 | lkv 66.7% | knorm 33.3% | +33.3 ± 23.6 |" in md
    with pytest.raises(ValueError, match="no problem of task 'qa' has both"):
        paired_difference(recs, 1024, 0.75, "lkv", "knorm", ["qa"])
