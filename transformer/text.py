"""Parallel text in (``load_corpus``), a joint tokenizer, packed training rows (``PackedBatchSampler``,
``PackedRows``) and padded evaluation batches (``padded_batches``) out. Ids 0-3 are <pad> <unk> <s>
</s>; a source is ``ids + </s>``, the decoder reads ``<s> + ids`` and predicts ``ids + </s>``."""

from __future__ import annotations

import gzip
import itertools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset, Sampler

from common.distributed import DistInfo, broadcast_object, mix_seed, print0
from common.errors import UserError

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
PAD, UNK, BOS, EOS = range(4)
VAL_NAMES = ("val", "valid", "validation", "dev")  # all mean "val" here
Splits = dict[str, tuple[list[str], list[str]]]  # split -> (source sentences, target sentences)
CHARS_PER_TOKEN = 16  # a side longer than this x --max-len in characters cannot fit --max-len tokens in practice


def load_corpus(args, info: DistInfo) -> Splits:
    """Read the parallel corpus named by --data (or make the synthetic one); always has train and val."""
    if args.synthetic:
        splits = synthetic_corpus(args.seed)
    else:
        path = Path(args.data).expanduser()
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            splits = read_saved_dataset(path, args.lang_src, args.lang_tgt)
        elif path.is_dir():
            splits = read_text_dir(path, args.lang_src, args.lang_tgt)
        elif path.exists():
            raise UserError(f"--data {args.data} is a file; give the directory that holds train.{args.lang_src}[.gz]")
        elif args.data.startswith(("/", ".", "~")) or args.data.count("/") > 1:
            raise UserError(f"--data {args.data}: no such directory (expected a dir with train.{args.lang_src}[.gz]"
                            f" and train.{args.lang_tgt}[.gz], a save_to_disk dir, or a Hugging Face dataset "
                            "name)")  # fmt: skip
        else:
            splits = read_hub_dataset(args, info)
    val = next((k for k in splits if k in VAL_NAMES), None)  # the first of val/valid/validation/dev
    splits = {("val" if k == val else k): v for k, v in splits.items() if k == val or k not in VAL_NAMES}
    if "train" not in splits or not splits["train"][0]:
        raise UserError(f"--data {args.data} has no training pairs")
    if "val" not in splits:  # seeded hold-out: identical on every rank and rerun, never trained on
        src, tgt = splits["train"]
        n_val = args.val_split or max(1, min(3000, len(src) // 10))
        if n_val >= len(src):
            raise UserError(f"--val-split {n_val} leaves no training pairs (train has {len(src)})")
        perm = torch.randperm(len(src), generator=torch.Generator().manual_seed(mix_seed(args.seed, 12345))).tolist()
        splits["val"] = ([src[i] for i in perm[:n_val]], [tgt[i] for i in perm[:n_val]])
        splits["train"] = ([src[i] for i in perm[n_val:]], [tgt[i] for i in perm[n_val:]])
        print0(f"no validation split: held out {n_val} training pairs (seeded)")
    splits["train"] = screen_pairs(*splits["train"], CHARS_PER_TOKEN * args.max_len, args.data)
    return splits


def screen_pairs(src: list[str], tgt: list[str], max_chars: int, where: str) -> tuple[list[str], list[str]]:
    """Drop the training pairs with a side over ``max_chars`` characters before the tokenizer is trained (BPE's cost
    grows with the square of a word's length); warn about pairs with an empty side."""
    keep = [i for i, (a, b) in enumerate(zip(src, tgt)) if len(a) <= max_chars and len(b) <= max_chars]
    if len(keep) < len(src):
        print0(f"dropped {len(src) - len(keep)} training pairs over {max_chars} characters (--max-len x "
               f"{CHARS_PER_TOKEN}) before training the tokenizer")  # fmt: skip
        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    empty = sum(1 for a, b in zip(src, tgt) if not a.strip() or not b.strip())
    if src and empty == len(src):
        raise UserError(f"--data {where}: every training pair has an empty side (check the files' contents)")
    if empty:
        print0(f"warning: {empty} of {len(src)} training pairs have an empty side (misaligned files?)", file=sys.stderr)
    if not src:
        raise UserError(f"--data {where}: no training pair is under {max_chars} characters (raise --max-len)")
    return src, tgt


def synthetic_corpus(seed: int, sizes: tuple[int, int, int] = (20000, 500, 500)) -> Splits:
    """A made-up language pair, deterministic in `seed`: each word maps to a fixed target word, and word order is
    reversed (which needs real attention, not a per-position lookup)."""
    syll_src = ["ka", "lo", "mi", "ne", "su", "ta", "ro", "vi"]
    syll_tgt = ["ba", "de", "fo", "gu", "hi", "jo", "pe", "zu"]
    src_words = [a + b for a in syll_src for b in syll_src][:40]
    tgt_words = [a + b for a in syll_tgt for b in reversed(syll_tgt)][:40]
    splits = {}
    for k, (name, n) in enumerate(zip(("train", "val", "test"), sizes)):
        g = torch.Generator().manual_seed(mix_seed(seed, k))
        sentences = [torch.randint(0, 40, (m,), generator=g).tolist() for m in torch.randint(3, 11, (n,), generator=g)]
        splits[name] = ([" ".join(src_words[w] for w in s) for s in sentences],
                        [" ".join(tgt_words[w] for w in reversed(s)) for s in sentences])  # fmt: skip
    return splits


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file, plain or .gz; only '\\n' ends a line, so odd Unicode breaks stay inside."""
    try:
        raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8-sig")  # a leading byte order mark is no part of the text
    except UnicodeDecodeError as e:
        enc = "utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin1"  # UTF-16 begins with its byte order mark
        files = "" if path == Path("/dev/stdin") else f" {path.name} > {path.name}.utf8"  # stdin: iconv in the pipe
        raise UserError(f"cannot read {path}: not UTF-8 ({e.reason} at byte {e.start}) (convert it, e.g. iconv -f "
                        f"{enc} -t utf-8{files})") from None  # fmt: skip
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read {path}: {e} (check that the file is readable and, if .gz, complete)") from None
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []


def read_text_dir(root: Path, src: str, tgt: str) -> Splits:
    """Line-aligned `{split}.{lang}` files, optionally gzipped: train.de.gz, train.en.gz, val.de.gz, ..."""

    def find(split: str, lang: str) -> Path | None:
        return next((p for p in (root / f"{split}.{lang}", root / f"{split}.{lang}.gz") if p.is_file()), None)

    if find("train", src) is None or find("train", tgt) is None:
        langs = sorted({p.name.split(".")[1] for p in root.glob("train.*") if p.is_file()})
        raise UserError(f"no train.{src} and train.{tgt} (optionally .gz) in {root} (languages found: "
                        f"{', '.join(langs) or 'none'}; set --lang-src/--lang-tgt)")  # fmt: skip
    splits = {}
    for split in ("train", *VAL_NAMES, "test"):
        fs, ft = find(split, src), find(split, tgt)
        if fs is None or ft is None:
            continue
        a, b = read_lines(fs), read_lines(ft)
        if len(a) != len(b):
            raise UserError(f"{fs} has {len(a)} lines but {ft} has {len(b)}: not line-aligned (line i of one "
                            "must be the translation of line i of the other)")  # fmt: skip
        splits[split] = (a, b)
    return splits


def read_hub_dataset(args, info: DistInfo) -> Splits:
    """`datasets.load_dataset` on rank 0 only (nodes need no shared cache); the sentences, or the error, reach the
    other ranks by broadcast, so all fail alike instead of some waiting forever."""
    result: Splits | str | None = None
    if info.is_main:
        try:
            result = _load_hub(args.data, args.data_config, args.lang_src, args.lang_tgt)
        except UserError as e:
            result = str(e)
    result = broadcast_object(result)
    if isinstance(result, str):
        raise UserError(result)
    return result


def _load_hub(name: str, config: str | None, src: str, tgt: str) -> Splits:
    try:
        import datasets
    except ImportError:
        raise UserError(f"--data {name} looks like a Hugging Face dataset name, which needs `pip install datasets` "
                        "(or use a local directory of {split}.{lang} files)") from None  # fmt: skip
    offline_hint = (f"offline or the Hub is unreachable: use a local directory (--data DIR with train.{src}, "
                    f"train.{tgt}, ...) or a dataset already in the cache with HF_DATASETS_OFFLINE=1")  # fmt: skip
    try:
        if config is None:  # opus_books style: one config per language pair, in either order
            configs = datasets.get_dataset_config_names(name)
            config = next((c for c in (f"{src}-{tgt}", f"{tgt}-{src}") if c in configs), None)
            config = configs[0] if config is None and len(configs) == 1 else config
            if config is None:
                shown = ", ".join(configs[:30]) + (" ..." if len(configs) > 30 else "")
                raise UserError(f"dataset {name} has no {src}-{tgt} language pair (configs: {shown}; set "
                                "--lang-src/--lang-tgt or --data-config)")  # fmt: skip
        dd = datasets.load_dataset(name, config)
    except UserError:
        raise
    except Exception as e:  # ConnectionError, DatasetNotFoundError, a bad config, ...: one line, never a traceback
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        network = any(w in first.lower() for w in ("connect", "offline", "resolve", "timed out", "unreachable"))
        hint = offline_hint if network or isinstance(e, ConnectionError) else "and it is not a local directory either"
        raise UserError(f"cannot load dataset {name!r} config {config!r}: {first} ({hint})") from None
    return {split: _pairs_from_columns(ds, src, tgt, f"{name}[{split}]") for split, ds in dd.items()}


def read_saved_dataset(path: Path, src: str, tgt: str) -> Splits:
    """A `save_to_disk` directory: a DatasetDict (its splits) or a single Dataset (train only)."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path} is a `save_to_disk` directory, which needs `pip install datasets`") from None
    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"cannot read the saved dataset at {path}: {str(e).splitlines()[0][:200]} (give the whole "
                        "directory that save_to_disk wrote, or a directory of text files)") from None  # fmt: skip
    dd = obj if isinstance(obj, datasets.DatasetDict) else {"train": obj}
    return {split: _pairs_from_columns(ds, src, tgt, f"{path}[{split}]") for split, ds in dd.items()}


