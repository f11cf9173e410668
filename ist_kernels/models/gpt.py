"""A small decoder-only transformer (GPT-style) for byte-level language modelling.

Pre-LayerNorm blocks (``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``), causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a GELU FFN of ``4 * width`` hidden units,
learned positions, and the output projection tied to the token embedding (the logits are
``F.linear(h, tok_emb.weight)``: one tensor, so a subnetwork cut from the model stays tied).

Layer names: ``tok_emb``, ``pos_emb``, ``blocks.<i>.{ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj}``,
``ln_f``. The attention's ``qkv`` rows are ``[q heads | k heads | v heads]``, ``head_dim`` rows per
head, and the number of heads a module computes is read from its weight's shape, so a subnetwork
with some heads' rows (and the matching columns of ``attn.proj``) or some FFN units (rows of
``mlp.fc``, columns of ``mlp.proj``) runs unchanged.

Plain float attributes (not buffers, 1.0 by default) scale the branches: ``attn.output_scale`` and
``mlp.output_scale`` multiply the heads' / the FFN units' outputs before the output projection (whose
bias is not scaled; IST's full model sets them to 1/S, so its branch is the mean of the subnetworks'
branches) and a block's ``residual_scale`` (ResIST, paper 003 §2.6: both branches of a
partitioned block scaled by the expected fraction of subnetworks that own it).
"""
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: name -> (width, depth, head_dim): the defaults of ``gpt_tiny`` and ``gpt_small``
GPT_SIZES: Dict[str, Tuple[int, int, int]] = {"gpt_tiny": (128, 4, 32), "gpt_small": (256, 6, 32)}
#: the language models of this package (the trainer pairs them with token data sets)
LANGUAGE_MODELS = tuple(sorted(GPT_SIZES))


def gpt_shape(name: str, width: Optional[int] = None, depth: Optional[int] = None) -> Tuple[int, int, int]:
    """``(width, depth, heads)`` of ``name`` built with these options (None: the model's default):
    heads of the model's ``head_dim`` (32), fewer where that does not divide ``width``."""
    w, d, head_dim = GPT_SIZES[name]
    width = w if width is None else width
    heads = max(1, width // head_dim)
    while width % heads:
        heads -= 1
    return width, d if depth is None else depth, heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the heads are ``qkv.weight.shape[0] // (3 * head_dim)``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"CausalSelfAttention: width={width} must be a multiple of heads={heads} >= 1")
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.output_scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        heads = self.qkv.weight.shape[0] // (3 * self.head_dim)
        q, k, v = self.qkv(x).view(B, T, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, heads * self.head_dim)
        return self.proj(y * self.output_scale if self.output_scale != 1.0 else y)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}" + (f", output_scale={self.output_scale}" if self.output_scale != 1.0 else "")


class FeedForward(nn.Module):
    """``proj(output_scale * gelu(fc(x)))``; the hidden units are ``fc``'s rows."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)
        self.output_scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        return self.proj(h * self.output_scale if self.output_scale != 1.0 else h)

    def extra_repr(self) -> str:
        return f"output_scale={self.output_scale}" if self.output_scale != 1.0 else ""


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = FeedForward(width, hidden)
        self.residual_scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        s = self.residual_scale
        a = self.attn(self.ln1(x))
        x = x + (a * s if s != 1.0 else a)
        m = self.mlp(self.ln2(x))
        return x + (m * s if s != 1.0 else m)

    def extra_repr(self) -> str:
        return f"residual_scale={self.residual_scale}" if self.residual_scale != 1.0 else ""


class GPT(nn.Module):
    """Tokens ``[B, T]`` (int, ``0 <= token < vocab_size``, ``T <= context``) -> logits ``[B, T, vocab_size]``."""

    def __init__(self, vocab_size: int = 256, context: int = 128, width: int = 128, depth: int = 4,
                 heads: int = 4, ffn_mult: int = 4):
        super().__init__()
        if min(vocab_size, context, width, depth, heads, ffn_mult) < 1:
            raise ValueError(f"GPT: vocab_size, context, width, depth, heads and ffn_mult must be >= 1, got "
                             f"{vocab_size}, {context}, {width}, {depth}, {heads}, {ffn_mult}")
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, ffn_mult * width) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, the residual projections scaled
        by 1/sqrt(2 depth)."""
        depth = len(self.blocks)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            else:
                std = 0.02 / (2 * depth) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if T > self.context:
            raise ValueError(f"GPT: sequence of {T} tokens is longer than the context {self.context}")
        pos = torch.arange(T, device=tokens.device)
        h = self.blocks(self.tok_emb(tokens) + self.pos_emb(pos))
        return F.linear(self.ln_f(h), self.tok_emb.weight)


def _gpt(name: str, vocab_size: int, context: int, width: Optional[int], depth: Optional[int]) -> GPT:
    width, depth, heads = gpt_shape(name, width, depth)
    return GPT(vocab_size, context, width, depth, heads)


def gpt_tiny(vocab_size: int = 256, context: int = 128, width: Optional[int] = None,
             depth: Optional[int] = None) -> GPT:
    """Width 128, 4 blocks, heads of 32 (4), FFN 512: about 0.8M parameters for 256 bytes."""
    return _gpt("gpt_tiny", vocab_size, context, width, depth)


def gpt_small(vocab_size: int = 256, context: int = 128, width: Optional[int] = None,
              depth: Optional[int] = None) -> GPT:
    """Width 256, 6 blocks, heads of 32 (8), FFN 1024: about 4.8M parameters for 256 bytes."""
    return _gpt("gpt_small", vocab_size, context, width, depth)
