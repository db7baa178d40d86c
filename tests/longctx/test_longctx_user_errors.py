"""``python -m kvjax.longctx`` as a new user meets it (issue: tried as a new user would): Ctrl-C
ends in one resumable line, a bad config or a wrong learned folder is refused before any work,
a shipped config works from another directory, and short lengths are labelled right."""

import json
import re
import shlex
from pathlib import Path

import pytest

import kvjax.longctx.__main__ as cli
from kvjax.configio import load_config
from kvjax.evaluation.results_store import ResultsStore, read_records, record_key
from kvjax.longctx.report import length_label, overview
from kvjax.longctx.checks import check_learned, exported_policy
from kvjax.longctx.run import LongCtxConfig
from paths import ROOT

SMALL = ["--set", "tasks=[niah_noise]", "--set", "lengths=[256]", "--set", "problems=1",
         "--set", "compressions=[0.5]", "--set", "policies=[dense, knorm]", "--set", "window=8"]


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model (or running anything) fails the test: the checks come first."""
    import kvjax.real_model

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(kvjax.real_model, "ensure_model", refuse)
    monkeypatch.setattr(cli, "run_longctx", lambda cfg: (check_learned(cfg), refuse()))


def test_ctrl_c_prints_one_resumable_line_and_exits_130(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = [*SMALL, "--set", f"out_dir={out}"]

    def interrupted(cfg):               # one batch stored, then Ctrl-C in the next
        store = ResultsStore(cfg.out_dir, {"model": "m"})
        try:
            store.add([{"key": record_key(256, 0.0, "dense", "niah_noise/0"), "score": 1.0}])
            raise KeyboardInterrupt
        finally:
            store.close()

    monkeypatch.setattr(cli, "run_longctx", interrupted)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "interrupted" in err[0] and "nothing stored is lost" in err[0] and str(out) in err[0]
    assert shlex.split(err[0].split("resumable: ", 1)[1]) == ["python", "-m", "kvjax.longctx", *argv]
    assert len(read_records(out)) == 1
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("override,match", [
    ("policies=[dense, snapk]", "unknown policy 'snapk'; known: dense, streaming_llm"),
    ("policies=[dense, lkv]", "'lkv' is a learned policy; list it under learned:"),
    ("policies=[dense, oracle_values]", "unknown policy 'oracle_values'"),
    ("learned={snapkv: x}", "label 'snapkv' is a built-in policy's name"),
    ("lengths=[128]", "lengths: 128 is too short"),
    ("compressions=[0.5, 0.5]", "compressions: 0.5 is listed twice"),
    ("problems_at={100: 3}", "problems_at: {100: 3} needs a length >= 256 and a count >= 1"),
])
def test_a_bad_config_is_refused_before_anything_runs(override, match, tmp_path, no_model, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*SMALL, "--set", override, "--set", f"out_dir={tmp_path / 'out'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "out").exists()


def _export(folder: Path, **meta) -> Path:
    folder.mkdir(parents=True)
    (folder / "scorer_config.json").write_text(json.dumps(meta))
    (folder / "scorers.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("learned,match", [
    ("{lkv: nowhere/lkv}", r"learned: lkv: nowhere/lkv does not exist \(relative paths are taken from the current directory"),
    (f"{{lkv: {ROOT}/assets/smollm2-scorers/kvpop-mlp-mean}}",
     "label 'lkv' names policy lkv, but .*kvpop-mlp-mean holds a kvpop_mlp export"),
    (f"{{kvpop_mlstm_adakv: {ROOT}/assets/smollm2-scorers/lkv-kvpop-mlstm}}",
     "names policy kvpop_mlstm, but .* holds a lkv_kvpop_mlstm export"),
    (f"{{dms: {ROOT}/assets}}", "learned: dms: .*/assets holds no scorer_config.json"),
])
def test_a_wrong_learned_folder_is_refused_before_the_model_loads(learned, match, tmp_path, no_model, capsys):
    assert cli.main([*SMALL, "--set", f"learned={learned}", "--set", f"out_dir={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(match, err[0]), err
    assert not (tmp_path / "out").exists()


def test_the_label_is_checked_against_older_exports_too(tmp_path):
    """Exports before scorer_config.json's "policy" field: the name comes from "scorer" and
    "lkv_budgets", as kvjax.load_scorers infers it."""
    lkv_mlstm = _export(tmp_path / "a", scorer="mlstm", lkv_budgets=[[4]])
    mlp = _export(tmp_path / "b", scorer="mlp")
    assert exported_policy(lkv_mlstm) == "lkv_kvpop_mlstm" and exported_policy(mlp) == "kvpop_mlp"
    check_learned(LongCtxConfig(learned={"lkv_kvpop_mlstm": str(lkv_mlstm), "kvpop_mlp_peak": str(mlp),
                                         "mine": str(mlp)}))          # a free label claims no policy
    with pytest.raises(ValueError, match="label 'kvpop_mlstm' names policy kvpop_mlstm, but .* lkv_kvpop_mlstm"):
        check_learned(LongCtxConfig(learned={"kvpop_mlstm": str(lkv_mlstm)}))
    with pytest.raises(ValueError, match="label 'lkv' names policy lkv, but .* holds a kvpop_mlp export"):
        check_learned(LongCtxConfig(learned={"lkv": str(mlp)}))


@pytest.mark.parametrize("config", sorted(p.name for p in Path(ROOT, "configs").glob("longctx-*.yaml")))
def test_every_shipped_longctx_config_passes_the_checks_from_another_directory(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(LongCtxConfig, Path(ROOT, "configs", config))
    check_learned(cfg)
    assert all(Path(d).is_absolute() and Path(d).is_dir() for d in cfg.learned.values())


def test_lengths_below_1024_are_not_labelled_0k():
    assert [length_label(n) for n in (256, 512, 1000, 1024, 1536, 2048, 4096)] == \
        ["256", "512", "1000", "1k", "1536", "2k", "4k"]
    cfg = LongCtxConfig(tasks=["niah_noise"], lengths=[512, 1024], compressions=[0.75], policies=["dense", "knorm"])
    tab = {"average": {(512, 0.75, "knorm"): (0.5, 0.1, 1), (1024, 0.75, "knorm"): (0.25, 0.1, 1)},
           "cells": {}, "solvable": {512: ["niah_noise"], 1024: ["niah_noise"]}}
    head = overview(tab, cfg, ["dense", "knorm"]).splitlines()[0]
    assert head == "| policy | 512, 75% | 1k, 75% |"
