"""Where things are, for tests in any subfolder of ``tests/``."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))   # the helpers (hf_models, train_helpers, sharded_*.py)
ROOT = os.path.dirname(TESTS)                         # the repository (train.py, eval.py, configs/)