def _pairs_from_columns(ds, src: str, tgt: str, where: str) -> tuple[list[str], list[str]]:
    """A `translation` column of {lang: text} dicts, columns named after the languages, or two text columns."""
    cols = ds.column_names
    if "translation" in cols:
        rows = ds["translation"]
        if len(rows) and not (src in rows[0] and tgt in rows[0]):
            raise UserError(f"{where} has languages {', '.join(sorted(rows[0]))}, not {src} and {tgt} (set "
                            "--lang-src/--lang-tgt)")  # fmt: skip
        return [r[src] for r in rows], [r[tgt] for r in rows]
    if src in cols and tgt in cols:
        return list(ds[src]), list(ds[tgt])
    text = [c for c in cols if getattr(ds.features[c], "dtype", None) in ("string", "large_string")]
    if len(text) == 2:
        print0(f"note: {where}: using column {text[0]!r} as the source and {text[1]!r} as the target")
        return list(ds[text[0]]), list(ds[text[1]])
    raise UserError(f"{where} has columns {cols}: need 'translation', '{src}'+'{tgt}', or exactly two text columns")


def train_tokenizer(kind: str, sentences: list[str], vocab_size: int):
    """A joint source+target tokenizer whose decode gives back the exact text: byte-level BPE (never <unk>), or
    wordlevel, one id per word or punctuation mark (lossless for known words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    else:  # wordlevel (argparse's choices)
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        # Metaspace keeps the spaces as "▁" on the words, so decoding restores "word, word." exactly.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
        tok.decoder = decoders.Metaspace()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                            show_progress=False)  # fmt: skip
    tok.train_from_iterator(sentences, trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [PAD, UNK, BOS, EOS]
    return tok


def shared_tokenizer(args, train: tuple[list[str], list[str]], info: DistInfo) -> str:
    """Rank 0 trains the tokenizer on both sides of the training pairs; every rank gets its JSON by broadcast."""
    tok_json = train_tokenizer(args.tokenizer, train[0] + train[1], args.vocab_size).to_str() if info.is_main else None
    return broadcast_object(tok_json)


def load_tokenizer(text: str, path):
    """The tokenizer a checkpoint at ``path`` carries as JSON, or one line naming the file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers package raises Exception itself on JSON it cannot use
        detail = " ".join(str(e).split())[:160]
        raise UserError(f"checkpoint {path} holds no usable tokenizer: {detail} (pass a last.pt or best.pt that "
                        "transformer/train.py wrote)") from None  # fmt: skip


