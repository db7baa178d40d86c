import os
import resource
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama():
    """A random 2-layer Llama (4 query / 2 KV heads, head_dim 16, vocab 97) with sharp attention."""
    from flax import nnx

    import kvjax

    cfg = kvjax.ModelConfig("llama", 97, 32, 64, 2, 4, 2, 16, max_position_embeddings=512, eos_token_id=2)
    return kvjax.Decoder(cfg, rngs=nnx.Rngs(0), init_std=0.3, embed_init_std=1.0)


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
# runs them, `make test-fast` (the inner loop, < 3 minutes on 2 cores) leaves them out. Listed
# heaviest first (CI's durations): the run schedules them first, so that the two xdist workers
# (--dist loadfile hands out whole files in collection order) finish together instead of one
# idling while the other runs a long file last.
INTEGRATION = (
    "evaluation/test_eval_cli.py", "convert/test_real_model.py", "generation/test_generate.py",
    "train/test_train_loop.py", "project/test_device_check.py", "kernels/test_kernels.py",
    "traces/test_traces.py", "train/test_distill_kvpop.py", "eviction/test_prompt_compressed.py",
    "longctx/test_longctx_run.py", "scorers/test_export.py", "eviction/test_chunked_prefill.py",
    "scorers/test_scorer_fit.py", "train/test_remat.py", "train/test_distill_lkv.py",
    "train/test_sharding.py", "eviction/test_eviction_state.py", "train/test_key_dropout.py",
    "project/test_shipped_teachers.py", "longctx/test_tasks.py", "evaluation/test_trace_retention.py",
    "train/test_teacher_cache.py", "longctx/test_decision_slice.py", "evaluation/test_long_generation.py",
)
# The heaviest files of the test-fast set, heaviest first, scheduled next for the same reason: in
# collection order train/test_targets.py (about 45 s) is handed out near the end. Idle test-fast runs
# took 3:25 before and 3:04 after this ordering, but they vary by 10-20 s from run to run.
HEAVY_FAST = (
    "eviction/test_lkv_policies.py", "train/test_targets.py", "scorers/test_lkv.py", "scorers/test_scorers.py",
    "eviction/test_fenwick_keep_rule.py", "evaluation/test_oracle.py", "eviction/test_statistic_rows.py",
    "duo/test_duo.py", "dms/test_dms.py", "eviction/test_learned_policies.py", "eviction/test_budgets.py",
)
ORDER = INTEGRATION + HEAVY_FAST


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {}
    for item in items:
        rel = os.path.relpath(str(item.fspath), here).replace(os.sep, "/")
        if rel in INTEGRATION:
            item.add_marker(pytest.mark.integration)
        rank[item] = ORDER.index(rel) if rel in ORDER else len(ORDER)
    items.sort(key=rank.__getitem__)       # stable: a file's own tests keep their order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test file's compiled programs and traced closures are dropped after it: a worker runs
    dozens of files, and without this its memory only grows (the persistent XLA cache below
    makes a later file's recompile of the same program cheap)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    """One persistent XLA compilation cache per test run, shared by the xdist workers and the
    subprocesses they start (the same small models compile the same programs in many tests).
    Reads and writes hold the cache's file lock (a size cap turns it on), so concurrent
    processes never see a half-written entry. A run never reuses an earlier run's cache."""
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    config._kvjax_xla_cache = tempfile.mkdtemp(prefix="kvjax-test-xla-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=config._kvjax_xla_cache,
                      JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")


def pytest_unconfigure(config):
    folder = getattr(config, "_kvjax_xla_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _log_peak_memory(request):
    """``KVJAX_TEST_MEMLOG=file``: append each test whose run raised its process's peak RSS."""
    path = os.environ.get("KVJAX_TEST_MEMLOG")
    if not path:
        yield
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if after > before:
        with open(path, "a") as f:
            f.write(f"{after / 2**20:.2f} GiB peak (+{(after - before) / 2**20:.2f}) pid {os.getpid()} {request.node.nodeid}\n")
