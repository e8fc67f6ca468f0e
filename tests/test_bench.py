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


def test_padding_report_counts_every_pair_once(tmp_path):
    """bench/padding.py on a tiny line-aligned corpus: both orders cover the same real tokens."""
    lines = [" ".join(["wort"] * (1 + i % 7)) for i in range(60)]
    (tmp_path / "train.de").write_text("\n".join(lines) + "\n")
    (tmp_path / "train.en").write_text("\n".join(reversed(lines)) + "\n")
    p = run([sys.executable, "bench/padding.py", "--data", str(tmp_path), "--vocab-size", "60", "--max-tokens", "64"])
    rows = [line.split("|")[1:-1] for line in p.stdout.splitlines() if line.startswith("| 64 ")]
    assert len(rows) == 2
    totals = []
    for _, _, n, src_real, tgt_real, per_batch in rows:
        assert int(n) >= 2 and 0 < float(src_real) <= 1 and 0 < float(tgt_real) <= 1
        totals.append(int(n) * float(per_batch.replace(",", "")))
    assert abs(totals[0] - totals[1]) < 1e-6 * totals[0]  # the same sentences, only batched differently
