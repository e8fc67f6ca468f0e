"""An encoder-decoder Transformer for translation, written out block by block.

    src (B, S) --embed--> Encoder: N x [self-attention, feed-forward] --> memory (B, S, D)
    tgt (B, T) --embed--> Decoder: N x [causal self-attention, cross-attention to memory, feed-forward]
               --> logits (B, T, V), through the (shared) embedding matrix

Pre-norm (LayerNorm before each sub-layer, as in most modern Transformers: stable without a long
warmup), sinusoidal positions, one embedding matrix for source, target and output (the vocabulary
is joint). Attention goes through F.scaled_dot_product_attention, which picks flash / memory-
efficient kernels on GPUs. B batch, S source length, T target length, D model width, H heads,
V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.utils import autocast
from transformer.data import BOS, EOS, PAD, pad_batch, token_batches


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
    "small": dict(d_model=512, n_heads=8, enc_layers=3, dec_layers=3, d_ff=1024, dropout=0.3),  # Multi30k-size data
    "tiny": dict(d_model=64, n_heads=4, enc_layers=2, dec_layers=2, d_ff=256, dropout=0.0),  # tests, CPU smoke runs
}


def allow_cudnn_attention(allow: bool) -> None:
    """Whether F.scaled_dot_product_attention may use cuDNN's fused attention (flash and memory-efficient
    kernels remain). PyTorch picks cuDNN first on H100, but every new input shape costs cuDNN time (a new
    execution plan, we infer), and token-budget batches and step-by-step decoding bring new shapes all the
    time: on one H100, eager `base` training on many batch shapes ran at 158k target tokens/s with it and
    384k without (BENCHMARKS.md, "Why cuDNN attention is off"). Off by default in train.py and translate.py."""
    torch.backends.cuda.enable_cudnn_sdp(allow)


class Attention(nn.Module):
    """Multi-head attention. Self-attention when `memory` is None, else cross-attention to it."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be a multiple of n_heads"
        self.n_heads, self.dropout = n_heads, dropout
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x, memory=None, mask=None, causal: bool = False):
        # x (B, T, D); memory (B, S, D); mask (B, 1, 1, S) bool, True = may attend (padding keys False)
        B, T, D = x.shape
        memory = x if memory is None else memory
        S, H = memory.shape[1], self.n_heads
        q = self.q(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, D/H)
        k, v = self.kv(memory).view(B, S, 2, H, D // H).permute(2, 0, 3, 1, 4)  # 2 x (B, H, S, D/H)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )  # (B, H, T, D/H)
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
        self.norm1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.norm2, self.ff = nn.LayerNorm(cfg.d_model), FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, src_mask):  # x (B, S, D)
        x = x + self.drop(self.attn(self.norm1(x), mask=src_mask))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.self_attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.norm2, self.cross_attn = nn.LayerNorm(cfg.d_model), Attention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.norm3, self.ff = nn.LayerNorm(cfg.d_model), FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, memory, src_mask):  # x (B, T, D), memory (B, S, D)
        # Causal mask only: padding is on the right, so a real position t only ever sees positions <= t,
        # which are all real. Without an explicit mask SDPA can use the flash kernel.
        x = x + self.drop(self.self_attn(self.norm1(x), causal=True))
        x = x + self.drop(self.cross_attn(self.norm2(x), memory, mask=src_mask))
        return x + self.drop(self.ff(self.norm3(x)))


def sinusoids(length: int, d_model: int) -> torch.Tensor:
    """(length, d_model) fixed positional encodings of Vaswani et al."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


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

    def embed_tokens(self, ids):  # (B, L) -> (B, L, D)
        if ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"sequence of {ids.shape[1]} tokens > max_positions {self.cfg.max_positions}")
        return self.drop(self.embed(ids) * math.sqrt(self.cfg.d_model) + self.pos[: ids.shape[1]])

    def encode(self, src):
        """src (B, S) -> memory (B, S, D), src_mask (B, 1, 1, S) True at real tokens."""
        src_mask = (src != PAD)[:, None, None, :]
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x), src_mask

    def decode(self, tgt_in, memory, src_mask, last_only: bool = False):
        """tgt_in (B, T) -> logits (B, T, V) for the next token at every position ((B, 1, V) if last_only)."""
        x = self.embed_tokens(tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, src_mask)
        x = self.dec_norm(x[:, -1:] if last_only else x)  # generation needs only the newest position's logits
        return F.linear(x, self.embed.weight)  # tied output layer

    def forward(self, src, tgt_in):  # (B, S), (B, T) -> (B, T, V)
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)


# ------------------------------------------------------------------ decoding (validation and translate.py)


@torch.no_grad()
def generate(model: Transformer, src: torch.Tensor, beam: int = 1, max_len: int | None = None) -> list[list[int]]:
    """Translate a padded batch src (B, S) -> B lists of token ids (without <s>, </s> and <pad>).

    Greedy with beam=1, else beam search with length-normalized final scores. Each step re-runs the
    decoder over the prefix (no key/value cache: simpler, and cheap for sentence-length outputs);
    the causal mask makes that equal to incremental decoding.
    """
    B = src.shape[0]
    max_len = min(max_len or int(1.5 * src.shape[1]) + 10, model.cfg.max_positions - 1)
    memory, src_mask = model.encode(src)
    if beam > 1:  # every sentence gets `beam` rows: (B*K, ...)
        memory, src_mask = memory.repeat_interleave(beam, 0), src_mask.repeat_interleave(beam, 0)
    K = beam
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
    out = []
    for row in ys[:, 1:].tolist():
        out.append(row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD])
    return out


def translate_ids(model, sources: list[list[int]], max_tokens: int, beam: int = 1, dtype=None) -> list[list[int]]:
    """Translate token-id sentences in length-sorted token-budget batches; results in input order."""
    device = next(model.parameters()).device
    lengths = [len(s) + 1 for s in sources]
    order = sorted(range(len(sources)), key=lengths.__getitem__)
    out: list[list[int]] = [[] for _ in sources]
    for batch in token_batches(order, lengths, max(1, max_tokens // beam)):
        src = pad_batch([sources[i] + [EOS] for i in batch]).to(device)
        with autocast(device, dtype):
            hyps = generate(model, src, beam)
        for i, h in zip(batch, hyps):
            out[i] = h
    return out
