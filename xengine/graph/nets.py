"""Networks written here in plain torch, for tests and as named nets (``net=gpt2_small``):
nothing is downloaded.

:class:`GPTDecoder` is a GPT-2-style decoder (Radford et al. 2019): token and position
embeddings, pre-norm blocks of causal self-attention
(:func:`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP with residual adds,
a final LayerNorm and a linear head over the vocabulary. It is the kind of model the
rematerialization literature evaluates on (Rockmate, HiRemate: GPT models), small enough for
a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """The decoder's sizes. ``gpt2_small`` is GPT-2's shape scaled down for a CPU: 4 layers
    of width 128 with 4 heads (GPT-2 small: 12 layers, 768, 12 heads, 50257 tokens)."""

    vocab_size: int = 512
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask: one op in the captured graph when it is a
    leaf module (the split into heads is views of the fused q, k, v projection)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTDecoder(nn.Module):
    """Token ids ``[batch, seq_len]`` -> logits ``[batch, seq_len, vocab_size]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.register_buffer("pos", torch.arange(cfg.seq_len), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(self.pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a decoder: cross-entropy over every position (logits
    ``[batch, seq, vocab]``, target ``[batch, seq]`` token ids)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def next_token_batch(
    vocab: int, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and the next token at every position: one random sequence of ``seq_len + 1``
    tokens per sample, shifted by one (transformers' causal-LM loss shifts the same way)."""
    seq = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
