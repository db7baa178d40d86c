import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """``hf_dir(name, **save_kw) -> (folder, torch model)``, built once per session."""
    from hf_models import save_hf_model

    made = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(name)
            made[key] = (folder, save_hf_model(name, folder, **kw))
        return made[key]

    return get


# Modules that load the real model, train, spawn processes or compile many programs: `make test`
# runs them, `make test-fast` (the inner loop, < 3 minutes on 2 cores) leaves them out.
INTEGRATION = {
    "convert/test_real_model.py", "traces/test_traces.py", "train/test_train_loop.py",
    "train/test_distill_kvpop.py", "train/test_distill_lkv.py", "train/test_sharding.py",
    "evaluation/test_eval_cli.py", "kernels/test_kernels.py", "generation/test_generate.py",
    "eviction/test_eviction_state.py", "project/test_device_check.py", "scorers/test_export.py",
    "train/test_key_dropout.py", "scorers/test_scorer_fit.py", "longctx/test_tasks.py",
    "longctx/test_longctx_run.py", "evaluation/test_trace_retention.py", "eviction/test_prompt_compressed.py",
}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.fspath), here).replace(os.sep, "/")
        if rel in INTEGRATION:
            item.add_marker(pytest.mark.integration)
