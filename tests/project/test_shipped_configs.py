"""Every shipped evaluation and training config parses under its schema, so a renamed field or a
typo in configs/ fails here and not an hour into a run."""

import os
import sys

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paths import ROOT  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs")


def _by_mode(*modes):
    out = []
    for name in sorted(os.listdir(CONFIGS)):
        with open(os.path.join(CONFIGS, name)) as f:
            if yaml.safe_load(f).get("mode") in modes:
                out.append(name)
    return out


@pytest.mark.parametrize("name", _by_mode("quality", "bench"))
def test_eval_configs_parse(name):
    from kvjax.configio import load_config
    from kvjax.evaluation.config import EvalConfig

    cfg = load_config(EvalConfig, os.path.join(CONFIGS, name))
    assert cfg.policies and all(0.0 <= c < 1.0 for c in cfg.compressions)


@pytest.mark.parametrize("name", _by_mode("pretrain", "distill_kvpop", "distill_lkv"))
def test_train_configs_parse(name):
    from kvjax.configio import load_config
    from kvjax.train.config import TrainConfig

    cfg = load_config(TrainConfig, os.path.join(CONFIGS, name))
    assert cfg.total_steps >= 1


def test_quality_configs_were_found():
    assert {"testbed-quality.yaml", "testbed-ranking.yaml", "testbed-long.yaml"} <= set(_by_mode("quality"))
    assert "testbed-teacher-long.yaml" in _by_mode("pretrain")
