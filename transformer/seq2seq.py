"""An encoder-decoder Transformer for translation: pre-norm, sinusoidal positions, one embedding matrix for source,
target and output. B batch, S source length, T target length, D width, H heads, V vocabulary. Packed training rows
carry a document id per token: positions count from each sentence's start, and ``document_masks`` keeps every
sentence to itself (FlexAttention block masks on GPUs, dense masks for SDPA elsewhere). Padded batches (evaluation,
decoding) hold one sentence per row."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from text import BOS, EOS, PAD, token_batches
from torch.nn.utils.rnn import pad_sequence

from common.errors import UserError


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    max_positions: int = 1024


PRESETS = {
    "base": dict(d_model=512, n_heads=8, enc_layers=6, dec_layers=6, d_ff=2048, dropout=0.1),  # Vaswani et al.
    "small": dict(d_model=512, n_heads=8, enc_layers=3, dec_layers=3, d_ff=1024, dropout=0.4),  # Multi30k-size data
    "tiny": dict(d_model=64, n_heads=4, enc_layers=2, dec_layers=2, d_ff=256, dropout=0.0),  # tests, CPU smoke runs
    "1b": dict(d_model=2048, n_heads=16, enc_layers=9, dec_layers=9, d_ff=8192, dropout=0.1),  # 1.07B params
}


def model_config(args, vocab_size: int) -> ModelConfig:
    """The preset, with the flags that override it."""
    overrides = {"d_model": args.d_model, "n_heads": args.heads, "d_ff": args.d_ff, "dropout": args.dropout}
    overrides.update(enc_layers=args.layers, dec_layers=args.layers)
    return ModelConfig(vocab_size, **{**PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None}})


def check_size(cfg: ModelConfig) -> None:
    """Every rank builds the whole model on the host before it moves or shards it (and on a CPU trains it there,
    with gradients and AdamW's two moments): a model that cannot fit would be killed by the kernel without a word."""
    if not hasattr(os, "sysconf"):  # Windows: no portable figure for the host's memory
        return
    with torch.device("meta"):  # shapes only: no memory
        n = sum(p.numel() for p in Transformer(cfg).parameters())
    size, host = n * (4 if torch.cuda.is_available() else 16), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > host:
        raise UserError(f"the model of {n / 1e9:.2f}B parameters needs {size / 2**30:.0f} GiB on the host, which has "
                        f"{host / 2**30:.0f} GiB (lower --d-model, --d-ff, --layers or --vocab-size)")  # fmt: skip


@functools.cache  # FlexAttention is imported on first use (GPU training on packed rows): it imports slowly
def compiled(fn):
    """torch.compile(fn) for an eager model on a GPU, made once (a compiled model traces the plain function)."""
    return torch.compile(fn, dynamic=False)


def document_masks(src_doc, tgt_doc, dense: bool | None = None) -> tuple:
    """(encoder, decoder, cross-attention) masks of a packed batch from its document ids (B, S) and (B, T):
    BlockMasks on GPUs, dense (B, 1, Lq, Lkv) masks elsewhere (FlexAttention has no CPU backward), or as `dense`."""

    def within_document(b, h, q, kv):  # encoder: a source token sees its own sentence
        return src_doc[b, q] == src_doc[b, kv]

    def causal_within_document(b, h, q, kv):  # decoder: a target token sees its own sentence's earlier tokens
        return (tgt_doc[b, q] == tgt_doc[b, kv]) & (kv <= q)

    def to_own_source(b, h, q, kv):  # cross-attention: target sentence i sees source sentence i
        return tgt_doc[b, q] == src_doc[b, kv]

    make = dense_mask if (not src_doc.is_cuda if dense is None else dense) else block_mask
    return (make(within_document, src_doc, src_doc), make(causal_within_document, tgt_doc, tgt_doc),
            make(to_own_source, tgt_doc, src_doc))  # fmt: skip


def block_mask(mask_mod, q_doc, kv_doc):
    """FlexAttention's block-sparse form of mask_mod: 128 x 128 blocks, skipped where no pair may attend."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, q_doc.shape[0], None, q_doc.shape[1], kv_doc.shape[1], device=q_doc.device)


def dense_mask(mask_mod, q_doc, kv_doc) -> torch.Tensor:
    """mask_mod evaluated at every (query, key) pair at once: (B, 1, Lq, Lkv) bool for SDPA."""
    B, Lq, Lkv = q_doc.shape[0], q_doc.shape[1], kv_doc.shape[1]
    b, q, kv = (torch.arange(n, device=q_doc.device) for n in (B, Lq, Lkv))
    return mask_mod(b[:, None, None], None, q[None, :, None], kv[None, None, :])[:, None]


def padding_mask(src):  # a padded batch (B, S) -> (B, 1, 1, S), True at real tokens
    return (src != PAD)[:, None, None, :]


def positions_in_documents(doc):
    """(B, L) document ids -> each token's position inside its own document."""
    idx = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    starts = F.pad(doc[:, 1:] != doc[:, :-1], (1, 0), value=True)
    return idx - torch.where(starts, idx, 0).cummax(1).values


class Attention(nn.Module):
    """Multi-head self-attention, or cross-attention to `memory`. No dropout on the attention probabilities:
    FlexAttention, which trains the packed rows, has none."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be a multiple of n_heads"
        self.n_heads, self.q = n_heads, nn.Linear(d_model, d_model)
        self.kv, self.out = nn.Linear(d_model, 2 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, memory=None, mask=None, causal: bool = False):
        # mask: a BlockMask, or a bool tensor broadcastable to (B, H, T, S), True where a query may attend
        B, T, D = x.shape
        memory = x if memory is None else memory
        S, H = memory.shape[1], self.n_heads
        q = self.q(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, D/H)
        k, v = self.kv(memory).view(B, S, 2, H, D // H).permute(2, 0, 3, 1, 4)  # 2 x (B, H, S, D/H)
        if mask is None or isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, H, T, D/H)
        else:  # a BlockMask: FlexAttention, eager only as a slow reference (CPU); compiled, one fused kernel
            from torch.nn.attention.flex_attention import flex_attention

            if q.is_cuda and not torch.compiler.is_compiling():
                flex_attention = compiled(flex_attention)
            y = flex_attention(q, k, v, block_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), nn.Dropout(dropout)

    def forward(self, x):  # (B, T, D) -> (B, T, D)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads)
        self.norm2, self.ff = nn.LayerNorm(cfg.d_model), FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, mask):  # x (B, S, D)
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.self_attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads)
        self.norm2, self.cross_attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads)
        self.norm3, self.ff = nn.LayerNorm(cfg.d_model), FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, memory, cross_mask, self_mask=None):  # x (B, T, D), memory (B, S, D)
        # a padded batch needs the causal mask only (self_mask None): padding is on the right
        x = x + self.drop(self.self_attn(self.norm1(x), mask=self_mask, causal=self_mask is None))
        x = x + self.drop(self.cross_attn(self.norm2(x), memory, mask=cross_mask))
        return x + self.drop(self.ff(self.norm3(x)))


def sinusoids(length: int, d_model: int) -> torch.Tensor:  # (length, d_model): sin, cos, sin, cos, ...
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angle = torch.arange(length, dtype=torch.float32)[:, None] * freq
    return torch.stack([angle.sin(), angle.cos()], -1).flatten(1)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD)  # shared: src, tgt and output
        self.register_buffer("pos", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        self.enc_norm, self.dec_norm = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        # N(0, 1/D): scaled by sqrt(D) on input (unit variance) and well-sized logits as the output layer.
        nn.init.normal_(self.embed.weight, std=self.cfg.d_model**-0.5)
        nn.init.zeros_(self.embed.weight[PAD])

    def embed_tokens(self, ids, pos=None):  # (B, L) ids, positions (B, L) or None (0, 1, ...) -> (B, L, D)
        if pos is None and ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"sequence of {ids.shape[1]} tokens > max_positions {self.cfg.max_positions}")
        pe = self.pos[: ids.shape[1]] if pos is None else self.pos[pos]
        return self.drop(self.embed(ids) * math.sqrt(self.cfg.d_model) + pe)

    def encode(self, src, mask, pos=None):
        """src (B, S) -> memory (B, S, D)."""
        x = self.embed_tokens(src, pos)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.enc_norm(x)

    def decode(self, tgt_in, memory, cross_mask, self_mask=None, pos=None, last_only: bool = False):
        """tgt_in (B, T) -> next-token logits (B, T, V), or (B, 1, V) if last_only."""
        x = self.embed_tokens(tgt_in, pos)
        for layer in self.decoder:
            x = layer(x, memory, cross_mask, self_mask)
        x = self.dec_norm(x[:, -1:] if last_only else x)  # generation needs only the newest position's logits
        return F.linear(x, self.embed.weight)  # tied output layer

    def forward(self, src, tgt_in, src_doc=None, tgt_doc=None, dense: bool | None = None, tgt_out=None,
                label_smoothing: float = 0.0):  # fmt: skip
        """(B, S), (B, T) -> logits (B, T, V): a padded batch, or packed rows when document ids are given. Given the
        targets tgt_out: their summed loss, in the forward so that torch.compile fuses it (and a step is one graph)."""
        if tgt_out is not None:
            return token_loss(self.forward(src, tgt_in, src_doc, tgt_doc, dense), tgt_out, label_smoothing)
        if src_doc is None:
            src_mask = padding_mask(src)
            return self.decode(tgt_in, self.encode(src, src_mask), src_mask)
        masks = document_masks
        if src_doc.is_cuda and dense is None and not torch.compiler.is_compiling():
            # built eagerly, the three block masks cost more than a step's attention
            masks = compiled(document_masks)
        enc_mask, dec_mask, cross_mask = masks(src_doc, tgt_doc, dense)
        memory = self.encode(src, enc_mask, positions_in_documents(src_doc))
        return self.decode(tgt_in, memory, cross_mask, dec_mask, positions_in_documents(tgt_doc))


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed token cross-entropy of a batch's logits (B, T, V), <pad> targets left out. Compiled (--compile), the loss
    over the whole vocabulary (the largest activation) fuses into a few kernels."""
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, label_smoothing=label_smoothing,
                           reduction="sum")  # fmt: skip


