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
