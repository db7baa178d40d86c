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


def test_stages_are_chained_end_to_end(tmp_path):
    from kvjax.evaluation.learning_curve import chained_rows

    for name, steps in (("a", (100, 200)), ("b", (50, 100))):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "wall_s": 2.0 * s, "answer": s / 1000} for s in steps]
        (tmp_path / name / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = chained_rows([tmp_path / "a", tmp_path / "b"])
    assert [r["step"] for r in rows] == [100, 200, 250, 300]
    assert [r["wall_s"] for r in rows] == [200.0, 400.0, 500.0, 600.0]
    out = plot_learning_curve([tmp_path / "a", tmp_path / "b"], tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="c/eval.jsonl"):
        chained_rows([tmp_path / "a", tmp_path / "c"])