@torch.no_grad()
def generate(model: Transformer, src: torch.Tensor, beam: int = 1, max_len: int | None = None) -> list[list[int]]:
    """Translate a padded batch src (B, S) -> B lists of token ids: greedy, or beam search with length-normalized
    scores. Each step re-runs the decoder over the prefix (no key/value cache: simpler, cheap for sentences)."""
    B, K = src.shape[0], beam
    max_len = min(max_len or int(1.5 * src.shape[1]) + 10, model.cfg.max_positions - 1)
    src_mask = padding_mask(src)
    memory = model.encode(src, src_mask)
    if beam > 1:  # every sentence gets `beam` rows: (B*K, ...)
        memory, src_mask = memory.repeat_interleave(beam, 0), src_mask.repeat_interleave(beam, 0)
    ys = torch.full((B * K, 1), BOS, dtype=torch.long, device=src.device)  # prefixes, (B*K, t)
    done = torch.zeros(B * K, dtype=torch.bool, device=src.device)
    scores = torch.zeros(B, K, device=src.device)  # summed log-probs of each hypothesis
    scores[:, 1:] = -math.inf  # at the start all K rows are the same prefix: keep one
    for _ in range(max_len):
        logits = model.decode(ys, memory, src_mask, last_only=True)[:, -1].float()  # (B*K, V)
        if K == 1:
            nxt = torch.where(done, PAD, logits.argmax(-1))
            ys = torch.cat([ys, nxt[:, None]], 1)
        else:
            logp = F.log_softmax(logits, -1)
            logp[done] = -math.inf  # a finished hypothesis may only continue with <pad>, at no cost
            logp[done, PAD] = 0.0
            V = logp.shape[1]
            scores, flat = (scores.view(-1, 1) + logp).view(B, K * V).topk(K, dim=1)  # (B, K)
            rows = (torch.arange(B, device=src.device)[:, None] * K + flat // V).view(-1)
            nxt = (flat % V).view(-1)
            ys, done = torch.cat([ys[rows], nxt[:, None]], 1), done[rows]
        done |= nxt == EOS
        if done.all():
            break
    if K > 1:  # best hypothesis per sentence by score / length
        lengths = (ys[:, 1:] != PAD).sum(1).clamp(min=1).view(B, K)
        best = (scores / lengths).argmax(1)
        ys = ys.view(B, K, -1)[torch.arange(B, device=src.device), best]
    return [row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD] for row in ys[:, 1:].tolist()]


def translate_ids(model, sources: list[list[int]], max_tokens: int, beam: int = 1, dtype=None,
                  watch: Callable[[Iterable], Iterable] = iter) -> list[list[int]]:  # fmt: skip
    """Translate token-id sentences in length-sorted token-budget batches (each seen by ``watch``); results in input
    order."""
    device = next(model.parameters()).device
    lengths, out = [len(s) + 1 for s in sources], [[] for _ in sources]
    for batch in watch(token_batches(sorted(range(len(sources)), key=lengths.__getitem__), lengths,
                                     max(1, max_tokens // beam))):  # fmt: skip
        src = pad_sequence([torch.tensor(sources[i] + [EOS]) for i in batch], batch_first=True, padding_value=PAD)
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            hyps = generate(model, src.to(device), beam)
        for i, h in zip(batch, hyps):
            out[i] = h
    return out
