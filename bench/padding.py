"""How much of a token-budget batch is real text: the padding cost of padded batches (CPU only).

    python bench/padding.py --data .data/multi30k --lang-src de --lang-tgt en --max-tokens 8192 65536

The budget counts sentences x the longest (source or target) sentence of the batch; the encoder then computes
on batch x longest source and the decoder on batch x longest target. For each budget this prints, for the
sampler's order (sorted by target, then source length) and for one sorted by the longer side first, the
batches per epoch, the real share of the padded source and target positions, and the real target tokens per
batch, which is what tokens/s and MFU count. This report is why evaluation sorts by the longer side first.
transformer/train.py trains on packed rows instead (transformer/README.md, "Batches"), whose share of real
tokens its config.json records as `row_fill`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from transformer.data import encode, read_text_dir, token_batches, train_tokenizer


def padding_stats(batches: list[list[int]], src: list[int], tgt: list[int]) -> dict:
    real_s, real_t = sum(src[i] for b in batches for i in b), sum(tgt[i] for b in batches for i in b)
    pad_s = sum(len(b) * max(src[i] for i in b) for b in batches)
    pad_t = sum(len(b) * max(tgt[i] for i in b) for b in batches)
    return {
        "batches": len(batches),
        "src_real": real_s / pad_s,
        "tgt_real": real_t / pad_t,
        "tgt_per_batch": real_t / len(batches),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dir of line-aligned {split}.{lang}[.gz] files")
    p.add_argument("--lang-src", default="de")
    p.add_argument("--lang-tgt", default="en")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[8192, 65536])
    args = p.parse_args()
    src_text, tgt_text = read_text_dir(Path(args.data), args.lang_src, args.lang_tgt)["train"]
    tok = train_tokenizer("bpe", src_text + tgt_text, args.vocab_size)
    src = [len(s) + 1 for s in encode(tok, src_text)]  # + </s>, as train.py counts them
    tgt = [len(t) + 1 for t in encode(tok, tgt_text)]
    longer = [max(s, t) for s, t in zip(src, tgt)]
    cols = ["max tokens", "order", "batches/epoch", "real share: padded source", "padded target", "real tgt/batch"]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|")
    for mt in args.max_tokens:
        keys = {"target, then source length": lambda i: (tgt[i], src[i])}
        keys["longer side, then target, then source"] = lambda i: (longer[i], tgt[i], src[i])
        orders = {name: token_batches(sorted(range(len(src)), key=key), longer, mt) for name, key in keys.items()}
        for name, batches in orders.items():
            s = padding_stats(batches, src, tgt)
            cells = [
                mt,
                name,
                s["batches"],
                f"{s['src_real']:.3f}",
                f"{s['tgt_real']:.3f}",
                f"{s['tgt_per_batch']:,.0f}",
            ]
            print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