def encode(tok, sentences: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(sentences, add_special_tokens=False)]


def decode(tok, ids: list[list[int]]) -> list[str]:
    return tok.decode_batch(ids, skip_special_tokens=True)


# every character some reader ends a line at (str.splitlines() splits at all): a byte-level BPE can emit any, and
# one in a hypothesis would misalign every line after it
LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]+")


def one_line(text: str) -> str:
    return LINE_BREAKS.sub(" ", text)


class ParallelDataset(Dataset):
    """Pair i as two int64 tensors, source `ids + </s>` and target `<s> + ids + </s>`, made once up front."""

    def __init__(self, src: list[list[int]], tgt: list[list[int]]):
        self.src = [torch.tensor(s + [EOS]) for s in src]
        self.tgt = [torch.tensor([BOS] + t + [EOS]) for t in tgt]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.src[i], self.tgt[i]

    def __getstate__(self) -> dict:
        # to a DataLoader worker as two flat arrays, not one tensor per sentence
        return {k: (torch.cat(v).numpy(), [len(t) for t in v]) for k, v in vars(self).items()}

    def __setstate__(self, state: dict) -> None:
        for k, (flat, lengths) in state.items():
            setattr(self, k, list(torch.from_numpy(flat).split(lengths)))


def collate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> src (B, S), tgt_in (B, T) = <s> ids, tgt_out (B, T) = ids </s>, right-padded. A short row's tgt_in also
    holds its </s>, but where the target is <pad> (no loss), and the causal mask hides it from earlier positions."""
    src = pad_sequence([s for s, _ in pairs], batch_first=True, padding_value=PAD)
    tgt = pad_sequence([t for _, t in pairs], batch_first=True, padding_value=PAD)
    return src, tgt[:, :-1], tgt[:, 1:]


def token_batches(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Cut `order` into consecutive batches whose padded size (count x longest) stays <= max_tokens (or of one)."""
    batches, longest = [], 0
    for i in order:
        if batches and max(longest, lengths[i]) * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            batches.append([i])
            longest = lengths[i]
    return batches


