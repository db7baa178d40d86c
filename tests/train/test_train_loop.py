"""Trainer: config errors, exact resume after preemption, checkpoint refusal, metrics."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from kvjax.configio import ConfigError, load_config
from kvjax.eviction.config import kept_slots
from kvjax.train.checkpoint import CheckpointError
from kvjax.train.config import TrainConfig
from kvjax.train.loop import train
from train_helpers import TINY_MODEL, tiny_config
from paths import ROOT, TESTS  # noqa: F401



def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        load_config(TrainConfig, None, ["optim.learning_rate=1e-3", "steps=3"])
    with pytest.raises(ConfigError, match="data.batch_size: expected int, got str 'big'"):
        load_config(TrainConfig, None, ["data.batch_size=big", "steps=3"])
    with pytest.raises(ConfigError, match="mode: must be one of"):
        load_config(TrainConfig, None, ["mode=finetune", "steps=3"])
    with pytest.raises(ConfigError, match="set one of model.hf_path"):
        load_config(TrainConfig, None, ["model.config={model_type: qwen3}", "model.preset=qwen3-4b", "steps=3"])
    with pytest.raises(FileNotFoundError, match="config file .*nope.yaml does not exist"):
        load_config(TrainConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(TrainConfig, None, ["data.source=tokens", "steps=3"])
    cfg = load_config(TrainConfig, None, ["steps=7", "optim.lr=0.01", "phases=[{steps: 2}, {steps: 3}]"])
    assert cfg.optim.lr == 0.01 and cfg.total_steps == 5


def test_missing_token_file_is_named(tmp_path):
    cfg = tiny_config(tmp_path / "run", **{"data.source": "tokens", "data.path": str(tmp_path / "none.jsonl")})
    with pytest.raises(FileNotFoundError, match="token file .*none.jsonl does not exist"):
        train(cfg, quiet=True)


def test_exact_resume_after_preemption(tmp_path):
    full = train(tiny_config(tmp_path / "full"), quiet=True)
    part = tiny_config(tmp_path / "part")
    first = train(part, stop_after=10, quiet=True)
    assert first["stopped_at"] == 10
    resumed = train(part, quiet=True)
    for a, b in zip(leaves(full["params_tree"]), leaves(resumed["params_tree"])):
        np.testing.assert_array_equal(a, b)
    logged = [json.loads(line) for line in open(tmp_path / "part" / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30]
    assert {"loss", "grad_norm", "tokens_per_s", "lr_backbone", "skipped_steps"} <= set(logged[-1])
    assert logged[-1]["loss"] < logged[0]["loss"]


def test_incompatible_checkpoint_is_refused(tmp_path):
    train(tiny_config(tmp_path / "run", steps=4), quiet=True)
    other = tiny_config(tmp_path / "run", steps=8, **{"model.config": {**TINY_MODEL, "hidden_size": 48}})
    with pytest.raises(CheckpointError, match="incompatible with this run: its 'model' differs"):
        train(other, quiet=True)


def test_checkpoint_of_another_starting_model_is_refused(tmp_path):
    """A run from ``model.hf_path`` does not resume when the weights there changed (a retrained
    teacher under the same path), even with an identical config."""
    from flax import nnx

    import kvjax

    def save(seed):
        kvjax.save_hf(kvjax.Decoder(kvjax.ModelConfig.from_hf_config(TINY_MODEL), rngs=nnx.Rngs(seed)),
                      tmp_path / "start")

    save(0)
    cfg = lambda steps: tiny_config(tmp_path / "run", steps=steps, **{"model": {"hf_path": str(tmp_path / "start")}})
    train(cfg(3), stop_after=2, quiet=True)
    assert train(cfg(3), quiet=True)["resumed_from"] == 2    # same weights: resumes
    save(1)
    with pytest.raises(CheckpointError, match="its 'model_weights' differs"):
        train(cfg(3), quiet=True)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_saves_and_exits_as_shells_expect(tmp_path, sig, code):
    cfg = tiny_config(tmp_path / "run", steps=100000)
    from kvjax.configio import to_dict

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == code, out[-2000:]
    assert "checkpoint saved" in out and "done:" not in out
    assert f"interrupted by {sig.name} at step" in out and "resumable" in out
    steps = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and max(steps) >= 5


def test_sharded_training_matches_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=TESTS)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_train.py"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["max_param_diff"] <= 1e-5 and report["sharded_leaves"] > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
    """jax.distributed over localhost (2 processes x 4 CPU devices) = 1 process x 8 devices."""
    from kvjax.configio import to_dict
    from safetensors.numpy import load_file

    base = to_dict(tiny_config(tmp_path / "x", steps=10, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(base))
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", str(cfg_path)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    single = subprocess.run(cmd + ["--set", f"out_dir={tmp_path / 'one'}", "--set", f"save_hf={tmp_path / 'one/hf'}"],
                            env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert single.returncode == 0, single.stderr[-3000:]
    port = _free_port()
    procs = [subprocess.Popen(cmd + ["--set", f"out_dir={tmp_path / 'two'}", "--set", f"save_hf={tmp_path / 'two/hf'}",
                                     "--set", "mesh.multi_host=true", "--set", f"mesh.coordinator=127.0.0.1:{port}",
                                     "--set", "mesh.num_processes=2", "--set", f"mesh.process_id={i}"],
                              env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    a = load_file(tmp_path / "one/hf/model.safetensors")
    b = load_file(tmp_path / "two/hf/model.safetensors")
    assert a.keys() == b.keys()
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-5
    loss = lambda d: [json.loads(x)["loss"] for x in open(tmp_path / d / "metrics.jsonl")]  # noqa: E731
    np.testing.assert_allclose(loss("one"), loss("two"), atol=1e-5)


def test_dry_run_prints_per_device_memory():
    from kvjax.train.dry_run import dry_run

    cfg = load_config(TrainConfig, None, ["steps=10", "model.preset=qwen3-8b", "mesh.data=2", "mesh.fsdp=8",
                                          "mesh.tensor=4"])
    text = dry_run(cfg)
    assert "parameters: 8.191 B trained" in text and "(64 devices)" in text
    per_dev = float(text.split("per device: parameters ")[1].split(" GiB")[0])
    assert per_dev == pytest.approx(8.191e9 * 4 / 32 / 2**30, rel=0.05)   # fsdp x tensor = 32 shards


def test_curriculum_knobs():
    from kvjax.train.config import DataSection, OptimSection, Phase
    from kvjax.train.data import make_dataset
    from kvjax.train.model_init import build_model
    from kvjax.train.optim import make_optimizer

    opt = OptimSection(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule_per_phase=True)
    _, scheds = make_optimizer(opt, {"w": np.zeros(2)}, 20, [10, 10])
    lr = [float(scheds["backbone"](i)) for i in range(20)]
    assert lr[0] == 0.0 and lr[2] == pytest.approx(1.0) and lr[10] == 0.0 and lr[12] == pytest.approx(1.0)
    data = DataSection(testbed={"length": 128, "num_names": 8}, seq_len=128, batch_size=8)
    assert make_dataset(data, Phase(steps=1, batch_size=4), 0)[0]["tokens"].shape == (4, 128)
    assert make_dataset(data, Phase(steps=1), 0)[0]["tokens"].shape == (8, 128)
    cfg = tiny_config("unused", **{"model.qk_norm_init": 3.0})
    model = build_model(cfg.model, 0)
    assert float(model.layers[0].self_attn.q_norm[...].min()) == 3.0


def test_cli_reports_bad_config_and_exits_2():
    for script, arg, msg in [("train.py", "nope=1", "unknown config key 'nope'"),
                             ("eval.py", "policies=[dense,lru]", "unknown policy 'lru'")]:
        res = subprocess.run([sys.executable, os.path.join(ROOT, script), "--set", arg], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 2 and msg in res.stderr, res.stderr


@pytest.mark.parametrize("recipe", sorted(p for p in os.listdir(os.path.join(ROOT, "configs")) if "kvpop" in p and not p.startswith("testbed")))
def test_real_recipes_dry_run_without_hardware(recipe):
    from kvjax.train.dry_run import dry_run

    cfg = load_config(TrainConfig, os.path.join(ROOT, "configs", recipe))
    text = dry_run(cfg)
    assert cfg.mode == "distill_kvpop"
    if cfg.data.teacher_cache:          # the teacher's top-k from a file: no teacher in memory
        assert "frozen teacher" not in text and f"top-{cfg.data.teacher_topk} log-probabilities read from" in text
    else:
        assert "frozen teacher" in text and "teacher:" not in text
    budget = cfg.eviction.sinks + cfg.eviction.window + cfg.eviction.topk
    # the accelerator recipes keep the seed's 4096 slots; the SmolLM2 recipes 25% (12% for -88) of a row
    smol = cfg.model.preset == "smollm2-135m"
    assert budget == (kept_slots(0.88 if "-88" in recipe else 0.75, cfg.data.seq_len) if smol else 4096)
    per_dev = float(text.split("= ")[-1].split(" GiB")[0])
    assert 0.5 < per_dev < 16


def test_smollm2_lkv_recipe_dry_runs_without_weights():
    from kvjax.train.dry_run import dry_run

    cfg = load_config(TrainConfig, os.path.join(ROOT, "configs", "smollm2-distill-lkv.yaml"))
    text = dry_run(cfg)
    assert cfg.mode == "distill_lkv" and cfg.model.preset == "smollm2-135m" and "mode=distill_lkv" in text
    assert cfg.eviction.sinks + cfg.eviction.window + cfg.eviction.topk == cfg.data.seq_len // 4


def _with_file_size_limit(limit_bytes, script, args):
    """A command running ``script`` with writes past ``limit_bytes`` failing (EFBIG, SIGXFSZ
    ignored) -- the limit is set in the child itself, not in a fork of this threaded process."""
    code = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes})); "
            f"sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')")
    return [sys.executable, "-c", code, *args]


def test_full_disk_during_checkpoint_save_keeps_the_previous_one(tmp_path):
    """A save that runs out of space fails with an error naming the checkpoint and the cause;
    the previous checkpoint still resumes, and the resumed run equals an uninterrupted one."""
    from kvjax.configio import to_dict

    cfg = tiny_config(tmp_path / "run", steps=20, **{"checkpoint.every": 10})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert train(cfg, stop_after=10, quiet=True)["stopped_at"] == 10
    cmd = _with_file_size_limit(16 * 1024, os.path.join(ROOT, "train.py"), ["--config", str(path)])
    full = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert full.returncode != 0
    assert "saving checkpoint step 20" in full.stderr and "no space left or file-size limit" in full.stderr, \
        full.stderr[-3000:]
    assert "earlier checkpoints are untouched" in full.stderr
    resumed = train(cfg, quiet=True)          # the step-10 checkpoint is intact: resume to 20
    straight = train(tiny_config(tmp_path / "straight", steps=20, **{"checkpoint.every": 10}), quiet=True)
    for a, b in zip(leaves(straight["params_tree"]), leaves(resumed["params_tree"])):
        np.testing.assert_array_equal(a, b)


def test_a_second_run_on_the_same_out_dir_is_refused(tmp_path):
    from kvjax.dir_lock import DirLock, FolderInUse

    with DirLock(tmp_path / "run"):
        with pytest.raises(FolderInUse, match=r"run is in use by another training run \(pid \d+\)"):
            train(tiny_config(tmp_path / "run", steps=2), quiet=True)
    assert train(tiny_config(tmp_path / "run", steps=2), quiet=True)["steps"] == 2   # released: runs


def test_refused_resume_leaves_config_json_alone(tmp_path):
    train(tiny_config(tmp_path / "run", steps=4), quiet=True)
    before = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(CheckpointError, match="its 'optim' differs"):
        train(tiny_config(tmp_path / "run", steps=4, **{"optim.lr": 1e-2}), quiet=True)
    assert (tmp_path / "run" / "config.json").read_text() == before


def test_resume_with_other_steps_is_refused(tmp_path):
    train(tiny_config(tmp_path / "run", steps=8), stop_after=3, quiet=True)
    with pytest.raises(CheckpointError, match="its 'total_steps' differs \\(8 vs 12\\).*learning-rate schedule"):
        train(tiny_config(tmp_path / "run", steps=12), quiet=True)


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "run", steps=30, **{"checkpoint.every": 10, "checkpoint.keep": 3})
    assert train(cfg, stop_after=20, quiet=True)["stopped_at"] == 20
    ckpts = tmp_path / "run" / "checkpoints"
    for f in (ckpts / "20").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    resumed = train(cfg, quiet=True)
    err = capsys.readouterr().err
    assert "checkpoint step 20" in err and "trying the previous checkpoint" in err
    assert resumed["resumed_from"] == 10
    assert len(list((ckpts / "damaged").iterdir())) == 1                # kept aside, not deleted
    straight = train(tiny_config(tmp_path / "straight", steps=30), quiet=True)
    for a, b in zip(leaves(straight["params_tree"]), leaves(resumed["params_tree"])):
        np.testing.assert_array_equal(a, b)


def test_eval_every_zero_evaluates_at_the_end_and_tensorboard_writes_events(tmp_path):
    train(tiny_config(tmp_path / "run", steps=4, **{"log.tensorboard": True, "data.eval_problems": 8}), quiet=True)
    evals = [json.loads(line) for line in open(tmp_path / "run" / "eval.jsonl")]
    assert [e["step"] for e in evals] == [4] and "lookup_far" in evals[0]
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
