"""DDP equivalence and exact distributed evaluation, with real torchrun processes."""

import json
import sys

import torch

from tests.conftest import REPO, run_parallel, torchrun_cmd


def run_all(cmds):
    for p in run_parallel(cmds):
        assert p.returncode == 0, p.err[-3000:]


def test_ddp_two_procs_equal_one_proc_double_batch(tmp_path):
    """2 processes under torchrun x batch 4 == 1 process x batch 8 (in this process, as is the negative control:
    rank 0's shard trained alone at batch 4, what each rank would do without gradient averaging)."""
    sys.path.insert(0, str(REPO / "tests/helpers"))
    import ddp_equiv

    run_all([torchrun_cmd(2, REPO / "tests/helpers/ddp_equiv.py", "--batch-size", "4", "--out", tmp_path / "ddp.pt")])
    ddp = torch.load(tmp_path / "ddp.pt")
    single, noddp = ddp_equiv.train(8), ddp_equiv.train(4, rank=0, world_size=2, ddp=False)
    assert torch.get_default_dtype() == torch.float32 and single["0.weight"].dtype == torch.float64
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=1e-9, atol=1e-10)
    # negative control: without gradient averaging the result really differs
    assert any((noddp[k] - single[k]).abs().max() > 1e-4 for k in single)
    assert (single["0.weight"] - ddp_equiv.make_model()[0].weight).abs().max() > 0  # it trained at all


def test_exact_eval_identical_for_world_sizes_1_2_3(tmp_path, tiny_imagefolder, monkeypatch):
    """13 test images: no world size divides it; every image must be counted exactly once. The training and the
    1-process evaluation run the script's entry point in this process, the 2- and 3-process ones under torchrun."""
    import cifar_resnet.train as train

    out = tmp_path / "train"
    common = ["--data-dir", tiny_imagefolder, "-a", "resnet20", "-b", "4", "-j", "0", "--epochs", "1"]
    common += ["--max-steps", "2", "--seed", "1"]
    evaluate = ["cifar_resnet/train.py", *common, "-e", "--resume", out / "last.pt", "--output-dir"]
    for argv in (["cifar_resnet/train.py", *common, "--output-dir", out], [*evaluate, tmp_path / "eval1"]):
        monkeypatch.setattr(sys, "argv", list(map(str, argv)))
        train.run_cli(train.main, train.get_args_parser().parse_args())
    run_all([torchrun_cmd(n, *evaluate, tmp_path / f"eval{n}") for n in (2, 3)])
    records = []
    for n in (1, 2, 3):
        d = tmp_path / f"eval{n}"
        rec = [json.loads(line) for line in open(d / "metrics.jsonl")]
        assert len(rec) == 1 and rec[0]["split"] == "test"
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["world_size"] == n and cfg["launcher"] == ("single" if n == 1 else "torchrun")
        records.append(rec[0])
    for r in records:
        assert r["count"] == 13
        for k in ("loss", "acc1", "acc5"):
            assert abs(r[k] - records[0][k]) < 1e-6, (k, records)
