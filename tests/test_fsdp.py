"""transformer/train.py --fsdp (FSDP2 and torch.distributed.checkpoint) against DDP, on CPU with gloo: the same losses,
an exact resume after a SIGKILL in the middle of a sharded save, a resume on 3 processes, a DDP checkpoint as the
start, best.pt for translate.py, and the whole model as one unit. Nine short torchrun jobs, shared between the tests."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import PY, REPO, Evil, descendants_with_rank, free_port, popen, run, run_records, torchrun, torchrun_cmd

pytest.importorskip("tokenizers")
pytest.importorskip("sacrebleu")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

pytestmark = pytest.mark.slow

TRAIN, TRANSLATE = str(REPO / "transformer" / "train.py"), str(REPO / "transformer" / "translate.py")
# 8 steps of 2 micro-batches, a checkpoint after each, one evaluation at the end (best.pt)
ARGS = [TRAIN, "--synthetic", "--preset", "tiny", "--layers", "1", "--pack-len", "128", "--max-tokens", "512",
        "--accum-steps", "2", "-j", "0", "--lr", "1e-3", "--warmup-epochs", "0.2", "-p", "1",
        "--samples", "0"]  # fmt: skip
FSDP = [*ARGS, "--fsdp", "--max-steps", "8", "--save-every-steps", "1"]
NO_EVAL = ["--eval-every", "0"]  # for the runs whose evaluation no test reads


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if r["split"] == "train"}


def in_process(monkeypatch, module: str, *argv) -> None:
    """A script's entry point (transformer.train or transformer.translate) in this process, given its argv."""
    import importlib

    mod = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", list(map(str, argv)))
    mod.run_cli(mod.main, mod.get_args_parser().parse_args())


def shards(out, name="last") -> dict:
    """The weights and Adam's state that a checkpoint's shards hold, read back whole in this process."""
    ckpt = torch.load(out / f"{name}.pt", weights_only=True)
    dcp_to_torch_save(out / ckpt["shards"], out / f"{name}.whole")
    return torch.load(out / f"{name}.whole", weights_only=True)


