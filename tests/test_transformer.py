"""transformer/: masks, tokenizer, token-budget sampler, learning, DDP end to end, resume, errors (CPU, gloo)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    PY,
    REPO,
    assert_same_training_state,
    run_records,
    torchrun,
    transformer_corpus,
    transformer_reference,
)

pytest.importorskip("tokenizers")
pytest.importorskip("sacrebleu")

from seq2seq import PRESETS, ModelConfig, Transformer, generate, padding_mask  # noqa: E402  (conftest: the folders)
from text import (  # noqa: E402
    EOS,
    PAD,
    PackedBatchSampler,
    PackedRows,
    ParallelDataset,
    decode,
    encode,
    load_corpus,
    read_text_dir,
    synthetic_corpus,
    train_tokenizer,
)

from common.checkpoint import Position  # noqa: E402
from common.distributed import mix_seed  # noqa: E402

TRAIN = str(REPO / "transformer" / "train.py")
TRANSLATE = str(REPO / "transformer" / "translate.py")


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=50, d_model=32, n_heads=4, enc_layers=2, dec_layers=2, d_ff=64)).eval()


# ------------------------------------------------------------------ masks


def test_causal_mask_later_tokens_never_change_earlier_outputs():
    model = tiny_model()
    src = torch.randint(4, 50, (3, 7))
    tgt = torch.randint(4, 50, (3, 9))
    out = model(src, tgt)
    for t in (1, 4, 8):
        changed = tgt.clone()
        changed[:, t:] = torch.randint(4, 50, changed[:, t:].shape)
        out2 = model(src, changed)
        torch.testing.assert_close(out2[:, :t], out[:, :t], rtol=0, atol=1e-6)
    earlier = tgt.clone()
    earlier[:, 0] = (earlier[:, 0] + 1 - 4) % 46 + 4
    assert not torch.allclose(model(src, earlier)[:, 1:], out[:, 1:])  # the test can see a change


def test_padding_never_changes_real_outputs():
    model = tiny_model()
    srcs = [torch.randint(4, 50, (n,)) for n in (3, 8, 5)]
    tgts = [torch.randint(4, 50, (n,)) for n in (6, 2, 4)]
    src = torch.full((3, 8), PAD)
    tgt = torch.full((3, 6), PAD)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        src[i, : len(s)], tgt[i, : len(t)] = s, t
    batched = model(src, tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        alone = model(s[None], t[None])[0]
        torch.testing.assert_close(batched[i, : len(t)], alone, rtol=1e-5, atol=1e-5)
    # the encoder output at real positions, and decoding a padded batch, do not depend on padding either
    mem = model.encode(src, padding_mask(src))
    alone = model.encode(srcs[0][None], padding_mask(srcs[0][None]))
    torch.testing.assert_close(mem[0, :3], alone[0], rtol=1e-5, atol=1e-5)
    for beam in (1, 3):
        together = generate(model, src, beam=beam, max_len=6)
        assert together == [
            generate(model, src[i : i + 1, : len(s)], beam=beam, max_len=6)[0] for i, s in enumerate(srcs)
        ]


def packed_example(pack_len: int = 40):
    """Four sentence pairs of different lengths packed into two rows (3 + 1 pairs, then the tails)."""
    g = torch.Generator().manual_seed(7)
    src = [torch.randint(4, 50, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    tgt = [torch.randint(4, 50, (n,), generator=g).tolist() for n in (7, 4, 10, 6)]
    rows = [[0, 1, 2], [3]]
    batch = torch.stack([PackedRows(ParallelDataset(src, tgt), pack_len)[r] for r in rows], dim=1)  # as train.py
    return src, tgt, rows, batch


def unpacked_outputs(model, src, tgt):
    """Memory and logits of every pair run on its own (the padded path, batch of one)."""
    out = []
    for s, t in zip(src, tgt):
        s_ids, t_in = torch.tensor([s + [EOS]]), torch.tensor([[2] + t])
        out.append((model.encode(s_ids, padding_mask(s_ids))[0], model(s_ids, t_in)[0]))
    return out


@pytest.mark.parametrize("flex", [False, True])
def test_packed_rows_equal_each_sentence_alone(flex):
    """Packed rows with document masks give every sentence the encoder states and logits it gets alone: the encoder
    mask (memory), and the decoder and cross-attention masks (logits). flex=True runs FlexAttention itself (its CPU
    forward) instead of the dense boolean masks that CPU training uses."""
    import seq2seq as tm
    from torch.nn.attention.flex_attention import BlockMask

    model = tiny_model()
    src, tgt, rows, (s, t_in, t_out, s_doc, t_doc) = packed_example()
    with torch.no_grad():  # FlexAttention has no CPU backward
        enc_mask, dec_mask, cross_mask = tm.document_masks(s_doc, t_doc, dense=not flex)
        assert isinstance(enc_mask, BlockMask) == flex
        memory = model.encode(s, enc_mask, tm.positions_in_documents(s_doc))
        logits = model(s, t_in, s_doc, t_doc, dense=not flex)
        alone = unpacked_outputs(model, src, tgt)
        merged = model(s, t_in, torch.zeros_like(s_doc), torch.zeros_like(t_doc), dense=not flex)
    for r, row in enumerate(rows):
        a = b = 0
        for k in row:
            n_s, n_t = len(src[k]) + 1, len(tgt[k]) + 1
            torch.testing.assert_close(memory[r, a : a + n_s], alone[k][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(logits[r, b : b + n_t], alone[k][1], rtol=1e-4, atol=1e-5)
            assert t_out[r, b : b + n_t].tolist() == tgt[k] + [EOS]
            a, b = a + n_s, b + n_t
        assert (t_out[r, b:] == PAD).all() and (s[r, a:] == PAD).all()  # the tail: <pad>, no loss
    # the comparison can see cross-talk: one document per row changes the first sentence's later logits
    assert not torch.allclose(merged[0, : len(tgt[0]) + 1], alone[0][1], atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernels need a GPU")
def test_flex_attention_matches_dense_masks_on_gpu():
    """On the GPU, packed rows train through compiled FlexAttention: its logits and gradients equal those of the
    dense boolean masks (SDPA), and the padded path gives each sentence the same logits."""
    torch.manual_seed(0)  # head width 16: the smallest FlexAttention's GPU kernels take; no dropout, to compare runs
    cfg = ModelConfig(vocab_size=50, d_model=64, n_heads=4, enc_layers=2, dec_layers=2, d_ff=128, dropout=0.0)
    model = Transformer(cfg).cuda().train()
    src, tgt, rows, batch = packed_example(256)
    s, t_in, t_out, s_doc, t_doc = (x.cuda() for x in batch)
    results = []
    for dense in (False, True):
        model.zero_grad()
        logits = model(s, t_in, s_doc, t_doc, dense=dense)
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-3, atol=1e-3)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)
    model.eval()
    with torch.no_grad():
        packed = model(s, t_in, s_doc, t_doc)
        s0, t0 = torch.tensor([src[0] + [EOS]]).cuda(), torch.tensor([[2] + tgt[0]]).cuda()
        torch.testing.assert_close(packed[0, : len(tgt[0]) + 1], model(s0, t0)[0], rtol=1e-3, atol=1e-3)


@pytest.mark.learning
def test_beam_search_finds_a_likelier_sequence_than_greedy_on_average():
    model = tiny_model(1)
    src = torch.randint(4, 50, (8, 6))

    def logprob(seqs):
        total = 0.0
        for i, ids in enumerate(seqs):
            tgt = torch.tensor([[2] + ids])
            lp = model(src[i : i + 1], tgt).log_softmax(-1)[0]
            full = ids + [EOS] if len(ids) < 5 else ids
            total += sum(lp[j, tok].item() for j, tok in enumerate(full)) / len(full)
        return total

    greedy, beam = generate(model, src, beam=1, max_len=5), generate(model, src, beam=4, max_len=5)
    assert all(len(s) <= 5 for s in beam)
    assert logprob(beam) >= logprob(greedy) - 1e-4


# ------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("kind", ["bpe", "wordlevel"])
def test_tokenizer_round_trip(kind):
    train = [
        "Zwei junge weiße Männer sind im Freien.",
        "A man, a plan; a canal: Panama!",
        "Ünïcödé  with   spaces\tand tabs",
    ] * 20
    tok = train_tokenizer(kind, train, 300)
    assert [tok.token_to_id(t) for t in ("<pad>", "<unk>", "<s>", "</s>")] == [0, 1, 2, 3]
    assert decode(tok, encode(tok, train[:3])) == train[:3]
    if kind == "bpe":  # byte-level: lossless for text never seen in training too
        unseen = ["Ça coûte 5 € — 😀 日本語", " leading and trailing ", ""]
        assert decode(tok, encode(tok, unseen)) == unseen


def test_the_schedule_is_the_same_on_any_gpu_count():
    """--warmup-epochs: 1 process and 4 with --max-tokens / 4 (the docs' rule: the recipe's global batch) see the same
    LR at every step; 4 with the same --max-tokens (4x the batch, 1/4 of the steps) the same at each later epoch's
    start, up to whole steps. (A warmup counted in steps fails the second: 4 GPUs would warm up for 4x the data.)"""
    from argparse import Namespace

    from transformer.train import lr_at

    g = torch.Generator().manual_seed(0)
    src_lens, tgt_lens = (torch.randint(2, 40, (3001,), generator=g).tolist() for _ in range(2))
    args = Namespace(lr=1e-3, warmup_epochs=1.5)
    one, four, four_big = (PackedBatchSampler(src_lens, tgt_lens, 64, rows, 0, world, seed=5, epochs=8)
                           for rows, world in ((8, 1), (2, 4), (8, 4)))  # fmt: skip
    for epoch in range(8):
        steps = range(one.steps_in(epoch))
        assert [lr_at(epoch, k, args, one) for k in steps] == [lr_at(epoch, k, args, four) for k in steps]
        if epoch:  # (epoch 0's first step is 1 / warmup steps of the peak, in either's steps)
            assert lr_at(epoch, 0, args, four_big) == pytest.approx(lr_at(epoch, 0, args, one), rel=0.05)


# ------------------------------------------------------------------ sampler


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 2])
def test_packed_sampler(world, accum):
    g = torch.Generator().manual_seed(0)
    src_lens = torch.randint(2, 40, (301,), generator=g).tolist()
    tgt_lens = torch.randint(2, 40, (301,), generator=g).tolist()
    pack_len, rows, epochs = 64, 4, 3
    samplers = [
        PackedBatchSampler(src_lens, tgt_lens, pack_len, rows, r, world, seed=5, accum=accum, epochs=epochs)
        for r in range(world)
    ]
    s0 = samplers[0]
    assert s0.n_rows % (rows * world * accum)  # the rows do not fill whole steps: epochs share a step
    orders = []
    for epoch in range(epochs):
        per_rank = []
        for s in samplers:
            s.set_epoch(epoch)
            per_rank.append(list(s))
        assert len({len(b) for b in per_rank}) == 1  # the same number of batches on every rank
        assert len(per_rank[0]) == len(s0) == s0.steps_in(epoch) * accum
        assert all(len(b) == rows for batches in per_rank for b in batches)  # one shape: `rows` rows of pack_len
        for row in (row for batches in per_rank for b in batches for row in b):  # each side fits, with a tail
            assert sum(src_lens[i] for i in row) < pack_len and sum(tgt_lens[i] for i in row) < pack_len
        tokens = s0.step_tokens()
        steps = [[b for r in range(world) for b in per_rank[r][k * accum : (k + 1) * accum]]
                 for k in range(s0.steps_in(epoch))]  # fmt: skip
        assert tokens == [sum(tgt_lens[i] for b in step for row in b for i in row) for step in steps]
        orders.append(per_rank)
    assert orders[0] != orders[1]  # reshuffled per epoch
    # the epochs end to end: every pair once per epoch, and no empty row before the run's last step
    dealt = [row for epoch in orders for k in range(len(epoch[0]) // accum) for r in range(world)
             for b in epoch[r][k * accum : (k + 1) * accum] for row in b]  # fmt: skip
    assert len(dealt) == s0.steps_before(epochs) * rows * world * accum
    real = [row for row in dealt if row]
    assert len(real) == epochs * s0.n_rows and all(dealt[: len(real)])  # the empty rows all come last...
    assert len(dealt) - len(real) < rows * world * accum  # ...in the last step
    for e in range(epochs):  # each epoch's rows hold every pair once
        assert sorted(i for row in real[e * s0.n_rows : (e + 1) * s0.n_rows] for i in row) == list(range(301))
    again = PackedBatchSampler(src_lens, tgt_lens, pack_len, rows, world - 1, world, seed=5, accum=accum, epochs=3)
    again.set_epoch(1)
    assert list(again) == orders[1][world - 1]  # a pure function of (seed, epoch)
    again.set_epoch(1, skip=3)
    assert list(again) == orders[1][world - 1][3:] and len(again) == len(orders[1][world - 1]) - 3


def test_only_the_last_step_of_the_run_has_empty_rows():
    """An epoch whose rows do not fill its last step borrows the next epoch's first rows: Multi30k at 64 rows a step
    is 7.2 steps an epoch, and empty rows there would make 10% of the positions padding."""
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(8, 24, (2, 2000), generator=g).tolist()
    sampler = PackedBatchSampler(src, tgt, 256, 4, 1, 2, seed=1, accum=1, epochs=5)  # rank 1 of 2
    sampler.set_epoch(0, until=5)
    batches = list(sampler)
    assert sampler.n_rows % 8 and len(batches) == -(-5 * sampler.n_rows // 8)  # 8 rows a step
    empty = [k for k, b in enumerate(batches) for row in b if not row]
    assert empty and min(empty) == len(batches) - 1  # rank 1's share of the last step only
    endless = PackedBatchSampler(src, tgt, 256, 4, 1, 2, seed=1, accum=1)  # no end of data given: no empty row
    endless.set_epoch(0, until=5)
    assert all(row for b in endless for row in b)
    assert [sampler.steps_in(e) for e in range(5)] == [endless.steps_in(e) for e in range(5)]


@pytest.mark.parametrize("world,accum,pack_len", [(1, 1, 64), (3, 2, 64), (2, 2, 200)])
def test_sampler_plan_equals_the_plain_algorithm(world, accum, pack_len):
    """The sampler cuts the rows once and only fills them each epoch (fast epoch boundaries). Its plan must equal
    the docstring's steps done directly, which earlier checkpoints (mid-epoch resume) depend on."""
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(1, 40, (2, 500), generator=g).tolist()
    rows, epochs = 2, 5
    sampler = PackedBatchSampler(src, tgt, pack_len, rows, 0, world, seed=3, accum=accum, epochs=epochs)
    layout = torch.randperm(500, generator=torch.Generator().manual_seed(mix_seed(3, 54321))).tolist()
    stream, ends = [], []  # every epoch's rows, end to end; where each epoch's rows end
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(mix_seed(3, epoch))
        perm = torch.randperm(500, generator=g).tolist()
        shuffled = {}  # lengths -> the pairs of those lengths, in the epoch's random order
        for i in perm:
            shuffled.setdefault((src[i], tgt[i]), []).append(i)
        order = [shuffled[(src[i], tgt[i])].pop(0) for i in layout]  # each position: the next pair of its lengths
        packed, row = [], []
        for i in order:  # greedy: a row takes pairs while both sides stay under pack_len
            if row and (sum(src[j] for j in row) + src[i] >= pack_len or sum(tgt[j] for j in row) + tgt[i] >= pack_len):
                packed, row = packed + [row], []
            row = row + [i]
        packed.append(row)
        stream += [packed[k] for k in torch.randperm(len(packed), generator=g).tolist()]
        ends.append(len(stream))
    while len(stream) % (rows * world * accum):  # the end of the data: empty rows fill the last step
        stream.append([])
    batches = [stream[k : k + rows] for k in range(0, len(stream), rows)]
    steps = [batches[k : k + world * accum] for k in range(0, len(batches), world * accum)]
    first = 0
    for epoch in range(epochs):  # epoch e: the steps up to the one that deals its last row
        last = -(-ends[epoch] // (rows * world * accum))
        sampler.set_epoch(epoch)
        assert sampler.plan(epoch)[0] == steps[first:last]
        assert sampler.step_tokens() == [sum(tgt[i] for b in step for r in b for i in r) for step in steps[first:last]]
        first = last


def test_sampler_deals_epoch_after_epoch():
    """set_epoch(e, skip=k, until=n) deals epoch e from batch k on, then epochs e+1 .. n-1, each as set_epoch
    alone would: train.py's one DataLoader iterator for the whole run (no worker restart per epoch)."""
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(1, 40, (2, 400), generator=g).tolist()
    sampler = PackedBatchSampler(src, tgt, 100, 2, 1, 2, seed=4, accum=2)
    alone = []
    for epoch in (2, 3, 4):
        sampler.set_epoch(epoch)
        alone.append(list(sampler))
    sampler.set_epoch(2, skip=3, until=5)
    assert list(sampler) == alone[0][3:] + alone[1] + alone[2] and len(sampler) == sum(map(len, alone)) - 3
    assert sampler.step_tokens(3) == sampler.plan(3)[1] and sampler.step_tokens() == sampler.plan(2)[1]


def test_packed_rows_are_nearly_all_real_tokens():
    """Rows of randomly mixed lengths leave short tails on both sides: at 1,024 tokens a row, pairs of Multi30k-like
    lengths (8-23 tokens a side, drawn independently) fill over 95% of the rows' positions."""
    g = torch.Generator().manual_seed(0)
    src_lens, tgt_lens = torch.randint(8, 24, (2, 20000), generator=g).tolist()
    sampler = PackedBatchSampler(src_lens, tgt_lens, 1024, 1)
    assert sampler.fill > 0.95, sampler.fill
    rows = [row for step in sampler.plan(0)[0] for b in step for row in b]
    assert len(rows) == sampler.n_rows and all(rows)  # one row a step


def test_packed_row_layout():
    """A row: the pairs' sources end to end (ids </s>), the decoder input (<s> ids) and its targets (ids </s>), a
    document id per token; the tail is <pad> with one more document id on each side."""
    row = PackedRows(ParallelDataset([[5, 6], [7]], [[8], [9, 10]]), 8)[[0, 1]]
    src, tgt_in, tgt_out, src_doc, tgt_doc = (t.tolist() for t in row)
    assert src == [5, 6, EOS, 7, EOS, PAD, PAD, PAD] and src_doc == [0, 0, 0, 1, 1, 2, 2, 2]
    assert tgt_in == [2, 8, 2, 9, 10, PAD, PAD, PAD] and tgt_out == [8, EOS, 9, 10, EOS, PAD, PAD, PAD]
    assert tgt_doc == [0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError):  # a pair must leave room for the tail
        PackedBatchSampler([8], [3], 8, 1)


# ------------------------------------------------------------------ data sources


def write_corpus(root, splits, src="de", tgt="en", gz=("train.de", "val.en"), bom=("train.de", "train.en")):
    """Line-aligned files; those in ``bom`` begin with a UTF-8 byte order mark, as some editors write, which is no
    part of the first sentence."""
    root.mkdir(parents=True, exist_ok=True)
    for split, (a, b) in splits.items():
        for lang, lines in ((src, a), (tgt, b)):
            name = f"{split}.{lang}"
            data = (("\ufeff" if name in bom else "") + "\n".join(lines) + "\n").encode()
            if name in gz:
                (root / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (root / name).write_bytes(data)
    return root


def test_text_dir_and_seeded_holdout(tmp_path):
    splits = synthetic_corpus(3, (50, 7, 0))
    root = write_corpus(tmp_path / "c", {"train": splits["train"], "dev": splits["val"]})
    got = read_text_dir(root, "de", "en")
    assert got["train"] == splits["train"] and got["dev"] == splits["val"]
    args = type(
        "A", (), dict(synthetic=False, data=str(root), lang_src="de", lang_tgt="en", val_split=0, seed=0, max_len=256)
    )
    assert load_corpus(args, None)["val"] == splits["val"]  # "dev" is the validation split
    (root / "dev.de").unlink()
    a, b = load_corpus(args, None), load_corpus(args, None)  # no val: a seeded hold-out, the same every time
    assert a == b and len(a["val"][0]) == 5 and len(a["train"][0]) == 45
    assert sorted(a["val"][0] + a["train"][0]) == sorted(splits["train"][0])  # a partition of train


def test_hf_column_layouts(tmp_path):
    datasets = pytest.importorskip("datasets")
    from text import read_saved_dataset

    rows = {"translation": [{"en": "a b", "it": "x y"}, {"en": "c", "it": "z"}]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert read_saved_dataset(tmp_path / "dd", "en", "it")["train"] == (["a b", "c"], ["x y", "z"])
    datasets.Dataset.from_dict({"de": ["q"], "en": ["r"]}).save_to_disk(str(tmp_path / "one"))
    assert read_saved_dataset(tmp_path / "one", "de", "en") == {"train": (["q"], ["r"])}


# ------------------------------------------------------------------ learning


def train_in_process(monkeypatch, *args):
    """transformer/train.py's entry point in this process (1 process, no launcher): no start-up of its own."""
    import transformer.train as train

    monkeypatch.setattr(sys, "argv", [TRAIN, *map(str, args)])
    train.run_cli(train.main, train.get_args_parser().parse_args())


def translate_in_process(monkeypatch, capsys, *args) -> str:
    """transformer/translate.py's entry point in this process; returns what it wrote to stdout."""
    import transformer.translate as translate

    monkeypatch.setattr(sys, "argv", [TRANSLATE, *map(str, args)])
    capsys.readouterr()
    translate.run_cli(translate.main, translate.get_args_parser().parse_args())
    return capsys.readouterr().out


@pytest.mark.learning
def test_tiny_model_learns_synthetic_translation(tmp_path, monkeypatch, capsys):
    """Learning the reversal is a sudden drop of the loss whose timing moves with rounding (the CPU's kernels, the
    thread count): many small steps at a high peak LR end the drop well before the last step on every CPU."""
    out = tmp_path / "run"
    train_in_process(monkeypatch, "--synthetic", "--preset", "tiny", "--max-tokens", "1024", "--pack-len", "64",
                     "--accum-steps", "1", "--lr", "5e-3", "--warmup-epochs", "0.32", "--max-steps", "400",
                     "--eval-every", "1000", "-j", "0", "--output-dir", out)  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    assert val[-1]["step"] == 400 and val[-1]["bleu"] >= 90, val
    assert [r["split"] for r in records].count("test") == 1
    # beam search through translate.py on unseen sentences of the same made-up language pair
    src, ref = synthetic_corpus(99, (0, 0, 30))["test"]
    translated = translate_in_process(monkeypatch, capsys, "--checkpoint", out / "best.pt", "--beam", "3", *src)
    import sacrebleu

    assert sacrebleu.corpus_bleu(translated.splitlines(), [ref]).score >= 90


# ------------------------------------------------------------------ DDP end to end (its resume: test_fault.py)


@pytest.mark.slow
def test_ddp_end_to_end_on_local_files(tmp_path_factory, monkeypatch, capsys):
    """A local de->en corpus (.gz and plain files) trained by 2 gloo processes under torchrun to step 18: the
    uninterrupted run that test_fault.py's preempted and restarted runs must equal bit for bit (their resume)."""
    out = transformer_reference(tmp_path_factory)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["launcher"] == "torchrun" and cfg["backend"] == "gloo"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert train and set(train[0]) >= {"epoch", "step", "loss", "lr", "tok_per_s", "time"}
    assert train[-1]["step"] == 18 and all(r["tok_per_s"] > 0 for r in train)
    val, test = [r for r in records if r["split"] == "val"], [r for r in records if r["split"] == "test"]
    assert val and len(test) == 1 and {"loss", "bleu", "epoch", "step"} <= set(test[0])
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["step"] == 18 and ckpt["world_size"] == 2
    assert (out / "tokenizer.json").read_text() == ckpt["tokenizer"]  # the JSON file and the checkpoint agree
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    # translate.py: sentences as arguments (its entry point here) and on stdin (a process) give the same lines, one each
    src = synthetic_corpus(1, (400, 30, 21))["test"][0][:4]
    by_args = translate_in_process(monkeypatch, capsys, "--checkpoint", out / "last.pt", *src).splitlines()
    p = subprocess.run(
        [PY, TRANSLATE, "--checkpoint", str(out / "last.pt")],
        input="\n".join(src) + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    by_stdin = p.stdout.splitlines()
    assert len(by_args) == 4 and by_args == by_stdin


# the synthetic pair, 2 eager processes with gradient accumulation: the reference of the next two tests. One layer
# each side: what they compare is the same for any depth, and compiling it takes half the time of two.
DDP_ARGS = [TRAIN, "--synthetic", "--preset", "tiny", "--layers", "1", "--pack-len", "128", "--max-steps", "3",
            "-p", "2", "--accum-steps", "2", "-j", "0", "--lr", "1e-3", "--warmup-epochs", "0.2",
            "--resume", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def eager_ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    torchrun(2, *DDP_ARGS, "--max-tokens", "512", "--eval-every", "1000", "--output-dir", out, timeout=180)
    return out


def all_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_equal_one_with_twice_the_micro_batches(eager_ddp, tmp_path, monkeypatch):
    """DDP: 2 processes of 2 micro-batches a step train the same parameters as 1 process of 4, since both deal the
    same rows to each micro-batch and each step (dropout 0: its masks are seeded per rank). Same micro-batches: only
    the order of the gradient sums differs, which Adam amplifies where a gradient is about 0."""
    one = [*DDP_ARGS[1:], "--accum-steps", "4", "--max-tokens", "512", "--eval-every", "0", "--output-dir", tmp_path]
    train_in_process(monkeypatch, *one)  # the single process: in this process
    two, one = (torch.load(d / "last.pt", weights_only=True)["model"] for d in (eager_ddp, tmp_path))
    tiny = {**PRESETS["tiny"], "enc_layers": 1, "dec_layers": 1}
    start = Transformer(ModelConfig(vocab_size=two["embed.weight"].shape[0], **tiny)).state_dict()
    assert not torch.allclose(two["embed.weight"], start["embed.weight"])  # it trained
    for k in two:  # the key bias cannot change attention, so its exact gradient is 0 and Adam amplifies rounding noise
        a, b = (two[k][64:], one[k][64:]) if k.endswith("kv.bias") else (two[k], one[k])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=k)


def test_max_steps_stop_then_a_longer_run_equals_one_run(tmp_path, monkeypatch, capsys):
    """A run stopped by --max-steps, then the same command with a larger --max-steps, ends bit-identical to one run
    to that step (weights, Adam's state, step, epoch): the mid-epoch checkpoint resumes exactly, and --max-steps
    does not change the LR schedule. In this process, with dropout; test_fault.py covers the preempted and restarted
    runs."""
    args = [*DDP_ARGS[1:], "--max-tokens", "512", "--eval-every", "0", "--dropout", "0.1"]
    args = [a for a in args if a not in ("--resume", "none")]  # default --resume auto: continue from last.pt
    at = args.index("--max-steps") + 1
    for out, steps in ((tmp_path / "legs", 2), (tmp_path / "legs", 5), (tmp_path / "one", 5)):
        args[at] = str(steps)
        train_in_process(monkeypatch, *args, "--output-dir", out)
        printed = capsys.readouterr().out
        resumed = "resumed from" in printed and "step 2, batch" in printed  # only the second leg resumes
        assert resumed == ((out.name, steps) == ("legs", 5)), printed[-2000:]
    legs, one = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("legs", "one"))
    assert one["step"] == 5
    assert_same_training_state(one, legs)
    corpus = write_corpus(tmp_path / "deen", {"train": (["ein haus"] * 8, ["a house"] * 8)})
    before = [(tmp_path / "legs" / f).read_bytes() for f in ("last.pt", "tokenizer.json")]
    with pytest.raises(SystemExit) as e:  # another language pair in the same output dir: not this run's resume
        train_in_process(monkeypatch, *args[1:], "--data", corpus, "--lang-src", "de", "--lang-tgt", "en",
                         "--output-dir", tmp_path / "legs")  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and "last.pt is a run of src->tgt, not de->en (give this pair another" in err, err
    assert [(tmp_path / "legs" / f).read_bytes() for f in ("last.pt", "tokenizer.json")] == before


@pytest.mark.slow
def test_compiled_model_and_loss_train_like_eager_under_ddp(eager_ddp, tmp_path):
    """--compile compiles the DDP model and the loss (one static shape each); with 2 processes and
    gradient accumulation (no_sync on the first micro-batch) the logged losses match the eager run's. The compiled
    run also takes --eval-every 0: no evaluation, no best.pt."""
    torchrun(
        2, *DDP_ARGS, "--max-tokens", "512", "--compile", "--eval-every", "0", "--output-dir", tmp_path, timeout=300
    )
    losses, splits = {}, {}
    for name, out in (("eager", eager_ddp), ("compiled", tmp_path)):
        losses[name] = [r["loss"] for r in all_records(out) if r["split"] == "train"]
        splits[name] = {r["split"] for r in all_records(out)}
    assert len(losses["eager"]) == 2 and losses["eager"] == pytest.approx(losses["compiled"], rel=1e-4), losses
    assert splits == {"eager": {"train", "val", "test"}, "compiled": {"train"}}, splits
    assert (eager_ddp / "best.pt").exists() and not (tmp_path / "best.pt").exists()


# ------------------------------------------------------------------ resume on another world size


def test_another_world_size_ends_the_epoch_in_progress(capsys):
    """A checkpoint of other steps (another world size or accumulation) ends its epoch where it stands, every
    micro-batch of it done, so that its evaluation and checkpoint come next; its loss window (of the old steps) is
    dropped. The same world size and accumulation continue exactly, and a checkpoint at an epoch's start stays there."""
    import transformer.train as train

    ckpt = {"world_size": 2, "args": {"accum_steps": 1}, "window": {"sums": torch.ones(2), "n": 5}}
    pos = Position(epoch=1, step=7, batch_in_epoch=3)
    assert train.continue_at_next_epoch(pos, ckpt, 2, 1, epoch_end=10) is ckpt and pos.batch_in_epoch == 3
    assert capsys.readouterr().out == ""
    got = train.continue_at_next_epoch(pos, ckpt, 3, 1, epoch_end=10)
    assert (pos.epoch, pos.batch_in_epoch, pos.step) == (1, 10, 7) and "window" not in got
    assert "world size 2 x accum 1, now 3 x 1; continuing at the next epoch boundary" in capsys.readouterr().out
    pos = Position(epoch=2, step=9)
    assert "window" not in train.continue_at_next_epoch(pos, ckpt, 2, 2, epoch_end=10) and pos.batch_in_epoch == 0


# the local corpus (400 pairs, 30 val, 21 test): one row a micro-batch, 27 steps an epoch on 2 processes
WORLD = ["--lang-src", "de", "--lang-tgt", "en", "--preset", "tiny", "--layers", "1", "--vocab-size", "200",
         "--max-tokens", "256", "-j", "0", "-p", "1", "--samples", "0"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("evaluated", [True, False])
def test_another_world_size_at_the_last_epochs_end_ends_cleanly(evaluated, tmp_path_factory, tmp_path, monkeypatch):
    """1 process to step 2 of a 1-epoch run, then 2 processes to step 4: they deal other steps, so the run continues
    at the next epoch boundary, its end. With the evaluation at step 2 recorded (the first leg's final one) nothing is
    left to do and no file changes; without it (the first leg ran --eval-every 0) the second leg evaluates, val and
    test once, saves and is done, and a rerun has nothing to do. (Not an empty epoch trained, nor a ZeroDivisionError
    on every rank.)"""
    data, out = transformer_corpus(tmp_path_factory), tmp_path / "run"
    cmd = [TRAIN, "--data", data, *WORLD, "--epochs", "1", "--output-dir", out]
    train_in_process(monkeypatch, *cmd[1:], "--max-steps", "2", *([] if evaluated else ["--eval-every", "0"]))
    files = lambda: {f.name: f.read_bytes() for f in out.iterdir() if f.name != ".lock"}  # noqa: E731
    before, records = files(), run_records(out)
    log = torchrun(2, *cmd, "--max-steps", "4").stdout
    assert "world size 1 x accum 1, now 2 x 1; continuing at the next epoch boundary" in log, log[-3000:]
    if evaluated:
        assert "done: step 2 (already finished: nothing to do)" in log and files() == before, log[-3000:]
        return
    assert "done: step 2, best val BLEU" in log, log[-3000:]
    evaluations = [(r["split"], r["epoch"], r["step"]) for r in run_records(out)[len(records) :]]
    assert evaluations == [("val", 1, 2), ("test", 1, 2)]
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["step"], ckpt["world_size"]) == (1, 0, 2, 2)
    assert (out / "best.pt").exists()
    before = files()
    assert "already finished: nothing to do" in torchrun(2, *cmd, "--max-steps", "4").stdout and files() == before


@pytest.mark.slow
def test_another_world_size_mid_run_continues_after_that_epochs_end(tmp_path_factory, tmp_path, monkeypatch):
    """1 process to step 2 of epoch 0 of 2 (no evaluation there), then 2 processes to the end: epoch 0 ends at step 2
    with its evaluation and checkpoint, then epoch 1 trains each of its steps on 2 processes once, and the final
    evaluation, val and test, ends the run at (epoch 2, batch 0)."""
    data, out = transformer_corpus(tmp_path_factory), tmp_path / "run"
    cmd = [TRAIN, "--data", data, *WORLD, "--epochs", "2", "--output-dir", out]
    train_in_process(monkeypatch, *cmd[1:], "--max-steps", "2", "--eval-every", "0")
    n = len(run_records(out))
    torchrun(2, *cmd)
    cfg = json.loads((out / "config.json").read_text())
    rows = round(cfg["steps_per_epoch"] * 2)  # one row a rank a step
    last = 2 + rows - -(-rows // 2)  # the steps that deal epoch 1's rows: ceil(2 rows / 2) - ceil(rows / 2)
    # the LR of epoch 1's first step is the schedule's at epoch 1 on 2 processes (the default --warmup-epochs 4), not
    # at the step counter's 3
    s, w = -(-rows // 2) + 1, round(4.0 * cfg["steps_per_epoch"])
    first = next(r for r in run_records(out)[n:] if r["split"] == "train")
    assert first["lr"] == pytest.approx(cfg["lr"] * min(s / w, (w / s) ** 0.5), rel=1e-6), (first, s, w)
    records = [(r["split"], r["epoch"], r["step"]) for r in run_records(out)[n:]]
    assert [r for r in records if r[0] != "train"] == [("val", 1, 2), ("val", 2, last), ("test", 2, last)], records
    assert [r for r in records if r[0] == "train"] == [("train", 1, s) for s in range(3, last + 1)], records
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["step"], ckpt["world_size"]) == (2, 0, last, 2)
