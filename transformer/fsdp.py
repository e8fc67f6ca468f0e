"""FSDP2 for train.py --fsdp: the model sharded over the processes, checkpoints through torch.distributed.checkpoint.

Under DDP every rank holds the whole model, its gradients and Adam's two moments: 16 bytes a parameter. FSDP2
(`fully_shard`) keeps 1/N of each on each of N ranks, and gathers one layer's weights (--fsdp model: all of them)
just before its forward and backward. `last.pt` (or `best.pt`) holds the rest and names `last.<step>-<tag>.dcp/`,
the shards each rank wrote, which any number of ranks reads back. torch.distributed's modules load slowly: lazily."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import save_checkpoint, strip_prefixes
from common.distributed import broadcast_object
from common.errors import UserError


def shard(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device, unit: str) -> torch.nn.Module:
    """``unit`` "layer": each encoder and decoder layer one unit (gathered for its forward and backward, then freed),
    the embedding and final norms the root's. "model": the root's one unit, gathered once a step (each unit costs host
    time a step: small layers, as in `base`, compute in less, and the GPU waits). The model goes from the host to
    ``device`` a layer at a time. Under bf16 the weights are gathered in bf16, the gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise UserError("--fsdp needs 2 or more processes (torchrun --nproc_per_node=N ...)")
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for layer in [*model.encoder, *model.decoder]:
        _from_rank0(layer.to(device))
        if unit == "layer":
            fully_shard(layer, mp_policy=mp)
    for name, child in model.named_children():
        if name not in ("encoder", "decoder"):
            _from_rank0(child.to(device))
    for name, buffer in model.named_buffers(recurse=False):
        setattr(model, name, buffer.to(device))
    fully_shard(model, mp_policy=mp)
    return model


def _from_rank0(module: torch.nn.Module) -> None:
    """Rank 0's weights on every rank: all start from one initialization, as under DDP."""
    for t in module.state_dict().values():
        dist.broadcast(t, src=0)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module):
    """Micro-batches that do not step keep their gradients unsharded and unreduced, like DDP's no_sync."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def whole_weights(model: torch.nn.Module):
    """Every rank holds all the weights for evaluation (ranks decode different numbers of batches: no forward may
    wait for the others), gathered once, in one order everywhere. Decoding calls the layers without the root's
    forward, fine once the root has run forward (evaluate() computes the loss first)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first
    for m in units:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(m is not model, recurse=False)  # the root keeps its weights in training
            m.reshard()


def save(state: dict, model, optimizer, path: Path, whole: bool) -> None:
    """`path` and its directory of shards, by every rank: each writes its shards of the weights and optimizer state
    into a temporary directory, which rank 0 renames into place once all are done, then writes `path` (``state`` less
    the tensors, naming the shards), then removes older shards: a kill leaves the previous checkpoint whole.
    ``whole``: `path` also holds the whole model for translate.py."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    tag = broadcast_object(f"{state['step']:08d}-{time.time_ns():x}")  # one name on every rank
    tmp, final = path.with_name(f".{path.stem}.{tag}.dcp"), path.with_name(f"{path.stem}.{tag}.dcp")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)  # returns once all ranks wrote
    whole_options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered tensor by tensor to the host
    weights = get_model_state_dict(model, options=whole_options) if whole else {}
    if dist.get_rank() == 0:
        os.replace(tmp, final)
        save_checkpoint({**state, "model": weights, "optimizer": {}, "shards": final.name}, path)
        for old in path.parent.glob(f"*{path.stem}.*.dcp"):
            if old != final and old.is_dir():  # a file of that name is not one of ours
                shutil.rmtree(old)


class _MetadataUnpickler(pickle.Unpickler):
    """A shard directory's `.metadata` (torch.distributed.checkpoint pickles it whole): only the classes it holds,
    so that a foreign directory cannot run code, as `weights_only=True` ensures for a `.pt` file."""

    ALLOWED = {("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}  # fmt: skip

    def find_class(self, module: str, name: str):
        known = (module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata" and "." not in name
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        found = super().find_class(module, name) if known or dtype else None  # no other module is even imported
        if found is None or not (dtype or (module, name) in self.ALLOWED or isinstance(found, type)):
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's metadata")
        return found


def _shard_reader(path: Path, ckpt: dict) -> tuple:
    """A reader of the shards that ``ckpt`` (read from ``path``) names, once its `.metadata` is read safely and every
    file it lists is there, whole; values that are not tensors (the LR) must load with `weights_only=True` too."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    name = ckpt["shards"]
    shards = path.parent / name if isinstance(name, str) and name == Path(name).name else None
    if shards is None or not shards.is_dir():
        raise UserError(f"{path} names the directory {name!r} beside it, which is missing (copy both)")
    try:
        with open(shards / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        ends = {(s.relative_path, s.offset + s.length) for s in metadata.storage_data.values()}
    except Exception as e:  # whatever a torn or foreign file makes the unpickler raise
        detail = e.strerror if isinstance(e, OSError) else str(e)[:160]
        raise UserError(f"cannot read {shards}/.metadata: {detail} (copy the directory whole)") from None
    for file, end in sorted(ends):
        if file != Path(file).name or not (shards / file).is_file() or (shards / file).stat().st_size < end:
            raise UserError(f"{shards} is incomplete: {file} is missing or truncated (copy the directory whole)")

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the one read above, as FileSystemReader completes it
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):  # sizes were checked while planning: what fails here is the bytes
            try:
                return super().read_data(plan, planner)
            except UserError:
                raise
            except Exception as e:
                raise UserError(f"{shards} holds a shard that does not read back ({type(e).__name__}; copy the "
                                "directory whole, or resume from another checkpoint)") from None  # fmt: skip

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            try:  # the default reads them with pickle: only once they are plain values
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise UserError(f"refusing to load {shards}: its {read_item.dest_index.fqn} is pickled code or "
                                "objects, not a plain value (only load checkpoints you trust)") from None  # fmt: skip
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader(shards), Planner()


def load(path: Path, ckpt: dict, model, optimizer) -> None:
    """The weights and optimizer state of ``ckpt`` into the sharded model and optimizer: an FSDP checkpoint's shards
    (resharded to this number of ranks), or a single-file checkpoint of a DDP run (every rank keeps its part)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    try:
        if "shards" in ckpt:
            reader, planner = _shard_reader(path, ckpt)
            model_state, optim_state = sd.get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, storage_reader=reader, planner=planner)
            sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            return
        # a DDP run's single file: the weights first, so that a model of another size is told by its first tensor
        whole = sd.StateDictOptions(full_state_dict=True)
        sd.set_model_state_dict(model, strip_prefixes(ckpt["model"]), options=whole)
        # the DDP optimizer's state is keyed by position in the parameter groups: name each by its parameter
        names = {p: n for n, p in model.named_parameters()}
        fqn = [names[p] for group in optimizer.param_groups for p in group["params"]]
        saved = ckpt["optimizer"]
        groups = [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved["param_groups"]]
        optim_state = {"state": {fqn[i]: s for i, s in saved["state"].items()}, "param_groups": groups}
        sd.set_optimizer_state_dict(model, optimizer, optim_state, options=whole)
    except (RuntimeError, ValueError, KeyError, IndexError, dcp.CheckpointException) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, dcp.CheckpointException) else e  # one rank's
        if isinstance(cause, UserError):
            raise cause from None
        detail = " ".join(str(cause).split())[:240]
        raise UserError(f"checkpoint {path} does not fit this model (another preset or size?): {detail}") from None