def padded_batches(src: list[list[int]], tgt: list[list[int]], max_tokens: int, device) -> Iterator[tuple]:
    """The pairs as padded batches on ``device`` (``collate``), by length, each of at most ``max_tokens`` padded."""
    pairs, lengths = ParallelDataset(src, tgt), [max(len(s), len(t)) + 1 for s, t in zip(src, tgt)]
    for batch in token_batches(sorted(range(len(src)), key=lengths.__getitem__), lengths, max_tokens):
        yield tuple(t.to(device) for t in collate([pairs[i] for i in batch]))


def pack_rows(src_lens: list[int], tgt_lens: list[int], capacity: int) -> list[int]:
    """How many pairs each row takes, in order, while both its sides stay within `capacity` tokens."""
    sizes, n, s_sum, t_sum = [], 0, 0, 0
    for s, t in zip(src_lens, tgt_lens):
        if n and (s_sum + s > capacity or t_sum + t > capacity):
            sizes.append(n)
            n, s_sum, t_sum = 0, 0, 0
        n, s_sum, t_sum = n + 1, s_sum + s, t_sum + t
    return sizes + [n] if n else sizes


class PackedRows(Dataset):
    """dataset[list of pair indices] -> one row, (5, pack_len) int64: src, tgt_in, tgt_out, src_doc, tgt_doc.
    Pair k is document k on both sides; the tail (<pad>, no loss) is one more document, never empty."""

    def __init__(self, pairs: ParallelDataset, pack_len: int):
        self.pairs, self.pack_len = pairs, pack_len

    def __getitem__(self, row: list[int]) -> torch.Tensor:
        src, tgt = [self.pairs.src[i] for i in row], [self.pairs.tgt[i] for i in row]
        out = torch.full((5, self.pack_len), PAD)
        out[3:] = len(row)  # the tail's document id
        for side, seqs, doc in ((0, src, 3), (1, [t[:-1] for t in tgt], 4), (2, [t[1:] for t in tgt], None)):
            if row:
                ids = torch.cat(seqs)
                out[side, : len(ids)] = ids
                if doc is not None:
                    out[doc, : len(ids)] = torch.repeat_interleave(torch.tensor([len(x) for x in seqs]))
        return out


