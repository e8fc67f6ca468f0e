"""Checkpoints: round trip, prefix stripping, atomic writes under SIGKILL, clear errors, safe loading (the core's
``torch.load(weights_only=True)``, and hardening's check of a checkpoint before a run starts)."""

import contextlib
import os
import pickle
import random
import signal
import subprocess
import time

import pytest
import torch
import torch.nn as nn

from common.checkpoint import CheckpointWriter, load_model_state, resolve_resume, save_checkpoint, strip_prefixes
from common.errors import UserError
from common.hardening.checks import check_checkpoint
from tests.conftest import PY, REPO


def load_checkpoint(path):  # what a script does, after hardening checked the file
    check_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def test_round_trip_is_exact_and_weights_only(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 2,
        "step": 17,
        "args": {"lr": 0.1, "arch": "x", "none": None},
        "rng": torch.get_rng_state(),
    }
    save_checkpoint(state, tmp_path / "last.pt")
    back = load_checkpoint(tmp_path / "last.pt")
    assert back["step"] == 17 and back["args"] == state["args"]
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)
    model2 = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    load_model_state(model2, back["model"], "x")
    assert torch.equal(model2[0].weight, model[0].weight)
    assert not list(tmp_path.glob("*.tmp"))  # no temp files left behind


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
def test_background_writer_saves_the_state_as_it_was_when_asked(tmp_path, device):
    """Training changes the weights in place right after save(): the file must hold the state of the save() call.
    On a GPU the copies queue behind a long kernel: the writer must wait for them, not write its buffers as found."""
    w = torch.full((4_000_000,), 7.0, device=device)
    state = {"model": {"w": w}, "optimizer": {"state": {0: {"m": w[:5]}}, "param_groups": [{"lr": 0.1}]}, "step": 3}
    writer = CheckpointWriter()
    for step in (3, 4):
        if device == "cuda":
            torch.cuda._sleep(200_000_000)  # the GPU busy for a while, the copies queued behind
        state["step"] = step
        writer.save(state, tmp_path / "last.pt", keep_last=2)  # the second waits for the first write
        w.add_(1.0)  # the next optimizer step, while the file is being written
    writer.wait()
    back, first = load_checkpoint(tmp_path / "last.pt"), load_checkpoint(tmp_path / "step_00000003.pt")
    assert back["step"] == 4 and torch.equal(back["model"]["w"], torch.full((4_000_000,), 8.0))
    assert first["step"] == 3 and torch.equal(first["model"]["w"], torch.full((4_000_000,), 7.0))
    assert torch.equal(first["optimizer"]["state"][0]["m"], torch.full((5,), 7.0))
    assert not list(tmp_path.glob("*.tmp"))
    state["optimizer"]["state"][0]["m"] = w[:6]  # a tensor of another shape: its buffer replaced, not added
    writer.save(state, tmp_path / "last.pt")
    writer.wait()
    assert len(writer.buffers) == 2 and torch.equal(load_checkpoint(tmp_path / "last.pt")["optimizer"]["state"][0]["m"],
                                                    torch.full((6,), 9.0))  # fmt: skip


