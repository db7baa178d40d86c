"""A new user's mistakes and damaged files get clear errors (issue: tried as a new user would)."""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.configio import ConfigError, load_config
from kvjax.eviction.config import EvictionConfig
from kvjax.export import export_scorers, load_scorers
from kvjax.scorers import MLPScorer
from kvjax.eviction.learned import from_scorer
from kvjax.train.config import TrainConfig
from paths import ROOT, TESTS  # noqa: F401


def test_numeric_strings_are_numbers_for_numeric_fields():
    cfg = load_config(TrainConfig, None, ["optim.lr=1e-3", "steps=3", "optim.eps=1E-9"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float) and cfg.optim.eps == 1e-9
    with pytest.raises(ConfigError, match="optim.lr: expected float, got str 'fast'"):
        load_config(TrainConfig, None, ["optim.lr=fast", "steps=3"])
    with pytest.raises(ConfigError, match="optim.lr: expected a finite number"):
        load_config(TrainConfig, None, ["optim.lr='nan'", "steps=3"])


@pytest.mark.parametrize("override,match", [
    ("data.testbed.lenght=128", "unknown config key 'data.testbed.lenght'"),
    ("eviction.sinks=-4", "eviction.sinks must be a non-negative integer, got -4"),
    ("eviction.window=0", "eviction.window must be >= 1"),
    ("eviction.scorer=mlstm", "config key 'eviction.scorer' moved to 'eviction.kvpop.scorer'"),
    ("eviction.kvpop.pairwise_frac=0", "kvpop.pairwise_frac must be in \\(0, 1\\]"),
    ("mode=distill_lkv", "eviction.k_max \\(None\\) must be > eviction.topk \\(64\\) for distill_lkv"),
    ("phases=[{steps: 2, data: {num_nmes: 3}}]", "unknown config key 'phases\\[0\\].data.num_nmes'"),
    ("data.testbed.length=-5", "data.testbed \\(phase 0\\)"),
])
def test_config_errors_are_found_before_anything_runs(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TrainConfig, None, [override, "steps=3"])


def test_train_cli_reports_config_errors_in_one_line_and_writes_nothing(tmp_path, capsys):
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["train.py", "--set", "steps=3", "--set", f"out_dir={tmp_path / 'run'}", "--set",
                "eviction.window=0", "--dry-run"]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: eviction: eviction.window must be >= 1, got 0 (the current token is always kept)"]
    assert not (tmp_path / "run").exists()


def test_budget_at_least_the_sequence_warns():
    cfg = load_config(TrainConfig, None, ["mode=distill_kvpop", "steps=3", "data.seq_len=128",
                                          "eviction.window=100", "eviction.topk=64"])
    assert any("nothing is ever evicted" in w for w in cfg.warnings())
    ok = load_config(TrainConfig, None, ["mode=distill_kvpop", "steps=3", "data.seq_len=512"])
    assert ok.warnings() == []


def test_silent_wrong_inputs_are_refused(hf_dir):
    folder, _ = hf_dir("qwen3-gqa")
    model = kvjax.load_hf(folder)
    with pytest.raises(TypeError, match="token ids must be integers"):
        kvjax.forward(model, [[4.9, 12.2]])
    with pytest.raises(ValueError, match="600 positions exceed the model.s max_position_embeddings=512"):
        kvjax.forward(model, np.zeros((1, 600), np.int32))
    with pytest.raises(ValueError, match="window must be an integer, got 4.5"):
        EvictionConfig(window=4.5)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        kvjax.generate(model, [[5, 6]], 3, temperature=float("nan"))


def _export_for(model, path):
    cfg = model.config
    scorer = MLPScorer(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, rngs=nnx.Rngs(0))
    return export_scorers(from_scorer(scorer, EvictionConfig(2, 4, 4)), path, base_config=cfg)


def test_scorers_of_another_model_are_refused_by_name(hf_dir, tmp_path):
    mine = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    other = kvjax.load_hf(hf_dir("qwen3-headdim")[0])          # head_dim 24 vs 16
    out = _export_for(mine, tmp_path / "s")
    with pytest.raises(ValueError, match=r"made for another model \(head_dim 16 vs 24"):
        load_scorers(out, model=other)
    pol = load_scorers(out)
    with pytest.raises(ValueError, match="made for another model"):
        kvjax.generate(other, [[5, 6, 7]], 3, policy=pol)
    assert kvjax.generate(mine, [[5, 6, 7]], 3, policy=pol).shape == (1, 6)
    meta = json.loads((out / "scorer_config.json").read_text())
    (out / "scorer_config.json").write_text(json.dumps({**meta, "base_config_sha256": "0" * 64}))
    with pytest.warns(UserWarning, match="config differs from the one its scorers were exported with"):
        kvjax.generate(mine, [[5, 6, 7]], 3, policy=load_scorers(out))


def test_damaged_files_are_named(hf_dir, tmp_path):
    src = hf_dir("qwen3-gqa")[0]
    f = shutil.copytree(src, tmp_path / "cut")
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut/model.safetensors: .*truncated or damaged"):
        kvjax.load_hf(f)
    g = shutil.copytree(src, tmp_path / "badcfg")
    (g / "config.json").write_text((g / "config.json").read_text()[:40])
    with pytest.raises(ValueError, match=r"badcfg/config.json: not valid JSON"):
        kvjax.load_hf(g)
    h = shutil.copytree(src, tmp_path / "ff")
    raw = bytearray((h / "model.safetensors").read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header:] = b"\xff" * (len(raw) - header)
    (h / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        kvjax.load_hf(h)
    out = _export_for(kvjax.load_hf(src), tmp_path / "sc")
    blob = (out / "scorers.safetensors").read_bytes()
    (out / "scorers.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"sc/scorers.safetensors: cannot read it"):
        load_scorers(out)


def test_save_hf_keeps_the_umask_mode(hf_dir, tmp_path):
    model = kvjax.load_hf(hf_dir("qwen3-gqa")[0])
    old = os.umask(0o022)
    try:
        out = kvjax.save_hf(model, tmp_path / "m")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


def test_list_keys_prints_every_key_with_default_and_meaning():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--list-keys"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert {"optim.lr", "eviction.window", "data.testbed", "log.tensorboard", "mesh.fsdp"} <= set(rows)
    assert "0.003" in rows["optim.lr"] and "# peak learning rate" in rows["optim.lr"]
    assert all("#" in line for line in rows.values()), [k for k, v in rows.items() if "#" not in v]


def test_a_configs_relative_paths_are_found_from_another_directory(tmp_path, monkeypatch):
    """A relative path in a config file that is not there from the current directory is taken
    from the config's root (the folder holding its configs/ folder); one that exists nowhere yet
    (an out_dir) and --set values stay relative to the current directory."""
    from pathlib import Path

    root = tmp_path / "repo"
    (root / "configs").mkdir(parents=True)
    (root / "assets" / "teacher").mkdir(parents=True)
    (root / "configs" / "x.yaml").write_text("steps: 3\nmodel: {hf_path: assets/teacher}\nout_dir: runs/x\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "assets" / "mine").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    cfg = load_config(TrainConfig, root / "configs" / "x.yaml")
    assert (cfg.model.hf_path, cfg.out_dir) == (str(root / "assets" / "teacher"), "runs/x")
    cfg = load_config(TrainConfig, root / "configs" / "x.yaml", ["model.hf_path=assets/mine"])
    assert cfg.model.hf_path == "assets/mine"
    (elsewhere / "assets" / "teacher").mkdir()          # there from here too: the current directory wins
    assert load_config(TrainConfig, root / "configs" / "x.yaml").model.hf_path == "assets/teacher"
    monkeypatch.chdir(root)                              # from the root: nothing changes
    assert load_config(TrainConfig, Path("configs/x.yaml")).model.hf_path == "assets/teacher"


def test_train_dry_run_of_a_shipped_config_works_from_another_directory(tmp_path, monkeypatch, capsys):
    from kvjax.train.cli import main

    monkeypatch.chdir(tmp_path)
    config = os.path.join(ROOT, "configs", "testbed-distill-kvpop.yaml")
    assert main(["--dry-run", "--config", config]) == 0
    assert "per device: parameters" in capsys.readouterr().out
    assert main(["--dry-run", "--config", config, "--set", "model.hf_path=assets/nothere"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"train.py: error: assets/nothere: not a model folder (a relative path in {config} is taken from "
                   f"the current directory, {tmp_path}, or, when it is not there, from {ROOT}; --set paths from "
                   "the current directory)"]
