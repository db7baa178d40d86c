"""``bench/device_check.py --smoke``: every section at tiny sizes on the CPU (interpret mode),
in its own process, without grain installed, in under 3 minutes."""

import json
import os
import subprocess
import sys
import time

from paths import ROOT


def test_smoke_runs_every_section_without_grain(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "grain.py").write_text("raise ImportError('grain is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker), JAX_PLATFORMS="cpu")
    t = time.time()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "device_check.py"), "--smoke", "--out",
                          str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    elapsed = time.time() - t
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    secs = report["sections"]
    assert set(secs) == {"env", "correctness", "kernels", "decode", "longgen", "distill"}
    assert all(s["ok"] for s in secs.values()), {k: s.get("error") for k, s in secs.items()}
    assert secs["env"]["grain"].startswith("absent")
    assert secs["correctness"]["all_ok"] and len(secs["correctness"]["checks"]) == 14
    assert {r["impl"] for r in secs["decode"]["rows"]} == {"kvjax-dense", "kvjax-kvpop"}
    assert all("step_s" in r for r in secs["distill"]["rows"])
    longgen = {(r["model"], r["impl"], r["batch"]) for r in secs["longgen"]["rows"] if "tokens_per_s" in r}
    assert {(i, b) for m, i, b in longgen if m == "tiny"} == {
        (i, b) for i in ("kvjax-dense", "kvjax-kvpop", "kvjax-streaming_llm") for b in (1, 8)}, secs["longgen"]
    assert "## correctness: ok" in (tmp_path / "out" / "device_check.md").read_text()
    assert elapsed < 180, elapsed
