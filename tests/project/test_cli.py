"""The ``kvjax`` command, the entry points' help pages and finding the shipped assets (issue:
tried as a new user would). In process (``kvjax.cli.main``) except one ``python -m kvjax``."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvjax
from kvjax.configio import describe_keys, load_config
from paths import ROOT, TESTS  # noqa: F401

JOBS = ["real-model", "traces", "haystacks", "features", "fit", "train", "evaluate", "longctx", "fidelity", "duo", "dms",
        "kvpress-compare", "bench", "device-check", "policies", "tasks", "scorers"]
SHIPPED = {"smollm2-scorers/kvpop-mlp-mean": "kvpop_mlp", "smollm2-scorers/kvpop-mlp-peak": "kvpop_mlp",
           "smollm2-scorers/kvpop-mlp-union": "kvpop_mlp", "smollm2-scorers/kvpop-mlstm-mean": "kvpop_mlstm",
           "smollm2-scorers/lkv": "lkv", "smollm2-scorers/lkv-kvpop-mlstm": "lkv_kvpop_mlstm",
           "smollm2-scorers/kvpop-mlp-recon": "kvpop_mlp",
           "smollm2-dms": "dms", "smollm2-duo": "duo_attention", "testbed-dms": "dms", "testbed-duo": "duo_attention"}


def _config_classes():
    from kvjax.dms.train import DMSConfig
    from kvjax.duo.train import DuoConfig
    from kvjax.evaluation.config import EvalConfig
    from kvjax.evaluation.trace_fidelity import FidelityConfig
    from kvjax.longctx.run import LongCtxConfig
    from kvjax.scorer_fit.features import FeatureConfig
    from kvjax.scorer_fit.fit import FitConfig
    from kvjax.scorer_fit.haystacks import HaystackConfig
    from kvjax.traces.run import TraceConfig
    from kvjax.train.config import TrainConfig

    return {"traces": TraceConfig, "haystacks": HaystackConfig, "features": FeatureConfig, "fit": FitConfig, "train": TrainConfig,
            "evaluate": EvalConfig, "longctx": LongCtxConfig, "fidelity": FidelityConfig, "duo": DuoConfig,
            "dms": DMSConfig}


def _run(capsys, *argv):
    from kvjax.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_job_with_a_description(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for job in JOBS:
        assert re.search(rf"^  {re.escape(job)} +\S", out, re.M), f"kvjax --help does not list {job}"
    assert "example" in out


def test_python_dash_m_kvjax_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "kvjax", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(job in out.stdout for job in JOBS)


def test_pyproject_declares_the_console_script():
    meta = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    assert meta["scripts"]["kvjax"] == "kvjax.cli:main"


def test_bad_usage_is_one_line_on_stderr_and_exit_2(capsys):
    code, _, err = _run(capsys, "polices")
    assert code == 2 and err.strip().splitlines() == [
        "kvjax: error: unknown job 'polices' (did you mean policies?); kvjax --help lists them"]
    code, out, err = _run(capsys)
    assert code == 2 and "usage: kvjax JOB" in err and not out
    code, _, err = _run(capsys, "tasks", "extra")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_policies_lists_every_registered_policy_with_its_budget(capsys):
    code, out, _ = _run(capsys, "policies")
    assert code == 0
    blocks = dict(re.findall(r"^(\w+) +.*\n +needs: (.*)$", out, re.M))
    assert set(blocks) == set(kvjax.POLICIES)
    assert "k_max required" in blocks["duo_attention"] and "topk < k_max" in blocks["lkv"]
    assert "trained" in blocks["kvpop_mlp"] and "trained" in blocks["dms"] and "obs_window" in blocks["snapkv"]
    assert "trained" not in blocks["knorm"] and "priorities" in blocks["oracle"]


def test_policy_notes_describe_only_registered_policies():
    from kvjax.cli.listings import POLICY_NOTES

    assert set(POLICY_NOTES) <= set(kvjax.POLICIES)


def test_tasks_lists_every_long_context_task(capsys):
    from kvjax.longctx.tasks import TASKS

    code, out, _ = _run(capsys, "tasks")
    rows = dict(re.findall(r"^(\w+) +(\S.*)$", out, re.M))
    assert code == 0 and set(TASKS) <= set(rows)
    assert "variable tracking" in rows["vt"] and "``" not in out


def test_scorers_lists_the_shipped_folders_with_their_policies(capsys):
    code, out, _ = _run(capsys, "scorers")
    assert code == 0
    rows = {m[0]: m[1:] for m in re.findall(r"^(\S+) +(\w+) +(.+?\)) +(sinks=.*)$", out, re.M)}
    assert {k: v[0] for k, v in rows.items()} == SHIPPED
    assert "30 layers x 3 KV heads x head_dim 64" in rows["smollm2-scorers/lkv"][1]
    assert "testbed-teacher" in rows["testbed-dms"][1] and "k_max=184" in rows["smollm2-scorers/lkv"][2]
    for folder, policy in SHIPPED.items():          # the listing names what load_scorers builds
        assert kvjax.load_scorers(Path(ROOT) / "assets" / folder).name == policy


def test_scorers_reads_KVJAX_ASSETS(monkeypatch, tmp_path, capsys):
    shutil.copytree(Path(ROOT) / "assets" / "testbed-duo", tmp_path / "mine" / "duo")
    monkeypatch.setenv("KVJAX_ASSETS", str(tmp_path / "mine"))
    code, out, _ = _run(capsys, "scorers")
    assert code == 0 and re.search(r"^duo +duo_attention +testbed-teacher", out, re.M)


def test_assets_are_found_in_the_checkout_else_a_clear_error(monkeypatch, capsys, tmp_path):
    import kvjax.assets as assets

    monkeypatch.delenv("KVJAX_ASSETS", raising=False)
    assert assets.assets_dir() == Path(ROOT).resolve() / "assets"
    assert assets.asset("smollm2-duo").is_dir()
    monkeypatch.setattr(assets, "checkout", lambda: None)         # a non-editable install
    with pytest.raises(assets.AssetsNotFound, match="come with the git repository.*set KVJAX_ASSETS"):
        assets.assets_dir()
    code, _, err = _run(capsys, "scorers")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "KVJAX_ASSETS" in err
    monkeypatch.setenv("KVJAX_ASSETS", str(tmp_path / "missing"))
    with pytest.raises(assets.AssetsNotFound, match="is not a folder"):
        assets.assets_dir()


FORWARDED = ["real-model", "traces", "features", "fit", "train", "evaluate", "longctx", "fidelity", "duo", "dms"]


@pytest.mark.parametrize("job", FORWARDED)
def test_forwarded_help_exits_0_with_a_working_example(job, capsys):
    from kvjax.cli import JOBS as CLI_JOBS

    code, out, _ = _run(capsys, job, "--help")
    assert code == 0 and "usage:" in out
    example = CLI_JOBS[job].example
    assert example in out and "example" in out
    for path in re.findall(r"configs/(?![A-Z]\.yaml)[\w.-]+\.yaml", out):      # configs/X.yaml: a placeholder
        assert (Path(ROOT) / path).is_file(), f"kvjax {job} --help names a missing {path}"
    words = shlex.split(example)
    assert words[:2] == ["kvjax", job]
    if job in _config_classes():                                  # its --config and --set load
        config = words[words.index("--config") + 1] if "--config" in words else None
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        load_config(_config_classes()[job], Path(ROOT) / config if config else None, sets)


def _main_of(job):
    import importlib

    from kvjax.cli import JOBS as CLI_JOBS

    j = CLI_JOBS[job]
    return lambda argv: importlib.import_module(j.module).main([*j.prefix, *argv])


@pytest.mark.parametrize("job", ["traces", "duo", "dms", "features", "fit", "train", "evaluate", "fidelity", "longctx"])
def test_module_help_set_examples_are_keys_of_its_config(job, capsys):
    with pytest.raises(SystemExit) as e:
        _main_of(job)(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    keys = set(re.findall(r"--set\s+\"?([\w.]+)=", out)) - {"KEY", "key"}          # minus the placeholders
    assert keys, f"{job}: no --set example in its help"
    valid = {k for k, _, _ in describe_keys(_config_classes()[job])}
    assert keys <= valid, f"{job}: --set examples name unknown keys {keys - valid}"
    assert re.search(r"^  python (-m kvjax\.|train\.py|eval\.py)", out, re.M), f"{job}: no example command"


def test_scorer_fit_help_names_its_two_commands(capsys):
    from kvjax.scorer_fit.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  features +\S", out, re.M) and re.search(r"^  fit +\S", out, re.M)
    assert "python -m kvjax.scorer_fit features --config configs/features-smollm2.yaml" in out
    assert main(["fits"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bench_lists_its_scripts_and_needs_the_checkout(monkeypatch, capsys):
    code, out, _ = _run(capsys, "bench", "--help")
    assert code == 0 and re.search(r"^  real_model_speed +Generation throughput", out, re.M)
    assert "device_check" in out and not re.search(r"^  timing ", out, re.M)
    code, _, err = _run(capsys, "bench", "no_such_script")
    assert code == 2 and "no script bench/no_such_script.py" in err
    import kvjax.assets as assets

    monkeypatch.setattr(assets, "checkout", lambda: None)
    code, _, err = _run(capsys, "device-check", "--smoke")
    assert code == 2 and "ships with the git repository" in err


def test_device_check_help_runs_the_script(capfd):
    from kvjax.cli import main

    assert main(["device-check", "--help"]) == 0
    out = capfd.readouterr().out
    assert "kvjax device-check --smoke" in out and "usage: device_check.py" in out


def test_kvpress_compare_explains_its_own_venv(capsys):
    code, out, _ = _run(capsys, "kvpress-compare", "--help")
    assert code == 0 and ".venv-kvpress" in out and "make kvpress-compare" in out and "example" in out
    code, _, err = _run(capsys, "kvpress-compare", "--go")
    assert code == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("job", ["policies", "tasks", "scorers"])
def test_listing_help_has_an_example(job, capsys):
    code, out, _ = _run(capsys, job, "--help")
    assert code == 0 and f"kvjax {job}" in out and "example" in out