def test_background_writer_raises_a_failed_write(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    writer = CheckpointWriter()
    writer.save({"model": {}}, tmp_path / "a_file" / "last.pt")
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # raised once; the writer is usable again


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_prefix_stripping_both_orders(prefix):
    sd = {f"{prefix}0.weight": 1, f"{prefix}0.bias": 2}
    assert strip_prefixes(sd) == {"0.weight": 1, "0.bias": 2}


def test_a_wrapped_models_weights_load_into_the_bare_model():
    m = nn.Linear(2, 2)
    wrapped = torch.compile(m)  # its state dict's keys start with _orig_mod.
    assert all(k.startswith("_orig_mod.") for k in wrapped.state_dict())
    sd = {f"module.{k}": torch.zeros_like(v) for k, v in wrapped.state_dict().items()}  # and DDP's module.
    load_model_state(m, sd, "ckpt")
    assert m.weight.abs().sum() == 0


def test_mismatched_model_is_one_line_error(tmp_path):
    save_checkpoint({"model": nn.Linear(4, 10).state_dict()}, tmp_path / "a.pt")
    with pytest.raises(UserError, match=r"a\.pt does not fit this model"):
        load_model_state(nn.Linear(4, 5), load_checkpoint(tmp_path / "a.pt")["model"], tmp_path / "a.pt")


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", None])
def test_corrupt_or_truncated_file_names_the_file(tmp_path, content):
    p = tmp_path / "last.pt"
    if content is None:  # a real checkpoint cut in half
        save_checkpoint({"model": {"w": torch.randn(1000)}}, p)
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    else:
        p.write_bytes(content)
    with pytest.raises(UserError, match="last.pt") as e:
        load_checkpoint(p)
    assert "\n" not in str(e.value)


def test_foreign_file_is_refused(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "f.pt")
    with pytest.raises(UserError, match="not a checkpoint of this collection"):
        load_checkpoint(tmp_path / "f.pt")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "payload": _Evil(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match=r"refusing to load .*evil\.pt"):
        load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()
    # sanity: the payload is real (plain pickle would run it)
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(_Evil(marker), f)
    with open(tmp_path / "evil.pkl", "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_resolve_resume(tmp_path):
    assert resolve_resume("auto", tmp_path) is None
    (tmp_path / "last.pt").write_bytes(b"x")
    assert resolve_resume("auto", tmp_path) == tmp_path / "last.pt"
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume(str(tmp_path / "other.pt"), tmp_path) == tmp_path / "other.pt"  # hardening checks it is there


def test_keep_last_bounds_periodic_copies(tmp_path):
    for step in range(1, 6):
        save_checkpoint({"model": {}, "step": step}, tmp_path / "last.pt", keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_00000004.pt", "step_00000005.pt"]
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 5


def test_sigkill_during_save_never_breaks_last_pt(tmp_path):
    """SIGKILL a process that saves a 32 MB checkpoint in a loop, at random moments, repeatedly (6 savers, forked
    by one helper process that imports torch once)."""
    rnd = random.Random(0)
    pipe = subprocess.PIPE
    helper = [PY, str(REPO / "tests/helpers/save_loop.py"), str(tmp_path)]
    pid = None
    with subprocess.Popen(helper, stdin=pipe, stdout=pipe, text=True) as proc:
        try:
            for _ in range(6):
                proc.stdin.write("go\n")
                proc.stdin.flush()
                pid = int(proc.stdout.readline().split()[0])  # at least one complete save
                time.sleep(rnd.uniform(0.0, 0.4))
                os.kill(pid, signal.SIGKILL)
                for line in proc.stdout:  # the saver's last lines, then its end
                    if line.strip() == "dead":
                        break
                pid = None
                ckpt = load_checkpoint(tmp_path / "last.pt")  # must always load
                assert ckpt["model"]["w"][0].item() == ckpt["step"] >= 1
        finally:
            for p in (pid, proc.pid):  # on a failure, neither the saver nor the helper outlives the test
                if p is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)


def test_malicious_checkpoint_refused_by_resume_and_translate(tmp_path):
    """The same refusal through the command lines: cifar --resume PATH and translate.py --checkpoint."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": _Evil(marker)}, evil)
    cifar = [PY, "cifar_resnet/train.py", "--synthetic", "--max-steps", "1", "-j", "0", "--resume", str(evil),
             "--output-dir", str(tmp_path / "o")]  # fmt: skip
    translate = [PY, "transformer/translate.py", "--checkpoint", str(evil), "hallo welt"]
    for cmd in (cifar, translate):
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith(f"error: refusing to load {evil}"), p.stderr
        assert "Traceback" not in p.stderr
    assert not marker.exists()


def test_one_schema_for_every_script_and_its_resume(tmp_path):
    """checkpoint_state() writes DESIGN's keys (EMA under 'ema', script extras beside them); resume() puts every
    piece back and returns the position."""
    from common.checkpoint import Position, checkpoint_state, resume
    from common.utils import EMA

    def parts(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.amp.GradScaler("cpu", enabled=False), EMA(model, 0.9)

    model, opt, scaler, ema = parts(0)
    model(torch.randn(4, 3)).sum().backward()
    opt.step(), ema.update(1)
    args = type("Args", (), {"batch_size": 4, "accum_steps": 1})()
    pos = Position(epoch=1, step=7, batch_in_epoch=3, best_metric=12.5, log_lines=9, wandb_id="w")
    state = checkpoint_state(model, opt, scaler, pos, args, 2, ema, tokenizer="{}")
    assert set(state) == {"model", "optimizer", "scaler", "epoch", "step", "batch_in_epoch", "best_metric", "log_lines",
                          "wandb_id", "args", "world_size", "ema", "tokenizer"}  # fmt: skip
    wrapped = checkpoint_state(torch.compile(model), opt, scaler, pos, args, 2, ema)  # as the train loops pass it
    assert list(wrapped["model"]) == list(state["model"]) == list(model.state_dict())  # no _orig_mod., no module.
    save_checkpoint(state, tmp_path / "last.pt")
    fresh = parts(1)
    ckpt = load_checkpoint(tmp_path / "last.pt")
    got = resume(tmp_path / "last.pt", ckpt, *fresh, world_size=2, batch_size=4, accum_steps=1)
    assert got == pos and ckpt["tokenizer"] == "{}"
    for a, b in [(model, fresh[0]), (ema.module, fresh[3].module)]:
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert fresh[1].state_dict()["state"][0]["momentum_buffer"].equal(opt.state_dict()["state"][0]["momentum_buffer"])
    got = resume(tmp_path / "last.pt", ckpt, *parts(1), world_size=4, batch_size=4, accum_steps=1)
    assert (got.epoch, got.batch_in_epoch, got.step) == (1, 1, 7)  # 3 micro-batches of 2 x 4 = 1.5 of 4 x 4
