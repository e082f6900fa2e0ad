"""The trainer's core attention on torch's `scaled_dot_product_attention` (trainer.attention: sdpa).

Megatron's local DotProductAttention materialises the [batch x heads, L, L] scores and probabilities and keeps both
for the backward pass: memory grows with L^2 (~0.9 GB per layer per 8k-token row of a 7B model at TP 4). SDPA picks
a fused kernel by device (FlashAttention-2 / memory-efficient on CUDA, the flash kernel on CPU) that keeps only the
output and a log-sum-exp per query: activations linear in L (Dao 2023, "FlashAttention-2"). What the fused kernels
do not take is mapped onto what they do, exactly:

- grouped-query attention: `enable_gqa` (the key/value heads are not repeated in memory; on CUDA they are);
- a value head width other than the query's (multi-latent attention): zero channels pad the narrower side (zeros
  add nothing to a dot product, and the scale is given explicitly), and the output is cut back;
- attention sinks (gpt_oss, Megatron's softmax_type "learnable" / "off-by-one": one logit per head in every
  softmax's denominator): one more key, placed first, whose score is the sink logit, with a zero value. The key
  carries sink / scale in an extra channel that every query has at 1 (so that q.k x scale = sink), and one
  placeholder query, placed first too, keeps the causal diagonal where it was;
- sliding windows (window_size (W - 1, 0)): query blocks of W positions, each against its keys (the W - 1 before
  the block and the block) under an explicit band mask: memory O(L x W);
- packed sequences (qkv_format "thd"): each sequence of the row attends on its own (cu_seqlens), so no position
  ever attends to another sequence.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def fused_attention_class(base: type) -> type:
    """`base` (Megatron's DotProductAttention or a subclass of it) with its forward on SDPA: same parameters (the
    learnable softmax offset), same inputs and output shapes, same checkpoints."""
    return type(f"SDPA{base.__name__}", (SDPAttentionMixin, base), {"__doc__": f"{base.__name__} on SDPA."})


class SDPAttentionMixin:
    """Put before a DotProductAttention subclass: replaces its forward."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        from megatron.core.transformer.utils import is_layer_window_attention

        if attention_bias is not None:
            raise NotImplementedError("SDPA core attention takes no attention bias")
        if attention_mask is not None:
            raise NotImplementedError("SDPA core attention is causal: it takes no explicit attention mask")
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:  # DotProductAttention divides here, its softmax multiplies back
            scale *= self.layer_number
        window = (self.config.window_size[0] + 1 if is_layer_window_attention(
            self.config.window_size, self.config.window_attn_skip_freq, self.layer_number) else None)
        sink = self.softmax_offset
        dropout = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, heads, d]: each sequence of the row on its own
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            if packed_seq_params.cu_seqlens_kv.tolist() != bounds:
                raise NotImplementedError("SDPA core attention packs self-attention only (cu_seqlens_kv == q)")
            pieces = [attend(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), scale=scale,
                             window=window, sink=sink, dropout=dropout) for a, b in zip(bounds, bounds[1:]) if b > a]
            if bounds[-1] != query.shape[0]:  # packing.py makes any padding a segment of its own
                raise ValueError(f"cu_seqlens end at {bounds[-1]}, the packed row has {query.shape[0]} positions")
            out = torch.cat(pieces, dim=0)
            return out.reshape(out.shape[0], -1)
        elif packed_seq_params is not None:
            raise NotImplementedError(f"SDPA core attention: qkv_format {packed_seq_params.qkv_format!r}")
        out = attend(query, key, value, scale=scale, window=window, sink=sink, dropout=dropout)
        return out.reshape(out.shape[0], out.shape[1], -1)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, window: int | None = None,
           sink: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of q [s, b, heads, d] over k [s, b, groups, d] and v [s, b, groups, dv] (heads a multiple of
    groups), each query attending to itself and the positions before it (with `window`: the window - 1 before it
    only), `sink`: [heads] logits in every softmax's denominator. Returns [s, b, heads, dv]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    if q.is_cuda and k.shape[1] != q.shape[1]:
        # CUDA's memory-efficient kernel (the fused one float32 gets; flash takes half precision only) takes no
        # grouped heads: repeated, the keys and values stay O(L)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if sink is not None:
        q, k, v = _with_sink_key(q, k, v, sink, scale)
    if window is not None and window < k.shape[2]:
        out = _banded(q, k, v, scale=scale, window=window, sink=sink is not None, dropout=dropout)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout,
                                             enable_gqa=q.shape[1] != k.shape[1])
    if sink is not None:
        out = out[:, :, 1:, :-SINK_CHANNELS]  # the placeholder query, the sink channels
    return out[..., :dv].permute(2, 0, 1, 3)


SINK_CHANNELS = 8  # the sink's channel, padded to the multiple of 8 head widths CUDA's fused kernels need


def _with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with the sink as a first key (the sink logits are per query head, so grouped key and value heads are
    repeated to the query heads here), a first placeholder query, and the sink channels: 1 then zeros in every
    query, sink / scale then zeros in the sink key, zeros in every other key."""
    b, heads, _, _ = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    channel = q.new_zeros(b, heads, q.shape[2] + 1, SINK_CHANNELS)
    channel[..., 0] = 1.0
    q = torch.cat([channel, F.pad(q, (0, 0, 1, 0))], dim=-1)  # position 0: the placeholder query (zeros + 1)
    sink_key = F.pad((sink.to(k.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, 1, 1),
                     (0, SINK_CHANNELS - 1 + k.shape[-1]))
    k = torch.cat([sink_key, F.pad(k, (SINK_CHANNELS, 0))], dim=2)
    v = F.pad(v, (0, SINK_CHANNELS, 1, 0))  # the sink's value: zeros; the sink channels' place, cut after
    return q, k, v


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int, sink: bool,
            dropout: float) -> torch.Tensor:
    """Causal sliding-window attention in query blocks of `window` positions (with `sink`: position 0 is the sink
    key and the placeholder query, which every query sees)."""
    first = 1 if sink else 0
    n = q.shape[2]
    outs = [q[:, :, :first]] if first else []  # the placeholder query's output is cut anyway
    for start in range(first, n, window):
        stop = min(start + window, n)
        lo = max(first, start - window + 1)
        keys = torch.arange(lo, stop, device=q.device)
        queries = torch.arange(start, stop, device=q.device).unsqueeze(1)
        allowed = (keys <= queries) & (keys > queries - window)
        kb, vb = k[:, :, lo:stop], v[:, :, lo:stop]
        if first:
            allowed = torch.cat([allowed.new_ones(allowed.shape[0], 1), allowed], dim=1)
            kb, vb = torch.cat([k[:, :, :1], kb], dim=2), torch.cat([v[:, :, :1], vb], dim=2)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], kb, vb, attn_mask=allowed, scale=scale,
                                                   dropout_p=dropout, enable_gqa=q.shape[1] != kb.shape[1]))
    return torch.cat(outs, dim=2)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                        window: int | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention written out (the full score matrix): what the tests compare `attend` with."""
    q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s)
    allowed = (j <= i) & ((j > i - window) if window else True)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sink is not None:
        scores = torch.cat([sink.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1), scores], dim=-1)
        probs = scores.softmax(-1)[..., 1:]
    else:
        probs = scores.softmax(-1)
    return (probs @ v).permute(2, 0, 1, 3)
