"""Every config in configs/ parses under the schema of the command that reads it, so a renamed
field or a typo fails here and not an hour into a run; a new config with no known schema fails too."""

import os
import sys

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paths import ROOT  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs")
# file-name prefix -> (module, schema) of the command that reads configs without a `mode:`
BY_PREFIX = {"dms-": ("kvjax.dms.train", "DMSConfig"), "duo-": ("kvjax.duo.train", "DuoConfig"),
             "features-": ("kvjax.scorer_fit.features", "FeatureConfig"),
             "scorers-": ("kvjax.scorer_fit.fit", "FitConfig"),
             "fidelity-": ("kvjax.evaluation.trace_fidelity", "FidelityConfig"),
             "retention-": ("kvjax.evaluation.trace_retention", "RetentionConfig"),
             "longctx-": ("kvjax.longctx.run", "LongCtxConfig"), "traces-": ("kvjax.traces.run", "TraceConfig")}
BY_MODE = {"quality": ("kvjax.evaluation.config", "EvalConfig"), "bench": ("kvjax.evaluation.config", "EvalConfig"),
           "pretrain": ("kvjax.train.config", "TrainConfig"), "distill_kvpop": ("kvjax.train.config", "TrainConfig"),
           "distill_lkv": ("kvjax.train.config", "TrainConfig")}
NAMES = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".yaml"))


def _schema(name: str):
    import importlib

    with open(os.path.join(CONFIGS, name)) as f:
        mode = (yaml.safe_load(f) or {}).get("mode")
    spec = BY_MODE.get(mode) or next((v for k, v in BY_PREFIX.items() if name.startswith(k)), None)
    assert spec is not None, f"configs/{name}: no schema known for it (mode {mode!r}); add it to this test"
    return getattr(importlib.import_module(spec[0]), spec[1])


@pytest.mark.parametrize("name", NAMES)
def test_every_config_parses_under_its_schema(name):
    from kvjax.configio import load_config

    schema = _schema(name)
    cfg = load_config(schema, os.path.join(CONFIGS, name))
    assert type(cfg) is schema


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("testbed-") and "teacher" not in n
                                  and "distill" not in n])
def test_testbed_eval_configs_name_shipped_weights(name):
    """The weights a testbed evaluation names under assets/ are shipped (run outputs under runs/
    are made by `make quality` / `quality-long`; its budgets are checked when the config loads)."""
    from kvjax.configio import load_config
    from kvjax.evaluation.config import EvalConfig

    cfg = load_config(EvalConfig, os.path.join(CONFIGS, name))
    for path in [cfg.model, *cfg.scorers.values(), *cfg.students.values()]:
        if path.startswith("assets/"):
            assert os.path.isdir(os.path.join(ROOT, path)), f"configs/{name} names {path}, which is not shipped"
