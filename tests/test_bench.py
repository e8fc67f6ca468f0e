"""The benchmark entry point in its tiny CPU mode: every measurement runs end to end and reports a number."""

import json
import sys

from conftest import REPO, run


def test_benchmark_tiny_mode_runs_every_measurement(tmp_path):
    out = tmp_path / "bench"
    run([sys.executable, "bench/benchmark.py", "--tiny", "--out", str(out)], cwd=REPO, timeout=600)
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert not [r["what"] for r in rows if r["what"].startswith("FAILED")]
    assert {r["bench"] for r in rows} == {"resnet50", "jpeg", "cifar", "transformer"}
    for r in rows:  # every row measured something: a positive rate, and script rows name their exact command
        rate = r.get("img_per_s") or r.get("tok_per_s")
        assert rate and rate > 0, r
        assert ("cmd" in r) == r["what"].startswith(("imagenet/", "cifar_resnet/", "transformer/")), r
    assert res["env"]["torch"] and "| bench | what |" in (out / "results.md").read_text()