def assert_equal_state(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for k, state in a["optimizer"]["state"].items():
        for name, v in state.items():
            assert torch.equal(v, b["optimizer"]["state"][k][name]), (k, name)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """2 DDP processes to step 8; step_00000004.pt, a copy of last.pt at step 4, starts an FSDP run below."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun(2, *ARGS, *NO_EVAL, "--max-steps", "8", "--save-every-steps", "4", "--keep-last", "2", "--output-dir", out)
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(2, *FSDP, "--output-dir", out)
    return out


def test_fsdp_trains_like_ddp(ddp, fsdp):
    """Both start from rank 0's initialization and average the same gradients (FSDP by reduce-scatter, with the
    clipping norm summed over shards): the losses of 8 steps agree to 1e-6 (the first steps bit for bit)."""
    a, b = losses(ddp), losses(fsdp)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert a[1] == b[1] and a[8] < a[1] - 0.5, (a, b)  # the same start, and it trains
    assert all(b[s] == pytest.approx(a[s], rel=1e-6, abs=0) for s in a), (a, b)


def test_sigkill_during_a_sharded_save_then_the_same_command_ends_as_one_run(fsdp, tmp_path):
    """Rank 0 killed while the ranks write a checkpoint's shards (their temporary directory exists, not yet renamed):
    the same command resumes from the last complete checkpoint, removes the torn directory, and ends with the same
    weights and Adam state, bit for bit, and the same records as the uninterrupted run."""
    out = tmp_path / "run"
    proc = popen(torchrun_cmd(2, *FSDP, "--output-dir", out))
    partial = lambda: [n for n in os.listdir(out) if re.fullmatch(r"\.last\..*\.dcp", n)] if out.exists() else []  # noqa: E731
    deadline, torn = time.time() + 120, []
    while not torn and time.time() < deadline and proc.poll() is None:
        if partial() and os.path.exists(out / "last.pt"):  # a save after a complete one is under way
            rank0 = descendants_with_rank(proc.pid, 0)[0]
            os.kill(rank0, signal.SIGSTOP)
            torn = partial()
            os.kill(rank0, signal.SIGKILL if torn else signal.SIGCONT)
        time.sleep(0.001)
    log, _ = proc.communicate(timeout=120)
    assert torn and proc.returncode != 0, ("no save caught", log[-3000:])
    before = torch.load(out / "last.pt", weights_only=True)["step"]
    log = run(torchrun_cmd(2, *FSDP, "--output-dir", out)).stdout
    assert re.search(rf"resumed from .*last.pt: epoch 0, step {before},", log), log[-3000:]
    assert not set(torn) & set(os.listdir(out))  # the killed write's directory is gone
    assert len(list(out.glob("last.*.dcp"))) == 1 and len(list(out.glob("best.*.dcp"))) == 1
    assert_equal_state(shards(fsdp), shards(out))
    assert run_records(out) == run_records(fsdp)


def test_resume_on_three_processes_reshards(fsdp, tmp_path):
    """2 processes' checkpoint resumed by 3: the shards are read into 3 parts, and training goes on from the same
    position (at the next epoch boundary, as after any change of world size), with Adam's state carried over; under
    --amp bf16 (weights gathered in bf16, gradients reduced in fp32) from an fp32 run. A file named like a directory
    of shards is left alone."""
    (tmp_path / "last.notes.dcp").write_text("")
    log = torchrun(3, *FSDP, *NO_EVAL, "--amp", "bf16", "--max-steps", "10", "--resume", fsdp / "last.pt",
                   "--output-dir", tmp_path).stdout  # fmt: skip
    assert "resumed from" in log and "epoch 0, step 8, batch 16 of the epoch" in log, log[-3000:]
    assert "world size 2 x accum 2, now 3 x 2" in log
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    train = [(r["step"], r["epoch"]) for r in records if r["split"] == "train"]
    assert train == [(9, 1), (10, 1)], records
    assert abs(losses(tmp_path)[9] - losses(fsdp)[8]) < 0.2  # not a fresh model's loss (about 1 higher)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["world_size"] == 3
    assert (tmp_path / "last.notes.dcp").is_file()
    state = shards(tmp_path)["optimizer"]["state"]
    assert all(s["step"].item() == 10 for s in state.values())  # 8 steps restored, 2 taken


def test_ddp_checkpoint_starts_fsdp_and_translate_reads_best_pt(ddp, fsdp, tmp_path, monkeypatch, capsys):
    """A DDP checkpoint (weights and Adam's state keyed by position) continues under --fsdp with DDP's losses; an FSDP
    best.pt holds the whole model, equal to its shards, and translate.py reads it; DDP refuses a sharded checkpoint."""
    out = tmp_path / "from_ddp"
    log = torchrun(2, *ARGS, *NO_EVAL, "--fsdp", "--max-steps", "8", "--resume", ddp / "step_00000004.pt",
                   "--output-dir", out)  # fmt: skip
    assert "epoch 0, step 4, batch 8 of the epoch" in log.stdout, log.stdout[-3000:]
    a, b = losses(ddp), losses(out)
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == pytest.approx(a[s], rel=1e-6, abs=0) for s in b), (a, b)
    best = torch.load(fsdp / "best.pt", weights_only=True)
    whole = shards(fsdp, "best")["model"]
    assert best["model"].keys() == whole.keys() and all(torch.equal(v, whole[k]) for k, v in best["model"].items())
    # translate.py's and train.py's entry points in this process, as `python SCRIPT ARGS` runs them
    in_process(monkeypatch, "transformer.translate", TRANSLATE, "--checkpoint", fsdp / "best.pt", "suta mine susu", "",
               "kaka mine")  # fmt: skip
    lines = capsys.readouterr().out
    assert len(lines.split("\n")) == 4 and lines.split("\n")[1] == "", lines
    with pytest.raises(SystemExit) as e:  # no weights in it: one line
        in_process(monkeypatch, "transformer.translate", TRANSLATE, "--checkpoint", fsdp / "last.pt", "kaka")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().endswith("whose weights are in shards: give its best.pt"), err
    with pytest.raises(SystemExit) as e:
        in_process(monkeypatch, "transformer.train", *ARGS, "--resume", fsdp / "last.pt", "--output-dir", out)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "sharded checkpoint of an FSDP run" in err, err
    two = tmp_path / "two_layers"  # a checkpoint of a deeper model (1 process): told by the weights it has in excess
    in_process(monkeypatch, "transformer.train", *ARGS, *NO_EVAL, "--layers", "2", "--max-steps", "1", "--output-dir",
               two)  # fmt: skip
    p = torchrun(2, *ARGS, *NO_EVAL, "--fsdp", "--resume", two / "last.pt", "--output-dir", tmp_path / "o", check=False)
    want = 'Error(s) in loading state_dict for FSDPTransformer: Unexpected key(s) in state_dict: "encoder.1.'
    assert p.returncode != 0 and "does not fit this model" in p.stderr and want in p.stderr, p.stderr[-3000:]


def test_a_foreign_or_torn_directory_of_shards_is_one_line_on_each_rank(fsdp, tmp_path):
    """Copies of the FSDP run resumed with their shards tampered with: a `.metadata` that pickles a call, a learning
    rate that does (the shards rewritten whole), a rank's file gone, a rank's file garbled. torch.distributed.
    checkpoint's own reader would run both pickles; here each of the 2 ranks ends with exit 2 and one error line, and
    last.pt stays as it was."""
    marker, runs = tmp_path / "ran", []
    for name, want in (("metadata", "posix.system has no place in a checkpoint's metadata"),
                       ("lr", "its optimizer.param_groups.0.lr is pickled code or objects"),
                       ("rank1", "is incomplete: __1_0.distcp is missing or truncated"),
                       ("garbled", "holds a shard that does not read back")):  # fmt: skip
        out = tmp_path / name
        shutil.copytree(fsdp, out)
        d = out / torch.load(out / "last.pt", weights_only=True)["shards"]
        if name == "metadata":
            (d / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
        elif name == "lr":
            whole = shards(out)
            whole["optimizer"]["param_groups"][0]["lr"] = Evil(marker)
            shutil.rmtree(d)
            dcp.save(whole, checkpoint_id=d, no_dist=True)
        elif name == "rank1":
            (d / "__1_0.distcp").unlink()
        else:  # whole, but every 7th byte overwritten
            b = bytearray((d / "__0_0.distcp").read_bytes())
            b[::7] = bytes(range(256)) * (len(b[::7]) // 256) + bytes(len(b[::7]) % 256)
            (d / "__0_0.distcp").write_bytes(bytes(b))
        port, last = free_port(), (out / "last.pt").read_bytes()
        for rank in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            proc = subprocess.Popen([PY, *FSDP, "--output-dir", out], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
            runs.append((proc, want, out, last))
    for proc, want, out, last in runs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.startswith("error: ") and err.count("\n") == 1 and want in err, err[-3000:]
        assert (out / "last.pt").read_bytes() == last
    assert not marker.exists()


def test_compiled_fsdp_trains_like_eager(fsdp, tmp_path):
    """--fsdp --compile: the compiled model runs between FSDP's hooks; 8 steps' losses match the eager run's to 1e-6."""
    torchrun(2, *FSDP, *NO_EVAL, "--compile", "--output-dir", tmp_path, timeout=300)
    a, b = losses(fsdp), losses(tmp_path)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(b[s] == pytest.approx(a[s], rel=1e-6, abs=0) for s in a), (a, b)


def test_one_unit_trains_like_ddp_and_a_layer_a_unit_resumes_it(ddp, tmp_path):
    """--fsdp model (the whole model one unit) for 4 steps, then the same command with --fsdp (a unit a layer) to 8:
    each step's loss agrees with DDP's to 1e-6, so the one-unit run trains like DDP and its shards hold the whole
    state (weights and Adam's) in the names and layout that a unit a layer reads back."""
    one_unit = [*ARGS, "--save-every-steps", "4", "--output-dir", tmp_path]
    torchrun(2, *one_unit, "--fsdp", "model", "--max-steps", "4")  # and an evaluation at its end, weights gathered
    log = torchrun(2, *one_unit, *NO_EVAL, "--fsdp", "--max-steps", "8").stdout
    assert "epoch 0, step 4, batch 8 of the epoch" in log, log[-3000:]
    a, b = losses(ddp), losses(tmp_path)
    assert sorted(b) == list(range(1, 9)) and a[1] == b[1], (a, b)
    assert all(b[s] == pytest.approx(a[s], rel=1e-6, abs=0) for s in a), (a, b)
