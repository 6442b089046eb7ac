"""A small GPT-style language model: examples/train.py trains it on bytes of Python source
(examples/data.py); benchmarks/bench_step.py times its training step."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attn_bias: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, bias=attn_bias, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token embeddings plus learned positions, pre-LayerNorm blocks of causal attention and a 4x MLP, and an
    untied LM head. ``attn_bias=False`` drops the attention's input and output projection biases (the key
    bias gets only rounding noise as a gradient, which Adam amplifies: benchmarks/bench_step.py)."""

    def __init__(
        self, vocab: int = 64, dim: int = 128, heads: int = 4, layers: int = 2, seq: int = 32, attn_bias: bool = True
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, attn_bias) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))

