"""The one training loop (kvjax/train/step_loop.py): stop on a signal with a checkpoint, exact
resume, the resume rule's refusal of another run, and the metrics history."""

import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.train.checkpoint import Checkpointer, CheckpointError
from kvjax.train.metrics_log import MetricsLog
from kvjax.train.step_loop import StepLoop, logged_history, plain, resume


def _step(signal_at=None):
    def step_fn(state, step):
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGINT)          # as Ctrl-C would, during step `step`
        x = state["x"] * 0.9 + step
        return {"x": x}, {"loss": jnp.sum(x), "step_seen": jnp.float32(step)}

    return step_fn


def _loop(tmp_path, meta, **kw):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, async_save=False)
    return StepLoop(7, ckpt, plain(meta), "test", checkpoint_every=3, log=MetricsLog(tmp_path, tensorboard=False),
                    progress=False, **kw)


def test_a_signal_stops_with_a_checkpoint_and_the_run_resumes_exactly(tmp_path):
    x0 = {"x": jnp.arange(4, dtype=jnp.float32)}
    whole, _ = _loop(tmp_path / "a", {"run": 1}).run(x0, _step(), 0)
    loop = _loop(tmp_path / "b", {"run": 1})
    state, summary = loop.run(x0, _step(signal_at=4), 0)
    assert summary["stopped_at"] == 5 and summary["signal"] == "SIGINT"
    assert loop.ckpt.latest_step() == 5                  # saved at the stop, not only every 3 steps
    loop.ckpt.close()
    loop = _loop(tmp_path / "b", {"run": 1})
    restored, start = resume(loop.ckpt, x0, loop.meta)
    assert start == 5
    np.testing.assert_allclose(np.asarray(restored["x"]), np.asarray(state["x"]))
    final, summary = loop.run(restored, _step(), start)
    np.testing.assert_allclose(np.asarray(final["x"]), np.asarray(whole["x"]), rtol=1e-6)
    assert "stopped_at" not in summary and summary["last_metrics"]["step_seen"] == 6
    hist = logged_history(tmp_path / "b", ("step_seen",))
    assert [h[0] for h in hist] == list(range(7))
    loop.ckpt.close()


def test_the_resume_rule_refuses_another_runs_checkpoint(tmp_path):
    x0 = {"x": jnp.zeros(3)}
    loop = _loop(tmp_path, {"run": 1, "shape": (3,)})
    loop.run(x0, _step(), 0)
    loop.ckpt.close()
    other = _loop(tmp_path, {"run": 2, "shape": (3,)})
    with pytest.raises(CheckpointError, match="its 'run' differs"):
        resume(other.ckpt, x0, other.meta)
    same = _loop(tmp_path, {"run": 1, "shape": (3,)})       # tuples compare as they read back
    assert resume(same.ckpt, x0, same.meta)[1] == 7
