"""``nn.MultiheadAttention`` under IST's partition of heads: a subnetwork's compact module holding
some of the heads (:class:`HeadsMultiheadAttention`), and the full model's 1/S scale of the
heads' sum (:class:`AttentionScale`, a forward hook: torch's forward reads ``out_proj``'s weight
itself, so the pre-hook other output projections get would never run).

A head ``i`` of an ``nn.MultiheadAttention`` of width ``E = num_heads * head_dim`` is rows
``[i hd, (i + 1) hd)`` of each of the q, k and v blocks of ``in_proj_weight`` ``[3E, E]`` (or of
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` where ``kdim`` / ``vdim`` differ from ``E``),
the same entries of ``in_proj_bias`` and of ``bias_k`` / ``bias_v`` (``[1, 1, E]``), and columns
``[i hd, (i + 1) hd)`` of ``out_proj.weight``; ``out_proj.bias`` is shared. The heads are
independent, so the output of a module holding the heads ``P`` is the full module's with the other
heads' columns of ``out_proj.weight`` zeroed.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _float_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True: not attended) as an additive float mask, as torch's MHA reads it."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _pad(mask: Optional[Tensor]) -> Optional[Tensor]:
    return None if mask is None else F.pad(mask, (0, 1))


class HeadsMultiheadAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` holding ``num_heads`` of a full module's heads (a subnetwork's
    clone: :func:`.transformer.transformer_ist_plan` sets its class): ``in_proj_weight`` of
    ``3 * num_heads * head_dim`` rows (or ``q/k/v_proj_weight`` of ``num_heads * head_dim`` rows),
    ``in_proj_bias`` and ``bias_k`` / ``bias_v`` of those heads, ``out_proj`` reading them;
    ``embed_dim`` (its input and output width), ``kdim``, ``vdim`` and ``head_dim`` are the full
    module's. ``heads`` (the full module's indices of its heads) and ``full_heads`` select a 3-D
    ``attn_mask`` given per head of the full module (``[batch * full_heads, L, S]``).

    Its forward takes torch's arguments and computes torch's math (``F.multi_head_attention_forward``:
    masks, ``bias_k`` / ``bias_v``, ``add_zero_attn``, dropout on the weights, ``batch_first``,
    unbatched inputs) over its heads only: the full module's output with the other heads removed.
    The weights returned (``need_weights``) are its heads', averaged over them where asked.
    ``_qkv_same_embed_dim`` is False on such a module, so that ``nn.TransformerEncoderLayer`` does
    not take its fused fast path (which assumes a full module)."""

    heads: Optional[Tensor] = None
    full_heads: int = 0

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        batched = query.dim() == 3
        if self.batch_first and batched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if not batched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        L, N, _ = query.shape
        H, hd = self.num_heads, self.head_dim
        width = H * hd
        if self.in_proj_weight is not None:
            wq, wk, wv = self.in_proj_weight.split(width)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq, bk, bv = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.split(width)
        q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        attn_mask = _float_mask(attn_mask, q.dtype)
        key_padding_mask = _float_mask(key_padding_mask, q.dtype)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_mask = attn_mask.unsqueeze(0)
            elif self.heads is not None and attn_mask.shape[0] == N * self.full_heads != N * H:
                attn_mask = attn_mask.view(N, self.full_heads, *attn_mask.shape[1:])[:, self.heads.to(attn_mask.device)]
                attn_mask = attn_mask.reshape(N * H, *attn_mask.shape[2:])
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, N, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, N, 1)])
            attn_mask, key_padding_mask = _pad(attn_mask), _pad(key_padding_mask)
        q = q.reshape(L, N * H, hd).transpose(0, 1)
        k = k.reshape(k.shape[0], N * H, hd).transpose(0, 1)
        v = v.reshape(v.shape[0], N * H, hd).transpose(0, 1)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N * H, 1, hd)], dim=1)
            v = torch.cat([v, v.new_zeros(N * H, 1, hd)], dim=1)
            attn_mask, key_padding_mask = _pad(attn_mask), _pad(key_padding_mask)
        S = k.shape[1]
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(N, 1, 1, S).expand(-1, H, -1, -1).reshape(N * H, 1, S)
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            q = q * math.sqrt(1.0 / hd)
            scores = torch.bmm(q, k.transpose(-2, -1)) if attn_mask is None else \
                torch.baddbmm(attn_mask, q, k.transpose(-2, -1))
            weights = torch.softmax(scores, dim=-1)
            if p > 0.0:
                weights = F.dropout(weights, p=p)
            out = torch.bmm(weights, v)
        else:
            if attn_mask is not None:
                attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.view(N, H, -1, S)
            out = F.scaled_dot_product_attention(q.view(N, H, L, hd), k.view(N, H, S, hd), v.view(N, H, S, hd),
                                                 attn_mask, p).view(N * H, L, hd)
        out = out.transpose(0, 1).reshape(L * N, width)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias).view(L, N, -1)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
        if weights is not None:
            weights = weights.view(N, H, L, S)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        return out, weights


def narrow_heads(m: nn.MultiheadAttention, heads: Tensor, full_heads: int) -> None:
    """Make ``m`` (a subnetwork's clone of an ``nn.MultiheadAttention`` of ``full_heads`` heads,
    its tensors sliced to ``heads``) a :class:`HeadsMultiheadAttention` of those heads."""
    m.__class__ = HeadsMultiheadAttention
    m.__dict__["num_heads"] = int(heads.numel())
    m.__dict__["heads"] = heads
    m.__dict__["full_heads"] = int(full_heads)
    m.__dict__["_qkv_same_embed_dim"] = False


class AttentionScale:
    """Forward hook making ``owner`` (an ``nn.MultiheadAttention``) return ``b + scale (y - b)``
    for its output ``y`` and ``out_proj`` bias ``b``: its heads' sum scaled, as a pre-hook scales
    other output projections' inputs. Any other module calling it (a subnetwork's clone sharing
    the hook dict) passes through."""

    def __init__(self, owner: nn.Module, scale: float):
        self.owner = owner
        self.scale = scale

    def __call__(self, module, args, output):
        if module is not self.owner or self.scale == 1.0:
            return None
        y, *rest = output
        b = module.out_proj.bias
        y = y * self.scale if b is None else b + self.scale * (y - b)
        return (y, *rest)
