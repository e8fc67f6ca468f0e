"""--wandb with the real wandb package in offline mode: a resumed run goes on logging into the same wandb run (the id
saved in last.pt as ``wandb_id``), ``--resume none --overwrite`` starts another, and the files land in the output dir.

Mutation that fails it: in common/metrics.py, ``wandb.init(...)`` without ``id=self.pos.wandb_id`` (every start is a
new wandb run: the resumed run's offline directory and checkpoint carry another id, and neither run holds steps 1-4).
"""

import json
import shutil
import struct
import zlib
from pathlib import Path

import torch

from tests.conftest import PY, make_jpeg_imagefolder, run, run_parallel

BLOCK, HEADER = 32768, 7  # the LevelDB log format of a .wandb file: 32 KiB blocks, 7-byte chunk headers


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``run-<id>.wandb`` file (wandb 0.31 ships no Python reader): a
    7-byte file header, then LevelDB log chunks (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:HEADER] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:HEADER]
    pos, parts = HEADER, b""
    while pos < len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + HEADER : pos + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at {pos}"
        pos, parts = pos + HEADER + length, parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_run(run_dir: Path) -> tuple[str, str, dict[int, dict]]:
    """(project, run id, {step: logged values}) of one offline run directory."""
    (path,) = run_dir.glob("run-*.wandb")
    project, run_id, history = None, None, {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "run":
            project, run_id = r.run.project, r.run.run_id
        elif r.WhichOneof("record_type") == "history":
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = values
    return project, run_id, history


def test_resume_continues_the_wandb_run_and_overwrite_starts_another(tmp_path):
    """A run stopped at step 2, then in parallel: the same command resumed to step 4, and a copy of the stopped run
    started over with --resume none --overwrite."""
    dirs = {name: tmp_path / name for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    for d in dirs.values():
        d.mkdir()  # nothing of wandb's outside tmp_path
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{k: str(v) for k, v in dirs.items()}}
    data = make_jpeg_imagefolder(tmp_path / "imgs", {"train": 24, "test": 6}, classes=10)  # 6 test images: fast

    def cmd(out, *more):
        return [PY, "cifar_resnet/train.py", "--data-dir", data, "-a", "resnet20", "-b", "4", "-j", "0", "-p", "1",
                "--output-dir", out, "--wandb", *more]  # fmt: skip

    out, over = tmp_path / "out", tmp_path / "over"
    run(cmd(out, "--max-steps", "2"), env=env)
    first = torch.load(out / "last.pt", weights_only=True)["wandb_id"]
    shutil.copytree(out, over)
    resumed, overwritten = (
        cmd(out, "--max-steps", "4"),
        cmd(over, "--max-steps", "1", "--resume", "none", "--overwrite"),
    )
    procs = run_parallel([resumed, overwritten], env=env)
    assert [p.returncode for p in procs] == [0, 0], [p.err[-2000:] for p in procs]

    assert first and torch.load(out / "last.pt", weights_only=True)["wandb_id"] == first
    runs = sorted((out / "wandb").glob("offline-run-*"))  # offline-run-<date>_<time>-<id>, one per start
    assert [r.name.rsplit("-", 1)[1] for r in runs] == [first, first], runs
    logged = {}
    for r in runs:
        project, run_id, history = offline_run(r)
        assert (project, run_id) == ("cifar_resnet", first)
        logged.update(history)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(logged) == [1, 2, 3, 4] == [r["step"] for r in recs if r["split"] == "train"]
    assert [r["step"] for r in recs if r["split"] == "test"] == [2, 4]
    for r in recs:  # every number of every record, as <split>/<key> at its step
        numbers = {f"{r['split']}/{k}": v for k, v in r.items() if k not in ("split", "time")}
        assert numbers.items() <= logged[r["step"]].items(), (numbers, logged[r["step"]])
    assert not any(dirs["WANDB_DIR"].iterdir())  # wandb's files are in the output dir, not in WANDB_DIR

    new = torch.load(over / "last.pt", weights_only=True)["wandb_id"]
    (latest,) = set((over / "wandb").glob("offline-run-*")) - {over / "wandb" / r.name for r in runs}
    project, run_id, history = offline_run(latest)
    assert new != first and run_id == new and latest.name.endswith(f"-{new}")
    assert sorted(history) == [1] and "train/loss" in history[1] and "test/acc1" in history[1]