class PackedBatchSampler(Sampler):
    """Packed rows for DDP: yields, per micro-batch, `rows` rows (lists of pair indices; see PackedRows). Once, from
    the seed, a random order of the pairs is packed into rows (the layout: each position keeps its pair's lengths).
    Epoch e, from (seed, e) only, swaps pairs of equal lengths at random (same row sizes, other sentences) and
    shuffles the rows. The epochs' rows are dealt end to end: `rows` to a micro-batch, world_size x accum to a step,
    rank r taking r*accum ... r*accum+accum-1; an epoch's last step is topped up from the next epoch (the run's last
    with empty rows). So every step has one shape and every rank as many steps (no DDP hang). `set_epoch(e, skip=k,
    until=n)` skips this rank's first k micro-batches and deals on to epoch n: one iterator serves the whole run."""

    def __init__(self, src_lens: list[int], tgt_lens: list[int], pack_len: int, rows: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, accum: int = 1, epochs: int | None = None):  # fmt: skip
        # numpy, not ATen: ATen's threaded CPU kernels are slow on arrays this small on many cores (the loop's thread)
        self.src_lens, self.tgt_lens = np.array(src_lens, dtype=np.int64), np.array(tgt_lens, dtype=np.int64)
        longer = np.maximum(self.src_lens, self.tgt_lens)
        if int(longer.max()) >= pack_len:
            raise ValueError(f"a pair of {int(longer.max())} tokens does not fit a row of {pack_len} (and its tail)")
        self.rank, self.world, self.seed, self.accum, self.rows = rank, world_size, seed, accum, rows
        self.group = world_size * accum  # micro-batches per optimizer step, all ranks together
        self.per_step = rows * self.group  # rows per optimizer step, all ranks together
        self.epochs = epochs  # the end of the data (None: no end)
        top = int(longer.max()) + 1
        self.key = (longer * top + self.tgt_lens) * top + self.src_lens
        layout = torch.randperm(len(self.key), generator=torch.Generator().manual_seed(mix_seed(seed, 54321))).numpy()
        self.slots = np.argsort(self.key[layout], kind="stable")  # the layout's positions, by the lengths they take
        sizes = pack_rows(self.src_lens[layout].tolist(), self.tgt_lens[layout].tolist(), pack_len - 1)
        self.bounds = [0, *itertools.accumulate(sizes)]
        self.n_rows = len(sizes)  # rows of each epoch, all real
        self.steps_per_epoch = self.n_rows / self.per_step  # on average
        self.fill = float(self.src_lens.sum() + self.tgt_lens.sum()) / (2 * self.n_rows * pack_len)
        self._rows, self._plans = {}, {}  # a few epochs' rows and plans, made once
        self.set_epoch(0)

    def steps_before(self, epoch: int) -> int:
        """Optimizer steps of the epochs before `epoch` (an epoch's last step deals its last row)."""
        return -(-epoch * self.n_rows // self.per_step)

    def steps_in(self, epoch: int) -> int:
        return self.steps_before(epoch + 1) - self.steps_before(epoch)

    def epoch_rows(self, epoch: int) -> tuple[list[list[int]], list[int]]:
        """Epoch `epoch`'s rows in dealing order, and the target tokens of each."""
        if epoch not in self._rows:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            perm = torch.randperm(len(self.key), generator=g).numpy()
            order = np.empty_like(perm)
            order[self.slots] = perm[np.argsort(self.key[perm], kind="stable")]  # pairs of equal lengths, shuffled
            tokens = np.add.reduceat(self.tgt_lens[order], self.bounds[:-1])  # of each row
            flat = order.tolist()
            shuffle = torch.randperm(self.n_rows, generator=g).tolist()
            rows = [flat[self.bounds[k] : self.bounds[k + 1]] for k in shuffle]
            self._rows = {e: r for e, r in self._rows.items() if epoch - 2 <= e <= epoch + 1}
            self._rows[epoch] = rows, tokens[shuffle].tolist()
        return self._rows[epoch]

    def plan(self, epoch: int) -> tuple[list[list[list[list[int]]]], list[int]]:
        """The epoch's optimizer steps (each world_size x accum micro-batches of `rows` rows) and each step's target
        tokens; the previous epoch's plan is kept too."""
        if epoch in self._plans:
            return self._plans[epoch]
        rows, tokens = [], []
        for k in range(self.steps_before(epoch) * self.per_step, self.steps_before(epoch + 1) * self.per_step):
            e, i = divmod(k, self.n_rows)  # the rows of all epochs end to end: row i of epoch e
            real = self.epochs is None or e < self.epochs  # past the end of the data: empty rows
            rows.append(self.epoch_rows(e)[0][i] if real else [])
            tokens.append(self.epoch_rows(e)[1][i] if real else 0)
        batches = [rows[k : k + self.rows] for k in range(0, len(rows), self.rows)]
        steps = [batches[k : k + self.group] for k in range(0, len(batches), self.group)]
        step_tokens = [sum(tokens[k : k + self.per_step]) for k in range(0, len(tokens), self.per_step)]
        self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
        self._plans[epoch] = steps, step_tokens
        return self._plans[epoch]

    def set_epoch(self, epoch: int, skip: int = 0, until: int | None = None) -> None:
        self.epoch, self.skip, self.until = epoch, skip, max(until or 0, epoch + 1)

    def step_tokens(self, epoch: int | None = None) -> list[int]:
        """Target tokens of each step of an epoch (default: the one set), all ranks together: the loss divisor."""
        return self.plan(self.epoch if epoch is None else epoch)[1]

    def rank_batches(self, epoch: int | None = None) -> list[list[list[int]]]:
        a, steps = self.accum, self.plan(self.epoch if epoch is None else epoch)[0]
        return [b for step in steps for b in step[self.rank * a : (self.rank + 1) * a]]

    def __iter__(self):
        for e in range(self.epoch, self.until):
            yield from self.rank_batches(e)[self.skip if e == self.epoch else 0 :]

    def __len__(self) -> int:
        return (self.steps_before(self.until) - self.steps_before(self.epoch)) * self.accum - self.skip
