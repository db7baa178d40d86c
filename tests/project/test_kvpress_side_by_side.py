"""``experiments/kvpress_side_by_side.py``: kvjax's store and kvpress's records joined on the same problem
ids; the every-row table covers the problems every kvjax row and kvpress's dense run answered,
and names the presses not yet run on all of them."""

import importlib.util
import os

from paths import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("kvpress_side_by_side",
                                                  os.path.join(ROOT, "experiments", "kvpress_side_by_side.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ours(policy, comp, index, score, answer="x"):
    return {"policy": policy, "compression": comp, "length": 1024, "task": "niah_noise", "index": index,
            "score": score, "answer": answer}


def _theirs(press, comp, index, score, output="x"):
    return {"press": press, "compression": comp, "id": f"1024/niah_noise/{index}", "score": score,
            "output": output}


def _records():
    ours, theirs = [], []
    for i in range(3):
        ours += [_ours("dense", 0.0, i, 1.0), _ours("snapkv", 0.75, i, float(i == 0), answer=f"a{i}"),
                 _ours("snapkv", 0.88, i, 0.0)]
        theirs += [_theirs("none", 0.0, i, 1.0), _theirs("snapkv", 0.75, i, float(i < 2), output=f"a{i}")]
        if i < 2:                                         # keydiff never ran problem 2 at 88%
            theirs += [_theirs("keydiff", 0.75, i, 0.5), _theirs("keydiff", 0.88, i, 0.0)]
        theirs.append(_theirs("snapkv", 0.88, i, 0.0))
    return ours, theirs


def test_same_method_rows_count_equal_texts_and_scores():
    ours, theirs = _records()
    table = _bench().side_by_side(ours, theirs)
    row = next(line for line in table.splitlines() if line.startswith("| snapkv | 75%"))
    # kvjax scores 1/3, kvpress 2/3; texts a0 a1 a2 equal on all three; scores equal on problems 0 and 2
    assert row.split(" | ")[2:] == ["3", "33.3% ± 33.3%", "66.7% ± 33.3%", "3/3", "2/3 |"]
    assert "keydiff" not in table                        # no kvjax counterpart: not in the matched table


def test_every_row_table_names_a_press_not_run_on_every_problem_instead_of_shrinking():
    ours, theirs = _records()
    table = _bench().every_row(ours, theirs)
    assert table.splitlines()[0].startswith("3 problems (1024/niah_noise: 3)")
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in table.splitlines()
            if line.startswith("| kv")}
    assert list(rows) == [("kvjax", "dense"), ("kvjax", "snapkv"), ("kvpress", "none"), ("kvpress", "snapkv")]
    assert rows[("kvjax", "dense")].endswith("| 100.0% ± 0.0% | 100.0% ± 0.0% |")   # dense in every column
    assert rows[("kvjax", "snapkv")].endswith("| 33.3% ± 33.3% | 0.0% ± 0.0% |")
    assert rows[("kvpress", "snapkv")].endswith("| 66.7% ± 33.3% | 0.0% ± 0.0% |")
    # keydiff never ran problem 2 at 88%: named with its record count, not in the table
    assert table.endswith("Not yet on all 3 problems at every column, so left out: keydiff (4 records).")
    # each library's best evicting row at 75% (snapkv: 1/3 here, 2/3 in kvpress), paired by problem
    assert "At 75%: kvjax's best, snapkv, minus kvpress's best, snapkv: -33.3 ± 33.3 points" in table


def test_every_row_table_drops_columns_kvjax_does_not_hold():
    ours, theirs = _records()
    theirs += [_theirs("snapkv", 0.94, i, 0.0) for i in range(3)]     # a 94% sweep kvjax has no rows for
    table = _bench().every_row(ours, theirs)
    assert "| library | policy | 75% | 88% |" in table and "94%" not in table


def test_every_row_table_says_when_no_problem_is_shared():
    ours, theirs = _records()
    theirs = [dict(r, id="2048/qa/0") for r in theirs]
    assert _bench().every_row(ours, theirs).startswith("no problem is answered")
