"""The teacher's learning-curve plot from a run's eval.jsonl."""

import json

import pytest

from kvjax.evaluation.learning_curve import plot_learning_curve


def test_learning_curve_plots_eval_log_and_names_a_missing_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FileNotFoundError, match="eval.jsonl: no held-out evaluations"):
        plot_learning_curve(run)
    rows = [{"step": s, "wall_s": 60.0 * s, "lookup_near": 0.1 * s, "lookup_far": 0.05 * s, "compute": 0.2,
             "answer": 0.0} for s in (1, 2, 3)]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_learning_curve(run, tmp_path / "curve.png")
    assert out == tmp_path / "curve.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
